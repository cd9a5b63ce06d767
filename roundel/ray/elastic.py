"""``ElasticRayExecutor``: an elastic roundel job on a Ray cluster (Horovod's ``horovod.ray.ElasticRayExecutor``).

The job is driven by roundelrun's own elastic driver
(:mod:`roundel.runner.elastic_driver`): the hosts it follows are the Ray
cluster's alive nodes, with as many slots as their CPUs (and GPUs) hold
workers (:class:`RayHostDiscovery`), and each worker it starts is a Ray actor
pinned to its node (:class:`ActorWorker`) instead of a process. When an
actor or its node dies, the survivors roll back to their last commit and
form the next generation; when nodes join, new actors are started and every
rank resets at its next ``commit()``.
"""

from __future__ import annotations

import logging
import math
import signal
import threading
from typing import Any, Callable

import ray
import ray.exceptions
from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

from roundel.ray.settings import RaySettings, start_store
from roundel.ray.worker import RoundelRayWorker
from roundel.runner import elastic_driver, spawn
from roundel.runner.discovery import Blacklist
from roundel.runner.hosts import SlotInfo
from roundel.runner.outcome import OutcomeKind, RankFailedError, RankOutcome
from roundel.runner.worker import Worker

__all__ = ["ActorWorker", "ElasticRayExecutor", "RayHostDiscovery"]

log = logging.getLogger("roundel")


class RayHostDiscovery:
    """The Ray cluster's alive nodes as hosts (named by node id), each with as many slots as its
    resources hold workers of ``cpus_per_worker`` CPUs (and ``gpus_per_worker`` GPUs with ``use_gpu``)."""

    def __init__(self, use_gpu: bool = False, cpus_per_worker: float = 1, gpus_per_worker: float = 1):
        self.use_gpu = use_gpu
        self.cpus_per_worker = cpus_per_worker
        self.gpus_per_worker = gpus_per_worker

    def find_available_hosts_and_slots(self) -> dict[str, int]:
        """``{node id: slots}`` for every alive node with room for at least one worker."""
        hosts = {}
        for node in ray.nodes():
            if not node.get("Alive"):
                continue
            resources = node.get("Resources", {})
            slots = math.floor(resources.get("CPU", 0) / self.cpus_per_worker + 1e-9)
            if self.use_gpu:
                slots = min(slots, math.floor(resources.get("GPU", 0) / self.gpus_per_worker + 1e-9))
            if slots > 0:
                hosts[node["NodeID"]] = slots
        return hosts


class _DriverDiscovery:
    """The elastic driver's view of a discovery object (its ``poll()``): the last good answer is kept
    when asking fails, as for a discovery script."""

    def __init__(self, source):
        self.source = source
        self.hosts: dict[str, int] = {}
        self._last_problem: str | None = None

    def poll(self) -> dict[str, int]:
        try:
            self.hosts = dict(self.source.find_available_hosts_and_slots())
            self._last_problem = None
        except Exception as exc:  # noqa: BLE001 - a failing discovery must not end the job
            problem = f"roundel.ray: host discovery failed ({type(exc).__name__}: {exc}); keeping the last host list"
            if problem != self._last_problem:
                log.warning(problem)
                self._last_problem = problem
        return dict(self.hosts)


def _node_id(host: str) -> str:
    """The Ray node id for a discovered host: a node id itself, or the address of an alive node."""
    alive = [n for n in ray.nodes() if n.get("Alive")]
    for node in alive:
        if host == node["NodeID"]:
            return host
    for node in alive:
        if host == node.get("NodeManagerAddress"):
            return node["NodeID"]
    raise ValueError(f"discovered host {host!r} is neither the id nor the address of an alive Ray node")


class ActorWorker(Worker):
    """An elastic worker that is a Ray actor: the driver watches and stops it as it would a process.

    It "exits" when its ``run_elastic`` call returns (0: finished or left
    the job, 1: the function raised) or the actor dies (as if SIGKILLed);
    the actor is then killed, as a process would be gone.
    """

    _CODES = {OutcomeKind.RETURNED: 0, OutcomeKind.REMOVED: 0, OutcomeKind.RAISED: 1}

    def __init__(self, slot: SlotInfo, actor, ref):
        super().__init__(slot)
        self.actor = actor
        self.ref = ref
        self.outcome: RankOutcome | None = None
        self._code: int | None = None
        self._lock = threading.Lock()

    @property
    def returncode(self) -> int | None:
        return self._code

    @property
    def where(self) -> str:
        return f"Ray actor on node {self.slot.hostname}"

    def wait(self) -> int:
        try:
            outcome = ray.get(self.ref)
        except ray.exceptions.RayError as exc:
            outcome = RankOutcome.died(None, f"{type(exc).__name__}: {exc}")
        with self._lock:
            if self._code is None:
                self.outcome = outcome
                self._code = self._CODES.get(outcome.kind, -signal.SIGKILL)
                self._kill()
        return self._code

    def signal_group(self, signum: int) -> None:
        if signum in (signal.SIGTERM, signal.SIGKILL):
            self._kill()

    def _kill(self) -> None:
        try:
            ray.kill(self.actor, no_restart=True)
        except ray.exceptions.RayError:
            pass  # already gone


class ElasticRayExecutor:
    """Runs an elastic roundel job on the Ray cluster: between ``min_workers`` and ``max_workers`` actors
    (default: the settings' ``min_num_proc``/``max_num_proc``), one per ``cpus_per_worker`` CPUs (and
    ``gpus_per_worker`` GPUs with ``use_gpu``) of every alive node.

    ``override_discovery=False`` keeps ``settings.discovery`` (an object with
    Horovod's ``find_available_hosts_and_slots()``, naming hosts by Ray node id
    or node address). ``reset_limit`` and ``cooldown_range`` are
    ``roundelrun``'s ``--reset-limit`` and ``--blacklist-cooldown-range``;
    ``env_vars`` go into every actor's environment. Horovod's
    ``cpus_per_slot``/``gpus_per_slot`` names are accepted too.
    """

    @staticmethod
    def create_settings(min_num_proc: int = 1, max_num_proc: int | None = None, reset_limit: int | None = None,
                        elastic_timeout: float = RaySettings.elastic_timeout_s,
                        timeout_s: float = RaySettings.timeout_s, ssh_identity_file: str | None = None, nics=None,
                        min_np: int | None = None, max_np: int | None = None, **_horovod_only) -> RaySettings:
        """Settings for ``ElasticRayExecutor`` (Horovod's signature; ``min_np``/``max_np`` are the old names,
        other Horovod settings are accepted and not used)."""
        return RaySettings(timeout_s=timeout_s, ssh_identity_file=ssh_identity_file, nics=nics,
                           elastic_timeout_s=elastic_timeout,
                           min_num_proc=min_np if min_np is not None else min_num_proc,
                           max_num_proc=max_np if max_np is not None else max_num_proc, reset_limit=reset_limit)

    def __init__(self, settings: RaySettings | None = None, min_workers: int | None = None,
                 max_workers: int | None = None, use_gpu: bool = False, cpus_per_worker: float | None = None,
                 gpus_per_worker: float | None = None, env_vars: dict | None = None, override_discovery: bool = True,
                 reset_limit: int | None = None, cooldown_range: tuple[float, float] | None = None,
                 elastic_timeout: float | None = None, cpus_per_slot: float | None = None,
                 gpus_per_slot: float | None = None):
        self.settings = settings or RaySettings()
        s = self.settings
        self.min_workers = min_workers if min_workers is not None else (s.min_num_proc or 1)
        self.max_workers = max_workers if max_workers is not None else s.max_num_proc
        if not isinstance(self.min_workers, int) or self.min_workers < 1:
            raise ValueError(f"ElasticRayExecutor: min_workers={self.min_workers!r} must be a whole number >= 1")
        if self.max_workers is not None and self.max_workers < self.min_workers:
            raise ValueError(f"ElasticRayExecutor: max_workers={self.max_workers} is below "
                             f"min_workers={self.min_workers}")
        gpus = gpus_per_worker if gpus_per_worker is not None else gpus_per_slot
        if gpus is not None and not use_gpu:
            raise ValueError("ElasticRayExecutor: gpus_per_worker is set but use_gpu is False; pass use_gpu=True")
        self.cpus_per_worker = next((c for c in (cpus_per_worker, cpus_per_slot) if c is not None), 1)
        if not self.cpus_per_worker > 0:
            raise ValueError(f"ElasticRayExecutor: cpus_per_worker={self.cpus_per_worker!r} must be above 0")
        self.use_gpu = use_gpu
        self.gpus_per_worker = (gpus or 1) if use_gpu else 0
        self.reset_limit = reset_limit if reset_limit is not None else s.reset_limit
        if self.reset_limit is not None and self.reset_limit < 0:
            raise ValueError(f"ElasticRayExecutor: reset_limit={self.reset_limit} must be >= 0")
        if cooldown_range is not None and not 0 <= cooldown_range[0] <= cooldown_range[1]:
            raise ValueError(f"ElasticRayExecutor: cooldown_range={cooldown_range!r}: need 0 <= low <= high")
        self.cooldown_range = tuple(cooldown_range) if cooldown_range is not None else None
        self.elastic_timeout_s = elastic_timeout if elastic_timeout is not None else s.elastic_timeout_s
        if override_discovery:
            s.discovery = RayHostDiscovery(use_gpu, self.cpus_per_worker, self.gpus_per_worker or 1)
        elif getattr(s, "discovery", None) is None:
            raise ValueError("ElasticRayExecutor: override_discovery=False needs settings.discovery (an object "
                             "with find_available_hosts_and_slots())")
        self.env_vars = dict(env_vars or {})
        self.workers: list[ActorWorker] = []
        self._server = None
        self._secret = None
        self._address = None

    def start(self) -> None:
        """Start the job's rendezvous store (the actors start in ``run``)."""
        if not ray.is_initialized():
            raise RuntimeError("ElasticRayExecutor.start(): Ray is not initialized; call ray.init() first")
        if self._server is None:
            self._address = self.settings.store_address()
            self._server, self._secret = start_store(self._address)

    def _start_actor(self, fn: Callable, args: tuple, kwargs: dict) -> Callable:
        worker_cls = ray.remote(RoundelRayWorker)

        def start(slot: SlotInfo, env: dict[str, str], label: str) -> ActorWorker:
            ours = {k: v for k, v in env.items() if k.startswith(spawn.FORWARDED_PREFIXES)}
            ours.update(self.env_vars)
            actor = worker_cls.options(
                num_cpus=self.cpus_per_worker, num_gpus=self.gpus_per_worker, max_restarts=0,
                scheduling_strategy=NodeAffinitySchedulingStrategy(_node_id(slot.hostname), soft=False)).remote()
            actor.update_env_vars.remote(ours)  # an actor runs its calls in order: set before run_elastic
            worker = ActorWorker(slot, actor, actor.run_elastic.remote(fn, args, kwargs))
            self.workers.append(worker)
            return worker

        return start

    def run(self, worker_fn: Callable, callbacks: list | None = None, args: list | None = None,
            kwargs: dict | None = None) -> list[Any]:
        """Run ``worker_fn(*args, **kwargs)`` (which calls ``hvd.init()`` and an ``elastic.run`` loop) on
        the cluster until it finishes; return the results of the last generation's ranks in rank order.

        Raises RankFailedError when the job fails (with the traceback of a
        worker's own exception when there was one). ``callbacks`` (Horovod's
        rank-0 log queue) are not supported.
        """
        if callbacks:
            raise NotImplementedError("ElasticRayExecutor.run(callbacks=...): roundel.ray has no rank-0 "
                                      "log queue; report progress from worker_fn instead")
        if self._server is None:
            raise RuntimeError("ElasticRayExecutor.run(): call start() first")
        self.workers = []
        env = self.settings.worker_env()
        settings = elastic_driver.ElasticSettings(
            command=[], min_np=self.min_workers, max_np=self.max_workers,
            discovery=_DriverDiscovery(self.settings.discovery), blacklist=Blacklist(self.cooldown_range),
            elastic_timeout_s=self.elastic_timeout_s, reset_limit=self.reset_limit, settings_env=env,
            start_timeout_s=self.settings.timeout_s,
            start_worker=self._start_actor(worker_fn, tuple(args or ()), dict(kwargs or {})))
        code = elastic_driver.run(settings, self._server, self._secret, lambda host: self._address)
        outcomes = [w.outcome for w in self.workers if w.outcome is not None]
        if code == 0:
            return [o.result("ElasticRayExecutor: ") for o in sorted((o for o in outcomes if o.ok),
                                                                      key=lambda o: o.rank)]
        failures = [o for o in outcomes if o.kind is OutcomeKind.RAISED]
        own = [o for o in failures if not o.internal] or failures
        if own:
            raise own[0].failure(f"ElasticRayExecutor: the job failed (driver status {code}); ")
        raise RankFailedError(None, "", f"ElasticRayExecutor: the job failed (driver status {code}); see the "
                                        "driver's messages above")

    def shutdown(self) -> None:
        """Kill any actor still running and stop the rendezvous store."""
        for worker in self.workers:
            worker.signal_group(signal.SIGKILL)
        self.workers = []
        if self._server is not None:
            self._server.stop()
            self._server = None
