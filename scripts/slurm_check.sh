#!/usr/bin/env bash
# The Slurm recipe on a real single-node cluster: agent/slurm/wdscache-launch.sh starts one
# agent per node before the training step, the training step reads an epoch through it,
# and the agent is stopped after.
#
#   sudo bash scripts/slurm_check.sh        # as root: it installs packages and runs daemons
#
# 1. installs Debian's slurm-wlm and munge when slurmctld, slurmd or munged are missing;
# 2. in a fresh folder under /tmp: a munge key, a private munged on its own socket, a
#    slurm.conf for this one host (its CPUs and memory from `slurmd -C`, one partition,
#    select/cons_tres, proctrack/linuxproc, no cgroups), slurmctld and slurmd on it
#    (SLURM_CONF points the client commands there; /etc/slurm is not touched);
# 3. waits until `sinfo` shows the node idle;
# 4. serves a small synthetic dataset on 127.0.0.1 (scripts/demo_data.py), writes its URL
#    list, and submits a batch script that calls the launcher as
#    agent/slurm/example.sbatch does: torchrun with c10d rendezvous on the first node,
#    two ranks of scripts/train_example.py on the CPU, one epoch;
# 5. checks: the job completed with exit code 0; the ranks saw every sample of the dataset once;
#    the launcher logged the agents ready and stopped, the agent logged "stopped" and no
#    worker of its restarted; no process of the agent remains and `wdscache stats` shows
#    no running agent.
# On exit (also on failure or Ctrl-C) it cancels the job, stops the daemons and the server,
# and removes the folder. Exit status 0 on success, 1 with a message naming the check that
# failed, 3 if Slurm cannot run here (not root, packages, daemons that do not come up).
# Ports: WDSCACHE_SLURM_PORTS="CTLD SLURMD" (default: two free ones). Python environment:
# WDSCACHE_VENV, as for the other scripts.
set -euo pipefail
cd "$(dirname "$0")/.."
REPO=$PWD
START=$SECONDS

log() { printf '%s slurm_check: %s\n' "$(date +%H:%M:%S)" "$*" >&2; }
fail() { log "FAILED: $*"; exit 1; }
# Exit status 3: no Slurm cluster here (no root, no packages, daemons that do not come up).
unavailable() { log "UNAVAILABLE: $*"; exit 3; }

# Waits until "$@" succeeds, for at most $WAIT_SECONDS; status 1 after that.
wait_for() {
    local deadline=$((SECONDS + WAIT_SECONDS))
    until "$@" >/dev/null 2>&1; do
        ((SECONDS < deadline)) || return 1
        sleep 0.5
    done
}

[[ $(id -u) == 0 ]] || unavailable "run as root: it installs slurm-wlm and starts munged, slurmctld and slurmd"

# --- 1. packages ---------------------------------------------------------------------
if ! command -v slurmctld >/dev/null || ! command -v slurmd >/dev/null || ! command -v munged >/dev/null; then
    log "installing slurm-wlm and munge (apt-get)"
    export DEBIAN_FRONTEND=noninteractive
    apt-get update -q >/dev/null || unavailable "apt-get update failed"
    apt-get install -y -q --no-install-recommends slurm-wlm munge >/dev/null ||
        unavailable "apt-get install slurm-wlm munge failed"
fi
INSTALLED=$SECONDS
for daemon in slurmctld slurmd; do
    if pgrep -x "$daemon" >/dev/null; then
        unavailable "a $daemon already runs on this machine; this check starts its own cluster and would disturb it"
    fi
done

. scripts/venv.sh
VENV_BIN=$(cd "$(dirname "$PY")" && pwd)
free_ports() {  # N free TCP ports on 127.0.0.1
    "$PY" -c 'import socket, sys
socks = [socket.socket() for _ in range(int(sys.argv[1]))]
for s in socks: s.bind(("127.0.0.1", 0))
print(*(s.getsockname()[1] for s in socks))' "$1"
}
read -r CTLD_PORT SLURMD_PORT <<<"${WDSCACHE_SLURM_PORTS:-$(free_ports 2)}"

# --- cleanup ---------------------------------------------------------------------------
WORK=$(mktemp -d /tmp/wdscache-slurm.XXXXXX)
chmod 0700 "$WORK"
SOCKET_FOLDER=/tmp/wdscache-$(id -u)
[[ -e $SOCKET_FOLDER ]] && SOCKET_FOLDER_WAS_THERE=1 || SOCKET_FOLDER_WAS_THERE=""
export SLURM_CONF=$WORK/slurm.conf
declare -A PIDS=()  # name -> pid of what this script started

stop_pid() {  # name: SIGTERM, up to 20 s, then SIGKILL
    local name=$1 pid=${PIDS[$1]:-} i
    [[ -n $pid ]] || return 0
    kill -TERM "$pid" 2>/dev/null || true
    for ((i = 0; i < 40; i++)); do
        kill -0 "$pid" 2>/dev/null || break
        sleep 0.5
    done
    if kill -0 "$pid" 2>/dev/null; then
        log "$name (pid $pid) still runs 20 s after SIGTERM: killing it"
        kill -KILL "$pid" 2>/dev/null || true
    fi
    wait "$pid" 2>/dev/null || true
    unset "PIDS[$name]"
}

cleanup() {
    local rc=$? i
    trap - EXIT INT TERM
    if [[ -n ${PIDS[slurmctld]:-} ]] && squeue -h -o %i 2>/dev/null | grep -q .; then
        log "cancelling the job still in the queue"
        scancel --quiet --partition=check 2>/dev/null || true
        for ((i = 0; i < 80; i++)); do  # Slurm's KillWait is 30 s
            squeue -h -o %i 2>/dev/null | grep -q . || break
            sleep 0.5
        done
    fi
    if ((rc != 0)); then
        for f in job.out job2.out slurmctld.log slurmd.log; do
            [[ -s $WORK/$f ]] || continue
            log "last lines of $f:"
            tail -n 25 "$WORK/$f" >&2
        done
        for f in "$WORK"/logs/*.log; do
            [[ -s $f ]] || continue
            log "last lines of ${f#"$WORK"/}:"
            tail -n 15 "$f" >&2
        done
    fi
    for name in foreign server slurmd slurmctld munged; do stop_pid "$name"; done
    rm -rf -- "$WORK"
    # The agent's socket folder, if this run made it (rmdir: only while empty).
    [[ -n $SOCKET_FOLDER_WAS_THERE ]] || rmdir -- "$SOCKET_FOLDER" 2>/dev/null || true
    exit "$rc"
}
trap cleanup EXIT
trap 'log "FAILED: line $LINENO: $BASH_COMMAND"' ERR
trap 'log "interrupted"; exit 130' INT
trap 'log "terminated"; exit 143' TERM

# --- 2. munge and the cluster ---------------------------------------------------------
mkdir -p "$WORK"/{munge,state,spool,logs,seen}
chmod 0700 "$WORK/munge"
dd if=/dev/urandom of="$WORK/munge/munge.key" bs=1024 count=1 status=none
chmod 0400 "$WORK/munge/munge.key"
MUNGE_SOCKET=$WORK/munge/munge.socket
munged --foreground --force --socket="$MUNGE_SOCKET" --key-file="$WORK/munge/munge.key" \
    --pid-file="$WORK/munge/munged.pid" --log-file="$WORK/munge/munged.log" \
    --seed-file="$WORK/munge/munged.seed" 2>"$WORK/munge/stderr" &
PIDS[munged]=$!
WAIT_SECONDS=15 wait_for munge --socket="$MUNGE_SOCKET" --string=ok ||
    unavailable "munged did not answer within 15 s: $(cat "$WORK/munge/stderr" "$WORK/munge/munged.log" 2>/dev/null | tail -n 5)"

HOST=$(hostname -s)
NODE_LINE=$(slurmd -C | grep '^NodeName=') || unavailable "slurmd -C did not describe this host"
cat >"$SLURM_CONF" <<EOF
# A one-node cluster for scripts/slurm_check.sh, all of its state under $WORK.
ClusterName=wdscache-check
SlurmctldHost=$HOST(127.0.0.1)
SlurmctldPort=$CTLD_PORT
SlurmdPort=$SLURMD_PORT
SlurmUser=root
SlurmdUser=root
AuthType=auth/munge
CredType=cred/munge
AuthInfo=socket=$MUNGE_SOCKET
StateSaveLocation=$WORK/state
SlurmdSpoolDir=$WORK/spool
SlurmctldPidFile=$WORK/slurmctld.pid
SlurmdPidFile=$WORK/slurmd.pid
SlurmctldLogFile=$WORK/slurmctld.log
SlurmdLogFile=$WORK/slurmd.log
SlurmctldDebug=info
SlurmdDebug=info
# No cgroups: containers rarely allow them.
ProctrackType=proctrack/linuxproc
TaskPlugin=task/none
JobAcctGatherType=jobacct_gather/none
AccountingStorageType=accounting_storage/none
SchedulerType=sched/backfill
SelectType=select/cons_tres
SelectTypeParameters=CR_CPU
ReturnToService=2
MpiDefault=none
$NODE_LINE NodeAddr=127.0.0.1 State=UNKNOWN
PartitionName=check Nodes=$HOST Default=YES MaxTime=INFINITE State=UP
EOF

log "starting slurmctld and slurmd ($HOST, ports $CTLD_PORT/$SLURMD_PORT, config $SLURM_CONF)"
slurmctld -D -i -f "$SLURM_CONF" >"$WORK/slurmctld.stderr" 2>&1 &
PIDS[slurmctld]=$!
WAIT_SECONDS=30 wait_for scontrol ping ||
    unavailable "slurmctld did not answer within 30 s: $(tail -n 5 "$WORK/slurmctld.stderr")"
slurmd -D -f "$SLURM_CONF" -N "$HOST" >"$WORK/slurmd.stderr" 2>&1 &
PIDS[slurmd]=$!

# --- 3. the node idle -------------------------------------------------------------------
node_idle() { [[ $(sinfo -h -n "$HOST" -o %T) == idle ]]; }
WAIT_SECONDS=60 wait_for node_idle ||
    unavailable "the node $HOST is not idle in sinfo after 60 s (state: $(sinfo -h -n "$HOST" -o %T 2>&1)); slurmd: $(tail -n 5 "$WORK/slurmd.stderr")"
CLUSTER_UP=$SECONDS
log "node $HOST idle after $((CLUSTER_UP - INSTALLED)) s"

# --- 4. data, URL list, the job --------------------------------------------------------
SHARDS=8
PER_SHARD=50
TOTAL=$((SHARDS * PER_SHARD))
"$PY" scripts/demo_data.py make "$WORK/data" --shards "$SHARDS" --samples "$PER_SHARD" --payload 2000 >/dev/null
"$PY" scripts/demo_data.py serve "$WORK/data" --port-file "$WORK/port" &
PIDS[server]=$!
WAIT_SECONDS=30 wait_for test -s "$WORK/port" || fail "the shard server did not start within 30 s"
PORT=$(cat "$WORK/port")
printf 'http://127.0.0.1:%s/shard-{000000..%06d}.tar\n' "$PORT" $((SHARDS - 1)) >"$WORK/urls.txt"
CACHE=$WORK/cache
RDZV_PORT=$(free_ports 1)

# As agent/slurm/example.sbatch, on this one CPU-only node: the launcher, then torchrun once
# per node with c10d rendezvous on the first node, two ranks.
cat >"$WORK/check.sbatch" <<EOF
#!/usr/bin/env bash
#SBATCH --job-name=wdscache-check
#SBATCH --nodes=1
#SBATCH --ntasks-per-node=1
#SBATCH --cpus-per-task=$(nproc)
#SBATCH --time=10
#SBATCH --output=$WORK/job.out
set -euo pipefail
head_node=\$(scontrol show hostnames "\$SLURM_JOB_NODELIST" | head -n 1)
"$REPO/agent/slurm/wdscache-launch.sh" \\
    --urls "$WORK/urls.txt" \\
    --cache-dir "\${CHECK_CACHE:-$CACHE}" \\
    --ready-timeout 120 \\
    --stop-timeout 30 \\
    --log-dir "$WORK/logs" \\
    --srun-opt=--cpus-per-task="\$SLURM_CPUS_PER_TASK" \\
    -- torchrun \\
    --nnodes="\$SLURM_JOB_NUM_NODES" \\
    --nproc_per_node=2 \\
    --rdzv_backend=c10d \\
    --rdzv_endpoint="\$head_node:$RDZV_PORT" \\
    --rdzv_id="\$SLURM_JOB_ID" \\
    "$REPO/scripts/train_example.py" --epochs 1 --batch-size 10 --seen-log "$WORK/seen"
EOF

log "sbatch: the launcher, then one epoch of $TOTAL samples on 2 ranks"
JOB_START=$SECONDS
# Not `sbatch --wait`: it polls at 2, 10 and 42 s, which would triple this check's time.
# Submit check.sbatch (sbatch options: "$@") and wait for its end: sets JOB, state and exit_code.
run_job() {
    JOB=$(PATH=$VENV_BIN:$PATH sbatch --parsable --chdir="$WORK" "$@" "$WORK/check.sbatch") || fail "sbatch refused the job"
    local deadline=$((SECONDS + 300))
    while squeue -h -j "$JOB" -o %i 2>/dev/null | grep -q .; do
        ((SECONDS < deadline)) || fail "job $JOB did not end within 300 s"
        sleep 0.5
    done
    local job_info
    job_info=$(scontrol -o show job "$JOB") || fail "scontrol does not know job $JOB any more"
    state=$(grep -o 'JobState=[A-Z_]*' <<<"$job_info")
    exit_code=$(grep -o ' ExitCode=[0-9:]*' <<<"$job_info")
}
run_job
JOB_END=$SECONDS
[[ $state == JobState=COMPLETED && $exit_code == " ExitCode=0:0" ]] ||
    fail "job $JOB ended with $state$exit_code (job output above)"

# --- 5. checks ----------------------------------------------------------------------------
out=$WORK/job.out
line_of() { grep -n -m 1 -F -- "$1" "$out" | cut -d: -f1; }
ready=$(line_of "wdscache-launch.sh: all 1 agent(s) ready")
training=$(line_of "wdscache-launch.sh: running: torchrun")
trained=$(line_of "wdscache-launch.sh: training command exited with status 0")
stopped=$(line_of "wdscache-launch.sh: agents stopped")
[[ -n $ready ]] || fail "the launcher did not log the agent ready"
[[ -n $training && -n $trained ]] || fail "the launcher did not log the training step starting and ending with status 0"
[[ -n $stopped ]] || fail "the launcher did not log the agents stopped"
((ready < training && trained < stopped)) ||
    fail "the launcher's log is out of order: agent ready (line $ready), training (lines $training-$trained), agents stopped (line $stopped)"
agent_log=$(ls "$WORK"/logs/wdscache-agent-*.log 2>/dev/null | head -n 1)
[[ -n $agent_log ]] || fail "no agent log in $WORK/logs"
grep -q "agent [0-9]* serving" "$agent_log" || fail "the agent log does not show it serving"
grep -q "wdscache.agent.core: stopped" "$agent_log" || fail "the agent log does not show it stopped (SIGTERM, clean stop)"
if grep -q "died with exit code" "$agent_log"; then
    fail "the agent's workers were signalled too (the agent restarted them while it stopped)"
fi
seen=$("$PY" - "$WORK/seen" <<'EOF'
import json, pathlib, sys
ids = []
for path in sorted(pathlib.Path(sys.argv[1]).glob("rank-*.jsonl")):
    for line in path.read_text().splitlines():
        ids += json.loads(line).get("ids", [])
print(len(ids), len(set(ids)))
EOF
)
read -r delivered distinct <<<"$seen"
((delivered == TOTAL && distinct == TOTAL)) ||
    fail "the epoch delivered $delivered samples ($distinct distinct); the dataset has $TOTAL"
if pgrep -f -- "$CACHE" >/dev/null; then
    fail "processes of the agent remain after the job: $(pgrep -a -f -- "$CACHE")"
fi
stats=$(PATH=$VENV_BIN:$PATH wdscache stats --cache-dir "$CACHE" --json 2>&1) || true
if grep -Eq '"agent": *\{' <<<"$stats"; then
    fail "wdscache stats still shows a running agent on $CACHE"
fi

# --- 6. another job's agent on the cache dir -----------------------------------------------
# A launch whose cache dir already has an agent (another job's; here one started by hand)
# fails before its training, saying why, and leaves that agent running.
FOREIGN=$WORK/foreign-cache
mkdir -p -m 0700 "$FOREIGN"
PATH=$VENV_BIN:$PATH wdscache agent --cache-dir "$FOREIGN" --urls "$WORK/urls.txt" --min-free 1M \
    >"$WORK/foreign.log" 2>&1 &
PIDS[foreign]=$!
foreign_ready() { PATH=$VENV_BIN:$PATH wdscache stats --cache-dir "$FOREIGN" --json 2>/dev/null | grep -Eq '"answering": *true'; }
WAIT_SECONDS=60 wait_for foreign_ready || fail "the agent started by hand is not ready after 60 s: $(tail -n 5 "$WORK/foreign.log")"
log "sbatch: the launcher on a cache dir another agent serves"
run_job --output="$WORK/job2.out" --export=ALL,CHECK_CACHE="$FOREIGN"
[[ $state == JobState=FAILED && $exit_code == " ExitCode=1:0" ]] ||
    fail "job $JOB on a cache dir another agent serves ended with $state$exit_code; want FAILED, exit code 1: $(cat "$WORK/job2.out")"
grep -Eq "exited.* before .*ready" "$WORK/job2.out" ||
    fail "the launcher did not say its agent exited before it was ready: $(cat "$WORK/job2.out")"
if grep -q "wdscache-launch.sh: running:" "$WORK/job2.out"; then
    fail "the launcher ran the training on another job's agent"
fi
kill -0 "${PIDS[foreign]}" 2>/dev/null || fail "the launcher stopped the other job's agent"
log "OK: agent ready before the training, $TOTAL samples on 2 ranks, agent stopped after, none left; a launch on another agent's cache dir failed before its training and left that agent running"
log "times: install $((INSTALLED - START))s, cluster up $((CLUSTER_UP - INSTALLED))s, job $((JOB_END - JOB_START))s, after install $((SECONDS - INSTALLED))s"
