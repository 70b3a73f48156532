#!/usr/bin/env bash
# Run the test suite in a fresh virtual environment: scripts/test.sh [pytest args...]
# Installs everything the tests need (the package with its "test" extra), so it
# works on a clean clone. Tests run in WDSCACHE_TEST_PROCESSES pytest-xdist processes
# (default 4: most tests wait on agents, servers and sockets, not on a core); 0 runs
# them in this process. The slow scenarios (marked `slow`) run with `scripts/test.sh -m slow`
# (.ci/run runs both). Soak tests (tests/soak/) are left to scripts/soak.sh
# (pyproject.toml's pytest options leave them out of a plain `pytest`).
set -euo pipefail
cd "$(dirname "$0")/.."
. scripts/venv.sh
exec "$PY" -m pytest -n "${WDSCACHE_TEST_PROCESSES:-4}" "$@"
