"""The progress clock of an epoch stream, in the training process: why no wait of a
consumer lasts longer than ``timeout`` seconds without progress.

``progress_at`` is the last moment something moved: a reply brought samples, a download
we wait for grew (the agent's ``written``), or the user handed control back between
samples. Every wait of the stream checks the clock (:meth:`ProgressClock.check_stall`) or
is cut to what is left of it (:meth:`ProgressClock.left`); past the timeout the error
names the reason the agent gives for the shard waited for, or that its workers did not
answer; a wait the agent says is its own fault (out of open files: the status's ``agent_fault``)
is a WdsCacheError naming it, not the shard's FetchError, so that no ``on_error`` skips the shard.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from typing import Any

from ..shared.client import AgentConnection
from ..shared.errors import AgentUnavailableError, FetchError, WdsCacheError
from ..shared.messages import Requests

WORKERS_SILENT = "its workers did not answer"  # the hint of a stall while the agent itself answers
Waited = tuple[int | None, dict[str, Any] | None]  # the shard waited for (None: none), and its status if known


class ProgressClock:
    """The progress clock of reader ``reader`` (its agent at ``endpoint``)."""

    def __init__(
        self, conn: AgentConnection, reader: str, urls: Sequence[str], *, endpoint: str, timeout: float
    ) -> None:
        self.conn, self.urls, self.endpoint, self.timeout = conn, urls, endpoint, timeout
        self.requests = Requests(reader)
        self.progress_at = time.monotonic()
        self.written: dict[int, int] = {}  # bytes the agent said a download we wait for holds

    def left(self) -> float:
        """Seconds until the wait in progress counts as a stall; at least one, so that a busy
        agent's answer near the end still counts."""
        return max(1.0, self.progress_at + self.timeout - time.monotonic())

    def heard(self, shard: int, status: dict[str, Any]) -> None:
        """What the agent says of a shard we wait for: bytes arriving are progress, and no
        progress for ``timeout`` seconds ends the wait (a failed download ends it with the
        agent's answer to the open itself)."""
        written = status.get("written")
        if isinstance(written, int) and written > self.written.get(shard, -1):
            self.written[shard] = written
            self.progress_at = time.monotonic()
        self.check_stall(lambda: (shard, status))

    def check_stall(self, waited: Callable[[], Waited]) -> None:
        """Raise if nothing moved for ``timeout`` seconds; ``waited`` gives the shard waited
        for and what the agent said of it (asked here if it says nothing)."""
        timeout = self.timeout
        if time.monotonic() - self.progress_at <= timeout:
            return
        shard, status = waited()
        if shard is None:
            # Nothing of ours is downloading: our reads went unanswered. Is the agent there?
            self.conn.request(self.requests.ping(), timeout=min(2.0, timeout))
            raise AgentUnavailableError(self.endpoint, timeout, WORKERS_SILENT)
        url = self.urls[shard]
        if status is None:
            status = self.conn.request(self.requests.status(url), timeout=min(2.0, timeout))
        if status.get("agent_fault"):
            raise WdsCacheError(
                f"no progress for {timeout:g}s on {url}: the agent at {self.endpoint} cannot download it: "
                f"{status['agent_fault']}"
            )
        raise FetchError(url, f"no progress for {timeout:g}s: {why_not_there(status)}")


def agent_gone(exc: AgentUnavailableError, timeout: float) -> AgentUnavailableError:
    """The error of an agent that served an epoch, then went silent (it died, or restarted and is
    not back), from ``exc`` of the request that went unanswered. That request waited what was left
    of the wait (or less: a status asked within it), a figure that tells the user nothing: named is
    the loader's ``timeout``, which a wait without progress lasts, and what to do."""
    return AgentUnavailableError(
        exc.endpoint,
        timeout,
        f"the agent that served this epoch died or restarted, and no run of it answered again within the "
        f"loader's timeout={timeout:g} (an agent started again within it is taken up where the epoch stands; "
        f"a longer timeout= waits longer for it); {exc.hint}".rstrip("; "),
    )


def why_not_there(status: dict[str, Any]) -> str:
    """Why a shard is not there yet, from the agent's status of it."""
    state = status.get("state")
    if state == "failed":
        return f"its download failed: {status.get('error')}"
    if status.get("reason"):
        return str(status["reason"])
    written, total = status.get("written"), status.get("total")
    failing = f"; {status['failing']}" if status.get("failing") else ""
    if isinstance(written, int):
        of = f" of {total}" if isinstance(total, int) else ""
        return f"its download has {written}{of} bytes and gets no more{failing}"
    if state == "queued":
        return "its download waits for a connection"
    if state == "cached":
        return "it is cached, but the agent's workers did not answer"
    return f"the agent has no download of it ({state})"
