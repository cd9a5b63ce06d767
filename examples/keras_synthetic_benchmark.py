"""Keras synthetic benchmark: images/sec of data-parallel Keras 3 training with roundel, on random data.

Horovod's ``tensorflow2_synthetic_benchmark.py`` for Keras 3 (TensorFlow
backend by default; ``KERAS_BACKEND=torch`` works too)::

    roundelrun -np 2 python examples/keras_synthetic_benchmark.py                        # ResNet-50, batch 32
    roundelrun -np 2 python examples/keras_synthetic_benchmark.py --model small_cnn --batch-size 64

(ResNet-50 at 224x224 runs at a few images/sec per CPU core: on a small CPU
machine start with ``--image-size 64`` or ``--model small_cnn``.)

Every rank trains the same model (``keras_models.py``; ResNet-50 is
``keras.applications.ResNet50(weights=None)``, nothing is downloaded) on one
fixed random batch, so no data loading is timed: a step is
``model.train_on_batch`` with SGD wrapped in ``hvd.DistributedOptimizer``
(cross-entropy; XLA off, see ``roundel.keras``). Rank 0's weights are
broadcast first. After ``--num-warmup-batches`` untimed steps it times
``--num-iters`` iterations of ``--num-batches-per-iter`` steps each.

Output, on rank 0 only, in the format of Horovod's synthetic benchmark::

    Iter #0: 123.4 img/sec per CPU
    ...
    Img/sec per CPU: 120.1 +-5.2
    Total img/sec on 2 CPU(s): 240.2 +-10.4

An iteration's "per CPU" figure is the mean over ranks of each rank's own
img/sec for that iteration; "Total" is their sum. The ``+-`` is 1.96 standard
deviations over the iterations (a 95% interval for one iteration if the
figures are normal). The word is GPU when TensorFlow has GPUs (one per rank,
by ``local_rank()``).
"""

from __future__ import annotations

import argparse
import os
import sys
import time

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
os.environ.setdefault("TF_ENABLE_ONEDNN_OPTS", "0")  # its "oneDNN custom operations are on" notice, per rank, ignores the log level
os.environ.setdefault("KERAS_BACKEND", "tensorflow")
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))  # keras_models.py sits beside this file

import keras  # noqa: E402
import numpy as np  # noqa: E402

import roundel.keras as hvd  # noqa: E402
from keras_models import MODEL_NAMES, build_model, canonical_name  # noqa: E402


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description="roundel Keras synthetic benchmark",
                                formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    p.add_argument("--model", default="resnet50", help=f"model to train: {', '.join(MODEL_NAMES)}")
    p.add_argument("--batch-size", type=int, default=32, help="input batch size per rank")
    p.add_argument("--image-size", type=int, default=None,
                   help="height and width of the random images (default: 224 for resnet50, 32 for small_cnn)")
    p.add_argument("--num-classes", type=int, default=1000, help="number of output classes")
    p.add_argument("--num-warmup-batches", type=int, default=10, help="untimed steps before timing")
    p.add_argument("--num-batches-per-iter", type=int, default=10, help="steps per timed iteration")
    p.add_argument("--num-iters", type=int, default=10, help="number of timed iterations")
    p.add_argument("--fp16-allreduce", action="store_true", help="compress gradients to float16 for the allreduce")
    p.add_argument("--num-threads", type=int, default=None,
                   help="CPU threads per rank (default: this machine's usable cores / ranks on it)")
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


def use_devices(threads: int) -> str:
    """Pin this rank to its GPU, or limit its CPU threads (the ranks share the cores); returns "GPU" or "CPU"."""
    if keras.backend.backend() == "tensorflow":
        import tensorflow as tf
        gpus = tf.config.list_physical_devices("GPU")
        if gpus:
            tf.config.experimental.set_memory_growth(gpus[hvd.local_rank()], True)
            tf.config.set_visible_devices(gpus[hvd.local_rank()], "GPU")
            return "GPU"
        tf.config.threading.set_intra_op_parallelism_threads(threads)
        tf.config.threading.set_inter_op_parallelism_threads(threads)
    else:
        import torch
        torch.set_num_threads(threads)
    return "CPU"


def main(argv=None) -> None:
    args = parse_args(argv)
    hvd.init()
    threads = args.num_threads or max(1, usable_cores() // hvd.local_size())
    unit = use_devices(threads)
    keras.utils.set_random_seed(args.seed)
    try:
        model = build_model(args.model, args.image_size, args.num_classes)
    except ValueError as exc:
        sys.exit(f"error: {exc}")
    size = model.input_shape[1]
    opt = hvd.DistributedOptimizer(keras.optimizers.SGD(0.01 * hvd.size()),
                                   compression=hvd.Compression.fp16 if args.fp16_allreduce else hvd.Compression.none)
    model.compile(optimizer=opt, loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True),
                  jit_compile=False)
    hvd.broadcast_global_variables(0, model=model)

    rng = np.random.default_rng(args.seed + 1 + hvd.rank())
    data = keras.ops.convert_to_tensor(rng.standard_normal((args.batch_size, size, size, 3), dtype=np.float32))
    target = keras.ops.convert_to_tensor(rng.integers(0, args.num_classes, args.batch_size))

    def timed(steps: int) -> float:
        start = time.perf_counter()
        for _ in range(steps):
            model.train_on_batch(data, target)  # returns the loss as a number: the step has finished
        return time.perf_counter() - start

    log(f"Model: {args.model} ({model.count_params():,} parameters), input {size}x{size}x3, "
        f"Keras {keras.__version__} ({keras.backend.backend()} backend)")
    log(f"Batch size: {args.batch_size}")
    log(f"Number of {unit}s: {hvd.size()}" + ("" if unit == "GPU" else f" ({threads} thread(s) each)")
        + (", fp16 allreduce" if args.fp16_allreduce else ""))

    log("Running warmup...")
    timed(args.num_warmup_batches)

    log("Running benchmark...")
    per_rank = []  # this rank's img/sec in each iteration
    for i in range(args.num_iters):
        img_sec = args.batch_size * args.num_batches_per_iter / timed(args.num_batches_per_iter)
        per_rank.append(img_sec)
        mean = hvd.allreduce(np.array([img_sec]), op=hvd.Average, name=f"img_sec.{i}")  # outside the timing
        log(f"Iter #{i}: {mean[0]:.1f} img/sec per {unit}")

    # Each iteration's total over ranks, then mean and 1.96 std over iterations.
    totals = hvd.allreduce(np.array(per_rank), op=hvd.Sum, name="img_sec.all")
    total_mean, total_conf = float(np.mean(totals)), 1.96 * float(np.std(totals))
    n = hvd.size()
    log(f"Img/sec per {unit}: {total_mean / n:.1f} +-{total_conf / n:.1f}")
    log(f"Total img/sec on {n} {unit}(s): {total_mean:.1f} +-{total_conf:.1f}")


if __name__ == "__main__":
    main()
