"""Elastic JAX training for the elastic test: a small MLP on synthetic data, a jitted step, ``JaxState``.

Each rank trains on its shard (``rank::size``) of 192 samples with
``hvd.DistributedOptimizer`` inside ``jax.jit``, so a failed peer surfaces
inside compiled code. Prints ``COMMIT <step>`` on rank 0 after each commit,
``RESET <size>`` from the reset callback and ``FINAL <json>`` at the end
(epoch, step, rank, size and the parameters). Settings from the environment:
``EPOCHS``, ``BATCH``, ``STEP_SLEEP``, and ``FAST_FILE``: once that file
exists, steps no longer sleep (the test has done what needed training slowed down).
"""

import json
import os
import time

os.environ.setdefault("JAX_PLATFORMS", "cpu")

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
import optax  # noqa: E402

import roundel.jax as hvd  # noqa: E402

EPOCHS = int(os.environ.get("EPOCHS", "3"))
BATCH = int(os.environ.get("BATCH", "8"))
STEP_SLEEP = float(os.environ.get("STEP_SLEEP", "0.05"))
FAST_FILE = os.environ.get("FAST_FILE")
SAMPLES = 192

hvd.init()
rng = np.random.default_rng(0)
features = rng.normal(size=(SAMPLES, 8)).astype("float32")
labels = (features[:, 0] + features[:, 1] > 0).astype("int32")

key = jax.random.PRNGKey(hvd.rank())  # deliberately different: the first sync must make them equal
k1, k2 = jax.random.split(key)
params = {"w1": jax.random.normal(k1, (8, 16)) * 0.3, "b1": jnp.zeros(16),
          "w2": jax.random.normal(k2, (16, 2)) * 0.3, "b2": jnp.zeros(2)}
tx = hvd.DistributedOptimizer(optax.sgd(0.05, momentum=0.9))
state = hvd.elastic.JaxState(params=params, opt_state=tx.init(params), epoch=0, batch=0, step=0)
state.register_reset_callbacks([lambda: print(f"RESET {hvd.size()}", flush=True)])


def loss_fn(p, x, y):
    logits = jnp.tanh(x @ p["w1"] + p["b1"]) @ p["w2"] + p["b2"]
    return optax.softmax_cross_entropy_with_integer_labels(logits, y).mean()


@jax.jit
def train_step(p, s, x, y):
    updates, s = tx.update(jax.grad(loss_fn)(p, x, y), s, p)
    return optax.apply_updates(p, updates), s


@hvd.elastic.run
def train(state):
    while state.epoch < EPOCHS:
        x, y = features[hvd.rank()::hvd.size()], labels[hvd.rank()::hvd.size()]
        while (state.batch + 1) * BATCH <= len(x):
            rows = slice(state.batch * BATCH, (state.batch + 1) * BATCH)
            state.params, state.opt_state = train_step(state.params, state.opt_state, x[rows], y[rows])
            state.batch += 1
            state.step += 1
            if not (FAST_FILE and os.path.exists(FAST_FILE)):
                time.sleep(STEP_SLEEP)
            state.commit()
            if hvd.rank() == 0:
                print(f"COMMIT {state.step}", flush=True)
        state.epoch, state.batch = state.epoch + 1, 0
        state.commit()


train(state)
flat = [round(float(v), 6) for leaf in jax.tree_util.tree_leaves(state.params) for v in np.ravel(leaf)]
print("FINAL " + json.dumps({"epoch": state.epoch, "step": state.step, "rank": hvd.rank(), "size": hvd.size(),
                             "params": flat}), flush=True)
