"""Benchmark, demo and maintenance scripts, each run by its path (``python scripts/bench.py``).

A package only so that the test suite can import the two modules it shares
with the scripts: :mod:`scripts.shard_server` (the loopback HTTP server that
stands in for an object store) and :mod:`scripts.shard_maker` (deterministic
synthetic shards). They live here, not in tests/, because scripts never import
from tests/; a script imports them as its siblings (``from shard_server import
ShardServer``), as its own folder is first on ``sys.path``.
"""
