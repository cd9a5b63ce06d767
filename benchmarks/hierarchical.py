"""Hierarchical against flat allreduce and allgather, across 2 simulated hosts with a shaped link.

Run as root on Linux (it builds network namespaces, as tests/netns_util.py does)::

    python benchmarks/hierarchical.py                  # 2 hosts x 2 slots, 1 Gbit/s, 64 MiB
    python benchmarks/hierarchical.py --rate 500mbit --size-mib 16

It starts hosts rdl-h1 and rdl-h2 (namespaces with sshd on 10.231.0.0/24),
limits what each host sends to ``--rate`` with a ``tc`` token bucket on its
interface (ranks on one host talk over its loopback, unshaped), and launches
itself over ssh with ``roundelrun -H h1:2,h2:2 --hierarchical-allreduce
--hierarchical-allgather``. Every rank then times, in the same processes and
alternating round by round, the job's hierarchical communicator and the flat
Gloo communicator it wraps, on the same float32 buffer: allreduce of
``--size-mib`` MiB (Sum) and allgather of a quarter of that per rank. A
round's time is the slowest rank's; the figure is the median over rounds.
Each result is checked once against the exact expected value. Rank 0 prints
a Markdown table and the ratio flat time / hierarchical time (> 1: the
hierarchical path is faster).
"""

from __future__ import annotations

import argparse
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch

import roundel.torch as hvd
from roundel.common import basics
from roundel.ops import ReduceOp

REPO = Path(__file__).resolve().parent.parent


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--rate", default="1gbit", help="what each host may send, as tc writes it (default 1gbit)")
    p.add_argument("--size-mib", type=float, default=64.0, help="allreduce size in MiB (default 64)")
    p.add_argument("--rounds", type=int, default=5, help="rounds per communicator (default 5)")
    p.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    return p.parse_args(argv)


def drive(args: argparse.Namespace) -> int:
    """Build the hosts, shape their link and launch the workers over ssh."""
    sys.path.insert(0, str(REPO / "tests"))
    from netns_util import SSH_PORT, NetnsHosts, missing_tools

    missing = missing_tools() + ([] if shutil.which("tc") else ["tc"])
    if missing:
        print(f"benchmarks/hierarchical.py needs {', '.join(missing)} (it builds network namespaces)",
              file=sys.stderr)
        return 2
    with tempfile.TemporaryDirectory(prefix="roundel-hier-") as workdir:
        hosts = NetnsHosts(2, Path(workdir))
        try:
            hosts.shape(args.rate)
            h1, h2 = hosts.addrs
            command = [sys.executable, "-m", "roundel.runner.launch", "-p", str(SSH_PORT), "-i", hosts.key,
                       "-np", "4", "-H", f"{h1}:2,{h2}:2", "--hierarchical-allreduce", "--hierarchical-allgather",
                       sys.executable, str(Path(__file__).resolve()), "--worker", "--rate", args.rate,
                       "--size-mib", str(args.size_mib), "--rounds", str(args.rounds)]
            env = {**os.environ, **hosts.ssh_env(),
                   "PYTHONPATH": os.pathsep.join(filter(None, [str(REPO), os.environ.get("PYTHONPATH")]))}
            return subprocess.run(command, env=env).returncode
        finally:
            hosts.close()


def work(args: argparse.Namespace) -> int:
    """One rank: time the hierarchical communicator against the flat one it wraps."""
    hvd.init()
    rank, size = hvd.rank(), hvd.size()
    hier = basics.runtime().process_sets[0][1]
    if type(hier).__name__ != "HierarchicalBackend":
        print(f"rank {rank}: the job's communicator is {type(hier).__name__}, not hierarchical", file=sys.stderr)
        return 1
    flat = hier.flat
    count = int(args.size_mib * (1 << 20)) // 4
    width = count // size
    expected_sum = size * (size + 1) / 2  # rank r contributes r + 1

    def allreduce(backend):
        buffer = torch.full((count,), float(rank + 1))
        backend.allreduce(buffer, ReduceOp.Sum)
        return buffer

    def allgather(backend):
        out = torch.empty(width * size)
        backend.allgather(out, torch.full((width,), float(rank + 1)))
        return out

    gathered_ok = torch.arange(1, size + 1, dtype=torch.float32).repeat_interleave(width)
    wrong = 0
    for backend in (hier, flat):
        wrong += int(not torch.equal(allreduce(backend), torch.full((count,), expected_sum)))
        wrong += int(not torch.equal(allgather(backend), gathered_ok))

    def timed(call, backend) -> float:
        flat.barrier()
        start = time.perf_counter()
        call(backend)
        took = torch.tensor([time.perf_counter() - start], dtype=torch.float64)
        flat.allreduce(took, ReduceOp.Max)
        return took.item()

    times = {(op, which): [] for op in ("allreduce", "allgather") for which in ("hierarchical", "flat")}
    for _ in range(args.rounds):
        for op, call in (("allreduce", allreduce), ("allgather", allgather)):
            for which, backend in (("hierarchical", hier), ("flat", flat)):
                times[(op, which)].append(timed(call, backend))
    mistakes = torch.tensor([wrong], dtype=torch.int64)
    flat.allreduce(mistakes, ReduceOp.Sum)
    if rank == 0:
        print(f"2 hosts x 2 ranks, each host sending at most {args.rate}; median of {args.rounds} rounds")
        print("| collective | bytes | hierarchical s | flat s | flat / hierarchical |")
        print("|---|---|---|---|---|")
        for op, nbytes in (("allreduce", count * 4), ("allgather", width * 4 * size)):
            h = statistics.median(times[(op, "hierarchical")])
            f = statistics.median(times[(op, "flat")])
            print(f"| {op} | {nbytes / (1 << 20):g} MiB | {h:.3f} | {f:.3f} | {f / h:.2f} |")
        print("results checked:", "all correct" if mistakes.item() == 0 else f"{mistakes.item()} WRONG")
    hvd.shutdown()
    return 0 if mistakes.item() == 0 else 1


if __name__ == "__main__":
    parsed = parse_args()
    sys.exit(work(parsed) if parsed.worker else drive(parsed))
