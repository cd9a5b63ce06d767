"""Allreduce benchmark: roundel against raw ``torch.distributed`` Gloo (or raw mpi4py), side by side.

Run it under the launcher (one process per rank)::

    roundelrun -np 2 python benchmarks/allreduce.py            # full run, ~1-2 min
    roundelrun -np 2 python benchmarks/allreduce.py --quick    # a few sizes, < 40 s
    roundelrun -np 2 python benchmarks/allreduce.py --sizes 4,64K,16M

Each rank starts roundel (``hvd.init()``) and, in the same process, a plain
``torch.distributed`` Gloo process group of the same size (roundel keeps its
own private process group, so the two coexist). Every measurement is made
with both at the same time in the same processes, alternating them round by
round so that background noise hits both alike, and reported as a ratio.

What it measures:

1. One float32 tensor, 4 B to 64 MiB in powers of 4: per-call latency of
   roundel ``hvd.allreduce_(t, op=hvd.Sum, name=...)`` (in place, named so the
   response cache is used) and of raw ``dist.all_reduce(t)``; bus bandwidth
   ``2(n-1)/n * bytes / time`` of each; and ``ratio = roundel busbw / raw
   busbw`` (> 1: roundel is faster). Each size's result is checked once
   against the exact expected sum, for both.
2. Many small tensors: the 161 parameter tensors of ResNet-50 (25,557,032
   float32 values), reduced the way a training step would: roundel with all
   161 ``allreduce_async_`` submitted in backward order then synchronized
   (fusion and caching at work), against raw Gloo one blocking call per
   tensor, and against raw Gloo with all 161 ``async_op=True`` calls in flight.
3. Idle CPU: CPU seconds the process burns per second while roundel is
   initialized but no collective is running (should be ~0: nothing polls).

Timing: for each case, a warm-up, then ``rounds`` rounds; in each round every
implementation runs K iterations back to back between barriers (K chosen so
a measurement takes ``--target-s`` seconds, at least ``--min-iters``, and the
same on every rank). A round's per-iteration time is the slowest rank's; the
reported time is the median over rounds.

With ``--backend mpi`` (start it with ``mpirun -np 2 python benchmarks/allreduce.py
--backend mpi``) roundel moves its data over MPI (``HOROVOD_CPU_OPERATIONS=mpi``)
and "raw" is mpi4py's ``Allreduce`` (in place, on the tensor's own memory) on a
duplicate of ``MPI.COMM_WORLD``, and ``Iallreduce`` for the many-tensors
async case; the Gloo group then only times and checks.

When every rank runs on this host, roundel's allreduces go through shared
memory (or, up to 4 KiB, are reduced by its coordinator) while raw Gloo uses
loopback TCP; the header names roundel's transport. With
``ROUNDEL_SHARED_MEMORY=0`` roundel runs on Gloo too, which isolates what its
engine costs over the same transport.

Only rank 0 prints; the tables are Markdown, ready to paste into docs/performance.md.
Rank 0 also draws bus bandwidth against message size (log-log, one line for
roundel, one for the raw baseline) into a PNG, ``--plot PATH`` (default
``allreduce.png`` in the current directory), and prints where it is.
Exit status is 0 on success and 1 if any result was wrong (on any rank).
"""

from __future__ import annotations

import argparse
import json
import math
import os
import socket
import statistics
import sys
import threading
import time

import psutil
import torch
import torch.distributed as dist

import roundel
import roundel.torch as hvd
from roundel.common import basics
from roundel.common.settings import Settings

KIB = 1024
MIB = 1024 * KIB
FULL_SIZES = [4 ** k for k in range(1, 14)]  # 4 B .. 64 MiB
QUICK_SIZES = [4, 4 * KIB, MIB, 16 * MIB]
RESNET50_PARAMS = 25_557_032
IDLE_SECONDS = 2.0


# ------------------------------------------------------ raw baselines
class RawGloo:
    """The baseline: ``torch.distributed``'s default Gloo group."""

    label = "raw Gloo"

    def allreduce(self, tensor) -> None:
        dist.all_reduce(tensor)

    def allreduce_async(self, tensor):
        return dist.all_reduce(tensor, async_op=True)

    @staticmethod
    def wait_all(pending) -> None:
        for work in pending:
            work.wait()


class RawMPI:
    """The baseline: mpi4py on a private duplicate of ``MPI.COMM_WORLD``, on the tensors' memory."""

    label = "raw MPI"

    def __init__(self):
        from mpi4py import MPI  # only in --backend mpi, under mpirun
        self._mpi = MPI
        self._comm = MPI.COMM_WORLD.Dup()

    def allreduce(self, tensor) -> None:
        self._comm.Allreduce(self._mpi.IN_PLACE, tensor.numpy(), op=self._mpi.SUM)

    def allreduce_async(self, tensor):
        return self._comm.Iallreduce(self._mpi.IN_PLACE, tensor.numpy(), op=self._mpi.SUM)

    def wait_all(self, pending) -> None:
        self._mpi.Request.Waitall(pending)


RAW = RawGloo()


# ---------------------------------------------------------------- helpers
def parse_size(text: str) -> int:
    """'4', '64K', '1M', '1MiB' -> bytes (a positive multiple of 4)."""
    units = {"": 1, "B": 1, "K": KIB, "KB": KIB, "KIB": KIB, "M": MIB, "MB": MIB, "MIB": MIB,
             "G": 1024 * MIB, "GB": 1024 * MIB, "GIB": 1024 * MIB}
    raw = text.strip().upper()
    digits = raw.rstrip("KMGIB")
    unit = raw[len(digits):]
    if not digits.isdigit() or unit not in units:
        raise argparse.ArgumentTypeError(f"bad size {text!r}; use e.g. 4, 64K, 16M")
    value = int(digits) * units[unit]
    if value <= 0 or value % 4:
        raise argparse.ArgumentTypeError(f"size {text!r} must be a positive multiple of 4 bytes (float32)")
    return value


def human_bytes(n: int) -> str:
    for unit, scale in (("GiB", 1024 * MIB), ("MiB", MIB), ("KiB", KIB)):
        if n >= scale and n % scale == 0:
            return f"{n // scale} {unit}"
    return f"{n} B"


def bus_bandwidth_gbs(nbytes: int, seconds: float, world: int) -> float:
    """NCCL-tests' bus bandwidth for allreduce, in GB/s (1e9 B/s)."""
    if world < 2 or seconds <= 0:
        return 0.0
    return 2 * (world - 1) / world * nbytes / seconds / 1e9


def slowest(seconds: float) -> float:
    """The largest of every rank's ``seconds`` (so ranks agree on one number)."""
    value = torch.tensor([seconds], dtype=torch.float64)
    dist.all_reduce(value, op=dist.ReduceOp.MAX)
    return float(value.item())


def any_rank(flag: bool) -> bool:
    value = torch.tensor([1 if flag else 0], dtype=torch.int32)
    dist.all_reduce(value, op=dist.ReduceOp.MAX)
    return bool(value.item())


def timed(step, iters: int) -> float:
    """Seconds per call of ``step()`` over ``iters`` calls, slowest rank's, started together."""
    dist.barrier()
    start = time.perf_counter()
    for _ in range(iters):
        step()
    return slowest((time.perf_counter() - start) / iters)


def cpu_per_call(step, iters: int) -> float:
    """This process's CPU seconds (all its threads: roundel's engine, Gloo's) per call of ``step()``, over
    ``iters`` calls, the largest of the ranks'."""
    dist.barrier()
    before = time.process_time()
    for _ in range(iters):
        step()
    return slowest((time.process_time() - before) / iters)


def compare(steps: dict, rounds: int, target_s: float, min_iters: int, max_iters: int,
            warmup: int) -> tuple[dict, int]:
    """Median seconds per call of each step, measured alternately; returns (times, iterations).

    Round r runs the steps in order for even r and reversed for odd r, so
    neither always goes first.
    """
    for step in steps.values():
        for _ in range(warmup):
            step()
    probe = max(timed(step, 1) for step in steps.values())  # sets K; one call is enough
    iters = max(min_iters, min(max_iters, math.ceil(target_s / max(probe, 1e-7))))
    samples = {label: [] for label in steps}
    order = list(steps)
    for r in range(rounds):
        for label in (order if r % 2 == 0 else order[::-1]):
            samples[label].append(timed(steps[label], iters))
    return {label: statistics.median(s) for label, s in samples.items()}, iters


def free_port(host: str) -> int:
    """A TCP port that was free on ``host`` a moment ago (the OS picks it)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind((host, 0))
        return s.getsockname()[1]


def init_raw_gloo() -> None:
    """A default ``torch.distributed`` Gloo group of the same ranks, beside roundel's own.

    Rank 0 picks the store's port and shares it with ``hvd.broadcast_object``.
    On one host the store listens on 127.0.0.1; across hosts, on rank 0's
    host address.
    """
    address = None
    if hvd.rank() == 0:
        host = "127.0.0.1" if hvd.local_size() == hvd.size() else socket.gethostbyname(socket.gethostname())
        address = (host, free_port(host))
    host, port = hvd.broadcast_object(address, 0, name="bench.raw_store")
    dist.init_process_group("gloo", init_method=f"tcp://{host}:{port}", rank=hvd.rank(),
                            world_size=hvd.size())


# ------------------------------------------------------- single tensors
def expected_sum(numel: int, world: int) -> tuple[torch.Tensor, torch.Tensor]:
    """An input that differs per rank and the exact sum over ranks (small integers: exact in float32)."""
    base = (torch.arange(numel, dtype=torch.int64) % 97).to(torch.float32)
    return base + hvd.rank(), base * world + world * (world - 1) // 2


def check_once(nbytes: int, world: int) -> tuple[bool, bool]:
    """(roundel correct, raw correct) for one fresh tensor of ``nbytes``."""
    numel = nbytes // 4
    given, want = expected_sum(numel, world)
    mine = given.clone()
    hvd.allreduce_(mine, op=hvd.Sum, name=f"bench.check.{nbytes}")
    raw = given.clone()
    RAW.allreduce(raw)
    return torch.equal(mine, want), torch.equal(raw, want)


def single_tensor_steps(nbytes: int) -> dict:
    """One in-place Sum allreduce of a float32 tensor of ``nbytes``: roundel's and raw Gloo's."""
    # Zeros stay zeros under repeated in-place sums: no overflow, no denormals.
    t_roundel = torch.zeros(nbytes // 4, dtype=torch.float32)
    t_raw = torch.zeros(nbytes // 4, dtype=torch.float32)
    name = f"bench.{nbytes}"
    return {
        "roundel": lambda: hvd.allreduce_(t_roundel, op=hvd.Sum, name=name),
        "raw": lambda: RAW.allreduce(t_raw),
    }


def bench_sizes(sizes, opts, world: int) -> tuple[list, bool]:
    """Rows of (bytes, roundel s/call, raw s/call, iterations, correct), and whether any check failed."""
    rows, failed = [], False
    for nbytes in sizes:
        times, iters = compare(single_tensor_steps(nbytes), opts.rounds, opts.target_s, opts.min_iters,
                               opts.max_iters, opts.warmup)
        ok_roundel, ok_raw = check_once(nbytes, world)
        bad = any_rank(not (ok_roundel and ok_raw))
        failed |= bad
        if bad and hvd.rank() == 0:
            print(f"CHECK FAILED at {human_bytes(nbytes)}: roundel ok on rank 0: {ok_roundel}, "
                  f"raw ok on rank 0: {ok_raw}", flush=True)
        rows.append((nbytes, times["roundel"], times["raw"], iters, not bad))
    return rows, failed


# -------------------------------------------------------- many tensors
def resnet50_shapes() -> list[tuple]:
    """torchvision ResNet-50's parameter shapes, in ``model.parameters()`` order."""
    shapes = [(64, 3, 7, 7), (64,), (64,)]  # conv1, bn1
    in_ch = 64
    for blocks, width in ((3, 64), (4, 128), (6, 256), (3, 512)):
        out_ch = width * 4
        for block in range(blocks):
            shapes += [(width, in_ch, 1, 1), (width,), (width,),
                       (width, width, 3, 3), (width,), (width,),
                       (out_ch, width, 1, 1), (out_ch,), (out_ch,)]
            if block == 0:  # downsample: 1x1 conv + bn
                shapes += [(out_ch, in_ch, 1, 1), (out_ch,), (out_ch,)]
            in_ch = out_ch
    shapes += [(1000, 2048), (1000,)]  # fc
    return shapes


def bench_many(opts) -> dict:
    shapes = resnet50_shapes()
    assert len(shapes) == 161, len(shapes)
    if opts.many_numel:
        shapes = [(opts.many_numel,)] * len(shapes)
    total = sum(math.prod(s) for s in shapes)
    assert opts.many_numel or abs(total - RESNET50_PARAMS) <= RESNET50_PARAMS * 1e-3, total
    grads = {label: [torch.zeros(s, dtype=torch.float32) for s in shapes]
             for label in ("roundel", "raw_sync", "raw_async")}

    def roundel_step():
        handles = [hvd.allreduce_async_(t, op=hvd.Sum, name=f"grad.{i}")
                   for i, t in reversed(list(enumerate(grads["roundel"])))]
        for h in handles:
            hvd.synchronize(h)

    def raw_sync_step():
        for t in reversed(grads["raw_sync"]):
            RAW.allreduce(t)

    def raw_async_step():
        RAW.wait_all([RAW.allreduce_async(t) for t in reversed(grads["raw_async"])])

    steps = {"roundel": roundel_step, "raw_sync": raw_sync_step, "raw_async": raw_async_step}
    times, iters = compare(steps, opts.rounds, opts.target_s * 2, opts.min_iters, opts.max_iters,
                           opts.warmup_many)
    cpu = {label: cpu_per_call(step, iters) for label, step in steps.items()}
    return {"times": times, "cpu": cpu, "iters": iters, "count": len(shapes), "numel": total,
            "what": f"{len(shapes)} tensors of {opts.many_numel:,} float32" if opts.many_numel
            else f"ResNet-50's {len(shapes)} parameter tensors"}


# ------------------------------------------------------------ idle CPU
def idle_cpu(seconds: float) -> dict:
    """CPU time this process uses while roundel sits initialized and idle for ``seconds``."""
    proc = psutil.Process()
    names = {t.native_id: t.name for t in threading.enumerate()}
    before_pt = time.process_time()
    before_ps = proc.cpu_times()
    before_threads = {t.id: t.user_time + t.system_time for t in proc.threads()}
    start = time.perf_counter()
    time.sleep(seconds)
    wall = time.perf_counter() - start
    after_pt = time.process_time()
    after_ps = proc.cpu_times()
    busiest, busiest_s = None, 0.0
    for t in proc.threads():
        used = t.user_time + t.system_time - before_threads.get(t.id, 0.0)
        if used > busiest_s:
            busiest, busiest_s = names.get(t.id, f"native thread {t.id}"), used
    return {
        "rank": hvd.rank(),
        "process_time": (after_pt - before_pt) / wall,
        "psutil": ((after_ps.user + after_ps.system) - (before_ps.user + before_ps.system)) / wall,
        "busiest": busiest or "-",
        "busiest_rate": busiest_s / wall,
    }


# --------------------------------------------------------------- output
def print_report(header: str, rows, many, idle, world: int) -> None:
    print(header)
    print()
    print(f"| size | roundel µs | {RAW.label} µs | roundel busbw GB/s | raw busbw GB/s | ratio (roundel/raw) "
          "| iters | check |")
    print("| ---: | ---: | ---: | ---: | ---: | ---: | ---: | :---: |")
    for nbytes, t_roundel, t_raw, iters, ok in rows:
        bw_roundel = bus_bandwidth_gbs(nbytes, t_roundel, world)
        bw_raw = bus_bandwidth_gbs(nbytes, t_raw, world)
        print(f"| {human_bytes(nbytes)} | {t_roundel * 1e6:,.1f} | {t_raw * 1e6:,.1f} | {bw_roundel:.4f} | "
              f"{bw_raw:.4f} | {t_raw / t_roundel:.2f} | {iters} | {'ok' if ok else 'FAIL'} |")
    print()
    if many is not None:
        times = many["times"]
        print(f"Many small tensors: {many['what']} "
              f"({many['numel']:,} float32, {many['numel'] * 4 / MIB:.1f} MiB) per step, "
              f"{many['iters']} steps per round:")
        print()
        cpu = many["cpu"]
        print("| method | ms / step | roundel speedup | CPU ms / step (busiest rank's process) |")
        print("| --- | ---: | ---: | ---: |")
        print(f"| roundel: 161 `allreduce_async_` (backward order), then synchronize | "
              f"{times['roundel'] * 1e3:,.1f} | 1.00 | {cpu['roundel'] * 1e3:,.1f} |")
        print(f"| {RAW.label}: 161 blocking allreduce calls | {times['raw_sync'] * 1e3:,.1f} | "
              f"{times['raw_sync'] / times['roundel']:.2f} | {cpu['raw_sync'] * 1e3:,.1f} |")
        print(f"| {RAW.label}: 161 asynchronous allreduce calls, then wait | {times['raw_async'] * 1e3:,.1f} | "
              f"{times['raw_async'] / times['roundel']:.2f} | {cpu['raw_async'] * 1e3:,.1f} |")
        print()
    if idle is not None:
        print(f"Idle CPU with roundel initialized ({IDLE_SECONDS:g} s of `time.sleep`), "
              "CPU seconds per second (psutil counts in 10 ms ticks: 0.005 is one tick):")
        print()
        print("| rank | process_time | psutil (all threads) | busiest thread |")
        print("| ---: | ---: | ---: | --- |")
        for r in idle:
            print(f"| {r['rank']} | {r['process_time']:.4f} | {r['psutil']:.4f} | "
                  f"{r['busiest']} ({r['busiest_rate']:.4f}) |")
        print()


def plot_bandwidth(path, rows, world: int, backend: str):
    """Draw the single-tensor rows' bus bandwidth, roundel against the raw baseline; returns the PNG's path."""
    from plots import bus_bandwidth_plot  # benchmarks/plots.py, beside this script

    sizes = [row[0] for row in rows]
    lines = {"roundel": [bus_bandwidth_gbs(n, t, world) for n, t, *_ in rows],
             RAW.label: [bus_bandwidth_gbs(n, t, world) for n, _, t, *_ in rows]}
    return bus_bandwidth_plot(path, sizes, lines, f"allreduce bus bandwidth, {world} ranks, "
                              f"roundel on {backend} vs {RAW.label}, torch {torch.__version__}")


def write_json(path, rows, many, world: int, transport: str, threads: int, backend: str) -> None:
    """Write the measured times (seconds per call, medians) for other scripts to read."""
    record = {"world": world, "transport": transport, "raw": RAW.label, "backend": backend,
              "threads": threads, "cores": os.cpu_count(), "torch": torch.__version__,
              "sizes": [{"bytes": nbytes, "roundel_s": t_roundel, "raw_s": t_raw, "iters": iters, "ok": ok}
                        for nbytes, t_roundel, t_raw, iters, ok in rows],
              "many": None if many is None else {"count": many["count"], "numel": many["numel"],
                                                 "seconds": many["times"], "cpu_seconds": many["cpu"]}}
    with open(path, "w") as out:
        json.dump(record, out, indent=1)


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--quick", action="store_true",
                   help="4 sizes (4 B, 4 KiB, 1 MiB, 16 MiB) and short measurements (< 40 s at -np 2)")
    p.add_argument("--sizes", type=lambda s: [parse_size(x) for x in s.split(",") if x.strip()],
                   help="comma-separated tensor sizes in bytes, e.g. 4,64K,16M (default 4 B..64 MiB, x4)")
    p.add_argument("--rounds", type=int, help="alternating rounds per measurement (default 3)")
    p.add_argument("--target-s", type=float, help="seconds per measurement (default 0.4; quick 0.08)")
    p.add_argument("--min-iters", type=int, default=3, help="fewest iterations per measurement")
    p.add_argument("--max-iters", type=int, default=5000, help="most iterations per measurement")
    p.add_argument("--skip-many", action="store_true", help="skip the ResNet-50 many-tensors case")
    p.add_argument("--many-numel", type=int, default=0, metavar="N",
                   help="give the many-tensors case's 161 tensors N float32 elements each, not ResNet-50's "
                        "shapes (1500: a model's small layers, 0.9 MiB in all)")
    p.add_argument("--backend", choices=("gloo", "mpi"), default="gloo",
                   help="roundel's CPU transport and the raw baseline: gloo (default) or mpi (under mpirun)")
    p.add_argument("--threads", type=int,
                   help="torch intra-op threads per rank (default: CPU cores / ranks on this host)")
    p.add_argument("--plot", default="allreduce.png", metavar="PATH",
                   help="PNG of bus bandwidth vs message size, written by rank 0 (default: %(default)s)")
    p.add_argument("--json", metavar="PATH",
                   help="also write the figures as JSON, by rank 0 (read by benchmarks/scaling.py)")
    opts = p.parse_args(argv)
    if opts.sizes is None:
        opts.sizes = QUICK_SIZES if opts.quick else FULL_SIZES
    if opts.rounds is None:
        opts.rounds = 3
    if opts.target_s is None:
        opts.target_s = 0.08 if opts.quick else 0.4
    opts.warmup = 3 if opts.quick else 10
    opts.warmup_many = 1 if opts.quick else 2
    if opts.rounds < 1 or opts.min_iters < 1 or opts.max_iters < opts.min_iters or opts.target_s <= 0:
        p.error("--rounds and --min-iters must be >= 1, --max-iters >= --min-iters, --target-s > 0")
    return opts


def main(argv=None) -> int:
    global RAW
    opts = parse_args(argv)
    started = time.perf_counter()
    if opts.backend == "mpi" and not any(f"{p}_CPU_OPERATIONS" in os.environ for p in ("ROUNDEL", "HOROVOD")):
        os.environ["ROUNDEL_CPU_OPERATIONS"] = "mpi"
    hvd.init()
    if opts.backend == "mpi":
        if not hvd.mpi_enabled():
            raise SystemExit("--backend mpi: roundel is not moving data over MPI; unset "
                             "ROUNDEL_CPU_OPERATIONS/HOROVOD_CPU_OPERATIONS (or set them to mpi)")
        RAW = RawMPI()
    threads = opts.threads or max(1, (os.cpu_count() or 1) // hvd.local_size())
    torch.set_num_threads(threads)
    init_raw_gloo()
    world = hvd.size()
    settings = Settings.from_env()
    transport = basics.runtime().process_sets[0][1].name  # "shm" where every rank is on this host

    rows, failed = bench_sizes(opts.sizes, opts, world)
    many = None if opts.skip_many else bench_many(opts)
    dist.barrier()
    idle = hvd.allgather_object(idle_cpu(IDLE_SECONDS), name="bench.idle")

    if hvd.rank() == 0:
        header = (f"**roundel allreduce benchmark** — world size {world}, torch {torch.__version__}, "
                  f"roundel {getattr(roundel, '__version__', '?')} on {transport} vs {RAW.label}, fusion threshold "
                  f"{human_bytes(settings.fusion_threshold) if settings.fusion_threshold else 'off'}, "
                  f"cycle time {settings.cycle_time_ms:g} ms, cache capacity {settings.cache_capacity}, "
                  f"{threads} torch thread(s)/rank, {os.cpu_count()} CPU cores, "
                  f"{opts.rounds} alternating rounds (median){', --quick' if opts.quick else ''}.")
        print_report(header, rows, many, idle, world)
        plot = plot_bandwidth(opts.plot, rows, world, transport)
        if opts.json:
            write_json(opts.json, rows, many, world, transport, threads, opts.backend)
        verdict = "FAILED: some results were wrong" if failed else "all results correct"
        print(f"{verdict}; total {time.perf_counter() - started:.1f} s; plot: {plot}", flush=True)

    hvd.shutdown()
    dist.destroy_process_group()
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
