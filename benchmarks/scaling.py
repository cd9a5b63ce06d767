"""Allreduce and training against the number of ranks on one host: every comparison in one table.

Run it with plain ``python``; it starts every job itself, on this machine only::

    python benchmarks/scaling.py                               # 2, 4, 8, 16 ranks (those the cores allow)
    python benchmarks/scaling.py --np 2,4 --oversubscribe --quick
    python benchmarks/scaling.py --np 2,8,16 --sizes 1M,4M,16M,64M --models mlp,small_cnn --json s.json

For each rank count N it measures, one after the other:

1. Copy bandwidth: N processes (one torch thread each) copy a ``--copy-mib``
   MiB buffer into another (``dst.copy_(src)``) over and over for
   ``--copy-s`` seconds, all at the same time. B(N) = bytes moved by all of
   them (a copy of M bytes reads M and writes M: 2 M) / wall time from the
   first start to the last finish: the memory traffic the host gives N ranks
   at once.
2. Allreduce: ``roundelrun -np N python benchmarks/allreduce.py --quick
   --threads 1 --sizes ... --skip-many`` (roundel and raw Gloo in the same
   processes, alternating). For each size S it prints the bus bandwidth
   ``2(N-1)/N * S / t`` of both, their ratio (roundel / raw Gloo: > 1 means
   roundel is faster) and roundel's time as a multiple of its floor.

   The floor: on one host roundel's allreduce goes through shared memory.
   Each rank reads its S bytes and writes them into its slot (2 passes over
   S), reads its 1/N share of all N slots (S bytes in all) and writes its
   share of the result (1 pass, about), then reads the S-byte result and
   writes it out (2 passes): about 5 passes of S bytes per rank, 5 S N bytes
   of memory traffic for the whole job. At the rate the N ranks move bytes
   together, that takes ``floor = 5 S N / B(N)``. Slots (4 MiB) can stay in
   cache where B's 64 MiB buffers do not, so at sizes that fit in cache a
   multiple a little below 1 can happen. A multiple that grows with N, or
   stays far above 1 at large sizes, is overhead: synchronization, the
   engine, small-message latency.
3. Training (per ``--models`` entry): ``python benchmarks/torch_training.py
   --model M --np N --interleaved --threads 1 --only roundel,ddp,single``
   (roundel's DistributedOptimizer, PyTorch DDP and one process without
   communication, alternating span by span in the same processes). It prints
   samples/sec of roundel and DDP, their ratio, and each one's scaling
   efficiency, N-rank samples/sec / (N x 1-process samples/sec).

A rank count above this machine's usable cores is skipped, saying so, unless
``--oversubscribe`` is given: then it runs, and its rows are marked
oversubscribed (ranks wait for cores: a trend, not a measurement of the
code). Every rank runs one torch thread.

Output: the copy bandwidth per N, then one Markdown table for the allreduce
(a row per N and size) and one for training (a row per N and model); a PNG,
``--plot PATH`` (default ``scaling.png``): bus bandwidth against N (a line per
size, roundel solid, raw Gloo dashed) and scaling efficiency against N
(roundel solid, DDP dashed, per model); and with ``--json PATH`` every
figure, for other scripts (``benchmarks/scaling_model.py``) to read::

    {"cores": .., "oversubscribed": [N, ..], "skipped": [N, ..], "date": ..,
     "copy_bandwidth_bytes_per_s": {"N": ..},
     "allreduce": [{"np": N, "bytes": S, "roundel_s": .., "raw_s": .., "floor_s": ..}, ..],
     "training": [{"np": N, "model": "mlp", "roundel_sps": .., "ddp_sps": .., "single_sps": ..}, ..]}

Exit status: 0 when every job ran; 1 if a job failed or timed out (its
output is shown, the other jobs still run); 2 if no rank count could run.
"""

from __future__ import annotations

import argparse
import datetime
import json
import multiprocessing
import os
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import plots
from allreduce import bus_bandwidth_gbs, human_bytes, parse_size

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent
MIB = 1024 * 1024
FLOOR_PASSES = 5  # passes over its S bytes each rank makes in a shared-memory allreduce (see above)
DEFAULT_SIZES = "4K,256K,1M,4M,16M,64M"


def usable_cores() -> int:
    """CPU cores this process may run on."""
    try:
        return len(os.sched_getaffinity(0))
    except AttributeError:
        return os.cpu_count() or 1


# ------------------------------------------------------------ copy bandwidth
def _copier(nbytes: int, seconds: float, barrier, results) -> None:
    """One copying process: warm up, wait for the others, copy for ``seconds``; report (copies, start, end)."""
    import torch

    torch.set_num_threads(1)
    src = torch.ones(nbytes // 4, dtype=torch.float32)
    dst = torch.empty_like(src)
    dst.copy_(src)  # touch every page before timing
    barrier.wait()
    start = time.monotonic()  # CLOCK_MONOTONIC: one clock for every process on this host
    copies, end = 0, start
    while end - start < seconds:
        dst.copy_(src)
        copies += 1
        end = time.monotonic()
    results.put((copies, start, end))


def copy_bandwidth(processes: int, nbytes: int, seconds: float) -> float:
    """Bytes per second ``processes`` processes move together while copying (each copy reads and writes
    ``nbytes``: 2 ``nbytes`` of memory traffic)."""
    context = multiprocessing.get_context("fork")  # the parent has run no torch op: nothing to inherit badly
    barrier, results = context.Barrier(processes), context.Queue()
    workers = [context.Process(target=_copier, args=(nbytes, seconds, barrier, results))
               for _ in range(processes)]
    for worker in workers:
        worker.start()
    reports = [results.get(timeout=120 + seconds) for _ in workers]
    for worker in workers:
        worker.join()
    wall = max(end for _, _, end in reports) - min(start for _, start, _ in reports)
    return sum(copies for copies, _, _ in reports) * 2 * nbytes / wall


# ----------------------------------------------------------------- the jobs
def stop_group(proc: subprocess.Popen) -> tuple[str, str]:
    """SIGTERM to ``proc``'s process group, SIGKILL 10 s later if it is still there; returns its output."""
    os.killpg(proc.pid, signal.SIGTERM)
    try:
        return proc.communicate(timeout=10)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        return proc.communicate()


def run_job(command: list, timeout: float, what: str) -> bool:
    """Run one benchmark job; on failure or timeout print its output's tail and return False.

    The job runs in a process group of its own; on timeout, or when this
    script is stopped, the whole group gets SIGTERM (SIGKILL 10 s later), and
    ``roundelrun`` stops its ranks when it goes, so nothing of a stuck job
    keeps running.
    """
    env = dict(os.environ)
    env.setdefault("GLOO_SOCKET_IFNAME", "lo")
    proc = subprocess.Popen(command, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env,
                            start_new_session=True)
    try:
        out, err = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        out, err = stop_group(proc)
        print(f"{what}: did not finish within {timeout:.0f} s: {' '.join(command)}\n"
              f"--- stdout ---\n{out[-4000:]}\n--- stderr ---\n{err[-4000:]}", flush=True)
        return False
    finally:
        if proc.poll() is None:  # stopped by a signal (see main): take the job down too
            stop_group(proc)
    if proc.returncode != 0:
        print(f"{what}: failed (exit status {proc.returncode}): {' '.join(command)}\n"
              f"--- stdout ---\n{out[-4000:]}\n--- stderr ---\n{err[-4000:]}", flush=True)
        return False
    return True


def measure_allreduce(ranks: int, opts, bandwidth: float, scratch: Path) -> list[dict] | None:
    """One ``allreduce.py`` job of ``ranks`` ranks; its records with the floor added, or None if it failed."""
    figures = scratch / f"allreduce-{ranks}.json"
    command = [sys.executable, "-m", "roundel.runner.launch", "-np", str(ranks), sys.executable,
               str(HERE / "allreduce.py"), "--quick", "--threads", "1", "--skip-many",
               "--sizes", ",".join(str(s) for s in opts.sizes), "--json", str(figures),
               "--plot", str(scratch / f"allreduce-{ranks}.png")]
    if opts.quick:
        command += ["--rounds", "1"]
    if not run_job(command, opts.timeout, f"allreduce at {ranks} ranks"):
        return None
    record = json.loads(figures.read_text())
    return [{"np": ranks, "bytes": row["bytes"], "roundel_s": row["roundel_s"], "raw_s": row["raw_s"],
             "floor_s": FLOOR_PASSES * row["bytes"] * ranks / bandwidth, "ok": row["ok"],
             "transport": record["transport"]}
            for row in record["sizes"]]


def measure_training(ranks: int, model: str, opts, scratch: Path) -> dict | None:
    """One interleaved ``torch_training.py`` job; samples/sec of roundel, DDP and 1 process, or None."""
    figures = scratch / f"training-{ranks}-{model}.json"
    command = [sys.executable, str(HERE / "torch_training.py"), "--model", model, "--np", str(ranks),
               "--interleaved", "--quick", "--threads", "1", "--only", "roundel,ddp,single",
               "--json", str(figures), "--plot", str(scratch / f"training-{ranks}-{model}.png")]
    if opts.quick:
        command += ["--warmup", "1", "--steps", "3", "--measurements", "2"]
    if not run_job(command, opts.timeout, f"training {model} at {ranks} ranks"):
        return None
    runs = json.loads(figures.read_text())["runs"]
    return {"np": ranks, "model": model, "roundel_sps": runs["roundel"]["samples_per_s"],
            "ddp_sps": runs["ddp"]["samples_per_s"], "single_sps": runs["single"]["samples_per_s"]}


# ------------------------------------------------------------------- output
def rank_label(ranks: int, oversubscribed: list) -> str:
    """The rank count as a table shows it: marked when it ran oversubscribed."""
    return f"{ranks} (oversubscribed)" if ranks in oversubscribed else str(ranks)


def print_tables(results: dict) -> None:
    """The copy bandwidth per N, then the allreduce and training tables (Markdown)."""
    over = results["oversubscribed"]
    print(f"\nCopy bandwidth, bytes read + written ({results['copy_buffer_bytes'] // MIB} MiB buffers, "
          "one torch thread per process):\n")
    print("| ranks | aggregate GB/s | per process GB/s |\n| ---: | ---: | ---: |")
    for key, value in results["copy_bandwidth_bytes_per_s"].items():
        print(f"| {rank_label(int(key), over)} | {value / 1e9:.2f} | {value / int(key) / 1e9:.2f} |")
    if results["allreduce"]:
        print(f"\nAllreduce (floor = {FLOOR_PASSES} x bytes x ranks / copy bandwidth):\n")
        print("| ranks | size | roundel busbw GB/s | raw Gloo busbw GB/s | ratio (roundel/raw) | roundel µs "
              "| floor µs | roundel / floor |\n| ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: |")
        for row in results["allreduce"]:
            n, size = row["np"], row["bytes"]
            print(f"| {rank_label(n, over)} | {human_bytes(size)} | "
                  f"{bus_bandwidth_gbs(size, row['roundel_s'], n):.3f} | "
                  f"{bus_bandwidth_gbs(size, row['raw_s'], n):.3f} | {row['raw_s'] / row['roundel_s']:.2f} | "
                  f"{row['roundel_s'] * 1e6:,.0f} | "
                  f"{row['floor_s'] * 1e6:,.0f} | {row['roundel_s'] / row['floor_s']:.1f} |")
    if results["training"]:
        print("\nTraining (samples/sec, interleaved in the same processes; efficiency = N-rank / (N x 1 process)):\n")
        print("| ranks | model | roundel | DDP | ratio (roundel/DDP) | 1 process | efficiency, roundel "
              "| efficiency, DDP |\n| ---: | --- | ---: | ---: | ---: | ---: | ---: | ---: |")
        for row in results["training"]:
            n, single = row["np"], row["single_sps"]
            print(f"| {rank_label(n, over)} | {row['model']} | {row['roundel_sps']:,.1f} | {row['ddp_sps']:,.1f} | "
                  f"{row['roundel_sps'] / row['ddp_sps']:.2f} | {single:,.1f} | "
                  f"{row['roundel_sps'] / (n * single):.3f} | {row['ddp_sps'] / (n * single):.3f} |")


def plot(path, results: dict) -> Path:
    """Bus bandwidth and scaling efficiency against the rank count, into ``path``."""
    ranks = sorted({row["np"] for row in results["allreduce"] + results["training"]})
    bandwidth, efficiency = {}, {}
    for size in sorted({row["bytes"] for row in results["allreduce"]}):
        rows = {row["np"]: row for row in results["allreduce"] if row["bytes"] == size}
        bandwidth[human_bytes(size)] = tuple(
            [bus_bandwidth_gbs(size, rows[n][key], n) if n in rows else None for n in ranks]
            for key in ("roundel_s", "raw_s"))
    for model in dict.fromkeys(row["model"] for row in results["training"]):
        rows = {row["np"]: row for row in results["training"] if row["model"] == model}
        efficiency[model] = tuple(
            [rows[n][key] / (n * rows[n]["single_sps"]) if n in rows else None for n in ranks]
            for key in ("roundel_sps", "ddp_sps"))
    return plots.scaling_plot(path, ranks, bandwidth, efficiency,
                              f"roundel vs raw Gloo and DDP on one host, {results['cores']} usable cores",
                              marked=tuple(results["oversubscribed"]))


# ---------------------------------------------------------------------- main
def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--np", default="2,4,8,16", help="comma-separated rank counts (default %(default)s)")
    p.add_argument("--sizes", default=DEFAULT_SIZES, help="allreduce sizes, e.g. 4K,1M (default %(default)s)")
    p.add_argument("--models", default="mlp",
                   help="comma-separated training models: mlp, or names from examples/models.py such as "
                        "small_cnn, resnet18 (default %(default)s)")
    p.add_argument("--oversubscribe", action="store_true",
                   help="also run rank counts above this machine's cores (marked oversubscribed: a trend only)")
    p.add_argument("--quick", action="store_true",
                   help="one allreduce round and 3-step training spans: a smoke run, not figures to quote")
    p.add_argument("--skip-allreduce", action="store_true", help="no allreduce jobs")
    p.add_argument("--skip-training", action="store_true", help="no training jobs")
    p.add_argument("--copy-mib", type=int, default=64, help="MiB each copying process copies at a time")
    p.add_argument("--copy-s", type=float, default=0.5, help="seconds the copying processes copy")
    p.add_argument("--timeout", type=float, default=600, help="seconds one job may take")
    p.add_argument("--plot", default="scaling.png", metavar="PATH", help="PNG of both against the ranks")
    p.add_argument("--json", metavar="PATH", help="also write every figure as JSON (see above)")
    opts = p.parse_args(argv)
    try:
        opts.np = [int(n) for n in opts.np.split(",") if n.strip()]
    except ValueError:
        p.error(f"--np: {opts.np!r} is not a comma-separated list of rank counts")
    if not opts.np or min(opts.np) < 2:
        p.error("--np: every rank count must be >= 2")
    try:
        opts.sizes = [parse_size(s) for s in opts.sizes.split(",") if s.strip()]
    except argparse.ArgumentTypeError as bad:
        p.error(f"--sizes: {bad}")
    opts.models = [m.strip() for m in opts.models.split(",") if m.strip()]
    sys.path.insert(0, str(ROOT / "examples"))
    from models import canonical_name
    try:
        opts.models = [m if m == "mlp" else canonical_name(m) for m in opts.models]
    except ValueError as bad:
        p.error(f"--models: {bad}")
    if opts.copy_mib < 1 or opts.copy_s <= 0:
        p.error("--copy-mib must be >= 1 and --copy-s > 0")
    return opts


def main(argv=None) -> int:
    opts = parse_args(argv)
    signal.signal(signal.SIGTERM, lambda signum, frame: sys.exit(128 + signum))  # run_job then stops its job
    started = time.perf_counter()
    cores = usable_cores()
    results = {"cores": cores, "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
               "oversubscribed": [], "skipped": [], "copy_buffer_bytes": opts.copy_mib * MIB,
               "floor_passes": FLOOR_PASSES, "copy_bandwidth_bytes_per_s": {}, "allreduce": [], "training": []}
    print(f"scaling: ranks {', '.join(map(str, opts.np))} on {cores} usable cores; sizes "
          f"{', '.join(human_bytes(s) for s in opts.sizes)}; models {', '.join(opts.models)}", flush=True)
    failed = False
    with tempfile.TemporaryDirectory(prefix="scaling-") as scratch:
        for ranks in opts.np:
            if ranks > cores:
                if not opts.oversubscribe:
                    print(f"{ranks} ranks: skipped, this machine has {cores} cores; "
                          "--oversubscribe runs it anyway as a trend", flush=True)
                    results["skipped"].append(ranks)
                    continue
                results["oversubscribed"].append(ranks)
            bandwidth = copy_bandwidth(ranks, opts.copy_mib * MIB, opts.copy_s)
            results["copy_bandwidth_bytes_per_s"][str(ranks)] = bandwidth
            print(f"{ranks} ranks: copy bandwidth {bandwidth / 1e9:.2f} GB/s", flush=True)
            if not opts.skip_allreduce:
                rows = measure_allreduce(ranks, opts, bandwidth, Path(scratch))
                failed |= rows is None
                results["allreduce"] += rows or []
                print(f"{ranks} ranks: allreduce {'done' if rows else 'FAILED'} "
                      f"({time.perf_counter() - started:.0f} s)", flush=True)
            for model in [] if opts.skip_training else opts.models:
                row = measure_training(ranks, model, opts, Path(scratch))
                failed |= row is None
                results["training"] += [row] if row else []
                print(f"{ranks} ranks: training {model} {'done' if row else 'FAILED'} "
                      f"({time.perf_counter() - started:.0f} s)", flush=True)
    if not results["copy_bandwidth_bytes_per_s"]:
        print(f"nothing ran: every rank count exceeds this machine's {cores} cores (add --oversubscribe)")
        return 2
    print_tables(results)
    if results["allreduce"] or results["training"]:
        print(f"\nplot: {plot(opts.plot, results)}")
    if opts.json:
        with open(opts.json, "w") as out:
            json.dump(results, out, indent=1)
        print(f"wrote {opts.json}")
    print(f"total {time.perf_counter() - started:.0f} s{'; SOME JOBS FAILED' if failed else ''}", flush=True)
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
