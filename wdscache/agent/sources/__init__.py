"""The sources shards come from, one class per kind of URL, registered by scheme:
``http``/``https`` (:mod:`.http`), ``s3`` (:mod:`.s3`), ``file`` (:mod:`.file`) and ``pipe:``
commands (:mod:`.pipe`). Each implements :class:`~.base.Source`; the fetcher's one retry,
resume and range loop serves them all."""

from __future__ import annotations

from .base import Settings, Source
from .file import FileSource
from .http import HttpSource
from .pipe import PipeSource
from .s3 import S3Source

SOURCES: dict[str, type[Source]] = {
    "http": HttpSource,
    "https": HttpSource,
    "s3": S3Source,
    "file": FileSource,
    "pipe": PipeSource,
}


def make_sources(settings: Settings) -> dict[str, Source]:
    """One source of each kind, by scheme (``http`` and ``https`` share one)."""
    made: dict[type[Source], Source] = {}
    return {scheme: made.setdefault(kind, kind(settings)) for scheme, kind in SOURCES.items()}
