"""The loader's ``mix=``, ``epoch_samples=`` and ``resampled=``: the sources read into one list,
and each epoch's :class:`~wdscache.shared.mixture.MixSpec` (the arithmetic is in
:mod:`wdscache.shared.mixture`).

The sources' lists become one list for the agent, in order, each shard once: a shard listed
by two sources is downloaded and cached once (the agent caches by URL), and each source is
the list of its shards' places in it. ``resampled=True`` is the one-source mixture with
replacement (its samples carry no ``__source__``, as webdataset's do not).

A mixture's epoch needs every shard's count: from a shard index, from the agent's index
(shards it counted before), or else counted here before the first sample, by reading the
shards not counted yet through the agent (which downloads them into the cache, as the epoch
would).
"""

from __future__ import annotations

import dataclasses
import functools
import hashlib
import numbers
import os
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from ..shared.errors import ConfigError, WdsCacheError
from ..shared.mixture import MixSpec, Mixture, check_mix_arg
from ..shared.sequence import BLOCK, EpochSpec, Resume
from ..shared.shard_index import UNKNOWN, ShardFacts, ShardInfo
from ..shared.urls import UrlList, Urls
from .stream import EpochStream, Session, StreamSettings
from .urls_arg import UrlsArg, pipe_refusal, pipe_urls, read_urls_arg


@dataclass(frozen=True)
class MixArg:
    """What ``mix=`` / ``resampled=`` asked for: the sources' names, weights and shards (places in
    the combined list), and the epoch's length: ``epoch_samples``, or ``per_worker`` samples for
    every DataLoader worker (under ``resampled=True``, webdataset's ``with_epoch(n)``, or the
    epochs of an endless ``wdscache.WebDataset``)."""

    names: tuple[str, ...]
    weights: tuple[float, ...]
    shards: tuple[tuple[int, ...], ...]
    replacement: bool
    labelled: bool
    epoch_samples: int | None = None
    per_worker: int | None = None

    def total(self, world_size: int, workers: int) -> int:
        """Samples of an epoch of the job. With ``per_worker`` (``n``), every worker's slice holds
        ``n`` rounded up to whole blocks (a slice is whole blocks of the rank's share; the rest of
        a block is left undelivered when ``with_epoch`` stops the worker at ``n``)."""
        if self.epoch_samples is not None:
            return self.epoch_samples
        if self.per_worker is None:
            raise ConfigError(
                "resampled=True needs an epoch length: give epoch_samples=N (the job's samples per "
                "epoch), as each iteration of a loader is one epoch; wdscache.WebDataset(urls, "
                "resampled=True) is endless without one, as webdataset's, and cut by with_epoch(n) or "
                "the steps of a training loop"
            )
        return -(-self.per_worker // BLOCK) * BLOCK * workers * world_size

    def fingerprint(self) -> str:
        """What a checkpoint names: resumed under another mixture, positions would mean other samples."""
        text = repr((self.names, self.weights, self.shards, self.replacement, self.epoch_samples, self.per_worker))
        return hashlib.sha256(text.encode()).hexdigest()[:16]

    def mixture(self, world_size: int, workers: int) -> Mixture:
        return Mixture(
            self.names, self.weights, self.shards, self.total(world_size, workers), self.replacement, self.labelled
        )


def read_mix_arg(
    urls: UrlsArg | None, mix: Mapping[str, float] | None, epoch_samples: int | None, resampled: bool
) -> tuple[UrlList | None, MixArg | None]:
    """The loader's list (None: the agent's) and its mixture (None: no ``mix=`` nor ``resampled=``)."""
    if epoch_samples is not None:  # any integer type (numpy's too), as a plain int
        if isinstance(epoch_samples, bool) or not isinstance(epoch_samples, numbers.Integral) or epoch_samples < 1:
            raise ConfigError(f"epoch_samples={epoch_samples!r} must be a whole number >= 1")
        epoch_samples = int(epoch_samples)
    if mix is None and not resampled:
        if epoch_samples is not None:
            raise ConfigError(
                "epoch_samples= sets the length of a mixture's epoch: give it with mix= or "
                "resampled=True (an epoch of one list is the list, read once)"
            )
        return (read_urls_arg(urls) if urls is not None else None), None
    if mix is not None and urls is not None:
        raise ConfigError("give urls= or mix=, not both: mix= names every source with its weight")
    if mix is None:
        if urls is None:
            raise ConfigError("resampled=True needs urls= (the list the shards are drawn from)")
        name = os.fspath(urls) if isinstance(urls, (str, os.PathLike)) else "urls"
        pairs = [(str(name), 1.0)]
        lists = [read_urls_arg(urls)]
    else:
        if epoch_samples is None:
            raise ConfigError("mix= needs epoch_samples=N: the samples of an epoch over all sources")
        pairs = check_mix_arg(mix)
        lists = []
        for key, _ in pairs:
            piped = pipe_urls(key)
            if piped:
                raise ConfigError(pipe_refusal(f"mix[{key!r}]"))
            try:
                lists.append(read_urls_arg(key))
            except WdsCacheError as exc:
                raise type(exc)(f"mix[{key!r}]: {exc}") from None
    combined, places = _combined(lists, [k for k, _ in pairs])
    arg = MixArg(
        tuple(k for k, _ in pairs),
        tuple(w for _, w in pairs),
        places,
        replacement=resampled,
        labelled=mix is not None,
        epoch_samples=epoch_samples,
    )
    return combined, arg


def _combined(lists: Sequence[UrlList], names: Sequence[str]) -> tuple[UrlList, tuple[tuple[int, ...], ...]]:
    """One list of every source's shards, each once, and each source's places in it."""
    at: dict[str, int] = {}
    facts: list[ShardInfo | None] = []
    places = []
    for name, listed in zip(names, lists):
        if not listed.urls:
            raise ConfigError(f"mix source {name!r} lists no shards")
        mine = []
        for k, url in enumerate(listed.urls):
            info = listed.shards[k] if listed.shards is not None else None
            if url not in at:
                at[url] = len(facts)
                facts.append(info)
            elif info is not None and facts[at[url]] is not None and facts[at[url]] != info:
                raise ConfigError(
                    f"mix source {name!r}'s shard index says other things of a shard than another "
                    f"source's does (shard {k} of {name!r})"
                )
            elif facts[at[url]] is None:
                facts[at[url]] = info
            mine.append(at[url])
        places.append(tuple(mine))
    # A source given without an index leaves its shards' facts unknown, not the other sources'.
    shards = ShardFacts(f or UNKNOWN for f in facts) if any(facts) else None
    return UrlList(None, Urls(at), shards=shards), tuple(places)


def mix_spec(
    arg: MixArg, counts: Sequence[int], *, world_size: int, workers: int, epoch: int, settings: StreamSettings
) -> MixSpec:
    return MixSpec(
        arg.mixture(world_size, workers), tuple(counts), settings.seed, epoch, settings.shuffle, settings.shuffle_buffer
    )


def shard_counts(
    urls: Sequence[str], counts: Sequence[Any], settings: StreamSettings, open_session: Callable[[], Session]
) -> list[int]:
    """Every shard's sample count: ``counts`` (the agent's); those it has none of yet counted
    here, by reading them through a stream of their own (one rank, list order) before the
    epoch starts. A shard that fails there counts 0 (skipped), whatever ``on_error`` makes of
    it but "raise": a handler that says stop ends no epoch before it has begun."""
    missing = tuple(i for i, c in enumerate(counts) if not isinstance(c, int))
    if not missing:
        return [int(c) for c in counts]
    on_error = settings.on_error
    one = dataclasses.replace(
        settings,
        world_size=1,
        rank=0,
        on_error=functools.partial(_skipping, on_error) if callable(on_error) else on_error,
    )
    spec = EpochSpec(len(urls), shuffle=False, shards=missing)
    learned = EpochStream(one, open_session(), 0, Resume(), spec=spec).counts()
    return [learned.get(i, 0) if i in missing else int(c) for i, c in enumerate(counts)]


def _skipping(handler: Callable[[Exception], Any], exc: Exception) -> bool:
    """``handler``'s verdict on a shard counted before the epoch: told of it, but skipped either way."""
    handler(exc)
    return True
