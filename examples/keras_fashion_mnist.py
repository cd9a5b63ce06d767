"""The Horovod Keras walkthrough's finished script, on roundel and Keras 3.

    roundelrun -np 2 python examples/keras_fashion_mnist.py                       # digits, no download
    roundelrun -np 2 python examples/keras_fashion_mnist.py --dataset fashion-mnist --data-dir DIR
    roundelrun -np 2 python examples/keras_fashion_mnist.py --checkpoint-dir ck --resume

The walkthrough's steps, as numbered there:
 1. hvd.init()
 2. pin each process to one GPU (local_rank), when there are GPUs
 3. print and log on rank 0 only (verbose)
 4. scale the learning rate by the number of ranks and wrap the optimizer in hvd.DistributedOptimizer
 5. BroadcastGlobalVariablesCallback(0): every rank starts from rank 0's weights
 6. fewer steps per epoch: each rank trains on its shard of the data
 7. MetricAverageCallback: epoch metrics averaged over the ranks
 8. checkpoints on rank 0 only; --resume finds the last one and rank 0 broadcasts the epoch to resume from
 9. learning-rate warm-up (LearningRateWarmupCallback) and schedule (LearningRateScheduleCallback)
10. a large-batch optimizer: NovoGrad (--optimizer novograd, roundel.keras.optimizers.NovoGrad, in place of
    tensorflow_addons' tfa.optimizers.NovoGrad) or Keras's LAMB (--optimizer lamb)

XLA: the train step is compiled with jit_compile=False (roundel's collectives are Python ops).
"""

from __future__ import annotations

import argparse
import glob
import os
import re
import sys

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
os.environ.setdefault("TF_ENABLE_ONEDNN_OPTS", "0")  # its "oneDNN custom operations are on" notice, per rank, ignores the log level
os.environ.setdefault("KERAS_BACKEND", "tensorflow")
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import keras  # noqa: E402
import numpy as np  # noqa: E402
import tensorflow as tf  # noqa: E402

import roundel.keras as hvd  # noqa: E402
from keras_data import DATASETS, load_numpy  # noqa: E402
from keras_throughput import SamplesPerSecond  # noqa: E402


DESCRIBED = {"digits": "digits (the default: scikit-learn's 8x8 handwritten digits scaled to 28x28, no download; "
                      "for Fashion-MNIST pass --dataset fashion-mnist --data-dir DIR)"}


def parse_args(argv=None):
    p = argparse.ArgumentParser(description="roundel Keras Fashion-MNIST walkthrough",
                                formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    p.add_argument("--dataset", choices=DATASETS, default="digits")
    p.add_argument("--data-dir", help="directory holding the four IDX files (mnist / fashion-mnist)")
    p.add_argument("--batch-size", type=int, default=32, help="batch size per rank")
    p.add_argument("--epochs", type=int, default=6)
    p.add_argument("--base-lr", type=float, default=None,
                   help="learning rate for one rank (scaled by size); default 0.01, for novograd 0.1")
    p.add_argument("--warmup-epochs", type=float, default=2)
    p.add_argument("--momentum", type=float, default=0.9)
    p.add_argument("--optimizer", choices=("sgd", "adam", "novograd", "lamb"), default="sgd")
    p.add_argument("--fp16-allreduce", action="store_true")
    p.add_argument("--checkpoint-dir", help="rank 0 saves checkpoint-{epoch}.keras here after every epoch")
    p.add_argument("--resume", action="store_true", help="continue from the last checkpoint in --checkpoint-dir")
    args = p.parse_args(argv)
    if args.base_lr is None:
        args.base_lr = 0.1 if args.optimizer == "novograd" else 0.01  # NovoGrad steps each layer by about lr
    return args


def build_model():
    return keras.Sequential([
        keras.Input((28, 28, 1)),
        keras.layers.Conv2D(32, 3, activation="relu"),
        keras.layers.MaxPooling2D(2),
        keras.layers.Conv2D(64, 3, activation="relu"),
        keras.layers.MaxPooling2D(2),
        keras.layers.Flatten(),
        keras.layers.Dropout(0.25),
        keras.layers.Dense(128, activation="relu"),
        keras.layers.Dense(10, activation="softmax"),
    ])


def last_checkpoint(directory):
    found = []
    for path in glob.glob(os.path.join(directory, "checkpoint-*.keras")):
        match = re.search(r"checkpoint-(\d+)\.keras$", path)
        if match:
            found.append((int(match.group(1)), path))
    return max(found) if found else (0, None)


def main(argv=None):
    args = parse_args(argv)
    hvd.init()                                                     # step 1
    for gpu in tf.config.list_physical_devices("GPU"):             # step 2
        tf.config.experimental.set_memory_growth(gpu, True)
    gpus = tf.config.list_physical_devices("GPU")
    if gpus:
        tf.config.set_visible_devices(gpus[hvd.local_rank()], "GPU")
    verbose = 1 if hvd.rank() == 0 else 0                          # step 3
    keras.utils.set_random_seed(1234 + hvd.rank())  # different init per rank: step 5 makes them equal

    (x_train, y_train), (x_test, y_test) = load_numpy(args.dataset, args.data_dir)
    if verbose:
        print(f"data set: {DESCRIBED.get(args.dataset, args.dataset)}", flush=True)
    # step 6: each rank trains on its own shard, so an epoch has size-times fewer steps
    shard = len(x_train) // hvd.size()
    x_train = x_train[hvd.rank() * shard:(hvd.rank() + 1) * shard]
    y_train = y_train[hvd.rank() * shard:(hvd.rank() + 1) * shard]
    steps_per_epoch = shard // args.batch_size

    # step 8: the epoch to resume from, decided on rank 0 and broadcast
    resume_epoch, resume_path = 0, None
    if args.resume and args.checkpoint_dir and hvd.rank() == 0:
        resume_epoch, resume_path = last_checkpoint(args.checkpoint_dir)
    resume_epoch, resume_path = hvd.broadcast_object((resume_epoch, resume_path), 0, name="resume_from_epoch")

    scaled_lr = args.base_lr * hvd.size()                          # step 4 (and 9: learning-rate scaling)
    if resume_path:
        model = hvd.load_model(resume_path, compression=hvd.Compression.fp16 if args.fp16_allreduce
                               else hvd.Compression.none)
        if verbose:
            print(f"resumed from {resume_path} (epoch {resume_epoch}, {type(model.optimizer).__name__})", flush=True)
    else:
        model = build_model()
        if args.optimizer == "sgd":
            opt = keras.optimizers.SGD(scaled_lr, momentum=args.momentum)
        elif args.optimizer == "adam":
            opt = keras.optimizers.Adam(scaled_lr)
        elif args.optimizer == "novograd":                          # step 10: NovoGrad or LAMB
            opt = hvd.optimizers.NovoGrad(scaled_lr, weight_decay=1e-3, grad_averaging=True)
        else:
            opt = keras.optimizers.Lamb(scaled_lr)
        opt = hvd.DistributedOptimizer(opt, compression=hvd.Compression.fp16 if args.fp16_allreduce
                                       else hvd.Compression.none)
        model.compile(optimizer=opt, loss="sparse_categorical_crossentropy", metrics=["accuracy"],
                      jit_compile=False)

    callbacks = [
        SamplesPerSecond(args.batch_size, hvd.size),                # the job's samples/s in the epoch line
        hvd.callbacks.BroadcastGlobalVariablesCallback(0),          # step 5
        hvd.callbacks.MetricAverageCallback(),                      # step 7
        hvd.callbacks.LearningRateWarmupCallback(initial_lr=scaled_lr, warmup_epochs=args.warmup_epochs,
                                                 verbose=verbose),  # step 9
        hvd.callbacks.LearningRateScheduleCallback(initial_lr=scaled_lr, multiplier=1.0,
                                                   start_epoch=args.warmup_epochs, end_epoch=args.epochs * 2 // 3),
        hvd.callbacks.LearningRateScheduleCallback(initial_lr=scaled_lr, multiplier=0.1,
                                                   start_epoch=args.epochs * 2 // 3),
    ]
    if args.checkpoint_dir and hvd.rank() == 0:                     # step 8: rank 0 only
        os.makedirs(args.checkpoint_dir, exist_ok=True)
        callbacks.append(keras.callbacks.ModelCheckpoint(os.path.join(args.checkpoint_dir,
                                                                      "checkpoint-{epoch}.keras")))

    train = (tf.data.Dataset.from_tensor_slices((x_train, y_train)).repeat()
             .shuffle(4096, seed=hvd.rank()).batch(args.batch_size))
    model.fit(train, steps_per_epoch=steps_per_epoch, shuffle=False,  # the dataset shuffles itself
              epochs=args.epochs, initial_epoch=resume_epoch, callbacks=callbacks, verbose=verbose)

    # Evaluate each rank's share of the test set and average.
    part = len(x_test) // hvd.size()
    lo = hvd.rank() * part
    loss, accuracy = model.evaluate(x_test[lo:lo + part], y_test[lo:lo + part], verbose=0)
    loss, accuracy = hvd.allreduce(np.array([loss, accuracy]), name="test_metrics")
    if verbose:
        print(f"test loss: {loss:.4f}  test accuracy: {accuracy:.4f}  (data set: {args.dataset})", flush=True)
    return accuracy


if __name__ == "__main__":
    main()
