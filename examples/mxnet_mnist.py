"""Data-parallel training of a Gluon MLP with roundel.mxnet, Horovod's MXNet recipe.

Run it on 2 processes (scikit-learn's bundled digits, scaled to MNIST's
28x28 as in pytorch_mnist.py; nothing to download), in an environment with
``pip install 'roundel[mxnet]'``::

    roundelrun -np 2 python examples/mxnet_mnist.py --epochs 5

A Horovod script is the same with ``import horovod.mxnet as hvd`` and
``horovodrun``; every ``hvd.`` call below is Horovod's API.
"""

from __future__ import annotations

import argparse
import os
import sys
import time

import mxnet as mx
import numpy as np
from mxnet import autograd, gluon

import roundel.mxnet as hvd

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))  # datasets.py sits beside this file
from datasets import load_digits  # noqa: E402


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description="roundel MXNet digits example",
                                formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    p.add_argument("--epochs", type=int, default=5, help="number of epochs to train")
    p.add_argument("--batch-size", type=int, default=32, help="training batch size per rank")
    p.add_argument("--lr", type=float, default=0.01, help="learning rate for one rank, scaled by the rank count")
    p.add_argument("--momentum", type=float, default=0.9, help="SGD momentum")
    p.add_argument("--seed", type=int, default=42, help="random seed")
    p.add_argument("--fp16-allreduce", action="store_true", help="compress gradients to float16 for the allreduce")
    p.add_argument("--gradient-predivide-factor", type=float, default=1.0,
                   help="divide gradients by this before the sum and by size/this after")
    args = p.parse_args(argv)
    if args.epochs < 1 or args.batch_size < 1 or args.lr <= 0:
        p.error("--epochs and --batch-size must be at least 1 and --lr positive")
    return args


def load_data():
    """Digits as flat float32 images (N x 784) and int labels, split as pytorch_mnist.py splits them."""
    train, test = load_digits()

    def flat(ds):
        images, labels = ds.tensors
        return images.numpy().reshape(len(labels), -1), labels.numpy().astype(np.float32)

    return flat(train), flat(test)


def make_net() -> gluon.nn.HybridSequential:
    net = gluon.nn.HybridSequential()
    with net.name_scope():
        net.add(gluon.nn.Dense(128, activation="relu"))  # input size left to the first batch (deferred init)
        net.add(gluon.nn.Dense(64, activation="relu"))
        net.add(gluon.nn.Dense(10))
    return net


def accuracy(net, x: np.ndarray, y: np.ndarray) -> float:
    """The fraction of every rank's share of (x, y) classified right."""
    mine = slice(hvd.rank(), None, hvd.size())
    predicted = net(mx.nd.array(x[mine])).argmax(axis=1).asnumpy()
    counts = mx.nd.array([float((predicted == y[mine]).sum()), float(len(predicted))], dtype="float64")
    correct, total = hvd.allreduce(counts, op=hvd.Sum, name="accuracy").asnumpy()
    return correct / total


def main(argv=None) -> float:
    args = parse_args(argv)
    # roundel: 1. initialize
    hvd.init()
    mx.random.seed(args.seed + hvd.rank())  # different initial values: broadcast_parameters makes them one
    (x_train, y_train), (x_test, y_test) = load_data()
    # roundel: 2. each rank trains on its own share of the data, the same number of batches everywhere
    x_mine, y_mine = x_train[hvd.rank()::hvd.size()], y_train[hvd.rank()::hvd.size()]
    steps = (len(x_train) // hvd.size()) // args.batch_size

    net = make_net()
    net.initialize(mx.init.Xavier())
    net.hybridize()
    params = net.collect_params()
    # roundel: 3. start every rank from rank 0's parameters (broadcast after their deferred initialization)
    hvd.broadcast_parameters(params, root_rank=0)
    # roundel: 4. the learning rate scaled by the rank count, gradients averaged by the DistributedTrainer
    compression = hvd.Compression.fp16 if args.fp16_allreduce else hvd.Compression.none
    trainer = hvd.DistributedTrainer(params, "sgd", {"learning_rate": args.lr * hvd.size(),
                                                     "momentum": args.momentum},
                                     compression=compression,
                                     gradient_predivide_factor=args.gradient_predivide_factor)
    loss_fn = gluon.loss.SoftmaxCrossEntropyLoss()
    shuffle = np.random.RandomState(args.seed + hvd.rank())
    for epoch in range(1, args.epochs + 1):
        start = time.perf_counter()
        order = shuffle.permutation(len(x_mine))
        total_loss = 0.0
        for step in range(steps):
            batch = order[step * args.batch_size:(step + 1) * args.batch_size]
            data, label = mx.nd.array(x_mine[batch]), mx.nd.array(y_mine[batch])
            with autograd.record():
                loss = loss_fn(net(data), label)
            loss.backward()
            trainer.step(args.batch_size)
            total_loss += float(loss.mean().asscalar())
        mean_loss = hvd.allreduce(mx.nd.array([total_loss / steps]), name="loss").asscalar()
        test_accuracy = accuracy(net, x_test, y_test)
        if hvd.rank() == 0:
            samples = steps * args.batch_size * hvd.size()
            print(f"epoch {epoch}: loss {mean_loss:.4f}, test accuracy {test_accuracy:.4f}, "
                  f"{samples / (time.perf_counter() - start):.0f} samples/s", flush=True)
    if hvd.rank() == 0:
        print(f"final test accuracy: {test_accuracy:.4f}", flush=True)
    hvd.shutdown()
    return test_accuracy


if __name__ == "__main__":
    main()
