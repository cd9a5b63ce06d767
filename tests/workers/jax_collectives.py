"""JAX adapter worker: ``jax_collectives.py SCENARIO[,SCENARIO...]`` under roundelrun.

Every rank builds every rank's input (seeded by rank and a tag), computes the
NumPy reference locally and compares; a mismatch raises (the rank exits
non-zero). After each scenario the rank prints ``CHECKS PASSED <scenario>``.
"""

from __future__ import annotations

import os
import sys
import time
import zlib

os.environ.setdefault("JAX_PLATFORMS", "cpu")

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
import optax  # noqa: E402

import roundel.jax as hvd  # noqa: E402
from roundel.jax import host_calls  # noqa: E402
from _checks import expect_raises, run_scenarios  # noqa: E402

hvd.init()
RANK, SIZE = hvd.rank(), hvd.size()
DTYPES = (jnp.uint8, jnp.int8, jnp.int16, jnp.int32, jnp.float16, jnp.bfloat16, jnp.float32, jnp.bool_)
OPS = {"Sum": hvd.Sum, "Average": hvd.Average, "Min": hvd.Min, "Max": hvd.Max, "Product": hvd.Product}


def rng(rank, tag):
    return np.random.RandomState(zlib.crc32(f"{rank}/{tag}".encode()))


def make(rank, tag, shape, dtype=jnp.float32, low=-5, high=6) -> np.ndarray:
    """Small integers (exact in every dtype) as a NumPy array of ``dtype``."""
    if np.dtype(dtype) == np.bool_:
        return rng(rank, tag).randint(0, 2, size=shape).astype(bool)
    if np.dtype(dtype) == np.uint8:
        low = max(low, 0)
    return rng(rank, tag).randint(low, high, size=shape).astype(np.dtype(dtype))


def normal(rank, tag, shape) -> np.ndarray:
    return rng(rank, tag).standard_normal(shape).astype(np.float32)


def check(actual, expected, what, dtype=None, tol=1e-5):
    assert isinstance(actual, jax.Array), f"{what}: got {type(actual).__name__}, not a jax.Array"
    expected = np.asarray(expected)
    if dtype is not None:
        assert actual.dtype == np.dtype(dtype), f"{what}: dtype {actual.dtype}, expected {np.dtype(dtype)}"
    got = np.asarray(actual)
    assert got.shape == expected.shape, f"{what}: shape {got.shape}, expected {expected.shape}"
    if got.dtype == np.bool_ or np.issubdtype(got.dtype, np.integer):
        ok = np.array_equal(got, expected)
    else:
        tol = {np.dtype(jnp.float16): 1e-2, np.dtype(jnp.bfloat16): 2e-2}.get(got.dtype, tol)
        ok = np.allclose(got.astype(np.float64), expected.astype(np.float64), rtol=tol, atol=tol)
    assert ok, f"{what}: values differ\n got      {got.tolist()}\n expected {expected.tolist()}"


def reduce_ref(op_name, arrays, prescale=1.0, postscale=1.0):
    stack = np.stack(arrays)
    if stack.dtype == np.bool_:
        return stack.any(0) if op_name in ("Sum", "Max") else stack.all(0)
    integer = np.issubdtype(stack.dtype, np.integer)
    stack = stack.astype(np.float64) * prescale
    out = {"Sum": lambda: stack.sum(0), "Min": lambda: stack.min(0), "Max": lambda: stack.max(0),
           "Product": lambda: stack.prod(0),
           "Average": lambda: stack.sum(0) // len(arrays) if integer else stack.sum(0) / len(arrays)}[op_name]()
    return out * postscale


def scatter_rows(rows, rank):
    return rows // SIZE + (1 if rank < rows % SIZE else 0)


def ragged_rows(rank):
    return rank + 1


# ------------------------------------------------------------------ eager collectives
def scenario_eager():
    for op_name, op in OPS.items():
        for dtype in DTYPES:
            if dtype == jnp.bool_ and op_name == "Average":
                continue
            low, high = (-3, 4) if op_name == "Product" else (0, 10) if op_name == "Average" else (-5, 6)
            inputs = [make(r, f"ar.{op_name}.{np.dtype(dtype)}", (2, 3), dtype, low, high) for r in range(SIZE)]
            got = hvd.allreduce(jnp.asarray(inputs[RANK]), op=op)
            check(got, reduce_ref(op_name, inputs).astype(np.dtype(dtype)), f"allreduce {op_name} {dtype}", dtype)
    # scale factors, compression, a pytree (fused), a grouped list, a scalar
    xs = [normal(r, "scaled", (5,)) for r in range(SIZE)]
    check(hvd.allreduce(jnp.asarray(xs[RANK]), op=hvd.Sum, prescale_factor=0.5, postscale_factor=3.0),
          reduce_ref("Sum", xs, 0.5, 3.0), "allreduce scaled")
    check(hvd.allreduce(jnp.asarray(xs[RANK]), compression=hvd.Compression.fp16), reduce_ref("Average", xs),
          "allreduce fp16", jnp.float32, tol=1e-2)
    tree = {"w": jnp.asarray(xs[RANK]), "b": (jnp.asarray(make(RANK, "t", (2,), jnp.int32)), jnp.float32(RANK))}
    got = hvd.allreduce(tree, op=hvd.Sum, name="tree")
    assert set(got) == {"w", "b"} and isinstance(got["b"], tuple)
    check(got["w"], reduce_ref("Sum", xs), "pytree w")
    check(got["b"][0], reduce_ref("Sum", [make(r, "t", (2,), jnp.int32) for r in range(SIZE)]), "pytree b0", jnp.int32)
    check(got["b"][1], sum(range(SIZE)), "pytree scalar", jnp.float32)
    grouped = hvd.grouped_allreduce([jnp.asarray(xs[RANK]), jnp.ones((2, 2)) * RANK], op=hvd.Max)
    check(grouped[0], reduce_ref("Max", xs), "grouped 0")
    check(grouped[1], np.full((2, 2), SIZE - 1.0), "grouped 1")
    # allgather: ragged first dimensions, a scalar, grouped
    parts = [make(r, "ag", (ragged_rows(r), 3), jnp.int32) for r in range(SIZE)]
    check(hvd.allgather(jnp.asarray(parts[RANK])), np.concatenate(parts), "allgather ragged", jnp.int32)
    check(hvd.allgather(jnp.float32(RANK)), np.arange(SIZE, dtype=np.float32), "allgather scalar")
    bf = [make(r, "agb", (2,), jnp.bfloat16) for r in range(SIZE)]
    g0, g1 = hvd.grouped_allgather([jnp.asarray(parts[RANK]), jnp.asarray(bf[RANK])])
    check(g0, np.concatenate(parts), "grouped_allgather 0")
    check(g1, np.concatenate(bf), "grouped_allgather bf16", jnp.bfloat16)
    # broadcast of a pytree from the last rank
    root = SIZE - 1
    got = hvd.broadcast({"a": jnp.asarray(make(RANK, "bc", (3,), jnp.int16)), "b": jnp.ones(2) * RANK}, root)
    check(got["a"], make(root, "bc", (3,), jnp.int16), "broadcast a", jnp.int16)
    check(got["b"], np.full(2, root, np.float32), "broadcast b")
    # alltoall: even, and with splits (rank r sends j+1+r rows to rank j)
    even = [make(r, "a2a", (2 * SIZE, 2), jnp.float32) for r in range(SIZE)]
    check(hvd.alltoall(jnp.asarray(even[RANK])), np.concatenate([e[2 * RANK:2 * RANK + 2] for e in even]),
          "alltoall even")
    splits = {r: [j + 1 + r for j in range(SIZE)] for r in range(SIZE)}
    data = {r: make(r, "a2as", (sum(splits[r]), 2), jnp.int32) for r in range(SIZE)}
    out, received = hvd.alltoall(jnp.asarray(data[RANK]), splits=splits[RANK])
    expected = []
    for r in range(SIZE):
        start = sum(splits[r][:RANK])
        expected.append(data[r][start:start + splits[r][RANK]])
    check(out, np.concatenate(expected), "alltoall splits", jnp.int32)
    check(received, [splits[r][RANK] for r in range(SIZE)], "alltoall received splits")
    # reducescatter: uneven rows, grouped
    rows = 2 * SIZE + 1
    rs = [make(r, "rs", (rows, 2), jnp.float32) for r in range(SIZE)]
    start = sum(scatter_rows(rows, r) for r in range(RANK))
    full = reduce_ref("Sum", rs)
    check(hvd.reducescatter(jnp.asarray(rs[RANK]), op=hvd.Sum), full[start:start + scatter_rows(rows, RANK)],
          "reducescatter")
    r0, r1 = hvd.grouped_reducescatter([jnp.asarray(rs[RANK]), jnp.asarray(rs[RANK]) * 2])
    check(r0, reduce_ref("Average", rs)[start:start + scatter_rows(rows, RANK)], "grouped_reducescatter 0")
    check(r1, 2 * reduce_ref("Average", rs)[start:start + scatter_rows(rows, RANK)], "grouped_reducescatter 1")
    # zero-copy: a CPU jax.Array and its engine buffer share memory
    x = jnp.arange(6, dtype=jnp.float32)
    assert host_calls.to_buffer(x).data_ptr() == x.unsafe_buffer_pointer(), "to_buffer copied"
    # a process set of some ranks (not all: that one exists already), eagerly and jitted
    members = [0, 1] if SIZE > 2 else [1]
    subset = hvd.add_process_set(members)
    if RANK in members:
        check(hvd.allreduce(jnp.ones(2) * (RANK + 1), op=hvd.Sum, process_set=subset),
              np.full(2, sum(r + 1.0 for r in members)), "set allreduce")
        check(jax.jit(lambda v: hvd.allgather(v, process_set=subset))(jnp.ones(1) * RANK), np.array(members, float),
              "set allgather")
    hvd.remove_process_set(subset)
    # objects
    assert hvd.broadcast_object({"from": RANK} if RANK == 1 % SIZE else None, root_rank=1 % SIZE) == {"from": 1 % SIZE}
    assert hvd.allgather_object(("r", RANK)) == [("r", r) for r in range(SIZE)]
    # bad input: a clear error on every rank
    expect_raises(TypeError, lambda: hvd.allreduce(jnp.ones(2, jnp.complex64)), "complex64", "is not supported")
    expect_raises(ValueError, lambda: hvd.allreduce(jnp.ones(2), op="mean"), "is not a reduction operator")


def scenario_async():
    xs = [normal(r, "async", (4,)) for r in range(SIZE)]
    handles = [hvd.allreduce_async(jnp.asarray(xs[RANK]), op=hvd.Sum, name="async.ar"),
               hvd.allgather_async({"p": jnp.asarray(make(RANK, "aga", (ragged_rows(RANK),), jnp.int32))}),
               hvd.broadcast_async(jnp.asarray(xs[RANK]), 0),
               hvd.alltoall_async(jnp.arange(SIZE, dtype=jnp.int32) + 10 * RANK),
               hvd.reducescatter_async(jnp.asarray(xs[RANK][:2].reshape(2, 1)), op=hvd.Sum),
               hvd.grouped_allreduce_async([jnp.ones(2), jnp.ones(3, jnp.int32)], op=hvd.Sum),
               hvd.grouped_allgather_async([jnp.ones(1) * RANK]),
               hvd.grouped_reducescatter_async([jnp.ones((SIZE, 1))], op=hvd.Sum)]
    assert all(isinstance(h, int) for h in handles)
    results = [hvd.synchronize(h) for h in handles]
    for h in handles:
        expect_raises(ValueError, lambda h=h: hvd.poll(h), "already synchronized")
    check(results[0], reduce_ref("Sum", xs), "async allreduce")
    check(results[1]["p"], np.concatenate([make(r, "aga", (ragged_rows(r),), jnp.int32) for r in range(SIZE)]),
          "async allgather pytree")
    check(results[2], xs[0], "async broadcast")
    out, received = results[3]
    check(out, [RANK + 10 * r for r in range(SIZE)], "async alltoall", jnp.int32)
    check(received, np.ones(SIZE), "async alltoall splits")
    summed = reduce_ref("Sum", [x[:2].reshape(2, 1) for x in xs])
    check(results[4], summed[start_row(2):start_row(2) + scatter_rows(2, RANK)], "async reducescatter")
    check(results[5][0], np.full(2, SIZE), "async grouped allreduce 0")
    check(results[5][1], np.full(3, SIZE), "async grouped allreduce 1", jnp.int32)
    check(results[6][0], np.arange(SIZE, dtype=np.float32), "async grouped allgather")
    check(results[7][0], np.full((1, 1), SIZE), "async grouped reducescatter")
    handle = hvd.allreduce_async(jnp.ones(3))
    while not hvd.poll(handle):
        pass
    check(hvd.synchronize(handle), np.ones(3), "poll then synchronize")
    hvd.barrier()
    assert hvd.join() in range(SIZE)
    # in compiled code, join and barrier run on every call (not once while tracing): in call n, rank n % SIZE
    # arrives late, so it is the one join reports as the last to join
    step = jax.jit(lambda x: (hvd.join(), hvd.allreduce(x, op=hvd.Sum, name="after_join"), hvd.barrier())[:2])
    for n in range(SIZE):
        if RANK == n % SIZE:
            time.sleep(0.5)
        last, total = step(jnp.full(2, float(n)))
        assert int(last) == n % SIZE, (n, last)
        check(total, np.full(2, float(n * SIZE)), f"jit join/allreduce/barrier call {n}")
    expect_raises(ValueError, lambda: jax.jit(lambda x: hvd.allreduce_async(x))(jnp.ones(2)), "runs eagerly only")


def start_row(rows):
    return sum(scatter_rows(rows, r) for r in range(RANK))


# ------------------------------------------------------------------ inside jax.jit
def scenario_jit():
    xs = [normal(r, "jit", (3, 2)) for r in range(SIZE)]
    parts = [make(r, "jag", (2, 2), jnp.int32) for r in range(SIZE)]
    rows = 2 * SIZE + 1
    rs = [normal(r, "jrs", (rows, 2)) for r in range(SIZE)]

    @jax.jit
    def step(x, part, r):
        summed = hvd.allreduce(x * 2, op=hvd.Sum)
        tree = hvd.allreduce({"a": x, "b": part}, op=hvd.Max)
        gathered = hvd.allgather(part)
        bcast = hvd.broadcast(x, root_rank=SIZE - 1)
        exchanged = hvd.alltoall(jnp.tile(part[:1], (SIZE, 1)) + jnp.arange(SIZE, dtype=jnp.int32)[:, None])
        scattered = hvd.reducescatter(r, op=hvd.Sum, prescale_factor=2.0)
        (g_scattered,) = hvd.grouped_reducescatter([r])
        low = hvd.allreduce({"bf16": x.astype(jnp.bfloat16), "bool": part > 0, "f16": x.astype(jnp.float16)},
                            op=hvd.Sum)
        return summed + 1, tree, gathered, bcast, exchanged, scattered, g_scattered, low

    for _ in range(2):  # the second call runs the compiled program again: unnamed ops numbered alike
        summed, tree, gathered, bcast, exchanged, scattered, g_scattered, low = step(
            jnp.asarray(xs[RANK]), jnp.asarray(parts[RANK]), jnp.asarray(rs[RANK]))
        check(summed, reduce_ref("Sum", [2 * x for x in xs]) + 1, "jit allreduce")
        check(low["bf16"], reduce_ref("Sum", xs), "jit bfloat16", jnp.bfloat16)
        check(low["f16"], reduce_ref("Sum", xs), "jit float16", jnp.float16)
        check(low["bool"], reduce_ref("Sum", [p > 0 for p in parts]), "jit bool", jnp.bool_)
        check(tree["a"], reduce_ref("Max", xs), "jit pytree a")
        check(tree["b"], reduce_ref("Max", parts), "jit pytree b", jnp.int32)
        check(gathered, np.concatenate(parts), "jit allgather", jnp.int32)
        check(bcast, xs[SIZE - 1], "jit broadcast")
        check(exchanged, np.stack([parts[r][0] + RANK for r in range(SIZE)]), "jit alltoall", jnp.int32)
        mine = slice(start_row(rows), start_row(rows) + scatter_rows(rows, RANK))
        check(scattered, (2 * reduce_ref("Sum", rs))[mine], "jit reducescatter")
        check(g_scattered, reduce_ref("Average", rs)[mine], "jit grouped_reducescatter")
        check(hvd.allreduce(jnp.ones(1), op=hvd.Sum), [SIZE], "eager after jit")  # ordered after the jitted step

    # clear errors for what jit cannot do, and for vmap
    ragged = jnp.ones((ragged_rows(RANK), 2))
    total = sum(ragged_rows(r) for r in range(SIZE))
    if SIZE * ragged_rows(RANK) == total:  # this rank's traced shape happens to be right
        check(jax.jit(hvd.allgather)(ragged), np.ones((total, 2)), "jit allgather, matching by chance")
    else:
        expect_raises(Exception, lambda: jax.jit(hvd.allgather)(ragged).block_until_ready(),
                      "every rank must pass the same first dimension", "outside jit")
    hvd.barrier()
    expect_raises(ValueError, lambda: jax.jit(lambda x: hvd.alltoall(x, splits=[1] * SIZE))(jnp.ones(SIZE)),
                  "splits= inside jax.jit", "outside jit")
    for name, fn in [("vmap", jax.vmap(hvd.allreduce)), ("vmap of jit", jax.vmap(jax.jit(hvd.allreduce))),
                     ("jit of vmap", jax.jit(jax.vmap(lambda x: hvd.allgather(x))))]:
        expect_raises(ValueError, lambda fn=fn: fn(jnp.ones((2, 3))), "cannot run under jax.vmap",
                      "on the whole batched array", what=name)
    check(hvd.allreduce(jnp.ones(2) * RANK, op=hvd.Sum), np.full(2, sum(range(SIZE))), "allreduce after errors")


# ------------------------------------------------------------------ gradients
def scenario_grads():
    c = [normal(r, "c", (4,)) for r in range(SIZE)]
    x = jnp.asarray(normal(RANK, "x", (4,)))
    for jit in (False, True):
        wrap = jax.jit if jit else (lambda f: f)
        tag = "jit" if jit else "eager"
        # allreduce: the cotangent reduced with the same op and scale factors
        g = wrap(jax.grad(lambda v: jnp.sum(jnp.asarray(c[RANK]) * hvd.allreduce(v, op=hvd.Sum))))(x)
        check(g, reduce_ref("Sum", c), f"{tag} grad allreduce Sum")
        g = wrap(jax.grad(lambda v: jnp.sum(jnp.asarray(c[RANK]) * hvd.allreduce(
            v, prescale_factor=2.0, postscale_factor=0.5))))(x)
        check(g, reduce_ref("Average", c), f"{tag} grad allreduce Average scaled")
        g = wrap(jax.grad(lambda t: jnp.sum(hvd.allreduce(t, op=hvd.Sum)["w"] * jnp.asarray(c[RANK]))))(
            {"w": x, "b": jnp.ones(2)})
        check(g["w"], reduce_ref("Sum", c), f"{tag} grad pytree w")
        check(g["b"], np.zeros(2), f"{tag} grad pytree unused leaf")
        # allgather: this rank's rows of the averaged cotangent
        rows = 2 if jit else ragged_rows(RANK)
        all_rows = [2 if jit else ragged_rows(r) for r in range(SIZE)]
        cg = [normal(r, "cg", (sum(all_rows), 3)) for r in range(SIZE)]
        xg = jnp.asarray(normal(RANK, "xg", (rows, 3)))
        g = wrap(jax.grad(lambda v: jnp.sum(jnp.asarray(cg[RANK]) * hvd.allgather(v))))(xg)
        start = sum(all_rows[:RANK])
        check(g, reduce_ref("Average", cg)[start:start + rows], f"{tag} grad allgather")
        # broadcast: the averaged cotangent on the root, zeros elsewhere
        g = wrap(jax.grad(lambda v: jnp.sum(jnp.asarray(c[RANK]) * hvd.broadcast(v, 0))))(x)
        check(g, reduce_ref("Average", c) if RANK == 0 else np.zeros(4), f"{tag} grad broadcast")
        # reducescatter (Sum): the allgathered cotangent times the set size
        rs_rows = 2 * SIZE + 1
        mine = scatter_rows(rs_rows, RANK)
        cr = [normal(r, "cr", (scatter_rows(rs_rows, r), 2)) for r in range(SIZE)]
        g = wrap(jax.grad(lambda v: jnp.sum(jnp.asarray(cr[RANK]) * hvd.reducescatter(v, op=hvd.Sum))))(
            jnp.ones((rs_rows, 2)))
        assert cr[RANK].shape[0] == mine
        check(g, SIZE * np.concatenate(cr), f"{tag} grad reducescatter")
        # alltoall (even): the cotangent sent back
        ca = [normal(r, "ca", (SIZE, 2)) for r in range(SIZE)]
        g = wrap(jax.grad(lambda v: jnp.sum(jnp.asarray(ca[RANK]) * hvd.alltoall(v))))(jnp.ones((SIZE, 2)))
        check(g, np.stack([ca[r][RANK] for r in range(SIZE)]), f"{tag} grad alltoall")
    # alltoall with splits, eagerly: rank r sends r+1 rows to everyone
    splits = [RANK + 1] * SIZE
    recv = [r + 1 for r in range(SIZE)]
    ca = [normal(r, "cas", (sum(r2 + 1 for r2 in range(SIZE)), 2)) for r in range(SIZE)]
    g = jax.grad(lambda v: jnp.sum(jnp.asarray(ca[RANK]) * hvd.alltoall(v, splits=splits)[0]))(
        jnp.ones((SIZE * (RANK + 1), 2)))
    expected = [ca[j][sum(recv[:RANK]):sum(recv[:RANK]) + RANK + 1] for j in range(SIZE)]
    check(g, np.concatenate(expected), "grad alltoall splits")
    expect_raises(TypeError, lambda: jax.jvp(hvd.allreduce, (x,), (x,)), "forward-mode")


# ------------------------------------------------------------------ optimizer and broadcasts
def loss_fn(params, xb, yb):
    return jnp.mean((xb @ params["w"] + params["b"] - yb) ** 2)


def scenario_optimizer():
    per_rank, steps = 4, 5
    data_rng = np.random.RandomState(7)
    features = data_rng.standard_normal((steps, 2, per_rank * SIZE, 3)).astype(np.float32)
    targets = data_rng.standard_normal((steps, 2, per_rank * SIZE, 1)).astype(np.float32)
    start = {"w": jnp.asarray(normal(0, "w", (3, 1))), "b": jnp.zeros(1)}
    mine = slice(RANK * per_rank, (RANK + 1) * per_rank)

    # broadcast_parameters / broadcast_optimizer_state: every rank ends with rank 0's
    params = {"w": jnp.asarray(normal(RANK, "w", (3, 1))), "b": jnp.zeros(1)}
    params = hvd.broadcast_parameters(params, root_rank=0)
    check(params["w"], np.asarray(start["w"]), "broadcast_parameters")
    inner = optax.sgd(0.1, momentum=0.9)
    tx = hvd.DistributedOptimizer(inner)
    opt_state = inner.init(jax.tree_util.tree_map(lambda p: p + RANK, params))
    opt_state = hvd.broadcast_optimizer_state(jax.tree_util.tree_map(lambda p: p + RANK, opt_state), root_rank=0)
    check(opt_state[0].trace["w"], np.zeros((3, 1)), "broadcast_optimizer_state")

    @jax.jit
    def step(p, s, xb, yb):
        updates, s = tx.update(jax.grad(loss_fn)(p, xb, yb), s, p)
        return optax.apply_updates(p, updates), s

    def reference_step(tx_, p, s, grads):  # one process, the whole batch's gradient
        updates, s = tx_.update(grads, s, p)
        return optax.apply_updates(p, updates), s

    reference_step = jax.jit(reference_step, static_argnums=0)
    full_grad = jax.jit(jax.grad(loss_fn))
    ref_p, ref_s = start, inner.init(start)
    for i in range(steps):
        params, opt_state = step(params, opt_state, features[i, 0, mine], targets[i, 0, mine])
        ref_p, ref_s = reference_step(inner, ref_p, ref_s, full_grad(ref_p, features[i, 0], targets[i, 0]))
    for key in params:
        check(params[key], np.asarray(ref_p[key]), f"DistributedOptimizer {key} vs one process", tol=1e-5)

    # two backward passes per step (eagerly and jitted), fp16 compression: the average over both
    adam = optax.adam(0.05)
    for jit in (False, True):
        tx2 = hvd.DistributedOptimizer(adam, backward_passes_per_step=2, compression=hvd.Compression.fp16,
                                       num_groups=2)
        params, opt_state = start, tx2.init(start)
        ref_p, ref_s = start, adam.init(start)

        def step2(p, s, xb, yb):
            updates, s = tx2.update(full_grad(p, xb, yb), s, p)
            return optax.apply_updates(p, updates), s

        step2 = jax.jit(step2) if jit else step2
        for i in range(steps if jit else 1):  # eager JAX compiles every new primitive: one step
            before = params
            params, opt_state = step2(params, opt_state, features[i, 0, mine], targets[i, 0, mine])
            check(params["w"], np.asarray(before["w"]), "first pass leaves params unchanged")
            params, opt_state = step2(params, opt_state, features[i, 1, mine], targets[i, 1, mine])
            grads = jax.tree_util.tree_map(lambda a, b: (a + b) / 2, full_grad(ref_p, features[i, 0], targets[i, 0]),
                                           full_grad(ref_p, features[i, 1], targets[i, 1]))
            ref_p, ref_s = reference_step(adam, ref_p, ref_s, grads)
        for key in params:
            check(params[key], np.asarray(ref_p[key]), f"backward_passes_per_step=2 jit={jit} {key}", tol=2e-3)
    expect_raises(ValueError, lambda: hvd.DistributedOptimizer(inner, op=hvd.Sum, gradient_predivide_factor=2.0),
                  "op=Average only")


SCENARIOS = {"eager": scenario_eager, "async": scenario_async, "jit": scenario_jit, "grads": scenario_grads,
             "optimizer": scenario_optimizer}

if __name__ == "__main__":
    run_scenarios(SCENARIOS, sys.argv, RANK)
