"""MPI transport worker: ``torch_mpi_backend.py SCENARIO`` under mpirun (or ``roundelrun --mpi``).

``torch_mpi_backend.py collectives SCENARIO[,SCENARIO...]`` runs
torch_collectives.py's scenarios, then prints the TRANSPORT line below.

- ``transport``: print ``TRANSPORT <rank> mpi_enabled=<bool> gloo_enabled=<bool> mpi_built=<bool>``.
- ``train``: for each transport (mpi, then gloo: ``init()`` again after
  ``shutdown()``), three DistributedOptimizer steps of a small model on
  per-rank data, then print ``WEIGHTS <transport> <rank> <json list>``.
- ``subcomm``: ``init(comm=...)`` splits 3+ ranks into the even and the odd
  ranks; each job's allreduce must sum its own members only.
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


SCENARIOS = {"transport": scenario_transport, "train": scenario_train, "subcomm": scenario_subcomm}

if __name__ == "__main__":
    if sys.argv[1] == "collectives":
        import torch_collectives  # calls hvd.init()

        run_scenarios(torch_collectives.SCENARIOS, sys.argv[1:], hvd.rank())
        print(_transport_line(), flush=True)
    else:
        run_scenarios(SCENARIOS, sys.argv, -1)
    hvd.shutdown()
