"""The agent refuses a cache directory another user could tamper with, and a loader writes nothing into one."""

from __future__ import annotations

import os

import pytest

from wdscache import CachedMultiLoader, ConfigError

NOBODY = 65534


@pytest.mark.skipif(os.getuid() != 0, reason="needs root to give a directory to another user")
def test_cache_dir_owned_by_another_user_is_refused(tmp_path, dataset, run_cli):
    data = dataset(1, samples=1, payload=100)
    cache = tmp_path / "theirs"
    cache.mkdir(mode=0o700)
    os.chown(cache, NOBODY, NOBODY)
    r = run_cli("agent", "--cache-dir", cache, "--urls", data.list_file, "--min-free", "1M")
    assert r.returncode == 2
    assert f"belongs to uid {NOBODY}" in r.stderr
    assert os.listdir(cache) == []  # nothing was created in it


def test_private_agent_writes_nothing_into_a_directory_others_can_write(tmp_path, dataset):
    data = dataset(1, samples=1, payload=100)
    shared = tmp_path / "shared"
    shared.mkdir()
    shared.chmod(0o777)
    # A planted link where the loader would write its list must not be followed.
    victim = tmp_path / "victim.txt"
    victim.write_text("keep me\n")
    (shared / "private-urls.txt").symlink_to(victim)
    with pytest.raises(ConfigError, match="chmod 700"):
        iter(CachedMultiLoader(data.urls, cache_dir=shared, rank=0, world_size=1, timeout=5))
    assert victim.read_text() == "keep me\n"
