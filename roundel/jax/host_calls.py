"""How JAX arrays reach the engine: buffer conversions, and running a collective now or from compiled code.

Eagerly (concrete arrays) a collective runs at once in Python. While JAX
traces (``jax.jit``, or the backward pass of ``jax.grad`` inside ``jit``) it
becomes an ordered ``jax.experimental.io_callback``: the result shapes are
fixed at trace time and the callbacks of a program run in program order, so
every rank submits its collectives in the same order. Under ``jax.vmap``
(which would run one collective per batch element, in an order that is not
defined) it raises a ValueError saying so.

Copies: a CPU ``jax.Array`` is shared with the engine through DLPack without
a copy, and eager results come back the same way (JAX copies only when a
buffer is not aligned as it needs). Arrays on other devices go through
NumPy (a copy to the host), and eager results are CPU arrays. From compiled
code, ``io_callback`` hands the callback its operands and copies the
returned NumPy views of the engine's results into XLA's output buffers.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import torch
from jax.custom_batching import custom_vmap
from jax.experimental import io_callback

from roundel.common import buffers

__all__ = ["SUPPORTED_DTYPES", "check_dtype", "is_traced", "run", "to_buffer", "to_jax"]

SUPPORTED_DTYPES = tuple(np.dtype(d) for d in (jnp.uint8, jnp.int8, jnp.int16, jnp.int32, jnp.int64, jnp.float16,
                                                jnp.bfloat16, jnp.float32, jnp.float64, jnp.bool_))


def check_dtype(array, what: str) -> None:
    """TypeError naming the supported dtypes when ``array``'s dtype is not one of them."""
    if np.dtype(array.dtype) not in SUPPORTED_DTYPES:
        names = ", ".join(d.name for d in SUPPORTED_DTYPES)
        raise TypeError(f"{what}: dtype {np.dtype(array.dtype).name} is not supported; use one of {names}")


def is_traced(arrays) -> bool:
    """True when any of ``arrays`` is a JAX tracer (inside jit, vmap, grad ...)."""
    return any(isinstance(a, jax.core.Tracer) for a in arrays)


def to_buffer(array) -> torch.Tensor:
    """The engine's CPU buffer for ``array``: shared through DLPack with a CPU jax.Array, else via NumPy."""
    if isinstance(array, jax.Array) and array.is_fully_addressable and \
            all(d.platform == "cpu" for d in array.devices()):
        return torch.from_dlpack(array)
    return buffers.from_numpy(np.asarray(array))


def to_jax(buffer: torch.Tensor) -> jax.Array:
    """A jax.Array holding an engine result (shared through DLPack; JAX copies an unaligned buffer)."""
    return jax.dlpack.from_dlpack(buffer.contiguous())


def _refuse_vmap(axis_size, in_batched, *args):
    raise ValueError("roundel collectives cannot run under jax.vmap (nor transforms built on it, such as "
                     "jax.jacfwd/jacrev or vmap of a jitted function): each rank would submit one collective per "
                     "batch element. Call the collective on the whole batched array instead, outside vmap")


def run(host, arrays: list, result_specs) -> list:
    """``host(arrays)`` -> list of engine buffers, as jax.Arrays: called now for concrete arrays, else staged
    as an ordered callback (which hands XLA NumPy views of the buffers).

    ``result_specs`` (a list of ``jax.ShapeDtypeStruct``, or a function of the
    arrays returning it) is only used when staging. Before running eagerly,
    this waits for the callbacks of compiled code already dispatched, so eager
    and compiled collectives reach the engine in program order.
    """
    if not is_traced(arrays):
        jax.effects_barrier()
        return [to_jax(b) for b in host(list(arrays))]
    specs = result_specs(arrays) if callable(result_specs) else result_specs

    def host_numpy(xs):
        return [buffers.to_numpy(b, bfloat16=ml_dtypes.bfloat16) for b in host(xs)]

    @custom_vmap
    def staged(xs):
        return io_callback(host_numpy, list(specs), xs, ordered=True)

    staged.def_vmap(_refuse_vmap)
    return list(staged(list(arrays)))
