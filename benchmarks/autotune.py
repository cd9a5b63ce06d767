"""Autotune against hand-picked settings: the communication-bound MLP, 2 ranks, in one run.

Run it with plain ``python``; it starts every job itself, on this machine only::

    python benchmarks/autotune.py --rounds 3 --steps 10  # the run in docs/autotune.md: 3 rounds of the three jobs below
    python benchmarks/autotune.py --rounds 1 --max-samples 8 --steps-per-sample 2   # shorter, noisier

Three ``roundelrun -np 2`` jobs train the MLP of ``benchmarks/torch_training.py``
(``--model mlp``: three 2048-wide Linear layers, about 10.5 M parameters,
batch 32 per rank, its ``Trainer``):

    bad       fusion threshold 1 MiB, cycle time 50 ms (deliberately bad)
    autotune  the same bad settings to start from, with --autotune: trains until
              the search has ended (every rank has the final settings), then is timed
    default   roundel's defaults (128 MiB, 1 ms): the best hand-picked setting

Each job runs ``--warmup`` untimed steps and then ``--measurements`` timed
spans of ``--steps`` steps (samples/sec of a span = ranks x batch x steps /
seconds, between barriers); the autotune job is timed only after its search.
The jobs alternate from round to round. Prints samples/sec of each (median
of its spans), the ratios autotune / bad and autotune / default, the steps
and seconds the search took and the settings it chose.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
import torch_training  # noqa: E402  (its Trainer and MLP)

JOBS = ("bad", "autotune", "default")
BAD = ["--fusion-threshold-mb", "1", "--cycle-time-ms", "50"]


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0],
                                formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    p.add_argument("--rounds", type=int, default=2, help="rounds of the three jobs")
    p.add_argument("--warmup", type=int, default=3, help="untimed steps at the start of each job")
    p.add_argument("--steps", type=int, default=5, help="steps per timed span")
    p.add_argument("--measurements", type=int, default=3, help="timed spans per job")
    p.add_argument("--warmup-samples", type=int, default=1, help="--autotune-warmup-samples")
    p.add_argument("--steps-per-sample", type=int, default=5, help="--autotune-steps-per-sample (steps per window; "
                   "a sample is five windows)")
    p.add_argument("--max-samples", type=int, default=10, help="--autotune-bayes-opt-max-samples")
    p.add_argument("--max-search-steps", type=int, default=1000, help="give up if the search takes longer")
    p.add_argument("--threads", type=int, default=max(1, torch_training.usable_cores() // 2),
                   help="PyTorch threads per process")
    p.add_argument("--timeout", type=float, default=900, help="seconds one job may take")
    p.add_argument("--worker", choices=JOBS, help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    # what torch_training.Trainer reads
    args.model, args.batch_size, args.image_size, args.num_classes = "mlp", 32, 0, 1000
    return args


def worker(args) -> None:
    import torch

    import roundel.torch as hvd
    from roundel.common import basics

    torch.set_num_threads(args.threads)
    hvd.init()
    trainer = torch_training.Trainer("roundel", args, hvd.rank(), hvd.size())
    for _ in range(args.warmup):
        trainer.step(False)
    engine = basics.runtime().engine
    search_steps, started = 0, time.perf_counter()
    while args.worker == "autotune":  # until every rank has the final settings
        final_here = torch.tensor([0 if engine.tuned.tuning else 1])
        if hvd.allreduce(final_here, name="bench.tuned", op=hvd.Min).item() == 1:
            break
        if search_steps >= args.max_search_steps:
            raise SystemExit(f"autotune did not finish within {args.max_search_steps} steps")
        trainer.step(False)
        search_steps += 1
    search_s = time.perf_counter() - started
    for _ in range(args.measurements):
        trainer.span(args, hvd.barrier)
    if hvd.rank() == 0:
        tuned = engine.tuned
        print("BENCH_RESULT " + json.dumps({
            "rates": trainer.rates, "search_steps": search_steps, "search_s": search_s,
            "tuned": {"fusion_mib": tuned.fusion_threshold / 2 ** 20, "cycle_ms": tuned.cycle_time_ms,
                      "cache": tuned.cache_enabled, "bucket_mib": tuned.bucket_cap_mb}}), flush=True)
    hvd.shutdown()


def command(job: str, args) -> list[str]:
    launcher = [sys.executable, "-m", "roundel.runner.launch", "-np", "2"]
    if job in ("bad", "autotune"):
        launcher += BAD
    if job == "autotune":
        launcher += ["--autotune", "--autotune-warmup-samples", str(args.warmup_samples),
                     "--autotune-steps-per-sample", str(args.steps_per_sample),
                     "--autotune-bayes-opt-max-samples", str(args.max_samples)]
    mine = ["--worker", job, "--warmup", str(args.warmup), "--steps", str(args.steps),
            "--measurements", str(args.measurements), "--threads", str(args.threads),
            "--max-search-steps", str(args.max_search_steps)]
    return launcher + [sys.executable, str(Path(__file__).resolve()), *mine]


def run_job(job: str, args) -> dict:
    env = {k: v for k, v in os.environ.items() if not k.startswith(("ROUNDEL_", "HOROVOD_"))}
    env.setdefault("GLOO_SOCKET_IFNAME", "lo")
    env["OMP_NUM_THREADS"] = str(args.threads)
    proc = subprocess.run(command(job, args), capture_output=True, text=True, env=env, timeout=args.timeout)
    results = [json.loads(line.split("BENCH_RESULT ", 1)[1]) for line in proc.stdout.splitlines()
               if "BENCH_RESULT " in line]
    if proc.returncode != 0 or len(results) != 1:
        sys.exit(f"{job} job failed (exit status {proc.returncode}): {' '.join(command(job, args))}\n"
                 f"--- stdout ---\n{proc.stdout[-6000:]}\n--- stderr ---\n{proc.stderr[-6000:]}")
    return results[0]


def driver(args) -> None:
    results = {job: [] for job in JOBS}
    for r in range(args.rounds):
        order = JOBS[r % len(JOBS):] + JOBS[:r % len(JOBS)]
        for job in order:
            started = time.perf_counter()
            result = run_job(job, args)
            results[job].append(result)
            extra = ""
            if job == "autotune":
                t = result["tuned"]
                buckets = f"{t['bucket_mib']:g} MiB" if t["bucket_mib"] else "as configured"
                extra = (f"; search {result['search_steps']} steps, {result['search_s']:.1f} s; chose "
                         f"{t['fusion_mib']:.1f} MiB, {t['cycle_ms']:g} ms, cache {'on' if t['cache'] else 'off'}, "
                         f"buckets {buckets}")
            print(f"round {r + 1}/{args.rounds} {job:8s}: {statistics.median(result['rates']):7.1f} samples/sec "
                  f"(job {time.perf_counter() - started:.0f} s{extra})", flush=True)
    medians = {job: statistics.median(rate for res in results[job] for rate in res["rates"]) for job in JOBS}
    print()
    print(f"MLP 3 x 2048, batch 32 per rank, 2 ranks, {args.threads} thread(s) per process, "
          f"{torch_training.usable_cores()} usable core(s); {args.rounds} round(s) x {args.measurements} span(s) "
          f"of {args.steps} steps; autotune: {args.warmup_samples} warm-up + {args.max_samples} samples "
          f"of 5 windows of {args.steps_per_sample} steps")
    print()
    print("| settings | samples/sec (median) |")
    print("| --- | --- |")
    labels = {"bad": "fusion 1 MiB, cycle 50 ms", "autotune": "the same, then autotune's choice",
              "default": "defaults: fusion 128 MiB, cycle 1 ms"}
    for job in JOBS:
        print(f"| {labels[job]} | {medians[job]:,.1f} |")
    print()
    print(f"autotune / bad: **{medians['autotune'] / medians['bad']:.3f}**, "
          f"autotune / default: **{medians['autotune'] / medians['default']:.3f}**; search: "
          + ", ".join(f"{res['search_steps']} steps ({res['search_s']:.0f} s)" for res in results["autotune"]))


def main(argv=None) -> None:
    args = parse_args(argv)
    if args.worker:
        worker(args)
    else:
        driver(args)


if __name__ == "__main__":
    main()
