"""Horovod's TensorFlow error types for failed collectives, eagerly and in graphs.

Horovod's TF ops raise ``tf.errors.FailedPreconditionError`` when ranks
submitted incompatible tensors under one name (shape, dtype, root rank) and
``tf.errors.InvalidArgumentError`` for bad ``alltoall`` splits. roundel
raises the classes below, which are also roundel's ``CollectiveMismatchError``
so code catching either keeps working.

Eagerly they are raised as they are. In a graph (``tf.function`` or a
``tf.compat.v1`` graph run by a ``Session``) a collective is a Python op, and
TensorFlow reports every Python error of such an op with a code of its own:
``InvalidArgumentError`` for a ``ValueError`` (which serves for bad splits),
``UnknownError`` for anything else. So inside a graph a mismatch is raised as
:class:`GraphMismatch`, whose message carries a token, and
:func:`install_graph_errors` (called when ``roundel.tfops.mpi_ops`` is imported)
makes ``tf.errors.UnknownError`` build, for a message carrying such a token,
a :class:`MismatchPreconditionError` with the original message instead. That
is the class TensorFlow raises at the Python boundary of the graph
(``Session.run``, the ``tf.function`` call): the user catches
``tf.errors.FailedPreconditionError``, as with Horovod. Every other
``UnknownError`` is built as before.
"""

from __future__ import annotations

import itertools
import re
import threading

import tensorflow as tf

from roundel.common.elastic import raising_internal_errors
from roundel.errors import CollectiveDeadlockError, CollectiveMismatchError, RoundelError


def _opargs(args) -> tuple:
    """``(node_def, op, message, *rest)`` from either ``(message,)`` or OpError's own arguments."""
    if len(args) == 1:
        return None, None, args[0]
    return tuple(args)


class MismatchPreconditionError(tf.errors.FailedPreconditionError, CollectiveMismatchError):
    """Ranks disagreed on a collective (Horovod raises ``FailedPreconditionError``).

    Built from a message alone, or from ``(node_def, op, message)`` as TensorFlow's own errors
    (TensorFlow re-creates errors that way at a ``Session`` boundary).
    """

    def __init__(self, *args):
        tf.errors.FailedPreconditionError.__init__(self, *_opargs(args))


class MismatchInvalidArgumentError(tf.errors.InvalidArgumentError, CollectiveMismatchError):
    """A collective's arguments were invalid, e.g. alltoall splits (Horovod raises ``InvalidArgumentError``)."""

    def __init__(self, *args):
        tf.errors.InvalidArgumentError.__init__(self, *_opargs(args))


def _is_invalid_argument(kind: str, message: str) -> bool:
    return kind == "alltoall" and "splits" in message


def translate(kind: str, error: CollectiveMismatchError) -> Exception:
    """The TensorFlow error to raise eagerly for ``error`` from a ``kind`` collective (deadlocks are left as they are)."""
    if isinstance(error, CollectiveDeadlockError):
        return error
    message = str(error)
    if _is_invalid_argument(kind, message):
        return MismatchInvalidArgumentError(message)
    return MismatchPreconditionError(message)


# ------------------------------------------------------------------ inside graphs
_TOKEN = re.compile(r"\[roundel mismatch #(\d+)\]")
_KEEP = 256  # messages remembered for the boundary (the newest; a raised error is turned at once)
_messages: dict[int, str] = {}
_counter = itertools.count(1)
_lock = threading.Lock()


class GraphMismatch(RoundelError, RuntimeError):
    """A mismatch raised inside a graph op; the user gets ``FailedPreconditionError`` (see the module notes).

    Not a ``ValueError`` (as ``CollectiveMismatchError`` is): TensorFlow would report that as InvalidArgumentError.
    """

    def __init__(self, message: str):
        with _lock:
            token = next(_counter)
            _messages[token] = message
            for old in [t for t in _messages if t <= token - _KEEP]:
                del _messages[old]
        super().__init__(f"[roundel mismatch #{token}] {message}")


def graph_error(kind: str, error: CollectiveMismatchError) -> Exception:
    """What a graph op raises for ``error``: a ``ValueError`` (InvalidArgument) for bad splits, else :class:`GraphMismatch`."""
    if isinstance(error, CollectiveDeadlockError) or _is_invalid_argument(kind, str(error)):
        return error  # a ValueError: TensorFlow's InvalidArgumentError
    return GraphMismatch(str(error))


class GraphPreconditionError(MismatchPreconditionError, tf.errors.UnknownError):
    """A mismatch inside a graph, as TensorFlow raises it at the graph's boundary: a ``FailedPreconditionError``.

    TensorFlow builds it where it would build the ``UnknownError`` of a failed
    Python op (hence that base too; its ``error_code`` is FAILED_PRECONDITION),
    and its message is the mismatch's own.
    """

    def __init__(self, *args):
        node_def, op, message, *rest = _opargs(args)
        found = _TOKEN.search(message) if isinstance(message, str) else None
        if found:
            message = _messages.get(int(found.group(1)), _TOKEN.sub("", message).strip())
        # OpError's own: FailedPreconditionError's would reach UnknownError's next in this class's MRO.
        tf.errors.OpError.__init__(self, node_def, op, message, tf.errors.FAILED_PRECONDITION, *rest)


_installed = False


def install_graph_errors() -> None:
    """Make TensorFlow build a :class:`GraphPreconditionError` where it builds the ``UnknownError`` of a roundel mismatch.

    Only an ``UnknownError`` whose message carries :class:`GraphMismatch`'s
    token is affected. Idempotent.
    """
    global _installed
    if _installed:
        return
    unknown = tf.errors.UnknownError
    previous = unknown.__new__

    def __new__(cls, *args, **kwargs):
        if cls is unknown:
            message = args[2] if len(args) > 2 else kwargs.get("message")
            if isinstance(message, str) and _TOKEN.search(message):
                cls = GraphPreconditionError  # an UnknownError too: Python goes on to its __init__
        if previous is BaseException.__new__:
            return previous(cls, *args)
        return previous(cls, *args, **kwargs)

    unknown.__new__ = staticmethod(__new__)
    _installed = True


def internal_errors_raised(func):
    """``func`` with a roundel internal error that a collective inside a graph reported as a
    ``tf.errors.OpError`` raised as RoundelInternalError again, for elastic ``run`` to roll back."""
    return raising_internal_errors(func, tf.errors.OpError, lambda exc: exc.message)
