"""wdscache's errors keep their class and message across processes (wdscache.shared.errors,
"what survives"): through pickle, and through torch's DataLoader, which re-raises a
worker's exception as ``exc_type(message)``."""

from __future__ import annotations

import inspect
import json
import pickle
import subprocess
import sys
from pathlib import Path

import pytest

import wdscache
from wdscache.agent.shard_download import BadShard, DiskFull
from wdscache.shared import errors
from wdscache.shared.index import IndexReadError, IndexWriteError

ROOT = Path(__file__).resolve().parents[1]

# One of each class, made as the code makes it.
EXAMPLES: list[errors.WdsCacheError] = [
    errors.WdsCacheError("something went wrong"),
    errors.ConfigError("--prefetch must be at least 0"),
    errors.UrlListError("urls.txt", 3, "ftp://h/a.tar", "unknown scheme 'ftp'"),
    errors.ShardIndexError("index.json", 2, 'no "url"', url="http://h/a.tar"),
    errors.ShardIndexError("index.json", None, "not valid JSON"),
    errors.FetchError("http://h/a.tar", "HTTP 404 Not Found", status=404, permanent=True),
    DiskFull("http://h/a.tar", "no space left on the cache's file system"),
    BadShard("http://h/a.tar", "4 samples, but the shard index says 5", permanent=True),
    errors.ShardError("http://h/a.tar", "bad tar header checksum", offset=1024),
    errors.AgentRunningError("/cache", 1234),
    errors.AgentUnavailableError("ipc:///tmp/x", 2.5, "start one with 'wdscache agent ...'"),
    errors.ProtocolError("a reply without an id"),
    errors.NotTrustedError("the agent cannot prove it holds the token"),
    errors.NoCacheError(cache_dir="/cache"),
    IndexWriteError("cannot write the index: disk full"),
    IndexReadError("cannot read the index in /cache/index (file is not a database): it is damaged"),
]


def _all_classes(cls: type) -> set[type]:
    return {cls}.union(*(_all_classes(sub) for sub in cls.__subclasses__()))


def test_the_examples_cover_every_error_class() -> None:
    exported = {getattr(wdscache, name) for name in wdscache.__all__}
    classes = _all_classes(errors.WdsCacheError)
    assert {c for c in exported if isinstance(c, type) and issubclass(c, BaseException)} <= classes
    assert {type(e) for e in EXAMPLES} == classes


@pytest.mark.parametrize("exc", EXAMPLES, ids=lambda e: f"{type(e).__name__}")
def test_an_error_survives_pickle_with_its_class_message_and_context(exc: errors.WdsCacheError) -> None:
    back = pickle.loads(pickle.dumps(exc))
    assert type(back) is type(exc)
    assert str(back) == str(exc)
    assert back.__dict__ == exc.__dict__


@pytest.mark.parametrize("exc", EXAMPLES, ids=lambda e: f"{type(e).__name__}")
def test_an_error_is_made_from_its_message_alone(exc: errors.WdsCacheError) -> None:
    message = f"Caught {type(exc).__name__} in DataLoader worker process 0.\nOriginal Traceback: ..."
    alone = type(exc)(message)
    assert str(alone) == message
    assert set(alone.__dict__) == set(exc.__dict__)  # every context attribute...
    params = inspect.signature(type(exc).__init__).parameters
    assert alone.__dict__ == {
        k: None if params[k].default is params[k].empty else params[k].default for k in alone.__dict__
    }  # ...set to its default, None without one
    back = pickle.loads(pickle.dumps(alone))
    assert type(back) is type(exc) and str(back) == message


_CHILD = """
import json, sys
import torch.utils.data
import wdscache

cache, endpoint = sys.argv[1], sys.argv[2]
loader = wdscache.CachedMultiLoader(["http://127.0.0.1:9/a.tar"], cache_dir=cache, endpoint=endpoint, timeout=1.0)
try:
    for _ in torch.utils.data.DataLoader(loader, batch_size=None, num_workers=1, timeout=30):
        pass
except wdscache.AgentUnavailableError as exc:
    print(json.dumps({"type": type(exc).__name__, "message": str(exc), "endpoint": exc.endpoint}))
"""


@pytest.mark.slow
def test_a_dataloader_worker_error_is_caught_by_its_wdscache_class(tmp_path: Path) -> None:
    pytest.importorskip("torch", reason="torch is not installed (scripts/test.sh installs it)")
    cache = tmp_path / "cache"  # no agent: the worker waits 1 s for its token and gives up
    cache.mkdir(mode=0o700)
    endpoint = f"ipc://{tmp_path}/agent.sock"
    # A child process: a loader is a torch dataset only where torch was imported, and this one is not to be.
    r = subprocess.run(
        [sys.executable, "-c", _CHILD, str(cache), endpoint], cwd=ROOT, capture_output=True, text=True, timeout=60
    )
    assert r.returncode == 0 and r.stdout.strip(), r.stderr[-3000:]
    got = json.loads(r.stdout.strip().splitlines()[-1])
    assert got["type"] == "AgentUnavailableError"
    assert got["message"].startswith("Caught AgentUnavailableError in DataLoader worker process 0.")
    assert f"no wdscache agent answered at {endpoint}" in got["message"], got["message"]
    assert got["endpoint"] is None  # the context is in the message: torch passes nothing else


def test_a_client_given_no_cache_dir_and_no_endpoint_is_a_config_error_saying_what_to_give() -> None:
    with pytest.raises(errors.ConfigError, match=r"give cache_dir \(or endpoint\) to find the agent"):
        wdscache.ShardClient()
