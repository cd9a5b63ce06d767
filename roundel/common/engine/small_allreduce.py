"""Small CPU allreduces reduced by the coordinator, from data sent with the requests.

A CPU allreduce (Sum, Average, Min, Max or Product) of at most
``Settings.coordinator_reduce_bytes`` bytes carries its tensor's bytes with
its request (or its cache bit) to the coordinator on rank 0. When every member
of its process set has sent them, the coordinator reduces them in rank order
and the batch it dispatches carries the result: the ranks then take it from
there and make no transport call. One round trip to rank 0 replaces the
negotiation round trip followed by the transport's own exchanges, which for a
few bytes cost more than the data. In any other case (a rank that has joined,
or one that sent no data) the batch runs on the transport as usual.
"""

from __future__ import annotations

import ctypes
import math

import numpy as np
import torch

from roundel.common.control.records import OpKind, Request
from roundel.ops import ReduceOp
from roundel.transport.backend import ARITHMETIC_DTYPES, COMBINE, scale, widened

#: Dtypes reduced at the coordinator (bool and complex tensors always go to the transport).
DTYPES = tuple(str(dtype).removeprefix("torch.") for dtype in ARITHMETIC_DTYPES)
#: The most tensor bytes one control message carries (the data of a rank's submitted requests, a batch's
#: results, a dispatch's), well under ``control_channel.MAX_FRAME``; more go in further messages.
MESSAGE_DATA_BYTES = 64 * 1024 * 1024
_OPS = (ReduceOp.Sum, ReduceOp.Average, ReduceOp.Min, ReduceOp.Max, ReduceOp.Product)
# NumPy reduces a few bytes several times faster than torch, with the same results: integers wrap
# around alike, and float16 sums are rounded after each step in both.
_NUMPY_TYPES = {name: np.dtype(name) for name in DTYPES if name != "bfloat16"}
_NUMPY_COMBINE = {ReduceOp.Sum: np.add, ReduceOp.Average: np.add, ReduceOp.Min: np.minimum,
                  ReduceOp.Max: np.maximum, ReduceOp.Product: np.multiply}


_ITEMSIZES = {name: getattr(torch, name).itemsize for name in DTYPES}


def nbytes(request: Request) -> int:
    """The size of ``request``'s tensor in bytes."""
    itemsize = _ITEMSIZES.get(request.dtype)
    return math.prod(request.shape) * (itemsize if itemsize is not None else getattr(torch, request.dtype).itemsize)


def eligible(request: Request, limit: int) -> bool:
    """Whether ``request`` may be reduced at the coordinator when it is at most ``limit`` bytes."""
    itemsize = _ITEMSIZES.get(request.dtype)  # None: not an arithmetic type
    return (itemsize is not None and request.kind == OpKind.ALLREDUCE and request.device == "cpu"
            and request.reduce_op in _OPS and request.error is None
            and 0 < math.prod(request.shape) * itemsize <= limit)


def snapshot(tensor: torch.Tensor) -> bytes:
    """The bytes a rank sends for ``tensor`` (its elements in row-major order)."""
    if _plain(tensor):
        return ctypes.string_at(tensor.data_ptr(), tensor.numel() * tensor.element_size())
    return tensor.detach().reshape(-1).contiguous().view(torch.uint8).numpy().tobytes()


def reduce(request: Request, contributions: list) -> bytes | None:
    """Every member's bytes (in rank order) prescaled, combined and postscaled (Average: divided by the
    number of members) as the transport path would; None if any has the wrong size."""
    size = nbytes(request)
    if any(not isinstance(data, bytes) or len(data) != size for data in contributions):
        return None
    op = ReduceOp(request.reduce_op)
    post = request.result_scale(len(contributions))
    array_type = _NUMPY_TYPES.get(request.dtype)
    if array_type is not None and request.prescale == 1.0:  # NumPy: the same results, in less time
        combine = _NUMPY_COMBINE[op]
        rows = [np.frombuffer(data, array_type) for data in contributions]
        with np.errstate(all="ignore"):  # overflow to inf or wrap-around, silently, as torch does
            result = combine(rows[0], rows[1]) if len(rows) > 1 else rows[0].copy()
            for row in rows[2:]:
                combine(result, row, out=result)
        if post != 1.0:
            scale(torch.from_numpy(result), post)
        return result.tobytes()
    dtype = getattr(torch, request.dtype)
    tensors = [widened(torch.frombuffer(bytearray(data), dtype=dtype)) for data in contributions]
    for tensor in tensors:
        scale(tensor, request.prescale)
    combine_tensors = COMBINE[op]
    total = tensors[0]
    for tensor in tensors[1:]:
        combine_tensors(total, tensor)
    if total.dtype != dtype:
        total = total.to(dtype)
    scale(total, post)
    return total.view(torch.uint8).numpy().tobytes()


def _plain(tensor: torch.Tensor) -> bool:
    """Whether ``tensor``'s memory holds its elements as they are, in row-major order."""
    return tensor.is_contiguous() and not tensor.is_neg()


def unpack(reduced: bytes, dtype: torch.dtype, outputs: list) -> None:
    """Copy a coordinator's result into ``outputs`` (in entry order)."""
    if len(outputs) == 1 and _plain(outputs[0]) and len(reduced) == outputs[0].numel() * outputs[0].element_size():
        ctypes.memmove(outputs[0].data_ptr(), reduced, len(reduced))  # the bytes, as they are
        return
    result = torch.frombuffer(bytearray(reduced), dtype=dtype)
    offset = 0
    with torch.no_grad():
        for output in outputs:
            count = output.numel()
            output.copy_(result[offset:offset + count].view(output.shape))
            offset += count

