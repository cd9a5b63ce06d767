"""Horovod's TensorFlow error types for failed collectives.

Horovod's TF ops raise ``tf.errors.FailedPreconditionError`` when ranks
submitted incompatible tensors under one name (shape, dtype, root rank) and
``tf.errors.InvalidArgumentError`` for bad ``alltoall`` splits. Eagerly,
roundel raises the classes below, which are also roundel's
``CollectiveMismatchError`` so code catching either keeps working. Inside a
``tf.function`` TensorFlow turns every Python error of a ``numpy_function``
into a code of its own choosing: a mismatch there surfaces as
``tf.errors.InvalidArgumentError``.
"""

from __future__ import annotations

import tensorflow as tf

from roundel.errors import CollectiveDeadlockError, CollectiveMismatchError


class MismatchPreconditionError(tf.errors.FailedPreconditionError, CollectiveMismatchError):
    """Ranks disagreed on a collective (Horovod raises ``FailedPreconditionError``)."""

    def __init__(self, message: str):
        tf.errors.FailedPreconditionError.__init__(self, None, None, message)


class MismatchInvalidArgumentError(tf.errors.InvalidArgumentError, CollectiveMismatchError):
    """A collective's arguments were invalid, e.g. alltoall splits (Horovod raises ``InvalidArgumentError``)."""

    def __init__(self, message: str):
        tf.errors.InvalidArgumentError.__init__(self, None, None, message)


def _is_invalid_argument(kind: str, message: str) -> bool:
    return kind == "alltoall" and "splits" in message


def translate(kind: str, error: CollectiveMismatchError) -> Exception:
    """The TensorFlow error to raise for ``error`` from a ``kind`` collective (deadlocks are left as they are)."""
    if isinstance(error, CollectiveDeadlockError):
        return error
    message = str(error)
    if _is_invalid_argument(kind, message):
        return MismatchInvalidArgumentError(message)
    return MismatchPreconditionError(message)
