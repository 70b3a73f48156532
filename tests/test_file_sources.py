"""A local shard changed while the agent copies it: rewritten in place at the same size (its mtime
changed, or put back to the old one so that only its ctime tells) or replaced by ``cp`` (truncated,
then written). The copy starts over from byte 0, as a download whose server changed the object does:
the cache holds the new version whole, never two versions spliced, and a consumer reads exactly
its samples.

The agent runs a few milliseconds at a time (SIGCONT, then SIGSTOP) until its partial file holds
some of the shard's bytes, not all; the test changes the source while the agent is stopped there,
so the change always lands mid-copy, whatever the machine's speed."""

from __future__ import annotations

import hashlib
import os
import shutil
import signal
import subprocess
import time
from pathlib import Path

import pytest

from scripts.shard_maker import make_shard, synth_samples, write_url_list
from tests.helpers.agents import AgentProc
from tests.helpers.streaming import assert_epoch_exact, reference
from tests.helpers.waits import wait_for
from wdscache.shared.layout import CacheLayout

SAMPLES, PAYLOAD = 24, 2 << 20  # a 48 MB shard: a slice of the agent's time copies a few MB of it
# Seconds the agent runs between two looks at its partial file: before its download begins, and
# then (a slice of that copies at most a few MB of the shard, even at 2 GB/s).
SLICE, COPY_SLICE = 0.02, 0.002
DEADLINE = 60.0


def versions(folder: Path, samples_v2: int) -> tuple[Path, Path, Path]:
    """The source (version 1 now), and both versions' files beside it. Version 2's first
    ``samples_v2`` samples are version 1's with other bytes: with as many, it is as long."""
    folder.mkdir()
    samples = synth_samples(0, SAMPLES, payload=PAYLOAD)
    v1 = make_shard(folder / "v1.tar", samples)
    v2 = make_shard(folder / "v2.tar", [{**s, "jpg": s["jpg"][::-1]} for s in samples[:samples_v2]])
    src = folder / "shard.tar"
    shutil.copyfile(v1, src)
    return src, v1, v2


def digest(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


def all_stopped(pid: int) -> bool:
    """Whether every thread of ``pid`` is stopped (its state T)."""
    for tid in os.listdir(f"/proc/{pid}/task"):
        try:
            stat = Path(f"/proc/{pid}/task/{tid}/stat").read_text()
        except FileNotFoundError:  # a thread that ended
            continue
        if stat[stat.rindex(")") + 2] not in "Tt":
            return False
    return True


def stop(agent: AgentProc) -> None:
    agent.proc.send_signal(signal.SIGSTOP)
    wait_for(lambda: all_stopped(agent.pid), 10, lambda: f"the agent did not stop\n{agent.stderr_tail()}", interval=0)


def stop_mid_copy(agent: AgentProc, partial: Path, total: int) -> int:
    """Run the stopped ``agent`` a slice at a time until its ``partial`` file holds some of the
    shard's ``total`` bytes, not all; returns that size, the agent stopped."""
    deadline = time.monotonic() + DEADLINE
    while True:
        size = partial.stat().st_size if partial.exists() else 0
        if size:
            assert size < total, f"the agent copied all {total} bytes within one slice of {COPY_SLICE}s"
            return size
        assert agent.proc.poll() is None, f"the agent exited with {agent.proc.returncode}\n{agent.stderr_tail()}"
        assert time.monotonic() < deadline, f"the agent never began copying the shard\n{agent.stderr_tail()}"
        began = "downloads: downloading " in agent.stderr_text()
        agent.proc.send_signal(signal.SIGCONT)
        time.sleep(COPY_SLICE if began else SLICE)
        stop(agent)


def in_place(src: Path, v2: Path) -> None:
    with open(src, "r+b") as f:
        f.write(v2.read_bytes())


def in_place_mtime_kept(src: Path, v2: Path) -> None:
    # As a copy that keeps times may leave it (cp -p, rsync --times): only the ctime tells.
    before = src.stat()
    in_place(src, v2)
    os.utime(src, ns=(before.st_atime_ns, before.st_mtime_ns))


def cp_over(src: Path, v2: Path) -> None:
    subprocess.run(["cp", str(v2), str(src)], check=True, timeout=30)


@pytest.mark.parametrize(
    ("change", "samples_v2"),
    [
        pytest.param(in_place, SAMPLES, id="rewritten-in-place"),
        pytest.param(in_place_mtime_kept, SAMPLES, id="rewritten-in-place-mtime-kept", marks=pytest.mark.slow),
        pytest.param(cp_over, SAMPLES - 4, id="cp-of-another-size", marks=pytest.mark.slow),
    ],
)
def test_a_local_shard_changed_while_it_is_copied_is_copied_again_whole(
    change, samples_v2, start_agent, consumers, tmp_path
):
    src, v1, v2 = versions(tmp_path / "data", samples_v2)
    url = "file://" + str(src)
    cache = tmp_path / "cache"
    urls = write_url_list(tmp_path / "urls.txt", [url])
    agent = start_agent(cache, urls, "--cache-size", "400M", wait=False)
    try:
        stop(agent)
        at = stop_mid_copy(agent, CacheLayout.of(cache).partial_path(url), v1.stat().st_size)
        change(src, v2)
        assert digest(src) == digest(v2)
    finally:
        agent.proc.send_signal(signal.SIGCONT)
    shard = CacheLayout.of(cache).shard_path(url)
    wait_for(
        lambda: shard.exists() or "downloads: failed " in agent.stderr_text(),
        DEADLINE,
        lambda: f"the shard neither cached nor failed\n{agent.stderr_tail()}",
    )
    assert shard.exists(), f"the shard failed\n{agent.stderr_tail()}"
    cached = digest(shard)
    assert cached == digest(v2), (
        f"the cached shard is not the new version (changed at byte {at}; version 1: {cached == digest(v1)})"
        f"\n{agent.stderr_tail()}"
    )
    assert "changed while it was copied" in agent.stderr_text(), agent.stderr_tail()
    c = consumers(cache, "consumer", "--no-shuffle")
    lines = c.wait()
    assert_epoch_exact(lines, reference([v2], [url]))
