"""Which transports move tensors: ``HOROVOD_CPU_OPERATIONS=gloo|mpi`` (default gloo) for CPU tensors,
``HOROVOD_GPU_OPERATIONS=nccl|gloo|mpi`` (default nccl) for CUDA tensors.

:func:`check` runs first in ``init()`` so that a job that asked for MPI but
cannot have it fails at once with a clear message; :func:`job_backend` and
:func:`process_set_backend` then build the communicators. The caller passes
what its settings ask for as a :class:`Choice`; the job's communicator
(Gloo or MPI) is hierarchical when the choice asks for it and the job
qualifies (see :mod:`roundel.transport.hierarchical`). Where NCCL is usable and
chosen for CUDA tensors, each communicator gets an NCCL one of the same
members beside it (``Backend.cuda``, made at the first CUDA collective);
otherwise CUDA tensors are staged through host memory and moved by the CPU
transport. A Gloo communicator whose members all run on one host (the job's,
its process sets', or the local one of the hierarchical collectives) moves
allreduce, allgather, broadcast, reduce, gather and barrier through shared
memory (:mod:`roundel.transport.shared_memory`) unless the choice turns it off.
"""

from __future__ import annotations

import dataclasses
import importlib.util
import logging

import torch.distributed as dist

from roundel.errors import SettingsError
from roundel.transport import hierarchical, nccl, shared_memory
from roundel.transport.backend import Backend, RootedBackend
from roundel.transport.gloo import GlooBackend

log = logging.getLogger("roundel")

@dataclasses.dataclass(frozen=True)
class Choice:
    """The transport the settings ask for: ``cpu_operations`` ("gloo" or "mpi"), the collectives'
    timeout in seconds, whether allreduce and allgather should be hierarchical, whether autotune may
    switch them (then a job that qualifies gets a hierarchical communicator either way),
    ``gpu_operations`` ("nccl", or "gloo"/"mpi": CUDA tensors staged through the CPU transport),
    whether Gloo communicators of ranks on one host may use ``shared_memory``, and whether Gloo communicators
    move small allreduces over ``peer_links`` (see :mod:`roundel.transport.peer_links`)."""

    cpu_operations: str
    timeout_s: float
    hierarchical_allreduce: bool = False
    hierarchical_allgather: bool = False
    autotune: bool = False
    gpu_operations: str = "nccl"
    shared_memory: bool = True
    peer_links: bool = True


def mpi_importable() -> bool:
    """Whether mpi4py is installed (without starting MPI)."""
    return importlib.util.find_spec("mpi4py") is not None


def check(choice: Choice, launcher) -> None:
    """Raise SettingsError when ``choice`` is MPI and this process cannot use it.

    MPI needs mpi4py and a job started by mpirun/mpiexec whose ``MPI.COMM_WORLD``
    is the job roundel runs (same size, same ranks). ``launcher`` is the
    ``LauncherIdentity`` of the launcher that started this process, or None.
    """
    if choice.cpu_operations != "mpi":
        return
    if not mpi_importable():
        raise SettingsError("HOROVOD_CPU_OPERATIONS=mpi needs mpi4py: pip install mpi4py (or "
                            "pip install 'roundel[mpi]'), or set HOROVOD_CPU_OPERATIONS=gloo")
    if launcher is None or not launcher.by_mpi:
        started = "by roundelrun or directly" if launcher is None else f"by {launcher.launcher}"
        raise SettingsError(f"HOROVOD_CPU_OPERATIONS=mpi needs a job started by mpirun/mpiexec, but this "
                            f"process was started {started}; start it with mpirun (or 'roundelrun --mpi'), "
                            "or set HOROVOD_CPU_OPERATIONS=gloo")
    from mpi4py import MPI  # starts MPI: only once MPI is known to be wanted and possible

    world = MPI.COMM_WORLD
    if world.Get_rank() != launcher.rank or launcher.size not in (None, world.Get_size()):
        raise SettingsError(f"HOROVOD_CPU_OPERATIONS=mpi: MPI.COMM_WORLD says rank {world.Get_rank()} of "
                            f"{world.Get_size()}, but {launcher.launcher}'s variables say rank {launcher.rank} "
                            f"of {launcher.size}; start every rank with the same mpirun, or set "
                            "HOROVOD_CPU_OPERATIONS=gloo")


def job_backend(choice: Choice, store, rank: int, size: int, hostname: str,
                world_ranks: tuple[int, ...], placement=None) -> Backend:
    """The communicator of the whole job; ``world_ranks`` are its members' launched (COMM_WORLD) ranks.

    ``placement`` (this rank's ``local_rank``, ``local_size``, ``cross_rank``,
    ``cross_size``, e.g. its ``Identity``) is needed for hierarchical collectives.
    """
    wants_hierarchical = choice.hierarchical_allreduce or choice.hierarchical_allgather or choice.autotune
    flat: RootedBackend
    if choice.cpu_operations == "mpi":
        from mpi4py import MPI
        from roundel.transport.mpi import MPIBackend  # imports mpi4py: only when MPI was asked for

        world = flat = MPIBackend(MPI.COMM_WORLD, world_ranks)

        def sub_communicator(label, members, rank, one_host):
            return world.subset(members)
    else:
        flat = GlooBackend(store, rank, size, choice.timeout_s, hostname, choice.peer_links)

        def sub_communicator(label, members, rank, one_host):
            group_store = dist.PrefixStore(f"{label}/", store)
            gloo = GlooBackend(group_store, rank, len(members), choice.timeout_s, hostname, choice.peer_links)
            return _on_this_host(choice, gloo, group_store) if one_host else gloo
    backend: Backend = flat
    if wants_hierarchical and placement is not None:
        try:
            backend = hierarchical.build(flat, placement, sub_communicator, choice.hierarchical_allreduce,
                                         choice.hierarchical_allgather)
        except BaseException:
            flat.close()
            raise
    if backend is flat and placement is not None and placement.local_size == size:
        backend = _on_this_host(choice, flat, store)
    return _with_cuda(choice, backend, store)


def process_set_backend(choice: Choice, job: Backend, store, ranks: tuple[int, ...],
                        hostname: str) -> Backend:
    """The communicator of a process set of job ranks ``ranks`` (built by its members only)."""
    if choice.cpu_operations == "mpi":
        # The job's MPI communicator, flat (MPIBackend) or hierarchical (HierarchicalBackend over one), makes
        # the set's communicator from its own members; the set's collectives go flat.
        backend = job.subset(ranks)
    else:
        backend = GlooBackend(store, ranks.index(job.rank), len(ranks), choice.timeout_s, hostname,
                              choice.peer_links)
        if isinstance(job, shared_memory.SharedMemoryBackend):  # the whole job is on this host
            backend = _on_this_host(choice, backend, store)
    return _with_cuda(choice, backend, store)


def _on_this_host(choice: Choice, gloo: RootedBackend, store) -> RootedBackend:
    """A Gloo communicator whose members all run on this host, through shared memory where chosen
    and possible (see :mod:`roundel.transport.shared_memory`)."""
    if not choice.shared_memory or choice.cpu_operations != "gloo":
        return gloo
    try:
        return shared_memory.attach(gloo, dist.PrefixStore("shm/", store), choice.timeout_s)
    except BaseException:
        gloo.close()
        raise


def _with_cuda(choice: Choice, backend: Backend, store) -> Backend:
    """``backend``, to get an NCCL communicator of its members for CUDA tensors where chosen and usable."""
    if choice.gpu_operations == "nccl":
        rank, size = backend.rank, backend.size  # not the backend itself: no reference cycle keeps it alive

        def make_cuda():
            return nccl.NcclBackend(store, rank, size, choice.timeout_s) if nccl.usable() else None
        backend.make_cuda = make_cuda
    return backend


def close(backend: Backend) -> None:
    """Close a communicator built here and the CUDA one beside it."""
    if backend.cuda is not None:
        backend.cuda.close()
    backend.close()
