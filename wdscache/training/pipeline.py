"""``wdscache.WebDataset``: a drop-in for ``webdataset.WebDataset`` whose samples the agent serves.

It is webdataset's own ``DataPipeline`` with its ``FluidInterface`` (``decode``, ``to_tuple``,
``map``, ``map_dict``, ``select``, ``rename``, ``batched``, ``with_epoch``, ...): the stages
are webdataset's, only the source differs. webdataset's source (shard list, node and worker
splitters, shard shuffle, opener, tar expander, grouper) becomes one
:class:`~.loader.CachedMultiLoader`, which yields the same sample dicts (``__key__``,
``__url__`` and one ``bytes`` field per extension) and splits them by rank and by DataLoader
worker itself. Needs webdataset (the package's ``wds`` extra).

Differences, all where webdataset's behaviour depends on chance:

- ``shardshuffle`` and a ``.shuffle(n)`` right after the source are the loader's seeded
  shuffle (shards, and a buffer of ``n`` samples): every rank gets an exact, equal share
  and a checkpoint resumes exactly. A ``.shuffle`` later in the pipeline is webdataset's.
- ``resampled=True`` (sampling shards with replacement) is refused: every epoch delivers
  each sample once.
- ``state_dict()`` counts what left the source: exact for per-sample stages and batching
  by the DataLoader; samples held in a ``.batched()`` or a later ``.shuffle()`` buffer when
  the state is taken are counted as delivered.
"""

from __future__ import annotations

import copy
import os
from typing import Any, Callable, Iterator, Sequence

try:
    import webdataset as wds
    from webdataset.handlers import reraise_exception
except ImportError as exc:  # pragma: no cover - the message is the point
    raise ImportError(
        "wdscache.WebDataset builds on webdataset, which is not installed: "
        "pip install webdataset (the package's wds extra)"
    ) from exc

from .loader import CachedMultiLoader

class _Source(wds.PipelineStage):
    """The pipeline's first stage: the loader's samples (works whether torch is there or not)."""

    def __init__(self, loader: CachedMultiLoader) -> None:
        self.loader = loader

    def run(self) -> Iterator[dict[str, Any]]:
        return iter(self.loader)

    def close(self) -> None:
        self.loader.close()


class WebDataset(wds.DataPipeline, wds.FluidInterface):
    """``webdataset.WebDataset(urls, ...)`` with samples served by the wdscache agent.

    ``urls``: a URL or brace pattern, a list of them, or a URL list file (the rules of
    ``CachedMultiLoader``). ``cache_dir``: the agent's (a private agent starts when none
    runs); ``shardshuffle``: False or 0 reads shards in list order, anything else in the
    loader's seeded order; ``seed`` seeds it (webdataset's default is random: here 0);
    ``handler``: as webdataset's, called with the error (a ``FetchError`` or ``ShardError``)
    of a shard that cannot be read: True (``warn_and_continue``, ``ignore_and_continue``)
    skips the shard, False (``ignore_and_stop``, ``warn_and_stop``) ends the epoch there,
    raising (``reraise_exception``) raises. Other keywords go to
    :class:`~.loader.CachedMultiLoader` (``rank``, ``world_size``, ``job``, ``timeout``, ...).
    """

    def __init__(
        self,
        urls: str | os.PathLike[str] | Sequence[str] | None = None,
        *,
        cache_dir: str | os.PathLike[str] | None = None,
        shardshuffle: bool | int | None = None,
        seed: int | None = None,
        resampled: bool = False,
        handler: Callable[[BaseException], bool] = reraise_exception,
        empty_check: bool = True,
        nodesplitter: Any = None,
        workersplitter: Any = None,
        **loader_kwargs: Any,
    ) -> None:
        super().__init__()
        if resampled:
            raise ValueError("wdscache.WebDataset(resampled=True) is not supported: every epoch delivers each "
                             "sample once; use with_epoch() for epochs of a fixed length")
        if not callable(handler):
            raise TypeError(f"wdscache.WebDataset(handler={handler!r}): a handler is a function of the error, "
                            "as webdataset's (reraise_exception, warn_and_continue, ignore_and_stop, ...)")
        # The loader splits by rank and by DataLoader worker itself: webdataset's splitters
        # (nodesplitter=, workersplitter=) have nothing to split and are ignored.
        del nodesplitter, workersplitter
        self.loader = CachedMultiLoader(
            urls, cache_dir=cache_dir, shuffle=bool(shardshuffle), shuffle_buffer=0,
            seed=0 if seed is None else seed, on_error="raise" if handler is reraise_exception else handler,
            **loader_kwargs)
        self.append(_Source(self.loader))
        self.empty_check = empty_check

    def shuffle(self, size: int, **kw: Any) -> "WebDataset":
        """Right after the source, the loader's seeded buffer of ``size`` samples (shards
        shuffled too); later in the pipeline, webdataset's ``shuffle`` stage."""
        if len(self.pipeline) == 1 and not kw and size > 1:
            result = self.compose()
            result.loader = loader = copy.copy(self.loader)  # compose() shares the stages: this one changes
            loader.shuffle, loader.shuffle_buffer = True, size
            result.pipeline = [_Source(loader)]
            return result
        return super().shuffle(size, **kw)

    def __iter__(self) -> Iterator[Any]:
        count = 0
        for sample in super().__iter__():
            count += 1
            yield sample
        if count == 0 and self.empty_check:
            raise ValueError("no samples found in dataset; perhaps you have fewer shards than workers?")

    # -- the loader's, for DataLoader, StatefulDataLoader and training loops -------

    def set_epoch(self, epoch: int) -> None:
        """Make the next iteration epoch ``epoch`` (its seeded order), from its start."""
        self.loader.set_epoch(epoch)

    def state_dict(self) -> dict[str, Any]:
        return self.loader.state_dict()

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.loader.load_state_dict(state)

    def __len__(self) -> int:
        """Samples per rank in the next epoch (the source's: before any batching or with_epoch)."""
        return len(self.loader)

    def close(self) -> None:
        """As webdataset's: close the stages (the loader stops using a private agent) and drop them."""
        if hasattr(self, "pipeline"):
            super().close()

    def __enter__(self) -> "WebDataset":
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
