"""Elastic MNIST training with roundel: the Horovod elastic PyTorch recipe.

Workers may fail, and hosts may come and go while it trains; the job rolls
back to the last commit, re-forms and goes on. Run it with a host discovery
script that prints one ``host:slots`` line per usable host::

    printf '#!/bin/sh\\necho localhost:1\\necho 127.0.0.2:1\\n' > discover.sh && chmod +x discover.sh
    roundelrun -np 2 --min-np 1 --max-np 4 --host-discovery-script ./discover.sh \\
        python examples/pytorch_mnist_elastic.py --epochs 5

(two names of this machine, so that a failed worker, which takes its whole
host out of the job as in Horovod, leaves the other one training).

Data as in pytorch_mnist.py: scikit-learn's digits by default, or the
MNIST / Fashion-MNIST IDX files with ``--dataset ... --data-dir ...``.
Each "roundel:" comment marks a step of the elastic recipe.
"""

from __future__ import annotations

import argparse
import os
import sys

import torch
import torch.nn.functional as F
from torch.utils.data import DataLoader

import roundel.torch as hvd

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))  # models.py and datasets.py sit beside this file
from datasets import DATASETS, load_dataset  # noqa: E402
from models import MnistNet  # noqa: E402
from progress_bar import sample_bar  # noqa: E402


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description="roundel elastic PyTorch MNIST example",
                                formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    p.add_argument("--dataset", choices=DATASETS, default="digits",
                   help="digits: scikit-learn's bundled digits (offline); mnist / fashion-mnist: IDX files")
    p.add_argument("--data-dir", help="directory holding the four MNIST or Fashion-MNIST IDX files")
    p.add_argument("--batch-size", type=int, default=32, help="training batch size per rank")
    p.add_argument("--epochs", type=int, default=5, help="number of epochs to train")
    p.add_argument("--lr", type=float, default=0.05, help="learning rate for one rank, scaled by the rank count")
    p.add_argument("--momentum", type=float, default=0.5, help="SGD momentum")
    p.add_argument("--batches-per-commit", type=int, default=5,
                   help="commit the state every this many batches (a failure repeats at most these)")
    p.add_argument("--checkpoint-dir", help="rank 0 writes checkpoint-{epoch}.pt here after every epoch")
    p.add_argument("--seed", type=int, default=42, help="random seed")
    return p.parse_args(argv)


def evaluate(model, dataset) -> float:
    """Accuracy on ``dataset`` over every rank's shard, averaged with one allreduce."""
    model.eval()
    shard = torch.utils.data.Subset(dataset, range(hvd.rank(), len(dataset), hvd.size()))
    correct = count = 0
    with torch.no_grad():
        for data, target in DataLoader(shard, batch_size=1000):
            correct += (model(data).argmax(dim=1) == target).sum().item()
            count += len(data)
    totals = hvd.allreduce(torch.tensor([correct, count], dtype=torch.float64), op=hvd.Sum, name="test_accuracy")
    return (totals[0] / totals[1]).item()


def main(argv=None) -> None:
    args = parse_args(argv)
    hvd.init()                                          # roundel: join the job
    torch.manual_seed(args.seed)
    torch.set_num_threads(1)
    train_set, test_set = load_dataset(args.dataset, args.data_dir)
    model = MnistNet()
    optimizer = torch.optim.SGD(model.parameters(), lr=args.lr * hvd.size(), momentum=args.momentum)
    optimizer = hvd.DistributedOptimizer(optimizer, named_parameters=model.named_parameters())
    sampler = hvd.elastic.ElasticSampler(train_set, shuffle=True, seed=args.seed)   # roundel: reshards on reset
    loader = DataLoader(train_set, batch_size=args.batch_size, sampler=sampler)

    # roundel: everything a rank needs to continue lives in the state, committed now and then
    state = hvd.elastic.TorchState(model, optimizer, sampler=sampler, epoch=1, batch=0)

    def on_reset():                                     # roundel: the rank count changed: rescale the lr
        for group in optimizer.param_groups:
            group["lr"] = args.lr * hvd.size()
        if hvd.rank() == 0:
            print(f"reset: now {hvd.size()} rank(s), lr {args.lr * hvd.size():g}", flush=True)

    state.register_reset_callbacks([on_reset])

    @hvd.elastic.run                                    # roundel: failures and host changes re-enter here
    def train(state):
        while state.epoch <= args.epochs:
            model.train()
            state.sampler.set_epoch(state.epoch)
            loss_sum = torch.zeros(2, dtype=torch.float64)
            # rank 0's bar counts the job's samples (this rank's x the rank count) left in this epoch
            with sample_bar(len(state.sampler) * hvd.size(), f"epoch {state.epoch}", hvd.rank()) as bar:
                for batch_idx, (data, target) in enumerate(loader):
                    optimizer.zero_grad()
                    loss = F.nll_loss(model(data), target)
                    loss.backward()
                    optimizer.step()
                    loss_sum += torch.tensor([loss.item() * len(data), len(data)], dtype=torch.float64)
                    bar.update(len(data) * hvd.size())
                    state.sampler.record_batch(batch_idx, args.batch_size)
                    state.batch = batch_idx
                    if batch_idx % args.batches_per_commit == 0:
                        state.commit()                  # roundel: a point to roll back to
            totals = hvd.allreduce(loss_sum, op=hvd.Sum, name="train_loss")
            accuracy = evaluate(model, test_set)
            if hvd.rank() == 0:
                print(f"epoch {state.epoch}: train loss {(totals[0] / totals[1]).item():.4f} (samples since the "
                      f"last reset), test accuracy {accuracy:.4f}, {hvd.size()} rank(s)", flush=True)
                if args.checkpoint_dir:                 # roundel: checkpoints on rank 0 only
                    os.makedirs(args.checkpoint_dir, exist_ok=True)
                    torch.save({"epoch": state.epoch, "model": model.state_dict()},
                               os.path.join(args.checkpoint_dir, f"checkpoint-{state.epoch}.pt"))
            state.epoch += 1
            state.batch = 0
            state.commit()
        return evaluate(model, test_set)

    accuracy = train(state)
    if hvd.rank() == 0:
        print(f"final test accuracy {accuracy:.4f}", flush=True)


if __name__ == "__main__":
    main()
