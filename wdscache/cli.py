"""The ``wdscache`` command: the only module that parses options (the library never imports click).

Each agent option may come from its ``WDSCACHE_*`` environment variable; its default is
the :class:`~wdscache.shared.config.AgentConfig` field's (see :mod:`wdscache.shared.config` for where
else the environment is read).

Exit status: 0 done; 1 a runtime error (another agent runs, no cache there);
2 bad options or input (a bad URL list line, a budget that cannot work).
"""

from __future__ import annotations

import json
import logging
import os
import signal
import sys
from pathlib import Path
from types import FrameType

import click

from .shared.config import AgentConfig, default
from .shared.errors import ConfigError, WdsCacheError


def _fail(exc: WdsCacheError) -> None:
    click.echo(f"wdscache: error: {exc}", err=True)
    sys.exit(2 if isinstance(exc, ConfigError) else 1)


@click.group(context_settings={"help_option_names": ["-h", "--help"], "show_default": True})
@click.version_option(package_name="wdscache")
def main() -> None:
    """Keep WebDataset shards on local disk ahead of demand and stream them to training jobs."""


@main.command()
@click.option("--cache-dir", envvar="WDSCACHE_CACHE_DIR", required=True, show_envvar=True,
              type=click.Path(file_okay=False, path_type=Path), help="Cache directory (created 0700).")
@click.option("--urls", envvar="WDSCACHE_URLS", required=True, show_envvar=True,
              type=click.Path(dir_okay=False, path_type=Path),
              help="URL list: one URL or brace pattern per line; watched for changes.")
@click.option("--cache-size", envvar="WDSCACHE_CACHE_SIZE", default=default("cache_size"), show_envvar=True,
              help="Budget: bytes, 500G, or a percentage of the file system.")
@click.option("--min-free", envvar="WDSCACHE_MIN_FREE", default=default("min_free"), show_envvar=True,
              help="Free space always left on the file system.")
@click.option("--prefetch", envvar="WDSCACHE_PREFETCH", default=default("prefetch"), type=int, show_envvar=True,
              help="Shards kept ready ahead of each reader.")
@click.option("--download-workers", envvar="WDSCACHE_DOWNLOAD_WORKERS", default=default("download_workers"),
              type=int, show_envvar=True, help="Parallel prefetches; shards a reader waits for may use as many again.")
@click.option("--download-parts", envvar="WDSCACHE_DOWNLOAD_PARTS", default=default("download_parts"), type=int,
              show_envvar=True, help="Connections per shard larger than one part (ranged parts; 1: one each).")
@click.option("--download-part-size", envvar="WDSCACHE_DOWNLOAD_PART_SIZE", default=default("download_part_size"),
              show_envvar=True, help="Size of one ranged part, and the least a shard needs to come in parts.")
@click.option("--workers", envvar="WDSCACHE_WORKERS", default=default("workers"), type=int,
              show_envvar=True, help="Sample worker processes.")
@click.option("--endpoint", envvar="WDSCACHE_ENDPOINT", default=default("endpoint"), show_envvar=True,
              help="ZeroMQ endpoint [default: a private IPC socket in the cache directory].")
@click.option("--allow-remote", envvar="WDSCACHE_ALLOW_REMOTE", is_flag=True, default=default("allow_remote"),
              show_envvar=True, help="Allow a TCP endpoint reachable from other machines.")
@click.option("--allow-pipe", envvar="WDSCACHE_ALLOW_PIPE", is_flag=True, default=default("allow_pipe"),
              show_envvar=True, help="Allow pipe:COMMAND lines in the URL list (they run a shell command).")
@click.option("--seed", envvar="WDSCACHE_SEED", default=default("seed"), type=int, show_envvar=True,
              help="Seed of the shard order of the initial prefetch.")
@click.option("--shuffle/--no-shuffle", envvar="WDSCACHE_SHUFFLE", default=default("shuffle"), show_envvar=True,
              help="Prefetch in seeded shuffle order (as readers will read) or in list order.")
@click.option("--retries", envvar="WDSCACHE_RETRIES", default=default("retries"), type=int, show_envvar=True,
              help="Retries of a failing download before it is marked failed.")
@click.option("--read-timeout", envvar="WDSCACHE_READ_TIMEOUT", default=default("read_timeout"), type=float,
              show_envvar=True, help="Seconds without data before a download is retried.")
@click.option("--revalidate/--no-revalidate", envvar="WDSCACHE_REVALIDATE", default=default("revalidate"),
              show_envvar=True,
              help="Check a shard cached by an earlier run against its source (HEAD) before serving it.")
@click.option("--reader-timeout", envvar="WDSCACHE_READER_TIMEOUT", default=default("reader_timeout"), type=float,
              show_envvar=True, help="Seconds of silence after which a consumer's pins are released.")
@click.option("--s3-endpoint-url", envvar="WDSCACHE_S3_ENDPOINT_URL", default=default("s3_endpoint_url"),
              show_envvar=True,
              help="Endpoint of an S3-compatible store for s3:// URLs [default: boto3's, e.g. AWS_ENDPOINT_URL].")
@click.option("-v", "--verbose", envvar="WDSCACHE_VERBOSE", is_flag=True, show_envvar=True,
              help="Log every download and eviction.")
@click.option("--private-users", hidden=True, default=default("private_users"),
              type=click.Path(dir_okay=False, path_type=Path),
              help="Run as a loader's private agent: stop once no loader holds a lock on this file.")
def agent(verbose: bool, **options: object) -> None:
    """Run the agent in the foreground until SIGINT or SIGTERM (a second one exits at once)."""
    from .agent.core import Agent

    _setup_logging(verbose)
    try:
        agent = Agent(AgentConfig(**options))  # type: ignore[arg-type]
    except WdsCacheError as exc:
        _fail(exc)

    def on_signal(signum: int, frame: FrameType | None) -> None:
        if agent.stopping:
            os._exit(128 + signum)  # the second signal: no more cleanup
        agent.stop()

    signal.signal(signal.SIGTERM, on_signal)
    signal.signal(signal.SIGINT, on_signal)
    try:
        agent.run()
    except WdsCacheError as exc:
        _fail(exc)


@main.command()
@click.option("--cache-dir", envvar="WDSCACHE_CACHE_DIR", required=True, show_envvar=True,
              type=click.Path(file_okay=False, path_type=Path))
@click.option("--json", "as_json", is_flag=True, help="Print one JSON object.")
def stats(cache_dir: Path, as_json: bool) -> None:
    """Show the cache and, when an agent runs, what it is doing."""
    from .shared.stats import collect, format_stats

    try:
        s = collect(cache_dir)
    except WdsCacheError as exc:
        click.echo(f"wdscache: error: {exc}", err=True)
        sys.exit(1)
    click.echo(json.dumps(s, indent=2) if as_json else format_stats(s))


def _setup_logging(verbose: bool) -> None:
    handler = logging.StreamHandler(sys.stderr)
    handler.setFormatter(logging.Formatter("%(asctime)s %(levelname)s %(name)s: %(message)s"))
    root = logging.getLogger("wdscache")
    root.addHandler(handler)
    root.setLevel(logging.DEBUG if verbose else logging.INFO)
