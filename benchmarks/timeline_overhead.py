"""What the timeline costs: the same training with and without it, in the same processes.

    python benchmarks/timeline_overhead.py                       # ResNet-18 at 64x64, batch 32
    python benchmarks/timeline_overhead.py --model smallcnn --image-size 32
    python benchmarks/timeline_overhead.py --model grads         # communication only: ResNet-18's
                                                                 # 62 gradients allreduced, no compute

It starts ``roundelrun -np 2`` on itself. Each rank trains with
``hvd.DistributedOptimizer`` (SGD, random fixed batch) and alternates timed
spans with the timeline off and on (``hvd.start_timeline`` /
``hvd.stop_timeline``, a new file per span, as rank 0 writes it), so both
halves share the machine's load. Rank 0 prints each span, then the median
steps/s of each half and the throughput lost with the timeline on.
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
import torch.nn.functional as F

import roundel.torch as hvd

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "examples"))
import models  # noqa: E402  (examples/models.py)

MODELS = {"resnet18": models.resnet18, "resnet50": models.resnet50, "smallcnn": models.SmallCNN}


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--model", default="resnet18", help="grads, resnet18, resnet50 or smallcnn")
    p.add_argument("--batch-size", type=int, default=32)
    p.add_argument("--image-size", type=int, default=64)
    p.add_argument("--spans", type=int, default=6, help="timed spans per setting (off and on alternate)")
    p.add_argument("--steps", type=int, default=10, help="steps per span")
    p.add_argument("--warmup", type=int, default=3)
    p.add_argument("--threads", type=int, default=max(1, (os.cpu_count() or 2) // 2))
    p.add_argument("--timeout", type=float, default=600)
    return p.parse_args(argv)


def worker(args) -> None:
    hvd.init()
    torch.manual_seed(0)
    torch.set_num_threads(args.threads)
    model = MODELS["resnet18" if args.model == "grads" else args.model](10)
    params = list(model.parameters())
    if args.model == "grads":
        grads = [torch.randn_like(p) for p in params]

        def step():
            handles = [hvd.allreduce_async_(g, name=f"grad.{i}") for i, g in enumerate(grads)]
            for h in handles:
                hvd.synchronize(h)
    else:
        optimizer = hvd.DistributedOptimizer(torch.optim.SGD(params, lr=0.01, momentum=0.9),
                                             named_parameters=model.named_parameters())
        images = torch.randn(args.batch_size, 3, args.image_size, args.image_size)
        labels = torch.randint(0, 10, (args.batch_size,))

        def step():
            optimizer.zero_grad()
            F.cross_entropy(model(images), labels).backward()
            optimizer.step()

    for _ in range(args.warmup):
        step()
    rates = {"off": [], "on": []}
    # only rank 0 writes the timeline; the others' start_timeline() calls do nothing
    directory = tempfile.mkdtemp(prefix="roundel-timeline-") if hvd.rank() == 0 else tempfile.gettempdir()
    for span in range(2 * args.spans):
        setting = ("off", "on")[(span + span // 2) % 2]  # off on on off off on ...: neither always first
        if setting == "on":
            hvd.start_timeline(os.path.join(directory, f"span{span}.json"))
        hvd.allreduce(torch.zeros(1), name="sync")
        start = time.perf_counter()
        for _ in range(args.steps):
            step()
        hvd.allreduce(torch.zeros(1), name="sync")
        elapsed = time.perf_counter() - start
        if setting == "on":
            hvd.stop_timeline()
        rates[setting].append(args.steps / elapsed)
        if hvd.rank() == 0:
            print(f"span {span:2d} timeline {setting:3s} {args.steps / elapsed:8.2f} steps/s", flush=True)
    if hvd.rank() == 0:
        off, on = statistics.median(rates["off"]), statistics.median(rates["on"])
        size = sum(os.path.getsize(os.path.join(directory, f)) for f in os.listdir(directory))
        print(f"model {args.model}: median {off:.2f} steps/s without the timeline, {on:.2f} with it: "
              f"{100 * (off - on) / off:+.1f} % throughput lost ({size / 1e6:.1f} MB of timeline written)",
              flush=True)
        shutil.rmtree(directory, ignore_errors=True)
    hvd.shutdown()


def main() -> int:
    args = parse_args()
    if "ROUNDEL_RANK" in os.environ:
        worker(args)
        return 0
    command = [sys.executable, "-m", "roundel.runner.launch", "-np", "2", sys.executable, __file__, *sys.argv[1:]]
    return subprocess.run(command, timeout=args.timeout).returncode


if __name__ == "__main__":
    sys.exit(main())
