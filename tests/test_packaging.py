"""The wheel the README builds holds the whole package: every module of the tree, none left out;
the source distribution holds the whole repository, so that its tests run from it."""

from __future__ import annotations

import shutil
import subprocess
import sys
import tarfile
import zipfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def test_the_wheel_holds_every_module_of_the_package(tmp_path: Path) -> None:
    # Built from a copy: a build in the tree leaves build/ behind, whose files a later build packs.
    source = tmp_path / "source"
    skip = shutil.ignore_patterns(
        ".git", ".venv", "build", "dist", "*.egg-info", "__pycache__", ".*cache", "tests", "bench-results"
    )
    shutil.copytree(ROOT, source, ignore=skip)
    r = subprocess.run(
        [sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation", "-q", str(source), "-w", tmp_path],
        capture_output=True,
        text=True,
        timeout=240,
        cwd=tmp_path,
    )
    assert r.returncode == 0, r.stderr
    (wheel,) = tmp_path.glob("wdscache-*.whl")
    packed = {name for name in zipfile.ZipFile(wheel).namelist() if name.endswith(".py")}
    tree = {str(p.relative_to(ROOT)) for p in (ROOT / "wdscache").rglob("*.py")}
    assert packed == tree, sorted(tree ^ packed)


def test_the_source_distribution_holds_every_tracked_file(tmp_path: Path) -> None:
    tracked = subprocess.run(["git", "ls-files"], cwd=ROOT, capture_output=True, text=True, check=True, timeout=60)
    files = [name for name in tracked.stdout.splitlines() if name != ".gitignore"]
    source = tmp_path / "source"
    for name in files:  # the tree as committed: a build in the working tree leaves files behind
        (source / name).parent.mkdir(parents=True, exist_ok=True)
        shutil.copy2(ROOT / name, source / name)
    r = subprocess.run(
        [sys.executable, "-c", f"from setuptools import build_meta; print(build_meta.build_sdist({str(tmp_path)!r}))"],
        capture_output=True,
        text=True,
        timeout=120,
        cwd=source,
    )
    assert r.returncode == 0, r.stderr
    with tarfile.open(tmp_path / r.stdout.split()[-1]) as sdist:
        packed = {name.split("/", 1)[1] for name in sdist.getnames() if "/" in name}
    assert set(files) <= packed, sorted(set(files) - packed)
