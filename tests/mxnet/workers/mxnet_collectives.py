"""roundel.mxnet's collectives under roundelrun, checked against NumPy: ``mxnet_collectives.py SCENARIO,...``.

Every rank can build every rank's input (seeded by rank and a tag), so each
computes the NumPy reference itself. A failed check raises, the rank exits
non-zero and roundelrun names it; each scenario that holds prints
``CHECKS PASSED <scenario>``.
"""

from __future__ import annotations

import sys
import zlib

import mxnet as mx
import numpy as np

import roundel.mxnet as hvd

DTYPES = ("uint8", "int8", "int32", "int64", "float16", "float32", "float64")
TOL = {"float16": 1e-2, "float32": 1e-5, "float64": 1e-12}
RANK = SIZE = None


def make(rank: int, tag: str, shape, dtype: str) -> np.ndarray:
    """Small integers (exact in every dtype) for ``rank``; 1..3 for uint8 so products stay in range."""
    r = np.random.RandomState(zlib.crc32(f"{rank}/{tag}".encode()))
    low, high = (1, 4) if dtype == "uint8" else (-3, 4)
    return r.randint(low, high, size=shape).astype(dtype)


def nd(array: np.ndarray) -> mx.nd.NDArray:
    return mx.nd.array(array, dtype=array.dtype)


def check(actual, expected: np.ndarray, what: str) -> None:
    assert isinstance(actual, mx.nd.NDArray), f"{what}: got {type(actual).__name__}, not an NDArray"
    got = actual.asnumpy()
    assert got.dtype == expected.dtype, f"{what}: dtype {got.dtype}, expected {expected.dtype}"
    assert got.shape == expected.shape, f"{what}: shape {got.shape}, expected {expected.shape}"
    tol = TOL.get(str(expected.dtype))
    ok = np.array_equal(got, expected) if tol is None else np.allclose(got, expected, rtol=tol, atol=tol)
    assert ok, f"{what}: values differ\n got      {got.tolist()}\n expected {expected.tolist()}"


def expect_raises(types, fn, *needles, what: str):
    try:
        fn()
    except types as exc:
        for needle in needles:
            assert needle in str(exc), f"{what}: message {str(exc)!r} lacks {needle!r}"
        return
    raise AssertionError(f"{what}: did not raise {types}")


def reference(op, arrays, dtype):
    stacked = np.stack([a.astype(np.float64) for a in arrays])
    value = {hvd.Sum: stacked.sum(0), hvd.Average: stacked.mean(0), hvd.Min: stacked.min(0),
             hvd.Max: stacked.max(0), hvd.Product: stacked.prod(0)}[op]
    return value.astype(dtype)


# ------------------------------------------------------------------ scenarios
def scenario_allreduce():
    for dtype in DTYPES:
        for op in (hvd.Sum, hvd.Min, hvd.Max, hvd.Product) + ((hvd.Average,) if "float" in dtype else ()):
            tag = f"ar.{dtype}.{op.name}"
            inputs = [make(r, tag, (3, 4), dtype) for r in range(SIZE)]
            expected = reference(op, inputs, dtype)
            x = nd(inputs[RANK])
            out = hvd.allreduce(x, name=tag, op=op)
            check(out, expected, f"allreduce {tag}")
            check(x, inputs[RANK], f"allreduce {tag} left its input alone")
            y = nd(inputs[RANK])
            assert hvd.allreduce_(y, op=op, priority=3) is y, "allreduce_ returns its argument"
            check(y, expected, f"allreduce_ {tag}")
    # Average by default, the legacy average= flag, scale factors
    inputs = [make(r, "scaled", (5,), "float64") for r in range(SIZE)]
    total = np.sum(inputs, axis=0)
    check(hvd.allreduce(nd(inputs[RANK])), total / SIZE, "default Average")
    check(hvd.allreduce(nd(inputs[RANK]), average=False), total, "average=False")
    check(hvd.allreduce(nd(inputs[RANK]), op=hvd.Sum, prescale_factor=0.5, postscale_factor=3.0), total * 1.5,
          "prescale and postscale")
    check(hvd.allreduce(nd(inputs[RANK]), average=True, prescale_factor=2.0), total * 2.0 / SIZE,
          "Average with prescale")
    expect_raises(ValueError, lambda: hvd.allreduce(nd(inputs[RANK]), op=hvd.Adasum), "Adasum is not supported",
                  what="Adasum")
    expect_raises(ValueError, lambda: hvd.allreduce(nd(inputs[RANK]), average=True, op=hvd.Sum), "not both",
                  what="average= and op=")


def scenario_grouped():
    shapes = [(4,), (2, 3), (1,), (3, 1, 2)]
    dtypes = ["float32", "int32", "float64", "float16"]
    inputs = [[make(r, f"g{i}", s, d) for i, (s, d) in enumerate(zip(shapes, dtypes))] for r in range(SIZE)]
    expected = [reference(hvd.Sum, [inputs[r][i] for r in range(SIZE)], d) for i, d in enumerate(dtypes)]
    mine = [nd(a) for a in inputs[RANK]]
    outs = hvd.grouped_allreduce(mine, op=hvd.Sum, name="grouped")
    for i, out in enumerate(outs):
        check(out, expected[i], f"grouped_allreduce [{i}]")
        check(mine[i], inputs[RANK][i], f"grouped_allreduce left input {i} alone")
    assert hvd.grouped_allreduce_(mine, average=False) is mine, "grouped_allreduce_ returns its argument"
    for i, t in enumerate(mine):
        check(t, expected[i], f"grouped_allreduce_ [{i}]")
    assert hvd.grouped_allreduce([]) == [] and hvd.grouped_allreduce_([]) == [], "empty groups"


def scenario_gather_bcast():
    for dtype in DTYPES + ("bool",):
        tag = f"ag.{dtype}"
        inputs = [make(r, tag, (r + 1, 3), "int32").astype(dtype) for r in range(SIZE)]
        check(hvd.allgather(nd(inputs[RANK]), name=tag), np.concatenate(inputs), f"allgather {dtype}")
        same = [make(r, f"bc.{dtype}", (2, 3), "int32").astype(dtype) for r in range(SIZE)]
        x = nd(same[RANK])
        check(hvd.broadcast(x, 1, name=f"bc.{dtype}"), same[1], f"broadcast {dtype} from rank 1")
        check(x, same[RANK], f"broadcast {dtype} left its input alone")
        assert hvd.broadcast_(x, 0, name=f"bc_.{dtype}") is x, "broadcast_ returns its argument"
        check(x, same[0], f"broadcast_ {dtype} from rank 0")
    inputs = [[make(r, "gag0", (r + 2,), "float32"), make(r, "gag1", (1 + 2 * r, 2), "int64")] for r in range(SIZE)]
    outs = hvd.grouped_allgather([nd(a) for a in inputs[RANK]])
    for i, out in enumerate(outs):
        check(out, np.concatenate([inputs[r][i] for r in range(SIZE)]), f"grouped_allgather [{i}]")
    # objects, through roundel.common.objects
    assert hvd.broadcast_object({"from": RANK}, root_rank=1) == {"from": 1}, "broadcast_object"
    assert hvd.allgather_object(RANK * 10) == [r * 10 for r in range(SIZE)], "allgather_object"


def scenario_alltoall_reducescatter():
    # rank r sends j + r + 1 rows to rank j
    sends = {r: [j + r + 1 for j in range(SIZE)] for r in range(SIZE)}
    inputs = [make(r, "a2a", (sum(sends[r]), 2), "float32") for r in range(SIZE)]

    def rows(r, j):
        start = sum(sends[r][:j])
        return inputs[r][start:start + sends[r][j]]

    expected = np.concatenate([rows(r, RANK) for r in range(SIZE)])
    for splits in (sends[RANK], mx.nd.array(sends[RANK], dtype="int32")):
        out, received = hvd.alltoall(nd(inputs[RANK]), splits=splits, name="a2a")
        check(out, expected, f"alltoall with splits as {type(splits).__name__}")
        check(received, np.array([sends[r][RANK] for r in range(SIZE)], dtype=np.int32), "alltoall received splits")
    even = [make(r, "a2a.even", (2 * SIZE,), "int64") for r in range(SIZE)]
    out = hvd.alltoall(nd(even[RANK]))
    check(out, np.concatenate([e[2 * RANK:2 * RANK + 2] for e in even]), "alltoall without splits")

    for dtype, op in (("float32", hvd.Average), ("int32", hvd.Sum), ("float64", hvd.Sum)):
        inputs = [make(r, f"rs.{dtype}", (2 * SIZE + 1, 3), dtype) for r in range(SIZE)]
        total = reference(op, inputs, dtype)
        counts = [(2 * SIZE + 1) // SIZE + (1 if r < (2 * SIZE + 1) % SIZE else 0) for r in range(SIZE)]
        start = sum(counts[:RANK])
        check(hvd.reducescatter(nd(inputs[RANK]), op=op), total[start:start + counts[RANK]],
              f"reducescatter {dtype} {op.name}")
    inputs = [[make(r, "grs0", (SIZE * 2,), "float32"), make(r, "grs1", (SIZE, 2), "float64")] for r in range(SIZE)]
    outs = hvd.grouped_reducescatter([nd(a) for a in inputs[RANK]], op=hvd.Sum, postscale_factor=2.0)
    for i, out in enumerate(outs):
        total = 2.0 * np.sum([inputs[r][i] for r in range(SIZE)], axis=0)
        per = total.shape[0] // SIZE
        check(out, total[RANK * per:(RANK + 1) * per].astype(inputs[RANK][i].dtype), f"grouped_reducescatter [{i}]")
    expect_raises(ValueError, lambda: hvd.reducescatter(nd(inputs[RANK][0]), op=hvd.Max), "Average or hvd.Sum",
                  what="reducescatter Max")


def scenario_process_set():
    # a set of rank 1 alone, and the set of every rank in reverse order of registration
    solo = hvd.add_process_set([1])
    x = nd(make(RANK, "ps", (3,), "float32"))
    if RANK == 1:
        check(hvd.allreduce(x, op=hvd.Sum, process_set=solo), x.asnumpy(), "allreduce on a set of one")
    check(hvd.allreduce(x, op=hvd.Sum, process_set=hvd.global_process_set),
          np.sum([make(r, "ps", (3,), "float32") for r in range(SIZE)], axis=0), "allreduce on the global set")
    hvd.remove_process_set(solo)


def scenario_errors():
    # mismatched shapes: a clear error on every rank, and the job goes on
    x = nd(np.ones(4 if RANK == SIZE - 1 else 3, dtype=np.float32))
    for fn in (lambda: hvd.allreduce(x, name="bad.shape"), lambda: hvd.allreduce_(x, name="bad.shape_")):
        expect_raises(hvd.CollectiveMismatchError, fn, "tensor shapes", "(3,)", "(4,)", what="shape mismatch")
    y = nd(np.ones(3, dtype=np.float64 if RANK == 0 else np.float32))
    expect_raises(hvd.CollectiveMismatchError, lambda: hvd.broadcast_(y, 0, name="bad.dtype"), "data types",
                  "float64", "float32", what="dtype mismatch")
    check(hvd.allreduce(nd(np.full(3, RANK + 1.0, dtype=np.float32)), op=hvd.Sum, name="after"),
          np.full(3, SIZE * (SIZE + 1) / 2, dtype=np.float32), "allreduce after the errors")
    # wrong types are refused at once, with what to pass instead
    expect_raises(TypeError, lambda: hvd.allreduce(np.ones(3)), "expects an mxnet NDArray", "mx.nd.array",
                  what="NumPy input")
    expect_raises(TypeError, lambda: hvd.allreduce(mx.nd.sparse.zeros("csr", (2, 2))), "dense NDArrays only",
                  what="sparse input")
    expect_raises(ValueError, lambda: hvd.broadcast_parameters([1, 2]), "dict or a gluon ParameterDict",
                  what="broadcast_parameters of a list")
    check(hvd.allgather(nd(np.array([RANK], dtype=np.int64))), np.arange(SIZE, dtype=np.int64),
          "allgather after the errors")


SCENARIOS = {name[len("scenario_"):]: fn for name, fn in globals().items() if name.startswith("scenario_")}


def main(argv):
    global RANK, SIZE
    hvd.init()
    RANK, SIZE = hvd.rank(), hvd.size()
    assert SIZE >= 2, "run under roundelrun -np 2 or more"
    for name in argv[1].split(","):
        SCENARIOS[name]()
        print(f"CHECKS PASSED {name}", flush=True)
    hvd.shutdown()


if __name__ == "__main__":
    main(sys.argv)
