"""A cache whose file system turns read-only under a running agent (ext4's errors=remount-ro
after a real error), and the commands that read it afterwards.

A real ext4 on a loop device, made to fail by the kernel's own ``trigger_fs_error``: since
Linux 6.x ext4 then refuses every write with EROFS while its mount still says ``rw``. The
agent, consumers and commands are real processes.
"""

from __future__ import annotations

import json
import subprocess
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest

from tests.helpers.waits import wait_for


def _run(*cmd: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(cmd, capture_output=True, text=True, timeout=30)


@pytest.fixture
def ext4(tmp_path: Path) -> Iterator[tuple[Path, Callable[[], None]]]:
    """A fresh ext4 mounted (loop, errors=remount-ro) at ``tmp_path/ext4``, and the function that
    makes it fail as a disk error would; unmounted at teardown. Skips where it cannot be made."""
    image, mnt = tmp_path / "ext4.img", tmp_path / "ext4"
    mnt.mkdir()
    with open(image, "wb") as f:
        f.truncate(64 << 20)
    r = _run("mkfs.ext4", "-q", "-F", str(image))
    if r.returncode != 0:
        pytest.skip(f"cannot make an ext4 file system: {r.stderr.strip()}")
    r = _run("mount", "-o", "loop,errors=remount-ro", str(image), str(mnt))
    if r.returncode != 0:
        pytest.skip(f"cannot mount a loop device: {r.stderr.strip()}")
    try:
        mnt.chmod(0o700)
        device = Path(_run("findmnt", "-no", "SOURCE", str(mnt)).stdout.strip()).name
        trigger = Path("/sys/fs/ext4") / device / "trigger_fs_error"
        if not trigger.exists():
            pytest.skip(f"{trigger} is not there: this kernel cannot make ext4 fail on demand")

        def fail() -> None:
            trigger.write_text("1\n")

        yield mnt, fail
    finally:
        if _run("umount", str(mnt)).returncode != 0:
            _run("umount", "-l", str(mnt))


@pytest.mark.slow
def test_a_file_system_that_turns_read_only_stops_the_agent_naming_it_and_is_read_after(
    ext4, dataset, start_agent, consumers, run_cli
):
    mnt, fail = ext4
    cache = mnt / "cache"
    data = dataset(12, samples=4, payload=2000)
    agent = start_agent(cache, data.list_file, "--cache-size", "20M", "--prefetch", "2")
    reader = consumers(cache, "reader", "--urls", str(data.list_file), "--no-shuffle", "--sleep", "0.05")
    agent.wait_stats(lambda s: s["shards"]["cached"] >= 2, 20, "two shards cached")
    fail()

    # The reader's downloads and reads need the index written: the agent finds it cannot, says
    # why in its last line, and exits 1, with no traceback and no talk of freeing space.
    wait_for(lambda: not agent.running(), 20, lambda: f"the agent still runs:\n{agent.stderr_tail()}")
    reader.kill()
    log = agent.stderr_text()
    assert agent.proc.returncode == 1, log
    last = log.splitlines()[-1]
    assert last.startswith(f"wdscache: error: the file system of {cache} became read-only ("), log
    assert last.endswith(
        "the agent stops, as it can record nothing more; the cached shards stay: start it again "
        "once the file system is writable"
    ), log
    for word in ("Traceback", "CRITICAL", "freeing space"):
        assert word not in log, log

    # What it cached is read, not called damaged.
    r = run_cli("stats", "--cache-dir", cache, "--json")
    assert r.returncode == 0, r.stderr
    stats = json.loads(r.stdout)
    assert stats["shards"]["cached"] >= 2 and stats["agent"] is None, stats
    r = run_cli("ls", "--cache-dir", cache, "--json")
    assert r.returncode == 0, r.stderr
    assert sum(s["state"] == "cached" for s in json.loads(r.stdout)) == stats["shards"]["cached"]
    r = run_cli("stats", "--cache-dir", cache)
    assert r.returncode == 0 and "damaged" not in r.stdout + r.stderr, r.stderr

    # A new agent is refused in one line that says why.
    r = run_cli("agent", "--cache-dir", cache, "--urls", data.list_file, "--min-free", "1M")
    assert (r.returncode, r.stderr) == (
        2,
        f"wdscache: error: cache directory {cache} is on a file system that turned read-only (it refuses "
        "writes): the agent needs to write to it; make it writable or use another --cache-dir\n",
    )
