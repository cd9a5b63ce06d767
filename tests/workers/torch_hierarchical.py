"""Hierarchical collectives worker: ``torch_hierarchical.py SCENARIO[,SCENARIO...]``.

Run under roundelrun (with or without --hierarchical-allreduce/--hierarchical-allgather).
Prints ``BACKEND <class> <hierarchical allreduce> <hierarchical allgather>``
for the job's communicator (and ``LOCAL <class>`` for a hierarchical one's
local communicator), then checks allreduce and allgather results
against NumPy references; ``CHECKS PASSED <scenario>`` after each scenario.
"""

from __future__ import annotations

import sys

import numpy as np
import torch

import roundel.torch as hvd
from roundel.common import basics
from _checks import check, dtype_name, make, run_scenarios, to_np

hvd.init()
RANK, SIZE = hvd.rank(), hvd.size()

job = basics.runtime().process_sets[0][1]
print("BACKEND", type(job).__name__, getattr(job, "hierarchical_allreduce", False),
      getattr(job, "hierarchical_allgather", False), flush=True)
if hasattr(job, "local"):
    print("LOCAL", type(job.local).__name__, flush=True)

OPS = {"Sum": hvd.Sum, "Average": hvd.Average, "Min": hvd.Min, "Max": hvd.Max}
DTYPES = (torch.int32, torch.int64, torch.float32, torch.float64, torch.bfloat16, torch.uint8, torch.int16)
# sizes below, at and above the local size, and ones not divisible by it
COUNTS = (1, 3, 4, 7, 1001, 65537)


def reduce_ref(op_name: str, arrays: list, dtype: torch.dtype) -> np.ndarray:
    stack = np.stack(arrays).astype(np.float64)
    if op_name == "Sum":
        out = stack.sum(axis=0)
    elif op_name == "Average":
        out = stack.sum(axis=0)
        out = out / len(arrays) if dtype.is_floating_point else out // len(arrays)
    elif op_name == "Min":
        out = stack.min(axis=0)
    else:
        out = stack.max(axis=0)
    return to_np(torch.from_numpy(out).to(dtype))


def inputs(tag: str, count: int, dtype: torch.dtype, op_name: str) -> list:
    low = 0 if dtype == torch.uint8 or op_name == "Average" else -5  # integer averages round toward zero
    high = 50 if dtype == torch.uint8 else 6  # a Sum of 4 fits in uint8
    return [to_np(make(r, tag, (count,), dtype, low, high)) for r in range(SIZE)]


def allreduce_ops_dtypes_sizes():
    for op_name, op in OPS.items():
        for dtype in DTYPES:
            for count in COUNTS:
                tag = f"ar-{op_name}-{dtype_name(dtype)}-{count}"
                every = inputs(tag, count, dtype, op_name)
                got = hvd.allreduce(torch.from_numpy(every[RANK]).to(dtype), op=op, name=tag)
                check(got, reduce_ref(op_name, every, dtype), tag, dtype)


def allreduce_fused():
    """Several tensors of odd sizes submitted together, so that they are fused into one buffer."""
    shapes = [(5,), (3, 7), (1,), (2, 3, 11), (13,)]
    for dtype in (torch.float32, torch.int64):
        tags = [f"fused-{dtype_name(dtype)}-{i}" for i in range(len(shapes))]
        every = [[to_np(make(r, tag, shape, dtype)) for r in range(SIZE)] for tag, shape in zip(tags, shapes)]
        handles = [hvd.allreduce_async(torch.from_numpy(arrays[RANK]).to(dtype), op=hvd.Sum, name=tag)
                   for tag, arrays in zip(tags, every)]
        for tag, arrays, handle in zip(tags, every, handles):
            check(hvd.synchronize(handle), reduce_ref("Sum", arrays, dtype), tag, dtype)


def allgather_variable():
    """Each rank gives a different first dimension (rank r: r+1 rows, and 0 rows on some)."""
    for dtype in (torch.float32, torch.int64, torch.int16):
        for tail in ((), (3,), (2, 5)):
            tag = f"ag-{dtype_name(dtype)}-{len(tail)}"
            rows = [(r * 3 + 1) % 4 for r in range(SIZE)]  # 1, 0, 3, 2: one rank has none
            every = [to_np(make(r, tag, (rows[r],) + tail, dtype)) for r in range(SIZE)]
            got = hvd.allgather(torch.from_numpy(every[RANK]).to(dtype), name=tag)
            check(got, np.concatenate(every), tag, dtype)
    tags = [f"ag-fused-{i}" for i in range(3)]
    every = [[to_np(make(r, tag, (r + i, 4), torch.float64)) for r in range(SIZE)] for i, tag in enumerate(tags)]
    handles = [hvd.allgather_async(torch.from_numpy(arrays[RANK]), name=tag) for tag, arrays in zip(tags, every)]
    for tag, arrays, handle in zip(tags, every, handles):
        check(hvd.synchronize(handle), np.concatenate(arrays), tag, torch.float64)


run_scenarios({"allreduce": allreduce_ops_dtypes_sizes, "fused": allreduce_fused,
               "allgather": allgather_variable}, sys.argv, RANK)
