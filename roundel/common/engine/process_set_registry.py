"""The process sets registered on one rank: their members and this rank's communicator for each.

``init()`` and ``add_process_set``/``remove_process_set`` (:mod:`roundel.common.basics`)
own the registry and are the only writers; the engine core and the executor
read it to find a batch's members and transport. Id 0 is the whole job.
"""

from __future__ import annotations

from typing import Iterator, NamedTuple

from roundel.transport.backend import Backend


class RegisteredSet(NamedTuple):
    """One process set as this rank knows it: its members, and its communicator (None on a non-member)."""

    ranks: tuple[int, ...]
    backend: Backend | None


class ProcessSetRegistry:
    """Process set id -> ``RegisteredSet``; the job's own set (id 0) is registered at construction."""

    def __init__(self, job_ranks: tuple[int, ...], job_backend: Backend):
        self._sets: dict[int, RegisteredSet] = {0: RegisteredSet(job_ranks, job_backend)}

    def __getitem__(self, set_id: int) -> RegisteredSet:
        return self._sets[set_id]

    def __contains__(self, set_id: object) -> bool:
        return set_id in self._sets

    def get(self, set_id: int) -> RegisteredSet | None:
        """The set under ``set_id``, or None when none is registered."""
        return self._sets.get(set_id)

    def values(self) -> Iterator[RegisteredSet]:
        """Every registered set (a snapshot: safe while another thread adds or removes one)."""
        return iter(list(self._sets.values()))

    @property
    def job_backend(self) -> Backend:
        """The communicator of the whole job (set 0's)."""
        return self.backend_of(0)

    def backend_of(self, set_id: int) -> Backend:
        """This rank's communicator for set ``set_id``; raises ValueError on a rank outside the set."""
        backend = self._sets[set_id].backend
        if backend is None:
            raise ValueError(f"this rank is not a member of process set {set_id}")
        return backend

    def members_and_backend(self, set_id: int) -> tuple[tuple[int, ...], Backend]:
        """(the members of set ``set_id``, this rank's communicator for it); ValueError on a non-member."""
        return self._sets[set_id].ranks, self.backend_of(set_id)

    def id_of(self, ranks: tuple[int, ...]) -> int | None:
        """The id of the set with exactly these members, or None."""
        return next((set_id for set_id, known in self._sets.items() if known.ranks == ranks), None)

    def add(self, set_id: int, ranks: tuple[int, ...], backend: Backend | None) -> None:
        """Register a set (a new id only)."""
        if set_id in self._sets:
            raise ValueError(f"process set id {set_id} is already registered")
        self._sets[set_id] = RegisteredSet(ranks, backend)

    def remove(self, set_id: int) -> RegisteredSet:
        """Unregister set ``set_id`` (never 0) and return it."""
        if set_id == 0:
            raise ValueError("the job's own process set (id 0) cannot be removed")
        return self._sets.pop(set_id)

    def clear(self) -> list[RegisteredSet]:
        """Drop every set (at shutdown) and return them, for their communicators to be closed."""
        dropped, self._sets = list(self._sets.values()), {}
        return dropped
