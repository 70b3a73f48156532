"""The ``wdscache`` command: the only module that parses options (the library never imports click).

Each agent option may come from its ``WDSCACHE_*`` environment variable; its default is
the :class:`~wdscache.shared.config.AgentConfig` field's (see :mod:`wdscache.shared.config` for where
else the environment is read).

Exit status: 0 done; 1 a runtime error (another agent runs, no cache there, a shard
``index`` could not read); 2 bad options or input (a bad URL list line or shard index, a
budget that cannot work).
"""

from __future__ import annotations

import itertools
import json
import logging
import os
import shutil
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
@click.option("--node-rank", envvar=["WDSCACHE_NODE_RANK", "GROUP_RANK", "SLURM_NODEID"], default=default("node_rank"),
              type=int, show_envvar=True,
              help="This node, of a job on --num-nodes: the start-up prefetch is its part of the list.")
@click.option("--num-nodes", envvar=["WDSCACHE_NUM_NODES", "SLURM_NNODES"], default=default("num_nodes"), type=int,
              show_envvar=True, help="Nodes of the job, one agent each (its part needs the shards' counts).")
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


@main.command("index")
@click.argument("urls", nargs=-1, required=True)
@click.option("-o", "--output", required=True, type=click.Path(dir_okay=False, path_type=Path),
              help="The index file to write (replaced atomically).")
@click.option("-j", "--jobs", default=4, type=click.IntRange(1, 64), help="Shards read at once.")
@click.option("--s3-endpoint-url", envvar="WDSCACHE_S3_ENDPOINT_URL", default=default("s3_endpoint_url"),
              show_envvar=True, help="Endpoint of an S3-compatible store for s3:// URLs.")
def index(urls: tuple[str, ...], output: Path, jobs: int, s3_endpoint_url: str | None) -> None:
    """Write a shard index (webdataset's wids JSON) of the shards URLS name.

    URLS are written as URL list lines are: URLs, brace patterns, s3:// prefixes or globs,
    local paths. Each shard is read once (its size, MD5 and samples, counted as the agent
    counts them). A local shard in OUTPUT's folder or below is stored relative to it (wids
    and wdscache resolve it against the index's folder, so the two can move together); any
    other URL or path is stored absolute. A progress bar shows on a terminal, one line per
    shard otherwise.

    Exit status: 0 written; 1 a shard could not be read (nothing is written); 2 bad arguments.
    """
    from .agent.fetch import Fetcher
    from .agent.indexing import Indexer
    from .shared.s3 import Listing
    from .shared.shard_index import ShardInfo, write_shard_index
    from .shared.urls import parse_url_list

    folder = output.parent.resolve()
    if not folder.is_dir():
        _fail(ConfigError(f"cannot write {output}: no folder {folder}"))
    lines = "".join(f"{u}\n" for u in urls)  # as list lines: braces and s3:// prefixes expand
    try:
        listed = parse_url_list(lines, path="<arguments>", lister=Listing(endpoint_url=s3_endpoint_url))
    except WdsCacheError as exc:
        _fail(exc)
    fetcher = Fetcher(s3_endpoint_url=s3_endpoint_url)
    scratch = folder / f".wdscache-index-{os.getpid()}"
    scratch.mkdir(mode=0o700)
    try:
        indexer = Indexer(fetcher, scratch, jobs=jobs)
        if sys.stderr.isatty():
            with click.progressbar(length=len(listed), label="indexing", file=sys.stderr,
                                   show_pos=True) as bar:
                results = indexer.shards(listed.urls, lambda url, info, error: bar.update(1))
        else:
            done = itertools.count(1)

            def said(url: str, info: ShardInfo | None, error: WdsCacheError | None) -> None:
                what = error if info is None else f"{info.nsamples} samples, {info.filesize} bytes"
                click.echo(f"[{next(done)}/{len(listed)}] {url}: {what}", err=True)

            results = indexer.shards(listed.urls, said)
    finally:
        shutil.rmtree(scratch, ignore_errors=True)
    failed = [r for r in results if not isinstance(r, ShardInfo)]
    for exc in failed:
        click.echo(f"wdscache: error: {exc}", err=True)
    if failed:
        click.echo(f"wdscache: {len(failed)} of {len(listed)} shards could not be read; {output} not written",
                   err=True)
        sys.exit(1)
    entries = [(_stored_url(url, folder), info) for url, info in zip(listed.urls, results)]
    write_shard_index(output, entries)  # type: ignore[arg-type]
    click.echo(f"wrote {output}: {len(entries)} shards, {sum(i.nsamples for _, i in entries)} samples", err=True)


def _stored_url(url: str, folder: Path) -> str:
    """``url`` as an index in ``folder`` stores it: a local shard in that folder (or below) relative to it,
    another local one as its absolute path, anything else as it is."""
    if not url.startswith("file://"):
        return url
    path = url[len("file://"):]
    rel = os.path.relpath(path, folder)
    return path if rel == os.pardir or rel.startswith(os.pardir + os.sep) else rel


def _setup_logging(verbose: bool) -> None:
    handler = logging.StreamHandler(sys.stderr)
    handler.setFormatter(logging.Formatter("%(asctime)s %(levelname)s %(name)s: %(message)s"))
    root = logging.getLogger("wdscache")
    root.addHandler(handler)
    root.setLevel(logging.DEBUG if verbose else logging.INFO)
