"""Latency of one blocking collective at a time: roundel against raw ``torch.distributed`` Gloo, p50 and p99.

    python benchmarks/latency.py                      # 2 and 4 ranks, shared memory on and off (~1 min)
    python benchmarks/latency.py --hosts 1gbit,10gbit # also 2 network-namespace hosts, tc-shaped (root)
    python benchmarks/latency.py --quick              # fewer calls per size
    python benchmarks/latency.py --pin                # each rank on a core of its own (taskset-like)

Each configuration is one ``roundelrun`` job whose ranks run roundel
(``hvd.init()``) and, in the same processes, a plain Gloo process group of
the same ranks. For every collective (allreduce, broadcast, allgather) and
size (4 B to 4 MiB), the two alternate in blocks of calls; every call is
timed on every rank, and a call's latency is the slowest rank's. The table
gives p50 and p99 per size, the ratio of raw Gloo's p50 to roundel's (> 1:
roundel is faster), and roundel's own cost: the p50 of a call's time outside
the calls roundel makes on its transport (its Python, thread hand-offs and,
where the call is negotiated, the round trip to rank 0), the slowest rank's;
a transfer roundel starts in Gloo's background (an allreduce of 1 MiB or more
that Gloo's ring carries) counts as its own. The last column is the CPU time
of the calling thread per call, roundel's and raw Gloo's: the median over a
size's blocks of calls, on the busiest rank. Raw Gloo's calling thread hands
the work to Gloo's threads and waits; roundel's does the work itself, so the
column shows where a call's CPU goes more than which side is cheaper; it is
the figure that moves when roundel's own Python gets cheaper, where latency
on a busy 2-core machine often does not. ``ROUNDEL_SHARED_MEMORY=0`` keeps
roundel off shared memory: on Gloo, and on its peer links. Across
hosts, each host is a network namespace whose link ``tc`` limits to the
given rate (tests/netns_util.py); one rank per host. ``--pin`` keeps each
rank of a local job (all its threads) on core ``local rank % cores``: left to itself, the
scheduler may run both ranks of a 2-rank job on one core for a whole run,
which at 256 KiB costs about four times the time on this machine. Writes
``latency.png`` (p50 against size, one panel per collective) and prints
Markdown, ready for docs/performance.md.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from datetime import timedelta
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
SIZES = (4, 64, 1024, 16 * 1024, 256 * 1024, 4 * 1024 * 1024)
OPS = ("allreduce", "broadcast", "allgather")
RESULT = "LATENCY "


def _human(nbytes: int) -> str:
    for unit, scale in (("MiB", 1 << 20), ("KiB", 1 << 10)):
        if nbytes >= scale:
            return f"{nbytes // scale} {unit}"
    return f"{nbytes} B"


# ------------------------------------------------------------------ the ranks
def work(args: argparse.Namespace) -> int:
    """One rank: time each collective and size, roundel and raw Gloo alternately; rank 0 prints the result."""
    import torch
    import torch.distributed as dist

    import roundel.torch as hvd
    from roundel.common import basics

    if args.pin:  # before any thread starts: roundel's threads and Gloo's inherit it
        os.sched_setaffinity(0, {int(os.environ["ROUNDEL_LOCAL_RANK"]) % os.cpu_count()})
    hvd.init()
    rank, size = hvd.rank(), hvd.size()
    # raw Gloo on the same interface as roundel's: the host's own address (loopback on one host)
    own = "127.0.0.1" if hvd.local_size() == size else os.environ["HOROVOD_HOSTNAME"]
    address = None
    if rank == 0:
        import socket
        with socket.socket() as s:
            s.bind((own, 0))
            address = (own, s.getsockname()[1])
    store_host, port = hvd.broadcast_object(address, root_rank=0, name="latency.store")
    store = dist.TCPStore(store_host, port, size, rank == 0, timeout=timedelta(seconds=60))
    options = dist.ProcessGroupGloo._Options()
    options._timeout = timedelta(seconds=60)
    options._devices = [dist.ProcessGroupGloo.create_device(hostname=own)]
    raw_group = dist.ProcessGroupGloo(store, rank, size, options)
    root = dist.BroadcastOptions()
    root.rootRank = 0
    maximum = dist.AllreduceOptions()
    maximum.reduceOp = dist.ReduceOp.MAX

    def barrier():
        raw_group.allreduce([torch.zeros(1)]).wait()

    in_transport = [0.0]  # seconds this rank has spent inside roundel's transport calls
    transport = basics.runtime().engine.job_backend

    def timed(call):
        def timed_call(*args):
            began = time.perf_counter()
            try:
                return call(*args)
            finally:
                in_transport[0] += time.perf_counter() - began
        return timed_call

    # what roundel's blocking collectives call (shared memory reduces a fused batch in allreduce_fused)
    for method in ("allreduce", "allreduce_fused", "allgather", "broadcast"):
        if hasattr(transport, method):
            setattr(transport, method, timed(getattr(transport, method)))

    def calls(op: str, nbytes: int) -> dict:
        numel = max(1, nbytes // 4)
        mine, raw = torch.zeros(numel), torch.zeros(numel)
        gathered = torch.empty(numel * size)
        name = f"latency.{op}.{nbytes}"
        if op == "allreduce":
            return {"roundel": lambda: hvd.allreduce_(mine, op=hvd.Sum, name=name),
                    "raw": lambda: raw_group.allreduce([raw]).wait()}
        if op == "broadcast":
            return {"roundel": lambda: hvd.broadcast_(mine, root_rank=0, name=name),
                    "raw": lambda: raw_group.broadcast([raw], root).wait()}
        return {"roundel": lambda: hvd.allgather(mine, name=name),
                "raw": lambda: raw_group._allgather_base(gathered, raw).wait()}

    rows = []
    for op in OPS:
        for nbytes in SIZES:
            steps = calls(op, nbytes)
            count = args.calls if nbytes <= 64 * 1024 else max(20, args.calls // 4)
            for step in steps.values():
                for _ in range(5):
                    step()
            times: dict[str, list[float]] = {label: [] for label in steps}
            cpu: dict[str, list[float]] = {label: [] for label in steps}  # per block: the calling thread's CPU/call
            own: list[float] = []  # roundel's calls' time outside its transport
            block = 10
            for start in range(0, count, block):
                order = list(steps) if (start // block) % 2 == 0 else list(steps)[::-1]
                for label in order:
                    barrier()
                    cpu_began = time.thread_time()
                    for _ in range(block):
                        began, inside = time.perf_counter(), in_transport[0]
                        steps[label]()
                        times[label].append(time.perf_counter() - began)
                        if label == "roundel":
                            own.append(times[label][-1] - (in_transport[0] - inside))
                    cpu[label].append((time.thread_time() - cpu_began) / block)
            row = {"op": op, "bytes": nbytes}
            for label, seconds in (*times.items(), ("roundel_own", own)):
                mine_t = torch.tensor(seconds, dtype=torch.float64)
                raw_group.allreduce([mine_t], maximum).wait()  # each call's slowest rank
                ordered = sorted(mine_t.tolist())
                row[f"{label}_p50"] = statistics.median(ordered)
                row[f"{label}_p99"] = ordered[min(len(ordered) - 1, int(0.99 * len(ordered)))]
            for label, per_block in cpu.items():
                busiest = torch.tensor([statistics.median(per_block)], dtype=torch.float64)
                raw_group.allreduce([busiest], maximum).wait()  # the busiest rank's median block
                row[f"{label}_cpu"] = busiest.item()
            rows.append(row)
    if rank == 0:
        print(RESULT + json.dumps(rows), flush=True)
    return 0


# ------------------------------------------------------------------ the driver
def _run(command: list, env: dict) -> list[dict]:
    result = subprocess.run(command, env=env, capture_output=True, text=True, timeout=900)
    for line in result.stdout.splitlines():
        payload = line.split(">:", 1)[-1] if line.startswith("[") else line
        if payload.startswith(RESULT):
            return json.loads(payload[len(RESULT):])
    raise RuntimeError(f"{' '.join(map(str, command))} gave no result (exit {result.returncode}):\n"
                       f"{result.stdout[-3000:]}\n{result.stderr[-3000:]}")


def _worker_command(args: argparse.Namespace, pin: bool = False) -> list[str]:
    return [sys.executable, str(Path(__file__).resolve()), "--worker", "--calls", str(args.calls),
            *(["--pin"] if pin else [])]


def local(args: argparse.Namespace, ranks: int, shared_memory: bool) -> list[dict]:
    env = {**os.environ, "ROUNDEL_SHARED_MEMORY": "1" if shared_memory else "0"}
    return _run([sys.executable, "-m", "roundel.runner.launch", "-np", str(ranks), *_worker_command(args, args.pin)],
                env)


def across_hosts(args: argparse.Namespace, rate: str) -> list[dict]:
    sys.path.insert(0, str(REPO / "tests"))
    from netns_util import SSH_PORT, NetnsHosts

    with tempfile.TemporaryDirectory(prefix="roundel-latency-") as workdir:
        hosts = NetnsHosts(2, Path(workdir))
        try:
            hosts.shape(rate)
            h1, h2 = hosts.addrs
            env = {**os.environ, **hosts.ssh_env(),
                   "PYTHONPATH": os.pathsep.join(filter(None, [str(REPO), os.environ.get("PYTHONPATH")]))}
            return _run([sys.executable, "-m", "roundel.runner.launch", "-p", str(SSH_PORT), "-i", hosts.key,
                         "-np", "2", "-H", f"{h1}:1,{h2}:1", *_worker_command(args)], env)
        finally:
            hosts.close()


def report(label: str, rows: list[dict]) -> None:
    print(f"\n**{label}** (seconds are the slowest rank's per call; ratio = raw p50 / roundel p50, > 1: "
          "roundel faster)\n")
    print("| collective | size | roundel p50 | roundel p99 | raw Gloo p50 | raw Gloo p99 | ratio p50 | "
          "roundel's own p50 | CPU per call, roundel / raw |")
    print("|---|---:|---:|---:|---:|---:|---:|---:|---:|")
    for row in rows:
        print(f"| {row['op']} | {_human(row['bytes'])} | {row['roundel_p50'] * 1e3:.3f} ms | "
              f"{row['roundel_p99'] * 1e3:.3f} ms | {row['raw_p50'] * 1e3:.3f} ms | {row['raw_p99'] * 1e3:.3f} ms | "
              f"{row['raw_p50'] / row['roundel_p50']:.2f} | {row['roundel_own_p50'] * 1e3:.3f} ms | "
              f"{row['roundel_cpu'] * 1e6:.0f} / {row['raw_cpu'] * 1e6:.0f} µs |")


def plot(path: Path, results: dict[str, list[dict]]) -> Path:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, len(OPS), figsize=(5 * len(OPS), 4), sharey=True)
    for axis, op in zip(axes, OPS):
        for label, rows in results.items():
            mine = [r for r in rows if r["op"] == op]
            sizes = [r["bytes"] for r in mine]
            line = axis.plot(sizes, [r["roundel_p50"] * 1e3 for r in mine], marker="o", label=f"roundel, {label}")
            axis.plot(sizes, [r["raw_p50"] * 1e3 for r in mine], linestyle="--", color=line[0].get_color(),
                      label=f"raw Gloo, {label}")
        axis.set_xscale("log", base=2)
        axis.set_yscale("log")
        axis.set_title(f"{op}: p50 latency")
        axis.set_xlabel("bytes")
        axis.grid(True, which="both", alpha=0.3)
    axes[0].set_ylabel("ms per call")
    axes[-1].legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)
    return path.resolve()


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--ranks", default="2,4", help="local job sizes (default 2,4)")
    p.add_argument("--hosts", default="", help="tc rates for the 2-host runs, e.g. 1gbit,10gbit (needs root)")
    p.add_argument("--calls", type=int, default=200, help="calls per size up to 64 KiB, a quarter above (200)")
    p.add_argument("--quick", action="store_true", help="40 calls per size")
    p.add_argument("--png", default="latency.png", help="where to write the plot (default latency.png)")
    p.add_argument("--pin", action="store_true", help="each rank of a local job on core (local rank %% cores)")
    p.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    if args.quick:
        args.calls = 40
    return args


def main(argv=None) -> int:
    args = parse_args(argv)
    if args.worker:
        return work(args)
    results: dict[str, list[dict]] = {}
    for ranks in (int(n) for n in args.ranks.split(",") if n):
        for shared in (True, False):
            label = f"{ranks} ranks, shared memory {'on' if shared else 'off'}"
            results[label] = local(args, ranks, shared)
            report(label, results[label])
    for rate in (r for r in args.hosts.split(",") if r):
        if not shutil.which("tc") or os.geteuid() != 0:
            print("\nskipped the 2-host runs: they need root and tc", file=sys.stderr)
            break
        label = f"2 hosts x 1 rank, {rate}"
        results[label] = across_hosts(args, rate)
        report(label, results[label])
    print(f"\nplot: {plot(Path(args.png), results)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
