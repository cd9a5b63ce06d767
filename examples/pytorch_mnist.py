"""Data-parallel MNIST training with roundel: the Horovod PyTorch tutorial recipe, step by step.

Run it on 2 processes (scikit-learn's bundled digits; nothing to download)::

    roundelrun -np 2 python examples/pytorch_mnist.py --epochs 5

or on the real MNIST / Fashion-MNIST files (the four IDX files, gzipped or
not, in one directory)::

    roundelrun -np 2 python examples/pytorch_mnist.py --dataset fashion-mnist --data-dir ~/data/fashion

With checkpoints, resumable, and TensorBoard logs (if tensorboard is installed)::

    roundelrun -np 2 python examples/pytorch_mnist.py --checkpoint-dir ckpt --resume --log-dir runs

A Horovod script is the same with ``import horovod.torch as hvd`` and
``horovodrun``; every ``hvd.`` call below is Horovod's API. Each numbered
"roundel:" comment is one step of the recipe.
"""

from __future__ import annotations

import argparse
import os
import re
import sys
import time
import types

import torch
import torch.nn.functional as F
import torch.optim as optim
from torch.utils.data import DataLoader
from torch.utils.data.distributed import DistributedSampler

import roundel.torch as hvd

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))  # models.py and datasets.py sit beside this file
from datasets import DATASETS, load_dataset  # noqa: E402
from models import MnistNet  # noqa: E402

CHECKPOINT = re.compile(r"^checkpoint-(\d+)\.pt$")


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description="roundel PyTorch MNIST example",
                                formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    p.add_argument("--dataset", choices=DATASETS, default="digits",
                   help="digits: scikit-learn's bundled 8x8 digits scaled to 28x28 (offline); mnist / "
                        "fashion-mnist: the IDX files in --data-dir")
    p.add_argument("--data-dir", help="directory holding the four MNIST or Fashion-MNIST IDX files")
    p.add_argument("--batch-size", type=int, default=None,
                   help="training batch size per rank (default: 64 for MNIST / Fashion-MNIST as in the tutorial, "
                        "32 for digits, whose 1,437 training images would otherwise give only 12 steps an epoch)")
    p.add_argument("--test-batch-size", type=int, default=1000, help="test batch size per rank")
    p.add_argument("--epochs", type=int, default=10, help="number of epochs to train")
    p.add_argument("--lr", type=float, default=None,
                   help="learning rate for one rank, scaled by the rank count (default: 0.01 for MNIST / "
                        "Fashion-MNIST as in the tutorial, 0.05 for the much smaller digits)")
    p.add_argument("--momentum", type=float, default=0.5, help="SGD momentum")
    p.add_argument("--seed", type=int, default=42, help="random seed")
    p.add_argument("--no-cuda", action="store_true", help="train on the CPU even if CUDA is available")
    p.add_argument("--num-threads", type=int, default=1, help="PyTorch CPU threads per rank")
    p.add_argument("--log-interval", type=int, default=10,
                   help="batches between text progress lines (when no progress bar is shown)")
    p.add_argument("--progress", choices=("auto", "bar", "text", "none"), default="auto",
                   help="rank 0's progress display, with samples/s: auto = a tqdm bar if tqdm is installed, "
                        "else text lines")
    p.add_argument("--fp16-allreduce", action="store_true", help="compress gradients to float16 for the allreduce")
    p.add_argument("--use-adasum", action="store_true", help="combine gradients with Adasum instead of averaging")
    p.add_argument("--gradient-predivide-factor", type=float, default=1.0,
                   help="divide gradients by this before the sum and by size/this after (averaging only)")
    p.add_argument("--checkpoint-dir", help="rank 0 writes checkpoint-{epoch}.pt here after every epoch")
    p.add_argument("--resume", action="store_true", help="continue from the latest checkpoint in --checkpoint-dir")
    p.add_argument("--log-dir", help="write TensorBoard logs here (rank 0; needs the tensorboard package)")
    args = p.parse_args(argv)
    small = args.dataset == "digits"
    if args.batch_size is None:
        args.batch_size = 32 if small else 64
    if args.lr is None:
        args.lr = 0.05 if small else 0.01
    if args.resume and not args.checkpoint_dir:
        p.error("--resume needs --checkpoint-dir")
    if args.use_adasum and args.gradient_predivide_factor != 1.0:
        p.error("--gradient-predivide-factor applies to averaging, not to --use-adasum")
    return args


def say(*parts) -> None:
    """Print on rank 0 only: every rank computes the same averaged numbers."""
    if hvd.rank() == 0:
        print(*parts, flush=True)


# ------------------------------------------------------------------ progress

class Progress:
    """Rank 0's progress through one epoch, with the job's samples/s: a tqdm bar, text lines, or nothing.

    Every rank trains on batches of the same size, so the job's samples are
    this rank's times the rank count.
    """

    def __init__(self, mode: str, epoch: int, total_samples: int, log_interval: int):
        self.epoch, self.log_interval = epoch, max(1, log_interval)
        self.total_samples = total_samples * hvd.size()
        self.seen, self.started = 0, time.perf_counter()
        self.bar = None
        self.mode = mode if hvd.rank() == 0 else "none"
        if self.mode in ("auto", "bar"):
            try:
                from progress_bar import sample_bar  # progress_bar.py beside this file; needs tqdm
            except ImportError:
                if self.mode == "bar":
                    print("tqdm is not installed (pip install tqdm); showing text progress instead", flush=True)
                self.mode = "text"
            else:
                self.bar = sample_bar(self.total_samples, f"epoch {epoch}", hvd.rank())
                self.mode = "bar"

    def update(self, batch_idx: int, batch_samples: int, loss: float) -> None:
        self.seen += batch_samples * hvd.size()
        if self.mode == "bar":
            self.bar.set_postfix(loss=f"{loss:.4f}", refresh=False)
            self.bar.update(batch_samples * hvd.size())
        elif self.mode == "text" and batch_idx % self.log_interval == 0:
            rate = self.seen / max(time.perf_counter() - self.started, 1e-9)
            print(f"epoch {self.epoch} [{self.seen}/{self.total_samples} "
                  f"({100.0 * self.seen / self.total_samples:.0f}%)] loss {loss:.4f}, {rate:.1f} samples/s",
                  flush=True)

    def close(self) -> None:
        if self.bar is not None:
            self.bar.close()


# ------------------------------------------------------------------ checkpoints

def latest_checkpoint(directory: str) -> tuple[int, str] | None:
    """(epoch, path) of the highest-numbered checkpoint-{epoch}.pt in ``directory``, or None."""
    if not os.path.isdir(directory):
        return None
    found = [(int(m.group(1)), os.path.join(directory, name))
             for name in os.listdir(directory) if (m := CHECKPOINT.match(name))]
    return max(found) if found else None


def save_checkpoint(directory: str, epoch: int, model, optimizer, args) -> str:
    """Write checkpoint-{epoch}.pt (model, optimizer, epoch) atomically; return its path. Rank 0 only."""
    os.makedirs(directory, exist_ok=True)
    path = os.path.join(directory, f"checkpoint-{epoch}.pt")
    state = {"epoch": epoch, "model": model.state_dict(), "optimizer": optimizer.state_dict(), "args": vars(args)}
    torch.save(state, path + ".tmp")
    os.replace(path + ".tmp", path)  # a crash mid-write never leaves a half checkpoint under the real name
    return path


# ------------------------------------------------------------------ metrics

def global_mean(loss_sum: float, correct: int, count: int, name: str) -> tuple[float, float]:
    """(mean loss, accuracy) over every rank's samples: the sums are added up with one allreduce."""
    totals = hvd.allreduce(torch.tensor([loss_sum, float(correct), float(count)], dtype=torch.float64),
                           op=hvd.Sum, name=name)
    loss_total, correct_total, count_total = totals.tolist()
    return loss_total / count_total, correct_total / count_total


def train_epoch(epoch, model, optimizer, loader, sampler, device, args) -> tuple[float, float]:
    model.train()
    sampler.set_epoch(epoch)  # roundel: a different shuffle every epoch, the same split across ranks
    progress = Progress(args.progress, epoch, len(sampler), args.log_interval)
    loss_sum, correct, count = 0.0, 0, 0
    for batch_idx, (data, target) in enumerate(loader):
        data, target = data.to(device), target.to(device)
        optimizer.zero_grad()
        output = model(data)
        loss = F.nll_loss(output, target)
        loss.backward()    # gradients are allreduced in the background as backward produces them
        optimizer.step()   # waits for the averaged gradients, then updates
        loss_sum += loss.item() * len(data)
        correct += (output.argmax(dim=1) == target).sum().item()
        count += len(data)
        progress.update(batch_idx, len(data), loss.item())
    progress.close()
    return global_mean(loss_sum, correct, count, "train_metrics")


@torch.no_grad()
def evaluate(model, loader, device) -> tuple[float, float]:
    model.eval()
    loss_sum, correct, count = 0.0, 0, 0
    for data, target in loader:
        data, target = data.to(device), target.to(device)
        output = model(data)
        loss_sum += F.nll_loss(output, target, reduction="sum").item()
        correct += (output.argmax(dim=1) == target).sum().item()
        count += len(data)
    return global_mean(loss_sum, correct, count, "test_metrics")


def open_tensorboard(log_dir: str | None):
    """A SummaryWriter on rank 0 when ``log_dir`` is set and tensorboard is installed; None otherwise."""
    if not log_dir or hvd.rank() != 0:
        return None
    if "tensorflow" not in sys.modules and "://" not in log_dir:
        # tensorboard imports TensorFlow when it is installed (and TensorFlow prints its banners), only for
        # files; its own switch, a module tensorboard.compat.notf, makes it use its TensorFlow-free file
        # functions, which write local directories (a gs:// or s3:// log dir keeps TensorFlow's)
        sys.modules.setdefault("tensorboard.compat.notf", types.ModuleType("tensorboard.compat.notf"))
    try:
        from torch.utils.tensorboard import SummaryWriter  # imported here: tensorboard is optional
    except ImportError:
        print(f"--log-dir {log_dir}: tensorboard is not installed (pip install tensorboard); "
              "training continues without TensorBoard logs", flush=True)
        return None
    return SummaryWriter(log_dir)


def main(argv=None) -> None:
    args = parse_args(argv)

    # roundel 1: start; one process per CPU slot or GPU.
    hvd.init()

    # roundel 2: one PyTorch thread per rank. The ranks share the machine's
    # cores (here 2 cores for 2 ranks); PyTorch's default of one thread per
    # core in every rank would oversubscribe them and slow everyone down.
    torch.set_num_threads(args.num_threads)
    torch.manual_seed(args.seed)

    # roundel 3: pin each rank to its own GPU (local_rank) when there are GPUs.
    use_cuda = not args.no_cuda and torch.cuda.is_available()
    if use_cuda:
        torch.cuda.set_device(hvd.local_rank())
        torch.cuda.manual_seed(args.seed)
    device = torch.device("cuda", hvd.local_rank()) if use_cuda else torch.device("cpu")

    started = time.perf_counter()
    try:
        train_set, test_set = load_dataset(args.dataset, args.data_dir)
    except (OSError, ValueError, ImportError) as exc:  # missing or malformed files, no scikit-learn
        sys.exit(f"pytorch_mnist.py: error: {exc}")

    # roundel 4: each rank reads its own 1/size of the data.
    train_sampler = DistributedSampler(train_set, num_replicas=hvd.size(), rank=hvd.rank(), shuffle=True,
                                       seed=args.seed)
    test_sampler = DistributedSampler(test_set, num_replicas=hvd.size(), rank=hvd.rank(), shuffle=False)
    loader_kwargs = {"pin_memory": True} if use_cuda else {}
    train_loader = DataLoader(train_set, batch_size=args.batch_size, sampler=train_sampler, **loader_kwargs)
    test_loader = DataLoader(test_set, batch_size=args.test_batch_size, sampler=test_sampler, **loader_kwargs)

    model = MnistNet().to(device)

    # roundel 5: scale the learning rate by the number of ranks: the
    # effective batch is size x batch-size. Adasum adapts to the rank count by
    # itself, so it keeps the one-rank rate (Horovod scales by local_size for
    # Adasum on GPUs with NCCL, where ranks on a host are averaged first).
    lr_scaler = 1 if args.use_adasum else hvd.size()
    if use_cuda and args.use_adasum and hvd.nccl_built():
        lr_scaler = hvd.local_size()
    optimizer = optim.SGD(model.parameters(), lr=args.lr * lr_scaler, momentum=args.momentum)

    # roundel 6: wrap the optimizer so gradients are combined across ranks
    # (averaged, or Adasum), optionally sent as float16.
    optimizer = hvd.DistributedOptimizer(
        optimizer, named_parameters=model.named_parameters(),
        compression=hvd.Compression.fp16 if args.fp16_allreduce else hvd.Compression.none,
        op=hvd.Adasum if args.use_adasum else hvd.Average,
        gradient_predivide_factor=args.gradient_predivide_factor)

    # roundel 7: resuming: rank 0 reads the newest checkpoint; every rank learns the epoch from it.
    resume_from_epoch = 0
    if args.resume and hvd.rank() == 0:
        found = latest_checkpoint(args.checkpoint_dir)
        if found is None:
            print(f"--resume: no checkpoint-*.pt in {args.checkpoint_dir}; starting at epoch 1", flush=True)
        else:
            resume_from_epoch, path = found
            state = torch.load(path, map_location=device, weights_only=True)
            model.load_state_dict(state["model"])
            optimizer.load_state_dict(state["optimizer"])
            print(f"resumed from {path}: epoch {resume_from_epoch} done"
                  + (f", continuing at epoch {resume_from_epoch + 1}" if resume_from_epoch < args.epochs else ""),
                  flush=True)
    resume_from_epoch = hvd.broadcast_object(resume_from_epoch, root_rank=0, name="resume_from_epoch")

    # roundel 8: start every rank from rank 0's weights and optimizer state
    # (random initialization or the checkpoint).
    hvd.broadcast_parameters(model.state_dict(), root_rank=0)
    hvd.broadcast_optimizer_state(optimizer, root_rank=0)

    writer = open_tensorboard(args.log_dir)
    say(f"training on {args.dataset}: {len(train_set)} train / {len(test_set)} test images, {hvd.size()} rank(s), "
        f"batch {args.batch_size} per rank, lr {args.lr * lr_scaler:g}"
        + (", fp16 allreduce" if args.fp16_allreduce else "") + (", Adasum" if args.use_adasum else ""))

    test_accuracy = float("nan")
    if resume_from_epoch >= args.epochs:
        _, test_accuracy = evaluate(model, test_loader, device)
        say(f"checkpoint is already at epoch {resume_from_epoch} of {args.epochs}; nothing to train")
    for epoch in range(resume_from_epoch + 1, args.epochs + 1):
        epoch_start = time.perf_counter()
        train_loss, train_accuracy = train_epoch(epoch, model, optimizer, train_loader, train_sampler, device, args)
        test_loss, test_accuracy = evaluate(model, test_loader, device)
        say(f"epoch {epoch}: train loss {train_loss:.4f} accuracy {train_accuracy:.4f} | "
            f"test loss {test_loss:.4f} accuracy {test_accuracy:.4f} | {time.perf_counter() - epoch_start:.1f} s")
        if writer is not None:
            writer.add_scalar("train/loss", train_loss, epoch)
            writer.add_scalar("train/accuracy", train_accuracy, epoch)
            writer.add_scalar("test/loss", test_loss, epoch)
            writer.add_scalar("test/accuracy", test_accuracy, epoch)
        # roundel 9: only rank 0 writes checkpoints (all ranks hold the same weights).
        if args.checkpoint_dir and hvd.rank() == 0:
            path = save_checkpoint(args.checkpoint_dir, epoch, model, optimizer, args)
            print(f"saved {path}", flush=True)

    if writer is not None:
        writer.close()
    say(f"total time: {time.perf_counter() - started:.1f} s")
    say(f"final test accuracy: {test_accuracy:.4f}")


if __name__ == "__main__":
    main()
