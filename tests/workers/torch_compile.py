"""``torch.compile`` and DistributedOptimizer: ``torch_compile.py compiled_training`` under roundelrun.

A compiled model and its eager twin, each wrapped by DistributedOptimizer, train three steps on each rank's
batch; both must end where one process training on every rank's batch does (float64 tolerance: the compiled
kernels may sum in another order). Under ``ROUNDEL_TEST_DEVICE=cuda`` the models live on the rank's GPU.
"""

from __future__ import annotations

import sys

import torch

import roundel.torch as hvd
from _checks import DEVICE, check, make_float, run_scenarios, to_np, use_test_device

hvd.init()
RANK, SIZE = hvd.rank(), hvd.size()
use_test_device(hvd.local_rank())


def _model() -> torch.nn.Module:
    torch.manual_seed(11)
    return torch.nn.Sequential(torch.nn.Linear(6, 32), torch.nn.Tanh(), torch.nn.Linear(32, 32), torch.nn.ReLU(),
                               torch.nn.Linear(32, 3)).double().to(DEVICE)


def _distributed(model: torch.nn.Module, prefix: str):
    optimizer = hvd.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9),
                                         named_parameters=[(prefix + n, p) for n, p in model.named_parameters()])
    hvd.broadcast_parameters(model.state_dict(), root_rank=0)
    return optimizer


def _step(model, optimizer, inputs, targets) -> None:
    optimizer.zero_grad()
    torch.nn.functional.mse_loss(model(inputs), targets).backward()
    optimizer.step()


def scenario_compiled_training():
    """A compiled model under DistributedOptimizer trains as its eager twin and as one process on every batch."""
    compiled_model, eager_model, reference = _model(), _model(), _model()
    compiled = torch.compile(compiled_model)
    compiled_optimizer = _distributed(compiled_model, "compiled.")
    eager_optimizer = _distributed(eager_model, "eager.")
    reference_optimizer = torch.optim.SGD(reference.parameters(), lr=0.1, momentum=0.9)
    for step in range(3):
        batches = [(make_float(r, f"compile.{step}.x", (8, 6)), make_float(r, f"compile.{step}.y", (8, 3)))
                   for r in range(SIZE)]
        _step(compiled, compiled_optimizer, *batches[RANK])
        _step(eager_model, eager_optimizer, *batches[RANK])
        reference_optimizer.zero_grad()
        (sum(torch.nn.functional.mse_loss(reference(x), y) for x, y in batches) / SIZE).backward()
        reference_optimizer.step()
    graphs = torch._dynamo.utils.counters["stats"]["unique_graphs"]
    assert graphs >= 1, "torch.compile made no graph: the model ran eagerly, and the test would show nothing"
    for (name, mine), eager, expected in zip(compiled_model.named_parameters(), eager_model.parameters(),
                                             reference.parameters()):
        check(mine, to_np(eager), f"compiled {name} against the eager model")
        check(mine, to_np(expected), f"compiled {name} against one process on every batch")


run_scenarios({"compiled_training": scenario_compiled_training}, sys.argv, RANK)
