"""The test suite (``pytest`` from the repository root runs it; tests/soak/ is left to scripts/soak.sh).

A package, so pytest imports its modules as ``tests.*`` with the repository root
on ``sys.path``: test modules import their shared helpers from
:mod:`tests.helpers` and the shard server and shard maker from :mod:`scripts`,
never from each other or from ``conftest``.
"""
