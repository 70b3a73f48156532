"""Real-world shards: webdataset's own test data, where the machine has it (tests using it skip otherwise)."""

from __future__ import annotations

from pathlib import Path

TESTDATA = Path(__file__).resolve().parents[3] / "shared/testdata/webdataset"
REAL_SHARDS = ["compressed.tar", "mpdata.tar", "sample.tgz", "tendata.tar", "testgz.tar"]
