#!/usr/bin/env bash
# wdscache-launch.sh: run a training command inside a Slurm allocation with one
# wdscache agent per node.
#
#   1. starts `wdscache agent` once on every node of the allocation (a
#      background job step that overlaps the training step),
#   2. waits until `wdscache stats --cache-dir DIR --json` succeeds and shows an
#      agent that answers on every node, or fails after a deadline, naming the
#      nodes that were not ready,
#   3. runs the training command with srun, WDSCACHE_CACHE_DIR exported,
#   4. on exit (normal end, error, SIGINT/SIGTERM) stops the agents with
#      SIGTERM to each agent process, then forcibly after a grace period.
#
# Exit status: the training command's; 1 if the agents could not be started;
# 2 for a usage error.
# Needs Slurm 20.11 or newer (srun --overlap).

set -euo pipefail

readonly PROG=${0##*/}

usage() {
    cat <<EOF
Usage: $PROG [OPTIONS] [--] COMMAND [ARG...]

Run inside an sbatch/salloc allocation. Starts one wdscache agent per node,
waits for all of them, runs COMMAND with srun (WDSCACHE_CACHE_DIR exported),
and stops the agents when COMMAND ends.

Options:
  -u, --urls FILE          URL list; must be readable at the same path on every
                           node (shared file system). Default: \$WDSCACHE_URLS.
  -d, --cache-dir DIR      node-local cache dir, same path on every node.
                           Default: \$WDSCACHE_CACHE_DIR, else
                           \$SLURM_TMPDIR/wdscache if SLURM_TMPDIR is set,
                           else /tmp/\$USER-wdscache.
  -t, --ready-timeout SEC  how long to wait for the agents (default 300).
      --stop-timeout SEC   how long the agents get to stop cleanly (default 60).
      --agent-cpus N       CPUs the agent step may use on each node
                           (default: all CPUs the job has on its smallest node).
      --log-dir DIR        write agent logs to DIR/wdscache-agent-JOBID-NODE.log
                           (default: into the job's own output).
      --srun-opt OPT       extra option for the training srun; repeat as needed,
                           e.g. --srun-opt=--ntasks-per-node=1
  -h, --help               show this help.

Other agent settings are taken from WDSCACHE_* variables in the environment
(WDSCACHE_CACHE_SIZE, WDSCACHE_PREFETCH, WDSCACHE_WORKERS, ...).

Example:
  $PROG --urls \$HOME/data/urls.txt -- torchrun --nnodes=\$SLURM_NNODES ... train.py
EOF
}

log() {
    printf '%s %s: %s\n' "$(date +%H:%M:%S)" "$PROG" "$*" >&2
}

die() {
    log "error: $*"
    exit 1
}

# Exit early (before any trap is set) for a usage error.
usage_error() {
    printf '%s: %s\nTry "%s --help".\n' "$PROG" "$1" "$PROG" >&2
    exit 2
}

is_uint() {
    [[ $1 =~ ^[0-9]+$ ]]
}

# Smallest CPU count the job has on any of its nodes, from a value such as
# SLURM_JOB_CPUS_PER_NODE="64(x2),32".
min_cpus_per_node() {
    local spec=${SLURM_JOB_CPUS_PER_NODE:-} item n min=""
    local -a items=()
    IFS=, read -r -a items <<<"$spec"
    # (The ${a[@]+...} form keeps bash < 4.4 quiet about empty arrays under set -u.)
    for item in ${items[@]+"${items[@]}"}; do
        n=${item%%(*}
        is_uint "$n" || continue
        if [[ -z $min ]] || ((n < min)); then
            min=$n
        fi
    done
    printf '%s\n' "${min:-1}"
}

# --- Options -------------------------------------------------------------------

urls=${WDSCACHE_URLS:-}
cache_dir=${WDSCACHE_CACHE_DIR:-}
ready_timeout=300
stop_timeout=60
agent_cpus=""
log_dir=""
train_srun_opts=()

need_arg() {
    [[ $# -ge 2 && -n $2 ]] || usage_error "option $1 needs a value"
}

while [[ $# -gt 0 ]]; do
    case $1 in
        -h | --help) usage; exit 0 ;;
        -u | --urls) need_arg "$@"; urls=$2; shift 2 ;;
        --urls=*) urls=${1#*=}; shift ;;
        -d | --cache-dir) need_arg "$@"; cache_dir=$2; shift 2 ;;
        --cache-dir=*) cache_dir=${1#*=}; shift ;;
        -t | --ready-timeout) need_arg "$@"; ready_timeout=$2; shift 2 ;;
        --ready-timeout=*) ready_timeout=${1#*=}; shift ;;
        --stop-timeout) need_arg "$@"; stop_timeout=$2; shift 2 ;;
        --stop-timeout=*) stop_timeout=${1#*=}; shift ;;
        --agent-cpus) need_arg "$@"; agent_cpus=$2; shift 2 ;;
        --agent-cpus=*) agent_cpus=${1#*=}; shift ;;
        --log-dir) need_arg "$@"; log_dir=$2; shift 2 ;;
        --log-dir=*) log_dir=${1#*=}; shift ;;
        --srun-opt) need_arg "$@"; train_srun_opts+=("$2"); shift 2 ;;
        --srun-opt=*) train_srun_opts+=("${1#*=}"); shift ;;
        --) shift; break ;;
        -*) usage_error "unknown option: $1" ;;
        *) break ;;
    esac
done

[[ $# -gt 0 ]] || usage_error "no training command given"
[[ -n $urls ]] || usage_error "no URL list: pass --urls FILE or set WDSCACHE_URLS"
is_uint "$ready_timeout" || usage_error "--ready-timeout must be a number of seconds"
is_uint "$stop_timeout" || usage_error "--stop-timeout must be a number of seconds"
[[ -z $agent_cpus ]] || is_uint "$agent_cpus" || usage_error "--agent-cpus must be a number"

# --- Environment checks ----------------------------------------------------------

[[ -n ${SLURM_JOB_ID:-} ]] ||
    die "not inside a Slurm allocation (SLURM_JOB_ID is unset); run this from an sbatch script or salloc"
for tool in srun squeue scancel; do
    command -v "$tool" >/dev/null || die "$tool not found in PATH"
done
wdscache_bin=${WDSCACHE_BIN:-wdscache}
command -v "$wdscache_bin" >/dev/null ||
    die "$wdscache_bin not found in PATH (pip install a clone of wdscache or its wheel, or set WDSCACHE_BIN)"

[[ -r $urls ]] || die "URL list $urls is not readable"
# Absolute path: the agents on other nodes do not share our working directory.
urls=$(realpath -- "$urls")

if [[ -z $cache_dir ]]; then
    if [[ -n ${SLURM_TMPDIR:-} ]]; then
        cache_dir=$SLURM_TMPDIR/wdscache
    else
        cache_dir=/tmp/${USER:-$(id -un)}-wdscache
    fi
fi
[[ $cache_dir == /* ]] || die "cache dir must be an absolute path: $cache_dir"

nnodes=${SLURM_JOB_NUM_NODES:-${SLURM_NNODES:-1}}
[[ -n $agent_cpus ]] || agent_cpus=$(min_cpus_per_node)
[[ -z $log_dir ]] || mkdir -p -- "$log_dir"

export WDSCACHE_CACHE_DIR=$cache_dir
export WDSCACHE_URLS=$urls
# Each node's agent writes its pid here (a node-local file): the launcher waits for that
# agent and stops that one, never another job's agent on the same cache dir.
readonly PID_FILE="${TMPDIR:-/tmp}/wdscache-agent-${SLURM_JOB_ID}-$$.pid"
# The pid of the agent `wdscache stats --json` shows (read from stdin), else nothing.
# shellcheck disable=SC2016  # expanded by the inner bash, not here
readonly STATS_PID='sed -n "/\"agent\": *{/,/\"pid\"/ s/.*\"pid\": *\([0-9][0-9]*\).*/\1/p"'

# --- Stopping the agents (runs at exit) -----------------------------------------------

agent_srun_pid=""
agent_step=""
check_srun_pid=""
train_pid=""
signalled=""
readonly AGENT_STEP_NAME=wdscache-agent

# Id (JOBID.STEP) of the agent step, found by its name.
find_agent_step() {
    squeue --steps --jobs "$SLURM_JOB_ID" --noheader --format='%i %j' 2>/dev/null |
        awk -v name="$AGENT_STEP_NAME" '$2 == name { print $1; exit }'
}

# Wait up to $2 seconds for process $1 to end; status 0 if it did.
wait_gone() {
    local pid=$1 left=$2
    while kill -0 "$pid" 2>/dev/null; do
        ((left > 0)) || return 1
        sleep 1
        left=$((left - 1))
    done
    return 0
}

# Only reached with training still running if this script itself was
# interrupted; its srun then kills the training tasks (the job is ending anyway).
stop_training() {
    [[ -n $train_pid ]] || return 0
    if kill -0 "$train_pid" 2>/dev/null; then
        log "stopping the training step"
        kill "$train_pid" 2>/dev/null || true
        wait_gone "$train_pid" 30 || kill -KILL "$train_pid" 2>/dev/null || true
    fi
    wait "$train_pid" 2>/dev/null || true
    train_pid=""
}

# SIGTERM to this job's agent process on every node (the pid it wrote, if `wdscache
# stats` shows it running), in a short step; status 0 if every node's agent got it.
# Not `scancel --signal`: that signals every process of the step, the agent's worker
# processes too, and the agent would log them as died and start new ones while it stops.
signal_agents() {
    # shellcheck disable=SC2016  # expanded by the inner bash, not here
    timeout 60 srun --job-name=wdscache-stop --nodes="$nnodes" --ntasks="$nnodes" --ntasks-per-node=1 \
        --overlap --export=ALL --kill-on-bad-exit=0 bash -c '
        mine=$(cat "$3" 2>/dev/null) || mine=""
        pid=$("$1" stats --cache-dir "$2" --json 2>/dev/null | eval "$4")
        if [[ -z $mine || $pid != "$mine" ]] || ! kill -TERM "$pid"; then
            printf "no running wdscache agent of this job on %s to stop\n" "$(hostname)" >&2
            exit 1
        fi
        rm -f -- "$3"
    ' wdscache-stop "$wdscache_bin" "$cache_dir" "$PID_FILE" "$STATS_PID"
}

stop_agents() {
    if [[ -n $check_srun_pid ]] && kill -0 "$check_srun_pid" 2>/dev/null; then
        kill "$check_srun_pid" 2>/dev/null || true
    fi
    [[ -n $agent_srun_pid ]] || return 0
    # When this script got SIGTERM, Slurm has usually signalled the agents
    # too (scancel, time limit). A second SIGTERM would make an agent exit at
    # once, skipping its cleanup, so first give them a moment to end by themselves.
    if [[ -n $signalled ]] && kill -0 "$agent_srun_pid" 2>/dev/null; then
        wait_gone "$agent_srun_pid" 15 || true
    fi
    if kill -0 "$agent_srun_pid" 2>/dev/null; then
        [[ -n $agent_step ]] || agent_step=$(find_agent_step || true)
        local how=""
        if [[ -z $signalled ]]; then
            log "stopping the agents (SIGTERM to each node's agent, up to ${stop_timeout}s)"
            if signal_agents; then
                how=pid
            else
                log "could not signal every node's agent by its pid"
            fi
        fi
        if [[ -z $how && -n $agent_step ]]; then
            # Sending SIGTERM to the srun process instead would make srun SIGKILL its tasks.
            log "stopping the agents (step $agent_step, SIGTERM, up to ${stop_timeout}s)"
            scancel --quiet --signal=TERM "$agent_step" || true
            how=step
        fi
        if [[ -n $how ]]; then
            if ! wait_gone "$agent_srun_pid" "$stop_timeout"; then
                log "agents still running after ${stop_timeout}s; killing them"
                kill "$agent_srun_pid" 2>/dev/null || true
            fi
        else
            log "cannot find the agent step with squeue; killing the agents"
            kill "$agent_srun_pid" 2>/dev/null || true
        fi
        if ! wait_gone "$agent_srun_pid" 10; then
            kill -KILL "$agent_srun_pid" 2>/dev/null || true
        fi
    fi
    local agent_rc=0
    wait "$agent_srun_pid" 2>/dev/null || agent_rc=$?
    agent_srun_pid=""
    log "agents stopped (their step's status $agent_rc)"
}

on_exit() {
    local rc=$?
    trap - EXIT INT TERM
    stop_training
    stop_agents
    exit "$rc"
}
trap on_exit EXIT
# SIGINT (Ctrl-C under salloc) does not stop srun's tasks, so the agents need
# our SIGTERM right away; only after a SIGTERM do we give them time first.
trap 'log "interrupted"; exit 130' INT
trap 'signalled=TERM; log "terminated"; exit 143' TERM

# --- Start one agent per node ----------------------------------------------------

agent_srun_opts=(
    --job-name="$AGENT_STEP_NAME"
    --nodes="$nnodes" --ntasks="$nnodes" --ntasks-per-node=1
    --cpus-per-task="$agent_cpus"
    --overlap
    --kill-on-bad-exit=0
    --export=ALL
)
if [[ -n $log_dir ]]; then
    agent_srun_opts+=(--output="$log_dir/wdscache-agent-%j-%N.log")
fi

log "starting $nnodes agent(s): cache dir $cache_dir, URL list $urls"
# The inner script runs on each node: create the private cache dir if needed,
# write its pid (exec keeps it), then become the agent (one task per node: its --node-rank
# and --num-nodes default from the task's SLURM_NODEID and SLURM_NNODES). Its arguments
# are $1 (wdscache) $2 (dir) $3 (urls) $4 (the pid file).
# shellcheck disable=SC2016  # expanded by the inner bash, not here
srun "${agent_srun_opts[@]}" bash -c '
    mkdir -p -m 0700 -- "$2" || exit 1
    printf "%s\n" "$$" >"$4" || exit 1
    exec "$1" agent --cache-dir "$2" --urls "$3"
' wdscache-agent "$wdscache_bin" "$cache_dir" "$urls" "$PID_FILE" &
agent_srun_pid=$!

# --- Wait until every node answers --------------------------------------------------

log "waiting up to ${ready_timeout}s for the agents"
# One step, one task per node, each polling its own node's agent until the
# deadline. A node that is not ready prints its name and the last output.
# `wdscache stats` also succeeds on a cache left by an earlier agent ("agent":
# null), and on an agent that runs but gave no reply in time ("answering": false;
# busy, say, re-reading a huge URL list), so "ready" means: it succeeds, the agent
# answers ("answering": true), and it is the one this job started (its pid; another
# job's agent on the same cache dir would serve that job's list). A busy agent is
# waited for, as a starting one; this job's agent that exited fails the wait at once.
# shellcheck disable=SC2016  # expanded by the inner bash, not here
srun --job-name=wdscache-wait --nodes="$nnodes" --ntasks="$nnodes" --ntasks-per-node=1 \
    --overlap --export=ALL --kill-on-bad-exit=0 bash -c '
    deadline=$((SECONDS + $3))
    until out=$("$1" stats --cache-dir "$2" --json 2>&1) &&
        grep -Eq "\"answering\": *true" <<<"$out" &&
        mine=$(cat "$4" 2>/dev/null) && [[ $(eval "$5" <<<"$out") == "$mine" ]]; do
        mine=$(cat "$4" 2>/dev/null) || mine=""
        if [[ -n $mine ]] && ! kill -0 "$mine" 2>/dev/null; then
            printf "the wdscache agent this job started on %s (pid %s) exited before it was ready (see its log); \"wdscache stats\" shows:\n%s\n" \
                "$(hostname)" "$mine" "$out" >&2
            exit 1
        fi
        if ((SECONDS >= deadline)); then
            printf "wdscache agent on %s not ready after %ss; last \"wdscache stats\" output:\n%s\n" \
                "$(hostname)" "$3" "$out" >&2
            exit 1
        fi
        sleep 2
    done
' wdscache-wait "$wdscache_bin" "$cache_dir" "$ready_timeout" "$PID_FILE" "$STATS_PID" &
check_srun_pid=$!

# Also watch the agents: if their step ends (every agent failed), stop waiting.
while kill -0 "$check_srun_pid" 2>/dev/null; do
    if ! kill -0 "$agent_srun_pid" 2>/dev/null; then
        agent_rc=0
        wait "$agent_srun_pid" || agent_rc=$?
        agent_srun_pid=""
        die "the agents exited (status $agent_rc) before all of them were ready; see their log above${log_dir:+ or in $log_dir}"
    fi
    [[ -n $agent_step ]] || agent_step=$(find_agent_step || true)
    sleep 1
done
check_rc=0
wait "$check_srun_pid" || check_rc=$?
check_srun_pid=""
((check_rc == 0)) ||
    die "not every node has a ready agent within ${ready_timeout}s (cache dir $cache_dir); see the messages above"
[[ -n $agent_step ]] || agent_step=$(find_agent_step || true)
log "all $nnodes agent(s) ready${agent_step:+ (step $agent_step)}"

# --- Training ---------------------------------------------------------------------------

log "running: $*"
# In the background so that a signal reaches our trap without waiting for srun.
srun --export=ALL ${train_srun_opts[@]+"${train_srun_opts[@]}"} "$@" &
train_pid=$!
train_rc=0
wait "$train_pid" || train_rc=$?
train_pid=""
log "training command exited with status $train_rc"
exit "$train_rc"
