"""Checks of DistributedOptimizer(compression=hvd.PowerSGD(...)), run under roundelrun.

Trains an MLP (64-256-256-10) on scikit-learn's digits (each rank its share of
the training set) with plain allreduce and with PowerSGD(rank=4,
start_iter=10), from the same initial weights on the same batches, and
compares test accuracy; counts the bytes the optimizer submits to allreduce
per step before and after ``start_iter``; checks every rank ends with the
same parameters.
"""

import sys

import numpy as np
import torch

import roundel.torch as hvd
import roundel.torch.optimizer as optimizer_module

EPOCHS = 8
PER_RANK_BATCH = 32

submitted = []  # bytes of each allreduce the optimizer started, this step


def _counting(start):
    def wrapper(tensors, *args, **kwargs):
        for t in tensors if isinstance(tensors, list) else [tensors]:
            submitted.append(t.numel() * t.element_size())
        return start(tensors, *args, **kwargs)
    return wrapper


optimizer_module.allreduce_async_ = _counting(optimizer_module.allreduce_async_)
optimizer_module.grouped_allreduce_async_ = _counting(optimizer_module.grouped_allreduce_async_)


def data():
    from sklearn.datasets import load_digits
    x, y = load_digits(return_X_y=True)
    gen = np.random.RandomState(0)
    order = gen.permutation(len(x))
    x, y = torch.tensor(x[order] / 16.0, dtype=torch.float32), torch.tensor(y[order])
    split = int(0.8 * len(x))
    return (x[:split], y[:split]), (x[split:], y[split:])


def make_model():
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(64, 256), torch.nn.ReLU(), torch.nn.Linear(256, 256),
                               torch.nn.ReLU(), torch.nn.Linear(256, 10))


def train(compression):
    (x, y), (tx, ty) = data()
    x, y = x[hvd.rank()::hvd.size()], y[hvd.rank()::hvd.size()]
    steps = len(x) // PER_RANK_BATCH  # the same on every rank (1437 // n rows, 32 a batch)
    steps = hvd.allreduce(torch.tensor(steps), op=hvd.Min).item()
    model = make_model()
    opt = hvd.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9),
                                   named_parameters=model.named_parameters(), compression=compression)
    per_step = []
    gen = torch.Generator().manual_seed(hvd.rank())
    for epoch in range(EPOCHS):
        order = torch.randperm(len(x), generator=gen)
        for s in range(steps):
            idx = order[s * PER_RANK_BATCH:(s + 1) * PER_RANK_BATCH]
            submitted.clear()
            opt.zero_grad()
            torch.nn.functional.cross_entropy(model(x[idx]), y[idx]).backward()  # the hooks start reductions
            opt.step()
            per_step.append(sum(submitted))
    with torch.no_grad():
        accuracy = (model(tx).argmax(1) == ty).float().mean().item() * 100
    for name, p in model.named_parameters():
        spread = (hvd.allreduce(p.detach(), op=hvd.Max) - hvd.allreduce(p.detach(), op=hvd.Min)).abs().max()
        assert spread.item() == 0.0, f"{name} differs across ranks by {spread.item()}"
    return accuracy, per_step


if __name__ == "__main__":
    hvd.init()
    plain_acc, plain_bytes = train(hvd.Compression.none)
    psgd_acc, psgd_bytes = train(hvd.PowerSGD(rank=4, start_iter=10))
    assert plain_bytes[0] == plain_bytes[-1], plain_bytes[:3]
    assert psgd_bytes[0] == plain_bytes[0], (psgd_bytes[0], plain_bytes[0])  # before start_iter: plain
    assert psgd_bytes[9] == plain_bytes[0] and psgd_bytes[10] < plain_bytes[0], psgd_bytes[8:12]
    ratio = plain_bytes[-1] / psgd_bytes[-1]
    print(f"POWERSGD rank {hvd.rank()} accuracy plain {plain_acc:.2f} powersgd {psgd_acc:.2f} "
          f"bytes/step plain {plain_bytes[-1]} powersgd {psgd_bytes[-1]} ratio {ratio:.1f}")
    assert ratio >= 10, f"PowerSGD cut the bytes per step only {ratio:.1f}x"
    assert psgd_acc >= plain_acc - 2.0, f"PowerSGD accuracy {psgd_acc:.2f} vs uncompressed {plain_acc:.2f}"
    print("CHECKS PASSED torch_powersgd")
    sys.stdout.flush()
