"""Elastic Keras training of an MNIST convnet: survives workers failing and hosts coming and going.

    roundelrun -np 2 --min-np 1 --max-np 4 --host-discovery-script ./discover.sh \\
        python examples/keras_mnist_elastic.py                        # digits (scikit-learn), no download
    ... python examples/keras_mnist_elastic.py --dataset mnist --data-dir DIR   # the four IDX files

The training state (model, optimizer, epoch, batch) is committed every
--batches-per-commit batches by ``hvd.elastic.CommitStateCallback``. After a
failure the survivors roll back to the last commit; after any reset the
learning rate is rescaled to the new number of ranks, each rank takes its
new shard of the data, and an interrupted epoch is finished before the
next ones. Rank 0 writes a checkpoint after every epoch (--checkpoint-dir)
and prints the test accuracy at the end. Plain ``roundelrun -np 2`` works too.
"""

from __future__ import annotations

import argparse
import os
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


def parse_args(argv=None):
    p = argparse.ArgumentParser(description="roundel elastic Keras MNIST",
                                formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    p.add_argument("--dataset", choices=DATASETS, default="digits")
    p.add_argument("--data-dir", help="directory holding the four IDX files (mnist / fashion-mnist)")
    p.add_argument("--batch-size", type=int, default=32, help="batch size per rank")
    p.add_argument("--epochs", type=int, default=3)
    p.add_argument("--base-lr", type=float, default=0.01, help="learning rate for one rank (scaled by size)")
    p.add_argument("--momentum", type=float, default=0.9)
    p.add_argument("--batches-per-commit", type=int, default=10)
    p.add_argument("--checkpoint-dir", help="rank 0 saves checkpoint-{epoch}.keras here after every epoch")
    return p.parse_args(argv)


def build_model():
    return keras.Sequential([
        keras.Input((28, 28, 1)),
        keras.layers.Conv2D(32, 3, activation="relu"),
        keras.layers.MaxPooling2D(2),
        keras.layers.Conv2D(64, 3, activation="relu"),
        keras.layers.MaxPooling2D(2),
        keras.layers.Flatten(),
        keras.layers.Dense(128, activation="relu"),
        keras.layers.Dense(10, activation="softmax"),
    ])


def main(argv=None):
    args = parse_args(argv)
    hvd.init()
    keras.utils.set_random_seed(1234)
    (x_train, y_train), (x_test, y_test) = load_numpy(args.dataset, args.data_dir)

    model = build_model()
    optimizer = hvd.DistributedOptimizer(keras.optimizers.SGD(args.base_lr * hvd.size(), momentum=args.momentum))
    model.compile(optimizer=optimizer, loss="sparse_categorical_crossentropy", metrics=["accuracy"],
                  jit_compile=False)
    state = hvd.elastic.KerasState(model, epoch=0, batch=0)

    def rescale_lr():
        model.optimizer.learning_rate = args.base_lr * hvd.size()
        if hvd.rank() == 0:
            print(f"reset: {hvd.size()} rank(s), learning rate {args.base_lr * hvd.size():g}", flush=True)

    state.register_reset_callbacks([rescale_lr])
    callbacks = [SamplesPerSecond(args.batch_size, hvd.size),  # the job's samples/s in rank 0's epoch line
                 hvd.elastic.UpdateBatchStateCallback(state), hvd.elastic.UpdateEpochStateCallback(state),
                 hvd.elastic.CommitStateCallback(state, batches_per_commit=args.batches_per_commit)]  # last

    @hvd.elastic.run
    def train(state):
        # this generation's shard; rank 0 alone checkpoints and prints progress
        x, y = x_train[hvd.rank()::hvd.size()], y_train[hvd.rank()::hvd.size()]
        steps = len(x) // args.batch_size
        data = (tf.data.Dataset.from_tensor_slices((x, y)).repeat()
                .shuffle(2048, seed=state.epoch * 1000 + hvd.rank()).batch(args.batch_size))
        extra = []
        if args.checkpoint_dir and hvd.rank() == 0:
            os.makedirs(args.checkpoint_dir, exist_ok=True)
            extra.append(keras.callbacks.ModelCheckpoint(os.path.join(args.checkpoint_dir,
                                                                      "checkpoint-{epoch}.keras")))
        verbose = 2 if hvd.rank() == 0 else 0
        if 0 < state.batch < steps:  # finish the epoch a reset interrupted
            model.fit(data, steps_per_epoch=steps - state.batch, initial_epoch=state.epoch,
                      epochs=state.epoch + 1, callbacks=callbacks + extra, verbose=verbose, shuffle=False)
        elif state.batch:  # at more ranks, this rank's smaller shard of that epoch is already done
            state.epoch, state.batch = state.epoch + 1, 0
        model.fit(data, steps_per_epoch=steps, initial_epoch=state.epoch, epochs=args.epochs,
                  callbacks=callbacks + extra, verbose=verbose, shuffle=False)  # the dataset shuffles itself

    train(state)

    # each rank evaluates its share of the test set; the averages are averaged
    part = len(x_test) // hvd.size()
    lo = hvd.rank() * part
    loss, accuracy = model.evaluate(x_test[lo:lo + part], y_test[lo:lo + part], verbose=0)
    loss, accuracy = hvd.allreduce(np.array([loss, accuracy]), name="test_metrics")
    if hvd.rank() == 0:
        print(f"test loss: {loss:.4f}  test accuracy: {accuracy:.4f}", flush=True)
    return accuracy


if __name__ == "__main__":
    main()
