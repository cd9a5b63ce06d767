"""The Horovod TensorFlow 2 recipe on roundel: GradientTape, tf.data with dataset.shard, rank-0 checkpoints.

    roundelrun -np 2 python examples/tensorflow2_mnist.py                 # digits, no download
    roundelrun -np 2 python examples/tensorflow2_mnist.py --dataset mnist --data-dir DIR

Recipe: hvd.init(); shard the data with dataset.shard(hvd.size(), hvd.rank());
scale the learning rate by size; wrap the tape in hvd.DistributedGradientTape;
broadcast model and optimizer variables from rank 0 after the first step;
average the reported loss with hvd.allreduce(loss, average=True); save
checkpoints on rank 0 only. Rank 0 shows a progress bar with the job's
samples/s on stderr (examples/progress_bar.py).
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
import tensorflow as tf  # noqa: E402

import roundel.tensorflow as hvd  # noqa: E402
from keras_data import DATASETS, load_numpy  # noqa: E402
from progress_bar import sample_bar  # noqa: E402


def parse_args(argv=None):
    p = argparse.ArgumentParser(description="roundel TensorFlow 2 MNIST recipe",
                                formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    p.add_argument("--dataset", choices=DATASETS, default="digits")
    p.add_argument("--data-dir", help="directory holding the four IDX files (mnist / fashion-mnist)")
    p.add_argument("--batch-size", type=int, default=32, help="batch size per rank")
    p.add_argument("--steps", type=int, default=200, help="training steps (in total, per rank)")
    p.add_argument("--lr", type=float, default=0.001, help="learning rate for one rank (scaled by size)")
    p.add_argument("--checkpoint-dir", help="rank 0 saves the weights here every --log-every steps")
    p.add_argument("--log-every", type=int, default=50)
    return p.parse_args(argv)


def main(argv=None):
    args = parse_args(argv)
    hvd.init()
    for gpu in tf.config.list_physical_devices("GPU"):
        tf.config.experimental.set_memory_growth(gpu, True)
    gpus = tf.config.list_physical_devices("GPU")
    if gpus:
        tf.config.set_visible_devices(gpus[hvd.local_rank()], "GPU")

    (x_train, y_train), (x_test, y_test) = load_numpy(args.dataset, args.data_dir)
    dataset = (tf.data.Dataset.from_tensor_slices((x_train, y_train))
               .shard(hvd.size(), hvd.rank())          # each rank reads its own part
               .repeat().shuffle(10000, seed=hvd.rank()).batch(args.batch_size))

    keras.utils.set_random_seed(hvd.rank())  # different on purpose: the first-step broadcast equalizes them
    model = keras.Sequential([
        keras.Input((28, 28, 1)),
        keras.layers.Conv2D(32, 3, activation="relu"),
        keras.layers.Conv2D(64, 3, activation="relu"),
        keras.layers.MaxPooling2D(2),
        keras.layers.Dropout(0.25),
        keras.layers.Flatten(),
        keras.layers.Dense(128, activation="relu"),
        keras.layers.Dense(10, activation="softmax"),
    ])
    loss_fn = keras.losses.SparseCategoricalCrossentropy()
    opt = keras.optimizers.Adam(args.lr * hvd.size())
    opt.build(model.trainable_variables)

    @tf.function
    def training_step(images, labels, first_batch):
        with tf.GradientTape() as tape:
            loss = loss_fn(labels, model(images, training=True))
        tape = hvd.DistributedGradientTape(tape)
        grads = tape.gradient(loss, model.trainable_variables)
        opt.apply_gradients(zip(grads, model.trainable_variables))
        # Broadcast after the first step so that the optimizer's state is included.
        if first_batch:
            hvd.broadcast_variables(model.variables, root_rank=0)
            hvd.broadcast_variables(opt.variables, root_rank=0)
        return loss

    # rank 0's bar on stderr counts the job's samples: every rank trains on batches of the same size
    with sample_bar(args.steps * args.batch_size * hvd.size(), "training", hvd.rank()) as bar:
        for step, (images, labels) in enumerate(dataset.take(args.steps)):
            loss = training_step(images, labels, step == 0)
            bar.update(len(images) * hvd.size())
            if step % args.log_every == 0 or step == args.steps - 1:
                avg = hvd.allreduce(loss, average=True, name="train_loss")
                if hvd.rank() == 0:
                    bar.write(f"step {step}: loss {float(avg):.4f}", file=sys.stdout)  # above the bar on a terminal
                    sys.stdout.flush()
                    if args.checkpoint_dir:
                        os.makedirs(args.checkpoint_dir, exist_ok=True)
                        model.save_weights(os.path.join(args.checkpoint_dir, "checkpoint.weights.h5"))

    # Test accuracy on each rank's part of the test set, averaged over the ranks.
    part = len(x_test) // hvd.size()
    lo = hvd.rank() * part
    predictions = model(x_test[lo:lo + part], training=False)
    correct = tf.reduce_mean(tf.cast(tf.equal(tf.argmax(predictions, 1), y_test[lo:lo + part]), tf.float32))
    accuracy = float(hvd.allreduce(correct, average=True, name="test_accuracy"))
    if hvd.rank() == 0:
        print(f"test accuracy: {accuracy:.4f}", flush=True)
    return accuracy


if __name__ == "__main__":
    main()
