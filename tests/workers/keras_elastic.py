"""Elastic Keras 3 training for the elastic tests: a small dense model on synthetic data, fitted with ``model.fit``.

Each rank trains on its shard (``rank::size``) of 192 samples, so ranks
whose gradients are not averaged drift apart. Prints, for the tests to
check: ``PID <pid>`` at start; ``COMMIT <step>`` on rank 0 after each
commit (by ``hvd.elastic.CommitStateCallback``); ``RESET <size>`` from the
reset callback; ``FINAL <json>`` at the end (epoch, step, rank, size and
the weights). Settings from the environment: ``EPOCHS``, ``BATCH``,
``COMMIT_EVERY``, ``STEP_SLEEP``, and ``FAST_FILE``: once that file exists,
steps no longer sleep (the test has done what needed training slowed down).
"""

import json
import os
import time

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
os.environ.setdefault("KERAS_BACKEND", "tensorflow")

import keras  # noqa: E402
import numpy as np  # noqa: E402

import roundel.keras as hvd  # noqa: E402

EPOCHS = int(os.environ.get("EPOCHS", "3"))
BATCH = int(os.environ.get("BATCH", "8"))
COMMIT_EVERY = int(os.environ.get("COMMIT_EVERY", "1"))
STEP_SLEEP = float(os.environ.get("STEP_SLEEP", "0.05"))
FAST_FILE = os.environ.get("FAST_FILE")
SAMPLES = 192

print(f"PID {os.getpid()}", flush=True)
hvd.init()
rng = np.random.default_rng(0)
features = rng.normal(size=(SAMPLES, 8)).astype("float32")
labels = (features[:, 0] + features[:, 1] > 0).astype("int64")

keras.utils.set_random_seed(hvd.rank())  # deliberately different: the first sync must make them equal
model = keras.Sequential([keras.Input((8,)), keras.layers.Dense(16, activation="relu"), keras.layers.Dense(2)])
model.compile(optimizer=hvd.DistributedOptimizer(keras.optimizers.SGD(0.05 * hvd.size(), momentum=0.9)),
              loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True), jit_compile=False)
state = hvd.elastic.KerasState(model, epoch=0, batch=0, step=0)


def on_reset():
    model.optimizer.learning_rate = 0.05 * hvd.size()
    print(f"RESET {hvd.size()}", flush=True)


state.register_reset_callbacks([on_reset])


class Progress(keras.callbacks.Callback):
    """Counts steps (before the commit) and slows training down so the tests can act mid-epoch."""

    def on_train_batch_end(self, batch, logs=None):
        state.step += 1
        if not (FAST_FILE and os.path.exists(FAST_FILE)):
            time.sleep(STEP_SLEEP)


class PrintCommit(keras.callbacks.Callback):
    """After CommitStateCallback: prints the step rank 0 just committed."""

    def on_train_batch_end(self, batch, logs=None):
        if hvd.rank() == 0 and state.step % COMMIT_EVERY == 0:
            print(f"COMMIT {state.step}", flush=True)


callbacks = [Progress(), hvd.elastic.UpdateBatchStateCallback(state), hvd.elastic.UpdateEpochStateCallback(state),
             hvd.elastic.CommitStateCallback(state, batches_per_commit=COMMIT_EVERY), PrintCommit()]


@hvd.elastic.run
def train(state):
    x, y = features[hvd.rank()::hvd.size()], labels[hvd.rank()::hvd.size()]
    if state.batch:  # finish the epoch a reset interrupted (its batches count on from state.batch)
        rest = slice(state.batch * BATCH, None)
        if len(x[rest]):
            model.fit(x[rest], y[rest], batch_size=BATCH, initial_epoch=state.epoch, epochs=state.epoch + 1,
                      shuffle=False, callbacks=callbacks, verbose=0)
        else:  # at more ranks than before, this rank's smaller shard of the epoch is already done
            state.epoch, state.batch = state.epoch + 1, 0
    model.fit(x, y, batch_size=BATCH, initial_epoch=state.epoch, epochs=EPOCHS, shuffle=False,
              callbacks=callbacks, verbose=0)


train(state)
weights = [float(v) for w in model.get_weights() for v in np.ravel(w)]
print("FINAL " + json.dumps({"epoch": state.epoch, "step": state.step, "rank": hvd.rank(), "size": hvd.size(),
                             "params": weights}), flush=True)
