"""CUDA tensor worker: ``torch_cuda.py SCENARIO[,SCENARIO...]`` under roundelrun, on a machine with a GPU.

Each rank uses GPU ``local_rank`` modulo the GPUs there are, as a Horovod
script does with ``torch.cuda.set_device(hvd.local_rank())``, except in
``shared_gpu``, where every rank uses GPU 0. In ``killed_in_nccl`` the rank
``ROUNDEL_TEST_VICTIM`` (default 1) kills itself.
"""

from __future__ import annotations

import os
import signal
import sys
import time

import numpy as np
import torch

import roundel.torch as hvd
from _checks import check, expect_raises, make, make_float, run_scenarios, to_np

hvd.init()
RANK, SIZE = hvd.rank(), hvd.size()


def _own_gpu() -> torch.device:
    torch.cuda.set_device(hvd.local_rank() % torch.cuda.device_count())
    return torch.device("cuda", torch.cuda.current_device())


def scenario_devices():
    """Every collective's result is on the GPU of its input, with the right values, sync and async."""
    gpu = _own_gpu()
    x = make(RANK, "dev.ar", (5, 3), torch.float32).to(gpu)
    out = hvd.allreduce(x, name="dev.ar", op=hvd.Sum)
    assert out.device == gpu, out.device
    check(out, sum(to_np(make(r, "dev.ar", (5, 3), torch.float32)) for r in range(SIZE)), "allreduce")
    handles = [hvd.allreduce_async(make_float(RANK, f"dev.as{i}", (1000 * (i + 1),)).to(gpu), name=f"dev.as{i}",
                                   op=hvd.Average) for i in range(4)]
    for i, handle in enumerate(handles):
        out = hvd.synchronize(handle)
        assert out.device == gpu
        check(out, np.mean([to_np(make_float(r, f"dev.as{i}", (1000 * (i + 1),))) for r in range(SIZE)], axis=0),
              f"allreduce_async {i}")
    big = torch.full((3 << 20,), float(RANK + 1), device=gpu)  # 12 MiB: the large-allreduce path
    check(hvd.allreduce(big, name="dev.big", op=hvd.Sum)[:4], np.full(4, SIZE * (SIZE + 1) / 2), "large allreduce")
    rows = torch.full((RANK + 1, 2), float(RANK), device=gpu)
    gathered = hvd.allgather(rows, name="dev.ag")
    assert gathered.device == gpu
    check(gathered, np.concatenate([np.full((r + 1, 2), float(r)) for r in range(SIZE)]).astype(np.float32),
          "allgather")
    value = torch.arange(4, device=gpu, dtype=torch.int64) * (RANK + 1)
    check(hvd.broadcast(value, 0, name="dev.bc"), np.arange(4), "broadcast")
    out, received = hvd.alltoall(torch.arange(2 * SIZE, device=gpu, dtype=torch.int32) + 100 * RANK,
                                 splits=torch.full((SIZE,), 2, dtype=torch.int32), name="dev.a2a")
    assert out.device == gpu
    check(out, np.concatenate([np.arange(2 * RANK, 2 * RANK + 2) + 100 * j for j in range(SIZE)]), "alltoall")
    check(received, np.full(SIZE, 2), "alltoall received splits")
    scattered = hvd.reducescatter(torch.ones((2 * SIZE, 3), device=gpu), name="dev.rs", op=hvd.Sum)
    assert scattered.device == gpu
    check(scattered, np.full((2, 3), float(SIZE), dtype=np.float32), "reducescatter")
    grouped = hvd.grouped_allreduce([torch.ones(3, device=gpu), torch.ones(2, dtype=torch.int16, device=gpu)],
                                    name="dev.grouped", op=hvd.Sum)
    check(grouped[0], np.full(3, float(SIZE), dtype=np.float32), "grouped float32")
    check(grouped[1], np.full(2, SIZE, dtype=np.int16), "grouped int16 (widened on the wire)")
    # a CPU tensor on one rank and a CUDA tensor on another: refused on every rank, and the job goes on
    mixed = torch.ones(2) if RANK == 0 else torch.ones(2, device=gpu)
    if SIZE > 1:
        expect_raises(hvd.CollectiveMismatchError, lambda: hvd.allreduce(mixed, name="dev.mixed"), "devices",
                      what="CPU on rank 0, CUDA elsewhere")
    check(hvd.allreduce(torch.ones(2, device=gpu), name="dev.after", op=hvd.Sum), np.full(2, float(SIZE)),
          "allreduce after the refused one")


def scenario_side_stream():
    """A tensor written on a side stream, still being written when submitted, is reduced as written."""
    gpu = _own_gpu()
    side = torch.cuda.Stream(gpu)
    x = torch.zeros(1 << 16, device=gpu)
    torch.cuda.current_stream(gpu).synchronize()
    with torch.cuda.stream(side):
        torch.cuda._sleep(200_000_000)  # about 0.1 s of GPU time before the tensor gets its values
        x.fill_(float(RANK + 1))
        handle = hvd.allreduce_async(x, name="side.ar", op=hvd.Sum)
    check(hvd.synchronize(handle)[:8], np.full(8, SIZE * (SIZE + 1) / 2, dtype=np.float32), "side-stream input")


def scenario_slow_gpu_cpu():
    """A collective behind a second of GPU work returns at once (no thread waits for the GPU), its result is
    ordered after that work on the caller's stream, and waiting for it sleeps: the process's CPU time stays far
    below the wait."""
    gpu = _own_gpu()
    x = torch.ones(1 << 10, device=gpu)
    hvd.allreduce(x, name="slow.warm")  # NCCL's communicator and the executor's first batch
    torch.cuda.synchronize(gpu)
    cpu, wall = time.process_time(), time.monotonic()
    torch.cuda._sleep(2_000_000_000)  # about a second of GPU time queued ahead of the collective's input
    out = hvd.allreduce(x, name="slow.ar", op=hvd.Sum)
    returned = time.monotonic() - wall
    finished = torch.cuda.Event(blocking=True)
    finished.record()
    assert not finished.query(), "the GPU's sleep had ended when allreduce returned: the call waited for it"
    finished.synchronize()
    cpu, wall = time.process_time() - cpu, time.monotonic() - wall
    check(out[:4], np.full(4, float(SIZE), dtype=np.float32), "allreduce after a slow kernel")
    assert wall > 0.3, f"the GPU's sleep took only {wall:.2f} s: too short to tell waiting from spinning"
    assert returned < 0.5 * wall, f"allreduce took {returned:.2f} s of a {wall:.2f} s sleep: it waited for the GPU"
    assert cpu < 0.5 * wall, f"{cpu:.2f} s of CPU while waiting {wall:.2f} s for the GPU: something spins"


def scenario_other_stream_reads():
    """A handle synchronized on another stream gives that stream the whole result, without waiting for work
    queued on the submitting stream after the collective's inputs."""
    gpu = _own_gpu()
    reader = torch.cuda.Stream(gpu)
    hvd.allreduce(torch.ones(4, device=gpu), name="reader.warm")
    for i in range(3):
        x = torch.full((1 << 20,), float(RANK + i), device=gpu)
        handle = hvd.allreduce_async(x, name=f"reader.ar{i}", op=hvd.Sum)
        torch.cuda._sleep(2_000_000_000)  # about a second of later work on the submitting stream
        later = torch.cuda.Event()
        later.record()
        start = time.monotonic()
        with torch.cuda.stream(reader):
            total = float(hvd.synchronize(handle).sum())
        took = time.monotonic() - start
        expected = (1 << 20) * sum(r + i for r in range(SIZE))
        assert total == expected, f"read on another stream: {total} != {expected}"
        assert not later.query(), f"the result was read only after the later work ({took:.2f} s): it waited for it"
        torch.cuda.synchronize(gpu)


def scenario_allocator():
    """An input dropped by the caller right after submission, its memory wanted at once by new tensors, is
    still reduced as it was: roundel holds it until the GPU has finished with it."""
    gpu = _own_gpu()
    hvd.allreduce(torch.ones(4, device=gpu), name="alloc.warm")
    for i in range(4):
        torch.cuda._sleep(200_000_000)  # the input is written only after this
        x = torch.full((1 << 20,), float(RANK + 1 + i), device=gpu)
        handle = hvd.allreduce_async(x, name=f"alloc.ar{i}", op=hvd.Sum)
        del x
        junk = [torch.full((1 << 20,), -1.0, device=gpu) for _ in range(4)]  # would take x's memory if freed
        out = hvd.synchronize(handle)
        check(out[-8:], np.full(8, float(sum(r + 1 + i for r in range(SIZE))), dtype=np.float32),
              f"allreduce {i} of a dropped input")
        del junk


def scenario_staged_reuse():
    """Through host memory, back to back and without synchronizing: sizes that grow and shrink and several
    dtypes reuse the pinned host buffers without mixing their values."""
    gpu = _own_gpu()
    started = []
    for i, (length, dtype) in enumerate([(10, torch.float32), (1 << 18, torch.float32), (7, torch.float32),
                                         (1 << 16, torch.int64), (1 << 18, torch.float64), (3, torch.int64)]):
        summed = hvd.allreduce_async(torch.full((length,), RANK + i, dtype=dtype, device=gpu),
                                     name=f"staged.ar{i}", op=hvd.Sum)
        expected_sum = np.full(length, sum(r + i for r in range(SIZE)))
        rows = length % 5 + 1
        gathered = hvd.allgather_async(torch.full((rows, 2), RANK - i, dtype=dtype, device=gpu),
                                       name=f"staged.ag{i}")
        expected_rows = np.concatenate([np.full((rows, 2), r - i) for r in range(SIZE)])
        started += [(summed, expected_sum, dtype, f"allreduce {i}"), (gathered, expected_rows, dtype, f"allgather {i}")]
    for handle, expected, dtype, what in started:
        check(hvd.synchronize(handle), expected, f"staged {what}", dtype)


def scenario_join_device():
    """A rank that joins before any CUDA collective contributes its zeros on its own GPU, not on GPU 0."""
    gpu = _own_gpu()
    if RANK == SIZE - 1:
        hvd.join()
    else:
        out = hvd.allreduce(torch.full((5,), float(RANK + 1), device=gpu), name="join.ar", op=hvd.Sum)
        check(out, np.full(5, float(sum(range(1, SIZE))), dtype=np.float32), "allreduce beside a joined rank")
        hvd.join()


def _model(gpu) -> torch.nn.Module:
    torch.manual_seed(7)
    return torch.nn.Sequential(torch.nn.Linear(6, 16), torch.nn.Tanh(), torch.nn.Linear(16, 3)).double().to(gpu)


def _batch(rank: int, gpu):
    inputs = make_float(rank, "train.x", (8, 6)).to(gpu)
    targets = make_float(rank, "train.y", (8, 3)).to(gpu)
    return inputs, targets


def scenario_training():
    """DistributedOptimizer on a CUDA model gives the parameters of one process training on every batch."""
    gpu = _own_gpu()
    model = _model(gpu)
    optimizer = hvd.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1),
                                         named_parameters=model.named_parameters())
    hvd.broadcast_parameters(model.state_dict(), root_rank=0)
    reference = _model(gpu)
    reference_optimizer = torch.optim.SGD(reference.parameters(), lr=0.1)
    everyone = [_batch(r, gpu) for r in range(SIZE)]
    for _ in range(3):
        optimizer.zero_grad()
        inputs, targets = everyone[RANK]
        torch.nn.functional.mse_loss(model(inputs), targets).backward()
        optimizer.step()
        reference_optimizer.zero_grad()
        loss = sum(torch.nn.functional.mse_loss(reference(x), y) for x, y in everyone) / SIZE
        loss.backward()
        reference_optimizer.step()
    for (name, mine), expected in zip(model.named_parameters(), reference.parameters()):
        assert mine.device == gpu
        check(mine, to_np(expected), f"parameter {name} after 3 steps")


def scenario_graphed():
    """A model captured as a CUDA graph (``torch.cuda.make_graphed_callables``), its gradients reduced by
    DistributedOptimizer outside the graph, gives the parameters of one process training on every batch."""
    gpu = _own_gpu()
    model = _model(gpu)
    optimizer = hvd.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1),
                                         named_parameters=model.named_parameters())
    hvd.broadcast_parameters(model.state_dict(), root_rank=0)
    everyone = [_batch(r, gpu) for r in range(SIZE)]
    graphed = torch.cuda.make_graphed_callables(model, (everyone[RANK][0].clone(),))
    reference = _model(gpu)
    reference_optimizer = torch.optim.SGD(reference.parameters(), lr=0.1)
    for _ in range(3):
        optimizer.zero_grad()
        inputs, targets = everyone[RANK]
        torch.nn.functional.mse_loss(graphed(inputs), targets).backward()
        optimizer.step()
        reference_optimizer.zero_grad()
        (sum(torch.nn.functional.mse_loss(reference(x), y) for x, y in everyone) / SIZE).backward()
        reference_optimizer.step()
    for (name, mine), expected in zip(model.named_parameters(), reference.parameters()):
        check(mine, to_np(expected), f"graphed model's {name} after 3 steps")


def scenario_graph_capture():
    """A collective submitted while this thread's stream captures a CUDA graph is refused, saying what to capture
    instead; nothing was submitted (the same name works at once outside the capture), and the capture goes on."""
    gpu = _own_gpu()
    x = torch.ones(4, device=gpu)
    hvd.allreduce(x, name="capture.warm")
    graph = torch.cuda.CUDAGraph()
    # thread_local: roundel's finalizer may still wait on the warm-up's event from its own thread, which a global
    # capture would forbid; this capture is about what the capturing thread submits
    with torch.cuda.graph(graph, capture_error_mode="thread_local"):
        doubled = x * 2
        expect_raises(RuntimeError, lambda: hvd.allreduce(doubled, name="capture.ar", op=hvd.Sum),
                      "capturing a CUDA graph", "not supported", "torch.cuda.make_graphed_callables",
                      what="allreduce inside torch.cuda.graph")
        doubled.add_(1)
    graph.replay()
    check(hvd.allreduce(doubled, name="capture.ar", op=hvd.Sum), np.full(4, 3.0 * SIZE, dtype=np.float32),
          "the same allreduce after the capture")


def _survive_sigterm():
    """roundelrun stops the other ranks once one dies; a survivor must first finish its checks."""
    signal.signal(signal.SIGTERM, lambda *_: print("got SIGTERM from roundelrun", file=sys.stderr, flush=True))


def scenario_killed_in_nccl():
    """The victim rank is SIGKILLed while the others' NCCL kernels wait for its part of an allreduce: each survivor
    gets HorovodInternalError naming it, for a CPU collective and for the CUDA one the death cut short, and its GPU
    is not left waiting (the communicators were aborted); MEASURED is the time from submission to all that."""
    victim = int(os.environ.get("ROUNDEL_TEST_VICTIM", "1"))
    gpu = _own_gpu()
    check(hvd.allreduce(torch.ones(4, device=gpu), name="cut.warm", op=hvd.Sum),
          np.full(4, float(SIZE), dtype=np.float32), "warm-up (NCCL's communicator made)")
    torch.cuda.synchronize(gpu)
    x = torch.ones(1 << 20, device=gpu)
    if RANK == victim:
        torch.cuda._sleep(20_000_000_000)  # about 10 s of GPU time before this rank's part can start
        hvd.allreduce_async(x, name="cut.ar", op=hvd.Sum)
        time.sleep(1.0)  # the others' kernels are now waiting for this rank's part
        os.kill(os.getpid(), signal.SIGKILL)
    _survive_sigterm()
    start = time.monotonic()
    handle = hvd.allreduce_async(x, name="cut.ar", op=hvd.Sum)
    expect_raises(hvd.HorovodInternalError, lambda: hvd.allreduce(torch.ones(1), name="cut.probe"),
                  f"rank {victim}", what="a CPU allreduce while the victim dies")
    error = expect_raises(hvd.HorovodInternalError, lambda: hvd.synchronize(handle), f"rank {victim}",
                          what="the NCCL allreduce the death cut short")
    torch.cuda.synchronize(gpu)  # returns: no kernel is left waiting on the lost rank
    waited = time.monotonic() - start
    print(f"MEASURED {waited:.3f}", flush=True)
    print(f"killed_in_nccl: HorovodInternalError after {waited:.2f} s: {error}", flush=True)


def scenario_shared_gpu():
    """Two ranks on one GPU over NCCL: every rank gets an error that says what to do, and no hang."""
    torch.cuda.set_device(0)
    expect_raises(hvd.HorovodInternalError, lambda: hvd.allreduce(torch.ones(4, device="cuda"), name="shared"),
                  "one rank per GPU", "HOROVOD_GPU_OPERATIONS=gloo", what="two ranks on GPU 0")


run_scenarios({"devices": scenario_devices, "side_stream": scenario_side_stream, "training": scenario_training,
               "slow_gpu_cpu": scenario_slow_gpu_cpu, "other_stream_reads": scenario_other_stream_reads,
               "allocator": scenario_allocator, "staged_reuse": scenario_staged_reuse,
               "join_device": scenario_join_device, "graphed": scenario_graphed,
               "graph_capture": scenario_graph_capture, "killed_in_nccl": scenario_killed_in_nccl,
               "shared_gpu": scenario_shared_gpu}, sys.argv, RANK)
