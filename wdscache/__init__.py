"""wdscache: a per-machine cache agent for WebDataset shards.

The public surface is what ``__all__`` lists; modules are importable but their
other names may change.
"""

from .client import ShardClient
from .loader import CachedMultiLoader
from .config import AgentConfig
from .errors import (
    AgentRunningError,
    AgentUnavailableError,
    ConfigError,
    FetchError,
    NoCacheError,
    ProtocolError,
    ShardError,
    UrlListError,
    WdsCacheError,
)
from .stats import collect as collect_stats
from .urls import UrlList, read_url_list

__all__ = [
    "AgentConfig",
    "AgentRunningError",
    "AgentUnavailableError",
    "CachedMultiLoader",
    "ConfigError",
    "FetchError",
    "NoCacheError",
    "ProtocolError",
    "ShardClient",
    "ShardError",
    "UrlList",
    "UrlListError",
    "WdsCacheError",
    "collect_stats",
    "read_url_list",
]
