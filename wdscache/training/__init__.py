"""What runs in a training process: :class:`~.loader.CachedMultiLoader` and its epoch stream.

The loader talks to the agent's control socket (:mod:`wdscache.shared.client`),
asks its workers for samples (:mod:`.stream`) and, where it may, copies payloads
from the cache files itself (:mod:`.direct`). It never writes the cache. With no
agent running it starts a private one (:mod:`.private`), as a separate process.
With torch, the loader is an ``IterableDataset`` whose DataLoader workers split the rank's
share (:mod:`.dataset`, :mod:`.worker_slices`); :mod:`.pipeline` is ``wdscache.WebDataset``.
"""
