"""MPI transport worker: ``torch_mpi_backend.py SCENARIO`` under mpirun (or ``roundelrun --mpi``).

``torch_mpi_backend.py collectives SCENARIO[,SCENARIO...]`` runs
torch_collectives.py's scenarios, then prints the TRANSPORT line below.

- ``transport``: print ``TRANSPORT <rank> mpi_enabled=<bool> gloo_enabled=<bool> mpi_built=<bool>``.
- ``train``: for each transport (mpi, then gloo: ``init()`` again after
  ``shutdown()``), three DistributedOptimizer steps of a small model on
  per-rank data, then print ``WEIGHTS <transport> <rank> <json list>``.
- ``subcomm``: ``init(comm=...)`` splits 3+ ranks into the even and the odd
  ranks; each job's allreduce must sum its own members only.
- ``hierarchical``: 4 ranks under one mpirun, placed as if on 2 hosts x 2
  (host = rank % 2, so host-major order differs from rank order): the
  transport factory builds the MPI job communicator with hierarchical
  allreduce and allgather over MPI sub-communicators, checked against
  NumPy-style expectations for several dtypes and ops; then a real
  ``hvd.init()`` with both flags on this one host stays flat.
- ``hierarchical_sets``: 4 ranks under ``roundelrun --mpi
  --hierarchical-allreduce``, each told by the test that its host is
  ``host<rank % 2>``: the job's communicator is hierarchical, and process
  sets (one across both hosts, one on one host) reduce and gather among
  their own members, the job's allreduce still correct beside them.
"""

from __future__ import annotations

import json
import os
import sys

import torch

import roundel.torch as hvd
from _checks import check, run_scenarios


def _transport_line() -> str:
    return (f"TRANSPORT {hvd.rank()} mpi_enabled={hvd.mpi_enabled()} gloo_enabled={hvd.gloo_enabled()} "
            f"mpi_built={hvd.mpi_built()}")


def scenario_transport():
    hvd.init()
    total = hvd.allreduce(torch.ones(3), op=hvd.Sum, name="transport")  # every rank has joined before any leaves
    check(total, torch.full((3,), float(hvd.size())), "transport sum")
    print(_transport_line(), flush=True)


def scenario_train():
    for transport in ("mpi", "gloo"):
        os.environ["ROUNDEL_CPU_OPERATIONS"] = transport
        hvd.init()
        print(_transport_line(), flush=True)
        print(f"WEIGHTS {transport} {hvd.rank()} {json.dumps(_trained_weights())}", flush=True)
        hvd.shutdown()


def _trained_weights() -> list:
    torch.manual_seed(1234)
    model = torch.nn.Sequential(torch.nn.Linear(6, 5), torch.nn.Tanh(), torch.nn.Linear(5, 2))
    generator = torch.Generator().manual_seed(100 + hvd.rank())
    inputs, targets = torch.randn(8, 6, generator=generator), torch.randn(8, 2, generator=generator)
    optimizer = hvd.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1),
                                         named_parameters=model.named_parameters())
    hvd.broadcast_parameters(model.state_dict(), root_rank=0)
    for _ in range(3):
        optimizer.zero_grad()
        torch.nn.functional.mse_loss(model(inputs), targets).backward()
        optimizer.step()
    return torch.cat([p.detach().reshape(-1) for p in model.parameters()]).tolist()


def scenario_subcomm():
    from mpi4py import MPI

    world = MPI.COMM_WORLD
    members = list(range(world.Get_rank() % 2, world.Get_size(), 2))
    hvd.init(comm=members)
    assert hvd.size() == len(members) and hvd.rank() == members.index(world.Get_rank()), (hvd.rank(), members)
    total = hvd.allreduce(torch.full((4,), float(world.Get_rank())), op=hvd.Sum, name="sub")
    check(total, torch.full((4,), float(sum(members))), "subcomm sum")
    gathered = hvd.allgather(torch.full((world.Get_rank() + 1,), world.Get_rank()), name="sub.gather")
    expected = torch.cat([torch.full((m + 1,), m) for m in members])
    check(gathered, expected, "subcomm allgather")
    print(_transport_line(), flush=True)


def scenario_hierarchical():
    from types import SimpleNamespace

    from mpi4py import MPI

    from roundel.transport import factory, hierarchical

    world = MPI.COMM_WORLD
    rank, size = world.Get_rank(), world.Get_size()
    assert size == 4, "run with mpirun -np 4"
    place = SimpleNamespace(local_rank=rank // 2, local_size=2, cross_rank=rank % 2, cross_size=2)
    backend = factory.job_backend(factory.Choice("mpi", 30.0, True, True), None, rank, size, "",
                                  tuple(range(size)), placement=place)
    assert isinstance(backend, hierarchical.HierarchicalBackend) and backend.local.name == "mpi", backend
    assert (backend.local.rank, backend.cross.rank) == (rank // 2, rank % 2), (backend.local.rank, backend.cross.rank)
    for dtype in (torch.float32, torch.float64, torch.int32, torch.float16, torch.bfloat16):
        tensor = torch.arange(10, dtype=torch.float64).add(rank * 100).to(dtype)
        backend.allreduce(tensor, hvd.Sum)
        check(tensor, (torch.arange(10, dtype=torch.float64) * size + 600).to(dtype), f"hierarchical sum {dtype}")
    tensor = torch.tensor([rank, -rank, 7], dtype=torch.int64)
    backend.allreduce(tensor, hvd.Max)
    check(tensor, torch.tensor([size - 1, 0, 7]), "hierarchical max")
    for width in (3, 0):
        mine = torch.full((width,), float(rank))
        output = torch.empty(size * width)
        backend.allgather(output, mine)
        check(output, torch.arange(size, dtype=torch.float32).repeat_interleave(width), f"hierarchical allgather {width}")
    backend.close()
    os.environ.update(HOROVOD_HIERARCHICAL_ALLREDUCE="1", HOROVOD_HIERARCHICAL_ALLGATHER="1")
    hvd.init()  # one real host: the job stays flat, and says why at debug level
    total = hvd.allreduce(torch.ones(2), op=hvd.Sum, name="flat")
    check(total, torch.full((2,), float(size)), "one host stays flat")
    print(_transport_line(), flush=True)


def scenario_hierarchical_sets():
    from roundel.common import basics

    hvd.init()
    rank, size = hvd.rank(), hvd.size()
    assert size == 4, "run with roundelrun --mpi -np 4"
    job = basics.runtime().process_sets[0][1]
    assert type(job).__name__ == "HierarchicalBackend" and job.hierarchical_allreduce, job
    assert (hvd.local_rank(), hvd.cross_rank()) == (rank // 2, rank % 2), (hvd.local_rank(), hvd.cross_rank())
    across, one_host = hvd.add_process_set([1, 2, 3]), hvd.add_process_set([0, 2])
    for process_set, members in ((across, [1, 2, 3]), (one_host, [0, 2])):
        if rank not in members:
            assert not process_set.included(), process_set
            continue
        total = hvd.allreduce(torch.full((5,), float(rank + 1)), op=hvd.Sum, name="set.sum", process_set=process_set)
        check(total, torch.full((5,), float(sum(m + 1 for m in members))), f"sum in {members}")
        gathered = hvd.allgather(torch.full((2,), rank), name="set.gather", process_set=process_set)
        check(gathered, torch.tensor(members).repeat_interleave(2), f"allgather in {members}")
    total = hvd.allreduce(torch.full((3,), float(rank)), op=hvd.Sum, name="job.sum")
    check(total, torch.full((3,), float(sum(range(size)))), "the job's hierarchical sum beside the sets")
    hvd.remove_process_set(across)
    hvd.remove_process_set(one_host)
    print(_transport_line(), flush=True)


SCENARIOS = {"transport": scenario_transport, "train": scenario_train, "subcomm": scenario_subcomm,
             "hierarchical": scenario_hierarchical, "hierarchical_sets": scenario_hierarchical_sets}

if __name__ == "__main__":
    if sys.argv[1] == "collectives":
        import torch_collectives  # calls hvd.init()

        run_scenarios(torch_collectives.SCENARIOS, sys.argv[1:], hvd.rank())
        print(_transport_line(), flush=True)
    else:
        run_scenarios(SCENARIOS, sys.argv, -1)
    hvd.shutdown()
