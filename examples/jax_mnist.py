"""Data-parallel MNIST training with roundel on JAX: a flax CNN, optax SGD and ``hvd.DistributedOptimizer``.

Run it on 2 processes (scikit-learn's bundled digits; nothing to download)::

    roundelrun -np 2 python examples/jax_mnist.py --epochs 5

or on the real MNIST / Fashion-MNIST IDX files::

    roundelrun -np 2 python examples/jax_mnist.py --dataset mnist --data-dir ~/data/mnist

Each rank trains on its own 1/size of the training set; the gradients are
averaged across ranks inside the jitted training step. Rank 0 prints the
loss and accuracy of every epoch (summed over every rank's test samples) and
``final test accuracy: <value>`` at the end.
"""

from __future__ import annotations

import argparse
import os
import sys
import time

os.environ.setdefault("JAX_PLATFORMS", "cpu")

import flax.linen as nn  # noqa: E402
import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
import optax  # noqa: E402

import roundel.jax as hvd  # noqa: E402

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))  # keras_data.py and datasets.py sit beside this file
from keras_data import DATASETS, load_numpy  # noqa: E402


class MnistCNN(nn.Module):
    """Two convolutions and two dense layers, for 28x28x1 images and ten classes."""

    @nn.compact
    def __call__(self, x):
        x = nn.max_pool(nn.relu(nn.Conv(16, (5, 5))(x)), (2, 2), (2, 2))
        x = nn.max_pool(nn.relu(nn.Conv(32, (5, 5))(x)), (2, 2), (2, 2))
        x = nn.relu(nn.Dense(64)(x.reshape((x.shape[0], -1))))
        return nn.Dense(10)(x)


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description="roundel JAX MNIST example",
                                formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    p.add_argument("--dataset", choices=DATASETS, default="digits",
                   help="digits: scikit-learn's bundled 8x8 digits scaled to 28x28 (offline); mnist / "
                        "fashion-mnist: the IDX files in --data-dir")
    p.add_argument("--data-dir", help="directory holding the four MNIST or Fashion-MNIST IDX files")
    p.add_argument("--batch-size", type=int, default=32, help="training batch size per rank")
    p.add_argument("--epochs", type=int, default=5, help="number of epochs to train")
    p.add_argument("--lr", type=float, default=0.05, help="learning rate for one rank, scaled by the rank count")
    p.add_argument("--momentum", type=float, default=0.5, help="SGD momentum")
    p.add_argument("--fp16-allreduce", action="store_true", help="compress gradients to float16 for the allreduce")
    p.add_argument("--seed", type=int, default=42, help="random seed")
    args = p.parse_args(argv)
    if args.batch_size < 1 or args.epochs < 1:
        p.error("--batch-size and --epochs must be >= 1")
    return args


def say(*parts) -> None:
    if hvd.rank() == 0:
        print(*parts, flush=True)


def main(argv=None) -> None:
    args = parse_args(argv)
    hvd.init()
    try:
        (x_train, y_train), (x_test, y_test) = load_numpy(args.dataset, args.data_dir)
    except (OSError, ValueError, ImportError) as exc:
        sys.exit(f"jax_mnist.py: error: {exc}")
    steps = len(x_train) // hvd.size() // args.batch_size  # the same number of steps on every rank
    # each rank its own 1/size of the data (the same split on every rank)
    x_train, y_train = x_train[hvd.rank()::hvd.size()], y_train[hvd.rank()::hvd.size()]
    x_test, y_test = x_test[hvd.rank()::hvd.size()], y_test[hvd.rank()::hvd.size()]

    model = MnistCNN()
    params = model.init(jax.random.PRNGKey(args.seed + hvd.rank()), jnp.zeros((1, 28, 28, 1)))["params"]
    params = hvd.broadcast_parameters(params, root_rank=0)  # every rank starts from rank 0's weights
    tx = hvd.DistributedOptimizer(optax.sgd(args.lr * hvd.size(), momentum=args.momentum),
                                  compression=hvd.Compression.fp16 if args.fp16_allreduce else hvd.Compression.none)
    opt_state = tx.init(params)

    def loss_fn(p, x, y):
        logits = model.apply({"params": p}, x)
        return optax.softmax_cross_entropy_with_integer_labels(logits, y).mean(), logits

    @jax.jit
    def train_step(p, s, x, y):
        (loss, logits), grads = jax.value_and_grad(loss_fn, has_aux=True)(p, x, y)
        updates, s = tx.update(grads, s, p)  # the gradients are averaged across ranks here
        return optax.apply_updates(p, updates), s, loss, jnp.sum(jnp.argmax(logits, -1) == y)

    @jax.jit
    def evaluate(p, x, y):
        loss, logits = loss_fn(p, x, y)
        sums = jnp.stack([loss * len(y), jnp.sum(jnp.argmax(logits, -1) == y), len(y)]).astype(jnp.float32)
        return hvd.allreduce(sums, op=hvd.Sum, name="test_metrics")  # every rank's test samples

    rng = np.random.default_rng(args.seed)  # the same order on every rank
    accuracy = 0.0
    for epoch in range(1, args.epochs + 1):
        started = time.perf_counter()
        order = rng.permutation(len(x_train))
        loss_sum = correct = 0.0
        for i in range(steps):
            rows = order[i * args.batch_size:(i + 1) * args.batch_size]
            params, opt_state, loss, right = train_step(params, opt_state, x_train[rows], y_train[rows])
            loss_sum += float(loss)
            correct += int(right)
        train = hvd.allreduce(jnp.array([loss_sum / steps, correct / (steps * args.batch_size)]), name="train")
        test_loss, test_correct, test_count = np.asarray(evaluate(params, x_test, y_test)).tolist()
        accuracy = test_correct / test_count
        say(f"epoch {epoch}: train loss {float(train[0]):.4f} accuracy {float(train[1]):.4f} | test loss "
            f"{test_loss / test_count:.4f} accuracy {accuracy:.4f} | {time.perf_counter() - started:.1f} s")
    say(f"final test accuracy: {accuracy:.4f}")


if __name__ == "__main__":
    main()
