"""CPU per training step spent by ``DistributedOptimizer`` on a model of many small parameters.

Run it under the launcher (each rank prints its own figures)::

    roundelrun -np 2 python benchmarks/optimizer_hooks.py                # 160 parameters, 300 timed steps
    roundelrun -np 2 python benchmarks/optimizer_hooks.py --profile 25   # and rank 0's cProfile, top 25
    python benchmarks/optimizer_hooks.py --stub-engine                   # the optimizer's own Python alone

The model is ``--layers`` Linear(``--width``, ``--width``) layers (a weight
and a bias each: 160 parameter tensors by default, about as many as
ResNet-50's 161) on a batch of 8, so the step's own compute is small and the
optimizer's per-parameter work (its gradient hooks, starting and finishing
the buckets) shows. Each step is ``loss.backward(); optimizer.step()``,
timed with ``time.process_time()`` (the CPU of every thread of the process,
the engine's included) and with ``time.perf_counter()``; the forward pass
and ``zero_grad`` (``set_to_none=True``, torch's default, so each new
gradient is copied into its bucket, as DDP copies it; ``--keep-grads``:
``set_to_none=False``) are outside the timed span. Prints the median and the mean
per step, in milliseconds. ``--local`` times the wrapped optimizer alone
(no hooks, no communication): the floor the optimizer's overhead adds to.
``--stub-engine`` replaces the allreduce the optimizer starts with one that
returns its input at once (nothing reaches the engine; run it as a job of
one): what is left above the floor is the optimizer's own per-parameter and
per-bucket work.
"""

from __future__ import annotations

import argparse
import cProfile
import pstats
import statistics
import time

import torch

import roundel.torch as hvd
import roundel.torch.optimizer as optimizer_module


def stub_engine() -> None:
    """Make the optimizer's in-place allreduces no-ops that complete at once (the bucket keeps its values)."""
    started: dict = {}

    def start(tensors, **_):
        handle = len(started) + 1
        started[handle] = tensors
        return handle

    optimizer_module.allreduce_async_ = start
    optimizer_module.grouped_allreduce_async_ = start
    optimizer_module.synchronize = started.pop


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--layers", type=int, default=80)
    parser.add_argument("--width", type=int, default=32)
    parser.add_argument("--steps", type=int, default=300)
    parser.add_argument("--warmup", type=int, default=30)
    parser.add_argument("--local", action="store_true",
                        help="the wrapped optimizer alone, no DistributedOptimizer: the step's floor")
    parser.add_argument("--keep-grads", action="store_true",
                        help="zero_grad(set_to_none=False): gradients stay in their buckets, nothing is copied in")
    parser.add_argument("--stub-engine", action="store_true",
                        help="the optimizer's allreduces return at once, untouched: its own work alone")
    parser.add_argument("--profile", type=int, default=0, metavar="N",
                        help="profile rank 0's timed steps with cProfile and print the top N functions")
    args = parser.parse_args()
    torch.set_num_threads(1)
    hvd.init()
    if args.stub_engine:
        stub_engine()
    torch.manual_seed(0)
    model = torch.nn.Sequential(*[torch.nn.Linear(args.width, args.width) for _ in range(args.layers)])
    opt = torch.optim.SGD(model.parameters(), lr=1e-3)
    if not args.local:
        opt = hvd.DistributedOptimizer(opt, named_parameters=model.named_parameters())
    hvd.broadcast_parameters(model.state_dict(), root_rank=0)
    x = torch.randn(8, args.width)
    cpu, wall = [], []
    profiler = cProfile.Profile() if args.profile and hvd.rank() == 0 else None
    for step in range(args.warmup + args.steps):
        opt.zero_grad(set_to_none=not args.keep_grads)
        loss = model(x).square().mean()
        timed = step >= args.warmup
        if timed and profiler is not None:
            profiler.enable()
        c0, w0 = time.process_time(), time.perf_counter()
        loss.backward()
        opt.step()
        c1, w1 = time.process_time(), time.perf_counter()
        if timed:
            if profiler is not None:
                profiler.disable()
            cpu.append((c1 - c0) * 1e3)
            wall.append((w1 - w0) * 1e3)
    params = sum(1 for p in model.parameters())
    print(f"rank {hvd.rank()}: {params} parameters, {args.steps} steps: CPU per step median "
          f"{statistics.median(cpu):.3f} ms mean {statistics.mean(cpu):.3f} ms; wall median "
          f"{statistics.median(wall):.3f} ms", flush=True)
    if profiler is not None:
        stats = pstats.Stats(profiler)
        stats.sort_stats("tottime").print_stats(args.profile)
    hvd.shutdown()


if __name__ == "__main__":
    main()
