"""How a worker finds its identity and the job's rendezvous store at ``hvd.init()``.

The ways a worker can have been started:

* by ``roundelrun``: identity, store address and secret are in ``ROUNDEL_*``
  variables (:meth:`Identity.from_env`);
* by ``torchrun``: rank 0 starts a roundel store on a free port and publishes
  its address (never the secret: that store has no authentication) under a
  ``roundel/...`` key of torchrun's own store at ``MASTER_ADDR:MASTER_PORT``
  (the agent's TCPStore; without an agent, rank 0 serves a TCPStore there only
  until every rank has read the key). roundel never listens on
  ``MASTER_PORT`` itself;
* by ``mpirun``/``mpiexec`` (Open MPI, MPICH, PBS's PALS, a PMIx launcher): rank 0 starts the store and
  broadcasts address and secret over ``MPI.COMM_WORLD`` with mpi4py, which
  must then be installed (``pip install mpi4py``);
* by Slurm's ``srun``: rank 0 starts the store on its own node, on a free
  port that it publishes with the secret and its address in the private file
  (nothing public predicts the port, so no one can take it first);
  ``ROUNDEL_RENDEZVOUS_ADDR`` / ``ROUNDEL_RENDEZVOUS_PORT`` override both
  (with ``ROUNDEL_SECRET`` and ``ROUNDEL_RENDEZVOUS_PORT`` both set, no file
  is needed: the others then look on the step's first node, where Slurm
  places task 0 unless ``srun -m arbitrary`` placed it elsewhere);
* as a pod of a Kubernetes Indexed Job (``JOB_COMPLETION_INDEX`` with
  ``ROUNDEL_NUM_PROC``): index 0 starts the store on
  ``ROUNDEL_RENDEZVOUS_PORT`` and the others reach it at
  ``ROUNDEL_RENDEZVOUS_ADDR``, index 0's stable name, with the
  ``ROUNDEL_SECRET`` of a Kubernetes Secret.

The secret: ``ROUNDEL_SECRET`` (hex) when exported before the launcher
(``export ROUNDEL_SECRET=$(openssl rand -hex 32)``), always; else a fresh
random one from rank 0, over MPI under ``mpirun``, and under ``srun`` and
``torchrun`` through a private file in the shared home directory
(:mod:`roundel.rendezvous.secret_file`), removed once every rank has joined.

Rank 0's store listens on the job's address only (the first host's, or that
of the job's network interface setting, which the caller reads from the
settings table and passes as ``nics``); ``ROUNDEL_RENDEZVOUS_BIND`` (for
example ``0.0.0.0``) chooses another.

An elastic worker (``roundelrun --host-discovery-script``) has no rank in
its environment, only ``ROUNDEL_ELASTIC_WORKER_ID``: it joins the driver's
next generation through the store and gets its identity there
(:mod:`roundel.rendezvous.elastic_join`).

Under any launcher, ``ROUNDEL_RENDEZVOUS_ADDR``, ``ROUNDEL_RENDEZVOUS_PORT``
and ``ROUNDEL_SECRET`` together with ``ROUNDEL_RENDEZVOUS_SERVER=external``
name a store that is already running (``roundelrun --mpi`` passes them).
Cross ranks and, where the launcher does not give them, local ranks and
sizes are then worked out by exchanging host names through the store.
"""

from __future__ import annotations

import ctypes
import dataclasses
import json
import os
import re
import secrets
import signal
import socket
import sys
import time
from datetime import timedelta
from pathlib import Path
from typing import Mapping

import psutil

from roundel.errors import RoundelInternalError, SettingsError
from roundel.rendezvous import elastic_join, horovod_gloo, network, secret_file, slurm
from roundel.rendezvous import identity as identity_env
from roundel.rendezvous.identity import Identity, LauncherIdentity, cross_ranks, detect_launcher
from roundel.rendezvous.store import RendezvousClient, RendezvousServer, new_secret

__all__ = ["Bootstrap", "advertise_address", "discover", "slurm_first_host"]

EXTERNAL_SERVER = "ROUNDEL_RENDEZVOUS_SERVER"
RENDEZVOUS_BIND = identity_env.RENDEZVOUS_BIND
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
    secret_path: Path | None = None  # the secret file rank 0 wrote for the others, until they joined
    served_by: str = "roundelrun"  # the process that serves the store, as errors name it

    def forget_secret_file(self) -> None:
        """Delete the secret file rank 0 wrote (once every rank has joined, or when init fails)."""
        if self.secret_path is not None:
            secret_file.remove(self.secret_path)
            self.secret_path = None

    @property
    def elastic(self) -> bool:
        return self.worker_id is not None

    def complete(self, client: RendezvousClient, prefix: str, timeout_s: float, elastic_timeout_s: float) -> Identity:
        """The full Identity; for another launcher's worker, exchange host names and local ranks
        through the store (a collective over all ranks); an elastic worker waits up to
        ``elastic_timeout_s`` for its place in the next generation. Raises RoundelInternalError on timeout."""
        if self.identity is not None:
            return self.identity
        if self.worker_id is not None:  # elastic
            assignment = elastic_join.join(client, self.worker_id, elastic_timeout_s)
            self.generation, self.hosts_version = assignment.generation, assignment.hosts_version
            return assignment.identity
        info = self.launcher
        assert info is not None  # discover() gives one whenever it gives no identity and no worker id
        host_key = socket.gethostname()
        if info.launcher == "torchrun" and "GROUP_RANK" in os.environ:
            host_key += "/" + os.environ["GROUP_RANK"]
        mine = json.dumps([host_key, -1 if info.local_rank is None else info.local_rank]).encode()
        try:
            client.set(f"{prefix}boot/{info.rank}", mine)
            if info.rank == 0:
                assert info.size is not None  # only a PMIx launcher leaves it out, and _mpi() fills it in
                table = [json.loads(client.get(f"{prefix}boot/{r}", timeout_s)) for r in range(info.size)]
                self.forget_secret_file()  # every rank has proven the secret: the file has served
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
    """Make this worker get SIGTERM when the process that started it dies, even by SIGKILL (Linux).

    Only for a worker whose parent is the process named in ``ROUNDEL_LAUNCHER_PID``: roundelrun's
    watchdog (:mod:`roundel.runner.reaper`, which also stops whatever a wrapper script started) or a
    Spark task; over ssh the remote side stops the worker when the connection closes.
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


def _start_server(bind: str, port: int, secret: bytes) -> RendezvousServer:
    server = RendezvousServer(secret, bind, port)
    server.start()
    return server


def _bind_address(env: Mapping[str, str], address: str) -> str:
    """Where rank 0's store listens: ``address`` unless ``ROUNDEL_RENDEZVOUS_BIND`` asks for another."""
    return env.get(RENDEZVOUS_BIND) or address


def _explicit(env: Mapping[str, str]) -> tuple[str, int, bytes] | None:
    try:
        if env.get(EXTERNAL_SERVER) == "external":
            return (env[identity_env.RENDEZVOUS_ADDR], int(env[identity_env.RENDEZVOUS_PORT]),
                    bytes.fromhex(env[identity_env.SECRET]))
    except (KeyError, ValueError) as exc:
        raise RoundelInternalError(f"{EXTERNAL_SERVER}=external needs ROUNDEL_RENDEZVOUS_ADDR, "
                                   f"ROUNDEL_RENDEZVOUS_PORT and ROUNDEL_SECRET (hex): {exc}") from None
    return None


def _torchrun(info: LauncherIdentity, env: Mapping[str, str], prefix: str, timeout_s: float, nics: str):
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
    run = f"{env.get('TORCHELASTIC_RUN_ID', 'none')}/{env.get('TORCHELASTIC_RESTART_COUNT', '0')}"
    key = f"roundel/{run}/{prefix}rendezvous"
    exported = secret_file.exported_secret(env)
    server = None
    path = None
    try:
        if info.rank == 0:
            local_only = info.local_size is not None and info.local_size == info.size
            host = "127.0.0.1" if local_only else network.reachable_address(master, nics)
            secret = exported or new_secret()
            server = _start_server(_bind_address(env, host), int(env.get(identity_env.RENDEZVOUS_PORT, 0)), secret)
            port = server.port
            # only the address goes through torchrun's unauthenticated store: a forged one fails the
            # store's proof of the secret. The nonce names this start's secret file, never a stale one.
            nonce = "" if exported else secrets.token_hex(16)
            if nonce:
                path = _torchrun_secret_path(run, master, master_port, prefix, nonce, env)
                secret_file.publish(path, secret_file.JobSecret(secret, host, port))
            store.set(key, json.dumps([host, port, nonce]))
            if serve:  # our own TCPStore on MASTER_PORT: keep it until every rank has read the key
                assert info.size is not None  # torchrun sets WORLD_SIZE
                deadline = time.monotonic() + timeout_s
                while store.add(key + "/read", 0) < info.size - 1:
                    if time.monotonic() > deadline:
                        raise RoundelInternalError(f"only {store.add(key + '/read', 0) + 1} of {info.size} "
                                                   f"ranks reached {master}:{master_port} within {timeout_s:g} s")
                    time.sleep(0.02)
        else:
            host, port, nonce = json.loads(store.get(key))
            if not agent:
                store.add(key + "/read", 1)
            if exported:
                secret = exported
            else:  # the address too comes from the private file: the one in torchrun's store may be forged
                job = _torchrun_secret_from_file(info, run, master, master_port, prefix, nonce, env, timeout_s)
                secret, host, port = job.secret, job.host, job.port
    except RoundelInternalError:
        _abandon(server, path)
        raise
    except Exception as exc:
        _abandon(server, path)
        raise RoundelInternalError(f"rank {info.rank} could not agree on roundel's rendezvous through "
                                   f"torchrun's store at {master}:{master_port}: {exc}") from exc
    finally:
        del store
    return host, int(port), secret, server, path


def _abandon(server: RendezvousServer | None, path: Path | None) -> None:
    if server is not None:
        server.stop()
    if path is not None:
        secret_file.remove(path)


def _torchrun_secret_path(run: str, master: str, master_port: int, prefix: str, nonce: str,
                          env: Mapping[str, str]) -> Path:
    return secret_file.job_secret_path("torchrun", f"{run}/{master}:{master_port}/{prefix}{nonce}", env)


def _torchrun_secret_from_file(info: LauncherIdentity, run: str, master: str, master_port: int, prefix: str,
                               nonce, env: Mapping[str, str], timeout_s: float) -> secret_file.JobSecret:
    if not isinstance(nonce, str) or not re.fullmatch(r"[0-9a-f]{32}", nonce):
        raise RoundelInternalError(
            f"rank {info.rank}: rank 0 used an exported {identity_env.SECRET} but this rank has none (or "
            f"torchrun's store at {master}:{master_port} holds a malformed roundel entry); export the same "
            f"{identity_env.SECRET} for every rank, or for none")
    path = _torchrun_secret_path(run, master, master_port, prefix, nonce, env)
    return secret_file.read(path, timeout_s, f"rank {info.rank} of {info.size} (started by torchrun)")


def _mpi(info: LauncherIdentity, env: Mapping[str, str], nics: str):
    try:
        from mpi4py import MPI
    except ImportError:
        raise RoundelInternalError(
            f"this process was started by {'mpirun' if info.launcher == 'openmpi' else 'mpiexec'} "
            f"(rank {info.rank}); roundel agrees on its rendezvous address over MPI and needs "
            "mpi4py for that: pip install mpi4py (or pip install 'roundel[mpi]'), or start the job with "
            "'roundelrun --mpi'") from None
    comm = MPI.COMM_WORLD
    if comm.Get_rank() != info.rank or info.size not in (None, comm.Get_size()):
        raise RoundelInternalError(f"MPI.COMM_WORLD says rank {comm.Get_rank()} of {comm.Get_size()} but the "
                                   f"launcher's variables say {info.rank} of {info.size}")
    info = dataclasses.replace(info, size=comm.Get_size())  # a PMIx launcher may not have said
    server = None
    message: tuple | None = None
    if info.rank == 0:
        try:
            local_only = info.local_size is not None and info.local_size == info.size
            host = "127.0.0.1" if local_only else network.reachable_address(None, nics)
            secret = secret_file.exported_secret(env) or new_secret()
            server = _start_server(_bind_address(env, host), int(env.get(identity_env.RENDEZVOUS_PORT, 0)), secret)
            message = ("ok", host, server.port, secret.hex())
        except Exception as exc:  # tell the others instead of leaving them waiting
            message = ("error", f"{type(exc).__name__}: {exc}")
    message = comm.bcast(message, root=0)
    if message[0] != "ok":
        raise RoundelInternalError(f"rank 0 could not start the rendezvous store: {message[1]}")
    _, host, port, secret_hex = message
    return info, (host, int(port), bytes.fromhex(secret_hex), server, None)


def slurm_first_host(env: Mapping[str, str]) -> str:
    """The first host of the job step's node list (``SLURM_STEP_NODELIST``, else ``SLURM_JOB_NODELIST``)."""
    try:
        nodes = slurm.step_nodes(env)
    except ValueError as exc:
        raise RoundelInternalError(f"{exc}; set ROUNDEL_RENDEZVOUS_ADDR to rank 0's host") from None
    if not nodes:
        raise RoundelInternalError("started by srun but SLURM_STEP_NODELIST/SLURM_JOB_NODELIST is not set; "
                                   "set ROUNDEL_RENDEZVOUS_ADDR to rank 0's host")
    return nodes[0]


def _is_own_address(addr: str) -> bool:
    if network.is_loopback(addr):
        return True
    return any(entry.address.split("%", 1)[0] == addr
               for entries in psutil.net_if_addrs().values() for entry in entries)


def _own_listen_address(host: str | None, env: Mapping[str, str], nics: str) -> str:
    """The address rank 0's store listens on, which the other ranks reach: that of the interfaces ``nics``
    names; else the address of ``host`` (``ROUNDEL_RENDEZVOUS_ADDR``) or of this node's name (Slurm's,
    else the host name) when it is this machine's (loopback only for a one-node Slurm step); else this
    machine's reachable address."""
    if nics:
        return network.interface_address(nics)
    try:
        addr = network.resolve(host or slurm.this_node(env) or socket.gethostname())
    except ValueError:
        addr = None
    if addr and _is_own_address(addr) and (not network.is_loopback(addr) or slurm.single_node(env)):
        return addr
    return network.reachable_address()


_SRUN_FIX = ("export ROUNDEL_SECRET=$(openssl rand -hex 32) and ROUNDEL_RENDEZVOUS_PORT=<a free port of rank "
             "0's host> before srun (every rank must see the same values; with 'srun -m arbitrary' also "
             "ROUNDEL_RENDEZVOUS_ADDR=<rank 0's host>), or give every rank the same private directory with "
             "ROUNDEL_SECRET_DIR (a home directory shared by the hosts)")


def _srun(info: LauncherIdentity, env: Mapping[str, str], prefix: str, timeout_s: float, nics: str):
    """Rank 0 serves the store on its own node. Its address, port and the secret reach the others through
    the private file, except what every rank already knows: an exported secret and port, and the address
    when ROUNDEL_RENDEZVOUS_ADDR names it or Slurm places task 0 on the step's first node."""
    named = env.get(identity_env.RENDEZVOUS_ADDR)
    port = int(env.get(identity_env.RENDEZVOUS_PORT) or 0)
    secret = secret_file.exported_secret(env)
    path = None
    if secret is None or not port or not (named or slurm.rank0_on_first_node(env)):
        job = env.get("SLURM_JOB_ID") or env.get("SLURM_JOBID") or "0"
        step = env.get("SLURM_STEP_ID") or env.get("SLURM_STEPID") or "0"
        path = secret_file.job_secret_path("srun", f"{job}.{step}.{prefix.rstrip('/')}", env)
    if info.rank != 0:
        if path is None:
            return named or slurm_first_host(env), port, secret, None, None
        published = secret_file.read(path, timeout_s, f"rank {info.rank} of {info.size} (started by srun)",
                                     _SRUN_FIX)
        return published.host, published.port, secret or published.secret, None, None
    if path is None and not named:
        first, node = slurm_first_host(env), slurm.this_node(env)
        if node is not None and node != first:
            raise RoundelInternalError(
                f"rank 0 runs on {node}, not on the step's first node {first}, where the other ranks look for "
                f"the rendezvous store; set ROUNDEL_RENDEZVOUS_ADDR={node} for every rank, or leave "
                f"{identity_env.RENDEZVOUS_PORT} unset so that rank 0 publishes its address in the private file")
    secret = secret or new_secret()
    try:
        listen = _own_listen_address(named, env, nics)
    except ValueError as exc:
        raise RoundelInternalError(f"rank 0 cannot choose the address to listen on: {exc}") from None
    host = named or listen
    server = secret_file.serve(secret, _bind_address(env, listen), port, host, path,
                               f"choose another port with ROUNDEL_RENDEZVOUS_PORT, or the address with "
                               f"{RENDEZVOUS_BIND}")
    return host, server.port, secret, server, path


def _indexed_job(info: LauncherIdentity, env: Mapping[str, str], nics: str):
    """A pod of a Kubernetes Indexed Job: index 0 serves the store on ``ROUNDEL_RENDEZVOUS_PORT``; the others
    reach it at ``ROUNDEL_RENDEZVOUS_ADDR`` (index 0's stable name under the Job's headless Service) with the
    ``ROUNDEL_SECRET`` every pod gets from a Kubernetes Secret: pods share no file system to pass one."""
    missing = [var for var in (identity_env.RENDEZVOUS_ADDR, identity_env.RENDEZVOUS_PORT, identity_env.SECRET)
               if not env.get(var)]
    if missing:
        raise SettingsError(
            f"pod {info.rank} of a Kubernetes Indexed Job needs {', '.join(missing)}: set "
            f"{identity_env.RENDEZVOUS_ADDR}=<job name>-0.<headless Service>, {identity_env.RENDEZVOUS_PORT}=<a "
            f"port> and {identity_env.SECRET} from a Secret in every pod (examples/kubernetes/indexed-job.yaml)")
    host, port, secret = env[identity_env.RENDEZVOUS_ADDR], int(env[identity_env.RENDEZVOUS_PORT]), \
        secret_file.exported_secret(env)
    if info.rank != 0:
        return host, port, secret, None, None
    assert secret is not None  # ROUNDEL_SECRET is set: checked above
    try:  # index 0's own name may not be in the cluster's DNS yet: its address then comes from its interfaces
        listen = _own_listen_address(host, env, nics)
    except ValueError as exc:
        raise RoundelInternalError(f"rank 0 cannot choose the address to listen on: {exc}") from None
    server = secret_file.serve(secret, _bind_address(env, listen), port, host, None,
                               f"choose another {identity_env.RENDEZVOUS_PORT} for every pod")
    return host, server.port, secret, server, None


def discover(prefix: str, timeout_s: float, environ: Mapping[str, str] | None = None, nics: str = "") -> Bootstrap:
    """Find this worker's identity and rendezvous store (starting the store on rank 0 where needed).

    ``nics``: the job's network interface setting (comma-separated names; rank 0's store listens on the
    first of them this host has). With no launcher at all, a job of one process with its own store.
    Raises SettingsError for malformed launcher variables and
    RoundelInternalError when the ranks cannot agree on a store.
    """
    env = os.environ if environ is None else environ
    follow_launcher(env)
    worker_id = elastic_join.worker_id(env)
    if worker_id is not None:
        return Bootstrap(*_roundelrun_store(env), None, None, worker_id=worker_id)
    ident = Identity.from_env(env)
    if ident is not None:
        return Bootstrap(*_roundelrun_store(env), None, ident)
    info = detect_launcher(env)
    if info is None:
        secret = new_secret()
        alone = _start_server("127.0.0.1", 0, secret)
        return Bootstrap("127.0.0.1", alone.port, secret, alone, Identity(0, 1, 0, 1, 0, 1, socket.gethostname()))
    explicit = _explicit(env)
    if explicit is not None:
        if info.size is None:
            raise SettingsError(f"{EXTERNAL_SERVER}=external: the {info.launcher} launcher does not say the "
                                "job's size; export PMIX_SIZE=N for every rank, or leave the rendezvous to MPI")
        host, port, secret = explicit
        server = path = None
    elif info.launcher == "horovod":  # Horovod's Gloo variables, set by another tool or by hand
        host, port, secret, server, path = horovod_gloo.store(info, env, prefix, timeout_s)
    elif info.launcher == "torchrun":
        host, port, secret, server, path = _torchrun(info, env, prefix, timeout_s, nics)
    elif info.by_mpi:
        info, (host, port, secret, server, path) = _mpi(info, env, nics)
    elif info.launcher == "kubernetes":
        host, port, secret, server, path = _indexed_job(info, env, nics)
    else:
        host, port, secret, server, path = _srun(info, env, prefix, timeout_s, nics)
    served_by = "roundelrun" if explicit is not None else f"rank 0 of the job (started by {info.launcher})"
    return Bootstrap(host, port, secret, server, None, info, secret_path=path, served_by=served_by)


def advertise_address(rendezvous_host: str, rendezvous_port: int, nics: str = "") -> str:
    """The address this worker gives its peers for Gloo: that of the interfaces ``nics`` names (the job's
    network interface setting) when given, else that of the interface routing to the store."""
    if nics:
        try:
            return network.interface_address(nics)
        except ValueError as exc:
            raise RoundelInternalError(f"{exc}; name one this host has with ROUNDEL_NETWORK_INTERFACE "
                                       "(roundelrun --network-interfaces)") from None
    return network.route_source(rendezvous_host, rendezvous_port) or "127.0.0.1"
