"""The agent's one validated configuration object, and size parsing.

:class:`AgentConfig`'s field defaults are the agent's defaults, stated here only:
the CLI's options (:mod:`wdscache.cli`) and :class:`~wdscache.agent.fetch.Fetcher` take
theirs from :func:`default`.

Where the environment is read: :mod:`wdscache.cli` (each option's ``WDSCACHE_*``
variable, through click) builds an :class:`AgentConfig` from options and
environment; nothing under it (the agent, its workers) reads the environment
again. On the training side :func:`wdscache.training.ranks.env_ranks` (and ``loader._env_places``) reads what a
launcher sets (``RANK``, ``WORLD_SIZE``, ``LOCAL_WORLD_SIZE``, ``GROUP_RANK``, ``TORCHELASTIC_RUN_ID``, and
Slurm's ``SLURM_PROCID``, ``SLURM_NTASKS``, ``SLURM_NODEID``, ``SLURM_NNODES`` in a task of
an ``srun`` step; without them, the rank and size of torch.distributed's process group when
the script initialised it) and
``WDSCACHE_CACHE_DIR``, ``WDSCACHE_ENDPOINT``, ``WDSCACHE_TOKEN``, for the
loader arguments left unset. No other module of the package reads it (the
libraries used do read their own: requests its proxy and CA variables, boto3
its ``AWS_*`` credentials, profile, region and endpoint).
"""

from __future__ import annotations

import ipaddress
import math
import os
import re
from dataclasses import MISSING, dataclass, fields
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit

from .errors import ConfigError
from .logs import DEFAULT_FORMAT, FORMATS

_UNITS = {"": 1, "K": 1 << 10, "M": 1 << 20, "G": 1 << 30, "T": 1 << 40, "P": 1 << 50}
_SIZE = re.compile(r"^\s*(\d+(?:\.\d+)?)\s*([KMGTP]?)(?:I?B)?\s*$", re.IGNORECASE)
_PERCENT = re.compile(r"^\s*(\d+(?:\.\d+)?)\s*%\s*$")


def parse_size(text: str | int, *, total: int | None = None, what: str = "size") -> int:
    """Bytes from ``1234``, ``500M``, ``1.5G``, ``2TiB`` or, given ``total``, ``80%``.

    Units are binary (``1G`` is 2**30 bytes).
    """
    if isinstance(text, int):
        return text
    if m := _PERCENT.match(text):
        if total is None:
            raise ConfigError(f"{what} {text!r}: a percentage needs a file system to refer to")
        pct = float(m.group(1))
        if not 0 < pct <= 100:
            raise ConfigError(f"{what} {text!r}: a percentage must be in (0, 100]")
        return int(total * pct / 100)
    if m := _SIZE.match(text):
        return int(float(m.group(1)) * _UNITS[m.group(2).upper()])
    raise ConfigError(f"{what} {text!r} is not a size: use bytes, 500M, 20G, 2T or 80%")


def format_size(n: float) -> str:
    """``1536`` -> ``'1.5K'``; the inverse of :func:`parse_size` up to rounding."""
    for unit in ("", "K", "M", "G", "T"):
        if abs(n) < 1024 or unit == "T":
            return f"{n:.0f}{unit}" if unit == "" else f"{n:.1f}{unit}"
        n /= 1024
    raise AssertionError("unreachable")


@dataclass(frozen=True)
class AgentConfig:
    """Everything an agent needs; built once, validated, never changed."""

    cache_dir: Path
    urls: Path
    cache_size: str = "80%"
    min_free: str = "1G"
    prefetch: int = 8
    download_workers: int = 4
    # A shard larger than one part comes as ranged parts, this many at once (1: one connection each).
    download_parts: int = 4
    download_part_size: str = "16M"
    workers: int = min(os.cpu_count() or 1, 8)
    endpoint: str | None = None
    allow_remote: bool = False
    allow_pipe: bool = False
    seed: int = 0
    shuffle: bool = True
    connect_timeout: float = 10.0
    read_timeout: float = 60.0
    retries: int = 8
    backoff: float = 0.5
    backoff_max: float = 30.0
    reader_timeout: float = 60.0
    revalidate: bool = True
    # False: no start-up window (nothing fetched, no size asked, until a client asks): the agent
    # of a `wdscache prefetch` run without one, whose prefetch says what to fetch, and once.
    startup_prefetch: bool = True
    s3_endpoint_url: str | None = None  # None: botocore's own (AWS_ENDPOINT_URL, the profile's)
    metrics_port: int | None = None  # None: no /metrics endpoint; 0: any free port
    metrics_host: str = "127.0.0.1"
    # The node this agent serves, of a job on several (see wdscache.shared.nodes): its start-up
    # prefetch is the node's part of the list.
    node_rank: int = 0
    num_nodes: int = 1
    # A private agent's users file (see wdscache.training.private): it stops once no loader holds a lock on it.
    private_users: Path | None = None
    # How its sample worker processes write their log lines (the agent's own: the CLI sets them up).
    log_format: str = DEFAULT_FORMAT

    def __post_init__(self) -> None:
        for name in ("prefetch", "download_workers", "download_parts", "workers"):
            check_count(name, getattr(self, name))
        if self.num_nodes < 1 or not 0 <= self.node_rank < self.num_nodes:
            raise ConfigError(f"--node-rank {self.node_rank} must be in [0, --num-nodes={self.num_nodes})")
        if self.retries < 0:
            raise ConfigError(f"--retries {self.retries}: use 0 or more")
        for name in ("connect_timeout", "read_timeout", "backoff", "backoff_max", "reader_timeout"):
            value = getattr(self, name)
            if not (math.isfinite(value) and value > 0):  # nan compares false to everything: no timeout at all
                raise ConfigError(f"--{name.replace('_', '-')} {value}: use a positive number of seconds")
        # Validate the syntax now; percentages are resolved against the file system at start.
        parse_size(self.cache_size, total=1, what="--cache-size")
        parse_size(self.min_free, total=1, what="--min-free")
        if parse_size(self.download_part_size, what="--download-part-size") < 64 << 10:
            raise ConfigError(f"--download-part-size {self.download_part_size!r}: use at least 64K")
        check_s3_endpoint_url(self.s3_endpoint_url)
        if self.log_format not in FORMATS:
            raise ConfigError(f"--log-format {self.log_format!r}: use one of {', '.join(FORMATS)}")
        if self.endpoint is not None:
            check_endpoint(self.endpoint, allow_remote=self.allow_remote, ports=1 + self.workers)
            # The agent names its endpoint to consumers and cache commands (agent.json), whose
            # working directory is another: a relative socket path is made absolute here.
            object.__setattr__(self, "endpoint", absolute_endpoint(self.endpoint))
        if self.metrics_port is not None and not 0 <= self.metrics_port < 65536:
            raise ConfigError(f"--metrics-port {self.metrics_port}: use a port in [0, 65535]")
        if not self.allow_remote and not is_loopback(self.metrics_host):
            raise ConfigError(
                f"--metrics-host {self.metrics_host!r} is reachable from other machines; bind 127.0.0.1, "
                "or pass --allow-remote if the network is trusted"
            )


# `wdscache prefetch --give-up-after`: seconds downloads may wait for space with no progress
# before the prefetch gives the rest up.
PREFETCH_GIVE_UP_AFTER = 10.0


# The most of each count an agent takes: far past any machine's need, short of what would stall
# its start (threads, processes) or its every turn (a window's shards).
MAX_COUNTS = {"prefetch": 100_000, "download_workers": 1024, "download_parts": 1024, "workers": 1024}


def check_count(name: str, value: int) -> None:
    """Refuse a count of option ``name`` (``download_workers``, say) below 1 or above its
    :data:`MAX_COUNTS`, naming the option."""
    if value < 1:
        raise ConfigError(f"--{name.replace('_', '-')} {value}: use at least 1")
    most = MAX_COUNTS.get(name)
    if most is not None and value > most:
        raise ConfigError(f"--{name.replace('_', '-')} {value}: use at most {most}")


def default(name: str) -> Any:
    """The default of :class:`AgentConfig`'s field ``name`` (one source for every layer that has one)."""
    for f in fields(AgentConfig):
        if f.name == name and f.default is not MISSING:
            return f.default
    raise KeyError(f"AgentConfig has no field {name!r} with a default")


def is_loopback(host: str) -> bool:
    """Whether ``host`` (a name or an address, an IPv6 one in brackets or not) is this machine's
    loopback: ``localhost``, or an address in 127.0.0.0/8 or ::1 (no lookup: names resolve
    elsewhere to anything)."""
    bare = host[1:-1] if host.startswith("[") and host.endswith("]") else host
    if bare == "localhost":
        return True
    try:
        return ipaddress.ip_address(bare).is_loopback
    except ValueError:
        return False


def check_endpoint(endpoint: str, *, allow_remote: bool, ports: int = 1) -> None:
    """Refuse endpoints we cannot serve, or not safely: only ipc://PATH and loopback
    tcp://HOST:PORT by default, the port followed by ``ports - 1`` more (the agent's workers
    listen on the ports after its own)."""
    if endpoint.startswith("ipc://"):
        if not endpoint[len("ipc://") :].strip("/"):
            raise ConfigError(f"endpoint {endpoint!r}: give the socket's path, ipc://PATH")
        return
    if not endpoint.startswith("tcp://"):
        raise ConfigError(f"endpoint {endpoint!r}: use ipc://PATH or tcp://127.0.0.1:PORT")
    host, _, port = endpoint[len("tcp://") :].rpartition(":")
    last = 65535 - (ports - 1)
    if not (host and port.isascii() and port.isdigit() and 1 <= int(port) <= last):
        workers = f" (its {ports - 1} worker(s) listen on the ports after it)" if ports > 1 else ""
        raise ConfigError(f"endpoint {endpoint!r}: use tcp://HOST:PORT with a port in [1, {last}]{workers}")
    if ":" in host and not (host.startswith("[") and host.endswith("]")):
        raise ConfigError(f"endpoint {endpoint!r}: write an IPv6 address in brackets, tcp://[ADDRESS]:PORT")
    if host == "*":  # (its workers and consumers dial the endpoint the agent names, and "*" dials nothing)
        raise ConfigError(f"endpoint {endpoint!r}: name an address, tcp://0.0.0.0:{port} for every interface")
    if not allow_remote and not is_loopback(host):
        raise ConfigError(
            f"endpoint {endpoint!r} is reachable from other machines, and its traffic is not "
            "encrypted (samples and the agent's key would cross the network in the clear); bind "
            "127.0.0.1, or pass --allow-remote if the network is trusted"
        )


def absolute_endpoint(endpoint: str) -> str:
    """``endpoint`` with an ``ipc://`` socket's relative path made absolute (from the working
    directory); any other as it is (an abstract ``ipc://@NAME`` has no path)."""
    path = endpoint[len("ipc://") :] if endpoint.startswith("ipc://") else None
    if path is None or path.startswith(("/", "@")):
        return endpoint
    return f"ipc://{os.path.abspath(path)}"


def check_s3_endpoint_url(url: str | None) -> None:
    """Refuse an ``--s3-endpoint-url`` that is not an http(s) URL with a host (None: botocore's
    own is used)."""
    if url is None:
        return
    try:
        parts = urlsplit(url)
        usable = parts.scheme in ("http", "https") and bool(parts.hostname) and (parts.port is None or parts.port > 0)
    except ValueError:  # a malformed host in brackets, a port that is no number
        usable = False
    if not usable:
        raise ConfigError(f"--s3-endpoint-url {url!r}: use http(s)://HOST[:PORT]")
