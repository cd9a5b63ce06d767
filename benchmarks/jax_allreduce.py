"""What the JAX adapter adds to an allreduce: roundel.jax (eager and inside ``jax.jit``) against roundel.torch.

Run it under the launcher::

    roundelrun -np 2 python benchmarks/jax_allreduce.py                 # 4 B to 16 MiB
    roundelrun -np 2 python benchmarks/jax_allreduce.py --sizes 4K,4M --rounds 5

For each size, one float32 array is summed across the ranks by three
implementations in the same processes, through the same engine:
``roundel.torch.allreduce`` on a torch tensor (the peer), ``roundel.jax.allreduce``
on a ``jax.Array`` called eagerly, and the same inside a jitted function
(an ordered ``io_callback``; the timed call includes ``block_until_ready``).
They alternate round by round so background load hits all alike; a round's
per-call time is the slowest rank's, the reported time the median over
rounds, and the ratios are jax time / torch time (1.00: no overhead). Each
implementation's result is checked once. Only rank 0 prints (Markdown).
"""

from __future__ import annotations

import argparse
import os
import statistics
import time

os.environ.setdefault("JAX_PLATFORMS", "cpu")

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
import torch  # noqa: E402

import roundel.jax as hvd_jax  # noqa: E402
import roundel.torch as hvd_torch  # noqa: E402

UNITS = {"K": 1024, "M": 1024 ** 2}


def parse_size(text: str) -> int:
    text = text.strip().upper()
    value = int(text[:-1]) * UNITS[text[-1]] if text[-1] in UNITS else int(text)
    if value < 4 or value % 4:
        raise argparse.ArgumentTypeError(f"size {text!r} must be a positive multiple of 4 bytes (float32)")
    return value


def human(nbytes: int) -> str:
    for unit, scale in (("MiB", 1024 ** 2), ("KiB", 1024)):
        if nbytes >= scale:
            return f"{nbytes / scale:g} {unit}"
    return f"{nbytes} B"


def slowest(seconds: float) -> float:
    return float(hvd_torch.allreduce(torch.tensor([seconds], dtype=torch.float64), op=hvd_torch.Max,
                                     name="bench.slowest")[0])


def per_call(fn, iters: int) -> float:
    hvd_torch.barrier()
    start = time.perf_counter()
    for _ in range(iters):
        fn()
    return slowest((time.perf_counter() - start) / iters)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--sizes", type=lambda s: [parse_size(x) for x in s.split(",")],
                   default=[4, 4 * 1024, 256 * 1024, 4 * 1024 ** 2, 16 * 1024 ** 2], help="e.g. 4,64K,16M")
    p.add_argument("--rounds", type=int, default=3, help="alternating rounds per size")
    p.add_argument("--target-s", type=float, default=0.3, help="seconds per implementation and round")
    args = p.parse_args()
    hvd_jax.init()
    world = hvd_torch.size()
    rows, wrong = [], False
    for nbytes in args.sizes:
        numel = nbytes // 4
        tensor = torch.full((numel,), float(hvd_torch.rank() + 1))
        array = jnp.full((numel,), float(hvd_jax.rank() + 1))
        jitted = jax.jit(lambda a: hvd_jax.allreduce(a, op=hvd_jax.Sum, name=f"bench.jit.{nbytes}"))
        impls = {
            "torch": lambda: hvd_torch.allreduce(tensor, op=hvd_torch.Sum, name=f"bench.torch.{nbytes}"),
            "jax eager": lambda: hvd_jax.allreduce(array, op=hvd_jax.Sum, name=f"bench.eager.{nbytes}"),
            "jax jit": lambda: jitted(array).block_until_ready(),
        }
        expected = world * (world + 1) / 2
        for name, fn in impls.items():  # warm-up (compiles the jitted one) and check
            wrong |= not np.allclose(np.asarray(fn()), expected)
        once = max(per_call(fn, 3) for fn in impls.values())
        iters = max(3, min(2000, int(args.target_s / max(once, 1e-6))))
        iters = int(hvd_torch.allreduce(torch.tensor([iters]), op=hvd_torch.Min, name="bench.iters")[0])
        times = {name: [] for name in impls}
        for _ in range(args.rounds):
            for name, fn in impls.items():
                times[name].append(per_call(fn, iters))
        rows.append((nbytes, {name: statistics.median(t) for name, t in times.items()}))
    if hvd_torch.rank() == 0:
        print(f"{world} ranks, {args.rounds} rounds; per-call time (slowest rank, median), ratio to roundel.torch\n")
        print("| size | roundel.torch | roundel.jax eager | ratio | roundel.jax in jit | ratio |")
        print("| --- | --- | --- | --- | --- | --- |")
        for nbytes, t in rows:
            print(f"| {human(nbytes)} | {t['torch'] * 1e6:.0f} us | {t['jax eager'] * 1e6:.0f} us | "
                  f"{t['jax eager'] / t['torch']:.2f} | {t['jax jit'] * 1e6:.0f} us | {t['jax jit'] / t['torch']:.2f} |")
        print("\nresults: " + ("WRONG" if wrong else "all correct"))
    raise SystemExit(1 if wrong else 0)


if __name__ == "__main__":
    main()
