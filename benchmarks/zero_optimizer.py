"""Sharded optimizer state: roundel's ``shard_optimizer_state=True`` against PyTorch's ZeroRedundancyOptimizer.

Run it under the launcher (CPU, Gloo over loopback)::

    roundelrun -np 2 python benchmarks/zero_optimizer.py                 # MLP, about 8.4 M parameters
    roundelrun -np 3 python benchmarks/zero_optimizer.py --width 1024 --layers 4 --spans 5

One job holds three trainings of the same model (``--layers`` Linear layers
of ``--width`` features with ReLU between them, Adam, cross-entropy on one
fixed random batch of ``--batch-size`` per rank), side by side in the same
processes, alternating span by span (each span ``--steps`` steps between two
barriers, the order rotated every span so none always goes first):

    sharded  hvd.DistributedOptimizer(Adam, shard_optimizer_state=True)
    zero     DistributedDataParallel + torch.distributed.optim.ZeroRedundancyOptimizer(Adam), Gloo
    plain    hvd.DistributedOptimizer(Adam) (every rank holds the whole state)

It prints, per training, the optimizer-state bytes each rank holds (the
tensors in the optimizer's state on that rank, gathered to rank 0) and the
samples/sec (ranks x batch x steps / span seconds, median over spans), then
the ratios sharded / zero and sharded / plain.
"""

from __future__ import annotations

import argparse
import statistics
import time

from peer_group import start_gloo_group  # benchmarks/peer_group.py, beside this script


def parse():
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--width", type=int, default=1024)
    p.add_argument("--layers", type=int, default=8)
    p.add_argument("--batch-size", type=int, default=32)
    p.add_argument("--steps", type=int, default=5)
    p.add_argument("--spans", type=int, default=4)
    p.add_argument("--warmup", type=int, default=2)
    p.add_argument("--threads", type=int, default=1)
    return p.parse_args()


def state_bytes(optimizer) -> int:
    return sum(v.numel() * v.element_size() for s in optimizer.state.values() for v in s.values()
               if hasattr(v, "numel") and v.dim() > 0)


def main():
    args = parse()
    import torch
    import torch.distributed as dist
    from torch.distributed.optim import ZeroRedundancyOptimizer
    from torch.nn.parallel import DistributedDataParallel

    import roundel.torch as hvd

    torch.set_num_threads(args.threads)
    hvd.init()
    rank, size = hvd.rank(), hvd.size()
    start_gloo_group(hvd)

    def make_model():
        torch.manual_seed(0)
        layers = []
        for _ in range(args.layers - 1):
            layers += [torch.nn.Linear(args.width, args.width), torch.nn.ReLU()]
        return torch.nn.Sequential(*layers, torch.nn.Linear(args.width, 10))

    gen = torch.Generator().manual_seed(rank)
    x = torch.randn(args.batch_size, args.width, generator=gen)
    y = torch.randint(0, 10, (args.batch_size,), generator=gen)

    trainings = {}
    model = make_model()
    trainings["sharded"] = (model, hvd.DistributedOptimizer(torch.optim.Adam(model.parameters(), lr=1e-4),
                                                            named_parameters=model.named_parameters(),
                                                            shard_optimizer_state=True))
    model = make_model()
    ddp = DistributedDataParallel(model)
    trainings["zero"] = (ddp, ZeroRedundancyOptimizer(ddp.parameters(), optimizer_class=torch.optim.Adam, lr=1e-4))
    model = make_model()
    trainings["plain"] = (model, hvd.DistributedOptimizer(torch.optim.Adam(model.parameters(), lr=1e-4),
                                                          named_parameters=model.named_parameters()))

    def run(kind, steps):
        model, opt = trainings[kind]
        for _ in range(steps):
            opt.zero_grad()
            torch.nn.functional.cross_entropy(model(x), y).backward()
            opt.step()

    for kind in trainings:
        run(kind, args.warmup)
    rates = {kind: [] for kind in trainings}
    kinds = list(trainings)
    for i in range(args.spans * len(kinds)):
        kind = kinds[i % len(kinds)] if i // len(kinds) % 2 == 0 else kinds[::-1][i % len(kinds)]
        dist.barrier()
        start = time.perf_counter()
        run(kind, args.steps)
        dist.barrier()
        rates[kind].append(size * args.batch_size * args.steps / (time.perf_counter() - start))

    own = {"sharded": trainings["sharded"][1].local_state_bytes(),
           "zero": state_bytes(trainings["zero"][1].optim),
           "plain": state_bytes(trainings["plain"][1])}
    every = hvd.allgather_object(own)
    params = sum(p.numel() for p in trainings["plain"][0].parameters())
    if rank == 0:
        print(f"{size} ranks, MLP {args.layers} x {args.width} ({params / 1e6:.2f} M parameters), Adam, "
              f"batch {args.batch_size} per rank, {args.spans} spans of {args.steps} steps each")
        print(f"{'':8s} {'state bytes per rank (max)':>28s} {'samples/sec (median)':>22s}")
        for kind in kinds:
            most = max(b[kind] for b in every)
            print(f"{kind:8s} {most:28,d} {statistics.median(rates[kind]):22.1f}")
        mem = {k: max(b[k] for b in every) for k in kinds}
        speed = {k: statistics.median(rates[k]) for k in kinds}
        print(f"ratio sharded/zero:  state bytes {mem['sharded'] / mem['zero']:.3f}, "
              f"samples/sec {speed['sharded'] / speed['zero']:.3f}")
        print(f"ratio sharded/plain: state bytes {mem['sharded'] / mem['plain']:.3f}, "
              f"samples/sec {speed['sharded'] / speed['plain']:.3f}")
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
