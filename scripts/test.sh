#!/usr/bin/env bash
# Run the test suite in a fresh virtual environment: scripts/test.sh [pytest args...]
# Installs everything the tests need (the package with its "test" extra), so it
# works on a clean clone. Soak tests (tests/soak/) are left to scripts/soak.sh.
set -euo pipefail
cd "$(dirname "$0")/.."
VENV=${WDSCACHE_VENV:-.venv}
if [ ! -x "$VENV/bin/python" ]; then
    python3 -m venv "$VENV"
fi
"$VENV/bin/python" -m pip install -q --disable-pip-version-check -e ".[test]"
exec "$VENV/bin/python" -m pytest --ignore=tests/soak "$@"
