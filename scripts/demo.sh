#!/usr/bin/env bash
# The main job on a built-in example: serve a synthetic dataset on loopback,
# start an agent, and watch it fill its cache ahead of demand.
set -euo pipefail
cd "$(dirname "$0")/.."
VENV=${WDSCACHE_VENV:-.venv}
if [ ! -x "$VENV/bin/python" ]; then
    python3 -m venv "$VENV"
fi
"$VENV/bin/python" -m pip install -q --disable-pip-version-check -e ".[test]"
PY="$VENV/bin/python"
WDS="$VENV/bin/wdscache"

DEMO=$(mktemp -d /tmp/wdscache-demo.XXXXXX)
pids=()
cleanup() {
    for pid in "${pids[@]}"; do kill -TERM "$pid" 2>/dev/null || true; done
    for pid in "${pids[@]}"; do wait "$pid" 2>/dev/null || true; done
    rm -rf "$DEMO"
}
trap cleanup EXIT

echo "== making 16 shards of ~2 MB in $DEMO/data"
"$PY" scripts/demo_data.py make "$DEMO/data" --shards 16 --samples 64 --payload 30000

echo "== serving them on 127.0.0.1 at 8 MB/s per connection"
"$PY" scripts/demo_data.py serve "$DEMO/data" --port-file "$DEMO/port" --rate 8e6 &
pids+=($!)
for _ in $(seq 100); do [ -s "$DEMO/port" ] && break; sleep 0.1; done
PORT=$(cat "$DEMO/port")
echo "http://127.0.0.1:$PORT/shard-{000000..000015}.tar" > "$DEMO/urls.txt"
echo "   urls.txt: $(cat "$DEMO/urls.txt")"

echo "== starting the agent: budget 24M, prefetch 6"
"$WDS" agent --cache-dir "$DEMO/cache" --urls "$DEMO/urls.txt" --cache-size 24M --prefetch 6 \
    2> "$DEMO/agent.log" &
pids+=($!)
for _ in $(seq 100); do "$WDS" stats --cache-dir "$DEMO/cache" --json 2>/dev/null | grep -q '"pid"' && break; sleep 0.1; done

for i in 1 2 3; do
    sleep 1
    echo "== wdscache stats after ${i}s"
    "$WDS" stats --cache-dir "$DEMO/cache"
done
echo "== agent log"
cat "$DEMO/agent.log"
