"""The URL lists the agent keeps for its readers besides its own: consumers' own lists, uploaded
in pages before their hello, and earlier agent lists that readers started their epoch on.

Guarantees (main loop only; :class:`~wdscache.agent.readers.Readers` owns one):

- Lists are bounded: those kept hold at most ``MAX_JOB_LIST_BYTES`` of URLs together (one list
  longer than that is kept alone), and ``MAX_UPLOADS`` are being uploaded, each of at most
  ``DEFAULT_LIMIT``; a list nobody reads is freed after ``LIST_GRACE`` (or at once when a new list
  needs its room). A hello whose list finds no room yet is refused with ``retry``: its client asks
  again (within its timeout), its upload kept meanwhile, until a job ends. An upload that gets
  no page (nor hello) for ``idle`` seconds (the agent's ``--reader-timeout``: its consumer died
  before its hello, which no reader timeout covers) is forgotten, at the latest when a new
  upload needs its room. Nothing here survives the agent: a consumer whose list is gone sends
  it again (``need_urls``).
- A list is kept only whole and as it was claimed: its pages in order, each with its facts
  when it comes from a shard index, and its hash equal to the ``list_id`` its hello names.
- A client of a TCP endpoint may be another machine: its list may name only http(s) URLs
  (``file://`` and ``s3://`` only for a peer on this machine, an ``ipc://`` endpoint), so that
  it never makes the agent read local files or use its S3 credentials.
"""

from __future__ import annotations

import time
from collections.abc import Collection, Iterator
from dataclasses import dataclass
from typing import Any

from ..shared.config import format_size
from ..shared.errors import ConfigError, ShardIndexError
from ..shared.protocol import field as get_field
from ..shared.protocol import strings
from ..shared.redact import redact_urls
from ..shared.shard_index import ShardInfo
from ..shared.urls import DEFAULT_LIMIT, UrlList, given_list, index_list
from .control import Reply

# The URLs (their text) of the lists kept together: about 800,000 of 80 characters, some 80 MB
# as held (:class:`~wdscache.shared.urls.Urls`): a few hundred jobs of lists of thousands of shards.
MAX_JOB_LIST_BYTES = 64 << 20
MAX_UPLOADS = 16  # lists being uploaded at once (their pages are held as Python strings until the hello)
LIST_GRACE = 10.0  # seconds a list nobody reads is kept: the next epoch (or len()) need not send it again


@dataclass(slots=True)
class _Upload:
    """The pages of a reader's own list received so far: URLs, their facts for a list from a shard
    index (else None), and when the last page came (monotonic)."""

    urls: list[Any]
    facts: list[Any] | None
    at: float
    checked: tuple[str, UrlList] | None = None  # its list_id and list, parsed once, while its hello waits for room


class JobLists:
    """The lists kept by ``list_id``, and those being uploaded by reader; ``idle``: seconds an
    upload that gets no page is kept (``--reader-timeout``)."""

    def __init__(self, endpoint: str, idle: float) -> None:
        # Over a TCP endpoint a peer may be another machine: it must not make us read local files,
        # nor fetch from S3 with our credentials: file:// and s3:// only for a peer on this machine.
        local = endpoint.startswith("ipc://")
        self.schemes = ("http://", "https://", "file://", "s3://") if local else ("http://", "https://")
        self._lists: dict[str, UrlList] = {}  # list_id -> a list readers read besides the agent's current one
        self._unread_since: dict[str, float] = {}  # list_id -> when its last reader left
        self._uploads: dict[str, _Upload] = {}  # reader -> its list as received so far
        self._idle = idle

    def __len__(self) -> int:
        return len(self._lists)

    def __contains__(self, key: object) -> bool:
        return key in self._lists

    def __iter__(self) -> Iterator[UrlList]:
        return iter(self._lists.values())

    def __reversed__(self) -> Iterator[UrlList]:
        """The lists, the latest kept first."""
        return reversed(self._lists.values())

    def get(self, key: str, default: UrlList) -> UrlList:
        return self._lists.get(key, default)

    def keep(self, key: str, urls: UrlList) -> None:
        """Keep ``urls`` as ``key`` (an agent list readers still read) unless kept already."""
        self._lists.setdefault(key, urls)

    def put_page(self, name: str, header: dict[str, Any]) -> Reply | None:
        """A page of reader ``name``'s own list (``put_urls``); the refusal if it is refused (with
        ``retry`` when others' uploads fill every place: its client asks again)."""
        now = time.monotonic()
        if name not in self._uploads and len(self._uploads) >= MAX_UPLOADS:
            self._forget_idle(now)
            if len(self._uploads) >= MAX_UPLOADS:
                return {"ok": False, "retry": True, "error": "too many lists being uploaded at once; try again"}
        error = self._add_page(name, header, now)
        if error is None:
            return None
        self._uploads.pop(name, None)
        return {"ok": False, "error": error}

    def _add_page(self, name: str, header: dict[str, Any], now: float) -> str | None:
        """Add a page to reader ``name``'s upload; the error if it does not fit it."""
        offset = get_field(header, "offset", int)
        page = strings(header, "urls")
        facts = header.get("shards")  # a list from a shard index: what it says of each URL of the page
        upload = self._uploads.setdefault(name, _Upload([], [] if offset == 0 and facts is not None else None, now))
        upload.at = now
        got, known = upload.urls, upload.facts
        if offset != len(got):
            return f"list page at {offset} does not follow the {len(got)} URLs received"
        if len(got) + len(page) > DEFAULT_LIMIT:
            return f"a job's list may hold at most {DEFAULT_LIMIT} URLs"
        if (known is None) != (facts is None) or (
            facts is not None and not (isinstance(facts, list) and len(facts) == len(page))
        ):
            return 'a list from a shard index gives each URL\'s facts, in every page: "shards" as long as "urls"'
        got.extend(page)
        if known is not None and facts is not None:
            known.extend(facts)
        return None

    def drop_upload(self, name: str) -> None:
        """Forget what reader ``name`` uploaded and has not claimed (it goes)."""
        self._uploads.pop(name, None)

    def _forget_idle(self, now: float) -> None:
        """Forget the uploads that got no page for ``idle`` seconds: a consumer that died while it
        sent its list never says hello, so no reader timeout drops its upload."""
        for name in [n for n, upload in self._uploads.items() if now - upload.at > self._idle]:
            del self._uploads[name]

    def take(self, name: str, claimed: str | None, read: Collection[str | None]) -> Reply | None:
        """Keep the list reader ``name`` uploaded as ``claimed`` (unless kept already); the
        refusal if it cannot be (``read``: the lists readers read, kept whatever the bound)."""
        uploaded = self._uploads.pop(name, None)
        if claimed is None or claimed in self._lists:
            return None
        if uploaded is None:
            return {"ok": False, "need_urls": True, "error": "send the list first (put_urls)"}
        if uploaded.checked is not None:
            key, parsed = uploaded.checked
        else:
            try:
                parsed = self._job_list(uploaded.urls, uploaded.facts)
            except ConfigError as exc:
                return {"ok": False, "error": str(exc)}
            key = parsed.list_id
        if key != claimed:
            return {"ok": False, "error": "the list sent does not match its list_id"}
        size = _size(parsed)
        if self._held() + size > MAX_JOB_LIST_BYTES:
            self.free(read, grace=0.0)  # lists nobody reads make room first
        held = self._held()
        if self._lists and held + size > MAX_JOB_LIST_BYTES:
            # Kept (checked) for the hello asked again; idle past the timeout once its client gives up.
            self._uploads[name] = _Upload([], None, time.monotonic(), (key, parsed))
            return {
                "ok": False,
                "retry": True,
                "error": (
                    f"the agent holds {format_size(held)} of URL lists of running jobs and this one's "
                    f"{format_size(size)} would take them past {format_size(MAX_JOB_LIST_BYTES)}; "
                    "try again once one ends"
                ),
            }
        self._lists[claimed] = parsed
        return None

    def _held(self) -> int:
        """The URLs' text the lists kept hold together."""
        return sum(_size(listed) for listed in self._lists.values())

    def _job_list(self, urls: list[Any], facts: list[Any] | None) -> UrlList:
        """A consumer's own URL list (with what its shard index says of each, if it came from one),
        held to what this endpoint may fetch for others."""
        schemes = self.schemes
        for u in urls:
            if not isinstance(u, str) or not u.startswith(schemes):
                raise ConfigError(f"{_shown(u)!r}: a job's URLs must be absolute {'/'.join(schemes)} URLs")
        if facts is not None:
            try:
                return index_list([(u, ShardInfo.from_wire(f)) for u, f in zip(urls, facts)])
            except ValueError as exc:
                raise ConfigError(f"a job's shard facts: {exc}") from None
        try:
            return given_list(urls)
        except ShardIndexError as exc:
            raise ConfigError(f"{_shown(exc.url)!r}: {exc.reason}" if exc.url else exc.reason) from None

    def free(self, read: Collection[str | None], grace: float = LIST_GRACE) -> None:
        """Forget the lists no reader has read (``read``: those read now) for ``grace`` seconds (a
        million URLs is about 140 MB), and the idle uploads; a consumer that comes back sends its
        list again (``need_urls``)."""
        now = time.monotonic()
        self._forget_idle(now)
        for key in list(self._lists):
            if key in read:
                self._unread_since.pop(key, None)
            elif now - self._unread_since.setdefault(key, now) >= grace:
                del self._lists[key]
                self._unread_since.pop(key)


def _size(listed: UrlList) -> int:
    """What ``listed`` counts for against ``MAX_JOB_LIST_BYTES``: its URLs' text."""
    return len(listed.urls.text())


def _shown(url: object) -> str:
    """``url`` as an error shows it: redacted before it is cut, as a cut may hide a secret's end."""
    return redact_urls(str(url))[:200]
