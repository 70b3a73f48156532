"""The jobs the agent's consumers read for: each job's world size, and the list each of its epochs reads.

A job's ranks, and each rank's DataLoader workers, are readers of their own: each says hello
as it starts an epoch, at its own time. Were each to take the agent's list as it is at its
hello, an edit of the list file between two of those hellos would give one epoch two lists:
they would split different shards, some samples going to no rank and the ranks' counts
unequal (a data-parallel job hangs on that). So the first reader of a job's epoch fixes the
list that epoch reads.

Guarantees (main loop only; :class:`~wdscache.agent.readers.Readers` owns one):

- Every reader of epoch E of job J that names no list of its own reads the list the first of
  them read, while J has a reader and for ``JOB_GRACE`` seconds after its last one left; then J
  is forgotten, and its next epoch reads the agent's list as it is then.
- The lists named here (:meth:`Jobs.lists`) are kept by :class:`Readers` while they are named.
- At most ``EPOCHS_KEPT`` epochs of a job are held, its latest: a reader of an older epoch (one
  that starts after its job moved on) reads the agent's list as it is then.
"""

from __future__ import annotations

from collections.abc import Callable, Collection
from dataclasses import dataclass, field

JOB_GRACE = 10.0  # seconds a job without readers keeps its epochs' lists (its ranks start one epoch together)
EPOCHS_KEPT = 2  # a job's latest epochs whose list is held (a rank may start an epoch as another starts the next)


@dataclass(slots=True)
class Job:
    """A job: the world size its ranks said, the list each of its latest epochs reads, and when
    its last reader left (None: it has readers)."""

    world_size: int
    epochs: dict[int, str] = field(default_factory=dict)  # epoch -> the list id its readers read
    left_at: float | None = None


class Jobs:
    """The jobs by name."""

    def __init__(self) -> None:
        self._jobs: dict[str, Job] = {}

    def other_world_size(self, name: str, world_size: int) -> int | None:
        """The world size job ``name`` said, if another than ``world_size`` (None: the same, or no such job)."""
        job = self._jobs.get(name)
        return job.world_size if job is not None and job.world_size != world_size else None

    def join(self, name: str, world_size: int) -> None:
        """A reader of job ``name`` says hello with ``world_size``: another world size than the
        job's is a new launch of that name (its ranks of the old size are gone), so it starts anew."""
        job = self._jobs.get(name)
        if job is None or job.world_size != world_size:
            self._jobs[name] = Job(world_size)
        else:
            job.left_at = None

    def list_for(self, name: str, epoch: int, current: str, held: Callable[[str], bool]) -> str:
        """The list id epoch ``epoch`` of job ``name`` (joined) reads: the one its first reader
        read, while ``held`` says the agent still holds it; else ``current`` (the agent's list now),
        which the epoch then reads."""
        job = self._jobs[name]
        key = job.epochs.get(epoch)
        if key is not None and held(key):
            return key
        if len(job.epochs) >= EPOCHS_KEPT and epoch < min(job.epochs):
            return current  # long after its job moved on: not held for it
        job.epochs[epoch] = current
        while len(job.epochs) > EPOCHS_KEPT:
            del job.epochs[min(job.epochs)]
        return current

    def list_of(
        self, name: str, epoch: int | None, current: str, held: Callable[[str], bool], *, probe: bool = False
    ) -> str:
        """The list id a reader of job ``name`` (joined) starting ``epoch`` reads (:meth:`list_for`);
        ``current`` for a reader of no epoch. A ``probe`` (a loader's ``len()`` of that epoch) gets
        the epoch's list if one of its readers started it, and starts it on none."""
        if epoch is None:
            return current
        if probe:
            pinned = self._jobs[name].epochs.get(epoch)
            return pinned if pinned is not None and held(pinned) else current
        return self.list_for(name, epoch, current, held)

    def lists(self) -> set[str]:
        """The list ids some job's epoch reads."""
        return {key for job in self._jobs.values() for key in job.epochs.values()}

    def expire(self, live: Collection[str], now: float) -> None:
        """Forget the jobs none of whose readers (``live``: the jobs that have one) was here for ``JOB_GRACE``."""
        for name, job in list(self._jobs.items()):
            if name in live:
                job.left_at = None
            elif job.left_at is None:
                job.left_at = now
            elif now - job.left_at >= JOB_GRACE:
                del self._jobs[name]
