"""A bound on the wait for a whole HTTP response head, which ``requests`` lacks: its read timeout
bounds each read from the socket, so a server or proxy that sends a status line and then a header
byte now and then (never silent for a whole read timeout) would hold a request for ever.

A session with :class:`WatchedAdapter` mounted reads every response head under the
:class:`HeadWatch` of the :func:`send_watched` call that sent it: a head not whole within the
watch's seconds of its request being sent (the read timeout: a head is a few hundred bytes, which
a server that sends its first byte in time sends at once), or whose download is cancelled
meanwhile, has its socket shut down, so the request ends (with an error, or a head cut short) and
:func:`send_watched` raises TimeoutError, or Cancelled. The watch looks every ``LOOK_EVERY``
seconds, as the pipe source does at a silent command.
"""

from __future__ import annotations

import contextlib
import socket
import threading
import time
from collections.abc import Callable, Iterator
from contextvars import ContextVar
from typing import Any

import requests
import urllib3
from urllib3.connection import HTTPConnection, HTTPSConnection
from urllib3.connectionpool import HTTPConnectionPool, HTTPSConnectionPool

from ..shard_download import Cancelled

LOOK_EVERY = 0.25  # seconds between looks at the time and the cancel flag while a head comes

_WATCH: ContextVar[HeadWatch | None] = ContextVar("wdscache_head_watch", default=None)


class HeadWatch:
    """The bound on the heads of one call of a session (redirects too): each whole within
    ``seconds`` of its request, and none once ``cancel`` is set. ``cut`` says why a head's socket
    was shut down, if one was."""

    def __init__(self, seconds: float, cancel: threading.Event | None) -> None:
        self.seconds, self.cancel = seconds, cancel
        self.cut: str | None = None  # "timeout" or "cancel"
        self._lock = threading.Lock()

    @contextlib.contextmanager
    def over(self, sock: socket.socket | None) -> Iterator[None]:
        """Watch ``sock`` while the calling thread reads a head from it."""
        if sock is None:  # (not connected: http.client raises at once, no head to wait for)
            yield
            return
        ended = threading.Event()
        until = time.monotonic() + self.seconds
        threading.Thread(target=self._watch, args=(sock, until, ended), name="head-watch", daemon=True).start()
        try:
            yield
        finally:
            with self._lock:  # a cut is made whole, or not at all, before the head is taken
                ended.set()

    def _watch(self, sock: socket.socket, until: float, ended: threading.Event) -> None:
        while not ended.wait(max(0.0, min(LOOK_EVERY, until - time.monotonic()))):
            cancelled = self.cancel is not None and self.cancel.is_set()
            if cancelled or time.monotonic() >= until:
                with self._lock:
                    if ended.is_set():
                        return
                    self.cut = "cancel" if cancelled else "timeout"
                    with contextlib.suppress(OSError):  # (closed meanwhile)
                        sock.shutdown(socket.SHUT_RDWR)  # the blocked read returns at once
                return


def send_watched(
    send: Callable[[], requests.Response], url: str, seconds: float, cancel: threading.Event | None = None
) -> requests.Response:
    """``send()``'s response, its head (each head: redirects too) whole within ``seconds`` of its
    request, and none once ``cancel`` is set. Raises Cancelled, or TimeoutError (an OSError: an
    attempt retried as a read timeout is) when a head was cut."""
    watch = HeadWatch(seconds, cancel)
    token = _WATCH.set(watch)
    try:
        r = send()
    except (OSError, requests.RequestException) as exc:
        _raise_cut(watch, url, seconds, exc)
        raise
    finally:
        _WATCH.reset(token)
    if watch.cut:
        r.close()  # (its head was cut short: not an answer)
        _raise_cut(watch, url, seconds, None)
    return r


def _raise_cut(watch: HeadWatch, url: str, seconds: float, cause: BaseException | None) -> None:
    if watch.cut == "cancel":
        raise Cancelled(url) from cause
    if watch.cut == "timeout":
        raise TimeoutError(
            f"no whole response head within {seconds:g}s of the request (--read-timeout): "
            "the server, or a proxy, sends it too slowly"
        ) from cause


class _Watched(HTTPConnection):
    def getresponse(self) -> Any:
        watch = _WATCH.get()
        if watch is None:
            return super().getresponse()
        with watch.over(self.sock):
            return super().getresponse()


class _WatchedHTTPS(_Watched, HTTPSConnection):
    pass


class _Pool(HTTPConnectionPool):
    ConnectionCls = _Watched


class _HTTPSPool(HTTPSConnectionPool):
    ConnectionCls = _WatchedHTTPS


_POOLS: dict[str, type[HTTPConnectionPool]] = {"http": _Pool, "https": _HTTPSPool}


class WatchedAdapter(requests.adapters.HTTPAdapter):
    """requests' adapter, its heads read under the thread's :func:`send_watched` (directly, or through
    an HTTP(S) proxy; a SOCKS proxy's connections are its own)."""

    def init_poolmanager(self, *args: Any, **kwargs: Any) -> None:
        super().init_poolmanager(*args, **kwargs)
        self.poolmanager.pool_classes_by_scheme = _POOLS

    def proxy_manager_for(self, proxy: str, **proxy_kwargs: Any) -> Any:
        manager = super().proxy_manager_for(proxy, **proxy_kwargs)
        if isinstance(manager, urllib3.ProxyManager):
            manager.pool_classes_by_scheme = _POOLS
        return manager
