"""Why a job waits for data, as one line: a pure function of a stats object (:mod:`wdscache.shared.stats`).

A job is starved when one of its ranks spent more than :data:`STARVED` of its recent
time waiting for data. What starves it, checked in this order (the first cause hides the
later ones), each of the job's own waits where the agent says whose they are
(``agent.demanded_by_job`` and the other ``*_by_job`` counts, ``retrying[].jobs``; another job
waiting for downloads does not make this one's wait a download's, nor another job's thrashing
this one's):

- ``budget``: the readers hold more bytes at once (``agent.need_bytes``) than the budget
  (``bytes_limit``), and shards this job waits for wait for room in it or are downloaded again
  (``agent.demanded_room_by_job``): shards still needed are evicted and downloaded again;
- ``disk``: readers wait for shards (``agent.demanded``) while the cache's file system is short
  (``agent.disk.short``): full (it refused a write, and no download starts until it has room), or
  with less than ``--min-free`` free (a shard a reader waits for waits for space). A full disk
  stops every download: more download workers or a better source would not help;
- ``files``: readers wait for shards while downloads wait for open files (``agent.out_of_files``):
  the agent's limit (``ulimit -n``) is too low for its downloads;
- ``failing_source``: readers wait for shards whose downloads fail and are retried
  (``agent.retrying``);
- ``silent_source``: readers wait for shards whose downloads got no byte from their source for
  ``SENDS_NOTHING_AFTER`` seconds (``agent.demanded_silent_by_job``): it accepted, but sends
  nothing (until the read timeout fails the attempt);
- ``downloads``: readers wait for shards whose downloads wait for a slot themselves
  (``agent.demanded_queued``): more download workers would start them;
- ``slow_source``: readers wait for shards downloading, or for the agent to ask the source whether
  a copy an earlier run cached is current, and none of those waits for a slot: the source (or the
  link) is slow. While other downloads (prefetches) wait for a slot meanwhile, more download
  workers or parts would fetch ahead of the readers; else fetching further ahead (``--prefetch``)
  would;
- ``workers``: the sample workers are busy more than :data:`WORKERS_BUSY` of the time, or one
  has not reported for :data:`SUSPECT_AFTER` seconds (they report every second: stuck on a
  request, or stopped);
- ``latency``: none of these: the consumer's own reads (receiving and decoding samples) are slow,
  as on a machine whose cores are all busy. A slow transform is no wait: it shows as a low rate.
  A rank's wait is of its last report (about a second), the causes of the moment: for about a
  report after its wait's cause went (a shard it waited for came, a stopped worker went on), or
  before that cause shows (a worker stopped less than :data:`SUSPECT_AFTER` ago), a waiting
  rank is told this.

A rank whose process ended mid-epoch (no bye: killed, crashed) while its job's other ranks read on
is named after the verdict, as gone (``ended_jobs``' ``gone``), and so is one that stopped
reporting (``silent_s``).
"""

from __future__ import annotations

from collections.abc import Collection, Mapping
from dataclasses import dataclass
from datetime import datetime
from typing import Any

from .config import format_size

STARVED = 0.2  # a rank waiting more than this fraction of its time is starved
WORKERS_BUSY = 0.8  # workers busy more than this fraction of the time are the bottleneck
# Consumers and workers report every second: one silent this long is stopped or hung, its last
# report no longer holds (a rank's rate and wait; a worker is counted busy).
SILENT_AFTER = 5.0
# A worker that has not reported for this long while a rank waits is named (not yet counted busy):
# two reports missed, where a rank's wait alone would read as its own slow reads.
SUSPECT_AFTER = 2.0
# A download waited for that got no byte from its source for this long: the source sends nothing.
SENDS_NOTHING_AFTER = 3.0
KINDS = (
    "budget",
    "disk",
    "files",
    "failing_source",
    "silent_source",
    "downloads",
    "slow_source",
    "workers",
    "latency",
)


@dataclass(frozen=True)
class Verdict:
    """``kind``: None (not starved, or ended) or one of :data:`KINDS`; ``text``: the line to show."""

    kind: str | None
    text: str


def job_counts(waited_for: Mapping[str, Collection[str]]) -> dict[str, int]:
    """``agent.demanded_by_job`` of the shards waited for (url -> the jobs whose readers wait)."""
    counts: dict[str, int] = {}
    for jobs in waited_for.values():
        for job in jobs:
            counts[job] = counts.get(job, 0) + 1
    return counts


def starved_by(stats: dict[str, Any], job: str | None = None) -> str | None:
    """What a rank (of ``job``; None: of any) that waits for data waits for, in this agent's state
    (one of :data:`KINDS`; None without an agent)."""
    agent = stats.get("agent")
    if not agent:
        return None
    limit = stats.get("bytes_limit") or 0
    if limit and agent.get("need_bytes", 0) > limit and _own(agent, "demanded_room", job, default=1) > 0:
        return "budget"
    if _own(agent, "demanded", job) > 0:
        if (agent.get("disk") or {}).get("short"):
            return "disk"
        if agent.get("out_of_files"):
            return "files"
        if _failing(agent, job):
            return "failing_source"
        if _own(agent, "demanded_silent", job) > 0:
            return "silent_source"
        return "downloads" if _queued_waits(stats, job) > 0 else "slow_source"
    busy = [w["busy"] for w in agent.get("workers", []) if isinstance(w.get("busy"), (int, float))]
    if (busy and sum(busy) / len(busy) > WORKERS_BUSY) or _silent_workers(agent):
        return "workers"
    return "latency"


def _own(agent: dict[str, Any], count: str, job: str | None, default: int = 0) -> int:
    """``agent[count]`` (a count of the shards readers wait for), of ``job``'s readers when the agent
    says whose they are (``<count>_by_job``); ``default`` from an agent that does not count it."""
    if job is not None and "demanded_by_job" in agent:
        by_job = agent.get(f"{count}_by_job")
        return default if by_job is None else int(by_job.get(job, 0))
    return int(agent.get(count, default))


def disk_short(stats: dict[str, Any]) -> str | None:
    """What the cache's file system lacks, as a sentence that says what to do (``agent.disk``), while
    downloads wait for it; None while they do not, or without an agent that says."""
    disk = (stats.get("agent") or {}).get("disk") or {}
    short = disk.get("short")
    if not short:
        return None
    free = disk.get("free_bytes", 0)
    where = (
        f"the file system of {stats.get('cache_dir')} has {format_size(free) if free >= 1024 else f'{free} bytes'} free"
    )
    if short == "full":
        return (
            f"{where} and refused a write ({disk.get('error')}): no download starts until it has room: "
            "free space on it, or lower --cache-size and raise --min-free (the agent then keeps room free)"
        )
    return (
        f"{where}, less than --min-free {format_size(disk.get('min_free', 0))} (and room for the index): "
        "the shards readers wait for wait for space: free space on it, or lower --min-free"
    )


def files_short(stats: dict[str, Any]) -> str | None:
    """That the agent is short of open files (it ran out, or downloads leave the last ones to
    connections), as a sentence that says what to do (``agent.out_of_files``), while downloads wait
    for them; None while they do not, or without an agent that says."""
    fault = (stats.get("agent") or {}).get("out_of_files")
    return f"the agent is short of open files, downloads wait: {fault}" if fault else None


def _queued_waits(stats: dict[str, Any], job: str | None) -> int:
    """How many of the shards readers (of ``job``) wait for wait for a download slot; from an agent
    that does not say (an older one), every queued shard is taken for one."""
    agent = stats["agent"]
    if job is not None and "demanded_queued_by_job" in agent:
        return int(agent["demanded_queued_by_job"].get(job, 0))
    if "demanded_queued" in agent:
        return int(agent["demanded_queued"])
    return int(stats.get("shards", {}).get("queued", 0))


def _failing(agent: dict[str, Any], job: str | None) -> list[dict[str, Any]]:
    """The retrying downloads (``agent.retrying``) that readers of ``job`` wait for: of any job for
    None, or from an agent that does not say whose waits they are."""
    mine = job is not None and "demanded_by_job" in agent
    return [r for r in agent.get("retrying", []) if r.get("demanded") and (not mine or job in r.get("jobs", ()))]


def _silent_workers(agent: dict[str, Any]) -> list[dict[str, Any]]:
    """The workers that have not reported for :data:`SUSPECT_AFTER` seconds (``quiet_s``; past
    :data:`SILENT_AFTER`, ``silent_s`` too), the one quiet longest first."""
    quiet = [w for w in agent.get("workers", []) if w.get("silent_s") or w.get("quiet_s")]
    return sorted(quiet, key=lambda w: -float(w.get("silent_s") or w.get("quiet_s") or 0.0))


def job_verdict(stats: dict[str, Any], ranks: dict[str, dict[str, Any]], job: str | None = None) -> Verdict:
    """The verdict on one live job (``job``; ``ranks``: its entry of ``stats["jobs"]``); ranks whose
    process ended mid-epoch (``ended_jobs``' ``gone``, none of their consumers live) and ranks that
    stopped reporting (``silent_s``) are named after it."""
    verdict = _live_verdict(stats, ranks, job)
    text = verdict.text
    for rank, r in gone_ranks(stats, job, ranks):
        world = f" of {r['world']}" if r.get("world") else ""
        text += f"; rank {rank}{world} gone at {_clock(r.get('ended'))} (its process ended mid-epoch)"
    silent = sorted((r["silent_s"], rank) for rank, r in ranks.items() if r.get("silent_s"))
    if silent:
        named = ", ".join(rank for _, rank in silent)
        text += f"; rank {named} silent for {silent[-1][0]:.0f}s (its process stopped or hung?)"
    return Verdict(verdict.kind, text)


def gone_ranks(
    stats: dict[str, Any], job: str | None, ranks: dict[str, dict[str, Any]]
) -> list[tuple[str, dict[str, Any]]]:
    """The ranks of live job ``job`` (its live ``ranks``) whose process ended mid-epoch, none of
    their consumers live (their entries of ``stats["ended_jobs"]``), by rank."""
    ended = stats.get("ended_jobs", {}).get(job, {}) if job is not None else {}
    gone = [(rank, r) for rank, r in ended.items() if r.get("gone") and rank not in ranks]
    return sorted(gone, key=lambda rr: int(rr[0]) if rr[0].isdigit() else 0)


def _clock(when: Any) -> str:
    """The time of day (HH:MM:SS) of an ISO 8601 date, as it says it; the date as it is otherwise."""
    try:
        return datetime.fromisoformat(str(when)).strftime("%H:%M:%S")
    except ValueError:
        return str(when)


def _live_verdict(stats: dict[str, Any], ranks: dict[str, dict[str, Any]], job: str | None) -> Verdict:
    waiting = max((r.get("waiting", 0.0) for r in ranks.values()), default=0.0)
    if waiting <= STARVED:
        return Verdict(None, "not starved")
    kind = starved_by(stats, job) or "latency"
    agent = stats.get("agent") or {}
    if kind == "budget":
        need = agent["need_bytes"]
        return Verdict(
            kind, f"starved by the budget: the cache thrashes, needs {format_size(need)} (--cache-size {need})"
        )
    if kind == "disk":
        return Verdict(kind, f"starved by the disk: {disk_short(stats)}")
    if kind == "files":
        return Verdict(
            kind,
            f"starved by open files: downloads of shards waited for wait for files ({agent['out_of_files']}): "
            "raise ulimit -n for the agent (or LimitNOFILE= in its systemd unit)",
        )
    if kind == "failing_source":
        failing = _failing(agent, job)
        return Verdict(
            kind,
            f"starved by a failing source: {len(failing)} download(s) waited for fail and are retried "
            f"({failing[0]['url']}: {failing[0]['error']}): check the source",
        )
    if kind == "silent_source":
        return Verdict(
            kind,
            f"starved by a source that sends nothing: {_own(agent, 'demanded_silent', job)} download(s) waited "
            f"for got no byte for {SENDS_NOTHING_AFTER:.0f}s or more (the source accepted, then sent nothing): "
            "check the source (--read-timeout ends such an attempt, which is retried)",
        )
    if kind == "downloads":
        return Verdict(
            kind, "starved by downloads: shards waited for wait for a download slot: raise --download-workers"
        )
    if kind == "slow_source":
        rate = format_size(stats.get("download_rate", 0))
        queued = int(stats.get("shards", {}).get("queued", 0))
        if queued:  # the slots are all taken: more of them fetch ahead of the readers
            return Verdict(
                kind,
                f"starved by a slow source: the shards waited for are downloading, {queued} other download(s) "
                f"wait for a slot, downloads get {rate}/s in all: raise --download-workers (or --download-parts) "
                "to fetch more at once, or check the source",
            )
        return Verdict(
            kind,
            f"starved by a slow source: no shard waited for waits for a download slot, downloads get "
            f"{rate}/s in all: raise --prefetch to download further ahead, or check the source",
        )
    if kind == "workers":
        stuck = _silent_workers(agent)
        if stuck:
            quiet = stuck[0].get("silent_s") or stuck[0]["quiet_s"]
            return Verdict(
                kind,
                f"starved by workers: worker {stuck[0].get('index')} has not reported for "
                f"{quiet:.0f}s (stuck on a request, or stopped): see the agent's log",
            )
        return Verdict(kind, "starved by workers: raise --workers, if the machine has idle cores")
    return Verdict(
        kind,
        "waiting for data, but not for downloads, workers or the budget: "
        "the consumer's own reads are slow (a machine whose cores are all busy?)",
    )


def ended_verdict(ranks: dict[str, dict[str, Any]]) -> Verdict:
    """The line of a job whose consumers all left (its entry of ``stats["ended_jobs"]``): its totals
    over all its epochs."""
    samples = sum(int(r.get("samples", 0)) for r in ranks.values())
    waited = sum(float(r.get("wait_s", 0.0)) for r in ranks.values())
    last = max((str(r.get("ended") or "") for r in ranks.values()), default="")
    epochs = max((int(r.get("epochs", 1)) for r in ranks.values()), default=1)
    over = f" in {epochs} epochs" if epochs > 1 else ""
    return Verdict(None, f"ended {last}{_how(ranks)}: {samples} samples{over}, waited {waited:.1f}s for data in all")


def _how(ranks: dict[str, dict[str, Any]]) -> str:
    """How a job ended, as its ranks' byes said: with an error of ours raised to the script (the
    first rank's that had one); nothing otherwise."""
    failed = sorted((rank, r["end_error"]) for rank, r in ranks.items() if r.get("end_error"))
    return f" with an error (rank {failed[0][0]}: {failed[0][1]})" if failed else ""


def verdicts(stats: dict[str, Any]) -> dict[str, Verdict]:
    """Every job's verdict: live jobs', and ended jobs' (their totals) when no rank of theirs is live."""
    out = {job: job_verdict(stats, ranks, job) for job, ranks in stats.get("jobs", {}).items()}
    for job, ranks in stats.get("ended_jobs", {}).items():
        out.setdefault(job, ended_verdict(ranks))
    return out
