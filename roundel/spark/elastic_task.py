"""What each Spark task of ``roundel.spark.run_elastic`` does: serve as one slot for elastic workers.

The task registers with the driver's store (its partition, attempt and
host), beats a counter there while it lives, and waits for the driver's
instructions: each ``start`` names a worker id and its environment (as the
elastic driver gives a worker it starts), and the task runs that worker as
``python -m roundel.spark.elastic_exec`` to its end, relaying its output
(:mod:`roundel.spark.output`), signalling it when the driver asks, and then
putting its outcome and exit status in the store. Workers on one task run
one after another. The task ends when the driver says the job is over or
cannot be reached, and takes its running worker down with it.

Store keys (all under ``spark/elastic/``) are named by the functions below;
a task is ``<partition>.<attempt>``, so a task Spark runs again is a new one.
"""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import threading
import time
from typing import Iterator

from roundel.rendezvous.store import RendezvousClient, RendezvousError, RendezvousTimeout
from roundel.spark import task

__all__ = ["BEAT_S", "DONE_KEY", "beat_key", "exit_key", "gone_key", "kill_key", "outcome_key", "register_key",
           "serve_slot", "start_key", "task_id"]

BEAT_S = 0.5
"""How often a task bumps its beat counter."""

DONE_KEY = "spark/elastic/done"
"""Set by the driver when the job is over: every task stops."""

_WATCH_S = 0.2
_WAIT_START_S = 0.5


def task_id(partition: int, attempt: int) -> str:
    return f"{partition}.{attempt}"


def register_key(partition: int) -> str:
    """JSON ``{"attempt": n, "host": name}`` of the partition's latest task."""
    return f"spark/elastic/task/{partition}"


def beat_key(task: str) -> str:
    return f"spark/elastic/beat/{task}"


def gone_key(task: str) -> str:
    """Set when the task has stopped serving."""
    return f"spark/elastic/gone/{task}"


def start_key(task: str, n: int) -> str:
    """The driver's ``n``-th start instruction to ``task``: JSON ``{"worker": id, "env": {...}}``."""
    return f"spark/elastic/start/{task}/{n}"


def kill_key(worker: str) -> str:
    """The signal number the driver wants sent to ``worker`` (SIGTERM or SIGKILL)."""
    return f"spark/elastic/kill/{worker}"


def outcome_key(worker: str) -> str:
    """The pickled outcome ``roundel.spark.elastic_exec`` wrote for ``worker``."""
    return f"spark/elastic/outcome/{worker}"


def exit_key(worker: str) -> str:
    """JSON ``{"code": status, "stderr": last lines}`` once ``worker`` has ended (set after its outcome)."""
    return f"spark/elastic/exit/{worker}"


def _now(client: RendezvousClient, key: str) -> bytes | None:
    return client.get(key) if client.check([key]) else None


def serve_slot(spec: task.TaskSpec, _partition) -> Iterator[str]:
    """The stage's partition function: serve elastic workers until the job ends; yield this task's id."""
    from pyspark import TaskContext

    context = TaskContext.get()
    me = task_id(context.partitionId(), context.attemptNumber())
    try:
        client = RendezvousClient(spec.host, spec.port, bytes.fromhex(spec.secret_hex))
    except RendezvousError:
        return  # the driver is gone already
    lost = threading.Event()
    beating = threading.Thread(target=_beat, args=(client, me, lost), name="roundel-spark-beat", daemon=True)
    try:
        client.set(register_key(context.partitionId()),
                   json.dumps({"attempt": context.attemptNumber(), "host": socket.gethostname()}).encode())
        beating.start()
        starts = 0
        while not lost.is_set() and not client.check([DONE_KEY]):
            try:
                raw = client.get(start_key(me, starts), timeout=_WAIT_START_S)
            except RendezvousTimeout:
                continue
            starts += 1
            _run_worker(spec, client, json.loads(raw))
        client.set(gone_key(me), b"1")
    except RendezvousError:
        pass  # the driver is gone: nothing is left to serve
    finally:
        lost.set()
        client.close()
    yield me


def _beat(client: RendezvousClient, me: str, lost: threading.Event) -> None:
    while not lost.wait(BEAT_S):
        try:
            client.add(beat_key(me), 1)
        except RendezvousError:
            lost.set()


def _run_worker(spec: task.TaskSpec, client: RendezvousClient, start: dict) -> None:
    """Run one worker to its end and report it; raise RendezvousError (after stopping it) when the
    driver is gone."""
    worker = start["worker"]
    if client.check([kill_key(worker)]):  # stopped before it started
        client.set(exit_key(worker), json.dumps({"code": -signal.SIGKILL, "stderr": ""}).encode())
        return
    python = spec.executable or sys.executable
    try:
        child = task.RankProcess(python, "roundel.spark.elastic_exec", task.process_env(spec, start["env"]),
                                 spec.payload, client, worker)
    except OSError as exc:
        client.set(exit_key(worker), json.dumps({"code": 127, "stderr": f"could not start {python}: {exc}"}).encode())
        return
    process = child.process
    sent = None
    try:
        while process.poll() is None:
            wanted = _now(client, kill_key(worker))
            if wanted is not None and wanted != sent:
                sent = wanted
                _signal(process, int(wanted))
            if client.check([DONE_KEY]):
                task.stop_group(process)
            time.sleep(_WATCH_S)
    except BaseException:  # the driver is gone, or Spark interrupts this task: take the worker down with it
        task.stop_group(process)
        raise
    result = child.result()
    if result:
        client.set(outcome_key(worker), result)
    client.set(exit_key(worker), json.dumps({"code": process.returncode, "stderr": child.last_stderr()}).encode())


def _signal(process: subprocess.Popen, signum: int) -> None:
    """SIGTERM (with SIGCONT, so that a stopped worker handles it) or SIGKILL the worker's process group."""
    for sig in ((signal.SIGTERM, signal.SIGCONT) if signum == signal.SIGTERM else (signal.SIGKILL,)):
        try:
            os.killpg(process.pid, sig)
        except (ProcessLookupError, PermissionError):
            pass
