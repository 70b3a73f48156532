#!/usr/bin/env bash
# Long-running fault soak (tests/soak/), kept out of the default suite (pyproject.toml). A few minutes.
#   WDSCACHE_SOAK_SEED=N WDSCACHE_SOAK_EPOCHS=E scripts/soak.sh
set -euo pipefail
cd "$(dirname "$0")/.."
. scripts/venv.sh
exec "$PY" -m pytest -s -p no:cacheprovider tests/soak "$@"
