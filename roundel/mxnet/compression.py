"""Gradient compression for MXNet: NDArrays cast before the allreduce and cast back after."""

from __future__ import annotations

import numpy as np

from roundel.common.compression import Compressor, NoneCompressor, cast_compressor

__all__ = ["Compression", "Compressor", "FP16Compressor", "NoneCompressor"]


def _cast(array, dtype):
    return array.astype(dtype, copy=False)


def _is_floating(array) -> bool:
    return np.issubdtype(array.dtype, np.floating)


FP16Compressor = cast_compressor(np.float16, _is_floating, _cast, "Sends floating-point NDArrays as float16.")


class Compression:
    """The available compressors: ``none`` (the default) and ``fp16``."""

    none = NoneCompressor
    fp16 = FP16Compressor
