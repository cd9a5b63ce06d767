"""Gradient compression applied before a tensor goes on the wire and undone after."""

from __future__ import annotations

import torch

from roundel.common.compression import Compressor, NoneCompressor, cast_compressor

__all__ = ["BF16Compressor", "Compression", "Compressor", "FP16Compressor", "NoneCompressor"]


def _cast(tensor, dtype):
    return tensor.to(dtype)


def _is_floating(tensor) -> bool:
    return tensor.dtype.is_floating_point


FP16Compressor = cast_compressor(torch.float16, _is_floating, _cast, "Sends floating-point tensors as float16.")
BF16Compressor = cast_compressor(torch.bfloat16, _is_floating, _cast,
                                 "Sends floating-point tensors as bfloat16 (wider range than fp16).")


class Compression:
    """The available compressors: ``none``, ``fp16`` and ``bf16``."""

    none = NoneCompressor
    fp16 = FP16Compressor
    bf16 = BF16Compressor
