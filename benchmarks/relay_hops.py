"""What one relay hop adds to a step's control round trip, measured on real jobs.

Each rank runs on a host of its own, a one-slot loopback address
(localhost, 127.0.0.1 .. 127.0.0.N-1), all on this machine, under the real
``roundelrun``. With relays forced on (``ROUNDEL_RELAY_FROM_RANKS=2``) and a
relay fanout of 1, the hosts' relays form a chain: rank k reaches rank 0
through the relays of ranks k-1 .. 1, so the last rank is D = N - 1 hops
from rank 0. Next to each chain the same ranks run with every rank connected
to rank 0 (relays off). Each rank allreduces a 4-byte tensor under one name,
``--steps`` times in a row: cached after the first, its data riding on the
control channel (the coordinator reduces it), so a step is one control round
trip to the farthest rank and nothing else. Reported: rank 0's median
milliseconds per step, chained and direct, and the fit
``t(D) = c + 2 D h`` to the chains: h is one hop, one way (the relay's
handling of a message and its way through the loopback interface, with the
wake-ups of the processes involved).

    python benchmarks/relay_hops.py --np 2,3,4,5,6 [--steps 2000] [--json out.json]

With more ranks than cores the processes share them; a step's processes
mostly wait for one another, one at a time, which a few cores serve.
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

import numpy as np

LAUNCHER = Path(sys.executable).parent / "roundelrun"


def hosts(ranks: int) -> str:
    """``-H`` for ``ranks`` one-slot loopback hosts, rank 0's first."""
    return ",".join(["localhost:1"] + [f"127.0.0.{i}:1" for i in range(1, ranks)])


def measure(ranks: int, steps: int, chained: bool, timeout_s: float = 300.0) -> float:
    """Rank 0's median milliseconds per step of a ``ranks``-rank job, its relays chained or off."""
    relays = {"ROUNDEL_RELAY_FROM_RANKS": "2", "ROUNDEL_RELAY_FANOUT": "1"} if chained else \
        {"ROUNDEL_RELAY_FROM_RANKS": "100000"}
    command = [str(LAUNCHER), "-np", str(ranks), "-H", hosts(ranks), sys.executable, __file__, "--worker",
               "--steps", str(steps)]
    env = {**os.environ, **relays, "OMP_NUM_THREADS": "1"}
    result = subprocess.run(command, env=env, capture_output=True, text=True, timeout=timeout_s)
    for line in result.stdout.splitlines():
        payload = line.split(">:", 1)[-1].strip()
        if payload.startswith("STEP_MS "):
            return float(payload.split()[1])
    raise RuntimeError(f"the {ranks}-rank job reported no step time (exit {result.returncode}):\n"
                       f"{result.stdout[-2000:]}\n{result.stderr[-2000:]}")


def fit_hop(depths: list, chain_ms: list) -> dict:
    """Least squares of ``t = c + 2 D h`` over the chains; h and c in seconds, with the largest relative error."""
    d, t = np.asarray(depths, dtype=float), np.asarray(chain_ms, dtype=float) / 1e3
    (c, h), *_ = np.linalg.lstsq(np.column_stack([np.ones_like(d), 2 * d]), t, rcond=None)
    error = float(np.max(np.abs(c + 2 * d * h - t) / t))
    return {"c_s": float(c), "hop_s": float(h), "error": error}


def worker(steps: int) -> None:
    """One rank's loop: ``steps`` 4-byte allreduces under one name; rank 0 prints its median step time."""
    import torch

    import roundel.torch as hvd
    hvd.init()
    tensor = torch.ones(1)
    for _ in range(50):  # the name is cached, the connections warm
        hvd.allreduce(tensor, name="hop")
    times = []
    for _ in range(steps):
        start = time.perf_counter()
        hvd.allreduce(tensor, name="hop")
        times.append(time.perf_counter() - start)
    if hvd.rank() == 0:
        print(f"STEP_MS {statistics.median(times) * 1e3:.4f}", flush=True)
    hvd.shutdown()


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--np", default="2,3,4,5,6", help="rank counts, comma-separated (default: %(default)s)")
    p.add_argument("--steps", type=int, default=2000, help="steps timed per job (default: %(default)s)")
    p.add_argument("--json", help="write the figures to this file")
    p.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    args = p.parse_args()
    if args.worker:
        worker(args.steps)
        return
    counts = [int(n) for n in args.np.split(",")]
    if min(counts) < 2:
        p.error("--np: every rank count must be at least 2 (a chain needs a rank besides rank 0)")
    rows = []
    print(f"{'ranks':>5} {'depth':>5} {'chained (ms)':>12} {'direct (ms)':>11}")
    for ranks in counts:
        chained, direct = measure(ranks, args.steps, True), measure(ranks, args.steps, False)
        rows.append({"np": ranks, "depth": ranks - 1, "chain_ms": chained, "direct_ms": direct})
        print(f"{ranks:>5} {ranks - 1:>5} {chained:>12.3f} {direct:>11.3f}", flush=True)
    fit = fit_hop([r["depth"] for r in rows], [r["chain_ms"] for r in rows]) if len(rows) >= 2 else None
    if fit is not None:
        print(f"fit t = c + 2 D h: c = {fit['c_s'] * 1e3:.3f} ms, h = {fit['hop_s'] * 1e6:.1f} µs per hop "
              f"(largest error {fit['error'] * 100:.1f} %)")
    print(f"on {os.cpu_count()} cores; {args.steps} steps per job")
    if args.json:
        Path(args.json).write_text(json.dumps({"cores": os.cpu_count(), "steps": args.steps, "rows": rows,
                                               "fit": fit}, indent=1) + "\n")


if __name__ == "__main__":
    main()
