"""Shared-memory transport worker: ``torch_shared_memory.py SCENARIO[,SCENARIO...]``.

Run under roundelrun on one host. Prints ``BACKEND <class of the job's
communicator>`` and, on ranks other than 0, ``CONTROL local`` when the rank
reached the coordinator over its local socket; then checks collectives larger
than one shared-memory slot (so they go in several pieces), of every dtype and
of groups reduced without a fusion buffer, against NumPy references, and
(``small``) sums and gathers small enough for the backend's NumPy path, bit for
bit against torch's; ``CHECKS PASSED <scenario>`` after each scenario.
"""

from __future__ import annotations

import itertools
import sys

import numpy as np
import torch

import roundel.torch as hvd
from roundel.common import basics
from roundel.ops import ReduceOp
from roundel.transport.shared_memory import DIRECT_BYTES, MANY_SMALL_BYTES, SLOT_BYTES, SMALL_BYTES
from _checks import check, dtype_name, make, make_float, run_scenarios, to_np

hvd.init()
RANK, SIZE = hvd.rank(), hvd.size()
print("BACKEND", type(basics.runtime().process_sets[0][1]).__name__, flush=True)
if RANK:  # how this rank reached the coordinator: its local socket on the same host, else TCP
    print("CONTROL", basics.runtime().engine.coordinator_peer.split(" ")[0], flush=True)

OPS = {"Sum": (hvd.Sum, np.sum), "Min": (hvd.Min, np.min), "Max": (hvd.Max, np.max)}
DTYPES = (torch.float32, torch.float64, torch.bfloat16, torch.int16, torch.uint16, torch.int64, torch.uint8,
          torch.bool)  # bool goes to Gloo
PIECES = 2 * SLOT_BYTES // 4 + 12345  # float32 elements: three pieces, the last one short
SMALL_DTYPES = (torch.float16, torch.float32, torch.float64, torch.int8, torch.uint8, torch.int32, torch.int64)
DIRECT = DIRECT_BYTES // 2  # int16 elements of the largest reduction combined whole by every member


def scenario_allreduce():
    for dtype, (op_name, (op, reference)) in itertools.product(DTYPES, OPS.items()):
        tag = f"shm.ar.{op_name}.{dtype_name(dtype)}"
        count = {torch.float32: PIECES, torch.int64: PIECES // 2, torch.int16: DIRECT + 7}.get(dtype, 1001)
        low = 0 if dtype == torch.uint16 else -3
        inputs = [to_np(make(r, tag, (count,), dtype, low, 4)) for r in range(SIZE)]
        expected = reference(np.stack(inputs).astype(np.float64), 0)
        if dtype == torch.bool:  # Sum and Max: any; Min: all
            expected = expected.astype(bool)
        check(hvd.allreduce(make(RANK, tag, (count,), dtype, low, 4), name=tag, op=op), expected, tag, dtype)
    tag = "shm.ar.average"
    values = make(RANK, tag, (PIECES,), torch.float64, -3, 4)
    expected = np.mean(np.stack([to_np(make(r, tag, (PIECES,), torch.float64, -3, 4)) for r in range(SIZE)]), 0)
    check(hvd.allreduce(values, name=tag, op=hvd.Average), expected, tag)


# float32 pieces cross from one tensor into the next; every member is too large for the coordinator
# to reduce (over 4 KiB even in float16), so each group is one batch
FUSED_SHAPES = [(SLOT_BYTES // 4 - 7,), (3001,), (3, SLOT_BYTES // 8), (2500,)]


GROUP_OPS = {**OPS, "Product": (hvd.Product, np.prod)}


def _check_groups(label: str, shapes: list, dtypes) -> None:
    """A grouped allreduce of tensors of ``shapes`` for each dtype and op, checked against NumPy."""
    for dtype, (op_name, (op, reference)) in itertools.product(dtypes, GROUP_OPS.items()):
        tag = f"{label}.{op_name}.{dtype_name(dtype)}"
        low, high = (1, 3) if op_name == "Product" else (-3, 4)
        inputs = [[make(r, f"{tag}.{i}", shape, dtype, low, high) for i, shape in enumerate(shapes)]
                  for r in range(SIZE)]
        results = hvd.grouped_allreduce(inputs[RANK], name=tag, op=op)
        for i, result in enumerate(results):
            expected = reference(np.stack([to_np(inputs[r][i]) for r in range(SIZE)]).astype(np.float64), 0)
            check(result, expected, f"{tag}[{i}]", dtype)


def _check_in_place_scaled(tag: str, shapes: list) -> None:
    """Prescale and postscale, Average, results into the inputs."""
    inputs = [[make(r, f"{tag}.{i}", shape, torch.float32) for i, shape in enumerate(shapes)] for r in range(SIZE)]
    hvd.grouped_allreduce_(inputs[RANK], name=tag, op=hvd.Average, prescale_factor=0.5, postscale_factor=4.0)
    for i, result in enumerate(inputs[RANK]):
        expected = 2.0 * np.mean(np.stack([to_np(make(r, f"{tag}.{i}", shapes[i], torch.float32))
                                           for r in range(SIZE)]), 0)
        check(result, expected, f"{tag}[{i}]")


def scenario_fused():
    """Groups of tensors reduced straight from and into their own memory (``allreduce_fused``: no fusion
    buffer), in pieces that cross tensor boundaries; int16 (widened) takes the fusion buffer instead.
    Every result is checked against NumPy."""
    backend = basics.runtime().process_sets[0][1]
    fused_calls = []
    unwrapped = backend.allreduce_fused
    backend.allreduce_fused = lambda *args: (fused_calls.append(len(args[0])), unwrapped(*args))  # counted
    try:
        _check_groups("shm.fused", FUSED_SHAPES, (torch.float32, torch.int32, torch.float16, torch.int16))
        # every member of the 12 groups other than int16's, several in one call
        assert sum(fused_calls) == 12 * len(FUSED_SHAPES) and max(fused_calls) > 1, fused_calls
        fused_so_far = len(fused_calls)
        _check_in_place_scaled("shm.fused.inplace.scaled", FUSED_SHAPES)
        assert len(fused_calls) > fused_so_far, fused_calls
        tag = "shm.fused.transposed"  # in place into a non-contiguous tensor
        inputs = [[make(r, f"{tag}.a", (300, 700), torch.float32).t(), make(r, f"{tag}.b", (3000,), torch.float32)]
                  for r in range(SIZE)]
        expected = [np.sum(np.stack([to_np(inputs[r][i]) for r in range(SIZE)]), 0) for i in range(2)]
        hvd.grouped_allreduce_(inputs[RANK], name=tag, op=hvd.Sum)
        for i, result in enumerate(inputs[RANK]):
            check(result, expected[i], f"{tag}[{i}]")
    finally:
        del backend.allreduce_fused


# many small tensors of one to three dimensions, each too large for the coordinator (over 4 KiB even in
# float16); 0.4 MiB in float32 in all, so that one direct batch holds them (``_reduce_many_small``)
SMALL_SHAPES = [(2049 + 37 * i,) if i % 3 == 0 else (3, 700 + i) if i % 3 == 1 else (5, 2, 211 + i)
                for i in range(40)]
assert sum(np.prod(shape) for shape in SMALL_SHAPES) * 4 <= min(DIRECT_BYTES, len(SMALL_SHAPES) * MANY_SMALL_BYTES)


def _count_many_small(backend) -> list:
    """Count the batches ``backend`` reduces as many small tensors (the tensor count of each)."""
    calls = []
    unwrapped = backend._reduce_many_small
    backend._reduce_many_small = lambda targets, *rest: (calls.append(len(targets)), unwrapped(targets, *rest))
    return calls


def scenario_many_small():
    """Groups of many small tensors, reduced as one range and copied in and out by one call each
    (``_reduce_many_small``), for every op and fused dtype, in place and not, scaled: checked against
    NumPy, and each group one such batch."""
    backend = basics.runtime().process_sets[0][1]
    calls = _count_many_small(backend)
    try:
        dtypes = (torch.float32, torch.float64, torch.int32, torch.int64, torch.float16, torch.bfloat16)
        _check_groups("shm.small", SMALL_SHAPES, dtypes)
        _check_in_place_scaled("shm.small.inplace.scaled", SMALL_SHAPES)
        assert calls == [len(SMALL_SHAPES)] * (len(dtypes) * len(GROUP_OPS) + 1), calls
    finally:
        del backend._reduce_many_small


def scenario_exact():
    """Float sums and averages of normal floats, scaled, are bitwise what adding the (prescaled) inputs in
    member order and then scaling the sum gives: a factor that rides on the copy into the slot (a power
    of two) changes no bit, and one that cannot (an average over 3) must stay after the sum."""
    cases = ((hvd.Average, 1.0, 1.0, "average"), (hvd.Average, 0.75, 2.0, "average.scaled"),
             (hvd.Sum, 3.0, 0.25, "sum.scaled"))
    for dtype, (op, pre, post, label) in itertools.product((torch.float32, torch.float64), cases):
        tag = f"shm.exact.{label}.{dtype_name(dtype)}"
        inputs = [make_float(r, tag, (PIECES,), dtype) for r in range(SIZE)]
        expected = inputs[0] * pre
        for other in inputs[1:]:
            expected.add_(other * pre)
        expected.mul_(post / (SIZE if op == hvd.Average else 1))
        result = hvd.allreduce(inputs[RANK], name=tag, op=op, prescale_factor=pre, postscale_factor=post)
        differ = (result != expected).sum().item()
        assert differ == 0, f"{tag}: {differ} of {PIECES} elements differ from the sum, then scaled"
    calls = _count_many_small(backend := basics.runtime().process_sets[0][1])
    try:  # the same for a group of many small tensors, combined as one range
        for dtype, (op, pre, post, label) in itertools.product((torch.float32, torch.float64), cases):
            tag = f"shm.exact.small.{label}.{dtype_name(dtype)}"
            inputs = [[make_float(r, f"{tag}.{i}", shape, dtype) for i, shape in enumerate(SMALL_SHAPES)]
                      for r in range(SIZE)]
            results = hvd.grouped_allreduce(inputs[RANK], name=tag, op=op, prescale_factor=pre,
                                            postscale_factor=post)
            for i, result in enumerate(results):
                expected = inputs[0][i] * pre
                for other in inputs[1:]:
                    expected.add_(other[i] * pre)
                expected.mul_(post / (SIZE if op == hvd.Average else 1))
                differ = (result != expected).sum().item()
                assert differ == 0, f"{tag}[{i}]: {differ} elements differ from the sum, then scaled"
        assert calls == [len(SMALL_SHAPES)] * 2 * len(cases), calls
    finally:
        del backend._reduce_many_small


def scenario_allgather():
    for dtype in (torch.float32, torch.int64, torch.bool):
        tag = f"shm.ag.{dtype_name(dtype)}"
        rows = PIECES // 8
        gathered = hvd.allgather(make(RANK, tag, (rows, 8), dtype, -3, 4), name=tag)
        check(gathered, np.concatenate([to_np(make(r, tag, (rows, 8), dtype, -3, 4)) for r in range(SIZE)]), tag, dtype)


def scenario_reducescatter():
    """Reducescatter in several pieces (float32, a chunk boundary inside a piece), with rows that do not
    divide evenly, widened int16, and Min; each rank's chunk checked against NumPy."""
    for dtype, (op_name, (op, reference)), rows in ((torch.float32, ("Sum", OPS["Sum"]), 3 * SIZE * 1000 + 1),
                                                    (torch.int16, ("Sum", OPS["Sum"]), 2 * SIZE + 1),
                                                    (torch.float64, ("Min", OPS["Min"]), 5 * SIZE)):
        tag = f"shm.rs.{op_name}.{dtype_name(dtype)}"
        shape = (rows, 1024)
        reduced = reference(np.stack([to_np(make(r, tag, shape, dtype, -3, 4)) for r in range(SIZE)])
                            .astype(np.float64), 0)
        counts = [rows // SIZE + (1 if r < rows % SIZE else 0) for r in range(SIZE)]
        start = sum(counts[:RANK])
        result = hvd.reducescatter(make(RANK, tag, shape, dtype, -3, 4), name=tag, op=op)
        check(result, reduced[start:start + counts[RANK]], tag, dtype)


def _counted(backend, method: str) -> list:
    """Count ``backend``'s calls of ``method`` (the dtype each names last)."""
    calls = []
    unwrapped = getattr(backend, method)
    setattr(backend, method, lambda *args: (calls.append(dtype_name(args[-1])), unwrapped(*args))[1])
    return calls


def _member_order_sum(inputs: list) -> torch.Tensor:
    total = inputs[0].clone()
    for other in inputs[1:]:
        total.add_(other)
    return total


def _small_inputs(tag: str, count: int, dtype: torch.dtype) -> list:
    return [make_float(r, tag, (count,), dtype) if dtype.is_floating_point else make(r, tag, (count,), dtype, -100, 100)
            for r in range(SIZE)]


def scenario_small():
    """Small Sum allreduces and allgathers of every dtype NumPy has, on the job's backend: through its NumPy views
    (``_sum_small``, ``_gather_small``) up to SMALL_BYTES, and bitwise what torch gives adding the members'
    tensors in member order, as above SMALL_BYTES. Then Sum and Average through roundel, four steps under one name
    (replayed from the third): bitwise that sum (for Average, then scaled by 1 / SIZE)."""
    backend = basics.runtime().process_sets[0][1]
    sums, gathers = _counted(backend, "_sum_small"), _counted(backend, "_gather_small")
    try:
        for dtype in SMALL_DTYPES:
            largest = SMALL_BYTES // dtype.itemsize
            for count in (1, 1001, largest, largest + 1):
                tag = f"shm.small.direct.{dtype_name(dtype)}.{count}"
                inputs = _small_inputs(tag, count, dtype)
                reduced = inputs[RANK].clone()
                backend.allreduce(reduced, ReduceOp.Sum)
                assert torch.equal(reduced, _member_order_sum(inputs)), tag
                gathered = torch.empty(SIZE * count, dtype=dtype)
                backend.allgather(gathered, inputs[RANK])
                assert torch.equal(gathered, torch.cat(inputs)), f"{tag}.gathered"
        names = [dtype_name(dtype) for dtype in SMALL_DTYPES]
        assert sums == gathers == [name for name in names for _ in range(3)], (sums, gathers)
    finally:
        del backend._sum_small, backend._gather_small
    for dtype, count, op in itertools.product(SMALL_DTYPES, (1, 1001), (hvd.Sum, hvd.Average)):
        if op == hvd.Average and not dtype.is_floating_point:
            continue
        tag = f"shm.small.{dtype_name(dtype)}.{count}.{'avg' if op == hvd.Average else 'sum'}"
        for step in range(4):
            inputs = _small_inputs(f"{tag}.{step}", count, dtype)
            expected = _member_order_sum(inputs)
            if op == hvd.Average:
                expected.mul_(1.0 / SIZE)
            result = hvd.allreduce(inputs[RANK], name=tag, op=op)
            assert torch.equal(result, expected), f"{tag} step {step}: {result} != {expected}"
            gathered = hvd.allgather(inputs[RANK], name=f"{tag}.gathered")
            assert torch.equal(gathered, torch.cat(inputs)), f"{tag}.gathered step {step}"


def scenario_broadcast():
    for root in range(SIZE):
        tag = f"shm.bcast.{root}"
        result = hvd.broadcast(make(RANK, tag, (PIECES,), torch.float32, -3, 4), root_rank=root, name=tag)
        check(result, to_np(make(root, tag, (PIECES,), torch.float32, -3, 4)), tag)
    hvd.barrier()


if __name__ == "__main__":
    run_scenarios({"allreduce": scenario_allreduce, "fused": scenario_fused, "many_small": scenario_many_small,
                   "exact": scenario_exact, "small": scenario_small,
                   "allgather": scenario_allgather, "broadcast": scenario_broadcast,
                   "reducescatter": scenario_reducescatter}, sys.argv, RANK)
    hvd.shutdown()
