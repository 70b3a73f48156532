"""wdscache: a per-machine cache agent for WebDataset shards.

The public surface is what ``__all__`` lists; modules are importable but their
other names may change.
"""

import importlib.util
from typing import TYPE_CHECKING, Any

# Names resolve on first use (PEP 562): a process that needs one module of the package
# (a sample worker, say) does not pay for importing all of them.
_WHERE = {
    "ShardClient": "shared.client",
    "CachedMultiLoader": "training.loader",
    "Tuning": "training.loader",
    "AgentConfig": "shared.config",
    "AgentRunningError": "shared.errors",
    "AgentUnavailableError": "shared.errors",
    "ConfigError": "shared.errors",
    "FetchError": "shared.errors",
    "NoCacheError": "shared.errors",
    "NotTrustedError": "shared.errors",
    "ProtocolError": "shared.errors",
    "ShardError": "shared.errors",
    "ShardIndexError": "shared.errors",
    "UrlListError": "shared.errors",
    "WdsCacheError": "shared.errors",
    "UrlList": "shared.urls",
    "read_url_list": "shared.urls",
    "WebDataset": "training.pipeline",
    "ShardListDataset": "training.random_access",
}

if TYPE_CHECKING:
    from .shared.client import ShardClient
    from .shared.config import AgentConfig
    from .shared.errors import (
        AgentRunningError,
        AgentUnavailableError,
        ConfigError,
        FetchError,
        NoCacheError,
        NotTrustedError,
        ProtocolError,
        ShardError,
        ShardIndexError,
        UrlListError,
        WdsCacheError,
    )
    from .shared.stats import collect as collect_stats
    from .shared.urls import UrlList, read_url_list
    from .training.loader import CachedMultiLoader, Tuning
    from .training.pipeline import WebDataset
    from .training.random_access import ShardListDataset


def __getattr__(name: str) -> Any:
    import importlib

    if name == "collect_stats":
        value = importlib.import_module(".shared.stats", __name__).collect
    elif name in _WHERE:
        value = getattr(importlib.import_module(f".{_WHERE[name]}", __name__), name)
    else:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return sorted(__all__)


__all__ = [
    "AgentConfig",
    "AgentRunningError",
    "AgentUnavailableError",
    "CachedMultiLoader",
    "ConfigError",
    "FetchError",
    "NoCacheError",
    "NotTrustedError",
    "ProtocolError",
    "ShardClient",
    "ShardError",
    "ShardIndexError",
    "ShardListDataset",
    "Tuning",
    "UrlList",
    "UrlListError",
    "WdsCacheError",
    "WebDataset",
    "collect_stats",
    "read_url_list",
]
if importlib.util.find_spec("webdataset") is None:  # the wds extra's: `import *` and help() leave it out
    __all__.remove("WebDataset")
