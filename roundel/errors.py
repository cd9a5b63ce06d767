"""Exception types raised by roundel, under the names Horovod scripts catch.

An uncaught one prints a single line per rank (see :mod:`roundel.excepthook`).
"""

from roundel.excepthook import install_short_tracebacks


class RoundelError(Exception):
    """Base class of every error roundel raises on purpose."""


class SettingsError(RoundelError, ValueError):
    """A setting (environment variable or launcher flag) has a value roundel cannot use."""


class NotInitializedError(RoundelError, ValueError):
    """An operation was called before ``init()`` (or after ``shutdown()``)."""

    def __init__(self, what: str = "this operation"):
        super().__init__(
            f"roundel has not been initialized; call hvd.init() before {what}."
        )


class RoundelInternalError(RoundelError, RuntimeError):
    """The job's communication failed: a peer died, left, or the transport broke.

    Elastic training catches this to roll back and re-form the job. Also
    importable as ``HorovodInternalError``.
    """


class CollectiveMismatchError(RoundelError, RuntimeError, ValueError):
    """Ranks submitted incompatible requests under one name (shape, dtype, op, root...).

    A ``RuntimeError`` as Horovod raises collective errors (and still a
    ``ValueError`` for older callers). Only the failed collective is affected:
    the job stays usable and the next collective works.
    """


class CollectiveDeadlockError(CollectiveMismatchError):
    """Every rank is blocked in roundel on collectives that can never complete.

    The ranks called different collectives (or in a different order); the
    message names what each rank waits for. The waited collectives fail on
    every rank; the job stays usable.
    """


class HostsUpdatedInterrupt(RoundelError):
    """Raised at ``commit()``/``check_host_updates()`` when hosts were added or removed."""

    def __init__(self, skip_sync: bool = False):
        super().__init__("the set of hosts changed")
        self.skip_sync = skip_sync


HorovodInternalError = RoundelInternalError

install_short_tracebacks(RoundelError)
