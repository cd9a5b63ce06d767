"""Gradient compression for TensorFlow tensors: cast floating-point tensors for the wire and back."""

from __future__ import annotations

import tensorflow as tf


class Compressor:
    """Interface: ``compress`` returns (tensor, context); ``decompress`` undoes it."""

    @staticmethod
    def compress(tensor):
        raise NotImplementedError

    @staticmethod
    def decompress(tensor, ctx):
        raise NotImplementedError


class NoneCompressor(Compressor):
    """Sends tensors as they are."""

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
            if tensor.dtype.is_floating and tensor.dtype != wire_dtype:
                return tf.cast(tensor, wire_dtype), tensor.dtype
            return tensor, None

        @staticmethod
        def decompress(tensor, ctx):
            return tensor if ctx is None else tf.cast(tensor, ctx)

    return _Cast


FP16Compressor = _cast_compressor(tf.float16, "Sends floating-point tensors as float16.")
BF16Compressor = _cast_compressor(tf.bfloat16, "Sends floating-point tensors as bfloat16 (wider range than fp16).")


class Compression:
    """The available compressors: ``none``, ``fp16`` and ``bf16``."""

    none = NoneCompressor
    fp16 = FP16Compressor
    bf16 = BF16Compressor
