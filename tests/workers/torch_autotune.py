"""Autotune worker (run with ``roundelrun --autotune ...``): ``torch_autotune.py [tune|no-sklearn]``.

``tune`` (the default): steps of named allreduces until tuning ends. Each step reduces four named tensors of different sizes (integer-valued, so
every sum is exact) and checks each result, then agrees with the other
ranks (an allreduce of "this rank has seen the final settings", Min) whether
to stop; a few more steps follow at the final settings. Prints
``TUNED <json>`` with the settings in force on this rank at the end, the
number of steps and the job communicator's hierarchical switches (null when
it is flat), and ``CHECKS PASSED autotune``.

``optimizer``: training steps of a small model with ``DistributedOptimizer``
(gradient buckets) until tuning ends, then a few more; prints ``TUNED`` as
above plus the optimizer's bucket size in MiB, its bucket names, its number of
buckets each time that changed, and a digest of the weights, and ``CHECKS PASSED optimizer``.

``no-sklearn``: scikit-learn cannot be imported; ``init()`` must raise
SettingsError naming it (on every rank); prints ``CHECKS PASSED no-sklearn``.
"""

from __future__ import annotations

import json
import sys

import torch

import roundel.torch as hvd
from roundel.common import basics
from roundel.errors import SettingsError

MAX_STEPS = 400
STEPS_AFTER = 5
SIZES = (1, 1000, 50_000, 300_000)


def step(n: int) -> None:
    rank, size = hvd.rank(), hvd.size()
    tensors = [torch.arange(elements, dtype=torch.float64) % 7 + rank + n for elements in SIZES]
    handles = [hvd.allreduce_async(t, name=f"grad.{i}", op=hvd.Sum) for i, t in enumerate(tensors)]
    for i, (elements, handle) in enumerate(zip(SIZES, handles)):
        expected = size * (torch.arange(elements, dtype=torch.float64) % 7 + n) + sum(range(size))
        result = hvd.synchronize(handle)
        assert torch.equal(result, expected), f"step {n} grad.{i}: {result[:4]} != {expected[:4]}"


def no_sklearn() -> None:
    sys.modules["sklearn.gaussian_process"] = None  # the import now fails, as without scikit-learn
    try:
        hvd.init()
    except SettingsError as exc:
        assert "needs scikit-learn" in str(exc), exc
        print(f"init refused: {exc}", flush=True)
        print("CHECKS PASSED no-sklearn", flush=True)
        return
    raise AssertionError("init() started autotune without scikit-learn")


class Trainer:
    """A model of six 256 x 256 layers (256 KiB of weights each) trained on per-rank data."""

    def __init__(self):
        torch.manual_seed(7)
        self.model = torch.nn.Sequential(*[torch.nn.Linear(256, 256) for _ in range(6)])
        self.optimizer = hvd.DistributedOptimizer(torch.optim.SGD(self.model.parameters(), lr=0.01),
                                                  named_parameters=self.model.named_parameters())
        hvd.broadcast_parameters(self.model.state_dict(), root_rank=0)
        self.layouts = []  # the number of buckets after each step, when it changed

    def __call__(self, n: int) -> None:
        generator = torch.Generator().manual_seed(1000 * n + hvd.rank())
        inputs = torch.randn(8, 256, generator=generator)
        self.optimizer.zero_grad()
        self.model(inputs).pow(2).mean().backward()
        self.optimizer.step()
        if not self.layouts or self.layouts[-1] != len(self.optimizer._buckets):
            self.layouts.append(len(self.optimizer._buckets))

    def report(self) -> dict:
        weights = torch.cat([p.detach().reshape(-1) for p in self.model.parameters()])
        return {"bucket_mib": self.optimizer._cap / (1 << 20), "buckets": [b.name for b in self.optimizer._buckets],
                "layouts": self.layouts,
                "weights": float(weights.double().abs().sum())}


def main() -> None:
    if sys.argv[1:] == ["no-sklearn"]:
        no_sklearn()
        return
    hvd.init()
    engine = basics.runtime().engine
    train = Trainer() if sys.argv[1:] == ["optimizer"] else step
    steps = 0
    while steps < MAX_STEPS:
        train(steps)
        steps += 1
        final_here = torch.tensor([0 if engine.tuned.tuning else 1])
        if hvd.allreduce(final_here, name="tuning_done", op=hvd.Min).item() == 1:
            break
    assert not engine.tuned.tuning, f"autotune did not finish within {MAX_STEPS} steps"
    for _ in range(STEPS_AFTER):
        train(steps)
        steps += 1
    backend = engine.job_backend  # a hierarchical one has the switches the executor applied
    switches = [getattr(backend, "hierarchical_allreduce", None), getattr(backend, "hierarchical_allgather", None)]
    report = {"params": list(engine.tuned), "steps": steps, "backend": switches}
    if isinstance(train, Trainer):
        report.update(train.report())
    print("TUNED " + json.dumps(report), flush=True)
    hvd.shutdown()
    print(f"CHECKS PASSED {'optimizer' if isinstance(train, Trainer) else 'autotune'}", flush=True)


if __name__ == "__main__":
    main()
