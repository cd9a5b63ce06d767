"""The process a Spark task starts for its rank: ``python -m roundel.spark.exec_fn``.

It reads the pickled ``(fn, args, kwargs)`` from its stdin (sent by the task,
which got it through Spark's closure), calls ``fn``, and writes the pickled
outcome to the file descriptor named by ``ROUNDEL_SPARK_RESULT_FD``: a
:class:`~roundel.runner.outcome.RankOutcome`'s bytes. Its identity and the job's
rendezvous store are in its environment, as ``roundelrun`` would set them,
so ``hvd.init()`` inside ``fn`` joins the job. When ``fn`` fails, the
failure is recorded in the store (:mod:`roundel.spark.abort`) before the
process exits, so that its error, not a peer's "rank lost", is the job's.
"""

from __future__ import annotations

import os
import sys

from roundel.rendezvous import bootstrap, identity
from roundel.rendezvous.store import RendezvousClient
from roundel.runner.outcome import RankOutcome
from roundel.spark import abort
from roundel.spark.task import RESULT_FD, call_payload


def main() -> int:
    """Run the function sent on stdin; return the exit status (1 when it raised)."""
    bootstrap.follow_launcher(os.environ)  # stop when the Spark task that started this process dies
    payload = sys.stdin.buffer.read()
    with open(os.devnull, "rb") as null:
        os.dup2(null.fileno(), 0)
    result = os.fdopen(int(os.environ[RESULT_FD]), "wb")
    outcome = RankOutcome.of_call(call_payload, (payload,), rank_of=lambda: int(os.environ["ROUNDEL_RANK"]))
    if not outcome.ok:  # before this process exits and its peers see it gone: its error is the job's
        _record_failure()
    with result:
        result.write(outcome.encode())
    return 0 if outcome.ok else 1


def _record_failure() -> None:
    env = os.environ
    client = RendezvousClient(env[identity.RENDEZVOUS_ADDR], int(env[identity.RENDEZVOUS_PORT]),
                              bytes.fromhex(env[identity.SECRET]))
    try:
        abort.record_failure(client, int(env["ROUNDEL_RANK"]))
    except Exception:  # noqa: BLE001 - the task records it when the store cannot be reached from here
        pass
    finally:
        client.close()


if __name__ == "__main__":
    sys.exit(main())
