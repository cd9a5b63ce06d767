"""Helpers shared by the worker scripts: deterministic per-rank inputs and NumPy comparisons.

Every rank can build every other rank's input (inputs are seeded by rank and a
tag), so each rank computes the NumPy reference for a collective locally and
compares. A mismatch raises AssertionError, which makes the rank exit non-zero.

``ROUNDEL_TEST_DEVICE=cuda`` makes the inputs CUDA tensors on the current GPU
(the workers select ``local_rank`` modulo the GPUs there are).
"""

from __future__ import annotations

import os
import sys
import time
import traceback
import zlib

import numpy as np
import torch

INT_DTYPES = (torch.uint8, torch.int8, torch.int16, torch.int32, torch.int64)
FLOAT_DTYPES = (torch.float16, torch.bfloat16, torch.float32, torch.float64)
ALL_DTYPES = INT_DTYPES + FLOAT_DTYPES + (torch.bool,)

DEVICE = os.environ.get("ROUNDEL_TEST_DEVICE", "cpu")

_TOL = {torch.float16: 1e-2, torch.bfloat16: 2e-2, torch.float32: 1e-5, torch.float64: 1e-12}


def dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).split(".")[1]


def rng(rank: int, tag: str) -> np.random.RandomState:
    return np.random.RandomState(zlib.crc32(f"{rank}/{tag}".encode()))


def make(rank: int, tag: str, shape, dtype: torch.dtype, low: int = -5, high: int = 6) -> torch.Tensor:
    """A deterministic tensor for ``rank``: small integers (exact in every dtype) in [low, high)."""
    r = rng(rank, tag)
    shape = tuple(shape)
    if dtype == torch.bool:
        values = r.randint(0, 2, size=shape).astype(bool)
        return torch.from_numpy(np.array(values, dtype=bool)).to(DEVICE)
    if dtype == torch.uint8:
        low = max(low, 0)
    values = r.randint(low, high, size=shape).astype(np.float64)
    return torch.from_numpy(np.array(values)).to(DEVICE, dtype)


def make_float(rank: int, tag: str, shape, dtype=torch.float64) -> torch.Tensor:
    """A deterministic tensor of normal floats for ``rank``."""
    return torch.from_numpy(np.array(rng(rank, tag).standard_normal(tuple(shape)))).to(DEVICE, dtype)


def use_test_device(local_rank: int) -> None:
    """Make this rank's GPU current when the inputs are CUDA tensors."""
    if DEVICE == "cuda":
        torch.cuda.set_device(local_rank % torch.cuda.device_count())


def to_np(tensor: torch.Tensor) -> np.ndarray:
    tensor = tensor.detach().cpu()
    if tensor.dtype in (torch.bfloat16, torch.float16):
        tensor = tensor.double()
    return tensor.numpy()


def check(actual: torch.Tensor, expected, what: str, dtype: torch.dtype | None = None) -> None:
    """Assert ``actual`` has ``dtype`` (if given), the shape of ``expected`` and (nearly) equal values."""
    assert isinstance(actual, torch.Tensor), f"{what}: got {type(actual).__name__}, not a tensor"
    if dtype is not None:
        assert actual.dtype == dtype, f"{what}: dtype {actual.dtype}, expected {dtype}"
    expected = expected if isinstance(expected, np.ndarray) else (
        to_np(expected) if isinstance(expected, torch.Tensor) else np.asarray(expected))
    got = to_np(actual)
    assert got.shape == expected.shape, f"{what}: shape {got.shape}, expected {expected.shape}"
    tol = _TOL.get(actual.dtype)
    if tol is None:
        ok = np.array_equal(got, expected)
    else:
        ok = np.allclose(got.astype(np.float64), expected.astype(np.float64), rtol=tol, atol=tol)
    assert ok, f"{what}: values differ\n got      {got.tolist()}\n expected {expected.tolist()}"


def expect_raises(types, fn, *needles: str, what: str = ""):
    """Call ``fn``; assert it raises one of ``types`` whose message contains every needle; return it."""
    try:
        fn()
    except types as exc:
        message = str(exc)
        for needle in needles:
            assert needle in message, f"{what}: message {message!r} lacks {needle!r}"
        return exc
    except Exception as exc:  # the wrong type
        raise AssertionError(f"{what}: raised {type(exc).__name__}: {exc}, expected {types}") from exc
    raise AssertionError(f"{what}: did not raise {types}")


def run_scenarios(scenarios: dict, argv: list[str], rank: int) -> None:
    """Run the comma-separated scenario names in ``argv[1]``; print CHECKS PASSED for each."""
    names = argv[1].split(",") if len(argv) > 1 else list(scenarios)
    for name in names:
        if name not in scenarios:
            raise SystemExit(f"unknown scenario {name!r}; known: {', '.join(scenarios)}")
        start = time.monotonic()
        try:
            scenarios[name]()
        except BaseException:
            print(f"rank {rank}: scenario {name} FAILED", file=sys.stderr, flush=True)
            traceback.print_exc()
            sys.stderr.flush()
            raise
        print(f"CHECKS PASSED {name}", flush=True)
        print(f"scenario {name} took {time.monotonic() - start:.2f} s", file=sys.stderr, flush=True)
