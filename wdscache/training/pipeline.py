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
  and a checkpoint resumes exactly. A ``.shuffle`` later in the pipeline, or one given
  webdataset's ``initial=``, ``rng=`` or ``seed=``, is webdataset's (with a warning right
  after the source).
- ``resampled=True`` draws shards with replacement, seeded per epoch (``set_epoch`` gives
  another draw): the one-source mixture with replacement (:mod:`wdscache.shared.mixture`),
  its epoch ``epoch_samples=`` samples of the job, or ``with_epoch(n)`` for each DataLoader
  worker. With neither, an iteration is endless, as webdataset's: the loader's epochs one
  after another, each :data:`ENDLESS_EPOCH` samples of each DataLoader worker (so a cut
  outside, by a ``wds.DataPipeline``'s or ``wds.WebLoader``'s ``with_epoch`` or by
  ``islice``, takes what it needs, and the next iteration begins the epoch after the last
  one begun: another draw). ``mix={source: weight}`` with ``epoch_samples=`` mixes several sources.
- ``state_dict()`` counts what left the source: exact for per-sample stages and batching
  by the DataLoader; samples held in a ``.batched()`` or a later ``.shuffle()`` buffer when
  the state is taken are counted as delivered. ``with_epoch(n)``'s cut is counted too (each
  DataLoader worker's its own): the next iteration after a cut is the loader's next epoch,
  whether the cut came before the loader's epoch ended (under ``resampled=True`` without
  ``epoch_samples=``, that epoch is ``n`` rounded up to whole blocks) or ran on into the
  next one. An iteration resumed from a checkpoint yields the rest of its ``n`` (none, if the
  ``n`` were out before its end was met), and one taken once the iteration is over resumes
  at the next epoch, as the run would have gone on.

``pipe:`` URLs are shell commands, which the agent runs only from its own list: given here,
they run in this process, as webdataset runs them. Such a dataset is webdataset's own
pipeline over those shards (its shard list, splitters, shuffle, opener, tar reader and
grouper, with webdataset's keywords: ``resampled``, ``select_files``, ...), uncached: its
samples are webdataset's, it has no checkpoint (``state_dict``) and no ``len()``, and the
loader's keywords (``rank``, ``timeout``, ...) do not apply.
"""

from __future__ import annotations

import copy
import dataclasses
import os
import warnings
from collections.abc import Callable, Iterable, Iterator, Sequence
from itertools import islice
from typing import Any

try:
    import webdataset as wds
    from webdataset.handlers import reraise_exception
except ImportError as exc:  # pragma: no cover - the message is the point
    raise ImportError(
        "wdscache.WebDataset builds on webdataset, which is not installed: "
        "pip install webdataset (the package's wds extra)"
    ) from exc

from ..shared.errors import ConfigError
from .loader import CachedMultiLoader
from .urls_arg import PIPE, pipe_urls, split_patterns, taken_once

_NOTHING = object()  # what an epoch without samples gives first
# A checkpoint's count of the items an iteration cut by with_epoch(n) had yielded (see
# WebDataset._cut): the loader's state does not know that cut.
CUT_ITEMS = "with_epoch_items"
# Samples of each DataLoader worker (of each rank, without workers) in each epoch of an endless
# resampled dataset (resampled=True with neither epoch_samples= nor its own with_epoch(n)): whole
# blocks (8), so every rank and worker gets exactly as many. Long enough that an epoch's start
# (its shard counts asked of the agent, a session opened) costs little per sample; short enough
# that a cut outside, which leaves the rest of an epoch unread, leaves little.
ENDLESS_EPOCH = 8192


class _Source(wds.PipelineStage):
    """The pipeline's first stage: the loader's samples (works whether torch is there or not).
    ``endless``: the loader's epochs one after another, in one run of the pipeline, as
    webdataset's resampled source is endless; so the stages after it (a ``batched``) see one
    stream, with no end between two epochs (which would flush a short batch, or, with
    ``partial=False``, drop it)."""

    def __init__(self, loader: CachedMultiLoader, *, endless: bool) -> None:
        self.loader, self.endless = loader, endless

    def run(self) -> Iterator[dict[str, Any]]:
        return self._chained() if self.endless else iter(self.loader)

    def _chained(self) -> Iterator[dict[str, Any]]:
        """Each epoch the one after the last begun, until one is empty; but the rest of an epoch
        resumed from a checkpoint may be empty (all of it was out before it was taken)."""
        loader = self.loader
        resumed = loader._resumed_from is not None and not loader._next.over
        while True:
            samples = iter(loader)
            first = next(samples, None)  # (a sample is a dict)
            if first is None:
                if resumed:
                    resumed = False
                    continue
                return
            resumed = False
            yield first
            yield from samples  # the rest without a step of Python each

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
    raising (``reraise_exception``) raises. ``mode="resampled"`` is ``resampled=True``.
    webdataset's keywords that change nothing here are taken: ``repeat`` and ``verbose`` (no
    effect in webdataset 1.0.2 either), ``detshuffle`` (the loader's shuffles are seeded),
    ``cache_size`` and ``url_to_name`` (webdataset's own cache's: the agent's ``--cache-size``
    and names decide); ``select_files`` and ``rename_files`` are refused (the agent serves
    whole samples) but for ``pipe:`` shards, which webdataset reads. Other keywords go to :class:`~.loader.CachedMultiLoader` (``rank``,
    ``world_size``, ``job``, ``timeout``, ...).
    """

    def __init__(
        self,
        urls: str | os.PathLike[str] | Iterable[str] | None = None,
        handler: Callable[[BaseException], bool] = reraise_exception,
        mode: str | None = None,
        *,
        cache_dir: str | os.PathLike[str] | None = None,
        shardshuffle: bool | int | None = None,
        seed: int | None = None,
        resampled: bool = False,
        empty_check: bool = True,
        nodesplitter: Any = None,
        workersplitter: Any = None,
        repeat: bool = False,
        verbose: bool = False,
        detshuffle: bool = False,
        cache_size: int = -1,
        url_to_name: Any = None,
        select_files: Callable[[str], bool] | None = None,
        rename_files: Callable[[str], str] | None = None,
        **loader_kwargs: Any,
    ) -> None:
        super().__init__()
        del repeat, verbose, cache_size, url_to_name  # see the docstring: nothing to do here
        if mode not in (None, "resampled"):
            raise ValueError(f"wdscache.WebDataset(mode={mode!r}): the one mode is 'resampled', as in webdataset")
        resampled = resampled or mode == "resampled"
        given = taken_once(urls)
        if not callable(handler):
            raise TypeError(
                f"wdscache.WebDataset(handler={handler!r}): a handler is a function of the error, "
                "as webdataset's (reraise_exception, warn_and_continue, ignore_and_stop, ...)"
            )
        if isinstance(given, (str, Sequence)) and pipe_urls(given):
            self.loader = None
            self._piped(
                given,
                handler=handler,
                empty_check=empty_check,
                unused=loader_kwargs,
                # webdataset's own keywords: its pipeline takes them as it does
                shardshuffle=shardshuffle,
                seed=seed,
                resampled=resampled,
                detshuffle=detshuffle,
                nodesplitter=nodesplitter,
                workersplitter=workersplitter,
                select_files=select_files,
                rename_files=rename_files,
            )
            return
        for name, chooser in (("select_files", select_files), ("rename_files", rename_files)):
            if chooser is not None:
                raise ValueError(
                    f"wdscache.WebDataset({name}=...): the agent serves whole samples, so tar members are "
                    "not chosen or renamed as they are read; drop or rename fields in a stage after the "
                    "source instead (.map_dict, .rename, .map), or read pipe: shards, which webdataset reads"
                )
        # The loader splits by rank and by DataLoader worker itself: webdataset's splitters
        # (nodesplitter=, workersplitter=) have nothing to split and are ignored.
        del nodesplitter, workersplitter
        self.loader = CachedMultiLoader(
            given,
            cache_dir=cache_dir,
            shuffle=bool(shardshuffle),
            shuffle_buffer=0,
            seed=0 if seed is None else seed,
            on_error="raise" if handler is reraise_exception else handler,
            resampled=resampled,
            **loader_kwargs,
        )
        mix = self.loader._mix
        # webdataset's resampled dataset is endless: here the loader's epochs, of ENDLESS_EPOCH
        # samples a worker each, one after another (with_epoch(n) makes them n, and cuts).
        self._endless_source = mix is not None and mix.replacement and mix.epoch_samples is None
        if self._endless_source:
            assert mix is not None
            self.loader._mix = dataclasses.replace(mix, per_worker=ENDLESS_EPOCH)
        self.append(_Source(self.loader, endless=self._endless_source))
        self.empty_check = empty_check
        self._cut_items = 0  # items the iteration cut by with_epoch has yielded (see _cut)
        self._cut_over = False  # ...and whether it is over (the next iteration is the next epoch)
        self._resumed_items = 0  # ...and, from a checkpoint, before the next one starts

    def _piped(
        self,
        urls: str | Sequence[str],
        *,
        handler: Callable[[BaseException], bool],
        empty_check: bool,
        unused: dict[str, Any],
        **webdatasets: Any,
    ) -> None:
        """``pipe:`` shards: webdataset's own pipeline over them, in this process (see the module),
        made with ``webdatasets``, its keywords given (a splitter left ``None`` is its default).
        A string goes to webdataset whole: it splits it at ``::`` and expands its braces."""
        items = split_patterns(urls) if isinstance(urls, str) else list(urls)
        others = [u for u in items if not (isinstance(u, str) and u.startswith(PIPE))]
        if others:
            raise ConfigError(
                f"urls= mixes pipe: commands with other shards ({others[0]!r}): pipe: shards are "
                "read in this process, uncached, the others through the agent; make a dataset of each"
            )
        if unused:
            raise TypeError(
                f"wdscache.WebDataset({', '.join(f'{k}=' for k in sorted(unused))}...) does not apply to "
                "pipe: shards: webdataset reads them in this process, uncached (split them with "
                "nodesplitter= and workersplitter=, as in webdataset)"
            )
        splitters = ("nodesplitter", "workersplitter")
        reader = wds.WebDataset(
            urls if isinstance(urls, str) else items,
            handler=handler,
            empty_check=False,  # (the check is this dataset's, in _iteration)
            **{k: v for k, v in webdatasets.items() if not (k in splitters and v is None)},
        )
        self.pipeline = reader.pipeline
        self.empty_check = empty_check

    def shuffle(self, size: int, **kw: Any) -> WebDataset:
        """Right after the source, the loader's seeded buffer of ``size`` samples (shards
        shuffled too); later in the pipeline, or with webdataset's keywords (``initial``, ``rng``,
        ``seed``), webdataset's ``shuffle`` stage, right after the source with a ``UserWarning``:
        the loader's buffer, which checkpoints replay, has its own fixed start and seeded generator."""
        source = self.loader if len(self.pipeline) == 1 and size > 1 else None
        if source is not None and kw:
            warnings.warn(
                f"wdscache.WebDataset.shuffle({size}, {', '.join(f'{k}=' for k in sorted(kw))}...) is "
                "webdataset's shuffle stage, not the loader's seeded buffer: a checkpoint counts the "
                "samples it holds as delivered, its order is random unless seed= or rng= fixes it, and "
                "shards are shuffled by shardshuffle= alone; .shuffle(n) without keywords is the loader's",
                UserWarning,
                stacklevel=2,
            )
        if source is not None and not kw:
            result = self.compose()
            result.loader = loader = copy.copy(source)  # compose() shares the stages: this one changes
            loader.shuffle, loader.shuffle_buffer = True, size
            if source._private_agent is not None:
                loader._ensure_agent()  # a copy holds no use of it (see __getstate__): its own, as the original's
            result.pipeline = [_Source(loader, endless=self._endless_source)]
            return result
        return super().shuffle(size, **kw)

    def with_epoch(self, nsamples: int = -1, nbatches: int = -1) -> WebDataset:
        """webdataset's: each DataLoader worker yields ``nsamples`` (or ``nbatches``) an epoch, and
        its next iteration is the loader's next epoch (a checkpoint counts the cut). Under
        ``resampled=True`` without ``epoch_samples=``, it is also the length of the loader's epoch
        (in place of :data:`ENDLESS_EPOCH`): each worker draws its ``nsamples``, and an iteration
        ends after them. The cut counts the pipeline's items: after a ``batched(b)`` an iteration
        takes ``n * b`` samples, from as many of the loader's epochs of ``n`` as that needs (each a
        few milliseconds to begin); a cut on a ``WebLoader``, as webdataset's examples make it,
        leaves the loader's epochs at :data:`ENDLESS_EPOCH`."""
        loader = self.loader
        mix = loader._mix if loader is not None else None
        cut = max(nsamples, nbatches)  # webdataset's: either names the items an iteration yields
        if loader is not None and mix is not None and mix.replacement and mix.epoch_samples is None:
            if cut <= 0:
                raise ValueError(
                    "with resampled=True, with_epoch() takes nsamples (each worker's samples): "
                    "the loader draws that many for each; or give epoch_samples="
                )
            loader._mix = dataclasses.replace(mix, per_worker=cut)
        return super().with_epoch(nsamples, nbatches)

    def __iter__(self) -> Iterator[Any]:
        """An iteration, its start said at once (as ``CachedMultiLoader``'s ``iter()`` says it): the
        loader's next epoch (a DataLoader worker's, see :mod:`wdscache.training.dataset`) and the
        count of its cut, so that a state taken before its first item (torchdata takes each
        worker's right after ``iter()``) names where it starts; the agent is asked for nothing
        until that item."""
        cuts = self._cuts()
        if self.loader is not None:
            self.loader._settle_next()
        if cuts:  # (its rest, resumed from a checkpoint; kept until the first item, should iter() be called again)
            self._cut_items, self._cut_over = self._resumed_items, False
        return self._iteration(cuts)

    def _iteration(self, cuts: bool) -> Iterator[Any]:
        rest_empty = cuts and self._resumed_items >= self.nsamples  # resumed once its n were out
        samples = self._cut() if cuts else super().__iter__()
        first = next(samples, _NOTHING)
        if first is _NOTHING:
            # webdataset's check, of a worker's shards: here of the rank's share, which its workers
            # slice by blocks of samples (one may get none where each would get a shard).
            if self.empty_check and not rest_empty and (self.loader is None or self.loader._rank_share_empty()):
                raise ValueError("no samples found in dataset; perhaps you have fewer shards than workers?")
            return
        yield first
        yield from samples  # the rest without a step of Python each

    def _cuts(self) -> bool:
        """Whether ``with_epoch(n)`` (or ``repeat(nbatches=n)``) cuts the iterations: the cut is
        counted, for checkpoints, whatever the loader's epoch (under ``resampled=True`` without
        ``epoch_samples=``, ``n`` rounded up to whole blocks; otherwise its own length, which the
        cut may end early or run past into the next epoch)."""
        return self.loader is not None and self.nsamples > 0

    def _endless(self) -> bool:
        """Whether an iteration runs the loader's epochs without end (``resampled=True`` with neither
        ``epoch_samples=`` nor a cut): each the epoch after the last one begun, so each another draw."""
        return self.loader is not None and self._endless_source and not self._cuts()

    def _cut(self) -> Iterator[Any]:
        """webdataset's ``with_epoch(n)`` cut, counted: the ``n`` items of an iteration (their rest,
        resumed from a checkpoint), so that a checkpoint can say how many are out, and whether
        the iteration is over (its ``n`` out, or its epochs ended before)."""
        self._resumed_items = 0  # the rest resumed is this iteration's now (__iter__ counted it in _cut_items)
        for item in islice(self._epochs(), max(0, self.nsamples - self._cut_items)):
            self._cut_items += 1
            yield item
        self._cut_over = True

    def _epochs(self) -> Iterator[Any]:
        """webdataset's ``iterator()``: runs of the pipeline one after another (``repetitions`` of
        them; each the loader's next epoch, or, from an endless source, its epochs without end),
        until one is empty; but the rest of an epoch resumed from a checkpoint may be empty (all of
        it was out before it was taken), and the next epoch follows. (A DataLoader worker's slice
        that was over when the checkpoint was taken is that worker's iteration over: it gives
        nothing.)"""
        assert self.loader is not None
        resumed = self.loader._resumed_from is not None and not self.loader._next.over
        for _ in range(self.repetitions):
            count = 0
            for item in self.iterator1():
                count += 1
                yield item
            if count == 0 and not resumed:
                break
            resumed = False

    # -- the loader's, for DataLoader, StatefulDataLoader and training loops -------

    def set_epoch(self, epoch: int) -> None:
        """Make the next iteration epoch ``epoch`` (its seeded order), from its start, unless a
        state just loaded resumes that epoch (see the loader's ``set_epoch``); pipe: shards:
        nothing, as webdataset has no epochs."""
        if self.loader is None:
            return
        kept = self.loader._resumes(epoch)
        self.loader.set_epoch(epoch)
        if not kept:
            self._cut_items = self._resumed_items = 0  # a checkpoint now names that epoch's start, none of it out
            self._cut_over = False

    def state_dict(self) -> dict[str, Any]:
        loader = self._loader("state_dict()")
        if not self._cuts():
            return loader.state_dict()
        if self._cut_over:  # the iteration is over: the next begins the next epoch
            return loader._state_after_current()
        if self._cut_items >= self.nsamples:  # its n are out, its end not met: an empty rest, then the next epoch
            return {**loader._state_after_current(), CUT_ITEMS: self._cut_items}
        return {**loader.state_dict(), CUT_ITEMS: self._cut_items}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        items = _cut_items(state)
        if type(items) is not int or items < 0:
            raise ValueError(f"a checkpoint's {CUT_ITEMS!r} is a count of items, not {items!r}")
        self._loader("load_state_dict()").load_state_dict(
            {k: v for k, v in state.items() if k != CUT_ITEMS} if items else state
        )
        self._cut_items = self._resumed_items = items  # the checkpoint is the position until the next iteration
        self._cut_over = False

    def __len__(self) -> int:
        """Samples per rank in the next epoch, of a dataset with no stage after its source: one
        with stages (a batching, a filter), cut (``with_epoch``) or repeated (``repeat``) may
        yield another count, and has no length, as webdataset's has none (``with_length(n)``
        gives one)."""
        loader = self._loader("len()")
        if self._endless():
            raise TypeError(
                "len() of an endless dataset: resampled=True with neither epoch_samples= nor with_epoch(n) "
                "has no length, as webdataset's has none; give epoch_samples= (the job's samples per epoch) "
                "for one, or with_length(n)"
            )
        if self.nsamples > 0 or self.repetitions != 1:
            raise TypeError(
                "len() of a WebDataset cut by with_epoch(n) or repeated by repeat(): each iteration yields "
                "another count than the epoch's, and webdataset's has no length either; give one with "
                "with_length(n)"
            )
        if len(self.pipeline) > 1:
            raise TypeError(
                "len() of a WebDataset with stages after its source: they may change the count, as "
                "batched(), select() or with_epoch() do; take len() before adding them, or give one "
                "with with_length(n)"
            )
        return len(loader)

    def _loader(self, what: str) -> CachedMultiLoader:
        if self.loader is None:
            raise TypeError(
                f"{what} of pipe: shards: webdataset reads them in this process, uncached, with no "
                "checkpoint and no length"
            )
        return self.loader

    def close(self) -> None:
        """As webdataset's: close the stages (the loader stops using a private agent) and drop them."""
        if hasattr(self, "pipeline"):
            super().close()

    def __enter__(self) -> WebDataset:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def _cut_items(state: Any) -> Any:
    """The items of a ``with_epoch`` cut out before ``state``: in our own state, or in the
    dataset's state a ``StatefulDataLoader`` without workers holds (``dataset_state``: the
    same layout, so the cut resumes too); 0 if neither has one."""
    if not isinstance(state, dict):
        return 0
    if CUT_ITEMS in state:
        return state[CUT_ITEMS]
    nested = state.get("dataset_state")
    return nested.get(CUT_ITEMS, 0) if isinstance(nested, dict) else 0
