"""roundel.mxnet's training pieces under roundelrun: ``mxnet_training.py SCENARIO,...``.

Distributed training (each rank steps on its slice of every batch) is compared
with one process stepping on the whole batch, computed here in the same
process; broadcast_parameters is checked against every rank's gathered values.
Each scenario that holds prints ``CHECKS PASSED <scenario>``.
"""

from __future__ import annotations

import sys
import warnings

import mxnet as mx
import numpy as np
from mxnet import autograd, gluon

import roundel.mxnet as hvd

RANK = SIZE = None
PER_RANK = 4
STEPS = 4


def make_net(seed: int, deferred: bool = False) -> gluon.nn.HybridSequential:
    """A small MLP whose initial parameters depend only on ``seed``."""
    net = gluon.nn.HybridSequential()
    with net.name_scope():
        net.add(gluon.nn.Dense(16, activation="tanh", in_units=0 if deferred else 6))
        net.add(gluon.nn.Dense(3, in_units=0 if deferred else 16))
    mx.random.seed(seed)
    net.initialize(mx.init.Xavier())
    return net


def batches():
    r = np.random.RandomState(1234)
    return [(r.standard_normal((PER_RANK * SIZE, 6)).astype(np.float32),
             r.standard_normal((PER_RANK * SIZE, 3)).astype(np.float32)) for _ in range(STEPS)]


def values(net) -> list:
    return [p.data().asnumpy() for _, p in sorted(net.collect_params().items())]


def copy_values(source, target) -> None:
    for (_, p), (_, q) in zip(sorted(source.collect_params().items()), sorted(target.collect_params().items())):
        q.set_data(p.data().copy())


def step(net, trainer, x, y) -> None:
    with autograd.record():
        loss = gluon.loss.L2Loss()(net(mx.nd.array(x)), mx.nd.array(y))
    loss.backward()
    trainer.step(x.shape[0])


def train_pair(make_trainer, optimizer: str, optimizer_params: dict):
    """Train with ``make_trainer(params)`` on this rank's slices and a plain Trainer on whole batches."""
    net, ref = make_net(0), make_net(0)
    trainer = make_trainer(net.collect_params())
    ref_trainer = gluon.Trainer(ref.collect_params(), optimizer, dict(optimizer_params), kvstore=None)
    mine = slice(RANK * PER_RANK, (RANK + 1) * PER_RANK)
    for x, y in batches():
        step(net, trainer, x[mine], y[mine])
        step(ref, ref_trainer, x, y)
    return values(net), values(ref)


def assert_close(got: list, expected: list, tol: float, what: str) -> None:
    for i, (a, b) in enumerate(zip(got, expected)):
        diff = float(np.abs(a - b).max())
        assert diff <= tol, f"{what}: parameter {i} differs from one process on the whole batch by {diff} > {tol}"


def assert_same_on_all_ranks(arrays: list, what: str) -> None:
    for i, a in enumerate(arrays):
        gathered = hvd.allgather(mx.nd.array(a[None])).asnumpy()
        assert all(np.array_equal(g, gathered[0]) for g in gathered), f"{what}: parameter {i} differs across ranks"


def initial_moved(got: list, what: str) -> None:
    start = values(make_net(0))
    assert any(float(np.abs(a - b).max()) > 1e-3 for a, b in zip(got, start)), f"{what}: training changed nothing"


# ------------------------------------------------------------------ scenarios
def scenario_trainer():
    cases = {
        "sgd": ("sgd", {"learning_rate": 0.1, "momentum": 0.9}, {}, 1e-5),
        "adam, 2 groups": ("adam", {"learning_rate": 0.01}, {"num_groups": 2}, 1e-5),
        "predivide 4, prefix": ("sgd", {"learning_rate": 0.1}, {"gradient_predivide_factor": 4.0,
                                                                  "prefix": "t2."}, 1e-5),
        "fp16": ("sgd", {"learning_rate": 0.1}, {"compression": hvd.Compression.fp16}, 5e-3),
        "fp16, 3 groups": ("sgd", {"learning_rate": 0.1}, {"compression": hvd.Compression.fp16,
                                                            "num_groups": 3}, 5e-3),
    }
    for what, (optimizer, params, extra, tol) in cases.items():
        got, expected = train_pair(lambda p: hvd.DistributedTrainer(p, optimizer, dict(params), **extra),
                                   optimizer, params)
        assert_close(got, expected, tol, f"DistributedTrainer {what}")
        assert_same_on_all_ranks(got, f"DistributedTrainer {what}")
        initial_moved(got, f"DistributedTrainer {what}")
    # a DistributedOptimizer handed to the trainer is unwrapped, with a warning
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        trainer = hvd.DistributedTrainer(make_net(0).collect_params(),
                                         hvd.DistributedOptimizer(mx.optimizer.SGD(learning_rate=0.1)))
    assert not isinstance(trainer._optimizer, hvd.DistributedOptimizer), "DistributedOptimizer not unwrapped"
    assert any("unwrapped" in str(w.message) for w in caught), [str(w.message) for w in caught]
    try:
        hvd.DistributedTrainer(make_net(0).collect_params(), "sgd", gradient_predivide_factor=0)
    except ValueError as exc:
        assert "must be positive" in str(exc), exc
    else:
        raise AssertionError("gradient_predivide_factor=0 accepted")


def scenario_optimizer():
    # SGD's updates come in lists of 4 (MXNet's aggregation), Adam's one at a time
    cases = {
        "sgd": (lambda: mx.optimizer.SGD(learning_rate=0.1, momentum=0.9), "sgd",
                {"learning_rate": 0.1, "momentum": 0.9}, {}),
        "sgd, 2 groups": (lambda: mx.optimizer.SGD(learning_rate=0.1), "sgd", {"learning_rate": 0.1},
                          {"num_groups": 2}),
        "adam, predivide 2": (lambda: mx.optimizer.Adam(learning_rate=0.01), "adam", {"learning_rate": 0.01},
                              {"gradient_predivide_factor": 2.0}),
    }
    for what, (make_opt, name, params, extra) in cases.items():
        got, expected = train_pair(
            lambda p: gluon.Trainer(p, hvd.DistributedOptimizer(make_opt(), **extra), kvstore=None), name, params)
        assert_close(got, expected, 1e-5, f"DistributedOptimizer {what}")
        assert_same_on_all_ranks(got, f"DistributedOptimizer {what}")
        initial_moved(got, f"DistributedOptimizer {what}")
    wrapped = hvd.DistributedOptimizer(mx.optimizer.SGD(learning_rate=0.5))
    wrapped.rescale_grad = 0.25
    assert wrapped._optimizer.rescale_grad == 0.25, "rescale_grad did not reach the wrapped optimizer"
    wrapped.set_learning_rate(0.125)
    assert wrapped.learning_rate == 0.125 == wrapped._optimizer.learning_rate, "set_learning_rate"


def scenario_broadcast_parameters():
    # every rank starts from its own values; afterwards all hold rank 0's
    net = make_net(100 + RANK)
    own = values(net)
    hvd.broadcast_parameters(net.collect_params(), root_rank=0)
    after = values(net)
    assert_same_on_all_ranks(after, "broadcast_parameters(ParameterDict)")
    if RANK == 0:
        assert_close(after, own, 0.0, "the root's parameters")
    else:
        assert any(not np.array_equal(a, b) for a, b in zip(after, own)), "nothing was broadcast"
    # a dict of NDArrays (Module.get_params()), from rank 1
    arrays = {"w": mx.nd.array(np.full((2, 3), RANK, np.float32)), "b": mx.nd.array([RANK * 2], dtype="int64")}
    hvd.broadcast_parameters(arrays, root_rank=1, prefix="dict.")
    assert (arrays["w"].asnumpy() == 1).all() and arrays["b"].asnumpy().tolist() == [2], "dict broadcast"
    # deferred initialization: broadcast once the first forward pass has given the shapes
    deferred = make_net(200 + RANK, deferred=True)
    hvd.broadcast_parameters(deferred.collect_params(), prefix="deferred.")
    deferred(mx.nd.ones((2, 6)))
    assert_same_on_all_ranks(values(deferred), "broadcast_parameters with deferred initialization")
    unsynced = make_net(200 + RANK, deferred=True)
    unsynced(mx.nd.ones((2, 6)))
    gathered = [hvd.allgather(mx.nd.array(a[None])).asnumpy() for a in values(unsynced)]
    assert any(not np.array_equal(g[0], g[1]) for g in gathered), \
        "seeds did not differ: the deferred check proves nothing"


SCENARIOS = {name[len("scenario_"):]: fn for name, fn in globals().items() if name.startswith("scenario_")}


def main(argv):
    global RANK, SIZE
    hvd.init()
    RANK, SIZE = hvd.rank(), hvd.size()
    assert SIZE >= 2, "run under roundelrun -np 2 or more"
    for name in argv[1].split(","):
        SCENARIOS[name]()
        print(f"CHECKS PASSED {name}", flush=True)
    hvd.shutdown()


if __name__ == "__main__":
    main(sys.argv)
