"""Elastic reset at N ranks: from a worker's death to the survivors' first committed step.

Each rank runs on a host of its own, a one-slot loopback address
(127.0.0.1 .. 127.0.0.N), all on this machine, under the real ``roundelrun``
with a host-discovery script, as an elastic job of ``-np N --min-np N-1``.
In the first generation the last rank kills itself (SIGKILL) at a given step
(``benchmarks/elastic_reset_worker.py``); the launcher blacklists its host,
and the survivors reset: they find the failure, agree on a new generation,
rebuild their communicators, restore the last commit and train on. Reported:
seconds from the kill to the first commit after it, and from the job's start
to its first commit (processes, imports and ``hvd.init()``), with Horovod's
figures from its issue #3556 (a reset took 0.4 s at 2 ranks, 7.1 s at 8 and
15.8 s at 16) for reference.

    python benchmarks/elastic_reset.py --np 4,8,16 [--json out.json]

With more ranks than cores the processes share them, and the figures then
include waiting for a core.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
HOROVOD_3556 = {2: 0.4, 8: 7.1, 16: 15.8}


def measure(ranks: int, kill_at_step: int, timeout_s: float) -> dict:
    """Run one job of ``ranks`` ranks; return its figures."""
    with tempfile.TemporaryDirectory() as tmp:
        hosts = Path(tmp) / "hosts"
        hosts.write_text("".join(f"127.0.0.{i}:1\n" for i in range(1, ranks + 1)))
        discover = Path(tmp) / "discover.sh"
        discover.write_text(f"#!/bin/sh\ncat {hosts}\n")
        discover.chmod(0o755)
        launcher = Path(sys.executable).parent / "roundelrun"
        command = [str(launcher), "-np", str(ranks), "--min-np", str(ranks - 1), "--host-discovery-script",
                   str(discover), "--elastic-timeout", "120", sys.executable, str(HERE / "elastic_reset_worker.py")]
        env = {**os.environ, "KILL_AT_STEP": str(kill_at_step), "STEPS": str(kill_at_step + 20),
               "OMP_NUM_THREADS": "1"}
        started = time.time()
        result = subprocess.run(command, env=env, capture_output=True, text=True, timeout=timeout_s)
    killed, commits = None, []
    for line in result.stdout.splitlines():
        payload = line.split(">:", 1)[-1].strip()
        if payload.startswith("KILLED "):
            killed = float(payload.split()[1])
        elif payload.startswith("COMMIT "):
            _, step, at = payload.split()
            commits.append((int(step), float(at)))
    if result.returncode != 0 or killed is None or not any(at > killed for _, at in commits):
        raise RuntimeError(f"the {ranks}-rank job did not train on after the kill (exit {result.returncode}):\n"
                           + result.stdout[-3000:] + result.stderr[-3000:])
    after = min(at for _, at in commits if at > killed)
    return {"ranks": ranks, "reset_s": after - killed, "first_commit_s": commits[0][1] - started,
            "horovod_3556_s": HOROVOD_3556.get(ranks)}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--np", default="4,8,16", help="job sizes (default 4,8,16)")
    parser.add_argument("--kill-at-step", type=int, default=20, help="step at which the last rank dies")
    parser.add_argument("--timeout", type=float, default=300, help="seconds allowed per job")
    parser.add_argument("--json", metavar="PATH", help="also write the figures as JSON")
    args = parser.parse_args()
    print(f"{os.cpu_count()} cores\n\n| ranks | kill to first commit after it (s) | start to first commit (s) "
          "| Horovod #3556 reset (s) |\n| ---: | ---: | ---: | ---: |")
    results = []
    for ranks in (int(n) for n in args.np.split(",")):
        row = measure(ranks, args.kill_at_step, args.timeout)
        results.append(row)
        reference = f"{row['horovod_3556_s']:.1f}" if row["horovod_3556_s"] else ""
        print(f"| {ranks} | {row['reset_s']:.2f} | {row['first_commit_s']:.1f} | {reference} |", flush=True)
    if args.json:
        Path(args.json).write_text(json.dumps({"cores": os.cpu_count(), "results": results}, indent=2))
        print(f"\nwrote {args.json}")


if __name__ == "__main__":
    main()
