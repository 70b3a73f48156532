"""The jobs the agent's consumers read for: each job's world size, and the list each of its epochs reads.

A job's ranks, and each rank's DataLoader workers, are readers of their own: each says hello
as it starts an epoch, at its own time. Were each to take the agent's list as it is at its
hello, an edit of the list file between two of those hellos would give one epoch two lists:
they would split different shards, some samples going to no rank and the ranks' counts
unequal (a data-parallel job hangs on that). So the first reader of a job's epoch fixes the
list that epoch reads, for as long as a reader of that epoch reads.

Guarantees (main loop only; :class:`~wdscache.agent.readers.Readers` owns one):

- A reader of epoch E of job J that names no list of its own, and starts while another reader
  of E reads, reads the list the first of them read. Once none reads (they said bye, or went),
  the next reader of E (a new launch of J, or the next pass of DataLoader workers started
  afresh) reads the agent's list as it is then.
- The lists named here (:meth:`Jobs.lists`) are kept by :class:`Readers` while they are named.
- Bounded by the readers: an epoch's record goes with its last reader, a job's (its world size)
  once it has no epoch read and no reader.
"""

from __future__ import annotations

from collections.abc import Callable, Collection
from dataclasses import dataclass, field


@dataclass(slots=True)
class Epoch:
    """One epoch of a job: the list it reads, and the readers reading it."""

    list_id: str
    readers: set[str] = field(default_factory=set)


@dataclass(slots=True)
class Job:
    """A job: the world size its latest hello said, and its epochs being read."""

    world_size: int
    epochs: dict[int, Epoch] = field(default_factory=dict)


class Jobs:
    """The jobs by name, and the epoch each reader reads."""

    def __init__(self) -> None:
        self._jobs: dict[str, Job] = {}
        self._reading: dict[str, tuple[str, int]] = {}  # reader -> (job, epoch)

    def refusal(self, name: str, world_size: int, rank: int, live: Callable[[], bool]) -> str | None:
        """Why rank ``rank`` of job ``name`` cannot join with ``world_size``: the job said another,
        and ranks of it are ``live`` (else that is a new launch of the name). None: it joins."""
        job = self._jobs.get(name)
        if job is not None and job.world_size != world_size:
            if live():
                return (
                    f"job {name!r} runs with world_size {job.world_size}, but rank {rank} says {world_size}; "
                    "give each launch its own job name"
                )
            job = None  # a new launch of that name: it starts anew
        if job is None:
            self._jobs[name] = Job(world_size)
        return None

    def forget(self, live: Collection[str]) -> None:
        """Forget the jobs with no epoch read and no reader (``live``: the jobs that have one)."""
        for name in [n for n, job in self._jobs.items() if n not in live and not job.epochs]:
            del self._jobs[name]

    def list_of(
        self,
        name: str,
        world_size: int,
        epoch: int | None,
        current: str,
        held: Callable[[str], bool],
        *,
        reader: str,
        probe: bool = False,
    ) -> str:
        """The list id ``reader`` of job ``name`` reads as it starts ``epoch``: the one the epoch's
        readers read, while the agent still holds it (``held``); else ``current`` (the agent's list
        now), which the epoch then reads. ``current`` for a reader of no epoch. A ``probe`` (a
        loader's ``len()`` of that epoch) gets the epoch's list if it is being read, and starts none.
        Another world size than the job's is a new launch of that name (its ranks of the old
        size are gone): it starts anew."""
        job = self._jobs.get(name)
        if epoch is None or (probe and job is None):
            return current
        if job is None or job.world_size != world_size:
            job = self._jobs[name] = Job(world_size)
        read = job.epochs.get(epoch)
        if read is not None and not held(read.list_id):
            read = None
        if probe:
            return read.list_id if read is not None else current
        if read is None:
            read = job.epochs[epoch] = Epoch(current)
        read.readers.add(reader)
        self._reading[reader] = (name, epoch)
        return read.list_id

    def leave(self, reader: str) -> None:
        """``reader`` goes: its epoch's record goes with its last reader (the job's, with its world
        size, stays until :meth:`forget`)."""
        where = self._reading.pop(reader, None)
        job = self._jobs.get(where[0]) if where is not None else None
        if where is None or job is None or where[1] not in job.epochs:
            return
        epoch = where[1]
        job.epochs[epoch].readers.discard(reader)
        if not job.epochs[epoch].readers:
            del job.epochs[epoch]

    def lists(self) -> set[str]:
        """The list ids some job's epoch reads."""
        return {read.list_id for job in self._jobs.values() for read in job.epochs.values()}
