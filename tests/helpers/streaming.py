"""Consumers as real processes (tests/consumer.py), and the reference samples they are checked against."""

from __future__ import annotations

import hashlib
import json
import signal
import subprocess
import sys
from collections import Counter
from pathlib import Path
from typing import Any

import pytest
import webdataset as wds

from tests.helpers.waits import stop_process

CONSUMER = Path(__file__).resolve().parents[1] / "consumer.py"  # run by its path, as a training script is
DEADLINE = 90.0


def reference(paths: list[Path], urls: list[str]) -> dict[tuple[str, str], dict[str, str]]:
    """(url, key) -> {ext: sha256} as webdataset's reader yields them."""
    out = {}
    for path, url in zip(paths, urls):
        for sample in wds.WebDataset(str(path), shardshuffle=False):
            fields = {k: hashlib.sha256(v).hexdigest() for k, v in sample.items() if not k.startswith("__")}
            out[(url, sample["__key__"])] = fields
    return out


class Consumer:
    def __init__(self, tmp: Path, cache_dir: Path, name: str, *args: str) -> None:
        self.out = tmp / f"{name}.jsonl"
        self.log = tmp / f"{name}.log"
        with open(self.log, "wb") as log:
            self.proc = subprocess.Popen(
                [sys.executable, str(CONSUMER), "--cache-dir", str(cache_dir), "--out", str(self.out), *args],
                stdout=log,
                stderr=subprocess.STDOUT,
                stdin=subprocess.DEVNULL,
            )

    def wait(self, timeout: float = DEADLINE) -> list[dict[str, Any]]:
        try:
            rc = self.proc.wait(timeout)
        except subprocess.TimeoutExpired:
            stop_process(self.proc, signal.SIGKILL, 5)
            pytest.fail(f"consumer did not finish in {timeout}s\n{self.log.read_text()[-3000:]}", pytrace=False)
        assert rc == 0, f"consumer exited {rc}\n{self.log.read_text()[-3000:]}"
        return [json.loads(line) for line in self.out.read_text().splitlines()]

    def kill(self) -> None:
        stop_process(self.proc, signal.SIGKILL, 5)


def fields_of(sample: dict[str, Any]) -> dict[str, str]:
    return {k: hashlib.sha256(v).hexdigest() for k, v in sample.items() if not k.startswith("__")}


def delivered(samples: list[dict[str, Any]]) -> dict[tuple[str, str], dict[str, str]]:
    """(url, key) -> fields of in-process loader samples; fails on a duplicate."""
    out: dict[tuple[str, str], dict[str, str]] = {}
    for s in samples:
        uk = (s["__url__"], s["__key__"])
        assert uk not in out, f"sample {uk} delivered twice"
        out[uk] = fields_of(s)
    return out


def samples_of(lines: list[dict[str, Any]]) -> list[dict[str, Any]]:
    return [line for line in lines if "key" in line]


def state_of(lines: list[dict[str, Any]]) -> dict[str, Any]:
    return lines[-1]["state"]


# -- what an epoch delivered, and consumers that end -------------------------------------


def exactly_once(lines: list[dict[str, Any]], ref: dict) -> Counter:
    """(url, key) counts of consumer output lines, checked byte for byte against ``ref``."""
    got = Counter()
    for s in samples_of(lines):
        uk = (s["url"], s["key"])
        assert uk in ref, f"unknown sample {uk}"
        assert s["fields"] == ref[uk], f"sample {uk} differs from webdataset's"
        got[uk] += 1
    return got


def assert_epoch_exact(lines: list[dict[str, Any]], ref: dict) -> None:
    got = exactly_once(lines, ref)
    dups = sorted(uk for uk, n in got.items() if n > 1)
    missing = sorted(set(ref) - set(got))
    assert not dups and not missing, f"{len(dups)} duplicated, {len(missing)} missing: {dups[:3]} {missing[:3]}"


def consumer_log(c: Consumer) -> str:
    return f"--- consumer log ---\n{c.log.read_text(errors='replace')[-3000:]}"


def wait_exit(proc: subprocess.Popen, timeout: float, what: str) -> int:
    try:
        return proc.wait(timeout)
    except subprocess.TimeoutExpired:
        stop_process(proc, signal.SIGKILL, 5)
        pytest.fail(f"{what} did not exit within {timeout:g}s", pytrace=False)
