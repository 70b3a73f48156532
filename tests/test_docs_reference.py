"""The reference pages say what the code does: docs/cli.md is what scripts/gen_cli_docs.py makes
of the click commands, docs/api.md lists exactly the parameters of the public signatures, and
every relative link in the README and docs/ leads to a file and heading that exist."""

from __future__ import annotations

import inspect
import re
from pathlib import Path

import pytest

import wdscache
from scripts.gen_cli_docs import PAGE as CLI_PAGE
from scripts.gen_cli_docs import render

ROOT = Path(__file__).resolve().parent.parent
README = ROOT / "README.md"
API = ROOT / "docs" / "api.md"
PAGES = [README, *sorted((ROOT / "docs").glob("*.md")), ROOT / "agent" / "README.md"]


def test_the_command_reference_is_what_the_generator_makes_of_the_cli():
    assert CLI_PAGE.read_text() == render(), (
        "docs/cli.md differs from the CLI's --help: run "
        "`.venv/bin/python scripts/gen_cli_docs.py` and commit docs/cli.md"
    )


def _sections(text: str) -> dict[str, str]:
    """Each heading's text (up to the next heading), by the first `name` in the heading."""
    out: dict[str, str] = {}
    for m in re.finditer(r"^#+ .*?`(?:wdscache\.)?(\w+)`.*\n((?:(?!#+ ).*\n)*)", text, re.M):
        out[m.group(1)] = m.group(2)
    return out


def _table(section: str) -> dict[str, str]:
    """The ``| parameter | default | meaning |`` table of a section: each parameter's default."""
    rows = re.findall(r"^\| `(\w+)` \| `([^`]*)` \|", section.split("| parameter | default | meaning |", 1)[1], re.M)
    return dict(rows)


def _shown(default: object) -> str:
    if default is inspect.Parameter.empty:
        return "required"
    return default.__name__ if callable(default) else repr(default)


@pytest.mark.parametrize("name", ["WebDataset", "CachedMultiLoader", "Tuning", "ShardClient", "ShardListDataset"])
def test_the_api_page_lists_exactly_the_parameters_of_the_signature(name):
    sections = _sections(API.read_text())
    assert name in sections, f"docs/api.md has no heading naming `{name}`"
    page = _table(sections[name])
    # __init__'s, not the class's: CachedMultiLoader's __new__ takes (*args, **kwargs)
    params = {
        p.name: p
        for p in inspect.signature(getattr(wdscache, name).__init__).parameters.values()
        if p.name != "self" and p.kind not in (p.VAR_KEYWORD, p.VAR_POSITIONAL)
    }
    assert params
    assert sorted(set(params) - set(page)) == [], f"docs/api.md's `{name}` table misses these parameters"
    assert sorted(set(page) - set(params)) == [], f"docs/api.md's `{name}` table lists parameters it does not have"
    wrong = {p: (page[p], _shown(params[p].default)) for p in params if page[p] != _shown(params[p].default)}
    assert wrong == {}, f"docs/api.md's `{name}` table: (page, code) defaults differ"


def _slug(heading: str) -> str:
    """GitHub's anchor of a heading."""
    return re.sub(r"[^\w\- ]", "", heading.strip().lower()).replace(" ", "-")


def test_every_relative_link_in_the_readme_and_docs_leads_somewhere():
    broken = []
    for page in PAGES:
        text = re.sub(r"```.*?```", "", page.read_text(), flags=re.S)
        for target in re.findall(r"\]\(([^)\s]+)\)", text):
            if re.match(r"[a-z]+:", target):
                continue
            path, _, anchor = target.partition("#")
            dest = (page.parent / path).resolve() if path else page
            if not dest.exists():
                broken.append(f"{page.relative_to(ROOT)}: {target} (no such file)")
            elif anchor and dest.suffix == ".md":
                headings = {_slug(h) for h in re.findall(r"^#+ (.*)$", dest.read_text(), re.M)}
                if anchor not in headings:
                    broken.append(f"{page.relative_to(ROOT)}: {target} (no such heading)")
    assert broken == []


def test_the_readme_is_a_short_guide_whose_install_line_does_not_hide_the_package():
    text = README.read_text()
    assert len(text.encode()) <= 10_000
    assert "scripts/demo.sh" in text and "scripts/test.sh" in text
    # A clone named like the package, beside a script, is imported instead of it (a namespace package).
    clones = re.findall(r"^git clone \S+(?: (\S+))?", text, re.M)
    assert clones and all(folder not in ("", "wdscache") for folder in clones), clones
    # A page may name only the extras the package has.
    import tomllib

    extras = set(tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["optional-dependencies"])
    for page in PAGES:
        for named in re.findall(r"\.\[([\w,]+)\]", page.read_text()):
            assert set(named.split(",")) <= extras, (page.name, named)


def test_every_exported_name_is_on_the_api_page():
    page = (ROOT / "docs" / "api.md").read_text()
    missing = [name for name in wdscache.__all__ + ["WebDataset"] if f"`{name}" not in page]
    assert not missing, f"names in wdscache.__all__ that docs/api.md does not mention: {missing}"


def test_help_shows_the_loaders_keywords_not_its_constructors_catch_all():
    shown = inspect.signature(wdscache.CachedMultiLoader)
    assert list(shown.parameters)[:2] == ["urls", "cache_dir"] and "args" not in shown.parameters
