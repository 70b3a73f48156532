#!/usr/bin/env bash
# The main job on a built-in example: serve a synthetic dataset on loopback,
# start an agent, watch it fill its cache ahead of demand, then stream one
# epoch to two consumer processes of one job and show `wdscache stats` (each time once
# what it is to show is there: the first shards cached, the job delivering samples).
set -euo pipefail
cd "$(dirname "$0")/.."
. scripts/venv.sh

DEMO=$(mktemp -d /tmp/wdscache-demo.XXXXXX)
pids=()
consumers=()
cleanup() {
    for pid in "${pids[@]}"; do kill -TERM "$pid" 2>/dev/null || true; done
    for pid in "${pids[@]}"; do wait "$pid" 2>/dev/null || true; done
    rm -rf "$DEMO"
}
trap cleanup EXIT

echo "== making 16 shards of ~2 MB in $DEMO/data"
"$PY" scripts/demo_data.py make "$DEMO/data" --shards 16 --samples 64 --payload 30000

echo "== serving them on 127.0.0.1 at 4 MB/s per connection"
"$PY" scripts/demo_data.py serve "$DEMO/data" --port-file "$DEMO/port" --rate 4e6 &
pids+=($!)
for _ in $(seq 100); do [ -s "$DEMO/port" ] && break; sleep 0.1; done
PORT=$(cat "$DEMO/port")
echo "http://127.0.0.1:$PORT/shard-{000000..000015}.tar" > "$DEMO/urls.txt"
echo "   urls.txt: $(cat "$DEMO/urls.txt")"

echo "== starting the agent: budget 40M, prefetch 6"
"$WDS" agent --cache-dir "$DEMO/cache" --urls "$DEMO/urls.txt" --cache-size 40M --prefetch 6 \
    2> "$DEMO/agent.log" &
pids+=($!)

# Shows `wdscache stats` once its text matches the grep -E pattern $1 (waiting at most $2 seconds),
# or once the processes $4... all ended: then the last text that matched $3 (a fallback), else the last.
stats_when() {
    local want=$1 deadline=$((SECONDS + $2)) fallback=$3 text kept="" pid alive
    shift 3
    while :; do
        text=$("$WDS" stats --cache-dir "$DEMO/cache" 2>&1) || true
        if grep -qE "$want" <<<"$text"; then echo "$text"; return 0; fi
        grep -qE "$fallback" <<<"$text" && kept=$text
        alive=0
        for pid in "$@"; do kill -0 "$pid" 2>/dev/null && alive=1; done
        if [ "$alive" = 0 ] || [ "$SECONDS" -ge "$deadline" ]; then echo "${kept:-$text}"; return 0; fi
        sleep 0.1
    done
}

for _ in $(seq 200); do
    "$WDS" stats --cache-dir "$DEMO/cache" --json 2>/dev/null | grep -q '"pid"' && break
    sleep 0.1
done
echo "== wdscache stats once the first shards are cached: the cache fills before anyone reads"
stats_when '^shards +[1-9]' 30 '^shards' "${pids[@]}"

echo "== one epoch to two consumer processes of one job (ranks 0 and 1 of 2; a training step of 0.1 s)"
for rank in 0 1; do
    RANK=$rank WORLD_SIZE=2 TORCHELASTIC_RUN_ID=demo WDSCACHE_CACHE_DIR="$DEMO/cache" \
        "$PY" scripts/train_example.py --epochs 1 --batch-size 16 --step-sleep 0.1 &
    consumers+=($!)
done
echo "== wdscache stats while the job runs"
stats_when '^  rank [0-9]+: [1-9][0-9]* samples' 30 '^job demo:$' "${consumers[@]}"
for pid in "${consumers[@]}"; do wait "$pid"; done
echo "== wdscache stats after the epoch "
"$WDS" stats --cache-dir "$DEMO/cache"
echo "== agent log (last lines)"
tail -n 8 "$DEMO/agent.log"
