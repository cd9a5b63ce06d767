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


def global_data(per_update=1):
    """The 1-process reference's data: update u's batch is every rank's local batches of that update, concatenated."""
    xs, ys = zip(*[data(r) for r in range(SIZE)])
    rows = PER_RANK * per_update
    updates = range(STEPS // per_update)
    return (np.concatenate([x[u * rows:(u + 1) * rows] for u in updates for x in xs]),
            np.concatenate([y[u * rows:(u + 1) * rows] for u in updates for y in ys]))


def fit_matches_reference(label, make_opt, make_reference_opt=None, spe=1, eager=False, per_update=1, **wrap):
    """Fit 2 epochs with ``DistributedOptimizer(make_opt(), **wrap)``; assert the weights equal the 1-process
    reference (``make_reference_opt`` or ``make_opt``, batches of ``per_update`` steps of every rank)."""
    spe = spe if BACKEND == "tensorflow" else 1  # Keras's torch backend allows only 1
    model = make_model()
    model.compile(optimizer=hvd.DistributedOptimizer(make_opt(), **wrap), loss="mse", steps_per_execution=spe,
                  run_eagerly=eager)
    model.fit(*data(RANK), batch_size=PER_RANK, epochs=2, shuffle=False, verbose=0)
    reference = make_model()  # eagerly: a few tiny steps cost less than tracing them
    reference.compile(optimizer=(make_reference_opt or make_opt)(), loss="mse", run_eagerly=True)
    reference.fit(*global_data(per_update), batch_size=PER_RANK * SIZE * per_update, epochs=2, shuffle=False,
                  verbose=0)
    diff = max(np.abs(a - b).max() for a, b in zip(model.get_weights(), reference.get_weights()))
    for got, want in zip(model.get_weights(), reference.get_weights()):
        assert np.allclose(got, want, rtol=TOL, atol=TOL), \
            f"{label} (steps_per_execution={spe}): weights differ from the 1-process reference by {diff}"
    moved = max(np.abs(a - b).max() for a, b in zip(model.get_weights(), make_model().get_weights()))
    assert moved > 1e-3, f"{label}: training did not change the weights"
    iterations = int(keras.ops.convert_to_numpy(model.optimizer.iterations))
    assert iterations == 2 * STEPS // per_update, f"{label}: {iterations} optimizer steps"
    weights_equal_across_ranks(model, label)
    print(f"{label}: max |diff| = {diff:.2e}", file=sys.stderr)
    return model


def scenario_fit_equivalence():
    """2-rank fit with DistributedOptimizer == 1 process on the concatenated batch, step for step."""
    fit_matches_reference("sgd", lambda: keras.optimizers.SGD(0.1))
    fit_matches_reference("adam", lambda: keras.optimizers.Adam(0.01), spe=2)
    fit_matches_reference("sgd-momentum-eager", lambda: keras.optimizers.SGD(0.05, momentum=0.9), eager=True)
    # Loss scaling checks and unscales the reduced gradients.
    fit_matches_reference("loss-scale", lambda: keras.optimizers.LossScaleOptimizer(keras.optimizers.SGD(0.1)),
                          eager=True)
    # The wrapped optimizer is the same class name and config as the original.
    opt = hvd.DistributedOptimizer(keras.optimizers.Adam(0.003))
    assert isinstance(opt, keras.optimizers.Adam) and type(opt).__name__ == "Adam"
    assert abs(float(keras.ops.convert_to_numpy(opt.learning_rate)) - 0.003) < 1e-9
    expect_raises(ValueError, lambda: hvd.DistributedOptimizer(opt), "already", what="double wrap")


def novograd_reference(weights, steps, lr, beta_1, beta_2, epsilon, weight_decay, grad_averaging, amsgrad):
    """NovoGrad (Ginsburg et al., 2019) in float64 NumPy: ``weights`` after applying each gradient list in ``steps``."""
    weights = [w.astype(np.float64) for w in weights]
    m = [np.zeros_like(w) for w in weights]
    v, v_max = [0.0] * len(weights), [0.0] * len(weights)
    for t, grads in enumerate(steps):
        for i, g in enumerate(grads):
            norm = float(np.sum(g.astype(np.float64) ** 2))
            v[i] = norm if t == 0 else beta_2 * v[i] + (1 - beta_2) * norm
            v_max[i] = max(v_max[i], v[i])
            d = g / (np.sqrt(v_max[i] if amsgrad else v[i]) + epsilon) + weight_decay * weights[i]
            m[i] = beta_1 * m[i] + (1 - beta_1 if grad_averaging else 1) * d
            weights[i] = weights[i] - lr * m[i]
    return weights


def scenario_novograd():
    """NovoGrad against a NumPy reference; NovoGrad and Keras's Lamb through DistributedOptimizer in fit."""
    from roundel.keras.optimizers import NovoGrad
    r = rng(0, "novograd")
    start = [r.standard_normal((3, 4)).astype(np.float32), r.standard_normal(4).astype(np.float32)]
    # Step 3's gradients are small, so v falls and amsgrad (max v) differs from plain NovoGrad.
    steps = [[(r.standard_normal(w.shape) * (0.1 if t == 2 else 1.0)).astype(np.float32) for w in start]
             for t in range(5)]
    results = {}
    for grad_averaging in (False, True):
        for amsgrad in (False, True):
            settings = dict(beta_1=0.8, beta_2=0.5, epsilon=1e-6, weight_decay=0.01, grad_averaging=grad_averaging,
                            amsgrad=amsgrad)
            variables = [keras.Variable(w) for w in start]
            opt = NovoGrad(0.1, **settings)
            for grads in steps:
                opt.apply([keras.ops.convert_to_tensor(g) for g in grads], variables)
            want = novograd_reference(start, steps, 0.1, **settings)
            got = [keras.ops.convert_to_numpy(v) for v in variables]
            for g, w in zip(got, want):
                assert np.allclose(g, w, rtol=1e-5, atol=1e-6), \
                    f"NovoGrad {settings}: {np.abs(g - w).max()} from the NumPy reference"
            results[grad_averaging, amsgrad] = got[0]
            again = NovoGrad.from_config(opt.get_config())
            assert again.get_config() == opt.get_config() and again.novograd_weight_decay == 0.01
    assert not np.allclose(results[False, False], results[False, True]), "amsgrad made no difference"
    assert not np.allclose(results[False, False], results[True, False]), "grad_averaging made no difference"
    for bad, needle in ((dict(beta_1=1.0), "beta_1"), (dict(beta_2=-0.1), "beta_2"), (dict(epsilon=0.0), "epsilon"),
                        (dict(weight_decay=-1e-3), "weight_decay")):
        expect_raises(ValueError, lambda: NovoGrad(**bad), needle, what=f"NovoGrad({bad})")
    assert hvd.optimizers.NovoGrad is NovoGrad
    fit_matches_reference("novograd", lambda: NovoGrad(0.05, weight_decay=1e-3, grad_averaging=True), spe=2)
    fit_matches_reference("lamb", lambda: keras.optimizers.Lamb(0.01))


def counting(opt, attribute="_roundel_reduce"):
    """Count calls of ``opt``'s ``attribute`` (its reductions); returns the list the calls are appended to."""
    calls, original = [], getattr(opt, attribute)

    def spy(*args, **kwargs):
        calls.append(1)
        return original(*args, **kwargs)

    setattr(opt, attribute, spy)
    return calls


def scenario_accumulation():
    """backward_passes_per_step=2 == 1 process on batches of 2 steps x every rank; one reduction per update."""
    fit_matches_reference("sgd-sum", lambda: keras.optimizers.SGD(0.1), lambda: keras.optimizers.SGD(0.2),
                          per_update=2, backward_passes_per_step=2)
    fit_matches_reference("adam-average", lambda: keras.optimizers.Adam(0.01), spe=2, per_update=2,
                          backward_passes_per_step=2, average_aggregated_gradients=True)
    # Clipping applies to the reduced gradients (Keras's own accumulation: their mean).
    fit_matches_reference("clipped", lambda: keras.optimizers.SGD(0.1, global_clipnorm=0.5),
                          lambda: keras.optimizers.SGD(0.1, global_clipnorm=0.5), per_update=2,
                          backward_passes_per_step=2, average_aggregated_gradients=True)
    # Eagerly, count the reductions: one per update (4 of 8 steps), not one per step.
    model = make_model()
    opt = hvd.DistributedOptimizer(keras.optimizers.SGD(0.1), backward_passes_per_step=2)
    calls = counting(opt)
    model.compile(optimizer=opt, loss="mse", run_eagerly=True)
    model.fit(*data(RANK), batch_size=PER_RANK, epochs=2, shuffle=False, verbose=0)
    assert len(calls) == STEPS, f"{len(calls)} reductions in {2 * STEPS} steps with backward_passes_per_step=2"
    expect_raises(ValueError, lambda: hvd.DistributedOptimizer(keras.optimizers.SGD(), backward_passes_per_step=0),
                  "backward_passes_per_step", what="backward_passes_per_step=0")
    expect_raises(ValueError, lambda: hvd.DistributedOptimizer(keras.optimizers.SGD(gradient_accumulation_steps=2),
                                                               backward_passes_per_step=2),
                  "gradient_accumulation_steps", what="both accumulations")


def scenario_groups():
    """groups= and num_groups: the gradients go in the allreduce groups asked for; training as one group."""
    if BACKEND == "tensorflow":  # a group of several gradients is concatenated and reduced as one tensor
        import roundel.tfops.gradients as gradients_module
        import roundel.tfops.mpi_ops as ops_module
        spied = [(ops_module, "grouped_allreduce"), (gradients_module, "_allreduce_concatenated")]
    else:  # the torch backend's gradients are the engine's buffers: they go to the engine directly
        import roundel.common.collectives as ops_module
        spied = [(ops_module, "grouped_allreduce_async")]
    sizes, originals = [], [getattr(module, function) for module, function in spied]

    def spy_on(original):
        def spy(tensors, *args, **kwargs):
            sizes.append(len(tensors))
            return original(tensors, *args, **kwargs)
        return spy

    for (module, function), original in zip(spied, originals):
        setattr(module, function, spy_on(original))
    reference = make_model()
    reference.compile(optimizer=keras.optimizers.SGD(0.1), loss="mse", run_eagerly=True)
    reference.fit(*global_data(), batch_size=PER_RANK * SIZE, epochs=1, shuffle=False, verbose=0)
    try:
        cases = (("groups", lambda m: {"groups": [[m.layers[0].kernel, m.layers[1].kernel]]}, [2, 1, 1]),
                 ("num_groups", lambda m: {"num_groups": 2}, [2, 2]),  # variables: kernel, bias, kernel, bias
                 ("groups-int", lambda m: {"groups": 3}, [2, 1, 1]))
        for label, kwargs, per_step in cases:
            model = make_model()
            model.compile(optimizer=hvd.DistributedOptimizer(keras.optimizers.SGD(0.1), **kwargs(model)),
                          loss="mse", run_eagerly=True)
            del sizes[:]
            model.fit(*data(RANK), batch_size=PER_RANK, epochs=1, shuffle=False, verbose=0)
            assert sizes == per_step * STEPS, f"{label}: allreduce group sizes {sizes}, expected {per_step} per step"
            for got, want in zip(model.get_weights(), reference.get_weights()):
                assert np.allclose(got, want, rtol=TOL, atol=TOL), f"{label}: weights differ from the reference"
    finally:
        for (module, function), original in zip(spied, originals):
            setattr(module, function, original)
    model, other = make_model(), make_model()
    kernel = model.layers[0].kernel
    for kwargs, needle in (({"groups": [[kernel], [kernel]]}, "more than one group"),
                           ({"groups": [["kernel"]]}, "list of lists"), ({"groups": [kernel]}, "list of lists"),
                           ({"groups": [[kernel]], "num_groups": 2}, "not both"), ({"groups": -1}, ">= 0")):
        expect_raises(ValueError, lambda: hvd.DistributedOptimizer(keras.optimizers.SGD(), **kwargs), needle,
                      what=f"DistributedOptimizer({kwargs})")
    model.compile(optimizer=hvd.DistributedOptimizer(keras.optimizers.SGD(),
                                                     groups=[[other.layers[0].kernel]]), loss="mse", run_eagerly=True)
    expect_raises(ValueError, lambda: model.fit(*data(RANK, steps=1), batch_size=PER_RANK, verbose=0),
                  "not one this optimizer trains", what="groups= with another model's variable")
    options_flow_to_the_reduction()


def options_flow_to_the_reduction():
    """The GradientOptions DistributedOptimizer checked are the object each step reduces with; the model's
    variables named in groups= stay the model's (not tracked as the optimizer's)."""
    if BACKEND == "tensorflow":
        import roundel.tfops.gradients as module
        function = "reduce_gradients"
    else:
        import roundel.keras.core as module
        function = "_reduce_torch"
    original, seen = getattr(module, function), []

    def spy(grads, options, *args, **kwargs):
        seen.append(options)
        return original(grads, options, *args, **kwargs)

    model = make_model()
    kernel = model.layers[0].kernel
    opt = hvd.DistributedOptimizer(keras.optimizers.SGD(0.1), groups=[[kernel]], gradient_predivide_factor=2.0)
    options = opt._roundel_options
    assert options.groups[0][0] is kernel and options.num_groups == 0 and options.gradient_predivide_factor == 2.0
    model.compile(optimizer=opt, loss="mse", run_eagerly=True)
    setattr(module, function, spy)
    try:
        model.fit(*data(RANK, steps=2), batch_size=PER_RANK, epochs=1, shuffle=False, verbose=0)
    finally:
        setattr(module, function, original)
    assert len(seen) == 2 and all(o is options for o in seen), f"reduced with {seen}, not {options}"
    assert opt._roundel_options is options, "the optimizer's options were replaced"
    model_paths = {v.path for v in model.variables}
    leaked = [v.path for v in opt.variables if v.path in model_paths]
    assert not leaked, f"groups= made the model's variables the optimizer's: {leaked}"


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
    """hvd.load_model re-wraps the saved optimizer (Adam; roundel's NovoGrad) with its state; saves again."""
    from roundel.keras.optimizers import NovoGrad
    x, y = data(RANK)
    path = hvd.allgather_object(os.path.join(tempfile.gettempdir(), f"roundel_keras_{os.getpid()}.keras"),
                                name="load_model.path")[0]  # rank 0's file, the same name on every rank
    for make_opt in (lambda: keras.optimizers.Adam(0.01), lambda: NovoGrad(0.01, weight_decay=1e-3, amsgrad=True)):
        model = make_model()
        model.compile(optimizer=hvd.DistributedOptimizer(make_opt()), loss="mse", run_eagerly=True)
        model.fit(x, y, batch_size=PER_RANK, epochs=1, shuffle=False, verbose=0)
        if RANK == 0:
            model.save(path)
        hvd.allgather_object(None, name="saved")  # acts as a barrier
        loaded = hvd.load_model(path)
        label = type(model.optimizer).__name__
        assert type(loaded.optimizer).__mro__[1].__name__ == "_DistributedOptimizerMixin", \
            type(loaded.optimizer).__mro__
        assert isinstance(loaded.optimizer, type(make_opt())) and \
            loaded.optimizer.get_config() == model.optimizer.get_config(), f"{label}: another optimizer came back"
        assert int(keras.ops.convert_to_numpy(loaded.optimizer.iterations)) == STEPS
        for a, b in zip(loaded.optimizer.variables, model.optimizer.variables):
            assert np.allclose(keras.ops.convert_to_numpy(a), keras.ops.convert_to_numpy(b)), \
                f"{label}: optimizer state lost"
        loaded.fit(x, y, batch_size=PER_RANK, epochs=1, shuffle=False, verbose=0)
        model.fit(x, y, batch_size=PER_RANK, epochs=1, shuffle=False, verbose=0)
        for a, b in zip(loaded.get_weights(), model.get_weights()):
            assert np.allclose(a, b, rtol=1e-5, atol=1e-6), f"{label}: loaded model trains differently"
        hvd.allgather_object(None, name="loaded")
        if RANK == 0:  # the re-wrapped optimizer saves and loads again
            loaded.save(path)
            again = keras.models.load_model(path)
            assert type(again.optimizer).__name__ == label and \
                int(keras.ops.convert_to_numpy(again.optimizer.iterations)) == 2 * STEPS
            os.remove(path)
        hvd.allgather_object(None, name="removed")


SCENARIOS = {
    "fit_equivalence": scenario_fit_equivalence,
    "compression": scenario_compression,
    "broadcast": scenario_broadcast,
    "metric_average": scenario_metric_average,
    "lr_callbacks": scenario_lr_callbacks,
    "jit_error": scenario_jit_error,
    "load_model": scenario_load_model,
    "novograd": scenario_novograd,
    "accumulation": scenario_accumulation,
    "groups": scenario_groups,
}

if __name__ == "__main__":
    run_scenarios(SCENARIOS, sys.argv, RANK)
