#!/usr/bin/env bash
# The linters, as CI runs them: ruff's formatter (a check: `ruff format .` makes the change) and
# ruff (errors, bugbear, import order, modern syntax) on everything, mypy on the package.
# Settings are in pyproject.toml.
set -euo pipefail
cd "$(dirname "$0")/.."
. scripts/venv.sh
"$VENV/bin/ruff" format --check .
"$VENV/bin/ruff" check .
"$VENV/bin/mypy"
