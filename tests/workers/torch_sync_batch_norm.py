"""SyncBatchNorm against one process running torch.nn.BatchNorm on the concatenated batch.

Every rank builds every rank's input (seeded by rank), so each rank runs the
single-process reference itself and compares its own slice: forward output,
input gradient, running statistics, and the weight/bias gradients summed over
the ranks. Ranks get different batch sizes (rank r has r + 2 samples), and one
case gives rank 0 an empty batch.
"""

import os
import sys

import numpy as np
import torch

sys.path.insert(0, os.path.dirname(__file__))
from _checks import check, expect_raises, make_float, run_scenarios  # noqa: E402

import roundel.torch as hvd  # noqa: E402

hvd.init()
RANK, SIZE = hvd.rank(), hvd.size()
TOL = 1e-9  # float64 throughout, so only summation order differs


def batch_sizes(empty_rank0: bool) -> list[int]:
    return [0 if (r == 0 and empty_rank0) else r + 2 for r in range(SIZE)]


def compare(shape_tail, bn_class, empty_rank0=False, momentum=0.1, steps=2, what=""):
    sizes = batch_sizes(empty_rank0)
    channels = shape_tail[0]
    sync = hvd.SyncBatchNorm(channels, momentum=momentum).double()
    ref = bn_class(channels, momentum=momentum).double()
    with torch.no_grad():  # non-trivial affine parameters, equal on both
        for layer in (sync, ref):
            layer.weight.copy_(make_float(0, "bn.weight", (channels,)))
            layer.bias.copy_(make_float(0, "bn.bias", (channels,)))
    for step in range(steps):
        tag = f"{what}.{step}"
        inputs = [make_float(r, tag + ".x", (sizes[r],) + tuple(shape_tail)) for r in range(SIZE)]
        upstream = [make_float(r, tag + ".dy", (sizes[r],) + tuple(shape_tail)) for r in range(SIZE)]

        x = inputs[RANK].clone().requires_grad_()
        out = sync(x)
        (out * upstream[RANK]).sum().backward()

        x_all = torch.cat(inputs).requires_grad_()
        out_ref = ref(x_all)
        (out_ref * torch.cat(upstream)).sum().backward()

        start = sum(sizes[:RANK])
        mine = slice(start, start + sizes[RANK])
        check(out, out_ref[mine].detach().numpy(), f"{tag} forward")
        check(x.grad, x_all.grad[mine].numpy(), f"{tag} input gradient")
        check(sync.running_mean, ref.running_mean.numpy(), f"{tag} running mean")
        check(sync.running_var, ref.running_var.numpy(), f"{tag} running var")
        for param in ("weight", "bias"):
            summed = hvd.allreduce(getattr(sync, param).grad, op=hvd.Sum, name=f"{tag}.{param}.grad")
            check(summed, getattr(ref, param).grad.numpy(), f"{tag} {param} gradient summed over ranks")
        sync.zero_grad()
        ref.zero_grad()

    # eval mode uses the running statistics and does not communicate
    sync.eval()
    ref.eval()
    x = make_float(RANK, what + ".eval", (3,) + tuple(shape_tail))
    check(sync(x), ref(x).detach().numpy(), f"{what} eval mode")


def scenario_shapes():
    compare((4,), torch.nn.BatchNorm1d, what="1d")
    compare((3, 5), torch.nn.BatchNorm1d, what="1d_length")
    compare((3, 4, 2), torch.nn.BatchNorm2d, what="2d")
    compare((2, 3, 2, 2), torch.nn.BatchNorm3d, what="3d")
    compare((3, 4, 2), torch.nn.BatchNorm2d, momentum=None, steps=3, what="cumulative")


def scenario_empty_batch():
    compare((3, 4, 2), torch.nn.BatchNorm2d, empty_rank0=True, what="empty_rank0")


def scenario_float32_training():
    """A float32 model with SyncBatchNorm trained with DistributedOptimizer matches one process."""
    torch.manual_seed(0)
    net = torch.nn.Sequential(torch.nn.Conv2d(2, 4, 3, padding=1), hvd.SyncBatchNorm(4), torch.nn.ReLU(),
                              torch.nn.Flatten(), torch.nn.Linear(4 * 6 * 6, 3))
    torch.manual_seed(0)
    ref = torch.nn.Sequential(torch.nn.Conv2d(2, 4, 3, padding=1), torch.nn.BatchNorm2d(4), torch.nn.ReLU(),
                              torch.nn.Flatten(), torch.nn.Linear(4 * 6 * 6, 3))
    opt = hvd.DistributedOptimizer(torch.optim.SGD(net.parameters(), lr=0.1, momentum=0.9),
                                   named_parameters=net.named_parameters())
    ref_opt = torch.optim.SGD(ref.parameters(), lr=0.1, momentum=0.9)
    per_rank = 4
    for step in range(3):
        xs = [make_float(r, f"train.{step}.x", (per_rank, 2, 6, 6), torch.float32) for r in range(SIZE)]
        ys = [torch.from_numpy(np.arange(per_rank) % 3 + r % 3) % 3 for r in range(SIZE)]
        opt.zero_grad()
        torch.nn.functional.cross_entropy(net(xs[RANK]), ys[RANK]).backward()
        opt.step()
        # the mean of the ranks' mean losses is the mean loss over the whole batch
        ref_opt.zero_grad()
        torch.nn.functional.cross_entropy(ref(torch.cat(xs)), torch.cat(ys)).backward()
        ref_opt.step()
    for (name, p), q in zip(net.named_parameters(), ref.parameters()):
        check(p, q.detach().numpy(), f"trained {name}")


def scenario_no_host_reads():
    """Training steps read nothing back from the device (no ``.item()``), and too few values over all ranks are
    still refused on every rank."""
    reads = []
    item = torch.Tensor.item

    def counted(tensor):
        reads.append(tuple(tensor.shape))
        return item(tensor)

    layer = hvd.SyncBatchNorm(3).double()
    torch.Tensor.item = counted
    try:
        for step in range(2):
            x = make_float(RANK, f"reads.{step}", (RANK + 2, 3, 2)).requires_grad_()
            layer(x).sum().backward()
        assert reads == [], f"SyncBatchNorm read {len(reads)} value(s) back from the device: {reads}"
        lone = torch.zeros((1 if RANK == 0 else 0, 3), dtype=torch.float64)
        expect_raises(ValueError, lambda: layer(lone), "more than 1 value per channel", "got 1 over all ranks",
                      what="one value per channel over all ranks")
    finally:
        torch.Tensor.item = item


def scenario_bad_input():
    layer = hvd.SyncBatchNorm(3)
    for bad, expected in ((torch.zeros(4), "2D or higher"), (torch.zeros(2, 5), "3 features")):
        expect_raises(ValueError, lambda: layer(bad), expected, what=f"input of shape {list(bad.shape)}")


SCENARIOS = {
    "shapes": scenario_shapes,
    "empty_batch": scenario_empty_batch,
    "float32_training": scenario_float32_training,
    "bad_input": scenario_bad_input,
    "no_host_reads": scenario_no_host_reads,
}

if __name__ == "__main__":
    run_scenarios(SCENARIOS, sys.argv, RANK)
