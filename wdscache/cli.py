"""The ``wdscache`` command: the only module that parses options (the library never imports click).

Each agent option may come from its ``WDSCACHE_*`` environment variable; its default is
the :class:`~wdscache.shared.config.AgentConfig` field's (see :mod:`wdscache.shared.config` for where
else the environment is read).

Exit status: 0 done; 1 a runtime error (another agent runs, no cache there, a shard
``index`` could not read); 2 bad options or input (a bad URL list line or shard index, a
budget that cannot work, a cache directory that cannot be written).
"""

from __future__ import annotations

import itertools
import json
import os
import shutil
import signal
import sys
from collections.abc import Sequence
from pathlib import Path
from types import FrameType
from typing import TYPE_CHECKING, Any, NoReturn

import click

from .shared.config import PREFETCH_GIVE_UP_AFTER, AgentConfig, check_s3_endpoint_url, default, format_size
from .shared.errors import ConfigError, WdsCacheError
from .shared.logs import DEFAULT_FORMAT, FORMATS, get_logger, log_uncaught
from .shared.logs import setup as setup_logging
from .shared.redact import redact_urls, redacted

if TYPE_CHECKING:
    from .shared.urls import Lister


def _echo(text: str = "", **kwargs: Any) -> None:
    """Print for people: every line of the command's output goes through here, its URLs redacted."""
    click.echo(redact_urls(text), **kwargs)


def _echo_json(obj: object) -> None:
    """Print ``obj`` as JSON, every string in it (keys too) with its URLs redacted."""
    _write_out(json.dumps(redacted(obj), indent=2))


def _write_out(text: str) -> None:
    """``text`` (a JSON document, in one piece) and a newline on standard output, written whole: a
    pipe whose reader goes away in the middle of one large write takes part of it, which Python's
    stdout counts as done (the output cut, exit 0); written on, the rest meets the broken pipe
    (see :class:`_Main`). (Lines written one by one meet it as they are flushed.)"""
    out = sys.stdout
    if out is None:  # (no standard output at all: nothing is shown, as click does)
        return
    try:
        fd = out.fileno()
    except (OSError, ValueError):  # not a file (a test runner's capture)
        click.echo(text)
        return
    out.flush()
    data = memoryview((text + "\n").encode(out.encoding or "utf-8", errors="backslashreplace"))
    while data:
        data = data[os.write(fd, data) :]


def _fail(exc: WdsCacheError, log_format: str = DEFAULT_FORMAT) -> NoReturn:
    if log_format == "json":  # a log shipper reads every line of the agent's log as a record
        get_logger("wdscache.cli").error("%s", exc)
    else:
        _echo(f"wdscache: error: {exc}", err=True)
    sys.exit(2 if isinstance(exc, ConfigError) else 1)


# The one --s3-endpoint-url of every command that reads s3:// URLs (agent, index, prefetch), checked by
# check_s3_endpoint_url (the agent's through AgentConfig).
_S3_ENDPOINT_URL = click.option(
    "--s3-endpoint-url",
    envvar="WDSCACHE_S3_ENDPOINT_URL",
    default=default("s3_endpoint_url"),
    show_envvar=True,
    help="Endpoint of an S3-compatible store for s3:// URLs [default: boto3's, e.g. AWS_ENDPOINT_URL].",
)

_RETRIES = click.option(
    "--retries",
    envvar="WDSCACHE_RETRIES",
    default=default("retries"),
    type=click.IntRange(0),
    show_envvar=True,
    help="Retries of a failing download (with backoff) before the shard is given up.",
)


# The exit status of a command whose output's reader went away: a shell's for a command killed by SIGPIPE.
BROKEN_PIPE_EXIT = 128 + signal.SIGPIPE


class _Main(click.Group):
    """The ``wdscache`` group: a command whose standard output's reader goes away (``wdscache ls |
    head -1``) stops quietly with :data:`BROKEN_PIPE_EXIT`, as ``cat`` killed by SIGPIPE does
    (click's own exit 1 would read as "no cache there", or as some shard failing)."""

    def invoke(self, ctx: click.Context) -> Any:
        try:
            try:
                return super().invoke(ctx)
            finally:  # (what is still buffered: else the interpreter's last flush meets the broken pipe)
                if sys.stdout is not None:
                    sys.stdout.flush()
        except BrokenPipeError:
            # Nothing more can be written there, and nothing left buffered should be tried at exit.
            devnull = os.open(os.devnull, os.O_WRONLY)
            os.dup2(devnull, sys.stdout.fileno())
            os.close(devnull)
            sys.exit(BROKEN_PIPE_EXIT)


@click.group(cls=_Main, context_settings={"help_option_names": ["-h", "--help"], "show_default": True})
@click.version_option(package_name="wdscache")
def main() -> None:
    """Keep WebDataset shards on local disk ahead of demand and stream them to training jobs.

    A command whose output's reader goes away (wdscache ls | head -1) stops quietly with exit
    status 141, as a command killed by SIGPIPE.
    """


class _AgentCommand(click.Command):
    """``wdscache agent``: a bad option's error, under ``--log-format json``, is a JSON record as
    every other line of the agent's log (click's own parse would print its usage text)."""

    def parse_args(self, ctx: click.Context, args: list[str]) -> list[str]:
        wants_json = _json_asked(args)
        try:
            return super().parse_args(ctx, args)
        except click.UsageError as exc:
            if not wants_json:
                raise
            setup_logging(sys.stderr, fmt="json")
            get_logger("wdscache.cli").error("%s", exc.format_message())
            ctx.exit(exc.exit_code)


def _json_asked(args: list[str]) -> bool:
    """Whether the agent's command line (else its environment) asks for JSON log lines."""
    for k, arg in enumerate(args):
        if arg.startswith("--log-format="):
            return arg.endswith("=json")
        if arg == "--log-format":
            return args[k + 1 : k + 2] == ["json"]
    return os.environ.get("WDSCACHE_LOG_FORMAT") == "json"


@main.command(cls=_AgentCommand)
@click.option(
    "--cache-dir",
    envvar="WDSCACHE_CACHE_DIR",
    required=True,
    show_envvar=True,
    type=click.Path(file_okay=False, path_type=Path),
    help="Cache directory (created 0700).",
)
@click.option(
    "--urls",
    envvar="WDSCACHE_URLS",
    required=True,
    show_envvar=True,
    type=click.Path(dir_okay=False, path_type=Path),
    help="URL list: one URL or brace pattern per line; watched for changes.",
)
@click.option(
    "--cache-size",
    envvar="WDSCACHE_CACHE_SIZE",
    default=default("cache_size"),
    show_envvar=True,
    help="Budget: bytes, 500G, or a percentage of the file system.",
)
@click.option(
    "--min-free",
    envvar="WDSCACHE_MIN_FREE",
    default=default("min_free"),
    show_envvar=True,
    help="Free space always left on the file system.",
)
@click.option(
    "--prefetch",
    envvar="WDSCACHE_PREFETCH",
    default=default("prefetch"),
    type=int,
    show_envvar=True,
    help="Shards kept ready ahead of each reader.",
)
@click.option(
    "--download-workers",
    envvar="WDSCACHE_DOWNLOAD_WORKERS",
    default=default("download_workers"),
    type=int,
    show_envvar=True,
    help="Parallel prefetches; shards a reader waits for may use as many again.",
)
@click.option(
    "--download-parts",
    envvar="WDSCACHE_DOWNLOAD_PARTS",
    default=default("download_parts"),
    type=int,
    show_envvar=True,
    help="Connections per shard larger than one part (ranged parts; 1: one each).",
)
@click.option(
    "--download-part-size",
    envvar="WDSCACHE_DOWNLOAD_PART_SIZE",
    default=default("download_part_size"),
    show_envvar=True,
    help="Size of one ranged part, and the least a shard needs to come in parts.",
)
@click.option(
    "--workers",
    envvar="WDSCACHE_WORKERS",
    default=default("workers"),
    type=int,
    show_envvar=True,
    help="Sample worker processes.",
)
@click.option(
    "--endpoint",
    envvar="WDSCACHE_ENDPOINT",
    default=default("endpoint"),
    show_envvar=True,
    help="ZeroMQ endpoint [default: a private IPC socket in the cache directory].",
)
@click.option(
    "--allow-remote",
    envvar="WDSCACHE_ALLOW_REMOTE",
    is_flag=True,
    default=default("allow_remote"),
    show_envvar=True,
    help="Allow a TCP endpoint reachable from other machines.",
)
@click.option(
    "--allow-pipe",
    envvar="WDSCACHE_ALLOW_PIPE",
    is_flag=True,
    default=default("allow_pipe"),
    show_envvar=True,
    help="Allow pipe:COMMAND lines in the URL list (they run a shell command).",
)
@click.option(
    "--seed",
    envvar="WDSCACHE_SEED",
    default=default("seed"),
    type=int,
    show_envvar=True,
    help="Seed of the shard order of the initial prefetch.",
)
@click.option(
    "--shuffle/--no-shuffle",
    envvar="WDSCACHE_SHUFFLE",
    default=default("shuffle"),
    show_envvar=True,
    help="Prefetch in seeded shuffle order (as readers will read) or in list order.",
)
@click.option(
    "--node-rank",
    envvar=["WDSCACHE_NODE_RANK", "GROUP_RANK", "SLURM_NODEID"],
    default=default("node_rank"),
    type=int,
    show_envvar=True,
    help="This node, of a job on --num-nodes: the start-up prefetch is its part of the list.",
)
@click.option(
    "--num-nodes",
    envvar=["WDSCACHE_NUM_NODES", "SLURM_NNODES"],
    default=default("num_nodes"),
    type=int,
    show_envvar=True,
    help="Nodes of the job, one agent each (its part needs the shards' counts).",
)
@_RETRIES
@click.option(
    "--read-timeout",
    envvar="WDSCACHE_READ_TIMEOUT",
    default=default("read_timeout"),
    type=float,
    show_envvar=True,
    help="Seconds without data, or for a whole HTTP response head, before a download is retried.",
)
@click.option(
    "--revalidate/--no-revalidate",
    envvar="WDSCACHE_REVALIDATE",
    default=default("revalidate"),
    show_envvar=True,
    help="Check a shard cached by an earlier run against its source (HEAD) before serving it.",
)
@click.option(
    "--reader-timeout",
    envvar="WDSCACHE_READER_TIMEOUT",
    default=default("reader_timeout"),
    type=float,
    show_envvar=True,
    help="Seconds of silence after which a consumer's pins are released.",
)
@_S3_ENDPOINT_URL
@click.option(
    "-v",
    "--verbose",
    envvar="WDSCACHE_VERBOSE",
    is_flag=True,
    show_envvar=True,
    help="Also log debugging detail (each download as it starts).",
)
@click.option(
    "--metrics-port",
    envvar="WDSCACHE_METRICS_PORT",
    type=int,
    default=default("metrics_port"),
    show_envvar=True,
    help="Serve Prometheus metrics on http://127.0.0.1:PORT/metrics (0: any free port; needs wdscache[metrics]).",
)
@click.option(
    "--metrics-host",
    envvar="WDSCACHE_METRICS_HOST",
    default=default("metrics_host"),
    show_envvar=True,
    help="Address /metrics binds; other than loopback only with --allow-remote.",
)
@click.option(
    "--log-format",
    envvar="WDSCACHE_LOG_FORMAT",
    type=click.Choice(FORMATS),
    default=default("log_format"),
    show_envvar=True,
    help="Log lines as text, or one JSON object a line for log shippers.",
)
@click.option(
    "--private-users",
    hidden=True,
    default=default("private_users"),
    type=click.Path(dir_okay=False, path_type=Path),
    help="Run as a loader's private agent: stop once no loader holds a lock on this file.",
)
def agent(verbose: bool, log_format: str, **options: object) -> None:
    """Run the agent in the foreground until SIGINT, SIGTERM or SIGHUP (a second one exits at once).

    Exit status: 0 after a clean stop; 1 a runtime error (another agent owns the cache
    directory: the message names its pid); 2 bad options or input (a URL list line, a
    shard index, a budget that cannot work).
    """
    from .agent.core import Agent

    setup_logging(sys.stderr, fmt=log_format, verbose=verbose)
    log_uncaught()  # beyond WdsCacheError (caught below): a bug's traceback, any thread's, redacted too
    try:
        agent = Agent(AgentConfig(**options, log_format=log_format))  # type: ignore[arg-type]
    except WdsCacheError as exc:
        _fail(exc, log_format)

    def on_signal(signum: int, frame: FrameType | None) -> None:
        if agent.stopping:
            os._exit(128 + signum)  # the second signal: no more cleanup
        agent.stop()

    signal.signal(signal.SIGTERM, on_signal)
    signal.signal(signal.SIGINT, on_signal)
    # A hang-up (the SSH session of an agent in its foreground closed) stops it as cleanly, not at
    # once by default: no agent.json or socket left behind, partial files kept. Under nohup (the
    # hang-up ignored) it is ignored still: the agent was meant to outlive the session.
    if signal.getsignal(signal.SIGHUP) is not signal.SIG_IGN:
        signal.signal(signal.SIGHUP, on_signal)
    try:
        agent.run()
    except WdsCacheError as exc:
        _fail(exc, log_format)


@main.command()
@click.option(
    "--cache-dir",
    envvar="WDSCACHE_CACHE_DIR",
    required=True,
    show_envvar=True,
    type=click.Path(file_okay=False, path_type=Path),
)
@click.option("--json", "as_json", is_flag=True, help="Print one JSON object.")
@click.option(
    "--prometheus",
    is_flag=True,
    help="Print Prometheus metrics, as the agent's /metrics (for node_exporter's textfile collector).",
)
@click.option("--watch", is_flag=True, help="Redraw a live view every second, with a verdict per job, until Ctrl-C.")
def stats(cache_dir: Path, as_json: bool, prometheus: bool, watch: bool) -> None:
    """Show the cache and, when an agent runs, what it is doing.

    Exit status: 0 shown (--watch: stopped with Ctrl-C); 1 no cache there, or it
    cannot be read (the error on stderr); 2 bad options, or --prometheus without
    wdscache[metrics].
    """
    from .shared.stats import collect, format_stats

    if watch:
        if as_json or prometheus:
            _fail(ConfigError("--watch draws for people: leave out --json and --prometheus"))
        _watch(cache_dir)
        return
    try:
        if prometheus:
            from .shared.metrics import require

            require()
        s = collect(cache_dir)
        if prometheus:
            from .shared.metrics import exposition

            _echo(exposition(s), nl=False)
            return
    except WdsCacheError as exc:
        _fail(exc)
    if as_json:
        _echo_json(s)
    else:
        _echo(format_stats(s))


@main.command("index")
@click.argument("urls", nargs=-1, required=True)
@click.option(
    "-o",
    "--output",
    required=True,
    type=click.Path(dir_okay=False, path_type=Path),
    help="The index file to write (replaced atomically).",
)
@click.option("-j", "--jobs", default=4, type=click.IntRange(1, 64), help="Shards read at once.")
@_RETRIES
@_S3_ENDPOINT_URL
def index(urls: tuple[str, ...], output: Path, jobs: int, retries: int, s3_endpoint_url: str | None) -> None:
    """Write a shard index (webdataset's wids JSON) of the shards URLS name.

    URLS are written as URL list lines are: URLs, brace patterns, s3:// prefixes or globs,
    local paths (each argument one, whatever "#" it holds). Each shard is read once (its
    size, MD5 and samples, counted as the agent counts them). A local shard in OUTPUT's folder or below is stored relative to it (wids
    and wdscache resolve it against the index's folder, so the two can move together); any
    other URL or path is stored absolute. A progress bar shows on a terminal, one line per
    shard otherwise.

    Exit status: 0 written; 1 a shard could not be read (nothing is written); 2 bad arguments.
    """
    from .agent.fetch import Fetcher
    from .agent.indexing import Indexer
    from .shared.s3 import Listing
    from .shared.shard_index import ShardInfo, write_shard_index

    try:
        check_s3_endpoint_url(s3_endpoint_url)
    except ConfigError as exc:
        _fail(exc)
    if not output.name or output.is_dir():  # (-o '' is the current folder)
        _fail(ConfigError(f"cannot write the index to {str(output)!r}: give a file's name (-o FILE), not a folder"))
    folder = output.parent.resolve()
    if not folder.is_dir():
        _fail(ConfigError(f"cannot write {output}: no folder {folder}"))
    try:
        arguments = _argument_urls(urls, Listing(endpoint_url=s3_endpoint_url))
        listed = list(dict.fromkeys(url for _, expanded in arguments for url in expanded))  # each once, in order
        if not listed:  # (blank arguments): an index of no shard is one no reader can open
            raise ConfigError(f"no shards to index: the arguments hold no URL; {output} not written")
    except WdsCacheError as exc:
        _fail(exc)
    fetcher = Fetcher(s3_endpoint_url=s3_endpoint_url, retries=retries)
    scratch = folder / f".wdscache-index-{os.getpid()}"
    try:
        scratch.mkdir(mode=0o700)
    except OSError as exc:
        _fail(ConfigError(f"cannot write {output}: {exc.strerror} ({folder})"))
    try:
        indexer = Indexer(fetcher, scratch, jobs=jobs)
        if sys.stderr.isatty():
            with click.progressbar(length=len(listed), label="indexing", file=sys.stderr, show_pos=True) as bar:
                results = indexer.shards(listed, lambda url, info, error: bar.update(1))
        else:
            done = itertools.count(1)

            def said(url: str, info: ShardInfo | None, error: WdsCacheError | None) -> None:
                what = error if info is None else f"{info.nsamples} samples, {info.filesize} bytes"
                _echo(f"[{next(done)}/{len(listed)}] {url}: {what}", err=True)

            results = indexer.shards(listed, said)
    finally:
        shutil.rmtree(scratch, ignore_errors=True)
    failed = [r for r in results if not isinstance(r, ShardInfo)]
    for error in failed:
        _echo(f"wdscache: error: {error}", err=True)
    if failed:
        _echo(f"wdscache: {len(failed)} of {len(listed)} shards could not be read; {output} not written", err=True)
        sys.exit(1)
    entries = [
        (_stored_url(url, folder), info) for url, info in zip(listed, results) if isinstance(info, ShardInfo)
    ]  # every one, since none failed
    try:
        write_shard_index(output, entries)
    except OSError as exc:
        _fail(ConfigError(f"cannot write {output}: {exc.strerror}"))
    _echo(f"wrote {output}: {len(entries)} shards, {sum(i.nsamples or 0 for _, i in entries)} samples", err=True)


def _stored_url(url: str, folder: Path) -> str:
    """``url`` as an index in ``folder`` stores it: a local shard in that folder (or below) relative to it,
    another local one as its absolute path, anything else as it is."""
    from .shared.urls import file_path

    if not url.startswith("file://"):
        return url
    path = file_path(url)
    rel = os.path.relpath(path, folder)
    return path if rel == os.pardir or rel.startswith(os.pardir + os.sep) else rel


# -- the cache commands -------------------------------------------------------------------------

_CACHE_DIR = click.option(
    "--cache-dir",
    envvar="WDSCACHE_CACHE_DIR",
    required=True,
    show_envvar=True,
    type=click.Path(file_okay=False, path_type=Path),
    help="Cache directory.",
)
_JSON = click.option("--json", "as_json", is_flag=True, help="Print one JSON object (for scripts).")
_FORCE = click.option("--force", is_flag=True, help="Also evict shards a reader holds (it keeps reading its file).")


def _argument_urls(
    args: tuple[str, ...], lister: Lister | None = None, *, allow_pipe: bool = False
) -> list[tuple[str, Sequence[str]]]:
    """Each argument with the URLs it stands for, read as a URL list line is (braces expanded, paths
    made ``file://`` URLs, ``s3://`` prefixes and globs listed by ``lister`` when given), but for
    comments: an argument is one entry, whatever ``#`` it holds. UrlListError names argument k as
    line k of "the command line"."""
    from .shared.errors import UrlListError
    from .shared.urls import PIPE_AGENT_ONLY, parse_url_list

    out: list[tuple[str, Sequence[str]]] = []
    for k, arg in enumerate(args, 1):
        if not allow_pipe and arg.startswith("pipe:"):  # (no option of this command would allow it)
            raise UrlListError("the command line", k, arg, PIPE_AGENT_ONLY)
        try:
            listed = parse_url_list(arg, path="the command line", lister=lister, allow_pipe=allow_pipe, comments=False)
            out.append((arg, listed.urls))
        except UrlListError as exc:
            raise UrlListError("the command line", k, exc.line, exc.reason) from None
    return out


def _rate(n: float) -> str:
    return f"{format_size(n)}/s"


def _eta(seconds: float | None) -> str:
    if seconds is None:
        return "ETA ?"
    m, s = divmod(int(seconds + 0.5), 60)
    return f"ETA {m // 60}:{m % 60:02d}:{s:02d}" if m >= 60 else f"ETA {m}:{s:02d}"


@main.command()
@click.argument("urls", nargs=-1)
@_CACHE_DIR
@click.option(
    "--urls",
    "list_file",
    type=click.Path(dir_okay=False, exists=True, path_type=Path),
    help="Also the shards of this URL list file.",
)
@click.option(
    "--cache-size",
    default=None,
    help="Budget when no agent runs [default: the last agent's, else the agent's default].",
)
@click.option(
    "--min-free",
    default=None,
    help="Free space left on the file system when no agent runs [default: the last agent's, else the agent's default].",
)
@click.option(
    "--download-workers", type=click.IntRange(min=1), default=None, help="Parallel downloads when no agent runs."
)
@click.option(
    "--give-up-after",
    type=click.FloatRange(min=0.5),
    default=PREFETCH_GIVE_UP_AFTER,
    show_default=True,
    help="Seconds downloads may wait for space with no progress before the rest fail "
    "(shards the budget cannot take fail at once).",
)
@_S3_ENDPOINT_URL
@click.option(
    "--log-format", type=click.Choice(FORMATS), default=default("log_format"), help="Log lines as text or JSON."
)
@click.option("-v", "--verbose", is_flag=True, help="Log each event (shard cached, failed...), not only warnings.")
@_JSON
def prefetch(
    urls: tuple[str, ...],
    cache_dir: Path,
    list_file: Path | None,
    cache_size: str | None,
    min_free: str | None,
    download_workers: int | None,
    give_up_after: float,
    s3_endpoint_url: str | None,
    log_format: str,
    verbose: bool,
    as_json: bool,
) -> None:
    """Warm a cache: download URLS (URLs, brace patterns, s3:// prefixes or globs, paths) before a run.

    Through the running agent, or by itself (an agent run in this process until done)
    when none runs. Shows a progress bar (shards, bytes, rate, ETA) on a terminal, a
    line per shard otherwise. Each shard is downloaded at most once: those the budget
    cannot take beside the others fail, naming it. --s3-endpoint-url is where s3://
    prefixes and globs are listed, and where the command's own agent fetches; a running
    agent fetches from its own.

    Exit status: 0 every shard cached; 1 some failed (listed) or a runtime error;
    2 bad options or URLs.
    """
    import logging

    from .agent.cache_commands import PrefetchProgress
    from .agent.cache_commands import prefetch as run_prefetch
    from .shared.errors import UrlListError
    from .shared.s3 import Listing
    from .shared.urls import PIPE_AGENT_ONLY, PIPE_REFUSED, read_url_list

    setup_logging(sys.stderr, fmt=log_format, verbose=False)
    if not verbose:
        logging.getLogger("wdscache").setLevel(logging.WARNING)
    try:
        check_s3_endpoint_url(s3_endpoint_url)
        lister = Listing(endpoint_url=s3_endpoint_url)
        wanted = [url for _, expanded in _argument_urls(urls, lister) for url in expanded]
        if list_file is not None:
            try:
                wanted += read_url_list(list_file, lister=lister).urls
            except UrlListError as exc:
                if exc.reason != PIPE_REFUSED:
                    raise
                raise UrlListError(exc.path, exc.lineno, exc.line, PIPE_AGENT_ONLY) from None
        if not wanted:
            raise ConfigError("no shards to prefetch: give URLS or --urls FILE")
        bar = sys.stdout.isatty() and not as_json

        def report(p: PrefetchProgress) -> None:
            if as_json:
                return
            if bar:
                total = format_size(p.bytes_total) if p.bytes_total is not None else "?"
                width = 30
                filled = int(width * (p.cached + len(p.failed)) / p.total)
                _echo(
                    f"\r[{'#' * filled}{'.' * (width - filled)}] {p.cached}/{p.total} shards"
                    f"{f', {len(p.failed)} failed' if p.failed else ''}, {format_size(p.bytes_done)}/{total},"
                    f" {_rate(p.rate)}, {_eta(p.eta)}\x1b[K",
                    nl=False,
                )
                return
            for url in p.finished:
                _echo(f"failed {url}: {p.failed[url]}" if url in p.failed else f"cached {url}")

        result = run_prefetch(
            cache_dir,
            wanted,
            report=report,
            cache_size=cache_size,
            min_free=min_free,
            download_workers=download_workers,
            give_up_after=give_up_after,
            s3_endpoint_url=s3_endpoint_url,
        )
    except WdsCacheError as exc:
        _fail(exc)
    if bar:
        _echo()
    if as_json:
        _echo_json(
            {
                "shards": result.total,
                "cached": result.cached,
                "bytes": result.bytes_done,
                "failed": [{"url": u, "error": e} for u, e in result.failed.items()],
            }
        )
    else:
        _echo(
            f"{result.cached} of {result.total} shard(s) cached ({format_size(result.bytes_done)})"
            + (f", {len(result.failed)} failed:" if result.failed else "")
        )
        for url, error in result.failed.items():
            _echo(f"  {url}: {error}")
    sys.exit(1 if result.failed or result.cached < result.total else 0)


@main.command(name="ls")
@_CACHE_DIR
@_JSON
def ls_command(cache_dir: Path, as_json: bool) -> None:
    """List the shards the cache knows: state, size, last read (a date), reads, URL.

    Exit status: 0 listed; 1 no cache there, or it cannot be read (the error on stderr).
    """
    from .agent.cache_commands import list_shards

    try:
        shards = list_shards(cache_dir)
    except WdsCacheError as exc:
        _fail(exc)
    if as_json:
        _echo_json(shards)
        return
    _echo(f"{'STATE':<12}{'SIZE':>9}  {'LAST READ':<26}{'READS':>6}  URL")
    for s in shards:
        _echo(
            f"{s['state']:<12}{format_size(s['size']):>9}  {s['last_read'] or 'never':<26}{s['reads']:>6}  "
            f"{s['url']}" + (f"  ({s['error']})" if s["error"] else "")
        )


@main.command()
@_CACHE_DIR
@click.option(
    "--index",
    "index_file",
    type=click.Path(dir_okay=False, exists=True, path_type=Path),
    help="A shard index (wids JSON) whose MD5s the cached copies are checked against too.",
)
@_JSON
def verify(cache_dir: Path, index_file: Path | None, as_json: bool) -> None:
    """Re-check every cached shard (size, tar structure, and with --index the MD5 it gives) and evict
    the bad ones (those a reader holds are left, and listed).

    Exit status: 0 every shard is sound; 1 some were bad (listed), or a runtime error;
    2 bad options (an --index that does not parse).
    """
    from .agent.cache_commands import no_checksum
    from .agent.cache_commands import verify as run_verify
    from .shared.urls import read_url_list

    checksum_of = no_checksum
    if index_file is not None:
        try:
            listed = read_url_list(index_file)
        except WdsCacheError as exc:
            _fail(exc)
        if listed.shards is None:
            _fail(ConfigError(f"{index_file}: not a shard index (wids JSON), a plain URL list"))
        md5s = {url: info.md5 for url, info in zip(listed.urls, listed.shards) if info.md5}
        checksum_of = lambda url: ("md5", md5s[url]) if url in md5s else None  # noqa: E731
    try:
        result = run_verify(cache_dir, checksum_of=checksum_of)
    except WdsCacheError as exc:
        _fail(exc)
    if as_json:
        _echo_json(result)
    else:
        _echo(f"checked {result['checked']} shard(s): {len(result['bad'])} bad, {len(result['evicted'])} evicted")
        held = {r["url"]: r["reason"] for r in result["refused"]}
        for b in result["bad"]:
            _echo(
                f"  bad {b['url']}: {b['problem']}" + (f" (not evicted: {held[b['url']]})" if b["url"] in held else "")
            )
    sys.exit(1 if result["bad"] else 0)


def _freed(result: dict, as_json: bool, *, unmatched: list[str] | None = None, note: str = "") -> None:
    """Print what an evict or clear freed (and ``note``, a line after it); exit 1 if a reader held
    some, or (``unmatched``: the arguments of an evict that named no cached shard) if none of the
    shards asked for was cached."""
    if unmatched is not None:
        result = {**result, "unmatched": unmatched}
    if as_json:
        _echo_json(result)
    else:
        _echo(f"evicted {len(result['evicted'])} shard(s), {format_size(result['bytes'])} freed")
        for r in result["refused"]:
            _echo(f"  refused {r['url']}: {r['reason']}")
        for arg in unmatched or ():
            # (a URL shown redacted stands for the one cached URL it shows: not for several)
            why = " (as shown redacted it names no single cached URL: give the whole URL)" if "***" in arg else ""
            _echo(f"  not cached: {arg}{why}")
        if note:
            _echo(note)
    if unmatched and not result["evicted"] and not result["refused"]:
        _echo(
            "wdscache: error: nothing evicted: no shard given is cached ('wdscache ls' lists those that are)", err=True
        )
        sys.exit(1)
    sys.exit(1 if result["refused"] else 0)


@main.command()
@click.argument("urls", nargs=-1, required=True)
@_CACHE_DIR
@_FORCE
@_JSON
def evict(urls: tuple[str, ...], cache_dir: Path, force: bool, as_json: bool) -> None:
    """Evict the cached shards of URLS (URLs, brace patterns, paths, pipe: commands, s3:// prefixes
    and globs; through the agent when one runs). A prefix or glob stands for the cached shards it
    names: the store is not asked.

    A running agent then leaves them out of its start-up prefetch: it fetches them again
    only when a reader asks for them, until its URL list changes or it restarts.

    Arguments that name no cached shard are listed ("not cached"; ``unmatched`` with --json).

    Exit status: 0 none of them is cached any more; 1 some are held by a reader (listed;
    --force evicts them), none of URLS named a cached shard, or a runtime error; 2 bad options
    or URLs.
    """
    from .agent.cache_commands import evict as run_evict

    try:
        expanded = _argument_urls(urls, _cached_lister(cache_dir), allow_pipe=True)
        result = run_evict(cache_dir, list(dict.fromkeys(u for _, us in expanded for u in us)), force=force)
    except WdsCacheError as exc:
        _fail(exc)
    absent = set(result["absent"])
    _freed(result, as_json, unmatched=[arg for arg, us in expanded if absent.issuperset(us)])


def _cached_lister(cache_dir: Path) -> Lister:
    """An ``s3://`` prefix or glob as the cached shards it names (the index read on first need)."""
    from .agent.cache_commands import list_shards
    from .shared.s3 import listed_by, named_object, split

    cached: list[str] = []

    def lister(url: str) -> tuple[str, ...]:
        named = named_object(url)
        if named is not None:
            return (named,)
        if not cached:
            cached.extend(s["url"] for s in list_shards(cache_dir) if s["url"].startswith("s3://"))
        bucket, matches = split(url)[0], listed_by(url)
        return tuple(u for u in cached if split(u)[0] == bucket and matches(split(u)[1]))

    return lister


@main.command()
@_CACHE_DIR
@_FORCE
@_JSON
def clear(cache_dir: Path, force: bool, as_json: bool) -> None:
    """Evict every cached shard (through the agent when one runs).

    A running agent then stops its start-up prefetch: it fetches again only the shards
    its readers ask for (a job reading now goes on), until its URL list changes or it
    restarts. "agent" in --json says whether one ran.

    Exit status: 0 every cached shard was evicted; 1 some are held by a reader (listed;
    --force evicts them) or a runtime error.
    """
    from .agent.cache_commands import clear as run_clear

    try:
        result = run_clear(cache_dir, force=force)
    except WdsCacheError as exc:
        _fail(exc)
    _freed(result, as_json, note="the agent fetches again only what its readers ask for" if result["agent"] else "")


# -- the live view ----------------------------------------------------------------------------------

WATCH_EVERY = 1.0  # seconds between redraws of stats --watch


def _watch(cache_dir: Path) -> None:
    """Redraw :func:`_live_view` every second until Ctrl-C (on a terminal in place, else frame after frame)."""
    import time

    from .shared.stats import collect

    # Ctrl-C only sets a flag: a KeyboardInterrupt raised inside a request to the agent could
    # leave its ZeroMQ context open, and the exit would wait on it for good.
    stop: list[int] = []
    signal.signal(signal.SIGINT, lambda signum, frame: stop.append(signum))
    clear = "\x1b[H\x1b[2J" if sys.stdout.isatty() else ""
    while not stop:
        try:
            view = _live_view(collect(cache_dir))
        except WdsCacheError as exc:
            _fail(exc)
        _echo(f"{clear}{view}" if clear else f"{view}\n")  # on a pipe, frames a blank line apart
        sys.stdout.flush()
        until = time.monotonic() + WATCH_EVERY
        while not stop and time.monotonic() < until:
            time.sleep(0.05)


def _live_view(s: dict) -> str:
    """The compact live view of a stats object: cache against budget, downloads, workers, the disk
    while downloads wait for it, every live job with its ranks and its verdict (:func:`wdscache.shared.verdict.verdicts`), the latest jobs
    that ended (:func:`wdscache.shared.stats.latest_ended`)."""
    from datetime import datetime

    from .shared.stats import latest_ended, silent_workers
    from .shared.verdict import disk_short, files_short, verdicts

    used, limit = s["bytes_used"], s.get("bytes_limit")
    agent = s.get("agent") or {}
    bar = ""
    if limit:
        filled = min(20, int(20 * used / limit))
        bar = f" [{'#' * filled}{'.' * (20 - filled)}] {100 * used / limit:.0f}%"
    lookups = s["hits"] + s["misses"]
    hit_rate = f"{100 * s['hits'] / lookups:.0f}%" if lookups else "-"
    shards = s["shards"]
    now = datetime.now().astimezone().isoformat(timespec="seconds")
    who = "agent not running"
    if agent:
        doing = "" if agent.get("answering") else ", not answering"
        if agent.get("starting"):
            doing = f", starting: {agent['starting']}"
        who = f"agent pid {agent['pid']}, up {agent['uptime_s']:.0f}s{doing}"
    lines = [
        f"wdscache {s['cache_dir']}  {now}  {who}",
        f"cache      {format_size(used)} of {format_size(limit) if limit else '?'}{bar}, "
        f"{shards['cached']} shards, {agent.get('pinned', 0)} being read",
        f"downloads  {_rate(s['download_rate'])}, {shards['downloading']} running, {shards['queued']} queued, "
        f"{shards['failed']} failed, {len(agent.get('retrying', []))} retrying; hit rate {hit_rate}, "
        f"{s.get('redownloads', 0)} re-download(s)",
    ]
    if agent.get("workers"):
        workers = agent["workers"]
        busy = [w["busy"] for w in workers if isinstance(w.get("busy"), (int, float))]
        lines.append(
            f"workers    {len(workers)}: {100 * sum(busy) / len(busy) if busy else 0:.0f}% busy now, "
            f"{sum(w.get('busy_s', 0) for w in workers):.1f}s busy in all, "
            f"{agent.get('worker_restarts', 0)} restart(s)" + silent_workers(workers)
        )
    short = disk_short(s)
    if short:
        lines.append(f"disk       {short}")
    files = files_short(s)
    if files:
        lines.append(f"files      {files}")
    judged = verdicts(s)
    for job, ranks in sorted(s.get("jobs", {}).items()):
        rate = sum(r.get("rate", 0) for r in ranks.values())
        lines.append(f"job {job}: {len(ranks)} rank(s), {rate:.0f} samples/s: {judged[job].text}")
        for rank, r in sorted(ranks.items(), key=lambda kv: int(kv[0]) if kv[0].isdigit() else 0):
            lines.append(
                f"  rank {rank:>3}  {r.get('rate', 0):8.0f} samples/s  waiting "
                f"{100 * r.get('waiting', 0):3.0f}%  {r.get('samples', 0)} samples, "
                f"waited {r.get('wait_s', 0):.1f}s" + (f", silent {r['silent_s']:.0f}s" if r.get("silent_s") else "")
            )
    shown, more = latest_ended(s)
    lines.extend(f"job {job}: {len(ranks)} rank(s), {judged[job].text}" for job, ranks in shown)
    if more:
        lines.append(more)
    if not s.get("jobs") and not s.get("ended_jobs"):
        lines.append("jobs       none")
    return "\n".join(lines)
