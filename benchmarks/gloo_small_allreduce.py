"""Roundel's Gloo transport alone: a small allreduce on Gloo's ring against one allgather and a local sum.

    python benchmarks/gloo_small_allreduce.py                # 2 and 4 ranks (~1 min)
    python benchmarks/gloo_small_allreduce.py --ranks 2 --blocks 30

Each job size is one ``roundelrun`` job (shared memory off). Every rank calls
the job's ``GlooBackend`` directly, the two forms alternating in blocks of 20
calls per size; a form's figure is the slowest rank's median. This is what
``GlooBackend.allreduce`` picks between (``GATHER_BYTES`` in
roundel/transport/gloo.py), without the engine around it.
"""

from __future__ import annotations

import argparse
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
ELEMENTS = (1, 16, 256, 1024, 4096, 16384, 65536)
CALLS_PER_BLOCK = 20


def work(blocks: int) -> int:
    """One rank: time both forms for every size; rank 0 prints a Markdown row per size."""
    import torch

    import roundel.torch as hvd
    from roundel.common import basics
    from roundel.ops import ReduceOp

    hvd.init()
    backend = basics.runtime().engine.job_backend.for_device("cpu")
    forms = {"ring": lambda t: backend._allreduce_work(t, ReduceOp.Sum).wait(),
             "gather": lambda t: backend._allreduce_by_allgather(t, ReduceOp.Sum)}
    for count in ELEMENTS:
        tensor = torch.ones(count)
        seconds: dict[str, list] = {form: [] for form in forms}
        for _ in range(blocks):
            for form, call in forms.items():
                for _ in range(CALLS_PER_BLOCK):
                    sent = tensor.clone()
                    started = time.perf_counter()
                    call(sent)
                    seconds[form].append(time.perf_counter() - started)
        medians = hvd.allgather_object({form: statistics.median(s) for form, s in seconds.items()})
        if hvd.rank() == 0:
            ring, gather = (max(m[form] for m in medians) * 1e3 for form in ("ring", "gather"))
            print(f"| {hvd.size()} | {count * 4} B | {ring:.3f} ms | {gather:.3f} ms | {gather / ring:.2f} |",
                  flush=True)
    hvd.shutdown()
    return 0


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--ranks", default="2,4", help="job sizes (default 2,4)")
    parser.add_argument("--blocks", type=int, default=15, help="blocks of 20 calls per form and size (15)")
    parser.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.worker:
        return work(args.blocks)
    print("| ranks | size | ring p50 | allgather + sum p50 | allgather / ring |\n|---|---:|---:|---:|---:|", flush=True)
    env = {**os.environ, "ROUNDEL_SHARED_MEMORY": "0",
           "PYTHONPATH": os.pathsep.join(filter(None, [str(REPO), os.environ.get("PYTHONPATH")]))}
    for ranks in (int(n) for n in args.ranks.split(",") if n):
        command = [sys.executable, "-m", "roundel.runner.launch", "-np", str(ranks), sys.executable, __file__,
                   "--worker", "--blocks", str(args.blocks)]
        job = subprocess.run(command, env=env, capture_output=True, text=True)
        if job.returncode != 0:
            sys.stderr.write(job.stdout + job.stderr)
            return job.returncode
        for line in job.stdout.splitlines():
            print(line.split(":", 1)[1] if line.startswith("[0]<stdout>:") else line, flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
