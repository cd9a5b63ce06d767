"""Gradient compression for JAX arrays: cast floating-point arrays for the wire and back."""

from __future__ import annotations

import jax.numpy as jnp

from roundel.common.compression import Compressor, NoneCompressor, cast_compressor

__all__ = ["BF16Compressor", "Compression", "Compressor", "FP16Compressor", "NoneCompressor"]


def _cast(array, dtype):
    return array.astype(dtype)


def _is_floating(array) -> bool:
    return jnp.issubdtype(array.dtype, jnp.floating)


FP16Compressor = cast_compressor(jnp.float16, _is_floating, _cast, "Sends floating-point arrays as float16.")
BF16Compressor = cast_compressor(jnp.bfloat16, _is_floating, _cast,
                                 "Sends floating-point arrays as bfloat16 (wider range than fp16).")


class Compression:
    """The available compressors: ``none``, ``fp16`` and ``bf16``."""

    none = NoneCompressor
    fp16 = FP16Compressor
    bf16 = BF16Compressor
