"""``init(comm=...)``: a job made of some of the launched ranks, as Horovod's sub-communicators.

Horovod accepts a list of ranks or an mpi4py communicator; the job is then
those ranks only, renumbered in the communicator's order, and ranks given
disjoint lists (or ``COMM_WORLD.Split`` results) run independent jobs.
roundel moves the data over Gloo either way: mpi4py only names the ranks.
"""

from __future__ import annotations

import json

from roundel.rendezvous.identity import Identity, cross_ranks


def _mpi():
    try:
        from mpi4py import MPI
    except ImportError:
        raise ValueError("an MPI communicator was passed, but mpi4py is not installed; pip install mpi4py, "
                         "or pass a list of ranks instead") from None
    return MPI


def is_mpi_comm(value) -> bool:
    """Whether ``value`` is an mpi4py communicator (without importing mpi4py for other values)."""
    return type(value).__module__.startswith("mpi4py")


def mpi_comm_ranks(comm) -> list[int]:
    """The ``MPI.COMM_WORLD`` ranks of ``comm``'s members, in ``comm``'s rank order.

    Raises ValueError when mpi4py is missing or ``comm`` is not an ``MPI.Comm``.
    """
    MPI = _mpi()
    if not isinstance(comm, MPI.Comm):
        raise ValueError(f"expected a list of ranks or an mpi4py.MPI.Comm, got {type(comm).__name__}")
    group, world = comm.Get_group(), MPI.COMM_WORLD.Get_group()
    try:
        return [int(r) for r in MPI.Group.Translate_ranks(group, list(range(group.Get_size())), world)]
    finally:
        group.Free()
        world.Free()


def member_ranks(comm, rank: int, size: int) -> tuple[int, ...] | None:
    """The launched ranks that form this job for ``init(comm=comm)``, or None for all of them.

    ``comm`` is None, a list of ranks, or an mpi4py communicator (whose
    ``COMM_WORLD`` must be the job roundel launched). Raises ValueError for
    ranks outside the job, repeated ranks, or a ``comm`` without this rank.
    """
    if comm is None:
        return None
    if is_mpi_comm(comm):
        world_size = _mpi().COMM_WORLD.Get_size()
        if world_size != size:
            raise ValueError(f"init(comm=...) got an MPI communicator whose COMM_WORLD has {world_size} "
                             f"process(es), but this job has {size}; start the job with mpirun (roundel then "
                             "follows its ranks) or pass a list of ranks")
        ranks = mpi_comm_ranks(comm)
    else:
        try:
            ranks = [int(r) for r in comm]
        except (TypeError, ValueError):
            raise ValueError(f"init(comm=...) expects a list of ranks or an mpi4py communicator, "
                             f"not {comm!r}") from None
    if not ranks:
        return None  # Horovod: an empty list means every rank
    if len(set(ranks)) != len(ranks) or any(r < 0 or r >= size for r in ranks):
        raise ValueError(f"init(comm={ranks}) needs distinct ranks in 0..{size - 1}")
    if rank not in ranks:
        raise ValueError(f"rank {rank} called init(comm={ranks}) without being in it; every rank must pass "
                         "a communicator that contains it (ranks with disjoint lists form separate jobs)")
    return None if ranks == list(range(size)) else tuple(ranks)


def sub_identity(client, prefix: str, ident: Identity, members: tuple[int, ...],
                 timeout_s: float) -> tuple[Identity, str]:
    """This rank's Identity in the job of ``members``, and the store prefix that job uses.

    Members exchange host names through the rendezvous store, so local and
    cross ranks count only the job's own processes.
    """
    job_prefix = f"{prefix}comm{'-'.join(str(r) for r in members)}/"
    me = members.index(ident.rank)
    client.set(f"{job_prefix}host/{me}", json.dumps(ident.hostname).encode())
    hosts = [json.loads(client.get(f"{job_prefix}host/{r}", timeout_s)) for r in range(len(members))]
    seen: dict[str, int] = {}
    table = []
    for host in hosts:  # local ranks: the order on the host, by rank in the new job
        table.append((host, seen.get(host, 0)))
        seen[host] = seen.get(host, 0) + 1
    return cross_ranks(table)[me], job_prefix
