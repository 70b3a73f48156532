"""Deterministic synthetic WebDataset shards for tests and benchmarks.

Shards are byte-for-byte reproducible: same inputs, same file.  Two writers
are offered because real datasets come from both: Python's :mod:`tarfile`
and GNU ``tar``, whose headers differ in small ways a reader must tolerate.
:func:`read_samples_reference` is an independent reader that applies
WebDataset's grouping rules, to compare against what wdscache delivers.

It lives in scripts/ because the benchmark and demo scripts make their data
with it too: tests import it as ``scripts.shard_maker``, scripts as their
sibling ``shard_maker``, and nothing here imports from tests/.
"""

from __future__ import annotations

import functools
import gzip as gzip_module
import io
import json
import os
import random
import re
import shutil
import subprocess
import tarfile
import tempfile
from collections.abc import Iterable, Sequence
from pathlib import Path
from typing import Any, BinaryIO, Literal

__all__ = [
    "find_gnu_tar",
    "make_dataset",
    "make_shard",
    "read_samples_reference",
    "synth_samples",
    "write_url_list",
]

Sample = dict[str, Any]  # "__key__" -> str, extension -> bytes
Tool = Literal["tarfile", "gnutar"]

# WebDataset skips members whose name starts with a "__...__" component.
_META_RE = re.compile(r"__[^/]*__($|/)")


@functools.lru_cache(maxsize=1)
def find_gnu_tar() -> str | None:
    """Path of a GNU tar executable (``tar`` or ``gtar``), or None if there is none."""
    for candidate in ("tar", "gtar"):
        exe = shutil.which(candidate)
        if exe is None:
            continue
        try:
            out = subprocess.run([exe, "--version"], capture_output=True, text=True, timeout=10, check=False).stdout
        except (OSError, subprocess.SubprocessError):
            continue
        if "GNU tar" in out:
            return exe
    return None


def _members(samples: Iterable[Sample]) -> list[tuple[str, bytes]]:
    """Member names and data in archive order; validates what would not round-trip."""
    members: list[tuple[str, bytes]] = []
    seen: set[str] = set()
    for sample in samples:
        key = sample.get("__key__")
        if not isinstance(key, str) or not key:
            raise ValueError(f"sample without a usable __key__: {sorted(sample)!r}")
        base = key.rsplit("/", 1)[-1]
        # A dot in the basename would move the key/extension split on reading.
        if not base or "." in base or key.startswith("/") or ".." in key.split("/"):
            raise ValueError(f"key {key!r} would not survive a round trip through a shard")
        for ext in sorted(sample):
            if ext.startswith("__") and ext.endswith("__"):
                continue  # metadata such as __key__ or __url__, not a member
            value = sample[ext]
            if not isinstance(value, (bytes, bytearray, memoryview)):
                raise TypeError(f"{key}.{ext}: payload must be bytes, not {type(value).__name__}")
            if not ext or "/" in ext:
                raise ValueError(f"{key}: bad extension {ext!r}")
            name = f"{key}.{ext}"
            if name in seen:
                raise ValueError(f"duplicate member {name!r}")
            seen.add(name)
            members.append((name, bytes(value)))
    return members


def _write_with_tarfile(out: BinaryIO, members: Sequence[tuple[str, bytes]]) -> None:
    # PAX, not GNU: with GNU format the result is byte-identical to GNU tar's,
    # and the two tools are meant to give readers two header dialects.
    with tarfile.open(fileobj=out, mode="w", format=tarfile.PAX_FORMAT) as tf:
        for name, data in members:
            info = tarfile.TarInfo(name)
            info.size = len(data)
            info.mtime = 0
            info.mode = 0o644
            info.uid = info.gid = 0
            info.uname = info.gname = ""
            info.type = tarfile.REGTYPE
            tf.addfile(info, io.BytesIO(data))


def _write_with_gnutar(dest: Path, members: Sequence[tuple[str, bytes]]) -> None:
    exe = find_gnu_tar()
    if exe is None:
        raise RuntimeError("GNU tar is not installed; use tool='tarfile'")
    with tempfile.TemporaryDirectory(prefix="wdscache-shard-") as tmp:
        src = Path(tmp, "members")
        src.mkdir()
        for name, data in members:
            member = src / name
            member.parent.mkdir(parents=True, exist_ok=True)
            member.write_bytes(data)
        # An explicit NUL-separated list fixes the member order (tar would
        # otherwise follow directory order) and survives any character in a name.
        file_list = Path(tmp, "members.list")
        file_list.write_bytes(b"".join(os.fsencode(name) + b"\0" for name, _ in members))
        cmd = [
            exe,
            "--create",
            "--file",
            str(dest),
            "--format=gnu",
            "--sort=none",
            "--no-recursion",
            "--mtime=@0",
            "--owner=0",
            "--group=0",
            "--numeric-owner",
            "--mode=0644",
            "-C",
            str(src),
            "--null",
            "--verbatim-files-from",
            "-T",
            str(file_list),
        ]
        # C locale so tar's messages and behaviour do not depend on the host.
        env = dict(os.environ, LC_ALL="C")
        proc = subprocess.run(cmd, capture_output=True, env=env, timeout=300, check=False)
        if proc.returncode != 0:
            raise RuntimeError(f"tar failed ({proc.returncode}): {proc.stderr.decode(errors='replace').strip()}")


def _gzip_file(src: Path, dest: Path) -> None:
    # mtime=0 and no embedded file name keep the .gz byte-for-byte reproducible.
    with open(src, "rb") as fin, open(dest, "wb") as raw:
        with gzip_module.GzipFile(filename="", mode="wb", fileobj=raw, mtime=0, compresslevel=6) as gz:
            shutil.copyfileobj(fin, gz, 1 << 20)


def make_shard(
    path: str | os.PathLike[str],
    samples: Iterable[Sample],
    *,
    tool: Tool = "tarfile",
    gzip: bool = False,
) -> Path:
    """Write ``samples`` to a tar shard at ``path`` and return the path.

    Members are ``{key}.{ext}``: samples in the given order, extensions sorted.
    ``tool`` is ``"tarfile"`` (Python, POSIX/PAX headers) or ``"gnutar"``
    (the ``tar`` binary, GNU headers);
    ``gzip=True`` compresses the archive.  Keys ``__like_this__`` in a sample
    are ignored.  The file appears atomically (written aside, then renamed).
    """
    if tool not in ("tarfile", "gnutar"):
        raise ValueError(f"tool must be 'tarfile' or 'gnutar', not {tool!r}")
    dest = Path(path)
    dest.parent.mkdir(parents=True, exist_ok=True)
    members = _members(samples)
    with tempfile.TemporaryDirectory(prefix=".shard-", dir=dest.parent) as tmp:
        plain = Path(tmp, "plain.tar")
        if tool == "tarfile":
            with open(plain, "wb") as out:
                _write_with_tarfile(out, members)
        else:
            _write_with_gnutar(plain, members)
        final = plain
        if gzip:
            final = Path(tmp, "packed.tar.gz")
            _gzip_file(plain, final)
        os.replace(final, dest)
    return dest


def synth_samples(shard_index: int, n: int, *, payload: int = 1000, seed: int = 0) -> list[Sample]:
    """``n`` deterministic samples for shard ``shard_index``.

    Keys are ``s{shard:05d}_{i:05d}``; each sample has ``jpg`` (random bytes,
    ``payload`` +/- 10 %), ``cls`` (an ASCII integer) and ``json`` (a small object).
    """
    samples: list[Sample] = []
    spread = payload // 10
    for i in range(n):
        # A string seed: tuples are not accepted by random.Random on 3.11+.
        rng = random.Random(f"wdscache:{seed}:{shard_index}:{i}")
        size = max(0, payload + rng.randint(-spread, spread))
        label = rng.randrange(1000)
        meta = {"index": i, "label": label, "seed": seed, "shard": shard_index}
        samples.append(
            {
                "__key__": f"s{shard_index:05d}_{i:05d}",
                "cls": str(label).encode("ascii"),
                "jpg": rng.randbytes(size),
                "json": json.dumps(meta, sort_keys=True, separators=(",", ":")).encode(),
            }
        )
    return samples


def make_dataset(
    root: str | os.PathLike[str],
    n_shards: int,
    samples_per_shard: int,
    *,
    payload: int = 1000,
    tool: Tool = "tarfile",
    gzip: bool = False,
    prefix: str = "shard",
    seed: int = 0,
) -> list[Path]:
    """Write ``{prefix}-{i:06d}.tar`` (or ``.tar.gz``) shards under ``root``; return their paths."""
    root_path = Path(root)
    root_path.mkdir(parents=True, exist_ok=True)
    suffix = ".tar.gz" if gzip else ".tar"
    return [
        make_shard(
            root_path / f"{prefix}-{i:06d}{suffix}",
            synth_samples(i, samples_per_shard, payload=payload, seed=seed),
            tool=tool,
            gzip=gzip,
        )
        for i in range(n_shards)
    ]


def write_url_list(path: str | os.PathLike[str], urls: Iterable[str | os.PathLike[str]]) -> Path:
    """Write one URL (or path) per line, newline-terminated; return the path."""
    dest = Path(path)
    dest.parent.mkdir(parents=True, exist_ok=True)
    dest.write_text("".join(f"{os.fspath(u)}\n" for u in urls), encoding="utf-8")
    return dest


def _split_name(name: str) -> tuple[str, str] | None:
    """WebDataset's key/extension split: the basename breaks at its first dot."""
    directory, slash, base = name.rpartition("/")
    dot = base.find(".")
    if dot <= 0:
        return None  # no extension, or a dot-file: WebDataset skips these
    return directory + slash + base[:dot], base[dot + 1 :]


def read_samples_reference(path: str | os.PathLike[str]) -> list[Sample]:
    """Read a (possibly gzipped) shard into samples the way WebDataset groups them.

    Only regular files count; ``__meta__`` members and names without an
    extension are skipped; extensions are lowercased; consecutive members with
    the same key form one sample.  A repeated extension within a sample raises
    ValueError, as WebDataset does.  Samples carry ``__key__`` but no ``__url__``.
    """
    samples: list[Sample] = []
    current: Sample | None = None
    with tarfile.open(path, mode="r:*") as tf:
        for info in tf:
            if not info.isreg() or _META_RE.match(info.name):
                continue
            split = _split_name(info.name)
            if split is None:
                continue
            key, ext = split[0], split[1].lower()
            if current is None or current["__key__"] != key:
                current = {"__key__": key}
                samples.append(current)
            if ext in current:
                raise ValueError(f"{path}: {info.name}: extension {ext!r} repeated in sample {key!r}")
            extracted = tf.extractfile(info)
            current[ext] = extracted.read() if extracted is not None else b""
    return samples
