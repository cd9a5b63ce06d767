"""Keras 3 worker: ``keras_training.py SCENARIO[,SCENARIO...]`` (backend from KERAS_BACKEND, default tensorflow).

Each scenario trains small models with ``model.fit`` and checks the effect of
``DistributedOptimizer`` and the callbacks against a local reference; prints
``CHECKS PASSED <scenario>``.
"""

from __future__ import annotations

import os
import sys
import tempfile

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
os.environ.setdefault("KERAS_BACKEND", "tensorflow")

import keras  # noqa: E402
import numpy as np  # noqa: E402

import roundel.keras as hvd  # noqa: E402
from _checks import expect_raises, rng, run_scenarios  # noqa: E402

hvd.init()
RANK, SIZE = hvd.rank(), hvd.size()
BACKEND = keras.backend.backend()
PER_RANK = 8  # samples per rank per step
STEPS = 4
TOL = 1e-5  # DistributedOptimizer vs. one process on the concatenated batch (float32 weights)


def data(rank, steps=STEPS):
    """Rank ``rank``'s samples: ``steps`` batches of PER_RANK rows."""
    r = rng(rank, "keras.data")
    x = r.standard_normal((steps * PER_RANK, 5)).astype(np.float32)
    y = (x @ np.arange(1, 6, dtype=np.float32)[:, None] * 0.3 + r.standard_normal((steps * PER_RANK, 1)) * 0.1
         ).astype(np.float32)
    return x, y


def make_model(seed=0):
    keras.utils.set_random_seed(seed)
    return keras.Sequential([keras.Input((5,)), keras.layers.Dense(7, activation="tanh"), keras.layers.Dense(1)])


def weights_equal_across_ranks(model, what):
    flat = np.concatenate([np.ravel(w) for w in model.get_weights()])
    every = hvd.allgather_object(flat, name=f"weights.{what}")
    for r, w in enumerate(every):
        assert np.array_equal(w, every[0]), f"{what}: rank {r}'s weights differ from rank 0's"


def scenario_fit_equivalence():
    """2-rank fit with DistributedOptimizer == 1 process on the concatenated batch, step for step."""
    xs, ys = zip(*[data(r) for r in range(SIZE)])
    # The global batch of step s is every rank's s-th local batch, concatenated in rank order.
    gx = np.concatenate([np.concatenate([x[s * PER_RANK:(s + 1) * PER_RANK] for x in xs]) for s in range(STEPS)])
    gy = np.concatenate([np.concatenate([y[s * PER_RANK:(s + 1) * PER_RANK] for y in ys]) for s in range(STEPS)])
    for opt_name, make_opt, spe, eager in (("sgd", lambda: keras.optimizers.SGD(0.1), 1, False),
                                           ("adam", lambda: keras.optimizers.Adam(0.01), 2, False),
                                           ("sgd-momentum-eager", lambda: keras.optimizers.SGD(0.05, momentum=0.9),
                                            1, True)):
        spe = spe if BACKEND == "tensorflow" else 1  # Keras's torch backend allows only 1
        model = make_model()
        model.compile(optimizer=hvd.DistributedOptimizer(make_opt()), loss="mse", steps_per_execution=spe,
                      run_eagerly=eager)
        model.fit(xs[RANK], ys[RANK], batch_size=PER_RANK, epochs=2, shuffle=False, verbose=0)
        reference = make_model()
        reference.compile(optimizer=make_opt(), loss="mse", run_eagerly=eager)
        reference.fit(gx, gy, batch_size=PER_RANK * SIZE, epochs=2, shuffle=False, verbose=0)
        for got, want in zip(model.get_weights(), reference.get_weights()):
            assert np.allclose(got, want, rtol=TOL, atol=TOL), \
                f"{opt_name} (steps_per_execution={spe}): weights differ from the 1-process reference by " \
                f"{np.abs(got - want).max()}"
        assert int(model.optimizer.iterations.numpy() if hasattr(model.optimizer.iterations, "numpy")
                   else model.optimizer.iterations) == 2 * STEPS
        weights_equal_across_ranks(model, opt_name)
        print(f"fit_equivalence {opt_name}: max |diff| = "
              f"{max(np.abs(a - b).max() for a, b in zip(model.get_weights(), reference.get_weights())):.2e}",
              file=sys.stderr)
    # The wrapped optimizer is the same class name and config as the original.
    opt = hvd.DistributedOptimizer(keras.optimizers.Adam(0.003))
    assert isinstance(opt, keras.optimizers.Adam) and type(opt).__name__ == "Adam"
    assert abs(float(keras.ops.convert_to_numpy(opt.learning_rate)) - 0.003) < 1e-9
    expect_raises(ValueError, lambda: hvd.DistributedOptimizer(opt), "already", what="double wrap")


def scenario_compression():
    model = make_model()
    model.compile(optimizer=hvd.DistributedOptimizer(keras.optimizers.SGD(0.1), compression=hvd.Compression.fp16,
                                                     num_groups=2), loss="mse")
    x, y = data(RANK)
    model.fit(x, y, batch_size=PER_RANK, epochs=1, shuffle=False, verbose=0)
    weights_equal_across_ranks(model, "fp16")


def scenario_broadcast():
    # Different initial weights per rank; lr 0 so only the broadcast changes them.
    model = make_model(seed=100 + RANK)
    root_weights = make_model(seed=100 + SIZE - 1).get_weights()
    model.compile(optimizer=hvd.DistributedOptimizer(keras.optimizers.SGD(0.0)), loss="mse")
    x, y = data(RANK, steps=1)
    model.fit(x, y, batch_size=PER_RANK, epochs=1, verbose=0,
              callbacks=[hvd.callbacks.BroadcastGlobalVariablesCallback(SIZE - 1)])
    for got, want in zip(model.get_weights(), root_weights):
        assert np.array_equal(got, want), "weights after BroadcastGlobalVariablesCallback are not the root's"
    # and with real training afterwards they stay equal
    model2 = make_model(seed=7 + RANK)
    model2.compile(optimizer=hvd.DistributedOptimizer(keras.optimizers.Adam(0.01)), loss="mse")
    model2.fit(*data(RANK), batch_size=PER_RANK, epochs=1, verbose=0,
               callbacks=[hvd.callbacks.BroadcastGlobalVariablesCallback(0)])
    weights_equal_across_ranks(model2, "after broadcast + training")
    # broadcast_global_variables(root, model=...)
    model3 = make_model(seed=50 + RANK)
    hvd.broadcast_global_variables(0, model=model3)
    for got, want in zip(model3.get_weights(), make_model(seed=50).get_weights()):
        assert np.array_equal(got, want), "broadcast_global_variables(model=) did not give rank 0's weights"


class Recorder(keras.callbacks.Callback):
    def __init__(self):
        super().__init__()
        self.epoch_logs, self.batch_lr = [], []

    def on_epoch_end(self, epoch, logs=None):
        self.epoch_logs.append(dict(logs or {}))

    def on_train_batch_begin(self, batch, logs=None):
        self.batch_lr.append(float(keras.ops.convert_to_numpy(self.model.optimizer.learning_rate)))


def scenario_metric_average():
    model = make_model()
    model.compile(optimizer=hvd.DistributedOptimizer(keras.optimizers.SGD(0.05)), loss="mse", metrics=["mae"])
    before, after = Recorder(), Recorder()
    x, y = data(RANK)
    model.fit(x, y, batch_size=PER_RANK, epochs=2, verbose=0,
              callbacks=[before, hvd.callbacks.MetricAverageCallback(), after])
    local = [(e["loss"], e["mae"]) for e in before.epoch_logs]
    every_local = hvd.allgather_object(local, name="metrics.local")
    averaged = [(e["loss"], e["mae"]) for e in after.epoch_logs]
    every_avg = hvd.allgather_object(averaged, name="metrics.avg")
    assert all(a == every_avg[0] for a in every_avg), f"averaged metrics differ across ranks: {every_avg}"
    expected = np.mean(np.array(every_local), axis=0)
    assert np.allclose(np.array(averaged), expected, rtol=1e-6), f"averaged {averaged} vs mean {expected}"
    assert SIZE == 1 or not np.allclose(every_local[0], every_local[-1]), "test data too similar across ranks"


def scenario_lr_callbacks():
    x, y = data(RANK)
    steps = STEPS
    # Warm-up over 2 epochs, then a staircase schedule x0.5 from epoch 3 on (end None).
    model = make_model()
    model.compile(optimizer=hvd.DistributedOptimizer(keras.optimizers.SGD(0.1)), loss="mse")
    rec = Recorder()
    initial = 0.4
    model.fit(x, y, batch_size=PER_RANK, epochs=5, verbose=0, callbacks=[
        hvd.callbacks.LearningRateWarmupCallback(initial_lr=initial, warmup_epochs=2, verbose=1),
        hvd.callbacks.LearningRateScheduleCallback(initial_lr=initial, multiplier=1.0, start_epoch=2, end_epoch=3),
        hvd.callbacks.LearningRateScheduleCallback(initial_lr=initial, multiplier=lambda e: 0.5 ** (e - 2),
                                                   start_epoch=3),
        rec])
    expected = []
    for epoch in range(5):
        for batch in range(steps):
            if epoch < 2:
                e = epoch + batch / steps + 1.0 / steps
                expected.append(initial / SIZE * (e * (SIZE - 1) / 2 + 1))
            elif epoch == 2:
                expected.append(initial)
            else:
                expected.append(initial * 0.5 ** (epoch - 2))
    assert np.allclose(rec.batch_lr, expected, rtol=1e-6), f"learning rates {rec.batch_lr} vs {expected}"
    assert abs(rec.batch_lr[2 * steps - 1] - initial) < 1e-6, "warm-up does not end at initial_lr"
    assert abs(rec.epoch_logs[-1]["learning_rate"] - initial * 0.25) < 1e-6, rec.epoch_logs[-1]


def scenario_jit_error():
    if BACKEND != "tensorflow":
        return
    model = make_model()
    model.compile(optimizer=hvd.DistributedOptimizer(keras.optimizers.SGD(0.1)), loss="mse", jit_compile=True)
    x, y = data(RANK, steps=1)
    expect_raises(Exception, lambda: model.fit(x, y, batch_size=PER_RANK, epochs=1, verbose=0),
                  "jit_compile=False", what="fit with jit_compile=True")


def scenario_load_model():
    x, y = data(RANK)
    model = make_model()
    model.compile(optimizer=hvd.DistributedOptimizer(keras.optimizers.Adam(0.01)), loss="mse")
    model.fit(x, y, batch_size=PER_RANK, epochs=1, verbose=0)
    path = os.path.join(tempfile.gettempdir(), f"roundel_keras_{os.environ.get('ROUNDEL_RENDEZVOUS_PORT', 'x')}"
                        f"_{os.getppid()}.keras")
    if RANK == 0:
        model.save(path)
    hvd.allgather_object(None, name="saved")  # acts as a barrier
    loaded = hvd.load_model(path)
    assert type(loaded.optimizer).__mro__[1].__name__ == "_DistributedOptimizerMixin", type(loaded.optimizer).__mro__
    assert int(keras.ops.convert_to_numpy(loaded.optimizer.iterations)) == STEPS
    for a, b in zip(loaded.optimizer.variables, model.optimizer.variables):
        assert np.allclose(keras.ops.convert_to_numpy(a), keras.ops.convert_to_numpy(b)), "optimizer state lost"
    loaded.fit(x, y, batch_size=PER_RANK, epochs=1, verbose=0)
    model.fit(x, y, batch_size=PER_RANK, epochs=1, verbose=0)
    for a, b in zip(loaded.get_weights(), model.get_weights()):
        assert np.allclose(a, b, rtol=1e-5, atol=1e-6), "loaded model trains differently from the original"
    hvd.allgather_object(None, name="loaded")
    if RANK == 0:
        os.remove(path)


SCENARIOS = {
    "fit_equivalence": scenario_fit_equivalence,
    "compression": scenario_compression,
    "broadcast": scenario_broadcast,
    "metric_average": scenario_metric_average,
    "lr_callbacks": scenario_lr_callbacks,
    "jit_error": scenario_jit_error,
    "load_model": scenario_load_model,
}

if __name__ == "__main__":
    run_scenarios(SCENARIOS, sys.argv, RANK)
