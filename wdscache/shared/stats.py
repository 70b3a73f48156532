"""``wdscache stats``: what the cache holds and what the agent is doing.

The object (also ``wdscache stats --json``)::

    cache_dir         the cache directory
    bytes_used        bytes of complete cached shards and their sample table files
    table_bytes       of those, the sample table files' (kept so that a restarted agent need
                      not walk each shard's tar headers again)
    bytes_limit       the budget (of the running agent, else of the last one)
    shards            counts by state: cached, downloading, queued, failed
    failed            [{url, error}] (at most 100 listed)
    hits, misses      shard opens that found the shard cached / had to wait for it
    bytes_downloaded  bytes fetched over the cache's life, in ``downloads`` completed downloads
    redownloads       of those, downloads of a shard this cache held before (evicted, changed or
                      damaged), with their bytes in bytes_redownloaded: many in one epoch mean
                      the budget is too small for what the readers hold (the agent warns)
    corrupt           shards found unreadable by consumers (their URLs: agent.corrupt)
    changed           cached shards found changed on the server and fetched again (agent.changed)
    download_rate     bytes/s over the last 10 s while downloads run; 0 once none runs (or no
                      agent runs)
    agent             null when no agent runs, else {pid, uptime_s, endpoint, answering (true), consumers,
                      workers: [{index, busy_s, busy (fraction, recent), requests, samples, bytes,
                      indexed (shards), walked / adopted / loaded (shards whose table the worker
                      walked itself / took from another worker / read from the cache's table
                      files), quiet_s (no report for over 2 s), silent_s (no report for that
                      long, over SILENT_AFTER: stuck or stopped, and counted busy 1.0)}],
                      worker_restarts, corrupt: [{url, error}], urls (its list's length),
                      pinned (shards being read), job_lists (URL lists held besides its own),
                      waiting_for_space: [{url, reason}] (downloads the budget or --min-free holds up,
                      and while the file system is full the shards readers wait for that it keeps
                      from starting), disk: {free_bytes (of the cache's file system), min_free
                      (--min-free), short: null | "full" (it refused a write: no download starts
                      until it has room) | "min_free" (a shard a reader waits for waits for space:
                      less than --min-free is free), error (the write refused, or why it waits)},
                      out_of_files: null | the error, while downloads wait for open files (a download
                      found none to spare, or its files would eat into those kept for connections:
                      the agent's fault, never the shard's, which is tried again after a backoff),
                      retrying: [{url, error, demanded, jobs}] (downloads whose last attempt failed,
                      retried after a backoff: that attempt's failure, whether a reader waits for the
                      shard, and the jobs whose readers do), demanded (shards readers wait for),
                      demanded_by_job ({job: how many of them its readers wait for}),
                      demanded_queued and demanded_queued_by_job (of those, the ones whose download
                      has not started: they wait for a download slot), demanded_room and
                      demanded_room_by_job (the ones the budget holds up: waiting for room in it, or
                      held before and downloaded again), demanded_silent and demanded_silent_by_job
                      (the ones whose source sent no byte for 3 s), need_bytes
                      (bytes the readers hold at once)};
                      {pid, uptime_s, endpoint, answering: false} when it runs (holds the directory's
                      lock) but gave no reply within ANSWER_TIMEOUT (busy, or stuck): the other fields
                      are then the index's, as with no agent; with ``starting`` (what it is doing:
                      reading its list, checking the cached shards, asking sources for sizes, waiting
                      for its workers) while it starts, not asked then (it answers once started)
    jobs              the ranks consumers read now, of their current epoch (each epoch of a rank is a
                      consumer of its own; its DataLoader workers' added up, ``readers`` of them):
                      {job: {rank: {samples, bytes, rate, wait_s, waiting (fraction, recent), readers,
                      epoch, position (samples of the epoch the job delivered, counted from
                      this rank's), starved: null | "budget" | "disk" | "failing_source" |
                      "downloads" | "slow_source" | "workers" | "latency" (see :mod:`wdscache.shared.verdict`),
                      silent_s (no report for that long, over SILENT_AFTER: rate and waiting 0)}}}
    ended_jobs        the same of the ranks whose consumers left in the last 10 minutes (counted
                      from each rank's latest exit), with their totals over every consumer of the
                      rank that left (its epochs and DataLoader workers: samples, bytes, wait_s
                      summed; epochs: how many distinct epoch numbers; epoch and position: the
                      latest's, and world), ``ended`` (an ISO 8601 date), ``gone`` (the latest
                      consumer's process ended without a bye: killed or crashed mid-epoch), and
                      ``end_error`` when a bye said
                      an error of wdscache's raised to the script ended an epoch (the first,
                      redacted); a job run again under the
                      same name (a rank of it saying hello from another run of the script,
                      named by its hello's ``launch``, while none of its consumers is live)
                      starts its ranks' totals over (rank_totals adds them up); see
                      :mod:`wdscache.agent.ended`
    rank_totals       {job: {rank: {samples, bytes, wait_s}}}: what each rank received, and waited, over
                      the agent's life, every epoch and reader of it together (``jobs`` shows the
                      current epoch's); never decreasing while the agent runs (the metrics' counters).
                      A rank is dropped an hour after its last report once no consumer of it is
                      connected (:mod:`wdscache.agent.rank_totals`); {} when no agent answers

Every string in it (keys too: job names) is shown redacted (:mod:`wdscache.shared.redact`): a
failure's URL and error, a job's name. Jobs whose names differ only by a secret stay apart: each
name gets a tag (``#3fa1``) that tells nothing of it
(:func:`~wdscache.shared.redact.shown_names`), the same in every field that names the job.

With an agent running it answers live over the agent's socket; otherwise it
reads the index summary, which costs the same on 10 or 100,000 shards.
"""

from __future__ import annotations

import os
import time
from collections.abc import Callable
from datetime import datetime
from pathlib import Path
from typing import Any

from .client import AgentConnection
from .config import format_size
from .errors import AgentUnavailableError, NoCacheError
from .index import read_summary
from .layout import CacheLayout
from .messages import Requests
from .protocol import process_identity
from .redact import redacted, shown_names
from .verdict import SILENT_AFTER, STARVED, disk_short, ended_verdict, files_short, job_verdict

STATES = ("cached", "downloading", "queued", "failed")
ANSWER_TIMEOUT = 5.0  # seconds a running agent gets to answer stats before it is shown as not answering
ENDED_SHOWN = 5  # jobs that ended lately shown in the text, the latest first (--json has them all)


def build(
    *,
    cache_dir: str,
    summary: dict[str, Any],
    counters: dict[str, int],
    bytes_limit: int | None,
    download_rate: float = 0.0,
    agent: dict[str, Any] | None = None,
    jobs: dict[str, Any] | None = None,
    ended_jobs: dict[str, Any] | None = None,
    rank_totals: dict[str, Any] | None = None,
) -> dict[str, Any]:
    """The stats object from an index summary and counters (shared by agent and reader), every
    string in it redacted (:func:`~wdscache.shared.redact.redacted`): it reaches people (``wdscache
    stats``, ``collect_stats``, ``ShardClient.stats``) and scripts' logs as it is; jobs named
    alike once redacted are told apart (:func:`~wdscache.shared.redact.shown_names`)."""
    counts = summary.get("counts", {})
    shown = shown_names(_job_names(agent, jobs, ended_jobs, rank_totals))
    return redacted(
        {
            "cache_dir": cache_dir,
            "bytes_used": summary.get("bytes_used", 0),
            "table_bytes": summary.get("table_bytes", 0),
            "bytes_limit": bytes_limit,
            "shards": {s: int(counts.get(s, 0)) for s in STATES},
            "failed": [{"url": u, "error": e} for u, e in summary.get("failed", {}).items()],
            "hits": counters.get("hits", 0),
            "misses": counters.get("misses", 0),
            "bytes_downloaded": counters.get("bytes_downloaded", 0),
            "downloads": counters.get("downloads", 0),
            "redownloads": counters.get("redownloads", 0),
            "bytes_redownloaded": counters.get("bytes_redownloaded", 0),
            "corrupt": counters.get("corrupt", 0),
            "changed": counters.get("changed", 0),
            "download_rate": round(download_rate, 1),
            "agent": None if agent is None else _agent_named(agent, shown),
            "jobs": _named(jobs, shown),
            "ended_jobs": _named(ended_jobs, shown),
            "rank_totals": _named(rank_totals, shown),
        }
    )


# The agent's counts by job of the shards readers wait for (see verdict's starved_by).
_BY_JOB = ("demanded_by_job", "demanded_queued_by_job", "demanded_room_by_job", "demanded_silent_by_job")


def _job_names(agent: dict[str, Any] | None, *tables: dict[str, Any] | None) -> list[str]:
    """Every job name in the stats: keys of ``tables`` (``jobs``...) and the agent's fields."""
    names = [job for table in tables for job in table or {}]
    if agent is not None:
        names += (job for table in _BY_JOB if table in agent for job in agent[table])
        names += (job for r in agent.get("retrying", []) for job in r.get("jobs", ()))
    return names


def _named(table: dict[str, Any] | None, shown: dict[str, str]) -> dict[str, Any]:
    """``table`` ({job: ...}) keyed by its jobs' names as shown."""
    return {shown[job]: value for job, value in (table or {}).items()}


def _agent_named(agent: dict[str, Any], shown: dict[str, str]) -> dict[str, Any]:
    """The ``agent`` field with the jobs it names (its ``*_by_job`` counts, retrying[].jobs) as shown."""
    out = dict(agent)
    for table in _BY_JOB:
        if table in agent:
            out[table] = _named(agent[table], shown)
    if "retrying" in agent:
        out["retrying"] = [{**r, "jobs": [shown[job] for job in r.get("jobs", ())]} for r in agent["retrying"]]
    return out


def collect(cache_dir: str | os.PathLike[str], *, timeout: float = ANSWER_TIMEOUT) -> dict[str, Any]:
    """Live stats from the running agent, else from the index, with an agent that runs but gave no
    reply within ``timeout`` shown as not answering, and one still starting (not asked: it answers
    once started) as starting, with what it does; NoCacheError if there is no cache, nor an agent
    starting to make one."""
    layout = CacheLayout.of(cache_dir)
    starting = layout.starting_agent()
    if not layout.is_cache() and starting is None:  # (an agent starting on a new directory makes its index soon)
        raise NoCacheError(cache_dir=str(layout.root), read_only=layout.read_only())
    state = starting or layout.agent_state()
    runs = False if state is None else layout.agent_holds_lock(state["pid"])
    if runs is not False and starting is None:  # (a dead agent's or a starting one's socket would not reply)
        live = ask_agent(layout, timeout)
        if live is not None:
            return live
    summary: dict[str, Any] = {}
    counters: dict[str, int] = {}
    meta: dict[str, Any] = {}
    if layout.is_cache():
        summary, counters, meta = read_summary(layout.index_dir, read_only=layout.read_only() is not None)
    # Without an agent's answer, what is in flight is not known: none, as when none runs.
    counts = dict(summary.get("counts", {}))
    counts["downloading"] = counts["queued"] = 0
    summary["counts"] = counts
    agent = None
    if state is not None and runs:
        agent = {
            "pid": state["pid"],
            "uptime_s": round(_uptime(state), 1),
            "endpoint": state["endpoint"],
            "answering": False,
        }
        if starting is not None:
            agent["starting"] = starting["starting"]
    return build(
        cache_dir=str(layout.root), summary=summary, counters=counters, bytes_limit=meta.get("bytes_limit"), agent=agent
    )


def _uptime(state: dict[str, Any]) -> float:
    """Seconds the agent of ``state`` (agent.json) has run: by the boot clock from its process's
    start when we see that very process (a step of the wall clock since it started, by NTP say,
    would make the wall clock's count wrong, even negative); else (another machine or pid
    namespace: the agent is no process here) by the wall clock."""
    identity = process_identity(state["pid"])
    if identity is None or identity != state.get("process"):
        return time.time() - state["started"]
    try:
        since_boot = float(Path("/proc/uptime").read_text().split()[0])
    except (OSError, ValueError, IndexError):
        return time.time() - state["started"]
    return since_boot - identity[1] / os.sysconf("SC_CLK_TCK")


def agent_connection(layout: CacheLayout, timeout: float) -> AgentConnection | None:
    """A connection to the agent that seems to serve ``layout`` (its first request tells), else None."""
    state = layout.agent_state()
    if state is None:
        return None
    endpoint = state["endpoint"]
    if endpoint.startswith("ipc://") and not os.path.exists(endpoint[len("ipc://") :]):
        return None
    if not layout.token_path.exists():
        return None  # left by an agent that made no token: none of ours runs
    # No pid check: from another container the agent's pid means nothing; the socket decides.
    # An agent that cannot prove it holds the directory's token is not ours: NotTrustedError.
    return AgentConnection(endpoint, timeout=timeout, cache_dir=layout.root)


def ask_agent(layout: CacheLayout, timeout: float) -> dict[str, Any] | None:
    """The running agent's stats, or None when none answers; an agent of another wire protocol is a
    ProtocolError that names both (it answers, but nothing this install asks of it)."""
    conn = agent_connection(layout, timeout)
    if conn is None:
        return None
    try:
        reply = conn.request(Requests.stats())
        return reply["stats"] if reply.get("ok") else None
    except (AgentUnavailableError, KeyError):
        return None
    finally:
        conn.close()


def with_fraction(prev: dict[str, Any] | None, report: dict[str, Any], total: str, name: str) -> dict[str, Any]:
    """``report`` with when it came (``seen``, shown; ``_mono``, for the next call and
    :func:`silent_for`) and ``name``: the fraction
    of the time since ``prev`` (an earlier result; one without ``total``, made at a start, counts
    from 0) spent in ``total`` (seconds). Without ``prev``, no fraction: the result marks a start."""
    now = time.monotonic()
    out = {**report, "seen": time.time(), "_mono": now}
    if prev is not None and "_mono" in prev and isinstance(report.get(total), (int, float)):
        dt = now - prev["_mono"]
        done = report[total] - prev.get(total, 0.0)
        out[name] = round(min(1.0, max(0.0, done / dt)), 3) if dt > 0 else 0.0
    return out


def silent_for(report: dict[str, Any], now: float) -> float:
    """Seconds since ``report`` (of :func:`with_fraction`) came, at ``now`` (``time.monotonic()``).
    Not by the wall clock (``seen``): a step of it (NTP, a VM resumed) would hide a stopped
    reporter, or show every live one silent for the step."""
    return now - report.get("_mono", now)


def silent_workers(workers: list[dict[str, Any]]) -> str:
    """``, worker I silent for Ns`` for each worker that stopped reporting (``silent_s``), for the text."""
    return "".join(f", worker {w.get('index')} silent for {w['silent_s']:.0f}s" for w in workers if w.get("silent_s"))


def jobs_view(
    consumers: dict[str, dict[str, Any]], starved_by: Callable[[str], str] | None
) -> dict[str, dict[str, Any]]:
    """Consumer reports grouped as {job: {rank: {...}}}, each with what it is starved by (or null;
    always null for consumers that ended, ``starved_by`` None; else ``starved_by(job)``). The consumers of one rank (its
    DataLoader workers, each a consumer) make one: their counts, rates and waits added up, the
    share of time they wait averaged, ``readers`` of them. A live rank whose latest report is
    older than :data:`~wdscache.shared.verdict.SILENT_AFTER` is ``silent_s``: rate and wait 0."""
    keep = ("samples", "bytes", "rate", "wait_s", "waiting", "epoch", "position", "world", "seen", "ended", "_mono")
    jobs: dict[str, dict[str, Any]] = {}
    for c in consumers.values():
        view = {k: c[k] for k in keep if k in c}
        ranks = jobs.setdefault(str(c.get("job")), {})
        rank = str(c.get("rank"))
        ranks[rank] = _together(ranks[rank], view) if rank in ranks else {**view, "readers": 1}
    now = time.monotonic()
    for job, ranks in jobs.items():
        for view in ranks.values():
            silent = silent_for(view, now)
            view.pop("_mono", None)  # (bookkeeping: not shown)
            if starved_by is not None and silent > SILENT_AFTER:  # stopped or hung: its last report no longer holds
                view.update(silent_s=round(silent, 1), rate=0.0, waiting=0.0)
            view["starved"] = starved_by(job) if starved_by is not None and view.get("waiting", 0.0) > STARVED else None
    return jobs


_ADDED = ("samples", "bytes", "rate", "wait_s", "position")  # of a rank's readers together
_LATEST = ("epoch", "world", "seen", "ended", "_mono")


def _together(rank: dict[str, Any], one: dict[str, Any]) -> dict[str, Any]:
    """The view of a rank whose readers so far are ``rank``, with reader ``one`` too."""
    n = rank["readers"]
    out = {**rank, "readers": n + 1}
    for k in _ADDED:
        if k in one:
            out[k] = round(rank.get(k, 0) + one[k], 3) if isinstance(one[k], float) else rank.get(k, 0) + one[k]
    for k in _LATEST:
        if k in one and (k not in rank or (one[k] is not None and (rank[k] is None or one[k] > rank[k]))):
            out[k] = one[k]
    if "waiting" in one:
        out["waiting"] = round((rank.get("waiting", 0.0) * n + one["waiting"]) / (n + 1), 3)
    return out


def public(report: dict[str, Any]) -> dict[str, Any]:
    """A report without its bookkeeping fields."""
    return {k: v for k, v in report.items() if not k.startswith("_") and k not in ("op", "id")}


def latest_ended(s: dict[str, Any]) -> tuple[list[tuple[str, dict[str, Any]]], str]:
    """The jobs of ``s`` that ended lately and have no live rank, the ENDED_SHOWN latest first, as
    (job, ranks); and a line that counts the others ("" if none): shown as text, a machine where
    many short jobs ran would list them all."""
    live = s.get("jobs", {})
    ended = [(job, ranks) for job, ranks in s.get("ended_jobs", {}).items() if job not in live]
    ended.sort(key=lambda jr: max((_moment(r.get("ended")) for r in jr[1].values()), default=0.0), reverse=True)
    more = len(ended) - ENDED_SHOWN
    return ended[:ENDED_SHOWN], f"and {more} more job(s) ended lately (--json lists them)" if more > 0 else ""


def _moment(when: Any) -> float:
    """Seconds since the epoch of an ISO 8601 date with its offset (0 for anything else)."""
    try:
        return datetime.fromisoformat(str(when)).timestamp()
    except ValueError:
        return 0.0


def format_stats(s: dict[str, Any]) -> str:
    """A human-readable summary of a stats object."""
    limit = s.get("bytes_limit")
    used = s["bytes_used"]
    pct = f" ({100 * used / limit:.0f}%)" if limit else ""
    shards = s["shards"]
    lookups = s["hits"] + s["misses"]
    hit_rate = f"{100 * s['hits'] / lookups:.0f}%" if lookups else "-"
    lines = [
        f"cache      {s['cache_dir']}",
        f"used       {format_size(used)} of {format_size(limit) if limit else '?'}{pct}"
        + (f", {format_size(s['table_bytes'])} of it sample tables" if s.get("table_bytes") else ""),
        "shards     " + ", ".join(f"{shards[k]} {k}" for k in STATES),
        f"hits       {s['hits']} hits, {s['misses']} misses (hit rate {hit_rate})",
        f"downloaded {format_size(s['bytes_downloaded'])} in all ({s.get('downloads', 0)} shards, "
        f"{s.get('redownloads', 0)} re-download(s) of {format_size(s.get('bytes_redownloaded', 0))}), "
        f"now {format_size(s['download_rate'])}/s",
    ]
    agent = s.get("agent")
    if agent:
        doing = f"{agent.get('consumers', 0)} consumer(s)" if agent.get("answering") else "running but not answering"
        if agent.get("starting"):
            doing = f"starting: {agent['starting']}"
        lines.append(
            f"agent      pid {agent['pid']}, up {agent['uptime_s']:.0f}s, {doing}, endpoint {agent.get('endpoint', '?')}"
        )
    else:
        lines.append("agent      not running")
    if agent and agent.get("workers"):
        busy = [w.get("busy") for w in agent["workers"] if w.get("busy") is not None]
        load = f"{100 * sum(busy) / len(busy):.0f}% busy" if busy else "starting"
        lines.append(
            f"workers    {len(agent['workers'])} ({load}), {agent.get('worker_restarts', 0)} restart(s)"
            + silent_workers(agent["workers"])
        )
    short = disk_short(s)
    if short:
        lines.append(f"disk       {short}")
    files = files_short(s)
    if files:
        lines.append(f"files      {files}")
    for job, ranks in sorted(s.get("jobs", {}).items()):
        lines.append(f"job {job}: {job_verdict(s, ranks, job).text}")  # the cause, and what to do
        for rank, r in sorted(ranks.items(), key=lambda kv: int(kv[0]) if kv[0].isdigit() else 0):
            starved = f"STARVED by {r['starved'].replace('_', ' ')}" if r.get("starved") else "not starved"
            if r.get("silent_s"):
                starved = f"silent for {r['silent_s']:.0f}s (its process stopped or hung?)"
            readers = f" ({r['readers']} readers)" if r.get("readers", 1) > 1 else ""  # its DataLoader workers
            lines.append(
                f"  rank {rank}{readers}: {r.get('samples', 0)} samples, {format_size(r.get('bytes', 0))}, "
                f"{r.get('rate', 0):.0f} samples/s, waited {r.get('wait_s', 0):.1f}s "
                f"({100 * r.get('waiting', 0):.0f}% now), {starved}"
            )
    shown, more = latest_ended(s)
    lines.extend(f"job {job}: {ended_verdict(ranks).text}" for job, ranks in shown)
    if more:
        lines.append(more)
    for w in (agent or {}).get("waiting_for_space", [])[:20]:
        lines.append(f"waiting    {w['url']}: {w['reason']}")
    for r in (agent or {}).get("retrying", [])[:20]:
        lines.append(f"retrying   {r['url']}: {r['error']}")
    if s["failed"]:
        lines.append(f"failed     {shards['failed']} shard(s):")
        lines.extend(f"  {f['url']}: {f['error']}" for f in s["failed"][:20])
    return "\n".join(lines)
