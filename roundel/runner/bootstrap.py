"""How a worker finds its identity and the job's rendezvous store at ``hvd.init()``.

Four ways a worker can have been started:

* by ``roundelrun``: identity, store address and secret are in ``ROUNDEL_*``
  variables (:meth:`Identity.from_env`);
* by ``torchrun``: rank 0 starts a roundel store on a free port and publishes
  its address and a fresh secret under a ``roundel/...`` key of torchrun's
  own store at ``MASTER_ADDR:MASTER_PORT`` (the agent's TCPStore; without an
  agent, rank 0 serves a TCPStore there only until every rank has read the
  key). roundel never listens on ``MASTER_PORT`` itself;
* by ``mpirun``/``mpiexec`` (Open MPI or MPICH): rank 0 starts the store and
  broadcasts address and secret over ``MPI.COMM_WORLD`` with mpi4py, which
  must then be installed (``pip install mpi4py``);
* by Slurm's ``srun``: rank 0 starts the store on the first host of
  ``SLURM_STEP_NODELIST`` at port ``20000 + (SLURM_JOB_ID * 16 +
  SLURM_STEP_ID) % 30000``; ``ROUNDEL_RENDEZVOUS_ADDR`` /
  ``ROUNDEL_RENDEZVOUS_PORT`` override both, and the secret is
  ``ROUNDEL_SECRET`` when exported before ``srun`` (recommended:
  ``export ROUNDEL_SECRET=$(openssl rand -hex 32)``), else one derived from
  the job id, which only keeps jobs apart, not other users out.

An elastic worker (``roundelrun --host-discovery-script``) has no rank in
its environment, only ``ROUNDEL_ELASTIC_WORKER_ID``: it joins the driver's
next generation through the store and gets its identity there
(:mod:`roundel.runner.elastic_rendezvous`).

Under any launcher, ``ROUNDEL_RENDEZVOUS_ADDR``, ``ROUNDEL_RENDEZVOUS_PORT``
and ``ROUNDEL_SECRET`` together with ``ROUNDEL_RENDEZVOUS_SERVER=external``
name a store that is already running (``roundelrun --mpi`` passes them).
Cross ranks and, where the launcher does not give them, local ranks and
sizes are then worked out by exchanging host names through the store.
"""

from __future__ import annotations

import ctypes
import dataclasses
import hashlib
import json
import os
import re
import signal
import socket
import sys
import time
from datetime import timedelta
from typing import Mapping

from roundel.common import identity as identity_env
from roundel.common.errors import RoundelInternalError, SettingsError
from roundel.common.identity import Identity, LauncherIdentity, cross_ranks, detect_launcher
from roundel.runner import elastic_rendezvous, network
from roundel.runner.rendezvous import RendezvousClient, RendezvousServer, new_secret

__all__ = ["Bootstrap", "advertise_address", "discover", "slurm_first_host", "slurm_port"]

EXTERNAL_SERVER = "ROUNDEL_RENDEZVOUS_SERVER"
_PR_SET_PDEATHSIG = 1


@dataclasses.dataclass
class Bootstrap:
    """Where this worker's store is, the secret, and the server this process runs (rank 0), if any."""

    host: str
    port: int
    secret: bytes
    server: RendezvousServer | None
    identity: Identity | None  # None until exchanged (another launcher's partial identity)
    launcher: LauncherIdentity | None = None
    worker_id: str | None = None  # an elastic worker, which joins the driver's next generation
    generation: int | None = None  # set by complete() for an elastic worker
    hosts_version: int = 0

    @property
    def elastic(self) -> bool:
        return self.worker_id is not None

    def complete(self, client: RendezvousClient, prefix: str, timeout_s: float) -> Identity:
        """The full Identity; for another launcher's worker, exchange host names and local ranks
        through the store (a collective over all ranks). Raises RoundelInternalError on timeout."""
        if self.identity is not None:
            return self.identity
        if self.elastic:
            assignment = elastic_rendezvous.join(client, self.worker_id, _elastic_timeout())
            self.generation, self.hosts_version = assignment.generation, assignment.hosts_version
            return assignment.identity
        info = self.launcher
        host_key = socket.gethostname()
        if info.launcher == "torchrun" and "GROUP_RANK" in os.environ:
            host_key += "/" + os.environ["GROUP_RANK"]
        mine = json.dumps([host_key, -1 if info.local_rank is None else info.local_rank]).encode()
        try:
            client.set(f"{prefix}boot/{info.rank}", mine)
            if info.rank == 0:
                table = [json.loads(client.get(f"{prefix}boot/{r}", timeout_s)) for r in range(info.size)]
                client.set(f"{prefix}boot/table", json.dumps(table).encode())
            else:
                table = json.loads(client.get(f"{prefix}boot/table", timeout_s))
        except Exception as exc:
            raise RoundelInternalError(
                f"rank {info.rank} of {info.size} (started by {info.launcher}) could not meet the other "
                f"ranks at the rendezvous store {self.host}:{self.port}: {exc}") from exc
        counts: dict[str, int] = {}
        for entry in table:  # local ranks the launcher did not give: order on the host by rank
            if entry[1] < 0:
                entry[1] = counts.get(entry[0], 0)
            counts[entry[0]] = counts.get(entry[0], 0) + 1
        ident = cross_ranks([(h, lr) for h, lr in table])[info.rank]
        local_size = info.local_size if info.local_size is not None else ident.local_size
        ident = dataclasses.replace(ident, local_size=local_size, hostname=socket.gethostname())
        ident.validate()
        self.identity = ident
        return ident


def follow_launcher(env: Mapping[str, str]) -> None:
    """Make this worker get SIGTERM when the roundelrun that started it dies, even by SIGKILL (Linux).

    Only for a worker whose parent is that roundelrun (not one started
    through a wrapper such as a shell, nor over ssh, where the remote side
    stops the worker when the connection closes).
    """
    launcher = env.get(identity_env.LAUNCHER_PID)
    if not launcher or not sys.platform.startswith("linux") or os.getppid() != int(launcher):
        return
    try:
        ctypes.CDLL(None, use_errno=True).prctl(_PR_SET_PDEATHSIG, signal.SIGTERM)
    except (OSError, AttributeError):
        return
    if os.getppid() != int(launcher):  # it died before prctl took effect
        os.kill(os.getpid(), signal.SIGTERM)


def _roundelrun_store(env: Mapping[str, str]) -> tuple[str, int, bytes]:
    try:
        return (env[identity_env.RENDEZVOUS_ADDR], int(env[identity_env.RENDEZVOUS_PORT]),
                bytes.fromhex(env[identity_env.SECRET]))
    except (KeyError, ValueError) as exc:
        raise RoundelInternalError(
            f"the rendezvous variables are missing or malformed ({exc}); start the script "
            "with roundelrun") from None


def _elastic_timeout() -> float:
    try:
        return float(os.environ.get(elastic_rendezvous.TIMEOUT, "600"))
    except ValueError:
        raise SettingsError(f"{elastic_rendezvous.TIMEOUT}={os.environ[elastic_rendezvous.TIMEOUT]!r} "
                            "must be a number of seconds") from None


def _start_server(bind: str, port: int = 0) -> tuple[RendezvousServer, bytes]:
    secret = new_secret()
    server = RendezvousServer(secret, bind, port)
    server.start()
    return server, secret


def _explicit(env: Mapping[str, str]) -> tuple[str, int, bytes] | None:
    try:
        if env.get(EXTERNAL_SERVER) == "external":
            return (env[identity_env.RENDEZVOUS_ADDR], int(env[identity_env.RENDEZVOUS_PORT]),
                    bytes.fromhex(env[identity_env.SECRET]))
    except (KeyError, ValueError) as exc:
        raise RoundelInternalError(f"{EXTERNAL_SERVER}=external needs ROUNDEL_RENDEZVOUS_ADDR, "
                                   f"ROUNDEL_RENDEZVOUS_PORT and ROUNDEL_SECRET (hex): {exc}") from None
    return None


def _torchrun(info: LauncherIdentity, env: Mapping[str, str], prefix: str, timeout_s: float):
    try:
        from torch.distributed import TCPStore
    except ImportError:
        raise RoundelInternalError("started by torchrun but torch.distributed is not importable") from None
    master, master_port = env["MASTER_ADDR"], int(env["MASTER_PORT"])
    agent = env.get("TORCHELASTIC_USE_AGENT_STORE", "").lower() == "true"
    serve = info.rank == 0 and not agent
    try:
        store = TCPStore(master, master_port, info.size if serve else None, serve,
                         timeout=timedelta(seconds=timeout_s), wait_for_workers=False)
    except Exception as exc:
        raise RoundelInternalError(f"rank {info.rank} could not reach torchrun's store at "
                                   f"{master}:{master_port}: {exc}") from exc
    key = (f"roundel/{env.get('TORCHELASTIC_RUN_ID', 'none')}/{env.get('TORCHELASTIC_RESTART_COUNT', '0')}/"
           f"{prefix}rendezvous")
    server = None
    try:
        if info.rank == 0:
            local_only = info.local_size is not None and info.local_size == info.size
            host = "127.0.0.1" if local_only else network.reachable_address(master, env)
            server, secret = _start_server(host, int(env.get(identity_env.RENDEZVOUS_PORT, 0)))
            port = server.port
            store.set(key, json.dumps([host, port, secret.hex()]))
            if serve:  # our own TCPStore on MASTER_PORT: keep it until every rank has read the key
                deadline = time.monotonic() + timeout_s
                while store.add(key + "/read", 0) < info.size - 1:
                    if time.monotonic() > deadline:
                        raise RoundelInternalError(f"only {store.add(key + '/read', 0) + 1} of {info.size} "
                                                   f"ranks reached {master}:{master_port} within {timeout_s:g} s")
                    time.sleep(0.02)
        else:
            host, port, secret_hex = json.loads(store.get(key))
            secret = bytes.fromhex(secret_hex)
            if not agent:
                store.add(key + "/read", 1)
    except RoundelInternalError:
        if server is not None:
            server.stop()
        raise
    except Exception as exc:
        if server is not None:
            server.stop()
        raise RoundelInternalError(f"rank {info.rank} could not agree on roundel's rendezvous through "
                                   f"torchrun's store at {master}:{master_port}: {exc}") from exc
    finally:
        del store
    return host, int(port), secret, server


def _mpi(info: LauncherIdentity, env: Mapping[str, str]):
    try:
        from mpi4py import MPI
    except ImportError:
        raise RoundelInternalError(
            f"this process was started by {'mpirun' if info.launcher == 'openmpi' else 'mpiexec'} "
            f"(rank {info.rank} of {info.size}); roundel agrees on its rendezvous address over MPI and needs "
            "mpi4py for that: pip install mpi4py (or pip install 'roundel[mpi]'), or start the job with "
            "'roundelrun --mpi'") from None
    comm = MPI.COMM_WORLD
    if comm.Get_rank() != info.rank or comm.Get_size() != info.size:
        raise RoundelInternalError(f"MPI.COMM_WORLD says rank {comm.Get_rank()} of {comm.Get_size()} but the "
                                   f"launcher's variables say {info.rank} of {info.size}")
    server = None
    message = None
    if info.rank == 0:
        try:
            local_only = info.local_size is not None and info.local_size == info.size
            host = "127.0.0.1" if local_only else network.reachable_address(None, env)
            server, secret = _start_server(host, int(env.get(identity_env.RENDEZVOUS_PORT, 0)))
            message = ("ok", host, server.port, secret.hex())
        except Exception as exc:  # tell the others instead of leaving them waiting
            message = ("error", f"{type(exc).__name__}: {exc}")
    message = comm.bcast(message, root=0)
    if message[0] != "ok":
        raise RoundelInternalError(f"rank 0 could not start the rendezvous store: {message[1]}")
    _, host, port, secret_hex = message
    return host, int(port), bytes.fromhex(secret_hex), server


def _expand_first(nodelist: str) -> str:
    """The first host of a Slurm node list such as ``node[03-05,9],gpu1``."""
    match = re.match(r"([^,\[]+)(?:\[([^\]]+)\])?", nodelist.strip())
    if not match:
        raise ValueError(f"cannot parse Slurm node list {nodelist!r}")
    base, ranges = match.group(1), match.group(2)
    if not ranges:
        return base
    return base + ranges.split(",")[0].split("-")[0]


def slurm_first_host(env: Mapping[str, str]) -> str:
    """The first host of the job step's node list (``SLURM_STEP_NODELIST``, else ``SLURM_JOB_NODELIST``)."""
    nodelist = env.get("SLURM_STEP_NODELIST") or env.get("SLURM_JOB_NODELIST") or env.get("SLURM_NODELIST")
    if not nodelist:
        raise RoundelInternalError("started by srun but SLURM_STEP_NODELIST/SLURM_JOB_NODELIST is not set; "
                                   "set ROUNDEL_RENDEZVOUS_ADDR to rank 0's host")
    return _expand_first(nodelist)


def slurm_port(env: Mapping[str, str]) -> int:
    """The rendezvous port of a Slurm job step: ``20000 + (job_id * 16 + step_id) % 30000``."""
    job = int(env.get("SLURM_JOB_ID") or env.get("SLURM_JOBID") or 0)
    step = int(env.get("SLURM_STEP_ID") or env.get("SLURM_STEPID") or 0)
    return 20000 + (job * 16 + step) % 30000


def _srun(info: LauncherIdentity, env: Mapping[str, str]):
    host = env.get(identity_env.RENDEZVOUS_ADDR) or slurm_first_host(env)
    port = int(env.get(identity_env.RENDEZVOUS_PORT) or slurm_port(env))
    if env.get(identity_env.SECRET):
        secret = bytes.fromhex(env[identity_env.SECRET])
    else:
        seed = f"roundel-slurm/{env.get('SLURM_JOB_ID', '')}/{env.get('SLURM_STEP_ID', '')}/{os.getuid()}"
        secret = hashlib.sha256(seed.encode()).digest()
    server = None
    if info.rank == 0:
        server = RendezvousServer(secret, "0.0.0.0", port)
        try:
            server.start()
        except OSError as exc:
            raise RoundelInternalError(
                f"rank 0 could not listen on port {port} for the rendezvous ({exc}); choose another with "
                "ROUNDEL_RENDEZVOUS_PORT") from None
    return host, port, secret, server


def discover(prefix: str, timeout_s: float, environ: Mapping[str, str] | None = None) -> Bootstrap:
    """Find this worker's identity and rendezvous store (starting the store on rank 0 where needed).

    With no launcher at all, a job of one process with its own store.
    Raises SettingsError for malformed launcher variables and
    RoundelInternalError when the ranks cannot agree on a store.
    """
    env = os.environ if environ is None else environ
    follow_launcher(env)
    worker_id = elastic_rendezvous.worker_id(env)
    if worker_id is not None:
        return Bootstrap(*_roundelrun_store(env), None, None, worker_id=worker_id)
    ident = Identity.from_env(env)
    if ident is not None:
        return Bootstrap(*_roundelrun_store(env), None, ident)
    info = detect_launcher(env)
    if info is None:
        server, secret = _start_server("127.0.0.1")
        return Bootstrap("127.0.0.1", server.port, secret, server,
                         Identity(0, 1, 0, 1, 0, 1, socket.gethostname()))
    explicit = _explicit(env)
    if explicit is not None:
        host, port, secret = explicit
        server = None
    elif info.launcher == "torchrun":
        host, port, secret, server = _torchrun(info, env, prefix, timeout_s)
    elif info.launcher in ("openmpi", "mpich"):
        host, port, secret, server = _mpi(info, env)
    else:
        host, port, secret, server = _srun(info, env)
    return Bootstrap(host, port, secret, server, None, info)


def advertise_address(rendezvous_host: str, rendezvous_port: int) -> str:
    """The address this worker gives its peers for Gloo: that of ``ROUNDEL_NETWORK_INTERFACE``
    (or ``HOROVOD_GLOO_IFACE``) when set, else that of the interface routing to the store."""
    for var in network.INTERFACE_VARS:
        if os.environ.get(var):
            try:
                return network.interface_address(os.environ[var])
            except ValueError as exc:
                raise RoundelInternalError(f"{var}: {exc}") from None
    return network.route_source(rendezvous_host, rendezvous_port) or "127.0.0.1"
