"""Gradient compression: samples/sec of DistributedOptimizer uncompressed, with fp16, and with PowerSGD.

Run it under the launcher (CPU; one host's shared memory)::

    roundelrun -np 2 python benchmarks/powersgd.py
    roundelrun -np 2 python benchmarks/powersgd.py --width 2048 --layers 4 --rank 4 --spans 5

or, as root on Linux, across two simulated hosts whose link is shaped (network
namespaces with sshd and a ``tc`` token bucket, as tests/netns_util.py and
benchmarks/hierarchical.py build them; one rank per host)::

    python benchmarks/powersgd.py --netns --rate 1gbit

One job holds three trainings of the same model (``--layers`` Linear layers of
``--width`` features with ReLU between them, SGD with momentum, cross-entropy
on one fixed random batch of ``--batch-size`` per rank) in the same
processes, alternating span by span (``--steps`` steps between two barriers,
the order reversed every other round):

    none     hvd.DistributedOptimizer(SGD)
    fp16     hvd.DistributedOptimizer(SGD, compression=hvd.Compression.fp16)
    powersgd hvd.DistributedOptimizer(SGD, compression=hvd.PowerSGD(rank=--rank, start_iter=1))

It prints the bytes each training submits to allreduce per step (counted at
the submission) and samples/sec (ranks x batch x steps / span seconds, median
over spans), and the ratios to ``none``. PowerSGD pays off where the link,
not the arithmetic, is the bottleneck: on one host's shared memory the
matrix products may cost more than the bytes they save.
"""

from __future__ import annotations

import argparse
import statistics
import time


def parse():
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--width", type=int, default=2048)
    p.add_argument("--layers", type=int, default=3)
    p.add_argument("--batch-size", type=int, default=32)
    p.add_argument("--rank", type=int, default=4)
    p.add_argument("--steps", type=int, default=5)
    p.add_argument("--spans", type=int, default=4)
    p.add_argument("--warmup", type=int, default=3)
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--netns", action="store_true", help="run on 2 network-namespace hosts, link shaped to --rate")
    p.add_argument("--rate", default="1gbit", help="with --netns: what each host may send, as tc writes it")
    return p.parse_args()


def drive_netns(args) -> int:
    """Build 2 hosts, shape their link, and launch this script on them over ssh, one rank per host."""
    import os
    import shutil
    import subprocess
    import sys
    import tempfile
    from pathlib import Path

    repo = Path(__file__).resolve().parent.parent
    sys.path.insert(0, str(repo / "tests"))
    from netns_util import SSH_PORT, NetnsHosts, missing_tools

    missing = missing_tools() + ([] if shutil.which("tc") else ["tc"])
    if missing:
        print(f"--netns needs {', '.join(missing)}", file=sys.stderr)
        return 2
    passed = [a for a in sys.argv[1:] if a != "--netns"]
    with tempfile.TemporaryDirectory(prefix="roundel-powersgd-") as workdir:
        hosts = NetnsHosts(2, Path(workdir))
        try:
            hosts.shape(args.rate)
            h1, h2 = hosts.addrs
            command = [sys.executable, "-m", "roundel.runner.launch", "-p", str(SSH_PORT), "-i", hosts.key,
                       "-np", "2", "-H", f"{h1}:1,{h2}:1", sys.executable, str(Path(__file__).resolve()), *passed]
            env = {**os.environ, **hosts.ssh_env(),
                   "PYTHONPATH": os.pathsep.join(filter(None, [str(repo), os.environ.get("PYTHONPATH")]))}
            return subprocess.run(command, env=env).returncode
        finally:
            hosts.close()


def main():
    args = parse()
    if args.netns:
        raise SystemExit(drive_netns(args))
    import torch

    import roundel.torch as hvd
    import roundel.torch.optimizer as optimizer_module

    submitted = []

    def counting(start):
        def wrapper(tensors, *a, **k):
            for t in tensors if isinstance(tensors, list) else [tensors]:
                submitted.append(t.numel() * t.element_size())
            return start(tensors, *a, **k)
        return wrapper

    optimizer_module.allreduce_async_ = counting(optimizer_module.allreduce_async_)
    optimizer_module.grouped_allreduce_async_ = counting(optimizer_module.grouped_allreduce_async_)

    torch.set_num_threads(args.threads)
    hvd.init()
    size = hvd.size()

    def make_model():
        torch.manual_seed(0)
        layers = []
        for _ in range(args.layers - 1):
            layers += [torch.nn.Linear(args.width, args.width), torch.nn.ReLU()]
        return torch.nn.Sequential(*layers, torch.nn.Linear(args.width, 10))

    gen = torch.Generator().manual_seed(hvd.rank())
    x = torch.randn(args.batch_size, args.width, generator=gen)
    y = torch.randint(0, 10, (args.batch_size,), generator=gen)
    compressions = {"none": hvd.Compression.none, "fp16": hvd.Compression.fp16,
                    "powersgd": hvd.PowerSGD(rank=args.rank, start_iter=1)}
    trainings = {}
    for kind, compression in compressions.items():
        model = make_model()
        opt = hvd.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.01, momentum=0.9),
                                       named_parameters=model.named_parameters(), compression=compression)
        trainings[kind] = (model, opt)
    bytes_per_step = {}

    def run(kind, steps):
        model, opt = trainings[kind]
        for _ in range(steps):
            submitted.clear()
            opt.zero_grad()
            torch.nn.functional.cross_entropy(model(x), y).backward()
            opt.step()
            bytes_per_step[kind] = sum(submitted)

    for kind in trainings:
        run(kind, args.warmup)
    kinds = list(trainings)
    rates = {kind: [] for kind in kinds}
    for i in range(args.spans):
        for kind in kinds if i % 2 == 0 else kinds[::-1]:
            hvd.barrier()
            start = time.perf_counter()
            run(kind, args.steps)
            hvd.barrier()
            rates[kind].append(size * args.batch_size * args.steps / (time.perf_counter() - start))
    if hvd.rank() == 0:
        params = sum(p.numel() for p in trainings["none"][0].parameters())
        print(f"{size} ranks, MLP {args.layers} x {args.width} ({params / 1e6:.2f} M parameters), SGD, "
              f"batch {args.batch_size} per rank, PowerSGD rank {args.rank}, {args.spans} spans of "
              f"{args.steps} steps each")
        print(f"{'':9s} {'bytes/step':>12s} {'samples/sec':>12s} {'bytes vs none':>14s} {'speed vs none':>14s}")
        for kind in kinds:
            rate = statistics.median(rates[kind])
            print(f"{kind:9s} {bytes_per_step[kind]:12,d} {rate:12.1f} "
                  f"{bytes_per_step[kind] / bytes_per_step['none']:14.4f} "
                  f"{rate / statistics.median(rates['none']):14.3f}")


if __name__ == "__main__":
    main()
