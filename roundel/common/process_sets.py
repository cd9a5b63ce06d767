"""Process sets: subsets of ranks that run collectives among themselves."""

from __future__ import annotations

from roundel.common.communicator import is_mpi_comm, mpi_comm_ranks


class ProcessSet:
    """A set of global ranks; pass it as ``process_set=`` to any collective.

    Create it with the member ranks, or an mpi4py communicator (its
    ``COMM_WORLD`` ranks become the members), and register it on every rank
    with ``init(process_sets=[...])`` or ``add_process_set(...)``.
    """

    def __init__(self, ranks_or_comm):
        self.mpi_comm = ranks_or_comm if is_mpi_comm(ranks_or_comm) else None
        ranks = mpi_comm_ranks(ranks_or_comm) if self.mpi_comm is not None else ranks_or_comm
        self.ranks = sorted(set(int(r) for r in ranks))
        self.process_set_id: int | None = None
        self._my_rank: int | None = None

    def _bind(self, process_set_id: int | None, ranks, my_global_rank: int | None) -> None:
        self.process_set_id = process_set_id
        if ranks is not None:
            self.ranks = list(ranks)
        self._my_rank = my_global_rank

    def size(self) -> int | None:
        """Number of ranks in the set, or None before it is registered."""
        return None if self.process_set_id is None else len(self.ranks)

    def rank(self) -> int | None:
        """This process's rank within the set, or None if it is not a member or not registered."""
        if self.process_set_id is None or self._my_rank not in self.ranks:
            return None
        return self.ranks.index(self._my_rank)

    def included(self) -> bool | None:
        """Whether this process is a member (None before registration)."""
        if self.process_set_id is None:
            return None
        return self._my_rank in self.ranks

    def __repr__(self) -> str:
        return f"ProcessSet(process_set_id={self.process_set_id}, ranks={self.ranks})"


global_process_set = ProcessSet([])
global_process_set.process_set_id = 0
