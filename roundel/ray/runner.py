"""``RayExecutor``: a fixed-size roundel job whose ranks are Ray actors (Horovod's ``horovod.ray.RayExecutor``).

``start()`` places one actor per rank with a placement group (PACK for
``num_workers``, STRICT_SPREAD with ``num_hosts``), numbers the ranks from the
nodes the actors landed on, starts the job's rendezvous store in the driver
with a fresh secret, and gives each actor the environment ``hvd.init()``
reads. ``run()`` calls a function on every rank and returns the results in
rank order; a rank's exception or a dead actor ends it with RankFailedError.
"""

from __future__ import annotations

import dataclasses
import time
from typing import Any, Callable

import ray
import ray.exceptions

from roundel.rendezvous.identity import rendezvous_env
from roundel.ray import placement
from roundel.ray.settings import RaySettings, start_store
from roundel.ray.worker import RoundelRayWorker
from roundel.runner.outcome import OutcomeKind, RankOutcome

__all__ = ["RayExecutor"]

FAILURE_GRACE_S = 5.0
"""After a rank fails, how long run() waits for the others' outcomes, to name the rank that failed first
(a dead actor or a user exception) rather than a peer that only saw it go."""


class RayExecutor:
    """Runs a roundel job on Ray actors.

    ``num_workers`` actors packed onto as few nodes as possible, or
    ``num_hosts`` x ``num_workers_per_host`` actors on distinct nodes; each with
    ``cpus_per_worker`` CPUs and, with ``use_gpu``, ``gpus_per_worker``
    (default 1) GPUs. ``use_current_placement_group`` is accepted for Horovod's
    signature; a new placement group is always created.
    """

    @staticmethod
    def create_settings(timeout_s: float = RaySettings.timeout_s, ssh_identity_file: str | None = None,
                        ssh_str: str | None = None,
                        placement_group_timeout_s: float = 100, nics=None) -> RaySettings:
        """Settings for ``RayExecutor`` (Horovod's signature; ``ssh_identity_file``/``ssh_str`` are not used:
        Ray starts the workers)."""
        return RaySettings(timeout_s=timeout_s, ssh_identity_file=ssh_identity_file,
                           placement_group_timeout_s=placement_group_timeout_s, nics=nics)

    def __init__(self, settings: RaySettings | None = None, num_workers: int | None = None,
                 num_hosts: int | None = None, num_workers_per_host: int = 1, cpus_per_worker: float = 1,
                 use_gpu: bool = False, gpus_per_worker: float | None = None,
                 use_current_placement_group: bool = True):
        if (num_workers is None) == (num_hosts is None):
            raise ValueError("RayExecutor: give either num_workers, or num_hosts (with num_workers_per_host)")
        for name, value in (("num_workers", num_workers), ("num_hosts", num_hosts),
                            ("num_workers_per_host", num_workers_per_host)):
            if value is not None and (not isinstance(value, int) or value < 1):
                raise ValueError(f"RayExecutor: {name}={value!r} must be a whole number of at least 1")
        if not cpus_per_worker > 0:
            raise ValueError(f"RayExecutor: cpus_per_worker={cpus_per_worker!r} must be above 0")
        if gpus_per_worker is not None and not use_gpu:
            raise ValueError("RayExecutor: gpus_per_worker is set but use_gpu is False; pass use_gpu=True")
        self.settings = settings or RaySettings()
        self.num_workers = num_workers if num_workers is not None else num_hosts * num_workers_per_host
        self.num_hosts = num_hosts
        self.num_workers_per_host = num_workers_per_host
        self.cpus_per_worker = cpus_per_worker
        self.gpus_per_worker = (gpus_per_worker or 1) if use_gpu else 0
        self.workers: list = []  # actor handles in rank order
        self.identities: list = []
        self._group = None
        self._server = None

    # ------------------------------------------------------------ start
    def _place(self) -> list:
        """Create the placement group and the actors (in bundle order)."""
        worker_cls = ray.remote(RoundelRayWorker)
        if self.num_hosts is None:
            self._group = placement.create_placement_group(
                {"CPU": self.cpus_per_worker, "GPU": self.gpus_per_worker}, self.num_workers, "PACK",
                self.settings.placement_group_timeout_s)
            bundles = range(self.num_workers)
        else:
            per_host = self.num_workers_per_host
            self._group = placement.create_placement_group(
                {"CPU": self.cpus_per_worker * per_host, "GPU": self.gpus_per_worker * per_host},
                self.num_hosts, "STRICT_SPREAD", self.settings.placement_group_timeout_s)
            bundles = [host for host in range(self.num_hosts) for _ in range(per_host)]
        return [worker_cls.options(**placement.actor_options(self._group, bundle, self.cpus_per_worker,
                                                             self.gpus_per_worker)).remote()
                for bundle in bundles]

    def start(self, executable_cls: type | None = None, executable_args: list | None = None,
              executable_kwargs: dict | None = None, extra_env_vars: dict | None = None) -> None:
        """Place the actors, start the rendezvous store, give each actor its rank's environment, and
        create ``executable_cls(*executable_args, **executable_kwargs)`` in each (for ``execute``)."""
        if self.workers:
            raise RuntimeError("RayExecutor.start(): already started; call shutdown() first")
        if not ray.is_initialized():
            raise RuntimeError("RayExecutor.start(): Ray is not initialized; call ray.init() first")
        try:
            actors = self._place()
            timeout = self.settings.placement_group_timeout_s
            node_ids = ray.get([a.node_id.remote() for a in actors], timeout=timeout)
            order, self.identities = placement.identities(node_ids)
            self.workers = [actors[i] for i in order]
            address = self.settings.store_address()
            self._server, secret = start_store(address)
            common = {**self.settings.worker_env(), **rendezvous_env(address, self._server.port, secret.hex()),
                      **(extra_env_vars or {})}
            envs = [{**common, **ident.to_env()} for ident in self.identities]
            if self.gpus_per_worker:
                self._share_gpus(envs, [node_ids[i] for i in order], timeout)
            ray.get([w.update_env_vars.remote(env) for w, env in zip(self.workers, envs)], timeout=timeout)
            ray.get([w.start_executable.remote(executable_cls, executable_args, executable_kwargs)
                     for w in self.workers])
        except BaseException:
            self.shutdown()
            raise

    def _share_gpus(self, envs: list[dict], nodes: list[str], timeout: float) -> None:
        """Let every rank see all GPUs given to the ranks on its node (local rank picks one), as Horovod does."""
        ids = ray.get([w.get_gpu_ids.remote() for w in self.workers], timeout=timeout)
        per_node: dict[str, list] = {}
        for node, gpus in zip(nodes, ids):
            per_node.setdefault(node, []).extend(gpus)
        for env, node in zip(envs, nodes):
            env["CUDA_VISIBLE_DEVICES"] = ",".join(str(g) for g in per_node[node])

    # ------------------------------------------------------------ calls
    def _started(self, what: str) -> None:
        if not self.workers:
            raise RuntimeError(f"RayExecutor.{what}(): call start() first")

    def run_remote(self, fn: Callable, args: list | None = None, kwargs: dict | None = None) -> list:
        """Start ``fn(*args, **kwargs)`` on every rank; its ObjectRefs in rank order (``ray.get`` them)."""
        self._started("run_remote")
        args, kwargs = tuple(args or ()), dict(kwargs or {})
        return [w.execute.remote(lambda _: fn(*args, **kwargs)) for w in self.workers]

    def run(self, fn: Callable, args: list | None = None, kwargs: dict | None = None) -> list[Any]:
        """``fn(*args, **kwargs)`` on every rank; the results in rank order.

        Raises RankFailedError naming the rank (with its traceback) whose
        function raised, or whose actor died.
        """
        self._started("run")
        args, kwargs = tuple(args or ()), dict(kwargs or {})
        return self._gather([w.run_guarded.remote(fn, args, kwargs) for w in self.workers], range(len(self.workers)))

    def execute(self, fn: Callable[[Any], Any]) -> list[Any]:
        """``fn(executable)`` on every rank (the object ``start(executable_cls=...)`` created); results in
        rank order, failures as in ``run``."""
        self._started("execute")
        return self._gather([w.run_guarded.remote(fn, (), {}, True) for w in self.workers], range(len(self.workers)))

    def execute_single(self, fn: Callable[[Any], Any]) -> Any:
        """``fn(executable)`` on rank 0 only; its result."""
        self._started("execute_single")
        return self._gather([self.workers[0].run_guarded.remote(fn, (), {}, True)], [0])[0]

    def _gather(self, refs: list, ranks) -> list[Any]:
        pending = dict(zip(refs, ranks))
        outcomes: dict[int, RankOutcome] = {}
        deadline = None
        while pending:
            wait = None if deadline is None else max(0.0, deadline - time.monotonic())
            ready, _ = ray.wait(list(pending), num_returns=1, timeout=wait)
            if not ready:
                break  # the grace after a failure is over; ranks still running are reported as such
            rank = pending.pop(ready[0])
            try:
                outcomes[rank] = ray.get(ready[0])
            except ray.exceptions.RayError as exc:  # the actor died (killed, its node lost)
                outcomes[rank] = RankOutcome.died(rank, f"{type(exc).__name__}: {exc}")
            if not outcomes[rank].ok and deadline is None:
                deadline = time.monotonic() + FAILURE_GRACE_S
        failed = {r: o for r, o in outcomes.items() if not o.ok}
        if not failed:
            return [outcomes[r].result("RayExecutor: ") for r in sorted(outcomes)]
        # the cause first: a dead actor, then an exception of the user's, then a peer's loss of the job
        rank = min(failed, key=lambda r: (0 if failed[r].kind is OutcomeKind.DIED else 1 + failed[r].internal, r))
        others = f"; {len(pending)} rank(s) still running" if pending else ""
        who = f"the actor of rank {rank}" if failed[rank].kind is OutcomeKind.DIED else None
        raise dataclasses.replace(failed[rank], rank=rank).failure("RayExecutor: ", who, others)

    def shutdown(self) -> None:
        """Kill the actors, remove the placement group and stop the rendezvous store."""
        for worker in self.workers:
            ray.kill(worker, no_restart=True)
        self.workers = []
        if self._group is not None:
            ray.util.remove_placement_group(self._group)
            self._group = None
        if self._server is not None:
            self._server.stop()
            self._server = None

