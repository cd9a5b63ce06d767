"""Synthetic training benchmark for JAX: images/sec of data-parallel training with roundel, on random data.

::

    roundelrun -np 2 python examples/jax_synthetic_benchmark.py                       # small CNN, batch 32
    roundelrun -np 2 python examples/jax_synthetic_benchmark.py --model mlp --batch-size 128

Every rank trains a flax model on one fixed random batch (no data loading is
timed): a step is the jitted forward, cross-entropy loss, gradient and
``hvd.DistributedOptimizer`` update (SGD; the gradients are averaged across
ranks inside the step). After ``--num-warmup-batches`` untimed steps it times
``--num-iters`` iterations of ``--num-batches-per-iter`` steps each.

Output, on rank 0 only, in the format of Horovod's synthetic benchmarks::

    Iter #0: 123.4 img/sec per CPU
    ...
    Img/sec per CPU: 120.1 +-5.2
    Total img/sec on 2 CPU(s): 240.2 +-10.4

"per CPU" is the mean over ranks of each rank's own img/sec, "Total" their
sum; ``+-`` is 1.96 standard deviations over the iterations. With
``--compare-local`` it then times the same steps with the plain optax
optimizer (each rank alone, no allreduce) and prints the ratio.
"""

from __future__ import annotations

import argparse
import os
import time

os.environ.setdefault("JAX_PLATFORMS", "cpu")

import flax.linen as nn  # noqa: E402
import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
import optax  # noqa: E402

import roundel.jax as hvd  # noqa: E402


class SmallCNN(nn.Module):
    """Three 3x3 convolutions with pooling, then a dense classifier."""

    num_classes: int

    @nn.compact
    def __call__(self, x):
        for width in (32, 64, 64):
            x = nn.max_pool(nn.relu(nn.Conv(width, (3, 3))(x)), (2, 2), (2, 2))
        return nn.Dense(self.num_classes)(nn.relu(nn.Dense(128)(x.reshape((x.shape[0], -1)))))


class MLP(nn.Module):
    """Two hidden layers of 512 units."""

    num_classes: int

    @nn.compact
    def __call__(self, x):
        x = x.reshape((x.shape[0], -1))
        return nn.Dense(self.num_classes)(nn.relu(nn.Dense(512)(nn.relu(nn.Dense(512)(x)))))


MODELS = {"smallcnn": SmallCNN, "mlp": MLP}


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description="roundel JAX synthetic benchmark",
                                formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    p.add_argument("--model", choices=MODELS, default="smallcnn", help="model to train")
    p.add_argument("--batch-size", type=int, default=32, help="input batch size per rank")
    p.add_argument("--image-size", type=int, default=32, help="height and width of the random images")
    p.add_argument("--num-classes", type=int, default=10, help="number of output classes")
    p.add_argument("--num-warmup-batches", type=int, default=10, help="untimed steps before timing")
    p.add_argument("--num-batches-per-iter", type=int, default=10, help="steps per timed iteration")
    p.add_argument("--num-iters", type=int, default=10, help="number of timed iterations")
    p.add_argument("--fp16-allreduce", action="store_true", help="compress gradients to float16 for the allreduce")
    p.add_argument("--seed", type=int, default=0, help="random seed for the model and the data")
    p.add_argument("--compare-local", action="store_true",
                   help="then time the same steps with the plain optax optimizer (no allreduce) and print the ratio")
    args = p.parse_args(argv)
    for name in ("batch_size", "image_size", "num_classes", "num_batches_per_iter", "num_iters"):
        if getattr(args, name) < 1:
            p.error(f"--{name.replace('_', '-')} must be >= 1")
    if args.num_warmup_batches < 0:
        p.error("--num-warmup-batches must be >= 0")
    return args


def log(text: str) -> None:
    if hvd.rank() == 0:
        print(text, flush=True)


def main(argv=None) -> None:
    args = parse_args(argv)
    hvd.init()
    model = MODELS[args.model](num_classes=args.num_classes)
    key = jax.random.PRNGKey(args.seed + hvd.rank())
    data = jax.random.normal(key, (args.batch_size, args.image_size, args.image_size, 3))
    target = jax.random.randint(key, (args.batch_size,), 0, args.num_classes)
    params = hvd.broadcast_parameters(model.init(jax.random.PRNGKey(args.seed), data[:1])["params"])
    local_tx = optax.sgd(0.01 * hvd.size())
    tx = hvd.DistributedOptimizer(local_tx,
                                  compression=hvd.Compression.fp16 if args.fp16_allreduce else hvd.Compression.none)
    opt_state = tx.init(params)

    def loss_fn(p):
        return optax.softmax_cross_entropy_with_integer_labels(model.apply({"params": p}, data), target).mean()

    def make_step(transformation):
        @jax.jit
        def step(p, s):
            updates, s = transformation.update(jax.grad(loss_fn)(p), s, p)
            return optax.apply_updates(p, updates), s

        return step

    step = make_step(tx)

    def timed(steps: int) -> float:
        nonlocal params, opt_state
        start = time.perf_counter()
        for _ in range(steps):
            params, opt_state = step(params, opt_state)
        jax.block_until_ready(params)
        return time.perf_counter() - start

    count = sum(int(np.prod(leaf.shape)) for leaf in jax.tree_util.tree_leaves(params))
    log(f"Model: {args.model} ({count:,} parameters), input {args.image_size}x{args.image_size}x3")
    log(f"Batch size: {args.batch_size}")
    log(f"Number of CPUs: {hvd.size()}" + (", fp16 allreduce" if args.fp16_allreduce else ""))
    log("Running warmup...")
    timed(max(args.num_warmup_batches, 1))  # at least one step: the first call compiles
    log("Running benchmark...")
    per_rank = []
    for i in range(args.num_iters):
        img_sec = args.batch_size * args.num_batches_per_iter / timed(args.num_batches_per_iter)
        per_rank.append(img_sec)
        mean = hvd.allreduce(jnp.array([img_sec]), op=hvd.Average, name=f"img_sec.{i}")
        log(f"Iter #{i}: {float(mean[0]):.1f} img/sec per CPU")
    totals = np.asarray(hvd.allreduce(jnp.array(per_rank), op=hvd.Sum, name="img_sec.all"))
    total_mean, total_conf = float(np.mean(totals)), 1.96 * float(np.std(totals))
    n = hvd.size()
    log(f"Img/sec per CPU: {total_mean / n:.1f} +-{total_conf / n:.1f}")
    log(f"Total img/sec on {n} CPU(s): {total_mean:.1f} +-{total_conf:.1f}")
    if args.compare_local:  # the same steps without the allreduce, in this run: what communication costs
        step = make_step(local_tx)
        timed(1)
        local = args.batch_size * args.num_batches_per_iter * args.num_iters / timed(
            args.num_batches_per_iter * args.num_iters)
        local = float(hvd.allreduce(jnp.array([local]), op=hvd.Average, name="img_sec.local")[0])
        log(f"Without the allreduce: {local:.1f} img/sec per CPU; with it / without: {total_mean / n / local:.2f}")


if __name__ == "__main__":
    main()
