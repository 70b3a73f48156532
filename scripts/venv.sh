# Sourced by the scripts: make (once) and fill the project's virtual environment.
# Sets PY and WDS. WDSCACHE_VENV chooses another environment (default: .venv).
# The package is installed editable, so code changes need no reinstall: pip runs only when
# the environment is new or pyproject.toml (or the clone's path) changed since the last install.
# Reinstalling rewrites the console script, and a script run while tests run (the demo, from
# its test) must not take `wdscache` away from agents other tests are starting.
VENV=${WDSCACHE_VENV:-.venv}
if [ ! -x "$VENV/bin/python" ]; then
    python3 -m venv "$VENV"
fi
STAMP="$VENV/.wdscache-installed"
WANT="$(pwd) $(sha256sum pyproject.toml | cut -d' ' -f1)"
if [ ! -x "$VENV/bin/wdscache" ] || [ "$(cat "$STAMP" 2>/dev/null)" != "$WANT" ]; then
    "$VENV/bin/python" -m pip install -q --disable-pip-version-check -e ".[test]"
    echo "$WANT" > "$STAMP"
fi
PY="$VENV/bin/python"
WDS="$VENV/bin/wdscache"
