"""Gradient compression, framework-neutral: the compressor interface and the cast to a narrower float.

Each adapter's ``Compression`` (``none``, ``fp16``, and ``bf16`` where the
framework has it) is built from these with its own dtype test and cast.
"""

from __future__ import annotations

from typing import Callable


class Compressor:
    """Interface: ``compress`` returns (tensor, context); ``decompress`` undoes it.

    A compressor defined by those two alone works element by element, so an
    optimizer may apply it to a bucket's flat buffer of gradients. One that
    needs more (PowerSGD: a bucket's gradients one by one, two rounds of
    allreduce, state kept from step to step) says so with the members below;
    their defaults describe a stateless element-wise compressor. The torch
    ``DistributedOptimizer`` uses them all; the other adapters use
    ``compress`` and ``decompress``.
    """

    reduce_ops: frozenset | None = None  # the reduction operators it works with; None: every one
    stateful = False  # keeps state from step to step: pass an instance, one per optimizer
    reduces_buckets = False  # reduces a bucket's gradients itself, with ``reduce_bucket``

    @staticmethod
    def compress(tensor):
        raise NotImplementedError

    @staticmethod
    def decompress(tensor, ctx):
        raise NotImplementedError

    def reduce_bucket(self, key: str, names: list, grads: list, allreduce: Callable) -> Callable[[], list]:
        """Start reducing a bucket's dense gradients ``grads`` (named ``names``; ``key``: the bucket's name);
        return a function that waits and returns the reduced gradients, one per input (any shape, the same
        number of elements). ``allreduce(tensor, name)`` starts an in-place allreduce with the optimizer's
        operator and scaling and returns its handle. Only called when ``reduces_buckets`` is true."""
        raise NotImplementedError(f"{type(self).__name__} does not reduce buckets itself (reduces_buckets is "
                                  "false); apply compress() and decompress() instead")

    @staticmethod
    def end_step() -> None:
        """Called by the optimizer once per step, after every reduction of the step finished."""

    @staticmethod
    def reset() -> None:
        """Forget what was kept from earlier steps, as on a rank that just joined; the optimizer calls it on
        every rank after an elastic reset, so that survivors and new ranks compress alike."""


def as_compressor(compression):
    """``compression`` with the whole ``Compressor`` interface: itself when it is a ``Compressor`` (class or
    instance), else a ``Compressor`` class that calls the ``compress`` and ``decompress`` of an object that has
    them (as Horovod accepts).

    Raises TypeError for anything else, and ValueError for the class of a stateful compressor (it needs an
    instance of its own).
    """
    if isinstance(compression, type) and issubclass(compression, Compressor):
        if compression.stateful:
            raise ValueError(f"compression={compression.__name__} keeps state from step to step and needs an "
                             f"instance, one per optimizer: e.g. compression={compression.__name__}()")
        return compression
    if isinstance(compression, Compressor):
        return compression
    if callable(getattr(compression, "compress", None)) and callable(getattr(compression, "decompress", None)):
        return type(type(compression).__name__, (Compressor,), {
            "__doc__": f"{compression!r} with the rest of the Compressor interface (a stateless element-wise one)",
            "compress": staticmethod(compression.compress), "decompress": staticmethod(compression.decompress)})
    raise TypeError(f"compression={compression!r} is not a compressor (it needs compress() and decompress()); "
                    "use hvd.Compression.none, fp16 or bf16")


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
