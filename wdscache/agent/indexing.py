"""Making a shard index (``wdscache index``): each shard read once, its facts as the agent finds them.

A shard is fetched with the agent's own :class:`~wdscache.agent.fetch.Fetcher` (HTTP(S), S3,
local files, with its retries and resumes) into a scratch folder, its MD5 taken over the
bytes as they came (a gzip'd shard's compressed bytes, as wids hashes the file), and its
samples counted in the tar the agent would cache, with the agent's walk
(:func:`wdscache.shared.samples.scan`): so ``nsamples`` is the count the agent and the
loader find. A plain tar on a local path is read where it lies, not copied.
"""

from __future__ import annotations

import itertools
import threading
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

from ..shared.errors import FetchError, ShardError, WdsCacheError
from ..shared.shard_index import ShardInfo, count_samples, file_facts
from ..shared.tarwalk import GZIP_MAGIC
from ..shared.urls import file_path
from .fetch import Fetcher
from .shard_download import Budget, Download


class Indexer:
    """Reads shards into :class:`ShardInfo`, ``jobs`` at a time, with scratch files in ``scratch``."""

    def __init__(self, fetcher: Fetcher, scratch: Path, *, jobs: int = 4) -> None:
        self.fetcher, self.scratch, self.jobs = fetcher, scratch, jobs
        self._names = itertools.count()  # scratch file names, one per download
        self._lock = threading.Lock()

    def shard(self, url: str) -> ShardInfo:
        """Read ``url`` once: its size, MD5 and samples. Raises FetchError or ShardError."""
        try:
            local = _local_tar(url)
            if local is not None:
                size, md5 = file_facts(local, md5=True)
                return ShardInfo(count_samples(local, url=url), size, md5)
            with self._lock:
                n = next(self._names)
            d = Download(
                url,
                partial=self.scratch / f"{n}.part",
                final=self.scratch / f"{n}.tar",
                budget=Budget(_unbounded),
                digest=True,
            )
            try:
                fetched = self.fetcher.fetch(d)
                return ShardInfo(count_samples(d.final, url=url), fetched.size, d.progress.md5)
            finally:
                for path in (d.partial, d.final, d.partial.with_name(d.partial.name + "~tar")):
                    path.unlink(missing_ok=True)
        finally:
            self.fetcher.close_thread()

    def shards(
        self, urls: Sequence[str], done: Callable[[str, ShardInfo | None, WdsCacheError | None], None]
    ) -> list[ShardInfo | WdsCacheError]:
        """Each of ``urls`` read (in parallel), in list order: its facts, or the error that stopped it.
        ``done(url, info, error)`` is called as each one ends (in the calling thread)."""
        results: list[ShardInfo | WdsCacheError] = []
        with ThreadPoolExecutor(max_workers=self.jobs, thread_name_prefix="index") as pool:
            for url, future in [(url, pool.submit(self._try, url)) for url in urls]:
                result = future.result()
                results.append(result)
                if isinstance(result, ShardInfo):
                    done(url, result, None)
                else:
                    done(url, None, result)
        return results

    def _try(self, url: str) -> ShardInfo | WdsCacheError:
        try:
            return self.shard(url)
        except (FetchError, ShardError) as exc:
            return exc
        except OSError as exc:
            return FetchError(url, f"{type(exc).__name__}: {exc}")


def _local_tar(url: str) -> Path | None:
    """The path of a ``file:`` URL naming a plain tar (read in place); None for anything else."""
    if not url.startswith("file://"):
        return None
    path = Path(file_path(url))
    try:
        with open(path, "rb") as f:
            return None if f.read(2) == GZIP_MAGIC else path
    except FileNotFoundError:
        raise FetchError(url, f"no such file: {path}", permanent=True) from None
    except PermissionError:
        raise FetchError(url, f"permission denied: {path}", permanent=True) from None


def _unbounded(d: Download, total: int, timeout: float | None) -> bool:
    """The budget of a scratch download: whatever it asks (it is one shard, deleted once read)."""
    d.budget.reserved = max(d.budget.reserved, total)
    return True
