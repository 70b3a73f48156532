"""Prometheus metrics of a stats object (:mod:`wdscache.shared.stats`), through ``prometheus_client``.

One custom collector builds every metric from a stats snapshot when scraped, so nothing is
counted twice: the agent's ``/metrics`` (``wdscache agent --metrics-port``) and
``wdscache stats --prometheus`` (for node_exporter's textfile collector) give the same text.
``prometheus_client`` is the optional extra ``wdscache[metrics]``.

The metrics (counters end in ``_total``; sizes are bytes, times seconds)::

    wdscache_agent_up                         1 while an agent runs, else 0
    wdscache_agent_answering                  1 while it answers; 0 when it runs but gave stats no reply
                                              in time (busy, or stuck), or none runs. An agent that
                                              runs but does not answer gives only these three and the
                                              cache's gauges: its counters are not known then
    wdscache_agent_starting                   1 while the agent starts (it holds the cache directory but
                                              answers only once started: up 1, answering 0), else 0
    wdscache_cache_bytes                      bytes of cached shards
    wdscache_cache_table_bytes                of those, the sample table files
    wdscache_cache_limit_bytes                the budget
    wdscache_cache_reserved_bytes             reserved by downloads in flight
    wdscache_shards{state}                    shards by state: cached, downloading, queued, failed
    wdscache_hits_total, wdscache_misses_total  opens that found the shard cached / had to wait
    wdscache_download_bytes_total             bytes downloaded over the cache's life
    wdscache_downloads_total                  downloads completed
    wdscache_redownloads_total                of those, of shards the cache held before (thrashing)
    wdscache_redownload_bytes_total           their bytes
    wdscache_corrupt_total, wdscache_changed_total  shards found damaged / changed at the source
    wdscache_download_rate_bytes_per_second   over the last 10 s while downloads run, else 0
    wdscache_need_bytes                       bytes the readers hold at once (above the budget: thrashing)
    wdscache_demanded_shards                  shards readers wait for now
    wdscache_disk_free_bytes                  free bytes of the cache's file system
    wdscache_disk_short                       1 while downloads wait for that file system: full (it
                                              refused a write), or a shard readers wait for waits for
                                              space with less than --min-free free; else 0
    wdscache_files_short                      1 while downloads wait for open files (the agent's limit,
                                              ulimit -n, is too low for them), else 0
    wdscache_pinned_shards                    shards being read
    wdscache_consumers                        consumers connected
    wdscache_worker_busy_seconds_total{worker}, wdscache_worker_samples_total{worker},
    wdscache_worker_bytes_total{worker}       the sample workers' work
    wdscache_worker_restarts_total            sample workers restarted
    wdscache_consumer_samples_total{job,rank}, wdscache_consumer_bytes_total{job,rank},
    wdscache_consumer_wait_seconds_total{job,rank}  what each rank got, and waited, over the agent's life:
                                              every epoch of it (stats' rank_totals), kept an hour
                                              after its last consumer left
    wdscache_consumer_samples_per_second{job,rank}  a rank of a live job: its recent sample rate
    wdscache_consumer_waiting_ratio{job,rank} and the share of its recent time spent waiting for data
    wdscache_consumer_silent_seconds{job,rank}  seconds since the rank's last report once over 5 s (its
                                              process stopped or hung: then its rate and waiting are 0),
                                              0 while it reports
    wdscache_job_starved{job,reason}          1 for a live job that is starved, by its reason
                                              (budget, disk, files, failing_source, silent_source,
                                              downloads, slow_source, workers, latency), else 0
    wdscache_job_ranks_gone{job}              ranks of a live job whose process ended mid-epoch (no
                                              bye: killed, crashed), none of their consumers live
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from typing import Any

from .errors import ConfigError
from .redact import redact_urls
from .verdict import KINDS, gone_ranks, verdicts

EXTRA = "pip install prometheus_client (the package's metrics extra)"


def require() -> None:
    """Raise :class:`ConfigError` naming the extra to install when ``prometheus_client`` is missing."""
    try:
        import prometheus_client  # noqa: F401
    except ImportError:
        raise ConfigError(f"metrics need prometheus_client: {EXTRA}") from None


class StatsCollector:
    """A ``prometheus_client`` collector of the stats ``snapshot()`` returns (None: nothing yet)."""

    def __init__(self, snapshot: Callable[[], dict[str, Any] | None]) -> None:
        self._snapshot = snapshot

    def collect(self) -> Iterator[Any]:
        s = self._snapshot()
        if s is not None:
            yield from families(s)


def families(s: dict[str, Any]) -> Iterator[Any]:
    """The metric families of stats object ``s``."""
    from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily

    def gauge(name: str, doc: str, value: float) -> GaugeMetricFamily:
        return GaugeMetricFamily(f"wdscache_{name}", doc, value=value)

    def counter(name: str, doc: str, value: float) -> CounterMetricFamily:
        return CounterMetricFamily(f"wdscache_{name}", doc, value=value)

    agent = s.get("agent") or {}
    yield gauge("agent_up", "1 while an agent runs on this cache", 1 if agent else 0)
    yield gauge(
        "agent_answering",
        "1 while the agent answers (0: it runs but gave no reply in time)",
        1 if agent.get("answering") else 0,
    )
    yield gauge(
        "agent_starting", "1 while the agent starts (it answers once started)", 1 if agent.get("starting") else 0
    )
    yield gauge("cache_bytes", "Bytes the budget counts: cached shards and their sample table files", s["bytes_used"])
    yield gauge("cache_table_bytes", "Of cache_bytes, the sample table files", s.get("table_bytes", 0))
    if s.get("bytes_limit") is not None:
        yield gauge("cache_limit_bytes", "The cache's budget (--cache-size)", s["bytes_limit"])
    shards = GaugeMetricFamily("wdscache_shards", "Shards by state", labels=["state"])
    for state, n in s["shards"].items():
        shards.add_metric([state], n)
    yield shards
    if agent and not agent.get("answering"):
        # A running agent's counters are ahead of those its index holds (written every few
        # seconds): none rather than lower ones, which Prometheus would take for a reset.
        return
    yield counter("hits", "Shard opens that found the shard cached", s["hits"])
    yield counter("misses", "Shard opens that had to wait for a download", s["misses"])
    yield counter("download_bytes", "Bytes downloaded over the cache's life", s["bytes_downloaded"])
    yield counter("downloads", "Downloads completed", s.get("downloads", 0))
    yield counter("redownloads", "Downloads of shards this cache held before", s.get("redownloads", 0))
    yield counter("redownload_bytes", "Bytes of re-downloads", s.get("bytes_redownloaded", 0))
    yield counter("corrupt", "Shards found damaged by readers", s.get("corrupt", 0))
    yield counter("changed", "Cached shards found changed at their source", s.get("changed", 0))
    yield gauge("download_rate_bytes_per_second", "Download rate over the last 10 s", s.get("download_rate", 0.0))
    if not agent:
        return  # what only an agent's answer tells
    yield gauge("cache_reserved_bytes", "Bytes reserved by downloads in flight", agent.get("bytes_reserved", 0))
    yield gauge("need_bytes", "Bytes the readers hold at once", agent.get("need_bytes", 0))
    yield gauge("demanded_shards", "Shards readers wait for", agent.get("demanded", 0))
    if "disk" in agent:
        disk = agent["disk"]
        yield gauge("disk_free_bytes", "Free bytes of the cache's file system", disk.get("free_bytes", 0))
        yield gauge(
            "disk_short",
            "1 while downloads wait for the cache's file system (full, or below --min-free)",
            1 if disk.get("short") else 0,
        )
    yield gauge(
        "files_short",
        "1 while downloads wait for open files (the agent's ulimit -n is too low for them), else 0",
        1 if agent.get("out_of_files") else 0,
    )
    yield gauge("pinned_shards", "Shards being read", agent.get("pinned", 0))
    yield gauge("consumers", "Consumers connected", agent.get("consumers", 0))
    yield counter("worker_restarts", "Sample workers restarted", agent.get("worker_restarts", 0))
    per_worker = {
        "busy_s": CounterMetricFamily(
            "wdscache_worker_busy_seconds", "Seconds a worker spent serving", labels=["worker"]
        ),
        "samples": CounterMetricFamily("wdscache_worker_samples", "Samples a worker served", labels=["worker"]),
        "bytes": CounterMetricFamily("wdscache_worker_bytes", "Bytes a worker served", labels=["worker"]),
    }
    for w in agent.get("workers", []):
        for key, family in per_worker.items():
            family.add_metric([str(w["index"])], w.get(key, 0))
    yield from per_worker.values()
    labels = ["job", "rank"]
    # Counters from the totals over all of a rank's epochs (each epoch is a new consumer, whose own
    # figures start at zero), gauges from the ranks read now.
    totals = {
        "samples": CounterMetricFamily("wdscache_consumer_samples", "Samples a rank received", labels=labels),
        "bytes": CounterMetricFamily("wdscache_consumer_bytes", "Bytes of samples a rank received", labels=labels),
        "wait_s": CounterMetricFamily(
            "wdscache_consumer_wait_seconds", "Seconds a rank waited for data", labels=labels
        ),
    }
    gauges = {
        "rate": GaugeMetricFamily("wdscache_consumer_samples_per_second", "A rank's recent sample rate", labels=labels),
        "waiting": GaugeMetricFamily(
            "wdscache_consumer_waiting_ratio", "Share of a rank's recent time spent waiting for data", labels=labels
        ),
        "silent_s": GaugeMetricFamily(
            "wdscache_consumer_silent_seconds",
            "Seconds since a rank's last report, once it is silent (stopped or hung), else 0",
            labels=labels,
        ),
    }
    for families_of, ranks_by_job in ((totals, s.get("rank_totals", {})), (gauges, s.get("jobs", {}))):
        for job, ranks in sorted(ranks_by_job.items()):
            for rank, r in sorted(ranks.items()):
                for key, rank_family in families_of.items():
                    rank_family.add_metric([redact_urls(job), rank], r.get(key, 0))  # a name is the user's choice
        yield from families_of.values()
    starved = GaugeMetricFamily(
        "wdscache_job_starved", "1 if the job is starved, by its reason", labels=["job", "reason"]
    )
    gone = GaugeMetricFamily(
        "wdscache_job_ranks_gone",
        "Ranks of a live job whose process ended mid-epoch (killed, crashed), none of their consumers live",
        labels=["job"],
    )
    for job, v in sorted(verdicts(s).items()):
        if job in s.get("jobs", {}):
            for kind in KINDS:
                starved.add_metric([redact_urls(job), kind], 1 if v.kind == kind else 0)
            gone.add_metric([redact_urls(job)], len(gone_ranks(s, job, s["jobs"][job])))
    yield starved
    yield gone


def exposition(s: dict[str, Any]) -> str:
    """The Prometheus text exposition of stats object ``s``."""
    require()
    from prometheus_client import CollectorRegistry, generate_latest

    registry = CollectorRegistry()
    registry.register(StatsCollector(lambda: s))
    return generate_latest(registry).decode()
