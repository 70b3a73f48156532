"""Write docs/cli.md, the command reference, from the click commands themselves.

    .venv/bin/python scripts/gen_cli_docs.py            # rewrite docs/cli.md (any Python with the package)
    .venv/bin/python scripts/gen_cli_docs.py --check    # exit 1 if docs/cli.md differs from what it would write

Each section is the command's ``--help`` as click renders it, at a fixed width, so the page
says what the installed command says. ``tests/test_docs_reference.py`` fails when the page
drifts from the code.
"""

from __future__ import annotations

import argparse
import copy
import os
import sys
from pathlib import Path

import click

PAGE = Path(__file__).resolve().parent.parent / "docs" / "cli.md"
WIDTH = 80  # a terminal's: the page shows what `wdscache X --help` shows there

# A default that depends on the machine is shown as its rule, not as the count of the machine
# that ran this script; the check keeps the rule true to the code.
MACHINE_DEFAULTS = {("agent", "workers"): ("cores, at most 8", lambda: min(os.cpu_count() or 1, 8))}

HEADER = """\
# Command reference

Every `wdscache` command and its options, as `wdscache COMMAND --help` prints
them. This page is generated from the code by `scripts/gen_cli_docs.py`: do not
edit it by hand. After changing an option or a command's help, run
`.venv/bin/python scripts/gen_cli_docs.py` in the clone.

Each agent option can also come from the environment variable its help names:
`WDSCACHE_` and the long name in capitals, as `WDSCACHE_CACHE_SIZE`. Sizes are
binary: `1G` is 2^30 bytes. What the options mean in practice, and how to
operate the agent: [operations.md](operations.md).
"""


def _with_rules(name: str, command: click.Command) -> click.Command:
    """``command`` with each machine-dependent default shown as its rule (a copy: the CLI is untouched)."""
    params = []
    for param in command.params:
        rule = MACHINE_DEFAULTS.get((name, param.name or ""))
        if rule is not None:
            text, value = rule
            if param.default != value():
                raise SystemExit(
                    f"scripts/gen_cli_docs.py: the default of `wdscache {name} --{param.name}` is no "
                    f"longer {text!r} ({param.default!r} here): update MACHINE_DEFAULTS"
                )
            param = copy.copy(param)
            param.default = text
        params.append(param)
    shown = copy.copy(command)
    shown.params = params
    return shown


def _help(command: click.Command, name: str, parent: click.Context | None) -> str:
    ctx = click.Context(
        command,
        info_name=name,
        parent=parent,
        terminal_width=WIDTH,
        max_content_width=WIDTH,
        **command.context_settings,
    )
    return command.get_help(ctx)


def render() -> str:
    """The page's text."""
    from wdscache.cli import main

    top = click.Context(
        main, info_name="wdscache", terminal_width=WIDTH, max_content_width=WIDTH, **main.context_settings
    )
    names = main.list_commands(top)
    parts = [
        HEADER,
        "Commands: " + ", ".join(f"[`{n}`](#wdscache-{n})" for n in names) + ".\n",
        "## wdscache\n",
        "```text",
        main.get_help(top),
        "```\n",
    ]
    for name in names:
        command = main.get_command(top, name)
        assert command is not None
        parts += [f"## wdscache {name}\n", "```text", _help(_with_rules(name, command), name, top), "```\n"]
    return "\n".join(parts)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--check", action="store_true", help="only compare: exit 1 if the page is out of date")
    args = ap.parse_args()
    text = render()
    if args.check:
        if not PAGE.exists() or PAGE.read_text() != text:
            sys.exit(f"{PAGE} is out of date: run .venv/bin/python scripts/gen_cli_docs.py")
        return
    PAGE.write_text(text)


if __name__ == "__main__":
    main()
