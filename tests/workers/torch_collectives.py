"""Collective correctness worker: ``torch_collectives.py SCENARIO[,SCENARIO...]``.

Run under roundelrun. Each scenario performs a list of collectives on
deterministic per-rank inputs and compares every result with a NumPy
reference; a mismatch raises AssertionError (the rank exits non-zero). After
each scenario the rank prints ``CHECKS PASSED <scenario>``.
"""

from __future__ import annotations

import itertools
import sys

import numpy as np
import torch

import roundel.torch as hvd
from roundel.common import basics
from roundel.common.control import channel as control_channel
from roundel.common.engine import small_allreduce
from roundel.common.engine.core import REPLAYS_SMALL_UP_TO
from roundel.common.settings import Settings
from _checks import (ALL_DTYPES, DEVICE, check, dtype_name, expect_raises, make,
                     make_float, rng, run_scenarios, to_np, use_test_device)

hvd.init()
RANK, SIZE = hvd.rank(), hvd.size()
use_test_device(hvd.local_rank())

OPS = {"Sum": hvd.Sum, "Average": hvd.Average, "Min": hvd.Min, "Max": hvd.Max, "Product": hvd.Product}
SHAPES = [(), (0,), (3, 0), (7,), (2, 3, 4)]


def _value_range(op_name: str):
    if op_name == "Product":
        return -3, 4
    if op_name == "Average":
        return 0, 10  # non-negative, so integer averages round down unambiguously
    return -5, 6


def ar_input(rank: int, tag: str, shape, dtype, op_name: str) -> torch.Tensor:
    low, high = _value_range(op_name)
    return make(rank, tag, shape, dtype, low, high)


def reduce_ref(op_name: str, arrays: list, dtype: torch.dtype, prescale=1.0, postscale=1.0) -> np.ndarray:
    """What allreduce of ``arrays`` (one per rank) must return."""
    stack = np.stack([np.asarray(a) for a in arrays])
    if dtype == torch.bool:
        stack = stack.astype(bool)
        if op_name in ("Sum", "Max"):
            return stack.any(axis=0)
        if op_name in ("Min", "Product"):
            return stack.all(axis=0)
        raise ValueError(op_name)
    stack = stack.astype(np.float64) * prescale
    if op_name == "Sum":
        out = stack.sum(axis=0)
    elif op_name == "Average":
        out = stack.sum(axis=0)
        out = out // len(arrays) if not dtype.is_floating_point else out / len(arrays)
    elif op_name == "Min":
        out = stack.min(axis=0)
    elif op_name == "Max":
        out = stack.max(axis=0)
    elif op_name == "Product":
        out = stack.prod(axis=0)
    else:
        raise ValueError(op_name)
    return out * postscale


def all_inputs(tag, shape, dtype, op_name):
    return [to_np(ar_input(r, tag, shape, dtype, op_name)) for r in range(SIZE)]


# ------------------------------------------------------------------ allreduce
def scenario_allreduce():
    # The full matrix, submitted asynchronously all at once (exercises fusion), then checked.
    pending = []
    for op_name, op in OPS.items():
        for dtype in ALL_DTYPES:
            if dtype == torch.bool and op_name == "Average":
                continue
            for shape in SHAPES:
                tag = f"ar.{op_name}.{dtype_name(dtype)}.{shape}"
                tensor = ar_input(RANK, tag, shape, dtype, op_name)
                handle = hvd.allreduce_async(tensor, name=tag, op=op)
                pending.append((handle, tag, shape, dtype, op_name, tensor.clone(), tensor))
    for handle, tag, shape, dtype, op_name, before, tensor in pending:
        result = hvd.synchronize(handle)
        check(result, reduce_ref(op_name, all_inputs(tag, shape, dtype, op_name), dtype), tag, dtype)
        check(tensor, before, f"{tag}: input must not change")

    # Synchronous forms on a subset, by name and unnamed.
    for dtype in (torch.int32, torch.float32, torch.bfloat16, torch.bool):
        for op_name in ("Sum", "Max"):
            tag = f"ar.sync.{op_name}.{dtype_name(dtype)}"
            tensor = ar_input(RANK, tag, (5, 2), dtype, op_name)
            ref = reduce_ref(op_name, all_inputs(tag, (5, 2), dtype, op_name), dtype)
            check(hvd.allreduce(tensor, name=tag, op=OPS[op_name]), ref, tag, dtype)
            check(hvd.allreduce(tensor, op=OPS[op_name]), ref, tag + " (unnamed)", dtype)
            inplace = tensor.clone()
            out = hvd.allreduce_(inplace, name=tag + ".inplace", op=OPS[op_name])
            assert out is inplace, "allreduce_ must return its argument"
            check(inplace, ref, tag + " in place", dtype)

    # Default op is Average; legacy average=True/False.
    tag = "ar.default"
    x = make_float(RANK, tag, (6,))
    xs = [to_np(make_float(r, tag, (6,))) for r in range(SIZE)]
    check(hvd.allreduce(x, name="ar.default"), np.mean(xs, axis=0), "default op (Average)")
    check(hvd.allreduce(x, average=True, name="ar.legacy.avg"), np.mean(xs, axis=0), "average=True")
    check(hvd.allreduce(x, average=False, name="ar.legacy.sum"), np.sum(xs, axis=0), "average=False")
    expect_raises(ValueError, lambda: hvd.allreduce(x, average=True, op=hvd.Sum, name="ar.both"),
                  what="average= with op=")

    # prescale/postscale factors.
    for dtype in (torch.float32, torch.float64, torch.int32):
        for op_name, pre, post in (("Sum", 2.0, 0.5), ("Average", 3.0, 1.0), ("Sum", 1.0, 4.0),
                                   ("Max", 0.5, 2.0)):
            tag = f"ar.scale.{op_name}.{pre}.{post}.{dtype_name(dtype)}"
            tensor = ar_input(RANK, tag, (2, 3), dtype, op_name)
            if dtype == torch.int32 and pre != 1.0 and pre != int(pre):
                continue  # integer prescale by a fraction truncates per element; not a portable check
            ref = reduce_ref(op_name, all_inputs(tag, (2, 3), dtype, op_name), dtype, pre, post)
            if dtype == torch.int32:
                ref = np.trunc(ref)
            check(hvd.allreduce(tensor, name=tag, op=OPS[op_name], prescale_factor=pre,
                                postscale_factor=post), ref, tag, dtype)
            inplace = tensor.clone()
            hvd.allreduce_(inplace, name=tag + ".inplace", op=OPS[op_name], prescale_factor=pre,
                           postscale_factor=post)
            check(inplace, ref, tag + " in place", dtype)

    # Average is not defined for bool: a clear error on every rank, and the engine goes on.
    flags = make(RANK, "bool.avg", (4,), torch.bool)
    expect_raises(ValueError, lambda: hvd.allreduce(flags, name="ar.bool.avg", op=hvd.Average),
                  "Average", "bool", what="bool Average")
    expect_raises(ValueError, lambda: hvd.allreduce_(flags.clone(), name="ar.bool.avg2"),
                  "Average", "bool", what="bool default Average (in place)")
    check(hvd.allreduce(flags, name="ar.bool.after", op=hvd.Sum),
          reduce_ref("Sum", [to_np(make(r, "bool.avg", (4,), torch.bool)) for r in range(SIZE)], torch.bool),
          "bool Sum after the error")

    # Non-contiguous input (a transposed view).
    for dtype in (torch.float32, torch.int64):
        tag = f"ar.noncontig.{dtype_name(dtype)}"
        base = make(RANK, tag, (4, 3), dtype)
        view = base.t()
        assert not view.is_contiguous()
        ref = reduce_ref("Sum", [to_np(make(r, tag, (4, 3), dtype)).T for r in range(SIZE)], dtype)
        before = base.clone()
        check(hvd.allreduce(view, name=tag, op=hvd.Sum), ref, tag, dtype)
        check(base, before, f"{tag}: allreduce must not touch its input")
        out = hvd.allreduce_(view, name=tag + ".inplace", op=hvd.Sum)
        assert out is view, "allreduce_ must return the view it was given"
        check(view, ref, tag + " in place (view)", dtype)
        check(base, ref.T, tag + " in place (base tensor behind the view)", dtype)
        # async in-place on a non-contiguous view
        base2 = make(RANK, tag, (4, 3), dtype)
        handle = hvd.allreduce_async_(base2.t(), name=tag + ".async_", op=hvd.Sum)
        hvd.synchronize(handle)
        check(base2, ref.T, tag + " async in place", dtype)
        # a strided slice
        wide = make(RANK, tag + ".wide", (6, 4), dtype)
        sl = wide[::2, 1:3]
        ref_sl = reduce_ref("Sum", [to_np(make(r, tag + ".wide", (6, 4), dtype))[::2, 1:3] for r in range(SIZE)],
                            dtype)
        hvd.allreduce_(sl, name=tag + ".slice", op=hvd.Sum)
        check(sl, ref_sl, tag + " strided slice in place", dtype)
        untouched = to_np(make(RANK, tag + ".wide", (6, 4), dtype))
        mask = np.ones((6, 4), dtype=bool)
        mask[::2, 1:3] = False
        assert np.array_equal(to_np(wide)[mask], untouched[mask]), "allreduce_ wrote outside the slice"

    # allreduce_async + poll + synchronize; synchronize twice is an error.
    tag = "ar.poll"
    x = make_float(RANK, tag, (3, 3), torch.float32)
    handle = hvd.allreduce_async(x, name=tag, op=hvd.Sum)
    for _ in range(20000):
        if hvd.poll(handle):
            break
        import time
        time.sleep(0.001)
    assert hvd.poll(handle), "poll never became True"
    check(hvd.synchronize(handle), np.sum([to_np(make_float(r, tag, (3, 3), torch.float32)) for r in range(SIZE)],
                                          axis=0), tag)
    expect_raises(ValueError, lambda: hvd.synchronize(handle), what="synchronize twice")
    expect_raises(ValueError, lambda: hvd.poll(handle), what="poll after synchronize")

    # A scalar keeps its 0-d shape and Python-scalar-like use.
    out = hvd.allreduce(torch.tensor(float(RANK + 1)), name="ar.scalar.py", op=hvd.Sum)
    assert out.dim() == 0 and out.item() == SIZE * (SIZE + 1) / 2, out


def scenario_allreduce_sizes():
    # One tensor per call (no fusion) around the sizes where the Gloo backend switches between its ring
    # allreduce and an allgather with a local reduction (each rank receiving at most 256 KiB): fewer elements
    # than ranks, as many, the largest gathered size (reduced in several slices), one more. Every op and
    # dtype must give the same results on both sides.
    for dtype in ALL_DTYPES:
        largest = 256 * 1024 // ((SIZE - 1) * torch.empty(0, dtype=dtype).element_size())
        for count, (op_name, op) in itertools.product((SIZE - 1, SIZE, largest, largest + 1), OPS.items()):
            if dtype == torch.bool and op_name == "Average":
                continue
            tag = f"ar.sizes.{count}.{op_name}.{dtype_name(dtype)}"
            tensor = ar_input(RANK, tag, (count,), dtype, op_name)
            ref = reduce_ref(op_name, all_inputs(tag, (count,), dtype, op_name), dtype)
            check(hvd.allreduce(tensor, name=tag, op=op), ref, tag, dtype)


def scenario_coordinator_reduce():
    """Small CPU allreduces make no transport call when the coordinator reduces them (by default up to
    ROUNDEL_COORDINATOR_REDUCE_BYTES), and each makes one when it is 0 or the tensor is larger; the
    results are the same either way. In a job of up to REPLAYS_SMALL_UP_TO ranks with steady replay on, the
    ones the schedule can replay (Sum and Average of the global set) are left to it instead."""
    settings = Settings.from_env()
    limit = settings.coordinator_reduce_bytes
    to_replay = settings.steady_replay and SIZE <= REPLAYS_SMALL_UP_TO
    backend = basics.runtime().engine.job_backend
    calls = []

    def counted(method):
        original = getattr(backend, method)

        def call(*args):
            calls.append(method)
            return original(*args)
        return call

    methods = [method for method in ("allreduce", "allreduce_async", "allreduce_fused", "allgather")
               if getattr(backend, method, None) is not None]  # the ones this backend offers
    for method in methods:
        setattr(backend, method, counted(method))
    try:
        for ops, replayable in (({k: v for k, v in OPS.items() if k not in ("Sum", "Average")}, False),
                                ({k: OPS[k] for k in ("Sum", "Average")}, to_replay)):
            before, replayed = len(calls), sum(basics.runtime().engine.replay_counts)
            for step in range(3):
                handles = []
                for (op_name, op), (dtype, pre, post) in itertools.product(
                        ops.items(), ((torch.float32, 2.0, 0.5), (torch.int32, 2.0, 0.5), (torch.bfloat16, 1.0, 1.0))):
                    tag = f"coord.{op_name}.{dtype_name(dtype)}.{step}"
                    tensor = ar_input(RANK, tag, (2, 3), dtype, op_name)
                    ref = reduce_ref(op_name, all_inputs(tag, (2, 3), dtype, op_name), dtype, pre, post)
                    if dtype == torch.int32:
                        ref = np.trunc(ref)
                    handles.append((hvd.allreduce_async(tensor, name=f"coord.{op_name}.{dtype_name(dtype)}",
                                                        op=op, prescale_factor=pre, postscale_factor=post),
                                    ref, tag, dtype))
                for handle, ref, tag, dtype in handles:
                    check(hvd.synchronize(handle), ref, tag, dtype)
            small = len(calls) - before
            replayed = sum(basics.runtime().engine.replay_counts) - replayed
            if limit > 0 and DEVICE == "cpu" and not replayable:
                assert small == replayed, (f"{small} transport calls, {replayed} of them replayed slots, for "
                                           f"allreduces ({', '.join(ops)}) the coordinator should have reduced")
            else:
                assert small > 0, f"small allreduces ({', '.join(ops)}) made no transport call"
        small = len(calls)
        count = limit // 4 + 1  # one float32 more than the coordinator takes
        tag = "coord.large"
        ref = reduce_ref("Sum", all_inputs(tag, (count,), torch.float32, "Sum"), torch.float32)
        check(hvd.allreduce(ar_input(RANK, tag, (count,), torch.float32, "Sum"), name=tag, op=hvd.Sum), ref, tag)
        assert len(calls) > small, "an allreduce over the coordinator's limit made no transport call"
    finally:
        for method in methods:
            delattr(backend, method)


# ------------------------------------------------------------ grouped allreduce
def scenario_grouped():
    specs = [((3,), torch.float32), ((2, 2), torch.float64), ((), torch.int32), ((0,), torch.float32),
             ((5,), torch.int8)]

    def inputs(rank, tag):
        return [make(rank, f"{tag}.{i}", shape, dtype, 0, 10) for i, (shape, dtype) in enumerate(specs)]

    def refs(tag, op_name):
        per_rank = [inputs(r, tag) for r in range(SIZE)]
        return [reduce_ref(op_name, [to_np(p[i]) for p in per_rank], specs[i][1]) for i in range(len(specs))]

    for op_name in ("Sum", "Average", "Max"):
        tag = f"grouped.{op_name}"
        tensors = inputs(RANK, tag)
        out = hvd.grouped_allreduce(tensors, name=tag, op=OPS[op_name])
        assert isinstance(out, list) and len(out) == len(specs)
        for i, (o, ref) in enumerate(zip(out, refs(tag, op_name))):
            check(o, ref, f"{tag}[{i}]", specs[i][1])
        # unnamed
        out = hvd.grouped_allreduce(tensors, op=OPS[op_name])
        for i, (o, ref) in enumerate(zip(out, refs(tag, op_name))):
            check(o, ref, f"{tag}[{i}] unnamed", specs[i][1])
        # in place
        tensors = inputs(RANK, tag)
        ret = hvd.grouped_allreduce_(tensors, name=tag + ".inplace", op=OPS[op_name])
        for i, (t, r, ref) in enumerate(zip(tensors, ret, refs(tag, op_name))):
            assert r is t, "grouped_allreduce_ must return its tensors"
            check(t, ref, f"{tag}[{i}] in place", specs[i][1])
        # async
        tensors = inputs(RANK, tag)
        handle = hvd.grouped_allreduce_async(tensors, name=tag + ".async", op=OPS[op_name])
        for i, (o, ref) in enumerate(zip(hvd.synchronize(handle), refs(tag, op_name))):
            check(o, ref, f"{tag}[{i}] async", specs[i][1])
        handle = hvd.grouped_allreduce_async_(tensors, name=tag + ".async_", op=OPS[op_name])
        hvd.synchronize(handle)
        for i, (t, ref) in enumerate(zip(tensors, refs(tag, op_name))):
            check(t, ref, f"{tag}[{i}] async in place", specs[i][1])
    # scale factors and a non-contiguous member
    tag = "grouped.scale"
    tensors = [make_float(RANK, tag + ".a", (4, 2)).t(), make_float(RANK, tag + ".b", (3,))]
    out = hvd.grouped_allreduce(tensors, name=tag, op=hvd.Sum, prescale_factor=2.0, postscale_factor=0.25)
    check(out[0], 0.5 * np.sum([to_np(make_float(r, tag + ".a", (4, 2))).T for r in range(SIZE)], axis=0), tag)
    check(out[1], 0.5 * np.sum([to_np(make_float(r, tag + ".b", (3,))) for r in range(SIZE)], axis=0), tag)
    hvd.grouped_allreduce_(tensors, name=tag + ".inplace", op=hvd.Sum)
    check(tensors[0], np.sum([to_np(make_float(r, tag + ".a", (4, 2))).T for r in range(SIZE)], axis=0),
          tag + " in place, transposed")
    # 3,000 members: their requests and dispatch are control frames longer than one read of the socket
    # (control_channel.RECV_BYTES); twice, the second time as cache bits
    for step in range(2):
        tensors = [torch.full((2,), float(i * SIZE + RANK)) for i in range(3000)]
        out = hvd.grouped_allreduce(tensors, name="grouped.many_members", op=hvd.Sum)
        expected = [torch.full((2,), float(sum(i * SIZE + r for r in range(SIZE)))) for i in range(3000)]
        assert all(torch.equal(o, e) for o, e in zip(out, expected)), f"grouped.many_members step {step}"


def scenario_group_batches():
    """Each grouped call's tensors run in one batch (they reach the coordinator together), those the
    coordinator reduces too; with HOROVOD_DISABLE_GROUP_FUSION a group shares its batch with nothing else."""
    executor = basics.runtime().engine.executor
    batches = []
    original = executor.put

    def recording(batch, works):
        batches.append(tuple(entry.name for entry in batch.entries))
        return original(batch, works)

    def batches_holding(names: set) -> list:
        return [b for b in batches if names & set(b)]

    executor.put = recording
    try:
        for step in range(10):
            for label, members, length in (("transport", 64, 2048), ("coordinator", 64, 2)):
                name = f"group_batches.{label}.{step}"
                out = hvd.grouped_allreduce([torch.full((length,), float(RANK + i)) for i in range(members)],
                                            name=name, op=hvd.Sum)
                for i, o in enumerate(out):
                    check(o, np.full(length, sum(r + i for r in range(SIZE)), np.float32), f"{name}[{i}]")
                names = {f"{name}.{i}" for i in range(members)}
                holding = batches_holding(names)
                assert len(holding) == 1 and names <= set(holding[0]), \
                    f"the {members} tensors of {name} ran in {len(holding)} batches of {[len(b) for b in holding]}"
        # Groups and single tensors submitted back to back (how many become ready at once depends on
        # timing): each group runs whole, and with group fusion disabled in a batch of its own.
        disabled = Settings.from_env().disable_group_fusion
        batches.clear()
        handles = [hvd.grouped_allreduce_async([torch.ones(8) for _ in range(3)], name="separate.a"),
                   hvd.allreduce_async(torch.ones(8), name="separate.p"),
                   hvd.grouped_allreduce_async([torch.ones(8) for _ in range(2)], name="separate.b"),
                   hvd.allreduce_async(torch.ones(8), name="separate.q")]
        for handle in handles:
            hvd.synchronize(handle)
        for group, members in (("separate.a", 3), ("separate.b", 2)):
            names = {f"{group}.{i}" for i in range(members)}
            holding = [set(b) for b in batches_holding(names)]
            assert len(holding) == 1 and names <= holding[0] and (names == holding[0] or not disabled), \
                f"group fusion {'disabled' if disabled else 'enabled'}: {group} ran in {holding}"
    finally:
        del executor.put


def scenario_message_limits():
    """With the data one control message may carry lowered to 16 KiB (and frames to 40 KiB), a grouped
    allreduce of 64 KiB the coordinator reduces goes in several submissions and dispatches, in batches
    of at most 16 KiB, with the same results (Max: a Sum would be left to the replayed schedule)."""
    executor = basics.runtime().engine.executor
    carried = []
    original_put, original_limit = executor.put, small_allreduce.MESSAGE_DATA_BYTES
    original_frame = control_channel.MAX_FRAME

    def recording(batch, works):
        carried.append(len(batch.reduced or b""))
        return original_put(batch, works)

    executor.put, small_allreduce.MESSAGE_DATA_BYTES = recording, 16 * 1024
    control_channel.MAX_FRAME = 40 * 1024
    try:
        for step in range(2):  # the second time as cache bits
            out = hvd.grouped_allreduce([torch.full((256,), float(RANK + i)) for i in range(64)],
                                        name="message_limits", op=hvd.Max)
            for i, o in enumerate(out):
                check(o, np.full(256, SIZE - 1 + i, np.float32), f"message_limits[{i}]")
        assert len(carried) >= 8 and max(carried) <= 16 * 1024, f"batches carried {carried} bytes"
        hvd.barrier()  # every rank is past its last large message before any lifts the limits
    finally:
        del executor.put
        small_allreduce.MESSAGE_DATA_BYTES, control_channel.MAX_FRAME = original_limit, original_frame


# ------------------------------------------------------------------ allgather
def scenario_allgather():
    for dtype in ALL_DTYPES:
        tag = f"ag.ragged.{dtype_name(dtype)}"
        mine = make(RANK, tag, (RANK + 1, 2, 3), dtype)
        ref = np.concatenate([to_np(make(r, tag, (r + 1, 2, 3), dtype)) for r in range(SIZE)])
        check(hvd.allgather(mine, name=tag), ref, tag, dtype)
        # 1-d ragged
        tag1 = f"ag.ragged1d.{dtype_name(dtype)}"
        mine = make(RANK, tag1, (2 * RANK + 1,), dtype)
        ref = np.concatenate([to_np(make(r, tag1, (2 * r + 1,), dtype)) for r in range(SIZE)])
        check(hvd.synchronize(hvd.allgather_async(mine, name=tag1)), ref, tag1 + " async", dtype)
    # 0-d input: each rank contributes one element.
    for dtype in (torch.float32, torch.int64, torch.bool):
        tag = f"ag.scalar.{dtype_name(dtype)}"
        mine = make(RANK, tag, (), dtype)
        ref = np.stack([to_np(make(r, tag, (), dtype)) for r in range(SIZE)])
        check(hvd.allgather(mine, name=tag), ref, tag, dtype)
    # One rank contributes nothing.
    for dtype in (torch.float32, torch.int16):
        tag = f"ag.empty.{dtype_name(dtype)}"
        rows = lambda r: 0 if r == 0 else 2  # noqa: E731
        mine = make(RANK, tag, (rows(RANK), 4), dtype)
        ref = np.concatenate([to_np(make(r, tag, (rows(r), 4), dtype)) for r in range(SIZE)])
        check(hvd.allgather(mine, name=tag), ref, tag, dtype)
    # Everyone contributes nothing.
    out = hvd.allgather(torch.zeros((0, 3)), name="ag.allempty")
    check(out, np.zeros((0, 3)), "all ranks empty", torch.float32)
    # Unnamed, and a non-contiguous input.
    base = make(RANK, "ag.nc", (3, RANK + 2), torch.float32)
    ref = np.concatenate([to_np(make(r, "ag.nc", (3, r + 2), torch.float32)).T for r in range(SIZE)])
    check(hvd.allgather(base.t()), ref, "allgather of a transposed view (unnamed)")
    # grouped_allgather with mixed dtypes and ragged first dims.
    specs = [((1, 2), torch.float32), ((2,), torch.int32), ((0, 5), torch.float64), ((), torch.uint8)]

    def grouped_input(r, i):
        shape, dtype = specs[i]
        if len(shape):
            shape = (shape[0] + (r if i != 2 else 0),) + shape[1:]
        return make(r, f"gag.{i}", shape, dtype)

    for mode in ("sync", "async"):
        tensors = [grouped_input(RANK, i) for i in range(len(specs))]
        if mode == "sync":
            out = hvd.grouped_allgather(tensors, name="gag." + mode)
        else:
            out = hvd.synchronize(hvd.grouped_allgather_async(tensors, name="gag." + mode))
        assert len(out) == len(specs)
        for i, o in enumerate(out):
            parts = [to_np(grouped_input(r, i)) for r in range(SIZE)]
            ref = np.concatenate([p.reshape((1,)) if p.ndim == 0 else p for p in parts])
            check(o, ref, f"grouped_allgather[{i}] {mode}", specs[i][1])


# ------------------------------------------------------------------ broadcast
def scenario_broadcast():
    for root in range(SIZE):
        for dtype in (torch.float32, torch.float16, torch.bfloat16, torch.int8, torch.int64, torch.bool,
                      torch.uint8):
            for shape in ((), (0,), (3, 4)):
                tag = f"bc.{root}.{dtype_name(dtype)}.{shape}"
                mine = make(RANK, tag, shape, dtype)
                ref = to_np(make(root, tag, shape, dtype))
                before = mine.clone()
                check(hvd.broadcast(mine, root, name=tag), ref, tag, dtype)
                check(mine, before, tag + ": broadcast must not touch its input")
                out = hvd.broadcast_(mine, root_rank=root, name=tag + ".inplace")
                assert out is mine
                check(mine, ref, tag + " in place", dtype)
        tag = f"bc.async.{root}"
        mine = make_float(RANK, tag, (5,))
        ref = to_np(make_float(root, tag, (5,)))
        check(hvd.synchronize(hvd.broadcast_async(mine, root, name=tag)), ref, tag)
        hvd.synchronize(hvd.broadcast_async_(mine, root, name=tag + "_"))
        check(mine, ref, tag + " in place")
        # in place into a non-contiguous view
        base = make_float(RANK, tag + ".nc", (4, 3))
        hvd.broadcast_(base.t(), root, name=tag + ".nc")
        check(base, to_np(make_float(root, tag + ".nc", (4, 3))), tag + " non-contiguous in place")
        # unnamed
        check(hvd.broadcast(make_float(RANK, tag + ".u", (2,)), root), to_np(make_float(root, tag + ".u", (2,))),
              tag + " unnamed")

    # Objects of different sizes per rank.
    for root in range(SIZE):
        obj = {"rank": RANK, "payload": "x" * (100 * RANK + 3), "list": list(range(RANK * 50))}
        got = hvd.broadcast_object(obj, root_rank=root, name=f"bco.{root}")
        assert got == {"rank": root, "payload": "x" * (100 * root + 3), "list": list(range(root * 50))}, got
        text = hvd.broadcast_object("hello from %d " % RANK * (RANK + 1), root_rank=root)
        assert text == "hello from %d " % root * (root + 1), text
        # unnamed, with a placeholder of another type off the root: matched by call order
        value = hvd.broadcast_object(root * 10 if RANK == root else None, root_rank=root)
        assert value == root * 10, value
    objs = hvd.allgather_object({"r": RANK, "s": "y" * (RANK * 1000)})
    assert objs == [{"r": r, "s": "y" * (r * 1000)} for r in range(SIZE)], objs
    strs = hvd.allgather_object("z" * (7 * RANK), name="strings")
    assert strs == ["z" * (7 * r) for r in range(SIZE)], strs
    empty = hvd.allgather_object([] if RANK == 0 else [RANK], name="lists")
    assert empty == [[]] + [[r] for r in range(1, SIZE)], empty


# ------------------------------------------------------------------- alltoall
def a2a_splits(sender: int, receiver: int) -> int:
    return (sender + 2 * receiver) % 3  # includes zeros


def a2a_input(sender: int, tag: str, dtype) -> torch.Tensor:
    rows = [[100 * sender + 10 * j + k, -(100 * sender + 10 * j + k) % 50] for j in range(SIZE)
            for k in range(a2a_splits(sender, j))]
    rows = torch.tensor(rows, dtype=torch.float64, device=DEVICE).reshape(-1, 2)
    return rows.to(dtype) if dtype != torch.bool else rows.remainder(2).bool()


def a2a_expected(receiver: int, tag: str, dtype) -> np.ndarray:
    parts = []
    for j in range(SIZE):
        t = to_np(a2a_input(j, tag, dtype))
        offset = sum(a2a_splits(j, k) for k in range(receiver))
        parts.append(t[offset:offset + a2a_splits(j, receiver)])
    return np.concatenate(parts)


def scenario_alltoall():
    for dtype in (torch.float32, torch.int32, torch.int16, torch.float16, torch.uint8, torch.bool):
        tag = f"a2a.{dtype_name(dtype)}"
        mine = a2a_input(RANK, tag, dtype)
        splits = [a2a_splits(RANK, j) for j in range(SIZE)]
        out, received = hvd.alltoall(mine, splits=splits, name=tag)
        check(out, a2a_expected(RANK, tag, dtype), tag, dtype)
        check(received, np.array([a2a_splits(j, RANK) for j in range(SIZE)]), tag + " received splits")
        # splits as a tensor, async
        out, received = hvd.synchronize(hvd.alltoall_async(mine, splits=torch.tensor(splits, dtype=torch.int32),
                                                           name=tag + ".async"))
        check(out, a2a_expected(RANK, tag, dtype), tag + " async", dtype)
    # Everything to one rank; this rank sends nothing at all.
    tag = "a2a.skew"
    splits = [3 if j == 0 else 0 for j in range(SIZE)]
    mine = torch.full((3, 2), float(RANK))
    out, received = hvd.alltoall(mine, splits=splits, name=tag)
    if RANK == 0:
        check(out, np.concatenate([np.full((3, 2), float(r)) for r in range(SIZE)]), tag)
        check(received, np.full(SIZE, 3), tag + " received splits")
    else:
        check(out, np.zeros((0, 2)), tag)
        check(received, np.zeros(SIZE), tag + " received splits")
    # Default (even) splits, 1-d and 3-d.
    for shape in ((2 * SIZE,), (SIZE, 2, 2)):
        tag = f"a2a.even.{shape}"
        mine = make(RANK, tag, shape, torch.float64)
        rows = shape[0] // SIZE
        out = hvd.alltoall(mine, name=tag)  # without splits: the tensor alone, as in Horovod
        ref = np.concatenate([to_np(make(j, tag, shape, torch.float64))[RANK * rows:(RANK + 1) * rows]
                              for j in range(SIZE)])
        check(out, ref, tag)
        out, received = hvd.synchronize(hvd.alltoall_async(mine, name=tag + ".async"))  # async: always the pair
        check(out, ref, tag + " async")
        check(received, np.full(SIZE, rows), tag + " received splits")
    # unnamed
    out = hvd.alltoall(torch.arange(SIZE, dtype=torch.int64) + 10 * RANK)
    check(out, np.array([10 * j + RANK for j in range(SIZE)]), "alltoall unnamed")


# -------------------------------------------------------------- reducescatter
def rs_counts(first: int):
    return [first // SIZE + (1 if r < first % SIZE else 0) for r in range(SIZE)]


def scenario_reducescatter():
    firsts = (2 * SIZE, 2 * SIZE + 1, SIZE + SIZE - 1, 1)
    for first in firsts:
        counts = rs_counts(first)
        start = sum(counts[:RANK])
        for op_name in ("Sum", "Average", "Max", "Min"):
            for dtype in (torch.float32, torch.float64, torch.int32):
                tag = f"rs.{first}.{op_name}.{dtype_name(dtype)}"
                mine = ar_input(RANK, tag, (first, 3), dtype, op_name)
                full = reduce_ref(op_name, all_inputs(tag, (first, 3), dtype, op_name), dtype)
                ref = full[start:start + counts[RANK]]
                check(hvd.reducescatter(mine, name=tag, op=OPS[op_name]), ref, tag, dtype)
        tag = f"rs.default.{first}"
        mine = make_float(RANK, tag, (first, 2))
        full = np.mean([to_np(make_float(r, tag, (first, 2))) for r in range(SIZE)], axis=0)
        check(hvd.reducescatter(mine, name=tag), full[start:start + counts[RANK]], tag + " (default Average)")
        check(hvd.synchronize(hvd.reducescatter_async(mine, name=tag + ".async")),
              full[start:start + counts[RANK]], tag + " async")
        check(hvd.reducescatter(mine), full[start:start + counts[RANK]], tag + " unnamed")
    # pre/postscale
    first = 2 * SIZE + 1
    counts = rs_counts(first)
    start = sum(counts[:RANK])
    for op_name, pre, post in (("Sum", 2.0, 0.5), ("Average", 4.0, 3.0), ("Sum", 1.0, 0.125)):
        tag = f"rs.scale.{op_name}.{pre}.{post}"
        mine = make_float(RANK, tag, (first, 3))
        full = reduce_ref(op_name, [to_np(make_float(r, tag, (first, 3))) for r in range(SIZE)], torch.float64,
                          pre, post)
        check(hvd.reducescatter(mine, name=tag, op=OPS[op_name], prescale_factor=pre, postscale_factor=post),
              full[start:start + counts[RANK]], tag)
    # A 3-d tensor.
    tag = "rs.3d"
    mine = make_float(RANK, tag, (SIZE + 1, 2, 2))
    counts = rs_counts(SIZE + 1)
    start = sum(counts[:RANK])
    full = np.sum([to_np(make_float(r, tag, (SIZE + 1, 2, 2))) for r in range(SIZE)], axis=0)
    check(hvd.reducescatter(mine, name=tag, op=hvd.Sum), full[start:start + counts[RANK]], tag)
    # grouped
    firsts = (SIZE, 2 * SIZE + 1, 1)
    for op_name in ("Sum", "Average"):
        tag = f"grs.{op_name}"
        tensors = [make_float(RANK, f"{tag}.{i}", (f, 2)) for i, f in enumerate(firsts)]
        outs = hvd.grouped_reducescatter(tensors, name=tag, op=OPS[op_name])
        outs_async = hvd.synchronize(hvd.grouped_reducescatter_async(tensors, name=tag + ".async",
                                                                     op=OPS[op_name]))
        for i, f in enumerate(firsts):
            counts = rs_counts(f)
            start = sum(counts[:RANK])
            full = reduce_ref(op_name, [to_np(make_float(r, f"{tag}.{i}", (f, 2))) for r in range(SIZE)],
                              torch.float64)
            check(outs[i], full[start:start + counts[RANK]], f"{tag}[{i}]")
            check(outs_async[i], full[start:start + counts[RANK]], f"{tag}[{i}] async")


# ---------------------------------------------------------------- barrier, join
def scenario_barrier():
    import time
    for i in range(3):
        if RANK == i % SIZE:
            time.sleep(0.1)  # late: the others wait for it
        hvd.barrier()
    # barrier after the ranks submitted a different number of unnamed collectives would need
    # per-rank counters to agree; that is covered in test_process_sets. Here: barrier orders work.
    stamp = torch.tensor([time.time()], dtype=torch.float64)
    if RANK == 0:
        time.sleep(0.2)
        stamp = torch.tensor([time.time()], dtype=torch.float64)
    hvd.barrier()
    after = time.time()
    latest = hvd.allreduce(stamp, name="barrier.stamps", op=hvd.Max).item()
    assert after >= latest, "a rank left barrier() before rank 0 entered it"


def scenario_join():
    last = SIZE - 1
    steps = 3
    x = make_float(RANK, "join.warm", (4,))
    check(hvd.allreduce(x, name="join.warm", op=hvd.Sum),
          np.sum([to_np(make_float(r, "join.warm", (4,))) for r in range(SIZE)], axis=0), "before join")
    live = range(SIZE - 1)
    if RANK == last:
        result = hvd.join()
    else:
        for step in range(steps):
            tag = f"join.{step}"
            x = make_float(RANK, tag, (4, 2))
            total = np.sum([to_np(make_float(r, tag, (4, 2))) for r in live], axis=0)
            check(hvd.allreduce(x, name=tag + ".sum", op=hvd.Sum), total, tag + " Sum (rank %d joined)" % last)
            # roundel, like Horovod, counts a joined rank in the divisor: it contributes zeros.
            check(hvd.allreduce(x, name=tag + ".avg", op=hvd.Average), total / SIZE, tag + " Average")
            xi = make(RANK, tag + ".int", (3,), torch.int32)
            check(hvd.allreduce(xi, name=tag + ".int", op=hvd.Sum),
                  np.sum([to_np(make(r, tag + ".int", (3,), torch.int32)) for r in live], axis=0), tag + " int Sum")
        # grouped and async under join
        handles = [hvd.allreduce_async(make_float(RANK, f"join.async.{i}", (3,)), name=f"join.async.{i}",
                                       op=hvd.Sum) for i in range(4)]
        for i, h in enumerate(handles):
            check(hvd.synchronize(h), np.sum([to_np(make_float(r, f"join.async.{i}", (3,))) for r in live], axis=0),
                  f"join async {i}")
        # allgather and broadcast raise while a rank has joined, as in Horovod
        tag = "join.gather"
        expect_raises(RuntimeError, lambda: hvd.allgather(make_float(RANK, tag, (RANK + 1, 2)), name=tag),
                      "join()", what="allgather while a rank has joined")
        tag = "join.bcast"
        expect_raises(RuntimeError, lambda: hvd.broadcast(make_float(RANK, tag, (3,)), 0, name=tag),
                      "join()", what="broadcast while a rank has joined")
        # broadcast from the joined rank fails clearly
        expect_raises(ValueError, lambda: hvd.broadcast(torch.zeros(3), last, name="join.bcast.joined"),
                      "join", what="broadcast from a joined root")
        result = hvd.join()
    assert isinstance(result, int), f"join() returned {result!r}"
    assert result in live, f"join() returned {result}; the last rank to join must be one of {list(live)}"
    results = hvd.allgather(torch.tensor([result]), name="join.results")
    assert len(set(results.tolist())) == 1, f"join() returned different ranks: {results.tolist()}"
    # everyone joins at once: still consistent, and collectives work afterwards
    again = hvd.join()
    agains = hvd.allgather(torch.tensor([again]), name="join.results2")
    assert len(set(agains.tolist())) == 1 and 0 <= again < SIZE, agains.tolist()
    check(hvd.allreduce(torch.ones(2), name="join.after", op=hvd.Sum), np.full(2, float(SIZE)), "after join")


# ----------------------------------------------------------- ordering and async
def scenario_ordering():
    n = 10
    names = [f"ooo.{i}" for i in range(n)]
    order = list(range(n))
    if RANK % 2 == 1:
        order.reverse()
    elif RANK > 0:
        rng(RANK, "order").shuffle(order)
    handles = {}
    for i in order:
        handles[i] = hvd.allreduce_async(make_float(RANK, names[i], (i + 1,), torch.float32), name=names[i],
                                         op=hvd.Sum)
    for i in range(n):
        ref = np.sum([to_np(make_float(r, names[i], (i + 1,), torch.float32)) for r in range(SIZE)], axis=0)
        check(hvd.synchronize(handles[i]), ref, names[i])

    # Mixed kinds, out of order.
    def submit(kind):
        tag = f"mixed.{kind}"
        if kind == "allreduce":
            return hvd.allreduce_async(make_float(RANK, tag, (3,)), name=tag, op=hvd.Sum)
        if kind == "allgather":
            return hvd.allgather_async(make_float(RANK, tag, (RANK + 1,)), name=tag)
        if kind == "broadcast":
            return hvd.broadcast_async(make_float(RANK, tag, (3,)), SIZE - 1, name=tag)
        if kind == "alltoall":
            return hvd.alltoall_async(make_float(RANK, tag, (SIZE,)), name=tag)
        return hvd.reducescatter_async(make_float(RANK, tag, (SIZE,)), name=tag, op=hvd.Sum)

    kinds = ["allreduce", "allgather", "broadcast", "alltoall", "reducescatter"]
    order = kinds[::-1] if RANK % 2 else kinds
    handles = {k: submit(k) for k in order}
    ins = {k: [to_np(make_float(r, f"mixed.{k}", (r + 1,) if k == "allgather" else (3,) if k in (
        "allreduce", "broadcast") else (SIZE,))) for r in range(SIZE)] for k in kinds}
    check(hvd.synchronize(handles["allreduce"]), np.sum(ins["allreduce"], axis=0), "mixed allreduce")
    check(hvd.synchronize(handles["allgather"]), np.concatenate(ins["allgather"]), "mixed allgather")
    check(hvd.synchronize(handles["broadcast"]), ins["broadcast"][SIZE - 1], "mixed broadcast")
    out, _ = hvd.synchronize(handles["alltoall"])
    check(out, np.array([ins["alltoall"][j][RANK] for j in range(SIZE)]), "mixed alltoall")
    check(hvd.synchronize(handles["reducescatter"]), np.sum(ins["reducescatter"], axis=0)[RANK:RANK + 1],
          "mixed reducescatter")

    # Many handles in flight, synchronized in a different random order on each rank.
    count = 50
    dtypes = (torch.float32, torch.float64, torch.int32, torch.int64, torch.float16)
    handles = []
    for i in range(count):
        dtype = dtypes[i % len(dtypes)]
        tag = f"many.{i}"
        handles.append((i, hvd.allreduce_async(make(RANK, tag, (i % 7 + 1, 3), dtype), name=tag, op=hvd.Sum)))
    order = list(range(count))
    rng(RANK, "many.order").shuffle(order)
    for i in order:
        dtype = dtypes[i % len(dtypes)]
        tag = f"many.{i}"
        ref = reduce_ref("Sum", [to_np(make(r, tag, (i % 7 + 1, 3), dtype)) for r in range(SIZE)], dtype)
        check(hvd.synchronize(handles[i][1]), ref, tag, dtype)
    # Many unnamed handles in flight, polled to completion.
    unnamed = [hvd.allreduce_async(torch.full((2,), float(RANK + i)), op=hvd.Sum) for i in range(20)]
    import time
    deadline = time.monotonic() + 60
    while not all(hvd.poll(h) for h in unnamed):
        assert time.monotonic() < deadline, "unnamed handles never completed"
        time.sleep(0.002)
    for i, h in enumerate(unnamed):
        check(hvd.synchronize(h), np.full(2, float(sum(r + i for r in range(SIZE)))), f"unnamed {i}")


# ------------------------------------------------- steady state: cache and fusion
def scenario_steady():
    """20 steps over 6 names; with a tiny cache capacity, entries are evicted while names repeat."""
    specs = [("w1", (4, 3), torch.float32, "Sum"), ("w2", (7,), torch.float64, "Average"),
             ("b1", (3,), torch.int32, "Max"), ("b2", (), torch.float32, "Sum"),
             ("emb", (5, 2), torch.float16, "Sum"), ("flag", (4,), torch.bool, "Sum")]
    for step in range(20):
        order = list(range(len(specs)))
        rng(RANK, f"steady.order.{step}").shuffle(order)
        handles = {}
        for i in order:
            name, shape, dtype, op_name = specs[i]
            if name == "w1" and step >= 10:
                shape = (2, 3)  # the same name with a new shape: the cached entry must be replaced
            tag = f"steady.{name}.{step}"
            handles[i] = (hvd.allreduce_async(ar_input(RANK, tag, shape, dtype, op_name), name=f"steady.{name}",
                                              op=OPS[op_name]), tag, shape, dtype, op_name)
        # plus one synchronous collective of each other kind under a repeating name
        g = hvd.allgather(make_float(RANK, f"steady.g.{step}", (RANK + 1,)), name="steady.gather")
        check(g, np.concatenate([to_np(make_float(r, f"steady.g.{step}", (r + 1,))) for r in range(SIZE)]),
              f"steady gather step {step}")
        root = step % SIZE
        b = hvd.broadcast(make_float(RANK, f"steady.b.{step}", (3,)), root, name="steady.bcast")
        check(b, to_np(make_float(root, f"steady.b.{step}", (3,))), f"steady bcast step {step}")
        for i in range(len(specs)):
            handle, tag, shape, dtype, op_name = handles[i]
            check(hvd.synchronize(handle), reduce_ref(op_name, all_inputs(tag, shape, dtype, op_name), dtype),
                  f"{tag} (step {step})", dtype)


# --------------------------------------------------------------------- autograd
def scenario_autograd():
    def w(rank, tag, shape):
        return make_float(rank, "w." + tag, shape)

    # allreduce Sum and Average: loss_k = sum(allreduce(x) * w_k); d(sum_k loss_k)/dx_r
    for op_name in ("Sum", "Average"):
        tag = f"grad.ar.{op_name}"
        x = make_float(RANK, tag, (3, 2)).requires_grad_()
        y = hvd.allreduce(x, name=tag, op=OPS[op_name])
        (y * w(RANK, tag, (3, 2))).sum().backward()
        ws = [to_np(w(r, tag, (3, 2))) for r in range(SIZE)]
        check(x.grad, np.sum(ws, axis=0) / (SIZE if op_name == "Average" else 1), tag)
    # scaled allreduce
    tag = "grad.ar.scaled"
    x = make_float(RANK, tag, (3,)).requires_grad_()
    y = hvd.allreduce(x, name=tag, op=hvd.Sum, prescale_factor=2.0, postscale_factor=0.5)
    (y * w(RANK, tag, (3,))).sum().backward()
    check(x.grad, np.sum([to_np(w(r, tag, (3,))) for r in range(SIZE)], axis=0), tag)
    # grouped allreduce
    tag = "grad.gar"
    xs = [make_float(RANK, tag + ".a", (2,)).requires_grad_(), make_float(RANK, tag + ".b", (3,)).requires_grad_()]
    ys = hvd.grouped_allreduce(xs, name=tag, op=hvd.Average)
    ((ys[0] * w(RANK, tag + ".a", (2,))).sum() + (ys[1] * w(RANK, tag + ".b", (3,))).sum()).backward()
    check(xs[0].grad, np.mean([to_np(w(r, tag + ".a", (2,))) for r in range(SIZE)], axis=0), tag + "[0]")
    check(xs[1].grad, np.mean([to_np(w(r, tag + ".b", (3,))) for r in range(SIZE)], axis=0), tag + "[1]")
    # allgather
    tag = "grad.ag"
    total = sum(r + 1 for r in range(SIZE))
    x = make_float(RANK, tag, (RANK + 1, 2)).requires_grad_()
    y = hvd.allgather(x, name=tag)
    (y * w(RANK, tag, (total, 2))).sum().backward()
    offset = sum(r + 1 for r in range(RANK))
    # Horovod's definition: the average of every rank's output gradient, this rank's rows
    check(x.grad, np.mean([to_np(w(r, tag, (total, 2))) for r in range(SIZE)], axis=0)[offset:offset + RANK + 1], tag)
    # broadcast
    root = SIZE - 1
    tag = "grad.bc"
    x = make_float(RANK, tag, (4,)).requires_grad_()
    y = hvd.broadcast(x, root, name=tag)
    (y * w(RANK, tag, (4,))).sum().backward()
    # Horovod's definition: the root gets the average of every rank's output gradient, the others zeros
    expected = np.mean([to_np(w(r, tag, (4,))) for r in range(SIZE)], axis=0) if RANK == root else np.zeros(4)
    check(x.grad, expected, tag)
    # alltoall with uneven splits
    tag = "grad.a2a"
    splits = [a2a_splits(RANK, j) for j in range(SIZE)]
    x = a2a_input(RANK, tag, torch.float64).requires_grad_()
    y, received = hvd.alltoall(x, splits=splits, name=tag)
    recv_total = sum(a2a_splits(j, RANK) for j in range(SIZE))
    (y * w(RANK, tag, (recv_total, 2))).sum().backward()
    # rows this rank sent to j are at offset sum(splits[:j]); j received them at offset sum(splits_j_from[:RANK])
    expected = []
    for j in range(SIZE):
        recv_offset = sum(a2a_splits(k, j) for k in range(RANK))
        wj = to_np(w(j, tag, (sum(a2a_splits(k, j) for k in range(SIZE)), 2)))
        expected.append(wj[recv_offset:recv_offset + a2a_splits(RANK, j)])
    check(x.grad, np.concatenate(expected), tag)
    # reducescatter Sum and Average (with scale factors)
    for op_name, pre, post in (("Sum", 1.0, 1.0), ("Average", 1.0, 1.0), ("Sum", 2.0, 0.25)):
        tag = f"grad.rs.{op_name}.{pre}.{post}"
        first = 2 * SIZE + 1
        counts = rs_counts(first)
        x = make_float(RANK, tag, (first, 2)).requires_grad_()
        y = hvd.reducescatter(x, name=tag, op=OPS[op_name], prescale_factor=pre, postscale_factor=post)
        assert y.shape == (counts[RANK], 2)
        (y * w(RANK, tag, (counts[RANK], 2))).sum().backward()
        scale = pre * post * (SIZE if op_name == "Sum" else 1)  # Horovod's definition
        expected = np.concatenate([to_np(w(k, tag, (counts[k], 2))) for k in range(SIZE)]) * scale
        check(x.grad, expected, tag)


def scenario_inference_mode():
    """Collectives on inference tensors (made under torch.inference_mode(), as a validation loop makes them), from
    inside and outside that mode, small and large, out of place and in place: the right results, and an
    out-of-place result the caller can use outside the mode."""
    for count in (3, 300_000):  # replayed or sent to rank 0 alike; and a large one
        with torch.inference_mode():
            mine = torch.full((count,), float(RANK + 1))
        for step in range(3):  # the later ones replayed
            with torch.inference_mode():
                inside = hvd.allreduce(mine, name=f"inference.{count}", op=hvd.Sum)
            outside = hvd.allreduce(mine, name=f"inference.{count}", op=hvd.Sum)
            total = float(sum(r + 1 for r in range(SIZE)))
            assert torch.equal(inside, torch.full((count,), total)) and torch.equal(outside, inside), (count, step)
            outside.add_(1)  # a normal tensor: writable outside the mode
        with torch.inference_mode():
            target = torch.full((count,), float(RANK + 1))
            hvd.allreduce_(target, name=f"inference.in_place.{count}", op=hvd.Sum)
        hvd.broadcast_(target, root_rank=0, name=f"inference.broadcast.{count}")  # in place, outside the mode
        assert target.is_inference() and torch.equal(target, torch.full((count,), total)), (count, target)


SCENARIOS = {
    "inference_mode": scenario_inference_mode,
    "allreduce": scenario_allreduce,
    "allreduce_sizes": scenario_allreduce_sizes,
    "coordinator_reduce": scenario_coordinator_reduce,
    "grouped": scenario_grouped,
    "group_batches": scenario_group_batches,
    "message_limits": scenario_message_limits,
    "allgather": scenario_allgather,
    "broadcast": scenario_broadcast,
    "alltoall": scenario_alltoall,
    "reducescatter": scenario_reducescatter,
    "barrier": scenario_barrier,
    "join": scenario_join,
    "ordering": scenario_ordering,
    "steady": scenario_steady,
    "autograd": scenario_autograd,
}

if __name__ == "__main__":
    run_scenarios(SCENARIOS, sys.argv, RANK)
    hvd.shutdown()
