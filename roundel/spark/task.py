"""What each Spark task of a ``roundel.spark`` job does: start its rank's process and watch it.

The driver's closure brings the job's :class:`TaskSpec` (store address,
secret, the pickled function, environment). The task works out its
identity from the barrier stage's placement (:mod:`roundel.spark.placement`),
tells the driver it started, starts ``python -m roundel.spark.exec_fn`` with
the identity and the store in its environment (as ``roundelrun`` would),
sends it the function on stdin, relays its output to the driver
(:mod:`roundel.spark.output`), and returns its outcome through Spark.

When a rank fails, the first failure is recorded (:mod:`roundel.spark.abort`);
every other task sees it and stops its rank's process group (SIGTERM, then
SIGKILL), so no rank is left waiting for a dead peer.
"""

from __future__ import annotations

import collections
import dataclasses
import os
import signal
import subprocess
import sys
import threading
import time
from typing import Iterator

from roundel.rendezvous.identity import LAUNCHER_PID, Identity, rendezvous_env
from roundel.rendezvous.store import RendezvousClient
from roundel.spark import abort, placement
from roundel.spark.output import Sender

__all__ = ["RESULT_FD", "TaskOutcome", "TaskSpec", "read_all", "run_task", "started_key", "stop_group"]

RESULT_FD = "ROUNDEL_SPARK_RESULT_FD"
"""Names the file descriptor on which the rank's process writes its outcome."""

_WATCH_S = 0.2
_GRACE_S = 5.0
_DRAIN_S = 10.0


def started_key(index: int) -> str:
    """Set by the task of partition ``index`` once it runs."""
    return f"spark/started/{index}"


@dataclasses.dataclass(frozen=True)
class TaskSpec:
    """What the driver sends every task (through Spark's closure)."""

    host: str
    port: int
    secret_hex: str
    payload: bytes  # cloudpickle of (fn, args, kwargs)
    env: dict[str, str]
    executable: str | None  # None: the Python the Spark task runs


@dataclasses.dataclass(frozen=True)
class TaskOutcome:
    """One rank's end: its result (pickled), or why it failed or was stopped."""

    rank: int
    ok: bool
    data: bytes  # pickled result when ok, else the traceback's (or the reason's) UTF-8 text


def run_task(spec: TaskSpec, _partition) -> Iterator[TaskOutcome]:
    """The barrier stage's partition function: run one rank and yield its outcome."""
    from pyspark import BarrierTaskContext

    context = BarrierTaskContext.get()
    index = context.partitionId()
    identity = placement.identities([info.address for info in context.getTaskInfos()])[index]
    client = RendezvousClient(spec.host, spec.port, bytes.fromhex(spec.secret_hex))
    try:
        client.set(started_key(index), str(identity.rank).encode())
        yield _run_rank(spec, identity, client)
    finally:
        client.close()


def _child_env(spec: TaskSpec, identity: Identity, result_fd: int) -> dict[str, str]:
    env = dict(os.environ)
    env.update(spec.env)
    env.update(identity.to_env())
    env.update(rendezvous_env(spec.host, spec.port, spec.secret_hex))
    env["PYTHONUNBUFFERED"] = "1"
    env[LAUNCHER_PID] = str(os.getpid())  # the rank's process dies with this task's
    env[RESULT_FD] = str(result_fd)
    return env


def stop_group(process: subprocess.Popen) -> None:
    """SIGTERM the process's group, then SIGKILL it after a grace period."""
    for signum in (signal.SIGTERM, signal.SIGCONT):
        try:
            os.killpg(process.pid, signum)
        except (ProcessLookupError, PermissionError):
            pass
    try:
        process.wait(_GRACE_S)
    except subprocess.TimeoutExpired:
        pass
    try:
        os.killpg(process.pid, signal.SIGKILL)
    except (ProcessLookupError, PermissionError):
        pass
    process.wait()


def read_all(fd: int, into: list[bytes]) -> None:
    """Append everything read from ``fd`` (until it closes) to ``into``."""
    with os.fdopen(fd, "rb") as pipe:
        into.append(pipe.read())


def _run_rank(spec: TaskSpec, identity: Identity, client: RendezvousClient) -> TaskOutcome:
    rank = identity.rank
    read_fd, write_fd = os.pipe()
    try:
        process = subprocess.Popen(
            [spec.executable or sys.executable, "-m", "roundel.spark.exec_fn"],
            env=_child_env(spec, identity, write_fd), stdin=subprocess.PIPE, stdout=subprocess.PIPE,
            stderr=subprocess.PIPE, pass_fds=(write_fd,), start_new_session=True)
    except OSError as exc:
        os.close(read_fd)
        return _failed(client, rank, f"rank {rank} could not start {spec.executable or sys.executable}: {exc}")
    finally:
        os.close(write_fd)
    result: list[bytes] = []
    reader = threading.Thread(target=read_all, args=(read_fd, result), name="roundel-spark-result", daemon=True)
    reader.start()
    tail: collections.deque = collections.deque(maxlen=20)
    sender = Sender(client, str(rank), tail)
    sender.relay(process.stdout, "stdout")
    sender.relay(process.stderr, "stderr")
    try:
        process.stdin.write(spec.payload)
        process.stdin.close()
    except OSError:
        pass  # it died before reading; its exit status and stderr say why
    stopped = False
    try:
        while process.poll() is None:
            if client.check([abort.ABORT_KEY]) and int(client.get(abort.ABORT_KEY)) != rank:
                stopped = True  # another rank failed (this one's own failure lets it finish reporting)
                stop_group(process)
                break
            time.sleep(_WATCH_S)
    except BaseException:  # the driver is gone, or Spark interrupts this task: take the rank down with it
        stop_group(process)
        raise
    reader.join(_DRAIN_S)
    sender.join(_DRAIN_S)
    data = result[0] if result else b""
    if data[:1] == b"1":
        return TaskOutcome(rank, True, data[1:])
    if data[:1] == b"0":
        return _failed(client, rank, data[1:].decode(errors="replace"))
    if stopped:
        who = client.get(abort.ABORT_KEY).decode()
        return TaskOutcome(rank, False, f"rank {rank} was stopped because rank {who} failed".encode())
    last = b"".join(tail).decode(errors="replace").rstrip()
    return _failed(client, rank, f"rank {rank}'s process {_exit_text(process.returncode)} before returning a "
                                 f"result" + (f"; the last lines of its stderr:\n{last}" if last else ""))


def _exit_text(code: int) -> str:
    if code < 0:
        try:
            return f"was killed by {signal.Signals(-code).name}"
        except ValueError:
            return f"was killed by signal {-code}"
    return f"exited with code {code}"


def _failed(client: RendezvousClient, rank: int, text: str) -> TaskOutcome:
    """Record this rank's failure (the first one recorded stops the others) and return it."""
    abort.record_failure(client, rank)
    return TaskOutcome(rank, False, text.encode())
