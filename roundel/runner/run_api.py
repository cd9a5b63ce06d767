"""``roundel.run(fn, ...)``: run a Python function on every rank of a job, as ``horovod.run`` does.

The caller's process is the launcher (the same code as ``roundelrun``). The
function and its arguments are pickled with cloudpickle and put into the job's
rendezvous store before any worker starts; each worker
(``python -m roundel.runner.run_api``) reads them from the store, which only
clients holding the job's secret can reach, calls the function, and puts its
result (or its exception's traceback) back under ``run/result/<rank>``. Nothing
travels over an unauthenticated socket or lands in a file.
"""

from __future__ import annotations

import os
import sys
from typing import Any, Callable, Sequence

import cloudpickle

from roundel.common import basics
from roundel.rendezvous import identity
from roundel.runner import launch
from roundel.runner.outcome import RankFailedError, RankOutcome
from roundel.rendezvous.store import RendezvousClient

__all__ = ["RankFailedError", "run"]

_FUNCTION_KEY = "run/function"
_RESULT_KEY = "run/result/"


def _flag(argv: list[str], name: str, value) -> None:
    if value is None or value is False:
        return
    if value is True:
        argv.append(name)
    elif isinstance(value, (list, tuple)):
        argv += [name, *map(str, value)]
    else:
        argv.append(f"{name}={value}")  # one word, so that a value starting with '-' stays a value


def run(fn: Callable, args: Sequence = (), kwargs: dict | None = None, num_proc: int | None = None,
        min_num_proc: int | None = None, max_num_proc: int | None = None, slots: int | None = None,
        reset_limit: int | None = None, cooldown_range: tuple[float, float] | None = None,
        hosts: str | None = None, hostfile: str | None = None, host_discovery_script: str | None = None,
        start_timeout: float | None = None, ssh_port: int | None = None, ssh_identity_file: str | None = None,
        disable_cache: bool | None = None, output_filename: str | None = None, verbose: bool | None = None,
        use_gloo: bool | None = None, use_mpi: bool | None = None, mpi_args: str | None = None,
        network_interface: str | None = None, network_interfaces: str | Sequence[str] | None = None,
        executable: str | None = None, np: int | None = None, min_np: int | None = None,
        max_np: int | None = None) -> list[Any]:
    """Run ``fn(*args, **kwargs)`` on every rank of a job started like ``roundelrun`` would start it,
    and return the ranks' results as a list in rank order.

    The parameters are ``horovod.run``'s: ``num_proc`` (or ``np``) ranks on
    ``hosts``/``hostfile`` (default this machine), elastic with
    ``host_discovery_script`` and ``min_num_proc``/``max_num_proc``, and the
    launcher's options. ``executable`` is the Python the workers run (default
    this one). ``fn`` must be picklable by cloudpickle; a function defined in
    an importable module is pickled by reference, so that module must be
    importable on the workers too.

    Raises ValueError for bad arguments, and RankFailedError naming the
    failing rank with its traceback when a rank's ``fn`` raised or a rank died.
    """
    num_proc = num_proc if num_proc is not None else np
    if num_proc is None and host_discovery_script is None:
        num_proc = 1
    nics = network_interfaces if network_interfaces is not None else network_interface
    if isinstance(nics, (list, tuple)):
        nics = ",".join(nics)
    argv: list[str] = []
    for name, value in (("--num-proc", num_proc), ("--min-np", min_num_proc if min_num_proc is not None else min_np),
                        ("--max-np", max_num_proc if max_num_proc is not None else max_np),
                        ("--slots-per-host", slots), ("--reset-limit", reset_limit),
                        ("--blacklist-cooldown-range", cooldown_range), ("--hosts", hosts), ("--hostfile", hostfile),
                        ("--host-discovery-script", host_discovery_script), ("--start-timeout", start_timeout),
                        ("--ssh-port", ssh_port), ("--ssh-identity-file", ssh_identity_file),
                        ("--disable-cache", disable_cache), ("--output-filename", output_filename),
                        ("--verbose", verbose), ("--gloo", use_gloo), ("--mpi", use_mpi),
                        ("--mpi-args", mpi_args), ("--network-interfaces", nics)):
        _flag(argv, name, value)
    payload = cloudpickle.dumps((fn, tuple(args), dict(kwargs or {})))
    argv += ["--", executable or sys.executable, "-m", "roundel.runner.run_api"]
    stores = []

    def ship(server) -> None:
        server.set(_FUNCTION_KEY, payload)
        stores.append(server)

    code = launch.run(argv, on_store=ship)
    if not stores:
        raise ValueError(f"roundel.run: the launcher refused the arguments (exit {code}); see its error above")
    return _results(stores[0], code, max(num_proc or 0, max_num_proc or max_np or 0))


def _results(server, code: int, expected: int) -> list[Any]:
    """The ranks' results in rank order (ranks 0 .. ``expected``-1 and any further ones that reported);
    raise RankFailedError for the first rank that failed."""
    outcomes: dict[int, RankOutcome] = {}
    rank = 0
    while True:
        raw = server.get(f"{_RESULT_KEY}{rank}")
        if raw is None and rank >= expected:
            break
        if raw is not None:
            outcomes[rank] = RankOutcome.decode(raw)
        rank += 1
    for outcome in outcomes.values():
        if not outcome.ok:
            raise outcome.failure("roundel.run: ")
    if code != 0 or not outcomes:
        raise RankFailedError(None, "", f"roundel.run: the job failed (roundelrun exit status {code}) with "
                                        f"results from {len(outcomes)} rank(s); see the ranks' output above")
    return [outcome.result("roundel.run: ") for _, outcome in sorted(outcomes.items())]


def _worker_rank() -> int:
    """This worker's rank: the launcher's, or (elastic) the one ``init()`` gave it."""
    if "ROUNDEL_RANK" in os.environ:
        return int(os.environ["ROUNDEL_RANK"])
    return basics.rank()  # an elastic worker's rank exists only once fn called init()


def _worker_main() -> int:
    """Worker side: fetch the function from the store, call it, store its result or traceback."""
    env = os.environ
    client = RendezvousClient(env[identity.RENDEZVOUS_ADDR], int(env[identity.RENDEZVOUS_PORT]),
                              bytes.fromhex(env[identity.SECRET]))
    try:
        fn, args, kwargs = cloudpickle.loads(client.get(_FUNCTION_KEY))
        outcome = RankOutcome.of_call(fn, args, kwargs, rank_of=_worker_rank)
        client.set(f"{_RESULT_KEY}{outcome.rank}", outcome.encode())
    finally:
        client.close()
    return 0 if outcome.ok else 1


if __name__ == "__main__":
    sys.exit(_worker_main())
