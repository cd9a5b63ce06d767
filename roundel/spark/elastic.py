"""``roundel.spark.run_elastic``: an elastic roundel job whose workers run in the tasks of a Spark stage.

The driver submits one ordinary (not barrier) stage of ``max_num_proc``
tasks; each task registers with the driver's rendezvous store and serves as
one slot (:mod:`roundel.spark.elastic_task`). ``roundelrun``'s own elastic
driver (:mod:`roundel.runner.elastic_driver`) runs the job: its hosts are the
machines of the live tasks, with one slot per task (:class:`SparkTaskDiscovery`),
and each worker it starts is a process one of those tasks starts on its
behalf (:class:`TaskWorker`). A task that ends or fails drops out of the
host list; a task Spark runs again (``spark.task.maxFailures``) comes back
as a new slot. Blacklisting, resets, ``min_num_proc``/``max_num_proc``,
``elastic_timeout`` and ``reset_limit`` are the elastic driver's.
"""

from __future__ import annotations

import functools
import itertools
import json
import logging
import os
import signal
import sys
import threading
import time
from typing import Any, Callable, Sequence, TextIO

import cloudpickle

from roundel.common.settings import Settings, setting
from roundel.rendezvous import elastic_join
from roundel.rendezvous.store import RendezvousServer, new_secret
from roundel.runner import elastic_driver, spawn
from roundel.runner.discovery import Blacklist
from roundel.runner.hosts import SlotInfo
from roundel.runner.outcome import OutcomeKind, RankFailedError, RankOutcome
from roundel.runner.worker import Worker
from roundel.spark import elastic_task, output, task
from roundel.spark.runner import (START_TIMEOUT_VARS, DEFAULT_START_TIMEOUT_S, nic_list, num_proc_setting,
                                  seconds_setting, spark_context, store_address)

__all__ = ["SparkTaskDiscovery", "TaskWorker", "run_elastic"]

log = logging.getLogger("roundel.spark")

TASK_LOST_S = 10.0
"""A task whose beat counter has not moved for this long counts as gone (its executor died)."""

_POLL_S = 0.1
_END_WAIT_S = 10.0
_CANCEL_WAIT_S = 30.0
_job_ids = itertools.count()


class SparkTaskDiscovery:
    """The live tasks of the stage as hosts: ``{machine: number of live tasks there}``.

    Each task keeps the slot index it got when it first appeared (the lowest
    free one on its machine), so a worker's slot never moves to another
    task; a machine offers the slots below its first unserved index.
    """

    def __init__(self, server: RendezvousServer, partitions: int):
        self.server = server
        self.partitions = partitions
        self._lock = threading.Lock()
        self._beats: dict[str, tuple[bytes | None, float]] = {}  # task: (last counter value, when it changed)
        self._slot_of: dict[str, tuple[str, int]] = {}

    def _registered(self) -> dict[str, str]:
        """``{task: host}`` of each partition's latest task."""
        found = {}
        for partition in range(self.partitions):
            raw = self.server.get(elastic_task.register_key(partition))
            if raw is not None:
                entry = json.loads(raw)
                found[elastic_task.task_id(partition, entry["attempt"])] = entry["host"]
        return found

    def _alive(self, task_id: str) -> bool:
        if self.server.get(elastic_task.gone_key(task_id)) is not None:
            return False
        beat = self.server.get(elastic_task.beat_key(task_id))
        now = time.monotonic()
        last, since = self._beats.get(task_id, (None, now))
        if beat != last or task_id not in self._beats:
            self._beats[task_id] = (beat, now)
            return True
        return now - since < TASK_LOST_S

    def live_tasks(self) -> dict[str, str]:
        """``{task: host}`` of the tasks serving now."""
        with self._lock:
            return {t: h for t, h in self._registered().items() if self._alive(t)}

    def alive(self, task_id: str) -> bool:
        """Whether ``task_id`` still serves (it is its partition's latest task, and beats)."""
        partition, attempt = map(int, task_id.split("."))
        raw = self.server.get(elastic_task.register_key(partition))
        if raw is None or json.loads(raw)["attempt"] != attempt:
            return False
        with self._lock:
            return self._alive(task_id)

    def find_available_hosts_and_slots(self) -> dict[str, int]:
        live = self.live_tasks()
        with self._lock:
            for gone in [t for t in self._slot_of if t not in live]:
                del self._slot_of[gone]
            for task_id in sorted(live, key=lambda t: tuple(map(int, t.split(".")))):
                if task_id not in self._slot_of:
                    used = {i for h, i in self._slot_of.values() if h == live[task_id]}
                    self._slot_of[task_id] = (live[task_id], next(i for i in itertools.count() if i not in used))
            hosts = {}
            for host in set(live.values()):
                used = {i for h, i in self._slot_of.values() if h == host}
                hosts[host] = next(i for i in itertools.count() if i not in used)
            return {h: n for h, n in hosts.items() if n}

    def task_at(self, host: str, index: int) -> str | None:
        """The task serving slot ``index`` of ``host``, or None."""
        with self._lock:
            return next((t for t, place in self._slot_of.items() if place == (host, index)), None)


class TaskWorker(Worker):
    """An elastic worker run by a Spark task: the elastic driver watches and stops it as a process.

    It has ended when its task reports its exit status, or when the task is
    gone (then as if SIGKILLed). Signals are requests the task carries out.
    """

    def __init__(self, slot: SlotInfo, task_id: str | None, worker_id: str, server: RendezvousServer,
                 discovery: SparkTaskDiscovery):
        super().__init__(slot)
        self.task_id = task_id
        self.worker_id = worker_id
        self.server = server
        self.discovery = discovery
        self._code: int | None = None if task_id is not None else -signal.SIGKILL
        self._lock = threading.Lock()

    @property
    def returncode(self) -> int | None:
        return self._code

    @property
    def where(self) -> str:
        if self.task_id is None:
            return "no Spark task serves this slot any more"
        partition, attempt = self.task_id.split(".")
        return f"Spark task {partition} (attempt {attempt})"

    def wait(self) -> int:
        while self._code is None:
            raw = self.server.get(elastic_task.exit_key(self.worker_id))
            if raw is not None:
                code = json.loads(raw)["code"]
            elif not self.discovery.alive(self.task_id):
                code = -signal.SIGKILL
                print(f"roundel.spark: {self.where} is gone; its worker counts as killed", file=sys.stderr,
                      flush=True)
            else:
                time.sleep(_POLL_S)
                continue
            with self._lock:
                if self._code is None:
                    self._code = code
        return self._code

    def signal_group(self, signum: int) -> None:
        if signum in (signal.SIGTERM, signal.SIGKILL) and self._code is None:
            self.server.set(elastic_task.kill_key(self.worker_id), str(int(signum)).encode())

    def outcome(self) -> RankOutcome | None:
        """What the worker's function did (see :mod:`roundel.spark.elastic_exec`), or None (it died)."""
        raw = self.server.get(elastic_task.outcome_key(self.worker_id))
        if raw is None:
            return None
        try:
            return RankOutcome.decode(raw)
        except ValueError as exc:
            return RankOutcome.died(None, f"its outcome could not be read on the driver: {exc}")


class _Slots:
    """Starts elastic workers on the tasks: the ``start_worker`` of the elastic driver's settings."""

    def __init__(self, server: RendezvousServer, discovery: SparkTaskDiscovery):
        self.server = server
        self.discovery = discovery
        self.workers: list[TaskWorker] = []
        self._starts: dict[str, int] = {}

    def __call__(self, slot: SlotInfo, env: dict[str, str], label: str) -> TaskWorker:
        worker_id = env[elastic_join.WORKER_ID]
        task_id = self.discovery.task_at(slot.hostname, slot.local_rank)
        worker = TaskWorker(slot, task_id, worker_id, self.server, self.discovery)
        if task_id is not None:
            ours = {k: v for k, v in env.items() if k.startswith(spawn.FORWARDED_PREFIXES)}  # the task adds the user env
            n = self._starts.get(task_id, 0)
            self._starts[task_id] = n + 1
            self.server.set(elastic_task.start_key(task_id, n), json.dumps({"worker": worker_id, "env": ours}).encode())
        self.workers.append(worker)
        return worker

    def worker_ids(self) -> list[str]:
        return [w.worker_id for w in list(self.workers)]


def _whole(name: str, value, low: int) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value < low:
        raise ValueError(f"{name} must be a whole number >= {low}, not {value!r}")
    return value


def run_elastic(fn: Callable, args: Sequence = (), kwargs: dict | None = None, num_proc: int | None = None,
                min_num_proc: int | None = None, max_num_proc: int | None = None,
                start_timeout: float | None = None, elastic_timeout: float | None = None,
                reset_limit: int | None = None, env: dict | None = None, stdout: TextIO | None = None,
                stderr: TextIO | None = None, verbose: int = 1, nics=None,
                prefix_output_with_timestamp: bool = False, executable: str | None = None,
                min_np: int | None = None, max_np: int | None = None) -> list[Any]:
    """Run ``fn(*args, **kwargs)`` as an elastic job in Spark tasks; return the results of the last
    generation's ranks in rank order.

    As ``horovod.spark.run_elastic``: ``fn`` calls ``hvd.init()`` and trains
    in an ``hvd.elastic.run`` loop with a State. ``num_proc`` (default
    ``spark.default.parallelism``) tasks must start within ``start_timeout``
    (default ``ROUNDEL_SPARK_START_TIMEOUT``/``HOROVOD_SPARK_START_TIMEOUT``, else
    600 s; a TimeoutError then says so); the stage has ``max_num_proc``
    (default ``num_proc``) tasks, and training goes on while at least
    ``min_num_proc`` (default ``num_proc``) of them serve. ``elastic_timeout``
    (default: the ``ELASTIC_TIMEOUT`` setting, docs/settings.md) and
    ``reset_limit`` are ``roundelrun``'s ``--elastic-timeout`` and
    ``--reset-limit``. ``env``, ``stdout``/``stderr``, ``nics``,
    ``prefix_output_with_timestamp`` and ``executable`` are as in
    :func:`roundel.spark.run`; output lines are prefixed ``[host:slot]``.
    ``min_np``/``max_np`` are Horovod's older names.

    Raises RankFailedError when the job fails, with the traceback of a
    worker's own exception when there was one.
    """
    if not callable(fn):
        raise TypeError(f"roundel.spark.run_elastic: fn must be callable, not {type(fn).__name__}")
    min_num_proc = min_np if min_np is not None else min_num_proc
    max_num_proc = max_np if max_np is not None else max_num_proc
    context = spark_context()
    num_proc = num_proc_setting(context, num_proc)
    min_num_proc = _whole("min_num_proc", num_proc if min_num_proc is None else min_num_proc, 1)
    max_num_proc = _whole("max_num_proc", num_proc if max_num_proc is None else max_num_proc, 1)
    if not min_num_proc <= num_proc <= max_num_proc:
        raise ValueError(f"roundel.spark.run_elastic: need min_num_proc <= num_proc <= max_num_proc, got "
                         f"{min_num_proc} <= {num_proc} <= {max_num_proc}")
    if reset_limit is not None:
        _whole("reset_limit", reset_limit, 0)
    start_s = seconds_setting(start_timeout, START_TIMEOUT_VARS, DEFAULT_START_TIMEOUT_S, "start_timeout")
    elastic_s = (seconds_setting(elastic_timeout, (), 0.0, "elastic_timeout") if elastic_timeout is not None
                 else Settings.from_env(only=("elastic_timeout_s",)).elastic_timeout_s)
    nics = nic_list(nics)
    address = store_address(context, nics)
    worker_env = {str(k): str(v) for k, v in (env or {}).items()}
    if nics:
        worker_env.setdefault(setting("network_interface").var, ",".join(nics))
    payload = cloudpickle.dumps((fn, tuple(args), dict(kwargs or {})))
    secret = new_secret()
    server = RendezvousServer(secret, host=address)
    server.start()
    spec = task.TaskSpec(address, server.port, secret.hex(), payload, worker_env, executable)
    discovery = SparkTaskDiscovery(server, max_num_proc)
    slots = _Slots(server, discovery)
    printer = output.Printer(server, slots.worker_ids, stdout or sys.stdout, stderr or sys.stderr,
                             prefix_output_with_timestamp, shown=lambda worker_id: worker_id.split("#")[0]).start()
    group = f"roundel.spark.run_elastic.{os.getpid()}.{next(_job_ids)}"
    stage = _Stage(context, group, spec, max_num_proc)
    try:
        stage.start()
        _wait_for_tasks(discovery, stage, num_proc, max_num_proc, start_s)
        if verbose >= 2:
            log.info("roundel.spark: %d to %d workers, rendezvous store at %s:%d", min_num_proc, max_num_proc,
                     address, server.port)
        settings = elastic_driver.ElasticSettings(
            command=[], min_np=min_num_proc, max_np=max_num_proc, discovery=_Polled(discovery),
            blacklist=Blacklist(), elastic_timeout_s=elastic_s, reset_limit=reset_limit, settings_env={},
            start_timeout_s=start_s, start_worker=slots,
            # a task is the unit Spark retries: a failed one takes out no other task on its machine
            evict_host_on_failure=False)
        code = elastic_driver.run(settings, server, secret, lambda host: address)
        server.set(elastic_task.DONE_KEY, b"1")
        stage.join(_END_WAIT_S)
    finally:
        server.set(elastic_task.DONE_KEY, b"1")
        stage.cancel()
        printer.stop()
        server.stop()
    return _results(code, slots.workers)


class _Polled:
    """The elastic driver's view of the discovery (its ``poll()``)."""

    def __init__(self, discovery: SparkTaskDiscovery):
        self.discovery = discovery

    def poll(self) -> dict[str, int]:
        return self.discovery.find_available_hosts_and_slots()


class _Stage:
    """The Spark stage of slot-serving tasks, run in a thread under its own job group."""

    def __init__(self, context, group: str, spec: task.TaskSpec, partitions: int):
        self.context = context
        self.group = group
        self.spec = spec
        self.partitions = partitions
        self.error: BaseException | None = None
        self._thread = threading.Thread(target=self._run, name="roundel-spark-stage", daemon=True)

    def _run(self) -> None:
        try:
            self.context.setJobGroup(self.group, "roundel.spark.run_elastic", interruptOnCancel=True)
            rdd = self.context.parallelize(range(self.partitions), self.partitions)
            rdd.mapPartitions(functools.partial(elastic_task.serve_slot, self.spec)).collect()
        except BaseException as exc:  # noqa: BLE001 - handed to the caller's thread
            self.error = exc

    def start(self) -> None:
        self._thread.start()

    def running(self) -> bool:
        return self._thread.is_alive()

    def join(self, timeout: float) -> None:
        self._thread.join(timeout)

    def cancel(self) -> None:
        """Cancel what is left of the stage and wait for it to end."""
        if self._thread.is_alive():
            self.context.cancelJobGroup(self.group)
            self._thread.join(_CANCEL_WAIT_S)


def _wait_for_tasks(discovery: SparkTaskDiscovery, stage: _Stage, num_proc: int, partitions: int,
                    timeout_s: float) -> None:
    """Wait until ``num_proc`` tasks serve; raise TimeoutError (or the stage's error) otherwise."""
    deadline = time.monotonic() + timeout_s
    while len(discovery.live_tasks()) < num_proc:
        if not stage.running():
            raise RuntimeError(f"roundel.spark.run_elastic: the Spark stage ended before {num_proc} tasks "
                               f"started: {stage.error}") from stage.error
        if time.monotonic() > deadline:
            raise TimeoutError(
                f"roundel.spark.run_elastic: only {len(discovery.live_tasks())} of {num_proc} Spark tasks started "
                f"within the start timeout of {timeout_s:g} s. Each worker runs in its own task of a stage of "
                f"{partitions} tasks, so the cluster needs {num_proc} free task slots (executors x cores per "
                "executor / spark.task.cpus); lower num_proc, add executors, or raise start_timeout if they are "
                "allocated on demand")
        time.sleep(_POLL_S)


def _results(code: int, workers: list[TaskWorker]) -> list[Any]:
    outcomes = [o for o in (w.outcome() for w in workers) if o is not None]
    if code == 0:
        return [o.result("roundel.spark.run_elastic: ") for o in sorted((o for o in outcomes if o.ok),
                                                                        key=lambda o: o.rank)]
    failures = [o for o in outcomes if o.kind in (OutcomeKind.RAISED, OutcomeKind.DIED)]
    own = [o for o in failures if not o.internal] or failures
    if own:
        raise own[0].failure(f"roundel.spark.run_elastic: the job failed (driver status {code}); ")
    raise RankFailedError(None, "", f"roundel.spark.run_elastic: the job failed (driver status {code}); see the "
                                    "roundelrun: lines above on stderr for why")
