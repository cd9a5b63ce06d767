"""The process a Spark task starts for one elastic worker: ``python -m roundel.spark.elastic_exec``.

It reads the pickled ``(fn, args, kwargs)`` from its stdin, calls ``fn``
(which joins generations of the job through ``hvd.init()`` and
``hvd.elastic.run``, as under ``roundelrun``'s elastic mode), and writes the
pickled outcome to the file descriptor named by ``ROUNDEL_SPARK_RESULT_FD``:
``("ok", result, rank)``, ``("removed", reason)`` when the driver left this
worker out of the next generation, or ``("failed", traceback_text, rank,
internal)``. Unlike a static rank it records no abort: the elastic driver
decides what a failure means for the job.
"""

from __future__ import annotations

import os
import sys
import traceback

import cloudpickle

from roundel.common import basics
from roundel.errors import RoundelInternalError
from roundel.rendezvous import bootstrap, elastic_join
from roundel.spark.task import RESULT_FD


def _rank() -> int | None:
    return basics.rank() if basics.is_initialized() else None


def _outcome(payload: bytes) -> tuple[str, bytes]:
    """(kind, pickled outcome); an unpicklable function or result fails with its traceback too."""
    try:
        fn, args, kwargs = cloudpickle.loads(payload)
        value = fn(*args, **kwargs)
        return "ok", cloudpickle.dumps(("ok", value, _rank()))
    except elastic_join.WorkerRemoved as removed:
        return "removed", cloudpickle.dumps(("removed", removed.reason))
    except BaseException as exc:  # noqa: BLE001 - the driver gets every failure, with its traceback
        text = traceback.format_exc()
        return "failed", cloudpickle.dumps(("failed", text, _rank(), isinstance(exc, RoundelInternalError)))


def main() -> int:
    """Run the function sent on stdin; return the exit status (0 when it returned or was left out)."""
    bootstrap.follow_launcher(os.environ)  # stop when the Spark task that started this process dies
    payload = sys.stdin.buffer.read()
    with open(os.devnull, "rb") as null:
        os.dup2(null.fileno(), 0)
    result = os.fdopen(int(os.environ[RESULT_FD]), "wb")
    kind, outcome = _outcome(payload)
    with result:
        result.write(outcome)
    basics.shutdown()
    return 1 if kind == "failed" else 0


if __name__ == "__main__":
    sys.exit(main())
