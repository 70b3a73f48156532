"""Real-world shards: webdataset's own test data, where the machine has it (tests using it skip otherwise).

The project ships only files it made itself: these shards stay outside the clone, in
``../shared/testdata/webdataset`` beside it. ``tests/README.md`` says where they come from and how
to put them there; :data:`NEEDS_TESTDATA` is the mark of a test that reads them.
"""

from __future__ import annotations

from pathlib import Path

import pytest

TESTDATA = Path(__file__).resolve().parents[3] / "shared/testdata/webdataset"
REAL_SHARDS = ["compressed.tar", "mpdata.tar", "sample.tgz", "tendata.tar", "testgz.tar"]
ABSENT = (
    f"needs webdataset's own test shards in {TESTDATA} (absent): copy {', '.join(REAL_SHARDS)} from the "
    "testdata/ folder of github.com/webdataset/webdataset there (tests/README.md)"
)
NEEDS_TESTDATA = pytest.mark.skipif(not TESTDATA.is_dir(), reason=ABSENT)
