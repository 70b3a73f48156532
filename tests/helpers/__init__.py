"""What the tests share, one concern per module (tests import them as ``tests.helpers.NAME``).

- :mod:`~tests.helpers.waits`: bounded waits (``wait_for``, ``stop_process``).
- :mod:`~tests.helpers.agents`: agents and the CLI run as real processes, the datasets they cache.
- :mod:`~tests.helpers.streaming`: consumer processes (tests/consumer.py) and reference samples.
- :mod:`~tests.helpers.workers`: a request sent straight to an agent's worker, as the loader sends it.
- :mod:`~tests.helpers.procs`: looking at processes through /proc.
- :mod:`~tests.helpers.disks`, :mod:`~tests.helpers.net`: a full file system, free loopback ports.
- :mod:`~tests.helpers.testdata`: the real-world shards of webdataset's own test data.

The shard server, the shard maker and the S3 proxy (in front of moto's server: it logs
requests, injects faults, caps rates) are shared with the benchmark and demo scripts, so they
live in scripts/ (:mod:`scripts.shard_server`, :mod:`scripts.shard_maker`,
:mod:`scripts.s3_proxy`), which tests import and scripts never import from tests/.
"""
