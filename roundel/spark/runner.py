"""``roundel.spark.run``: a roundel job whose ranks run in the tasks of a Spark barrier stage.

The driver (the caller's process, which holds the active SparkContext)
starts the job's rendezvous store with a fresh secret and submits one
barrier stage of ``num_proc`` tasks; Spark's closure carries the store's
address, the secret and the pickled function to the tasks
(:mod:`roundel.spark.task`), which start one process per rank. The driver
prints the ranks' output, waits for the stage, and returns the results in
rank order, or raises the first failed rank's error.
"""

from __future__ import annotations

import functools
import itertools
import logging
import os
import sys
import threading
import time
from typing import Any, Callable, Sequence, TextIO

import cloudpickle

from roundel.common.settings import setting
from roundel.rendezvous import network
from roundel.rendezvous.store import RendezvousServer, new_secret
from roundel.runner.outcome import RankFailedError, RankOutcome
from roundel.spark import abort, output, task

__all__ = ["run"]

log = logging.getLogger("roundel.spark")

START_TIMEOUT_VARS = ("ROUNDEL_SPARK_START_TIMEOUT", "HOROVOD_SPARK_START_TIMEOUT")
DEFAULT_START_TIMEOUT_S = 600.0
_CANCEL_WAIT_S = 30.0
_job_ids = itertools.count()


def spark_context():
    import pyspark

    context = pyspark.SparkContext._active_spark_context
    if context is None:
        raise RuntimeError("roundel.spark: no active SparkContext; create a SparkSession (or SparkContext) "
                           "before calling roundel.spark.run or run_elastic")
    return context


def seconds_setting(value: float | None, env_vars: Sequence[str], default: float, name: str) -> float:
    """``value``, else the first of ``env_vars`` set, else ``default``; a positive number of seconds.
    Raises ValueError naming ``name`` (or the variable) otherwise."""
    if value is None:
        for var in env_vars:
            if os.environ.get(var):
                try:
                    value = float(os.environ[var])
                except ValueError:
                    raise ValueError(f"{var}={os.environ[var]!r} must be a number of seconds") from None
                break
        else:
            value = default
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not value > 0:
        raise ValueError(f"{name} must be a positive number of seconds, not {value!r}")
    return float(value)


def _start_timeout(start_timeout: float | None) -> float:
    return seconds_setting(start_timeout, START_TIMEOUT_VARS, DEFAULT_START_TIMEOUT_S, "start_timeout")


def nic_list(nics) -> list[str]:
    """The interface names ``nics`` gives (one name, or a collection of them), sorted."""
    if nics is None:
        return []
    return [nics] if isinstance(nics, str) else sorted(nics)


def store_address(context, nics: list[str]) -> str:
    """The address the tasks reach the driver's store at: that of the first of ``nics`` this machine
    has, else the address ``spark.driver.host`` resolves to. Raises ValueError."""
    if nics:
        return network.interface_address(",".join(nics))
    return network.resolve(context.getConf().get("spark.driver.host") or "localhost")


def num_proc_setting(context, num_proc: int | None) -> int:
    """``num_proc``, defaulting to ``spark.default.parallelism``; raises ValueError when not a whole number >= 1."""
    if num_proc is None:
        num_proc = context.defaultParallelism
        log.info("roundel.spark: running %d processes (spark.default.parallelism)", num_proc)
    if isinstance(num_proc, bool) or not isinstance(num_proc, int) or num_proc < 1:
        raise ValueError(f"num_proc must be a whole number >= 1, not {num_proc!r}")
    return num_proc


def run(fn: Callable, args: Sequence = (), kwargs: dict | None = None, num_proc: int | None = None,
        start_timeout: float | None = None, use_mpi: bool | None = None, use_gloo: bool | None = None,
        extra_mpi_args: str | None = None, env: dict | None = None, stdout: TextIO | None = None,
        stderr: TextIO | None = None, verbose: int = 1, nics=None, prefix_output_with_timestamp: bool = False,
        executable: str | None = None) -> list[Any]:
    """Run ``fn(*args, **kwargs)`` as ``num_proc`` ranks in Spark tasks; return the results in rank order.

    As ``horovod.spark.run``: ``num_proc`` defaults to ``spark.default.parallelism``;
    ``start_timeout`` (default ``ROUNDEL_SPARK_START_TIMEOUT`` or
    ``HOROVOD_SPARK_START_TIMEOUT``, else 600 s) bounds the wait for Spark to
    start every task (a TimeoutError then says so); ``env`` is added to the
    ranks' environment; the ranks' output goes to ``stdout``/``stderr`` (default
    this process's) with ``[rank]<stdout>:`` prefixes; ``nics`` names the network
    interfaces to use; ``executable`` is the Python the tasks start for their
    rank (default the one the Spark task runs). ``use_gloo`` is accepted (roundel
    moves data the same way either way); MPI is not available under Spark.

    Raises RankFailedError naming the first rank that failed, with its traceback.
    """
    if use_mpi or extra_mpi_args:
        raise ValueError("roundel.spark.run starts every rank in its own Spark task, not through mpirun: "
                         "drop use_mpi/extra_mpi_args (roundelrun --mpi runs a job over MPI)")
    if not callable(fn):
        raise TypeError(f"roundel.spark.run: fn must be callable, not {type(fn).__name__}")
    context = spark_context()
    num_proc = num_proc_setting(context, num_proc)
    timeout_s = _start_timeout(start_timeout)
    nics = nic_list(nics)
    host = store_address(context, nics)
    rank_env = {str(k): str(v) for k, v in (env or {}).items()}
    if nics:
        rank_env.setdefault(setting("network_interface").var, ",".join(nics))
    payload = cloudpickle.dumps((fn, tuple(args), dict(kwargs or {})))
    secret = new_secret()
    server = RendezvousServer(secret, host=host)
    server.start()
    printer = output.Printer(server, lambda: map(str, range(num_proc)), stdout or sys.stdout, stderr or sys.stderr,
                             prefix_output_with_timestamp).start()
    try:
        spec = task.TaskSpec(host, server.port, secret.hex(), payload, rank_env, executable)
        if verbose >= 2:
            log.info("roundel.spark: %d ranks, rendezvous store at %s:%d", num_proc, host, server.port)
        outcomes = _run_stage(context, spec, num_proc, timeout_s, server)
        failed = abort.first_failure(server)
    finally:
        printer.stop()
        server.stop()
    return _results(outcomes, failed)


def _run_stage(context, spec: task.TaskSpec, num_proc: int, timeout_s: float,
               server: RendezvousServer) -> list[RankOutcome]:
    """Run the barrier stage; raise TimeoutError when its tasks do not all start within ``timeout_s``."""
    group = f"roundel.spark.run.{os.getpid()}.{next(_job_ids)}"
    done: dict[str, Any] = {}

    def stage() -> None:
        try:
            context.setJobGroup(group, "roundel.spark.run", interruptOnCancel=True)
            rdd = context.parallelize(range(num_proc), num_proc).barrier()
            done["outcomes"] = rdd.mapPartitions(functools.partial(task.run_task, spec)).collect()
        except BaseException as exc:  # noqa: BLE001 - handed to the caller's thread
            done["error"] = exc

    thread = threading.Thread(target=stage, name="roundel-spark-stage", daemon=True)
    thread.start()
    deadline = time.monotonic() + timeout_s
    try:
        while thread.is_alive():
            thread.join(0.2)
            if deadline is not None and all(server.get(task.started_key(i)) is not None for i in range(num_proc)):
                deadline = None
            if deadline is not None and time.monotonic() > deadline:
                started = sum(server.get(task.started_key(i)) is not None for i in range(num_proc))
                raise TimeoutError(
                    f"roundel.spark.run: only {started} of {num_proc} Spark tasks started within the start "
                    f"timeout of {timeout_s:g} s. Each rank runs in its own task of a barrier stage, so the "
                    f"cluster needs {num_proc} free task slots at once (executors x cores per executor / "
                    "spark.task.cpus); lower num_proc, add executors, or raise start_timeout if they are "
                    "allocated on demand")
    except BaseException:
        context.cancelJobGroup(group)
        thread.join(_CANCEL_WAIT_S)
        raise
    if "error" in done:
        failed = abort.first_failure(server)
        raise RankFailedError(failed, "", f"roundel.spark.run: the Spark job failed"
                              f"{f' after rank {failed} failed' if failed is not None else ''}: "
                              f"{done['error']}") from done["error"]
    return done["outcomes"]


def _results(outcomes: list[RankOutcome], failed: int | None) -> list[Any]:
    by_rank = {o.rank: o for o in outcomes}
    if failed is None:
        failed = next((o.rank for o in sorted(outcomes, key=lambda o: o.rank) if not o.ok), None)
    if failed is not None:
        if failed in by_rank:
            raise by_rank[failed].failure("roundel.spark.run: ")
        raise RankFailedError(failed, "", f"roundel.spark.run: rank {failed} raised:\n")
    return [by_rank[rank].result("roundel.spark.run: ") for rank in range(len(by_rank))]
