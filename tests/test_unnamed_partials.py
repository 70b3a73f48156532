"""Partial downloads kept across a restart whichever list named them, and removed once no list
names them for ``UNNAMED_GRACE``: a real cache (index and files) on disk, opened again as a new run
opens it, the clock given by the test."""

from __future__ import annotations

from pathlib import Path

from wdscache.agent.cache import ShardCache
from wdscache.agent.unnamed_partials import CHECK_EVERY, UNNAMED_GRACE, UnnamedPartials
from wdscache.shared.index import ShardRecord, ShardState
from wdscache.shared.layout import CacheLayout

JOBS = "http://127.0.0.1:9/jobs-own.tar"  # named by a job's own list only (gone with the agent)
NO_VALIDATOR = "http://127.0.0.1:9/no-validator.tar"


def killed_mid_download(root: Path, urls: dict[str, str | None]) -> CacheLayout:
    """A cache left by an agent killed while downloading each of ``urls`` (url -> its validator):
    a DOWNLOADING record, then 1000 bytes of partial file, as a download writes them."""
    layout = CacheLayout.of(root)
    layout.prepare()
    cache = ShardCache(layout, limit=1 << 20, min_free=0)
    try:
        for url, etag in urls.items():
            cache.index.put(ShardRecord(url, ShardState.DOWNLOADING, size=4000, etag=etag))
            layout.partial_path(url).write_bytes(b"x" * 1000)
    finally:
        cache.close()
    return layout


def test_a_restart_keeps_a_partial_no_list_of_its_own_names_if_it_has_a_validator(tmp_path: Path) -> None:
    layout = killed_mid_download(tmp_path / "cache", {JOBS: '"v1"', NO_VALIDATOR: None})
    cache = ShardCache(layout, limit=1 << 20, min_free=0)
    try:
        done = cache.recover()
        assert cache.kept == {JOBS: 1000} and cache.kept_bytes == 1000, done  # counted against the budget
        assert layout.partial_path(JOBS).exists() and not layout.partial_path(NO_VALIDATOR).exists()
        rec = cache.index.get(JOBS)
        assert rec is not None and rec.state is ShardState.DOWNLOADING and rec.etag == '"v1"'  # what a resume checks
        assert cache.index.get(NO_VALIDATOR) is None
    finally:
        cache.close()


def test_a_kept_partial_no_list_names_for_the_grace_is_removed_record_and_file(tmp_path: Path) -> None:
    named_again = "http://127.0.0.1:9/named-again.tar"
    layout = killed_mid_download(tmp_path / "cache", {JOBS: '"v1"', named_again: '"v2"'})
    cache = ShardCache(layout, limit=1 << 20, min_free=0)
    try:
        cache.recover()
        names: set[str] = set()
        unnamed = UnnamedPartials(cache, names.__contains__, now=0.0)
        t = CHECK_EVERY  # (looks come at least CHECK_EVERY apart)
        assert unnamed.check(t) == []  # first seen unnamed: their clocks start
        names.add(named_again)  # a job comes back and names its shard again
        assert unnamed.check(t + UNNAMED_GRACE / 2) == []
        names.discard(named_again)  # that job ends: its partial's clock starts over
        again = t + UNNAMED_GRACE - CHECK_EVERY
        assert unnamed.check(again) == []
        assert unnamed.check(t + UNNAMED_GRACE) == [JOBS]
        assert cache.index.get(JOBS) is None and not layout.partial_path(JOBS).exists()
        assert cache.kept == {named_again: 1000}
        assert unnamed.check(again + UNNAMED_GRACE - CHECK_EVERY) == []
        assert unnamed.check(again + UNNAMED_GRACE) == [named_again]
        assert cache.kept == {} and cache.index.get(named_again) is None and not any(layout.partial_dir.iterdir())
    finally:
        cache.close()
