# Sourced by the scripts: make (once) and fill the project's virtual environment.
# Sets PY and WDS. WDSCACHE_VENV chooses another environment (default: .venv).
VENV=${WDSCACHE_VENV:-.venv}
if [ ! -x "$VENV/bin/python" ]; then
    python3 -m venv "$VENV"
fi
"$VENV/bin/python" -m pip install -q --disable-pip-version-check -e ".[test]"
PY="$VENV/bin/python"
WDS="$VENV/bin/wdscache"
