"""Checks of DistributedOptimizer against the Compressor interface, run under roundelrun.

- A compressor of the test's own (not PowerSGD) that reduces buckets itself
  and keeps state: the optimizer hands it every bucket of every step
  (``reduce_bucket``), calls ``end_step`` once per step, and the gradients
  it returns are the ranks' average.
- A Horovod-style compressor object with ``compress`` and ``decompress``
  alone (no ``Compressor`` base): the gradients are the ranks' average.
- The once-per-step checks: over a step of 160 parameter hooks, the
  optimizer asks its process set whether this rank is a member at most
  twice (at the step's first gradient and in ``synchronize``), not once per
  parameter.

Prints ``CHECKS PASSED torch_compressor_interface`` on success.
"""

import copy
import sys

import torch

import roundel.torch as hvd
from roundel.torch.compression import NoneCompressor

STEPS = 3


class FlatBucket(NoneCompressor):
    """Reduces a bucket's gradients as one flat allreduce; counts what the optimizer asks of it."""

    reduce_ops = frozenset({hvd.Average})
    stateful = True
    reduces_buckets = True

    def __init__(self):
        self.buckets = []  # per call of reduce_bucket: (step, key, names)
        self.steps = 0

    def reduce_bucket(self, key, names, grads, allreduce):
        self.buckets.append((self.steps, key, tuple(names)))
        flat = torch.cat([g.reshape(-1) for g in grads])
        handle = allreduce(flat, f"{key}.flat")
        sizes = [g.numel() for g in grads]
        return lambda: list(hvd.synchronize(handle).split(sizes))

    def end_step(self):
        self.steps += 1


class HalfPrecision:
    """A compressor object as Horovod users write one: compress and decompress, no base class."""

    def compress(self, tensor):
        return tensor.to(torch.float16), tensor.dtype

    def decompress(self, tensor, ctx):
        return tensor.to(ctx)


def make_model(layers=3):
    torch.manual_seed(0)
    return torch.nn.Sequential(*[torch.nn.Linear(8, 8) for _ in range(layers)])


def batch(rank, step):
    gen = torch.Generator().manual_seed(1000 * rank + step)
    return torch.randn(4, 8, generator=gen)


def expected_grads(model, step):
    """Every rank's local gradient of this step, averaged (computed here from every rank's batch)."""
    grads = None
    for rank in range(hvd.size()):
        local = copy.deepcopy(model)
        local(batch(rank, step)).square().sum().backward()
        mine = [p.grad.clone() for p in local.parameters()]
        grads = mine if grads is None else [g + m for g, m in zip(grads, mine)]
    return [g / hvd.size() for g in grads]


def train_and_compare(compression, tol, what):
    model = make_model()
    reference = make_model()
    opt = hvd.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1),
                                   named_parameters=model.named_parameters(), compression=compression,
                                   bucket_cap_mb=0.0002)  # 3 buckets, one per layer, of this 3-layer model
    for step in range(STEPS):
        expect = expected_grads(reference, step)
        opt.zero_grad()
        model(batch(hvd.rank(), step)).square().sum().backward()
        opt.synchronize()
        for (name, p), e in zip(model.named_parameters(), expect):
            assert torch.allclose(p.grad, e, rtol=tol, atol=tol), f"{what}, step {step}: {name}.grad is not the average"
        with opt.skip_synchronize():
            opt.step()
        with torch.no_grad():
            for p, q in zip(reference.parameters(), model.parameters()):
                p.copy_(q)
    return opt


def check_bucket_reducing_compressor():
    compressor = FlatBucket()
    opt = train_and_compare(compressor, 1e-5, "a compressor that reduces buckets itself")
    assert compressor.steps == STEPS, f"end_step was called {compressor.steps} times in {STEPS} steps"
    per_step = len(opt._buckets)
    assert per_step == 3, [b.name for b in opt._buckets]
    assert [s for s, _, _ in compressor.buckets] == [s for s in range(STEPS) for _ in range(per_step)], \
        compressor.buckets
    names = {n for _, _, bucket_names in compressor.buckets for n in bucket_names}
    assert names == {n for n, _ in make_model().named_parameters()}, names
    try:
        hvd.DistributedOptimizer(torch.optim.SGD(make_model().parameters(), lr=0.1), compression=FlatBucket(),
                                 op=hvd.Sum)
    except ValueError as exc:
        assert "op=Average, not op=Sum" in str(exc), exc
    else:
        raise AssertionError("a compressor's reduce_ops did not refuse op=Sum")


def check_horovod_style_compressor():
    train_and_compare(HalfPrecision(), 1e-2, "a compressor object without the Compressor base")


def check_process_set_asked_once_per_step():
    model = torch.nn.Sequential(*[torch.nn.Linear(4, 4) for _ in range(80)])
    opt = hvd.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1),
                                   named_parameters=model.named_parameters())
    asked = []
    included = hvd.global_process_set.included

    def counting():
        asked.append(1)
        return included()

    hvd.global_process_set.included = counting
    try:
        for _ in range(3):
            asked.clear()
            opt.zero_grad()
            model(torch.ones(2, 4)).sum().backward()
            opt.step()
            assert 1 <= len(asked) <= 2, f"the process set was asked {len(asked)} times in a step of 160 hooks"
    finally:
        del hvd.global_process_set.included


def main():
    hvd.init()
    check_bucket_reducing_compressor()
    check_horovod_style_compressor()
    check_process_set_asked_once_per_step()
    print("CHECKS PASSED torch_compressor_interface", flush=True)
    hvd.shutdown()


if __name__ == "__main__":
    sys.exit(main())
