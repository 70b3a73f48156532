#!/usr/bin/env bash
# Long-running fault soak (tests/soak/), kept out of scripts/test.sh. A few minutes.
#   WDSCACHE_SOAK_SEED=N WDSCACHE_SOAK_EPOCHS=E scripts/soak.sh
set -euo pipefail
cd "$(dirname "$0")/.."
VENV=${WDSCACHE_VENV:-.venv}
if [ ! -x "$VENV/bin/python" ]; then
    python3 -m venv "$VENV"
fi
"$VENV/bin/python" -m pip install -q --disable-pip-version-check -e ".[test]"
exec "$VENV/bin/python" -m pytest -s -p no:cacheprovider tests/soak "$@"
