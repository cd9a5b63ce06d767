"""Hierarchical allreduce and allgather: work within each host first, cross hosts with less data.

``HOROVOD_HIERARCHICAL_ALLREDUCE`` / ``HOROVOD_HIERARCHICAL_ALLGATHER`` (or
``roundelrun --hierarchical-allreduce`` / ``--hierarchical-allgather``), and
autotune (which switches them), make the job's communicator a
:class:`HierarchicalBackend`: the flat communicator
of the job plus two sub-communicators of the same transport (Gloo or MPI),
*local* (the ranks on this host, numbered by local rank; over Gloo it moves
its data through shared memory, see :mod:`roundel.transport.shared_memory`)
and *cross* (the ranks with this local rank on every host, numbered by cross
rank).

Both collectives go through one leader per host (local rank 0): local
reduce (or gather) to it, the leaders' allreduce (or allgather) across hosts,
local broadcast. With a slow link between hosts the bytes that cross it are
what costs: each host sends one copy of its data per direction, where a flat
ring over 2 hosts x 2 ranks sends 1.5 copies. The other design, a local
reducescatter, an allreduce of each rank's chunk across hosts and a local
allgather, sends the same bytes across hosts, but Gloo's reducescatter and
allgather cost about three times its reduce and broadcast on one host, and
on 2 simulated hosts with a 1 Gbit/s link it was the slower of the two
(benchmarks/hierarchical.py: 64 MiB allreduce 0.97 s against 0.83 s, flat
0.92 s).

:func:`build` decides, from every rank's place exchanged over the flat
communicator (so that all ranks decide alike), whether the job qualifies:
several hosts, the same number of ranks on each (homogeneous), more than one
rank per host. Otherwise it returns the flat communicator and logs why at
debug level. Horovod likewise ignores the flags on a single host.
"""

from __future__ import annotations

import logging

from typing import Callable

import torch

from roundel.ops import ReduceOp
from roundel.transport.backend import Backend, RootedBackend

log = logging.getLogger("roundel")


class HierarchicalBackend(Backend):
    """The job's communicator with hierarchical allreduce and/or allgather; the rest goes flat.

    ``order[r]`` is where flat rank r's chunk sits in the host-major
    (cross rank, local rank) result of the two-level allgather; None when
    that is flat rank order already (ranks numbered host by host).
    """

    tunable_hierarchy = True

    def __init__(self, flat: Backend, local: RootedBackend, cross: Backend, order: list[int] | None,
                 hierarchical_allreduce: bool, hierarchical_allgather: bool):
        super().__init__(flat.rank, flat.size)
        self.name = flat.name  # the timeline names the transport's calls as the flat ones
        self.flat, self.local, self.cross = flat, local, cross
        self.hierarchical_allreduce = hierarchical_allreduce
        self.hierarchical_allgather = hierarchical_allgather
        self._order = None if order is None else torch.tensor(order, dtype=torch.int64)

    def use(self, hierarchical_allreduce: bool, hierarchical_allgather: bool) -> None:
        """Switch allreduce and allgather between hierarchical and flat (autotune; every member at the
        same point of its sequence of collectives)."""
        self.hierarchical_allreduce = hierarchical_allreduce
        self.hierarchical_allgather = hierarchical_allgather

    def allreduce(self, tensor, op: ReduceOp) -> None:
        """Local reduce to the host's leader, leaders' allreduce across hosts, local broadcast."""
        if not self.hierarchical_allreduce:
            self.flat.allreduce(tensor, op)
            return
        self.local.reduce(tensor, 0, op)
        if self.local.rank == 0:
            self.cross.allreduce(tensor, op)
        self.local.broadcast(tensor, 0)

    def allgather(self, output, tensor) -> None:
        """Local gather to the host's leader, leaders' allgather of their hosts' chunks, local broadcast."""
        if not self.hierarchical_allgather:
            self.flat.allgather(output, tensor)
            return
        width = tensor.numel()
        if width == 0:
            return
        gathered = output.view(-1) if self._order is None else \
            torch.empty(self.size * width, dtype=tensor.dtype, device=tensor.device)
        host = gathered.view(self.cross.size, self.local.size * width)[self.cross.rank]
        self.local.gather(list(host.view(self.local.size, width)), tensor.reshape(-1), 0)
        if self.local.rank == 0:
            self.cross.allgather(gathered, host.clone())
        self.local.broadcast(gathered, 0)
        if self._order is not None:
            torch.index_select(gathered.view(self.size, width), 0, self._order, out=output.view(self.size, width))

    def subset(self, members) -> Backend:
        """A communicator of some of the job's ranks (``members``; called by those members only), for a
        process set: the flat communicator's subset, so a set's collectives go flat, as over Gloo.

        Only a transport whose communicators make subsets of themselves (MPI) has one; over another
        (Gloo, whose process sets meet through the store) raises NotImplementedError.
        """
        return self.flat.subset(members)

    def broadcast(self, tensor, root: int) -> None:
        self.flat.broadcast(tensor, root)

    def alltoall(self, output, tensor, output_splits, input_splits) -> None:
        self.flat.alltoall(output, tensor, output_splits, input_splits)

    def reducescatter(self, output, tensor, op: ReduceOp) -> None:
        self.flat.reducescatter(output, tensor, op)

    def barrier(self) -> None:
        self.flat.barrier()

    def close(self) -> None:
        for backend in (self.cross, self.local, self.flat):
            backend.close()


def build(flat: Backend, placement, sub_communicator: Callable[[str, tuple[int, ...], int, bool], RootedBackend],
          hierarchical_allreduce: bool, hierarchical_allgather: bool) -> Backend:
    """``flat`` wrapped with hierarchical collectives when the job qualifies, else ``flat`` itself.

    Collective over the job: every rank calls it with its own ``placement``
    (anything with ``local_rank``, ``local_size``, ``cross_rank`` and
    ``cross_size``, e.g. the rank's ``Identity``). The local and cross
    communicators come from ``sub_communicator(label, members, rank, one_host)``:
    ``label`` names the group (``local<cross rank>`` or ``cross<local rank>``,
    the same on all its members), ``members`` are its flat ranks in the
    group's rank order, ``rank`` is this rank's place among them and
    ``one_host`` says whether they all run on this host (the local group). The
    transport must offer ``reduce`` and ``gather`` besides the collectives of
    :class:`Backend` (a :class:`~roundel.transport.backend.RootedBackend`).
    """
    mine = torch.tensor([placement.local_rank, placement.local_size, placement.cross_rank,
                         placement.cross_size], dtype=torch.int64)
    table = torch.empty(flat.size * 4, dtype=torch.int64)
    flat.allgather(table, mine)
    places = [tuple(row) for row in table.view(flat.size, 4).tolist()]
    reason = _why_flat(places)
    if reason is not None:
        log.debug("roundel: hierarchical allreduce/allgather asked for, but the job stays flat: %s", reason)
        return flat
    local_rank, local_size, cross_rank, cross_size = places[flat.rank]
    by_place = {(cr, lr): r for r, (lr, _, cr, _) in enumerate(places)}
    local = sub_communicator(f"local{cross_rank}", tuple(by_place[cross_rank, lr] for lr in range(local_size)),
                             local_rank, True)
    try:
        cross = sub_communicator(f"cross{local_rank}", tuple(by_place[cr, local_rank] for cr in range(cross_size)),
                                 cross_rank, False)
    except BaseException:
        local.close()
        raise
    order = [cr * local_size + lr for lr, _, cr, _ in places]
    done = [what for what, on in (("allreduce", hierarchical_allreduce), ("allgather", hierarchical_allgather))
            if on]
    log.debug("roundel: hierarchical %s over %d hosts x %d ranks (local rank %d, cross rank %d)",
              " and ".join(done), cross_size, local_size, local_rank, cross_rank)
    return HierarchicalBackend(flat, local, cross, None if order == list(range(flat.size)) else order,
                               hierarchical_allreduce, hierarchical_allgather)


def _why_flat(places: list[tuple[int, int, int, int]]) -> str | None:
    """Why a job whose ranks sit at ``places`` (local rank, local size, cross rank, cross size) stays flat."""
    local_sizes = sorted({p[1] for p in places})
    if len(local_sizes) > 1:
        return f"hosts run different numbers of ranks (local sizes {local_sizes}), the job is not homogeneous"
    local_size = local_sizes[0]
    if local_size == len(places):
        return "the job runs on one host"
    if local_size == 1:
        return "each host runs one rank"
    hosts = len(places) // local_size
    slots = {(p[2], p[0]) for p in places}
    if len(places) % local_size or {p[3] for p in places} != {hosts} or \
            slots != {(c, l) for c in range(hosts) for l in range(local_size)}:
        return "the ranks' local and cross ranks do not form a grid of hosts x local ranks"
    return None
