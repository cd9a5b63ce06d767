"""A worker's place in the job, as the launcher hands it over in the environment.

The launcher writes these variables (``ROUNDEL_*``, mirrored as the
``HOROVOD_*`` names Horovod's gloo launcher sets, for scripts that read them);
``hvd.init()`` reads them back.
"""

from __future__ import annotations

import dataclasses
import os
from typing import Mapping

from roundel.errors import SettingsError

RENDEZVOUS_ADDR = "ROUNDEL_RENDEZVOUS_ADDR"
RENDEZVOUS_PORT = "ROUNDEL_RENDEZVOUS_PORT"
SECRET = "ROUNDEL_SECRET"
NUM_PROC = "ROUNDEL_NUM_PROC"  # the size of a Kubernetes Indexed Job (its completions), which no variable carries
RENDEZVOUS_BIND = "ROUNDEL_RENDEZVOUS_BIND"  # where rank 0's store listens under another launcher
LAUNCHER_PID = "ROUNDEL_LAUNCHER_PID"  # the worker's parent it follows: roundelrun's watchdog, a Spark task

_FIELDS = ("rank", "size", "local_rank", "local_size", "cross_rank", "cross_size")


@dataclasses.dataclass(frozen=True)
class Identity:
    """Rank numbers as Horovod defines them, plus the host's name."""

    rank: int
    size: int
    local_rank: int
    local_size: int
    cross_rank: int
    cross_size: int
    hostname: str = ""

    def to_env(self) -> dict[str, str]:
        """The environment variables that carry this identity to a worker."""
        env = {}
        for field in _FIELDS:
            value = str(getattr(self, field))
            env["ROUNDEL_" + field.upper()] = value
            env["HOROVOD_" + field.upper()] = value
        env["ROUNDEL_HOSTNAME"] = env["HOROVOD_HOSTNAME"] = self.hostname
        return env

    @classmethod
    def from_env(cls, environ: Mapping[str, str] | None = None) -> "Identity | None":
        """The identity the launcher set, or None if this process was not launched by roundelrun."""
        env = os.environ if environ is None else environ
        if "ROUNDEL_RANK" not in env:
            return None
        values = {}
        for field in _FIELDS:
            var = "ROUNDEL_" + field.upper()
            try:
                values[field] = int(env[var])
            except (KeyError, ValueError):
                raise SettingsError(
                    f"{var}={env.get(var)!r}: the launcher's identity variables are incomplete; "
                    "start the script with roundelrun"
                ) from None
        ident = cls(hostname=env.get("ROUNDEL_HOSTNAME", ""), **values)
        ident.validate()
        return ident

    def validate(self) -> None:
        """Raise SettingsError when the numbers contradict each other."""
        if not (0 <= self.rank < self.size):
            raise SettingsError(f"rank {self.rank} is outside a job of size {self.size}")
        if not (0 <= self.local_rank < self.local_size):
            raise SettingsError(f"local rank {self.local_rank} is outside local size {self.local_size}")
        if not (0 <= self.cross_rank < self.cross_size):
            raise SettingsError(f"cross rank {self.cross_rank} is outside cross size {self.cross_size}")


def rendezvous_env(host: str, port: int, secret_hex: str) -> dict[str, str]:
    """The variables that tell a worker where the rendezvous store is and the job's secret."""
    return {RENDEZVOUS_ADDR: host, RENDEZVOUS_PORT: str(port), SECRET: secret_hex}


@dataclasses.dataclass(frozen=True)
class LauncherIdentity:
    """What another launcher (torchrun, mpirun/mpiexec, srun) tells a process about its place.

    ``local_rank``/``local_size`` are None where that launcher does not say,
    and ``size`` where a PMIx launcher does not (MPI's ``COMM_WORLD`` tells it
    at ``init()``); cross ranks are never given and are worked out at
    ``init()`` by exchanging host names and local ranks through the rendezvous
    store.
    """

    launcher: str  # "horovod", "torchrun", "openmpi", "pals", "mpich", "srun", "pmix", "kubernetes"
    rank: int
    size: int | None
    local_rank: int | None
    local_size: int | None

    @property
    def by_mpi(self) -> bool:
        """Whether an MPI launcher (mpirun, mpiexec) started this process: ranks agree over MPI.COMM_WORLD."""
        return self.launcher in ("openmpi", "pals", "mpich", "pmix")


def _int_var(env: Mapping[str, str], name: str, launcher: str) -> int:
    try:
        return int(env[name])
    except (KeyError, ValueError):
        raise SettingsError(f"{name}={env.get(name)!r}: expected a whole number as {launcher} sets it") from None


def _opt_int(env: Mapping[str, str], name: str, launcher: str) -> int | None:
    return _int_var(env, name, launcher) if name in env else None


def _first_int(env: Mapping[str, str], names: tuple[str, ...], launcher: str) -> int | None:
    """The first of ``names`` that is set, as a whole number; None when none is."""
    for name in names:
        if name in env:
            return _int_var(env, name, launcher)
    return None


def detect_launcher(environ: Mapping[str, str] | None = None) -> LauncherIdentity | None:
    """The identity another launcher gave this process, or None if none did.

    Checked in this order (an inner launcher's variables shadow an outer
    one's): Horovod's Gloo variables (``HOROVOD_RANK``, ``HOROVOD_SIZE``,
    ``HOROVOD_LOCAL_RANK``, ``HOROVOD_LOCAL_SIZE`` with
    ``HOROVOD_GLOO_RENDEZVOUS_ADDR``, as Horovod's launcher sets them), torchrun (``RANK``, ``WORLD_SIZE``, ``LOCAL_RANK``,
    ``LOCAL_WORLD_SIZE`` with ``MASTER_ADDR``/``MASTER_PORT``), Open MPI
    (``OMPI_COMM_WORLD_RANK``/``SIZE``/``LOCAL_RANK``/``LOCAL_SIZE``), HPE
    Cray PALS's ``mpiexec`` under PBS (``PALS_RANKID``, ``PALS_LOCAL_RANKID``,
    ``PALS_LOCAL_SIZE``, the size from Cray PMI's ``PMI_SIZE`` or
    ``PALS_NRANKS``), MPICH's Hydra (``PMI_RANK``, ``PMI_SIZE``,
    ``MPI_LOCALRANKID``, ``MPI_LOCALNRANKS``), Slurm's srun
    (``SLURM_PROCID``, and ``SLURM_STEP_NUM_TASKS`` which only a job step has,
    ``SLURM_LOCALID``), any PMIx launcher (``PMIX_RANK``, with ``PMIX_SIZE``,
    ``PMIX_LOCAL_RANK`` and ``PMIX_LOCAL_SIZE`` where set), and last a pod of
    a Kubernetes Indexed Job (``JOB_COMPLETION_INDEX``, which the Job
    controller sets, with the job's size in ``ROUNDEL_NUM_PROC``).
    roundelrun's own ``ROUNDEL_RANK`` is read by :meth:`Identity.from_env`
    and wins over all of these. Raises SettingsError for a malformed value.
    """
    env = os.environ if environ is None else environ
    found = None
    if "HOROVOD_RANK" in env and "HOROVOD_SIZE" in env and "HOROVOD_GLOO_RENDEZVOUS_ADDR" in env:
        name = "Horovod's Gloo launcher"
        found = LauncherIdentity("horovod", _int_var(env, "HOROVOD_RANK", name), _int_var(env, "HOROVOD_SIZE", name),
                                 _opt_int(env, "HOROVOD_LOCAL_RANK", name), _opt_int(env, "HOROVOD_LOCAL_SIZE", name))
    elif "RANK" in env and "WORLD_SIZE" in env and "MASTER_ADDR" in env and "MASTER_PORT" in env:
        name = "torchrun"
        found = LauncherIdentity(name, _int_var(env, "RANK", name), _int_var(env, "WORLD_SIZE", name),
                                 _opt_int(env, "LOCAL_RANK", name), _opt_int(env, "LOCAL_WORLD_SIZE", name))
    elif "OMPI_COMM_WORLD_RANK" in env:
        name = "Open MPI's mpirun"
        found = LauncherIdentity("openmpi", _int_var(env, "OMPI_COMM_WORLD_RANK", name),
                                 _int_var(env, "OMPI_COMM_WORLD_SIZE", name),
                                 _opt_int(env, "OMPI_COMM_WORLD_LOCAL_RANK", name),
                                 _opt_int(env, "OMPI_COMM_WORLD_LOCAL_SIZE", name))
    elif "PALS_RANKID" in env:
        name = "PALS's mpiexec"
        size = _first_int(env, ("PMI_SIZE", "PALS_NRANKS"), name)
        if size is None:
            raise SettingsError("PALS_RANKID is set but neither PMI_SIZE nor PALS_NRANKS says the job's size; "
                                "start the ranks with mpiexec -n N (PALS), or export PALS_NRANKS=N")
        found = LauncherIdentity("pals", _int_var(env, "PALS_RANKID", name), size,
                                 _first_int(env, ("PALS_LOCAL_RANKID", "PMI_LOCAL_RANK"), name),
                                 _first_int(env, ("PALS_LOCAL_SIZE", "PMI_LOCAL_SIZE"), name))
    elif "PMI_RANK" in env and "PMI_SIZE" in env:
        name = "MPICH's mpiexec"
        found = LauncherIdentity("mpich", _int_var(env, "PMI_RANK", name), _int_var(env, "PMI_SIZE", name),
                                 _opt_int(env, "MPI_LOCALRANKID", name), _opt_int(env, "MPI_LOCALNRANKS", name))
    elif "SLURM_PROCID" in env and "SLURM_STEP_NUM_TASKS" in env:
        name = "srun"
        found = LauncherIdentity("srun", _int_var(env, "SLURM_PROCID", name),
                                 _int_var(env, "SLURM_STEP_NUM_TASKS", name), _opt_int(env, "SLURM_LOCALID", name),
                                 None)
    elif "PMIX_RANK" in env:
        name = "the PMIx launcher"
        found = LauncherIdentity("pmix", _int_var(env, "PMIX_RANK", name), _opt_int(env, "PMIX_SIZE", name),
                                 _opt_int(env, "PMIX_LOCAL_RANK", name), _opt_int(env, "PMIX_LOCAL_SIZE", name))
    elif "JOB_COMPLETION_INDEX" in env and (NUM_PROC in env or RENDEZVOUS_ADDR in env):
        name = "a Kubernetes Indexed Job"
        if NUM_PROC not in env:
            raise SettingsError(f"JOB_COMPLETION_INDEX and {RENDEZVOUS_ADDR} are set but {NUM_PROC} is not: give "
                                f"every pod of the Indexed Job {NUM_PROC}=<the Job's completions>")
        found = LauncherIdentity("kubernetes", _int_var(env, "JOB_COMPLETION_INDEX", name),
                                 _int_var(env, NUM_PROC, name), None, None)
    if found is not None and (found.rank < 0 or found.size is not None and found.rank >= found.size):
        raise SettingsError(f"{found.launcher} gave rank {found.rank} outside a job of size {found.size}")
    if found is not None and found.local_rank is not None and found.local_size is not None \
            and not 0 <= found.local_rank < found.local_size:
        raise SettingsError(f"{found.launcher} gave local rank {found.local_rank} outside local size "
                            f"{found.local_size}")
    return found


def cross_ranks(table: list[tuple[str, int]]) -> list[Identity]:
    """Every rank's Identity from ``table[rank] = (hostname, local_rank)``.

    ``local_size`` counts the ranks on the same host; ``cross_rank`` is the
    rank's index among the ranks with its local rank (in rank order), and
    ``cross_size`` how many there are, as Horovod defines them.
    """
    per_host: dict[str, int] = {}
    per_local: dict[int, int] = {}
    for host, local in table:
        per_host[host] = per_host.get(host, 0) + 1
        per_local[local] = per_local.get(local, 0) + 1
    seen: dict[int, int] = {}
    out = []
    for rank, (host, local) in enumerate(table):
        cross = seen.get(local, 0)
        seen[local] = cross + 1
        out.append(Identity(rank, len(table), local, per_host[host], cross, per_local[local], host))
    return out
