"""Synthetic training benchmark: images/sec of data-parallel training with roundel, on random data.

The tutorials' ResNet-50 / AlexNet-OWT throughput runs, for any model in
``models.py``::

    roundelrun -np 2 python examples/pytorch_synthetic_benchmark.py                      # ResNet-50, batch 32
    roundelrun -np 2 python examples/pytorch_synthetic_benchmark.py --model alexnet_owt
    roundelrun -np 2 python examples/pytorch_synthetic_benchmark.py --model smallcnn --batch-size 64

(ResNet-50 at 224x224 runs at a few images/sec per CPU core: on a small CPU
machine start with ``--model resnet18 --image-size 64`` or ``--model smallcnn``.)

Every rank trains the same model on one fixed random batch (so no data
loading is timed): a training step is forward, cross-entropy loss,
``backward()`` (gradients are allreduced in the background as they appear)
and ``optimizer.step()`` (SGD, wrapped in ``hvd.DistributedOptimizer``).
After ``--num-warmup-batches`` untimed steps it times ``--num-iters``
iterations of ``--num-batches-per-iter`` steps each.

Output, on rank 0 only, in the format of Horovod's synthetic benchmark::

    Iter #0: 123.4 img/sec per CPU
    ...
    Img/sec per CPU: 120.1 +-5.2
    Total img/sec on 2 CPU(s): 240.2 +-10.4

While it runs, rank 0 also shows a progress bar on stderr with the job's
samples/s (``examples/progress_bar.py``).

An iteration's "per CPU" figure is the mean over ranks of each rank's own
img/sec for that iteration; "Total" is their sum. The ``+-`` is 1.96 standard
deviations over the iterations (a 95% interval for one iteration if the
figures are normal). The word is GPU when it runs on CUDA devices, one per
rank, pinned by ``local_rank()``.
"""

from __future__ import annotations

import argparse
import os
import sys
import time

import numpy as np
import torch
import torch.nn.functional as F
import torch.optim as optim

import roundel.torch as hvd

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))  # models.py sits beside this file
from models import ALIASES, INPUT_SHAPES, MODEL_NAMES, build_model, canonical_name, count_parameters  # noqa: E402
from progress_bar import sample_bar  # noqa: E402


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description="roundel PyTorch synthetic benchmark",
                                formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    p.add_argument("--model", default="resnet50",
                   help=f"model to train: {', '.join(MODEL_NAMES)} (or {', '.join(ALIASES)})")
    p.add_argument("--batch-size", type=int, default=32, help="input batch size per rank")
    p.add_argument("--image-size", type=int, default=None,
                   help="height and width of the random images (default: the model's own, 224 for the "
                        "ImageNet models, 32 for small_cnn, 28 for mnist_net)")
    p.add_argument("--num-classes", type=int, default=1000, help="number of output classes")
    p.add_argument("--num-warmup-batches", type=int, default=10, help="untimed steps before timing")
    p.add_argument("--num-batches-per-iter", type=int, default=10, help="steps per timed iteration")
    p.add_argument("--num-iters", type=int, default=10, help="number of timed iterations")
    p.add_argument("--fp16-allreduce", action="store_true", help="compress gradients to float16 for the allreduce")
    p.add_argument("--use-adasum", action="store_true", help="combine gradients with Adasum instead of averaging")
    p.add_argument("--no-cuda", action="store_true", help="run on the CPU even if CUDA is available")
    p.add_argument("--num-threads", type=int, default=None,
                   help="PyTorch CPU threads per rank (default: this machine's usable cores / ranks on it)")
    p.add_argument("--seed", type=int, default=0, help="random seed for the model and the data")
    args = p.parse_args(argv)
    try:
        args.model = canonical_name(args.model)
    except ValueError as exc:
        p.error(str(exc))
    for name in ("batch_size", "num_classes", "num_batches_per_iter", "num_iters"):
        if getattr(args, name) < 1:
            p.error(f"--{name.replace('_', '-')} must be >= 1")
    if args.num_warmup_batches < 0:
        p.error("--num-warmup-batches must be >= 0")
    return args


def log(text: str) -> None:
    if hvd.rank() == 0:
        print(text, flush=True)


def usable_cores() -> int:
    try:
        return len(os.sched_getaffinity(0))
    except AttributeError:  # not Linux
        return os.cpu_count() or 1


def main(argv=None) -> None:
    args = parse_args(argv)
    hvd.init()
    cuda = not args.no_cuda and torch.cuda.is_available()
    if cuda:
        torch.cuda.set_device(hvd.local_rank())  # one GPU per rank
        device = torch.device("cuda", hvd.local_rank())
    else:
        device = torch.device("cpu")
        # The ranks on one machine share its cores; one thread per core in
        # every rank would oversubscribe them.
        threads = args.num_threads or max(1, usable_cores() // hvd.local_size())
        torch.set_num_threads(threads)
    torch.manual_seed(args.seed)

    model = build_model(args.model, num_classes=args.num_classes).to(device)
    channels, default_size = INPUT_SHAPES[args.model]
    size = args.image_size or default_size

    # The tutorial's learning-rate scaling (Adasum keeps the one-rank rate).
    lr_scaler = 1 if args.use_adasum else hvd.size()
    optimizer = optim.SGD(model.parameters(), lr=0.01 * lr_scaler)
    optimizer = hvd.DistributedOptimizer(
        optimizer, named_parameters=model.named_parameters(),
        compression=hvd.Compression.fp16 if args.fp16_allreduce else hvd.Compression.none,
        op=hvd.Adasum if args.use_adasum else hvd.Average)
    hvd.broadcast_parameters(model.state_dict(), root_rank=0)
    hvd.broadcast_optimizer_state(optimizer, root_rank=0)

    generator = torch.Generator().manual_seed(args.seed + hvd.rank())
    data = torch.randn(args.batch_size, channels, size, size, generator=generator).to(device)
    target = torch.randint(0, args.num_classes, (args.batch_size,), generator=generator).to(device)

    def step() -> None:
        optimizer.zero_grad()
        loss = F.cross_entropy(model(data), target)
        loss.backward()
        optimizer.step()

    def timed(steps: int, bar=None) -> float:
        start = time.perf_counter()
        for _ in range(steps):
            step()
            if bar is not None:
                bar.update(args.batch_size * hvd.size())  # the job's samples (every rank's batch is the same)
        if cuda:
            torch.cuda.synchronize()
        return time.perf_counter() - start

    unit = "GPU" if cuda else "CPU"
    log(f"Model: {args.model} ({count_parameters(model):,} parameters), input {channels}x{size}x{size}")
    log(f"Batch size: {args.batch_size}")
    log(f"Number of {unit}s: {hvd.size()}" + ("" if cuda else f" ({torch.get_num_threads()} thread(s) each)")
        + (", fp16 allreduce" if args.fp16_allreduce else "") + (", Adasum" if args.use_adasum else ""))

    log("Running warmup...")
    timed(args.num_warmup_batches)

    log("Running benchmark...")
    per_rank = []  # this rank's img/sec in each iteration
    total_samples = args.num_iters * args.num_batches_per_iter * args.batch_size * hvd.size()
    with sample_bar(total_samples, "benchmark", hvd.rank()) as bar:  # rank 0's bar, on stderr
        for i in range(args.num_iters):
            img_sec = args.batch_size * args.num_batches_per_iter / timed(args.num_batches_per_iter, bar)
            per_rank.append(img_sec)
            # Outside the timed region: the mean over ranks, for the progress line.
            mean = hvd.allreduce(torch.tensor([img_sec], dtype=torch.float64), op=hvd.Average, name=f"img_sec.{i}")
            log(f"Iter #{i}: {mean.item():.1f} img/sec per {unit}")

    # Each iteration's total over ranks, then mean and 1.96 std over iterations.
    totals = hvd.allreduce(torch.tensor(per_rank, dtype=torch.float64), op=hvd.Sum, name="img_sec.all").numpy()
    total_mean, total_conf = float(np.mean(totals)), 1.96 * float(np.std(totals))
    n = hvd.size()
    log(f"Img/sec per {unit}: {total_mean / n:.1f} +-{total_conf / n:.1f}")
    log(f"Total img/sec on {n} {unit}(s): {total_mean:.1f} +-{total_conf:.1f}")


if __name__ == "__main__":
    main()
