"""Gradient compression for MXNet: NDArrays cast before the allreduce and cast back after."""

from __future__ import annotations


class Compressor:
    """Interface: ``compress`` returns (tensor, context); ``decompress`` undoes it."""

    @staticmethod
    def compress(tensor):
        raise NotImplementedError

    @staticmethod
    def decompress(tensor, ctx):
        raise NotImplementedError


class NoneCompressor(Compressor):
    """Sends NDArrays as they are."""

    @staticmethod
    def compress(tensor):
        return tensor, None

    @staticmethod
    def decompress(tensor, ctx):
        return tensor


class FP16Compressor(Compressor):
    """Sends floating-point NDArrays as float16; the context is the original dtype."""

    @staticmethod
    def compress(tensor):
        if "float" in str(tensor.dtype):
            return tensor.astype("float16", copy=False), tensor.dtype
        return tensor, tensor.dtype

    @staticmethod
    def decompress(tensor, ctx):
        if "float" in str(ctx):
            return tensor.astype(ctx, copy=False)
        return tensor


class Compression:
    """The available compressors: ``none`` (the default) and ``fp16``."""

    none = NoneCompressor
    fp16 = FP16Compressor
