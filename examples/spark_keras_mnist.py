"""A Keras (TensorFlow backend) digits classifier trained by ``roundel.spark.run`` on a local Spark cluster.

    python examples/spark_keras_mnist.py                              # 2 ranks on local-cluster[2,1,1024]
    python examples/spark_keras_mnist.py --master 'local[2]' --epochs 8

Each rank runs in one Spark task (a barrier stage); the Spark driver, this
process, runs the job's rendezvous store and gets the ranks' results back.
The data is scikit-learn's bundled 8x8 handwritten digits (no download),
split the same way on every rank; each rank trains on its shard. Needs Java
for Spark, and pyspark, tensorflow-cpu and scikit-learn (pip install
'roundel[spark,tensorflow]' scikit-learn).
"""

from __future__ import annotations

import argparse
import os
import sys

import roundel.spark


def train(epochs: int, batch_size: int, base_lr: float) -> float:
    """One rank's training (run in its Spark task's process); returns the test accuracy averaged over ranks."""
    import keras
    import numpy as np
    from sklearn.datasets import load_digits
    from sklearn.model_selection import train_test_split

    import roundel.keras as hvd

    hvd.init()
    keras.utils.set_random_seed(1234 + hvd.rank())  # different init per rank: the broadcast makes them equal
    digits = load_digits()
    x_train, x_test, y_train, y_test = train_test_split(
        (digits.data / 16.0).astype("float32"), digits.target, test_size=0.25, random_state=0, stratify=digits.target)
    x_train, y_train = x_train[hvd.rank()::hvd.size()], y_train[hvd.rank()::hvd.size()]

    model = keras.Sequential([keras.Input((64,)), keras.layers.Dense(64, activation="relu"),
                              keras.layers.Dense(10, activation="softmax")])
    optimizer = hvd.DistributedOptimizer(keras.optimizers.SGD(base_lr * hvd.size(), momentum=0.9))
    model.compile(optimizer=optimizer, loss="sparse_categorical_crossentropy", metrics=["accuracy"],
                  jit_compile=False)
    model.fit(x_train, y_train, batch_size=batch_size, epochs=epochs,
              callbacks=[hvd.callbacks.BroadcastGlobalVariablesCallback(0), hvd.callbacks.MetricAverageCallback()],
              verbose=2 if hvd.rank() == 0 else 0)
    x_part, y_part = x_test[hvd.rank()::hvd.size()], y_test[hvd.rank()::hvd.size()]
    _, accuracy = model.evaluate(x_part, y_part, verbose=0)
    return float(hvd.allreduce(np.array([accuracy]), name="test_accuracy")[0])


def parse_args(argv=None):
    p = argparse.ArgumentParser(description="roundel.spark: Keras digits on Spark",
                                formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    p.add_argument("--master", default="local-cluster[2,1,1024]", help="Spark master URL")
    p.add_argument("--num-proc", type=int, default=2, help="ranks (Spark tasks)")
    p.add_argument("--epochs", type=int, default=6)
    p.add_argument("--batch-size", type=int, default=32, help="batch size per rank")
    p.add_argument("--base-lr", type=float, default=0.05, help="learning rate for one rank (scaled by size)")
    return p.parse_args(argv)


def local_spark(master: str):
    """A SparkSession on this machine only: loopback addresses, no web UI."""
    from pyspark.sql import SparkSession

    os.environ.setdefault("SPARK_LOCAL_IP", "127.0.0.1")
    os.environ.setdefault("PYSPARK_PYTHON", sys.executable)
    session = (SparkSession.builder.master(master).appName("roundel-spark-keras")
               .config("spark.driver.host", "127.0.0.1").config("spark.driver.bindAddress", "127.0.0.1")
               .config("spark.ui.enabled", "false").config("spark.ui.showConsoleProgress", "false")
               .getOrCreate())
    session.sparkContext.setLogLevel("ERROR")
    return session


def main(argv=None, spark=None) -> float:
    """Train on ``spark`` (default: a new local session for this run) and print the test accuracy."""
    args = parse_args(argv)
    session = spark or local_spark(args.master)
    try:
        env = {"KERAS_BACKEND": "tensorflow", "TF_CPP_MIN_LOG_LEVEL": "2", "TF_ENABLE_ONEDNN_OPTS": "0"}
        accuracies = roundel.spark.run(train, args=(args.epochs, args.batch_size, args.base_lr),
                                       num_proc=args.num_proc, env=env)
    finally:
        if spark is None:
            session.stop()
    print(f"test accuracy: {accuracies[0]:.4f}", flush=True)
    return accuracies[0]


if __name__ == "__main__":
    main()
