"""What each Spark task of a ``roundel.spark`` job does: start its rank's process and watch it.

The driver's closure brings the job's :class:`TaskSpec` (store address,
secret, the pickled function, environment). The task works out its
identity from the barrier stage's placement (:mod:`roundel.spark.placement`),
tells the driver it started, starts ``python -m roundel.spark.exec_fn`` with
the identity and the store in its environment (as ``roundelrun`` would),
sends it the function on stdin, relays its output to the driver
(:mod:`roundel.spark.output`), and returns its outcome (a
:class:`~roundel.runner.outcome.RankOutcome`) through Spark.

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
from typing import Any, Iterator

import cloudpickle

from roundel.rendezvous.identity import LAUNCHER_PID, Identity, rendezvous_env
from roundel.rendezvous.store import RendezvousClient
from roundel.runner.outcome import RankOutcome
from roundel.spark import abort, placement
from roundel.spark.output import Sender

__all__ = ["RESULT_FD", "TaskSpec", "call_payload", "read_all", "run_task", "started_key", "stop_group"]

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


def call_payload(payload: bytes) -> Any:
    """Call the function a :class:`TaskSpec`'s ``payload`` holds, with its arguments; return its value."""
    fn, args, kwargs = cloudpickle.loads(payload)
    return fn(*args, **kwargs)


def run_task(spec: TaskSpec, _partition) -> Iterator[RankOutcome]:
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


def process_env(spec: TaskSpec, *extra: dict) -> dict[str, str]:
    """The environment of a process this task starts: the task's, ``spec.env``, then ``extra``."""
    env = dict(os.environ)
    env.update(spec.env)
    for more in extra:
        env.update(more)
    env["PYTHONUNBUFFERED"] = "1"
    env[LAUNCHER_PID] = str(os.getpid())  # the process dies with this task
    return env


class RankProcess:
    """``python -m module`` started by a task with the pickled function on its stdin, its output relayed
    to the driver under ``label`` (the last 20 lines of stderr kept in ``tail``), and what it writes to the
    result pipe collected. Raises OSError when it cannot be started."""

    def __init__(self, python: str, module: str, env: dict, payload: bytes, client: RendezvousClient, label: str):
        read_fd, write_fd = os.pipe()
        try:
            self.process = subprocess.Popen(
                [python, "-m", module], env={**env, RESULT_FD: str(write_fd)}, stdin=subprocess.PIPE,
                stdout=subprocess.PIPE, stderr=subprocess.PIPE, pass_fds=(write_fd,), start_new_session=True)
        except OSError:
            os.close(read_fd)
            raise
        finally:
            os.close(write_fd)
        self._result: list[bytes] = []
        self._reader = threading.Thread(target=read_all, args=(read_fd, self._result), name="roundel-spark-result",
                                        daemon=True)
        self._reader.start()
        self.tail: collections.deque = collections.deque(maxlen=20)
        self._sender = Sender(client, label, self.tail)
        self._sender.relay(self.process.stdout, "stdout")
        self._sender.relay(self.process.stderr, "stderr")
        try:
            self.process.stdin.write(payload)
            self.process.stdin.close()
        except OSError:
            pass  # it died before reading; its exit status and stderr say why

    def result(self) -> bytes:
        """Once the process has ended: what it wrote to the result pipe (after its output is relayed)."""
        self._reader.join(_DRAIN_S)
        self._sender.join(_DRAIN_S)
        return self._result[0] if self._result else b""

    def last_stderr(self) -> str:
        return b"".join(self.tail).decode(errors="replace").rstrip()


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


def _run_rank(spec: TaskSpec, identity: Identity, client: RendezvousClient) -> RankOutcome:
    rank = identity.rank
    python = spec.executable or sys.executable
    env = process_env(spec, identity.to_env(), rendezvous_env(spec.host, spec.port, spec.secret_hex))
    try:
        child = RankProcess(python, "roundel.spark.exec_fn", env, spec.payload, client, str(rank))
    except OSError as exc:
        return _failed(client, RankOutcome.died(rank, f"rank {rank} could not start {python}: {exc}"))
    process = child.process
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
    try:
        outcome = RankOutcome.decode(child.result())
    except ValueError:
        outcome = None  # it wrote nothing (or not all of it) before it ended
    if outcome is not None:
        return outcome if outcome.ok else _failed(client, outcome)
    if stopped:
        who = client.get(abort.ABORT_KEY).decode()
        return RankOutcome.died(rank, f"rank {rank} was stopped because rank {who} failed")
    last = child.last_stderr()
    return _failed(client, RankOutcome.died(
        rank, f"rank {rank}'s process {_exit_text(process.returncode)} before returning a result" +
        (f"; the last lines of its stderr:\n{last}" if last else "")))


def _exit_text(code: int) -> str:
    if code < 0:
        try:
            return f"was killed by {signal.Signals(-code).name}"
        except ValueError:
            return f"was killed by signal {-code}"
    return f"exited with code {code}"


def _failed(client: RendezvousClient, outcome: RankOutcome) -> RankOutcome:
    """Record the failure of ``outcome``'s rank (the first one recorded stops the others) and return it."""
    abort.record_failure(client, outcome.rank)
    return outcome
