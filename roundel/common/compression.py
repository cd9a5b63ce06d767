"""Gradient compression, framework-neutral: the compressor interface and the cast to a narrower float.

Each adapter's ``Compression`` (``none``, ``fp16``, and ``bf16`` where the
framework has it) is built from these with its own dtype test and cast.
"""

from __future__ import annotations

from typing import Callable


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


def cast_compressor(wire_dtype, is_floating: Callable[[object], bool], cast: Callable[[object, object], object],
                    doc: str) -> type:
    """A compressor that sends floating-point tensors (``is_floating(tensor)``) as ``wire_dtype``, cast with
    ``cast(tensor, dtype)``, and casts the result back to the tensor's own dtype."""

    class CastCompressor(Compressor):
        __doc__ = doc

        @staticmethod
        def compress(tensor):
            if is_floating(tensor) and tensor.dtype != wire_dtype:
                return cast(tensor, wire_dtype), tensor.dtype
            return tensor, None

        @staticmethod
        def decompress(tensor, ctx):
            return tensor if ctx is None else cast(tensor, ctx)

    return CastCompressor
