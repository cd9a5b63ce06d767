"""TensorFlow collective correctness worker: ``tf_collectives.py SCENARIO[,SCENARIO...]``.

Run under roundelrun. Every scenario runs its collectives twice, eagerly and
inside one ``tf.function`` (graph mode), on deterministic per-rank inputs and
compares each result with a NumPy reference; a mismatch raises
AssertionError. After each scenario the rank prints ``CHECKS PASSED <scenario>``.
"""

from __future__ import annotations

import os
import sys

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")

import numpy as np  # noqa: E402
import tensorflow as tf  # noqa: E402

import roundel.tensorflow as hvd  # noqa: E402
from _checks import expect_raises, rng, run_scenarios  # noqa: E402

hvd.init()
RANK, SIZE = hvd.rank(), hvd.size()

DTYPES = [tf.uint8, tf.int8, tf.int16, tf.int32, tf.int64, tf.float16, tf.bfloat16, tf.float32, tf.float64]
FLOATS = [tf.float16, tf.bfloat16, tf.float32, tf.float64]
_TOL = {tf.float16: 1e-2, tf.bfloat16: 3e-2, tf.float32: 1e-5, tf.float64: 1e-12}
MODES = ("eager", "graph")


def make(rank, tag, shape, dtype=tf.float32, low=-5, high=6) -> np.ndarray:
    """Deterministic small integers (exact in every dtype) as a float64/bool NumPy array."""
    r = rng(rank, tag)
    if dtype == tf.bool:
        return r.randint(0, 2, size=tuple(shape)).astype(bool)
    if dtype == tf.uint8:
        low = max(low, 0)
    return r.randint(low, high, size=tuple(shape)).astype(np.float64)


def tft(array, dtype):
    return tf.constant(np.asarray(array).astype(np.float64 if dtype != tf.bool else bool), dtype=dtype) \
        if dtype != tf.bool else tf.constant(array, tf.bool)


def check(actual, expected, what, dtype=None, tol=None):
    assert isinstance(actual, tf.Tensor), f"{what}: got {type(actual).__name__}, not a tf.Tensor"
    if dtype is not None:
        assert actual.dtype == dtype, f"{what}: dtype {actual.dtype.name}, expected {dtype.name}"
    got = actual.numpy()
    if got.dtype == tf.bfloat16.as_numpy_dtype:
        got = got.astype(np.float64)
    expected = np.asarray(expected)
    assert got.shape == expected.shape, f"{what}: shape {got.shape}, expected {expected.shape}"
    tol = tol or _TOL.get(actual.dtype)
    ok = np.array_equal(got, expected) if tol is None else np.allclose(
        got.astype(np.float64), expected.astype(np.float64), rtol=tol, atol=tol)
    assert ok, f"{what}: values differ\n got      {got.tolist()}\n expected {expected.tolist()}"


def run_in(mode, fn):
    """Call ``fn()`` eagerly or traced into one tf.function; returns its (nested) result."""
    return fn() if mode == "eager" else tf.function(fn)()


REDUCE = {"Sum": hvd.Sum, "Average": hvd.Average, "Min": hvd.Min, "Max": hvd.Max, "Product": hvd.Product}


def reduce_ref(op_name, arrays, dtype, pre=1.0, post=1.0):
    stack = np.stack(arrays).astype(np.float64) * pre
    out = {"Sum": lambda: stack.sum(0), "Min": lambda: stack.min(0), "Max": lambda: stack.max(0),
           "Product": lambda: stack.prod(0), "Average": lambda: stack.sum(0) / len(arrays)}[op_name]()
    if op_name == "Average" and not dtype.is_floating:
        out = stack.sum(0) // len(arrays)
    return out * post


# ------------------------------------------------------------------ allreduce
def scenario_allreduce():
    cases = []
    for op_name in REDUCE:
        for dtype in DTYPES:
            for shape in ((), (0,), (5,), (2, 3)):
                low, high = (-3, 4) if op_name == "Product" else ((0, 10) if op_name == "Average" else (-5, 6))
                cases.append((op_name, dtype, shape, low, high))
    for mode in MODES:
        tag0 = f"{mode}.ar"

        def body():
            outs = []
            for op_name, dtype, shape, low, high in cases:
                tag = f"{tag0}.{op_name}.{dtype.name}.{shape}"
                outs.append(hvd.allreduce(tft(make(RANK, tag, shape, dtype, low, high), dtype), op=REDUCE[op_name],
                                          name=tag))
            # legacy average=, scale factors, compression, unnamed, bool
            x = tft(make(RANK, f"{tag0}.avg", (4,)), tf.float32)
            outs.append(hvd.allreduce(x, average=False, name=f"{tag0}.avgF"))
            outs.append(hvd.allreduce(x, name=f"{tag0}.default"))
            outs.append(hvd.allreduce(x, op=hvd.Sum, prescale_factor=0.5, postscale_factor=3.0, name=f"{tag0}.scale"))
            outs.append(hvd.allreduce(x, compression=hvd.Compression.fp16, name=f"{tag0}.fp16"))
            outs.append(hvd.allreduce(x, compression=hvd.Compression.bf16, op=hvd.Sum))
            outs.append(hvd.allreduce(tft(make(RANK, f"{tag0}.bool", (6,), tf.bool), tf.bool), op=hvd.Max))
            return outs

        outs = run_in(mode, body)
        for out, (op_name, dtype, shape, low, high) in zip(outs, cases):
            tag = f"{tag0}.{op_name}.{dtype.name}.{shape}"
            ref = reduce_ref(op_name, [make(r, tag, shape, dtype, low, high) for r in range(SIZE)], dtype)
            check(out, ref, f"{mode} allreduce {op_name} {dtype.name} {shape}", dtype)
        xs = [make(r, f"{tag0}.avg", (4,)) for r in range(SIZE)]
        extra = outs[len(cases):]
        check(extra[0], np.sum(xs, 0), f"{mode} average=False", tf.float32)
        check(extra[1], np.mean(xs, 0), f"{mode} default Average", tf.float32)
        check(extra[2], np.sum(xs, 0) * 1.5, f"{mode} prescale/postscale", tf.float32)
        check(extra[3], np.mean(xs, 0), f"{mode} fp16 compression", tf.float32, tol=1e-3)
        check(extra[4], np.sum(xs, 0), f"{mode} bf16 compression", tf.float32, tol=2e-2)
        check(extra[5], np.any([make(r, f"{tag0}.bool", (6,), tf.bool) for r in range(SIZE)], 0),
              f"{mode} bool Max", tf.bool)
    expect_raises(ValueError, lambda: hvd.allreduce(tf.ones(2), average=True, op=hvd.Sum), "either",
                  what="average= and op= together")


def scenario_sparse():
    # IndexedSlices: allgathered values/indices (Average divides the values), eager and graph.
    for mode in MODES:
        def body():
            values = tf.constant(make(RANK, f"{mode}.sp", (RANK + 1, 3)), tf.float32)
            indices = tf.constant([(RANK + i) % 4 for i in range(RANK + 1)], tf.int64)
            s = tf.IndexedSlices(values, indices, dense_shape=tf.constant([4, 3], tf.int64))
            avg = hvd.allreduce(s, name=f"{mode}.sparse.avg")
            total = hvd.allreduce(s, op=hvd.Sum, name=f"{mode}.sparse.sum")
            return avg.values, avg.indices, total.values, tf.convert_to_tensor(total)

        values, indices, total_values, dense = run_in(mode, body)
        ref_values = np.concatenate([make(r, f"{mode}.sp", (r + 1, 3)) for r in range(SIZE)])
        ref_indices = np.concatenate([[(r + i) % 4 for i in range(r + 1)] for r in range(SIZE)])
        check(values, ref_values / SIZE, f"{mode} sparse Average values")
        check(indices, ref_indices, f"{mode} sparse indices")
        check(total_values, ref_values, f"{mode} sparse Sum values")
        ref_dense = np.zeros((4, 3))
        np.add.at(ref_dense, ref_indices, ref_values)
        check(dense, ref_dense, f"{mode} sparse Sum as dense")
    expect_raises(NotImplementedError, lambda: hvd.allreduce(
        tf.IndexedSlices(tf.ones((1, 2)), tf.constant([0]), tf.constant([2, 2])), op=hvd.Max), "sparse_as_dense",
        what="sparse Max")
    # integer Average: values / size in the values' dtype (TensorFlow's true division: float64), as Horovod
    ints = tf.IndexedSlices(tf.constant([[RANK + 1, 2]], tf.int32), tf.constant([RANK]), tf.constant([SIZE, 2]))
    avg = hvd.allreduce(ints, op=hvd.Average, name="sparse.int.avg")
    assert avg.values.dtype == tf.float64, avg.values.dtype
    check(avg.values, np.array([[r + 1, 2] for r in range(SIZE)]) / SIZE, "sparse int32 Average values")
    # pre/postscale factors: NotImplementedError, as Horovod
    for kwargs in ({"prescale_factor": 0.5}, {"postscale_factor": 0.5}):
        expect_raises(NotImplementedError, lambda: hvd.allreduce(ints, op=hvd.Sum, **kwargs), "scale",
                      what=f"sparse {kwargs}")


def scenario_grouped():
    specs = [((3,), tf.float32), ((2, 2), tf.int32), ((), tf.float64), ((0,), tf.float16), ((4,), tf.bfloat16)]
    for mode in MODES:
        for op_name in ("Sum", "Average", "Max"):
            tag = f"{mode}.grouped.{op_name}"

            def body():
                tensors = [tft(make(RANK, f"{tag}.{i}", s, d, 0, 10), d) for i, (s, d) in enumerate(specs)]
                return hvd.grouped_allreduce(tensors, op=REDUCE[op_name], name=tag)

            outs = run_in(mode, body)
            assert len(outs) == len(specs)
            for i, (out, (s, d)) in enumerate(zip(outs, specs)):
                ref = reduce_ref(op_name, [make(r, f"{tag}.{i}", s, d, 0, 10) for r in range(SIZE)], d)
                check(out, ref, f"{tag}[{i}]", d)


# ------------------------------------------------------------------ allgather, broadcast
def scenario_allgather():
    for mode in MODES:
        def body():
            outs = []
            for dtype in DTYPES + [tf.bool]:
                tag = f"{mode}.ag.{dtype.name}"
                outs.append(hvd.allgather(tft(make(RANK, tag, (RANK + 1, 2), dtype), dtype), name=tag))
            outs.append(hvd.allgather(tf.constant(float(RANK))))  # 0-d: one element per rank, unnamed
            outs.append(hvd.allgather(tf.zeros((0 if RANK == 0 else 2, 3)), name=f"{mode}.ag.empty"))
            outs += hvd.grouped_allgather([tf.fill([RANK + 1], RANK), tf.ones((1, 2), tf.float64)],
                                          name=f"{mode}.gag")
            return outs

        outs = run_in(mode, body)
        for out, dtype in zip(outs, DTYPES + [tf.bool]):
            tag = f"{mode}.ag.{dtype.name}"
            check(out, np.concatenate([make(r, tag, (r + 1, 2), dtype) for r in range(SIZE)]), tag, dtype)
        rest = outs[len(DTYPES) + 1:]
        check(rest[0], np.arange(SIZE, dtype=np.float32), f"{mode} allgather of a scalar")
        check(rest[1], np.zeros((2 * (SIZE - 1), 3)), f"{mode} allgather with an empty rank")
        check(rest[2], np.concatenate([np.full(r + 1, r) for r in range(SIZE)]), f"{mode} grouped_allgather[0]")
        check(rest[3], np.ones((SIZE, 2)), f"{mode} grouped_allgather[1]")


def scenario_broadcast():
    for mode in MODES:
        def body():
            outs = []
            for root in range(SIZE):
                for dtype in (tf.float32, tf.bfloat16, tf.int64, tf.bool, tf.uint8):
                    tag = f"{mode}.bc.{root}.{dtype.name}"
                    outs.append(hvd.broadcast(tft(make(RANK, tag, (2, 3), dtype), dtype), root, name=tag))
            outs.append(hvd.broadcast(tf.constant(RANK), 0))
            return outs

        outs = run_in(mode, body)
        i = 0
        for root in range(SIZE):
            for dtype in (tf.float32, tf.bfloat16, tf.int64, tf.bool, tf.uint8):
                tag = f"{mode}.bc.{root}.{dtype.name}"
                check(outs[i], make(root, tag, (2, 3), dtype), tag, dtype)
                i += 1
        check(outs[i], np.int32(0), f"{mode} broadcast scalar unnamed", tf.int32)


# ------------------------------------------------------------------ alltoall, reducescatter
def a2a_splits(sender, receiver):
    return (sender + 2 * receiver) % 3


def a2a_input(sender):
    rows = [[100 * sender + 10 * j + k, k] for j in range(SIZE) for k in range(a2a_splits(sender, j))]
    return np.array(rows, dtype=np.float64).reshape(-1, 2)


def scenario_alltoall():
    expected = np.concatenate([a2a_input(j)[sum(a2a_splits(j, k) for k in range(RANK)):][:a2a_splits(j, RANK)]
                               for j in range(SIZE)])
    for mode in MODES:
        def body():
            splits = [a2a_splits(RANK, j) for j in range(SIZE)]
            out, received = hvd.alltoall(tf.constant(a2a_input(RANK), tf.float32), splits=splits, name=f"{mode}.a2a")
            even = hvd.alltoall(tf.range(SIZE * 2, dtype=tf.int64) + 100 * RANK)  # Horovod: no splits, no pair
            return out, received, even

        out, received, even = run_in(mode, body)
        check(out, expected, f"{mode} alltoall", tf.float32)
        check(received, np.array([a2a_splits(j, RANK) for j in range(SIZE)]), f"{mode} received splits", tf.int32)
        check(even, np.concatenate([[100 * j + 2 * RANK, 100 * j + 2 * RANK + 1] for j in range(SIZE)]),
              f"{mode} alltoall even", tf.int64)


def scenario_reducescatter():
    for mode in MODES:
        firsts = (2 * SIZE, 2 * SIZE + 1)

        def body():
            outs = []
            for first in firsts:
                for op_name in ("Sum", "Average", "Max"):
                    tag = f"{mode}.rs.{first}.{op_name}"
                    outs.append(hvd.reducescatter(tf.constant(make(RANK, tag, (first, 3), tf.float32, 0, 10),
                                                              tf.float32), op=REDUCE[op_name], name=tag))
            outs += hvd.grouped_reducescatter([tf.ones((SIZE, 2)) * (RANK + 1)], op=hvd.Sum, name=f"{mode}.grs")
            return outs

        outs = run_in(mode, body)
        i = 0
        for first in firsts:
            counts = [first // SIZE + (1 if r < first % SIZE else 0) for r in range(SIZE)]
            start = sum(counts[:RANK])
            for op_name in ("Sum", "Average", "Max"):
                tag = f"{mode}.rs.{first}.{op_name}"
                full = reduce_ref(op_name, [make(r, tag, (first, 3), tf.float32, 0, 10) for r in range(SIZE)],
                                  tf.float32)
                check(outs[i], full[start:start + counts[RANK]], tag, tf.float32)
                i += 1
        check(outs[i], np.full((1, 2), SIZE * (SIZE + 1) / 2), f"{mode} grouped_reducescatter")


# ------------------------------------------------------------------ barrier, join, objects, process sets
def scenario_misc():
    hvd.barrier()
    tf.function(lambda: hvd.barrier())()
    obj = hvd.broadcast_object({"rank": RANK, "list": [1, 2]} if RANK == 0 else None, 0)
    assert obj == {"rank": 0, "list": [1, 2]}, obj
    gathered = hvd.allgather_object(("r", RANK))
    assert gathered == [("r", r) for r in range(SIZE)], gathered
    # broadcast_variables, eager and in tf.function
    v1 = tf.Variable(tf.fill([3], float(RANK)))
    v2 = tf.Variable(tf.constant(RANK, tf.int64))
    hvd.broadcast_variables([v1, v2], root_rank=SIZE - 1)
    check(tf.convert_to_tensor(v1), np.full(3, SIZE - 1.0), "broadcast_variables eager")
    check(tf.convert_to_tensor(v2), np.int64(SIZE - 1), "broadcast_variables eager int")
    v1.assign(tf.fill([3], float(RANK) + 10))
    @tf.function
    def bcast():
        hvd.broadcast_variables([v1], root_rank=0)

    bcast()
    check(tf.convert_to_tensor(v1), np.full(3, 10.0), "broadcast_variables in tf.function")
    # join: the last rank joins at once; others allreduce with it contributing zeros
    last = SIZE - 1
    if RANK != last:
        out = hvd.allreduce(tf.ones(2), op=hvd.Sum, name="join.ar")
        check(out, np.full(2, SIZE - 1.0), "allreduce while one rank joined")
    joined = hvd.join()
    assert int(joined) in range(SIZE), joined
    joined_graph = tf.function(hvd.join)()
    assert int(joined_graph) in range(SIZE), joined_graph
    # process sets: ranks {0, 1} (just {0} at size 2, where {0, 1} is the global set)
    members = [0, 1] if SIZE > 2 else [0]
    ps = hvd.add_process_set(members)
    if RANK in members:
        for mode in MODES:
            out = run_in(mode, lambda: hvd.allreduce(tf.constant([RANK + 1.0]), op=hvd.Sum, name=f"{mode}.ps",
                                                     process_set=ps))
            check(out, np.array([float(sum(r + 1 for r in members))]), f"{mode} allreduce on process set")
            out = run_in(mode, lambda: hvd.allgather(tf.constant([RANK]), process_set=ps, name=f"{mode}.ps.ag"))
            check(out, np.array(members), f"{mode} allgather on process set")
    hvd.remove_process_set(ps)
    assert hvd.size_op().numpy() == SIZE and hvd.rank_op().numpy() == RANK


# ------------------------------------------------------------------ out-of-order in one graph
def scenario_ordering():
    n = 8  # more than the inter-op threads TensorFlow has on this machine
    order = list(range(n))
    if RANK % 2 == 1:
        order.reverse()
    elif RANK > 0:
        order = order[n // 2:] + order[:n // 2]

    @tf.function
    def step(xs):
        outs = [None] * n
        for i in order:  # traced (and run) in a rank-dependent order
            outs[i] = hvd.allreduce(xs[i], op=hvd.Sum, name=f"ooo.{i}")
        # a chained collective that depends on earlier results
        outs.append(hvd.allreduce(outs[0] + outs[1], op=hvd.Sum, name="ooo.chain"))
        return outs

    for repeat in range(3):
        xs = [tf.fill([i + 1], float(RANK + i + repeat)) for i in range(n)]
        outs = step(xs)
        for i in range(n):
            check(outs[i], np.full(i + 1, float(sum(r + i + repeat for r in range(SIZE)))), f"ooo {i} step {repeat}")
        s0 = sum(r + repeat for r in range(SIZE))
        s1 = sum(r + 1 + repeat for r in range(SIZE))
        check(outs[n], np.full(2, SIZE * (s0 + s1)), f"ooo chain step {repeat}")

    # unnamed collectives in a graph are named from the graph, so trace order does not matter either
    @tf.function
    def unnamed(a, b, c):
        ops = [lambda: hvd.allreduce(a, op=hvd.Sum), lambda: hvd.allgather(b), lambda: hvd.broadcast(c, 0)]
        res = [None] * 3
        for i in ([0, 1, 2] if RANK % 2 == 0 else [2, 1, 0]):
            res[i] = ops[i]()
        return res

    ar, ag, bc = unnamed(tf.ones(3) * RANK, tf.fill([1], RANK), tf.fill([2], RANK))
    check(ar, np.full(3, float(sum(range(SIZE)))), "unnamed allreduce in graph")
    check(ag, np.arange(SIZE, dtype=np.int32), "unnamed allgather in graph")
    check(bc, np.zeros(2, np.int32), "unnamed broadcast in graph")


# ------------------------------------------------------------------ gradients
def scenario_gradients():
    w_ref = [make(r, "grad.w", (SIZE * 2, 3)) for r in range(SIZE)]
    for mode in MODES:
        def body():
            w = tf.constant(make(RANK, "grad.w", (SIZE * 2, 3)), tf.float64)
            with tf.GradientTape(persistent=True) as tape:
                tape.watch(w)
                ar = tf.reduce_sum(hvd.allreduce(w, op=hvd.Sum, name=f"{mode}.g.ar") * (RANK + 1))
                ag = tf.reduce_sum(hvd.allgather(w, name=f"{mode}.g.ag") * (RANK + 1))
                bc = tf.reduce_sum(hvd.broadcast(w, 0, name=f"{mode}.g.bc") * (RANK + 1))
                a2a = hvd.alltoall(w, name=f"{mode}.g.a2a")
                a2a = tf.reduce_sum(a2a * (RANK + 1))
                rs = tf.reduce_sum(hvd.reducescatter(w, op=hvd.Average, name=f"{mode}.g.rs") * (RANK + 1))
                rs_sum = tf.reduce_sum(hvd.reducescatter(w, op=hvd.Sum, name=f"{mode}.g.rss") * (RANK + 1))
                gag = tf.reduce_sum(hvd.grouped_allgather([w, w[:1]], name=f"{mode}.g.gag")[0] * (RANK + 1))
                grs = tf.reduce_sum(hvd.grouped_reducescatter([w], op=hvd.Sum, name=f"{mode}.g.grs")[0] * (RANK + 1))
            return [tape.gradient(y, w) for y in (ar, ag, bc, a2a, rs, rs_sum, gag, grs)]

        g_ar, g_ag, g_bc, g_a2a, g_rs, g_rs_sum, g_gag, g_grs = run_in(mode, body)
        total = float(sum(r + 1 for r in range(SIZE)))
        # Horovod's gradients: allreduce reduces the gradients as the forward op; allgather gives this
        # rank's rows of the ranks' average; broadcast the average on the root, zeros elsewhere;
        # reducescatter allgathers, times the size for Sum (not divided for Average).
        check(g_ar, np.full((SIZE * 2, 3), total), f"{mode} allreduce gradient")
        check(g_ag, np.full((SIZE * 2, 3), total / SIZE), f"{mode} allgather gradient")
        check(g_gag, np.full((SIZE * 2, 3), total / SIZE), f"{mode} grouped_allgather gradient")
        check(g_bc, np.full((SIZE * 2, 3), total / SIZE if RANK == 0 else 0.0), f"{mode} broadcast gradient")
        # alltoall: rows sent to rank j come back scaled by (j + 1)
        by_dest = np.repeat(np.arange(1, SIZE + 1, dtype=np.float64), 2)[:, None] * np.ones((1, 3))
        check(g_a2a, by_dest, f"{mode} alltoall gradient")
        check(g_rs, by_dest, f"{mode} reducescatter Average gradient")
        check(g_rs_sum, by_dest * SIZE, f"{mode} reducescatter Sum gradient")
        check(g_grs, by_dest * SIZE, f"{mode} grouped_reducescatter Sum gradient")
    del w_ref


def scenario_tape():
    # DistributedGradientTape: gradients averaged across ranks; options; eager and in tf.function.
    emb_ref = np.arange(12, dtype=np.float32).reshape(6, 2)
    for mode in MODES:
        for kwargs in ({}, {"num_groups": 2}, {"compression": hvd.Compression.fp16}, {"sparse_as_dense": True},
                       {"op": hvd.Sum}, {"gradient_predivide_factor": 2.0}):
            w = tf.Variable(tf.ones((3, 2)))
            b = tf.Variable(tf.zeros(2))
            emb = tf.Variable(emb_ref)
            x = tf.constant(make(RANK, "tape.x", (4, 3)), tf.float32)
            ids = tf.constant([RANK % 6, (RANK + 2) % 6])

            def step():
                with tf.GradientTape() as tape:
                    y = tf.matmul(x, w) + b + tf.reduce_sum(tf.gather(emb, ids))
                    loss = tf.reduce_sum(y * y) * 0.01
                tape = hvd.DistributedGradientTape(tape, **kwargs)
                return tape.gradient(loss, [w, b, emb])

            gw, gb, gemb = run_in(mode, step)
            # reference: each rank's local gradient in NumPy
            local = []
            for r in range(SIZE):
                xr = make(r, "tape.x", (4, 3))
                idr = [r % 6, (r + 2) % 6]
                yr = xr @ np.ones((3, 2)) + emb_ref[idr].sum()
                dy = 0.02 * yr
                gemb_r = np.zeros((6, 2))
                for i in idr:
                    gemb_r[i] += dy.sum()
                local.append((xr.T @ dy, dy.sum(0), gemb_r))
            scale = 1.0 if kwargs.get("op") == hvd.Sum else 1.0 / SIZE
            ref = [sum(lg[k] for lg in local) * scale for k in range(3)]
            what = f"{mode} tape {kwargs}"
            tol = 1e-2 if "compression" in kwargs else 1e-4
            for got, exp, nm in zip((gw, gb), ref[:2], ("w", "b")):
                assert np.allclose(got.numpy(), exp, rtol=tol, atol=tol), f"{what} grad {nm}: {got.numpy()} vs {exp}"
            if "sparse_as_dense" in kwargs:
                assert isinstance(gemb, tf.Tensor), f"{what}: embedding gradient is {type(gemb).__name__}"
            else:
                assert isinstance(gemb, tf.IndexedSlices), f"{what}: embedding gradient is {type(gemb).__name__}"
            assert np.allclose(tf.convert_to_tensor(gemb).numpy(), ref[2], rtol=tol, atol=tol), \
                f"{what} grad emb: {tf.convert_to_tensor(gemb).numpy()} vs {ref[2]}"


def scenario_tape_groups():
    # DistributedGradientTape in a tf.function whose input shape is known only when it runs: a group of one
    # dtype goes as one concatenated tensor (num_groups=2: x and w, its split sizes computed in the graph),
    # a group of mixed dtypes as a grouped allreduce (one group: x, w and the float64 v).
    w = tf.Variable(tf.fill((3, 2), 0.5))
    v = tf.Variable(tf.constant([[1.0], [2.0]], tf.float64))
    local = []
    for r in range(SIZE):
        xr = make(r, "groups.x", (4, 3))
        yr = xr @ np.full((3, 2), 0.5)
        dy = 0.02 * yr + np.array([1.0, 2.0])
        local.append((dy @ np.full((2, 3), 0.5), xr.T @ dy, yr.sum(0).reshape(2, 1)))
    for kwargs in ({"num_groups": 2}, {}):
        @tf.function(input_signature=[tf.TensorSpec([None, 3], tf.float32)])
        def step(x):
            with tf.GradientTape() as tape:
                tape.watch(x)
                y = tf.matmul(x, w)
                loss = tf.reduce_sum(y * y) * 0.01 + tf.cast(tf.reduce_sum(tf.matmul(tf.cast(y, tf.float64), v)),
                                                              tf.float32)
            tape = hvd.DistributedGradientTape(tape, **kwargs)
            return tape.gradient(loss, [x, w, v])

        grads = step(tf.constant(make(RANK, "groups.x", (4, 3)), tf.float32))
        for got, k, nm in zip(grads, range(3), "xwv"):
            exp = sum(lg[k] for lg in local) / SIZE
            assert np.allclose(got.numpy(), exp, rtol=1e-4, atol=1e-4), \
                f"tape groups {kwargs} grad {nm}: {got.numpy()} vs {exp}"
    tape_options_flow_to_the_reduction(w)


def tape_options_flow_to_the_reduction(w):
    """The GradientOptions DistributedGradientTape checked are the object gradient() reduces with; groups=
    takes the place of num_groups= (as in Horovod's tape)."""
    import roundel.tensorflow.gradient_tape as tape_module
    original, seen = tape_module.reduce_gradients, []

    def spy(grads, options, **kwargs):
        seen.append(options)
        return original(grads, options, **kwargs)

    with tf.GradientTape() as tape:
        loss = tf.reduce_sum(w * w)
    tape = hvd.DistributedGradientTape(tape, groups=[[w]], num_groups=3, gradient_predivide_factor=2.0)
    options = tape._roundel_options
    assert options.groups[0][0] is w and options.num_groups == 0, (options.groups, options.num_groups)
    tape_module.reduce_gradients = spy
    try:
        grad, = tape.gradient(loss, [w])
    finally:
        tape_module.reduce_gradients = original
    assert len(seen) == 1 and seen[0] is options, f"reduced with {seen}, not {options}"
    assert np.allclose(grad.numpy(), 2 * w.numpy()), grad.numpy()  # w is the same on every rank


SCENARIOS = {
    "allreduce": scenario_allreduce,
    "sparse": scenario_sparse,
    "grouped": scenario_grouped,
    "allgather": scenario_allgather,
    "broadcast": scenario_broadcast,
    "alltoall": scenario_alltoall,
    "reducescatter": scenario_reducescatter,
    "ordering": scenario_ordering,
    "gradients": scenario_gradients,
    "tape": scenario_tape,
    "tape_groups": scenario_tape_groups,
    "misc": scenario_misc,  # last: join makes ranks call different numbers of collectives
}

if __name__ == "__main__":
    run_scenarios(SCENARIOS, sys.argv, RANK)
