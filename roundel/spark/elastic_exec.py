"""The process a Spark task starts for one elastic worker: ``python -m roundel.spark.elastic_exec``.

It reads the pickled ``(fn, args, kwargs)`` from its stdin, calls ``fn``
(which joins generations of the job through ``hvd.init()`` and
``hvd.elastic.run``, as under ``roundelrun``'s elastic mode), and writes the
outcome (a :class:`~roundel.runner.outcome.RankOutcome`'s bytes: REMOVED when
the driver left this worker out of the next generation) to the file
descriptor named by ``ROUNDEL_SPARK_RESULT_FD``. Unlike a static rank it records no abort: the elastic driver
decides what a failure means for the job.
"""

from __future__ import annotations

import os
import sys

from roundel.common import basics
from roundel.rendezvous import bootstrap, elastic_join
from roundel.runner.outcome import OutcomeKind, RankOutcome
from roundel.spark.task import RESULT_FD, call_payload


def _rank() -> int | None:
    return basics.rank() if basics.is_initialized() else None


def main() -> int:
    """Run the function sent on stdin; return the exit status (0 when it returned or was left out)."""
    bootstrap.follow_launcher(os.environ)  # stop when the Spark task that started this process dies
    payload = sys.stdin.buffer.read()
    with open(os.devnull, "rb") as null:
        os.dup2(null.fileno(), 0)
    result = os.fdopen(int(os.environ[RESULT_FD]), "wb")
    outcome = RankOutcome.of_call(call_payload, (payload,), rank_of=_rank, removed=elastic_join.WorkerRemoved)
    with result:
        result.write(outcome.encode())
    basics.shutdown()
    return 1 if outcome.kind is OutcomeKind.RAISED else 0


if __name__ == "__main__":
    sys.exit(main())
