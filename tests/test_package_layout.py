"""The package's folders are its processes: what docs/architecture.md says of them holds."""

import ast
import subprocess
import sys
from pathlib import Path

import wdscache

ROOT = Path(wdscache.__file__).parent


def _imports(path: Path) -> set[str]:
    """The wdscache modules ``path`` imports (relative imports resolved)."""
    package = ".".join(("wdscache", *path.relative_to(ROOT).parent.parts))
    found = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.ImportFrom):
            if node.level:
                base = package.split(".")[: len(package.split(".")) - node.level + 1]
                found.add(".".join([*base, *([node.module] if node.module else [])]))
            elif node.module and node.module.startswith("wdscache"):
                found.add(node.module)
        elif isinstance(node, ast.Import):
            found |= {a.name for a in node.names if a.name.startswith("wdscache")}
    return found


def test_shared_and_training_never_import_the_agent():
    for folder, banned in (("shared", ("wdscache.agent", "wdscache.training")), ("training", ("wdscache.agent",))):
        for path in (ROOT / folder).glob("*.py"):
            bad = sorted(m for m in _imports(path) if m.startswith(banned))
            assert not bad, f"{path.relative_to(ROOT)} imports {bad}"


def test_every_module_lives_in_one_of_the_three_folders():
    top = sorted(p.name for p in ROOT.glob("*.py"))
    assert top == ["__init__.py", "__main__.py", "cli.py"]


def test_a_sample_worker_imports_only_what_serving_needs():
    code = (
        "import sys, wdscache.agent.worker; print(' '.join(sorted(m for m in sys.modules if m.startswith('wdscache'))))"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60, check=True)
    loaded = set(out.stdout.split())
    allowed = (
        {"wdscache", "wdscache.agent", "wdscache.shared"}
        | {
            f"wdscache.agent.{m}"
            for m in (
                "worker",
                "open_shards",
                "reply_frames",
                "scattered",
                "shardview",
                "sampletable",
                "growing",
                "ipc_files",
            )
        }
        | {
            f"wdscache.shared.{m}"
            for m in ("errors", "layout", "logs", "malloc", "messages", "protocol", "redact", "samples", "tarwalk")
        }
    )
    assert loaded <= allowed, sorted(loaded - allowed)
    assert not any(m.startswith("wdscache.training") for m in loaded)
