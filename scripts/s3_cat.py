"""Stream one S3 object to stdout: ``python scripts/s3_cat.py s3://bucket/key``.

What webdataset's docs have a ``pipe:`` URL run for S3 (there, ``aws s3 cp s3://... -``), made
with boto3 so the benchmark needs no AWS CLI: the same credential chain and ``AWS_ENDPOINT_URL``.
"""

from __future__ import annotations

import shutil
import sys

import boto3


def main() -> None:
    bucket, _, key = sys.argv[1].removeprefix("s3://").partition("/")
    body = boto3.client("s3").get_object(Bucket=bucket, Key=key)["Body"]
    shutil.copyfileobj(body, sys.stdout.buffer, 1 << 20)


if __name__ == "__main__":
    main()
