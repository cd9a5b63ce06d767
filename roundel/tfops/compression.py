"""Gradient compression for TensorFlow tensors: cast floating-point tensors for the wire and back."""

from __future__ import annotations

import tensorflow as tf

from roundel.common.compression import Compressor, NoneCompressor, cast_compressor

__all__ = ["BF16Compressor", "Compression", "Compressor", "FP16Compressor", "NoneCompressor"]


def _is_floating(tensor) -> bool:
    return tensor.dtype.is_floating


FP16Compressor = cast_compressor(tf.float16, _is_floating, tf.cast, "Sends floating-point tensors as float16.")
BF16Compressor = cast_compressor(tf.bfloat16, _is_floating, tf.cast,
                                 "Sends floating-point tensors as bfloat16 (wider range than fp16).")


class Compression:
    """The available compressors: ``none``, ``fp16`` and ``bf16``."""

    none = NoneCompressor
    fp16 = FP16Compressor
    bf16 = BF16Compressor
