"""The agent's ``/metrics`` endpoint (``wdscache agent --metrics-port``): Prometheus over HTTP.

Guarantees (threads): ``prometheus_client``'s server thread answers scrapes from the
last stats snapshot the main loop handed over (:meth:`MetricsServer.update`, every
second), never from the agent's live state, which is the main loop's alone. Bound to
127.0.0.1 unless the operator chose another address (``--allow-remote``).
"""

from __future__ import annotations

import errno
import threading
from typing import Any

from ..shared.errors import ConfigError
from ..shared.metrics import StatsCollector, require


class MetricsServer:
    """Serving on (``host``, ``port``) from construction until :meth:`close`; ``port`` 0 picks one."""

    def __init__(self, host: str, port: int) -> None:
        require()
        from prometheus_client import CollectorRegistry, start_http_server

        self._snapshot: dict[str, Any] | None = None
        self._lock = threading.Lock()
        registry = CollectorRegistry()
        registry.register(StatsCollector(self._latest))
        try:
            self._httpd, self._thread = start_http_server(port, addr=host, registry=registry)
        except OSError as exc:
            taken = exc.errno == errno.EADDRINUSE  # else the host: a name that does not resolve, say
            raise ConfigError(
                f"cannot serve metrics on {host}:{port} ({exc.strerror}): choose another "
                f"{'--metrics-port' if taken else '--metrics-host'}"
            ) from None
        self.host, self.port = host, self._httpd.server_address[1]

    @property
    def url(self) -> str:
        host = f"[{self.host}]" if ":" in self.host else self.host
        return f"http://{host}:{self.port}/metrics"

    def _latest(self) -> dict[str, Any] | None:
        with self._lock:
            return self._snapshot

    def update(self, stats: dict[str, Any]) -> None:
        """From the main loop: what the next scrapes report."""
        with self._lock:
            self._snapshot = stats

    def close(self) -> None:
        self._httpd.shutdown()
        self._httpd.server_close()
        self._thread.join(2.0)
