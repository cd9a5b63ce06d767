"""Gradient compression for JAX arrays: cast floating-point arrays for the wire and back."""

from __future__ import annotations

import jax.numpy as jnp


class Compressor:
    """Interface: ``compress`` returns (array, context); ``decompress`` undoes it."""

    @staticmethod
    def compress(tensor):
        raise NotImplementedError

    @staticmethod
    def decompress(tensor, ctx):
        raise NotImplementedError


class NoneCompressor(Compressor):
    """Sends arrays as they are."""

    @staticmethod
    def compress(tensor):
        return tensor, None

    @staticmethod
    def decompress(tensor, ctx):
        return tensor


def _cast_compressor(wire_dtype, doc: str):
    class _Cast(Compressor):
        __doc__ = doc

        @staticmethod
        def compress(tensor):
            if jnp.issubdtype(tensor.dtype, jnp.floating) and tensor.dtype != wire_dtype:
                return tensor.astype(wire_dtype), tensor.dtype
            return tensor, None

        @staticmethod
        def decompress(tensor, ctx):
            return tensor if ctx is None else tensor.astype(ctx)

    return _Cast


FP16Compressor = _cast_compressor(jnp.float16, "Sends floating-point arrays as float16.")
BF16Compressor = _cast_compressor(jnp.bfloat16, "Sends floating-point arrays as bfloat16 (wider range than fp16).")


class Compression:
    """The available compressors: ``none``, ``fp16`` and ``bf16``."""

    none = NoneCompressor
    fp16 = FP16Compressor
    bf16 = BF16Compressor
