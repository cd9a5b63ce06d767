"""What roundel.mxnet's copies cost: its in-place allreduce against roundel.torch's, in the same job.

Run it in the MXNet environment (``pip install -e ".[mxnet]"``)::

    roundelrun -np 2 python benchmarks/mxnet_allreduce.py

For each size, ``hvd_mx.allreduce_(ndarray, op=Sum, name=...)`` (a copy to
host memory, the engine, a copy back into the NDArray) and
``hvd_torch.allreduce_(tensor, op=Sum, name=...)`` (the engine on the tensor's
own memory) alternate, round by round, between barriers; a round's
per-call time is the slowest rank's, and the median over rounds is reported
with ``ratio = torch time / mxnet time`` (1.0: the copies cost nothing).
Both results are checked against the exact sum once per size.
"""

from __future__ import annotations

import argparse
import statistics
import time

import mxnet as mx
import numpy as np
import torch

import roundel.mxnet as hvd_mx
import roundel.torch as hvd_torch


def per_call(fn, iters: int) -> float:
    """Seconds per call of ``fn`` over ``iters`` calls, the slowest rank's."""
    hvd_torch.barrier()
    start = time.perf_counter()
    for _ in range(iters):
        fn()
    elapsed = torch.tensor([(time.perf_counter() - start) / iters], dtype=torch.float64)
    return float(hvd_torch.allreduce(elapsed, op=hvd_torch.Max, name="bench.time").item())


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--sizes", default="1K,64K,1M,4M", help="float32 element counts (K = 1024, M = 1024*1024)")
    p.add_argument("--rounds", type=int, default=5)
    p.add_argument("--iters", type=int, default=20)
    args = p.parse_args()
    hvd_mx.init()
    n = hvd_mx.size()
    units = {"K": 1024, "M": 1024 * 1024}
    if hvd_mx.rank() == 0:
        print(f"{'elements':>10} {'mxnet ms':>10} {'torch ms':>10} {'ratio':>7}", flush=True)
    for text in args.sizes.split(","):
        count = int(text[:-1]) * units[text[-1]] if text[-1] in units else int(text)
        array = mx.nd.ones((count,), dtype="float32")
        tensor = torch.ones(count, dtype=torch.float32)
        expected = float(n)
        hvd_mx.allreduce_(array, op=hvd_mx.Sum, name=f"check.mx.{count}")
        hvd_torch.allreduce_(tensor, op=hvd_torch.Sum, name=f"check.torch.{count}")
        assert np.all(array.asnumpy() == expected) and bool((tensor == expected).all()), "wrong sum"
        array[:] = 0.0
        tensor.zero_()
        mx_times, torch_times = [], []
        for _ in range(args.rounds):
            mx_times.append(per_call(lambda: hvd_mx.allreduce_(array, op=hvd_mx.Sum, name=f"mx.{count}"),
                                     args.iters))
            torch_times.append(per_call(lambda: hvd_torch.allreduce_(tensor, op=hvd_torch.Sum,
                                                                     name=f"torch.{count}"), args.iters))
        mx_ms, torch_ms = statistics.median(mx_times) * 1e3, statistics.median(torch_times) * 1e3
        if hvd_mx.rank() == 0:
            print(f"{count:>10} {mx_ms:>10.3f} {torch_ms:>10.3f} {torch_ms / mx_ms:>7.2f}", flush=True)
    hvd_mx.shutdown()


if __name__ == "__main__":
    main()
