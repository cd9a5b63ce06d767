"""Horovod TensorFlow/Keras API fidelity worker: ``tf_fidelity.py SCENARIO[,SCENARIO...]``.

Run under roundelrun. Each scenario checks Horovod 0.28.1 names, signatures
and behaviour against NumPy or single-process Keras references (eagerly and
inside ``tf.function`` where it matters) and prints ``CHECKS PASSED <scenario>``.
``FIDELITY_TMP`` names a directory shared by the ranks (for checkpoints).
"""

from __future__ import annotations

import os
import sys

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
os.environ.setdefault("KERAS_BACKEND", "tensorflow")

import keras  # noqa: E402
import numpy as np  # noqa: E402
import tensorflow as tf  # noqa: E402

import roundel.tensorflow as hvd  # noqa: E402
import roundel.tensorflow.keras as hvd_keras  # noqa: E402
from _checks import expect_raises, rng, run_scenarios  # noqa: E402

hvd.init()
RANK, SIZE = hvd.rank(), hvd.size()
MODES = ("eager", "graph")


def run_in(mode, fn):
    return fn() if mode == "eager" else tf.function(fn)()


def close(got, expected, what, tol=1e-5):
    got = np.asarray(tf.convert_to_tensor(got).numpy() if not isinstance(got, np.ndarray) else got, np.float64)
    expected = np.asarray(expected, np.float64)
    assert got.shape == expected.shape, f"{what}: shape {got.shape}, expected {expected.shape}"
    assert np.allclose(got, expected, rtol=tol, atol=tol), \
        f"{what}:\n got {got.tolist()}\n expected {expected.tolist()}"


def data(rank, tag, shape):
    return rng(rank, tag).standard_normal(shape).astype(np.float32)


# ------------------------------------------------------------------ signatures, *_op, broadcast_
def scenario_api():
    x = tf.constant([float(RANK + 1)] * (2 * SIZE))
    for mode in MODES:
        def body():
            # Horovod's positional order: allgather(tensor, name, ignore_name_scope, process_set) etc.
            ag = hvd.allgather(x[:1], f"{mode}.ag", True)
            bc = hvd.broadcast(x, 0, f"{mode}.bc", True)
            ar = hvd.allreduce(x, None, "", "", None, hvd.Sum, name=f"{mode}.ar", ignore_name_scope=True)
            low = hvd._allreduce(x, f"{mode}.low", hvd.Sum, 1.0, 1.0, True)
            rs = hvd.reducescatter(x, "", hvd.Compression.none, hvd.Sum, f"{mode}.rs", hvd.global_process_set, True)
            ga = hvd.grouped_allreduce([x], None, "", "", None, hvd.Sum, 1.0, 1.0, hvd.global_process_set, True,
                                       f"{mode}.ga")
            gg = hvd.grouped_allgather([x[:1]], f"{mode}.gg", True)
            grs = hvd.grouped_reducescatter([x], "", None, hvd.Sum, hvd.global_process_set)
            a2a = hvd.alltoall(x, None, f"{mode}.a2a", True)
            a2a_pair = hvd.alltoall(x, [2] * SIZE, f"{mode}.a2a2", True)
            return ag, bc, ar, low, rs, ga[0], gg[0], grs[0], a2a, a2a_pair

        ag, bc, ar, low, rs, ga, gg, grs, a2a, a2a_pair = run_in(mode, body)
        total = sum(r + 1.0 for r in range(SIZE))
        close(ag, [r + 1.0 for r in range(SIZE)], f"{mode} allgather")
        close(bc, np.ones(2 * SIZE), f"{mode} broadcast")
        for got, what in ((ar, "allreduce"), (low, "_allreduce"), (ga, "grouped_allreduce")):
            close(got, np.full(2 * SIZE, total), f"{mode} {what}")
        close(rs, np.full(2, total), f"{mode} reducescatter")
        close(grs, np.full(2, total), f"{mode} grouped_reducescatter")
        close(gg, [r + 1.0 for r in range(SIZE)], f"{mode} grouped_allgather")
        assert isinstance(a2a, tf.Tensor), f"{mode} alltoall without splits returns {type(a2a).__name__}"
        close(a2a, np.repeat([r + 1.0 for r in range(SIZE)], 2), f"{mode} alltoall")
        assert isinstance(a2a_pair, tuple) and len(a2a_pair) == 2, f"{mode} alltoall with splits: {a2a_pair!r}"
        close(a2a_pair[1], [2] * SIZE, f"{mode} alltoall received splits")

    # the *_op functions, eagerly and in a tf.function (values read when the op runs)
    members = [0, 1] if SIZE > 2 else [0]
    ps = hvd.add_process_set(members)
    for mode in MODES:
        values = run_in(mode, lambda: (hvd.rank_op(), hvd.size_op(), hvd.local_rank_op(), hvd.local_size_op(),
                                       hvd.size_op(ps.process_set_id), hvd.process_set_included_op(),
                                       hvd.process_set_included_op(ps.process_set_id),
                                       hvd.process_set_included_op(99)))
        got = [int(v.numpy()) for v in values]
        assert all(v.dtype == tf.int32 for v in values), values
        expected = [RANK, SIZE, hvd.local_rank(), hvd.local_size(), len(members), 1, int(RANK in members), -3]
        assert got == expected, f"{mode} *_op: {got} != {expected}"
    hvd.remove_process_set(ps)

    # broadcast_: in place on variables, returns the new values
    for mode in MODES:
        v1 = tf.Variable(tf.fill([3], float(RANK) + 5))
        v2 = tf.Variable(tf.constant([RANK, RANK], tf.int64))
        out = run_in(mode, lambda: hvd.broadcast_([v1, v2], SIZE - 1, name=f"{mode}.inplace"))
        close(v1, np.full(3, SIZE + 4.0), f"{mode} broadcast_ variable")
        close(v2, [SIZE - 1] * 2, f"{mode} broadcast_ int variable")
        close(out[0], np.full(3, SIZE + 4.0), f"{mode} broadcast_ result")

    fn = hvd.broadcast_object_fn(root_rank=0, name="objfn")
    assert fn({"from": RANK}) == {"from": 0}
    assert fn([RANK] * 3) == [0, 0, 0]


# ------------------------------------------------------------------ Horovod's TF error types
def scenario_errors():
    # shape mismatch: FailedPreconditionError eagerly (also roundel's CollectiveMismatchError)
    shape = (2,) if RANK == 0 else (3,)
    err = expect_raises(tf.errors.FailedPreconditionError,
                        lambda: hvd.allreduce(tf.ones(shape), name="err.shape"), what="allreduce shape mismatch")
    assert isinstance(err, hvd.CollectiveMismatchError), type(err)
    dtype = tf.float32 if RANK == 0 else tf.int32
    expect_raises(tf.errors.FailedPreconditionError, lambda: hvd.allgather(tf.ones([2], dtype), name="err.dtype"),
                  what="allgather dtype mismatch")
    expect_raises(tf.errors.FailedPreconditionError, lambda: hvd.broadcast(tf.ones([2]), RANK, name="err.root"),
                  what="broadcast root mismatch")
    expect_raises(tf.errors.FailedPreconditionError,
                  lambda: hvd.reducescatter(tf.ones((2 * SIZE,) + shape), name="err.rs"),
                  what="reducescatter shape mismatch")
    # bad alltoall splits: InvalidArgumentError, as Horovod
    expect_raises(tf.errors.InvalidArgumentError, lambda: hvd.alltoall(tf.ones([2 * SIZE + 1]), name="err.even"),
                  what="alltoall uneven without splits")
    expect_raises(tf.errors.InvalidArgumentError,
                  lambda: hvd.alltoall(tf.ones([3]), splits=[5] + [0] * (SIZE - 1), name="err.splits"),
                  what="alltoall splits not summing to the first dimension")
    # inside tf.function too: FailedPreconditionError (with the mismatch's own message), splits InvalidArgumentError
    err = expect_raises(tf.errors.FailedPreconditionError,
                        lambda: tf.function(lambda: hvd.allreduce(tf.ones(shape), name="err.graph"))(),
                        "err.graph", what="allreduce shape mismatch in tf.function")
    assert isinstance(err, hvd.CollectiveMismatchError) and "roundel mismatch #" not in str(err), repr(err)
    expect_raises(tf.errors.FailedPreconditionError,
                  lambda: tf.function(lambda: hvd.broadcast(tf.ones([2]), RANK, name="err.graph.root"))(),
                  what="broadcast root mismatch in tf.function")
    expect_raises(tf.errors.InvalidArgumentError,
                  lambda: tf.function(lambda: hvd.alltoall(tf.ones([3]), splits=[5] + [0] * (SIZE - 1),
                                                           name="err.graph.splits"))(),
                  what="alltoall bad splits in tf.function")
    # the job stays usable
    close(hvd.allreduce(tf.ones([2]), op=hvd.Sum, name="err.after"), np.full(2, float(SIZE)), "allreduce after errors")
    close(tf.function(lambda: hvd.allgather(tf.constant([RANK])))(), list(range(SIZE)), "allgather after errors")


# ------------------------------------------------------------------ tapes: groups=, local layers
def _local_grads(rank, kernel, bias, local_kernel):
    """This ``rank``'s own gradients of the model below, computed without any reduction."""
    x = tf.constant(data(rank, "tape.x", (4, 3)))
    with tf.GradientTape() as tape:
        loss = _loss(x, kernel, bias, local_kernel)
    return [g.numpy() for g in tape.gradient(loss, [kernel, bias, local_kernel])]


def _loss(x, kernel, bias, local_kernel):
    hidden = tf.matmul(x, kernel) + bias
    return tf.reduce_sum(tf.square(tf.matmul(hidden, local_kernel)))


def scenario_tape():
    keras.utils.set_random_seed(3)  # the same weights on every rank
    shared = keras.layers.Dense(2)
    local = keras.layers.Dense(1, use_bias=False)
    shared.build((None, 3))
    local.build((None, 2))
    kernel, bias, local_kernel = shared.kernel, shared.bias, local.kernel
    per_rank = [_local_grads(r, kernel, bias, local_kernel) for r in range(SIZE)]
    averaged = [sum(g[i] for g in per_rank) / SIZE for i in range(3)]
    mine = per_rank[RANK]
    x = tf.constant(data(RANK, "tape.x", (4, 3)))
    for mode in MODES:
        cases = {
            "groups=[[kernel, bias]]": (lambda t: hvd.DistributedGradientTape(t, groups=[[kernel, bias]]), averaged),
            "groups=2": (lambda t: hvd.DistributedGradientTape(t, groups=2), averaged),
            "partial": (lambda t: hvd.PartialDistributedGradientTape(t, local_layers=local),
                        averaged[:2] + [mine[2] / SIZE]),
            "partial unscaled": (lambda t: hvd.PartialDistributedGradientTape(t, local_layers=[local],
                                                                                scale_local_gradients=False),
                                 averaged[:2] + [mine[2]]),
        }
        for what, (wrap, expected) in cases.items():
            def step():
                with tf.GradientTape() as tape:
                    loss = _loss(x, kernel, bias, local_kernel)
                return wrap(tape).gradient(loss, [kernel, bias, local_kernel])

            for got, exp, name in zip(run_in(mode, step), expected, ("kernel", "bias", "local kernel")):
                close(got, exp, f"{mode} {what} {name}", tol=1e-4)

        def split():
            with tf.GradientTape() as tape:
                loss = _loss(x, kernel, bias, local_kernel)
            tape = hvd.PartialDistributedGradientTape(tape, local_layers=local)
            return tape.get_local_and_global_gradients(loss, [kernel, bias, local_kernel])

        local_pairs, global_pairs = run_in(mode, split)
        assert len(local_pairs) == 1 and len(global_pairs) == 2, (len(local_pairs), len(global_pairs))
    with tf.GradientTape() as tape:
        pass
    expect_raises(ValueError, lambda: hvd.DistributedGradientTape(tape, groups=[[x]]), "groups", what="bad groups")
    expect_raises(ValueError, lambda: hvd.PartialDistributedGradientTape(tape, local_layers=[x]), "local layers",
                  what="bad local_layers")


# ------------------------------------------------------------------ SyncBatchNormalization
def scenario_sync_bn():
    batches = [data(r, "bn", (r + 2, 2, 2, 3)) * (r + 1) + r for r in range(SIZE)]  # unequal sizes and moments
    everything = np.concatenate(batches)
    reference = keras.layers.BatchNormalization(momentum=0.5)
    ref_out = reference(everything, training=True).numpy()
    ref_out = reference(everything, training=True).numpy()  # twice: moving statistics move on
    start = sum(len(b) for b in batches[:RANK])
    for mode in MODES:
        layer = hvd.SyncBatchNormalization(momentum=0.5)
        layer.build(batches[RANK].shape)
        call = (lambda: layer(batches[RANK], training=True)) if mode == "eager" else \
            tf.function(lambda: layer(batches[RANK], training=True))
        call()
        out = call()
        close(out, ref_out[start:start + len(batches[RANK])], f"{mode} SyncBatchNormalization output", tol=1e-4)
        close(layer.moving_mean, reference.moving_mean, f"{mode} moving mean", tol=1e-5)
        close(layer.moving_variance, reference.moving_variance, f"{mode} moving variance", tol=1e-4)
        inference = layer(batches[RANK], training=False)
        close(inference, reference(batches[RANK], training=False), f"{mode} inference output", tol=1e-4)
    # gradients: each rank's input gradient of the sum of every rank's loss (weights differ per row)
    weights = data(99, "bn.w", everything.shape)
    whole = tf.constant(everything)
    with tf.GradientTape() as tape:
        tape.watch(whole)
        ref_loss = tf.reduce_sum(keras.layers.BatchNormalization()(whole, training=True) * weights)
    ref_grad = tape.gradient(ref_loss, whole).numpy()[start:start + len(batches[RANK])]
    mine = tf.constant(batches[RANK])
    for mode in MODES:
        layer = hvd.SyncBatchNormalization()

        def grad():
            with tf.GradientTape() as tape:
                tape.watch(mine)
                loss = tf.reduce_sum(layer(mine, training=True) * weights[start:start + len(batches[RANK])])
            return tape.gradient(loss, mine)

        close(run_in(mode, grad), ref_grad, f"{mode} SyncBatchNormalization input gradient", tol=1e-4)
    expect_raises(ValueError, lambda: hvd.SyncBatchNormalization(fused=True), "fused", what="fused=True")


# ------------------------------------------------------------------ DistributedOptimizer (TF entry point)
def _model(seed):
    keras.utils.set_random_seed(seed)
    model = keras.Sequential([keras.Input((3,)), keras.layers.Dense(2, name="shared"),
                              keras.layers.Dense(1, use_bias=False, name="local")])
    return model


def _fit_data(rank):
    return data(rank, "fit.x", (4, 3)), data(rank, "fit.y", (4, 1))


def scenario_optimizer():
    lr = 0.1
    model = _model(7)
    opt = hvd.DistributedOptimizer(keras.optimizers.SGD(lr))
    assert isinstance(opt, keras.optimizers.SGD), type(opt)
    model.compile(optimizer=opt, loss="mse")
    x, y = _fit_data(RANK)
    model.fit(x, y, batch_size=4, epochs=1, verbose=0, shuffle=False)
    reference = _model(7)
    reference.compile(optimizer=keras.optimizers.SGD(lr), loss="mse")
    all_x = np.concatenate([_fit_data(r)[0] for r in range(SIZE)])
    all_y = np.concatenate([_fit_data(r)[1] for r in range(SIZE)])
    reference.fit(all_x, all_y, batch_size=len(all_x), epochs=1, verbose=0, shuffle=False)
    for got, exp in zip(model.get_weights(), reference.get_weights()):
        close(got, exp, "DistributedOptimizer weights vs one process on the concatenated batch", tol=1e-5)
    expect_raises(TypeError, lambda: hvd.DistributedOptimizer(tf.compat.v1.train.GradientDescentOptimizer(0.1)),
                  "Keras optimizer", what="TF1 optimizer")
    expect_raises(ValueError, lambda: hvd.DistributedOptimizer(keras.optimizers.SGD(), op=hvd.Adasum), "Adasum",
                  what="Adasum with Keras")


# ------------------------------------------------------------------ Keras: partial optimizer, callbacks, names
def scenario_keras():
    lr = 0.1
    model = _model(11)
    start = [w.copy() for w in model.get_weights()]
    opt = hvd_keras.PartialDistributedOptimizer(keras.optimizers.SGD(lr), local_layers=model.get_layer("local"))
    model.compile(optimizer=opt, loss="mse")
    x, y = _fit_data(RANK)
    model.fit(x, y, batch_size=4, epochs=1, verbose=0, shuffle=False)
    grads = []
    for r in range(SIZE):
        probe = _model(11)
        xr, yr = _fit_data(r)
        with tf.GradientTape() as tape:
            loss = tf.reduce_mean(tf.square(probe(xr) - yr))
        grads.append([g.numpy() for g in tape.gradient(loss, probe.trainable_variables)])
    kernel, bias, local_kernel = model.get_weights()
    close(kernel, start[0] - lr * sum(g[0] for g in grads) / SIZE, "partial optimizer: shared kernel averaged")
    close(bias, start[1] - lr * sum(g[1] for g in grads) / SIZE, "partial optimizer: shared bias averaged")
    close(local_kernel, start[2] - lr * grads[RANK][2] / SIZE, "partial optimizer: local kernel, own gradient / size")

    # BroadcastGlobalVariablesCallback(root_rank, device, local_variables)
    model = _model(100 + RANK)
    own_local = model.get_layer("local").kernel.numpy().copy()
    root = _model(100)
    model.compile(optimizer=keras.optimizers.SGD(0.0), loss="mse")
    callback = hvd_keras.callbacks.BroadcastGlobalVariablesCallback(0, "",
                                                                     local_variables=[model.get_layer("local").kernel])
    model.fit(x, y, batch_size=4, epochs=1, verbose=0, callbacks=[callback])
    close(model.get_layer("shared").kernel, root.get_layer("shared").kernel, "broadcast shared kernel")
    close(model.get_layer("local").kernel, own_local, "local variable left alone")

    # BestModelCheckpoint: rank 0 saves, only when the monitored value improves
    scores = [3.0, 1.0, 2.0]
    snapshots = []

    class Score(keras.callbacks.Callback):
        def on_epoch_end(self, epoch, logs=None):
            logs["score"] = scores[epoch]
            snapshots.append([w.copy() for w in self.model.get_weights()])

    path = os.path.join(os.environ["FIDELITY_TMP"], f"best.rank{RANK}.weights.h5")
    model = _model(5)
    model.compile(optimizer=keras.optimizers.SGD(0.1), loss="mse")
    best = hvd_keras.callbacks.BestModelCheckpoint(monitor="score", mode="min", save_weights_only=True)
    best.filepath = path  # as Horovod's Spark estimator does
    model.fit(x, y, batch_size=4, epochs=3, verbose=0, callbacks=[Score(), best])
    assert os.path.exists(path) == (RANK == 0), f"rank {RANK}: checkpoint exists={os.path.exists(path)}"
    if RANK == 0:
        restored = _model(5)
        restored.load_weights(path)
        for got, exp in zip(restored.get_weights(), snapshots[1]):
            close(got, exp, "BestModelCheckpoint kept the best epoch's weights")
    expect_raises(ValueError, lambda: model.fit(x, y, verbose=0, callbacks=[hvd_keras.callbacks.BestModelCheckpoint()]),
                  "file path", what="BestModelCheckpoint without a file path")

    # load_model(legacy_opts=...) and TensorFlowKerasState
    saved = os.path.join(os.environ["FIDELITY_TMP"], f"model.rank{RANK}.keras")
    model.save(saved)
    loaded = hvd_keras.load_model(saved, legacy_opts=False)
    assert type(loaded.optimizer).__mro__[1].__name__ == "_DistributedOptimizerMixin", type(loaded.optimizer).__mro__
    expect_raises(ValueError, lambda: hvd_keras.load_model(saved, legacy_opts=True), "legacy",
                  what="load_model(legacy_opts=True)")
    from roundel.keras.elastic import TensorFlowKerasState
    state = TensorFlowKerasState(model, epoch=0)
    assert state.epoch == 0


# ------------------------------------------------------------------ TF1-style graph + Session
def scenario_v1graph():
    """Horovod's tests' graph mode: one tf.compat.v1 graph, several Session.run calls over parts of it."""
    graph = tf.Graph()
    with graph.as_default():
        fed = tf.compat.v1.placeholder(tf.float32, [2])
        a = hvd.allreduce(fed, op=hvd.Sum)                       # needs the placeholder fed
        b = hvd.allgather(tf.constant([RANK], tf.uint16))         # uint16 travels
        c = hvd.broadcast(tf.constant([RANK + 1] * 2, tf.uint16), 0)
        d = hvd.alltoall(tf.constant([RANK] * SIZE, tf.uint16))
        v = tf.compat.v1.Variable([float(RANK)] * 2, use_resource=False)
        bcast_globals = hvd.broadcast_global_variables(0)
        shape = [2] if RANK == 0 else [3]
        bad = hvd.allreduce(tf.ones(shape), name="v1.bad")
        bad_root = hvd.broadcast(tf.ones([2]), RANK, name="v1.bad.root")
        after = hvd.allreduce(tf.ones([2]), op=hvd.Sum, name="v1.after")
        many = [hvd.allreduce(tf.fill([3], float(i + RANK)), op=hvd.Sum) for i in range(24)]
        x = tf.constant(np.arange(4.0, dtype=np.float32) + RANK)
        gathered = hvd.allgather(x)
        g_ag = tf.gradients(gathered, x, tf.ones([4 * SIZE]) * (RANK + 1))[0]
        with tf.compat.v1.Session() as sess:
            sess.run(tf.compat.v1.global_variables_initializer())
            # Each run submits exactly what it evaluates: running b..d again and again never resends a
            # (whose placeholder is not fed there), and nothing is left in flight for the next run.
            for step in range(3):
                got_b, got_c, got_d = sess.run([b, c, d])
                close(got_b, list(range(SIZE)), f"v1 uint16 allgather, run {step}")
                close(got_c, [1, 1], f"v1 uint16 broadcast, run {step}")
                close(got_d, list(range(SIZE)), f"v1 uint16 alltoall, run {step}")
                close(sess.run(a, {fed: [1.0, float(step)]}), [SIZE, SIZE * step], f"v1 fed allreduce, run {step}")
            sess.run(bcast_globals)
            close(sess.run(v), [0.0, 0.0], "broadcast_global_variables in a v1 graph")
            err = expect_raises(tf.errors.FailedPreconditionError, lambda: sess.run(bad), "v1.bad",
                                what="v1 graph shape mismatch")
            assert isinstance(err, hvd.CollectiveMismatchError), repr(err)
            expect_raises(tf.errors.FailedPreconditionError, lambda: sess.run(bad_root),
                          what="v1 graph broadcast root mismatch")
            close(sess.run(after), [SIZE, SIZE], "v1 allreduce after mismatches")
            # more collectives in one run than a 2-core machine's default inter-op threads
            for got, i in zip(sess.run(many), range(24)):
                close(got, np.full(3, sum(float(i + r) for r in range(SIZE))), f"v1 allreduce {i} of 24 in one run")
            # allgather's gradient: this rank's rows of the ranks' average (as Horovod)
            close(sess.run(g_ag), np.full(4, sum(r + 1.0 for r in range(SIZE)) / SIZE), "v1 allgather gradient")


SCENARIOS = {
    "v1graph": scenario_v1graph,
    "api": scenario_api,
    "errors": scenario_errors,
    "tape": scenario_tape,
    "sync_bn": scenario_sync_bn,
    "optimizer": scenario_optimizer,
    "keras": scenario_keras,
}

if __name__ == "__main__":
    run_scenarios(SCENARIOS, sys.argv, RANK)
