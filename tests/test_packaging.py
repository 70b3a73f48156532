"""The wheel the README builds holds the whole package: every module of the tree, none left out."""

from __future__ import annotations

import shutil
import subprocess
import sys
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
