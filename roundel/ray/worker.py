"""The Ray actor a rank lives in: its environment, the user's executable object, and guarded calls.

The executors create one actor per rank, give it the environment ``hvd.init()``
reads (identity, rendezvous store and secret, settings) and then call functions
in it. The user's function imports the framework adapter and calls
``hvd.init()`` itself, exactly as under ``roundelrun``.
"""

from __future__ import annotations

import os
import socket
from typing import Any, Callable

import ray

from roundel.common import basics
from roundel.rendezvous import elastic_join
from roundel.runner.outcome import RankOutcome

__all__ = ["RoundelRayWorker"]


def _rank() -> int | None:
    return basics.rank() if basics.is_initialized() else None


class RoundelRayWorker:
    """One rank of a Ray job (Horovod's ``BaseHorovodWorker``): run as a Ray actor."""

    def __init__(self):
        self.executable = None

    def node_id(self) -> str:
        """The Ray node this actor runs on (hex)."""
        return ray.get_runtime_context().get_node_id()

    def node_ip(self) -> str:
        """The address Ray knows this actor's node by."""
        return ray.util.get_node_ip_address()

    def hostname(self) -> str:
        return socket.gethostname()

    def get_gpu_ids(self) -> list:
        """The GPUs Ray gave this actor."""
        return ray.get_gpu_ids()

    def update_env_vars(self, env_vars: dict) -> None:
        """Set variables in the actor's environment (read by ``hvd.init()``)."""
        os.environ.update({str(k): str(v) for k, v in env_vars.items()})

    def env_vars(self) -> dict:
        return dict(os.environ)

    def start_executable(self, executable_cls: type | None = None, executable_args: list | None = None,
                         executable_kwargs: dict | None = None) -> None:
        """Create ``executable_cls(*args, **kwargs)`` in the actor; ``execute`` passes it to its functions."""
        if executable_cls is not None:
            self.executable = executable_cls(*(executable_args or []), **(executable_kwargs or {}))

    def execute(self, fn: Callable[[Any], Any]) -> Any:
        """``fn(executable)``: its value, or its exception raised through Ray."""
        return fn(self.executable)

    def run_guarded(self, fn: Callable, args: tuple, kwargs: dict, on_executable: bool = False) -> RankOutcome:
        """``fn(*args, **kwargs)`` (``fn(executable)`` with ``on_executable``) with its failure returned
        as a traceback instead of raised.

        A rank whose function raised leaves the job (``shutdown()``), so that
        its peers' pending collectives fail instead of waiting for it.
        """
        call_args = (self.executable,) if on_executable else args
        outcome = RankOutcome.of_call(fn, call_args, None if on_executable else kwargs, rank_of=_rank)
        if not outcome.ok:
            basics.shutdown()
        return outcome

    def run_elastic(self, fn: Callable, args: tuple, kwargs: dict) -> RankOutcome:
        """An elastic worker's whole life: ``fn`` joins generations through ``hvd.init()`` and
        ``elastic.run``; a worker the driver leaves out is REMOVED. The worker leaves the job at the
        end, as a process would by exiting."""
        try:
            return RankOutcome.of_call(fn, args, kwargs, rank_of=_rank, removed=elastic_join.WorkerRemoved)
        finally:
            basics.shutdown()
