"""Log lines for people and for log shippers: one line per notable event, dates in ISO 8601.

A notable event (a shard cached, failed, evicted or downloaded again; a consumer that
joined, left or timed out; a worker restarted) is logged with :func:`event`, which
names it (``event``) and carries its fields (``url``, ``bytes``, ``job``...). The text
format reads as a sentence; the JSON format (``wdscache agent --log-format json``)
is one object a line: ``time``, ``level``, ``logger``, ``message``, and for an event
``event`` and its fields, for shippers to index without parsing sentences.

No secret of a URL reaches a log: every module logs through :func:`get_logger`, whose records
have their message, their event's fields and their traceback passed through
:func:`~wdscache.shared.redact.redact_urls` before any handler sees them (the package's own, or
whatever a training script configured). Such a record carries its traceback as text
(``exc_text``), not as ``exc_info``.
"""

from __future__ import annotations

import json
import logging
import sys
import threading
from datetime import datetime, timezone
from types import TracebackType
from typing import Any, TextIO

from .redact import redact_urls, redacted

DEFAULT_FORMAT = "text"
FORMATS = (DEFAULT_FORMAT, "json")
_EVENT = "wdscache_event"  # the LogRecord attribute that holds an event's name and fields


def iso_time(ts: float | None) -> str | None:
    """``ts`` (seconds since the epoch) as local ISO 8601 with its UTC offset; None for 0 or None (never)."""
    if not ts:
        return None
    return datetime.fromtimestamp(ts, timezone.utc).astimezone().isoformat(timespec="seconds")


class _Redacting(logging.Filter):
    """Passes every record, its URLs redacted (see the module docstring)."""

    _traceback = logging.Formatter()

    def filter(self, record: logging.LogRecord) -> bool:
        record.msg, record.args = redact_urls(record.getMessage()), None
        fields = getattr(record, _EVENT, None)
        if fields:
            setattr(record, _EVENT, {k: redacted(v) for k, v in fields.items()})
        if record.exc_info:
            record.exc_text = redact_urls(record.exc_text or self._traceback.formatException(record.exc_info))
            record.exc_info = None  # a handler would format it again, secrets included
        return True


_REDACTING = _Redacting()


def get_logger(name: str) -> logging.Logger:
    """The logger ``name`` (a module's ``__name__``), its records' URLs redacted."""
    logger = logging.getLogger(name)
    if _REDACTING not in logger.filters:
        logger.addFilter(_REDACTING)
    return logger


def event(
    logger: logging.Logger, name: str, message: str, *args: Any, level: int = logging.INFO, **fields: Any
) -> None:
    """Log the notable event ``name`` (``message % args``) with its ``fields``."""
    logger.log(level, message, *args, extra={_EVENT: {"event": name, **fields}})


class TextFormatter(logging.Formatter):
    """``2026-12-02T01:01:03.123+00:00 INFO wdscache.agent.downloads: cached URL (1.2M)``."""

    def __init__(self) -> None:
        super().__init__("%(asctime)s %(levelname)s %(name)s: %(message)s")

    def formatTime(self, record: logging.LogRecord, datefmt: str | None = None) -> str:  # noqa: N802 (logging's name)
        return _iso_ms(record.created)


class JsonFormatter(logging.Formatter):
    """One JSON object a line (see the module docstring)."""

    def format(self, record: logging.LogRecord) -> str:
        out: dict[str, Any] = {
            "time": _iso_ms(record.created),
            "level": record.levelname,
            "logger": record.name,
            "message": record.getMessage(),
        }
        out.update(getattr(record, _EVENT, {}))
        if record.exc_info and not record.exc_text:
            record.exc_text = self.formatException(record.exc_info)
        if record.exc_text:
            out["exception"] = record.exc_text
        return json.dumps(out, default=str)


def _iso_ms(ts: float) -> str:
    return datetime.fromtimestamp(ts, timezone.utc).astimezone().isoformat(timespec="milliseconds")


def setup(stream: TextIO, *, fmt: str = DEFAULT_FORMAT, verbose: bool = False) -> None:
    """Send the package's logs to ``stream`` in format ``fmt`` (one of :data:`FORMATS`)."""
    handler = logging.StreamHandler(stream)
    handler.setFormatter(JsonFormatter() if fmt == "json" else TextFormatter())
    root = logging.getLogger("wdscache")
    root.addHandler(handler)
    root.setLevel(logging.DEBUG if verbose else logging.INFO)


def log_uncaught() -> None:
    """Log an exception no code catches, in the main thread or any other, through this package's
    redacting logger (in the format :func:`setup` chose), where Python's own hooks would print its
    traceback as it is, a URL's secrets included. For a process of ours (the agent, its workers),
    never a training script's."""
    log = get_logger("wdscache.uncaught")

    def main_hook(kind: type[BaseException], exc: BaseException, tb: TracebackType | None) -> None:
        log.critical("uncaught exception", exc_info=(kind, exc, tb))

    def thread_hook(args: threading.ExceptHookArgs) -> None:
        if args.exc_type is SystemExit or args.exc_value is None:  # (Python's own hook is silent on SystemExit too)
            return
        where = args.thread.name if args.thread is not None else "a thread"
        log.critical("uncaught exception in %s", where, exc_info=args.exc_value)

    sys.excepthook = main_hook
    threading.excepthook = thread_hook
