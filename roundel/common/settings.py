"""Every tunable of roundel, read from the environment in one place.

Each setting has a ``ROUNDEL_*`` variable and accepts the ``HOROVOD_*`` name that
Horovod job scripts already set; when both are present the ``ROUNDEL_*`` one
wins. Each ``HOROVOD_*`` variable has Horovod 0.28.1's meaning and default
(``HOROVOD_GLOO_TIMEOUT_SECONDS`` excepted: 60 s rather than 30, for loaded
machines).

:data:`SPECS` declares each setting once: its field, variable, parser and
meaning, and its ``roundelrun`` flag and config-file key (:class:`Flag`).
The launcher builds its settings flags, its config-file keys and the
variables it hands the workers from it (:mod:`roundel.runner.flags`,
:mod:`roundel.runner.config`), so the launcher and the workers validate with
the same code; docs/settings.md is made from it too.
"""

from __future__ import annotations

import dataclasses
import os
from typing import Any, Callable, Collection, Mapping

from roundel.errors import SettingsError

MIB = 1024 * 1024

_LOG_LEVELS = ("trace", "debug", "info", "warning", "error", "fatal")


@dataclasses.dataclass(frozen=True)
class Settings:
    """Validated engine and job settings (see docs/settings.md for each one)."""

    fusion_threshold: int = 128 * MIB
    cycle_time_ms: float = 1.0
    cache_capacity: int = 1024
    stall_check_time_s: float = 60.0
    stall_check_enabled: bool = True
    stall_shutdown_time_s: float = 0.0
    collective_timeout_s: float = 60.0
    start_timeout_s: float = 30.0
    heartbeat_timeout_s: float = 15.0
    timeline_filename: str = ""
    timeline_mark_cycles: bool = False
    autotune: bool = False
    autotune_log: str = ""
    autotune_warmup_samples: int = 3
    autotune_steps_per_sample: int = 10
    autotune_bayes_opt_max_samples: int = 20
    autotune_gaussian_process_noise: float = 0.8
    hierarchical_allreduce: bool = False
    hierarchical_allgather: bool = False
    torus_allreduce: bool = False
    elastic_timeout_s: float = 600.0
    log_level: str = "warning"
    log_hide_time: bool = False
    network_interface: str = ""
    cpu_operations: str = "gloo"
    gpu_operations: str = "nccl"
    bucket_cap_mb: float = 25.0
    coordinator_reduce_bytes: int = 4096
    shared_memory: bool = True
    peer_links: bool = True
    steady_replay: bool = True
    disable_group_fusion: bool = False
    straggler_report: str = "auto"
    metrics_port: str = ""
    relay_from_ranks: int = 64
    relay_fanout: int = 4
    num_nccl_streams: int = 1

    @classmethod
    def from_env(cls, environ: Mapping[str, str] | None = None, only: Collection[str] | None = None) -> "Settings":
        """Read and validate every setting (``only``: just these fields, the others keep their defaults);
        raise SettingsError naming the bad variable."""
        env = os.environ if environ is None else environ
        values: dict[str, Any] = {}
        for spec in SPECS:
            if spec.field is None or (only is not None and spec.field not in only):
                continue  # fieldless: handed to the workers, never read
            raw, var = spec.lookup(env)
            if raw is None:
                continue
            values[spec.field] = spec.parse(var, raw)
        return cls(**values)


@dataclasses.dataclass(frozen=True)
class Flag:
    """The ``roundelrun`` flag of one setting, and its key in the config file.

    ``names`` are the option strings of a flag that takes a value (``type`` converts it, ``choices``
    limits it), or, for a switch (a flag with ``off`` strings), the ones that turn it on; ``off`` turns
    it off (``off_help`` None: not listed by ``--help``). ``to_env`` gives the
    variable's value for the flag's (default: 1/0 for a switch, ``repr`` for a float, ``str`` else).
    ``config`` is the key in Horovod's config file (``section.key``; ``config_negated``: the key says
    the opposite of the flag); the flag's ``dest`` is a top-level key too. ``implied_by`` is
    ``(dest, value)`` of another flag that, given alone, sets this one (``--verbose``: debug).
    ``group`` names the ``--help`` section. A ``repeat`` flag may be given again: its values join
    into one comma-separated list. ``help`` leaves the default out: ``--help`` adds the table's.
    """

    names: tuple[str, ...]
    help: str
    group: str
    type: Callable[[str], object] | None = None
    choices: tuple[str, ...] | None = None
    metavar: str | None = None
    off: tuple[str, ...] = ()
    off_help: str | None = None
    to_env: Callable[[object], str] | None = None
    config: str | None = None
    config_negated: bool = False
    implied_by: tuple[str, object] | None = None
    repeat: bool = False

    @property
    def dest(self) -> str:
        """The argparse destination: the first name without its dashes (``--cycle-time-ms``: cycle_time_ms)."""
        return self.names[0].lstrip("-").replace("-", "_")

    @property
    def switch(self) -> bool:
        """Whether the flag takes no value (it is on or off)."""
        return bool(self.off)

    def env_value(self, value: object) -> str:
        """The variable's text for the flag's parsed ``value``."""
        if self.to_env is not None:
            return self.to_env(value)
        if isinstance(value, bool):
            return "1" if value else "0"
        return repr(value) if isinstance(value, float) else str(value)


@dataclasses.dataclass(frozen=True)
class Spec:
    """One setting: its ``Settings`` field (None: accepted and handed to the workers, no effect in roundel),
    its variable (``ROUNDEL_``/``HOROVOD_`` + ``suffix``; ``horovod``: Horovod's own name where it differs),
    how its value is read, what it means (for the settings reference page), its ``roundelrun`` flag and
    config key, and whether roundel does not act on it yet although it reads it."""

    field: str | None
    suffix: str
    parse: Callable[[str, str], object]
    meaning: str
    flag: Flag | None = None
    not_yet: bool = False
    horovod: str | None = None

    @property
    def var(self) -> str:
        """The variable ``roundelrun`` hands to the workers (``ROUNDEL_`` + suffix)."""
        return "ROUNDEL_" + self.suffix

    @property
    def horovod_var(self) -> str:
        """The name Horovod's job scripts set (``HOROVOD_`` + suffix unless ``horovod`` names another)."""
        return self.horovod or "HOROVOD_" + self.suffix

    def lookup(self, env: Mapping[str, str]) -> tuple[str | None, str]:
        """``(value, variable)`` of the first of :attr:`var` and :attr:`horovod_var` set (not blank) in
        ``env``, its value stripped; ``(None, var)`` when neither is."""
        for var in (self.var, self.horovod_var):
            raw = env.get(var)
            if raw is not None and raw.strip() != "":
                return raw.strip(), var
        return None, self.var

    @property
    def default(self) -> object:
        """The ``Settings`` default (None for a setting without a field)."""
        return None if self.field is None else _DEFAULTS[self.field]

    def default_text(self) -> str:
        """The default as the variable would say it ("unset" when it has none)."""
        value = self.default
        if value is None or value == "":
            return "unset"
        if self.suffix.endswith("_DISABLE"):  # the variable says the opposite of the field
            value = not value
        if isinstance(value, bool):
            return "1" if value else "0"
        if isinstance(value, int) and value >= MIB and value % MIB == 0:
            return f"{value // MIB} MiB"
        return f"{value:g}" if isinstance(value, float) else str(value)


_DEFAULTS = {f.name: f.default for f in dataclasses.fields(Settings)}


def setting(field: str) -> Spec:
    """The table's row of ``Settings`` field ``field``; KeyError names a field the table lacks."""
    for spec in SPECS:
        if spec.field == field:
            return spec
    raise KeyError(f"no setting has the field {field!r}; the fields are those of roundel.common.settings.Settings")


def _int(minimum: int, example: str) -> Callable[[str, str], int]:
    def parse(var: str, raw: str) -> int:
        try:
            value = int(raw)
        except ValueError:
            raise SettingsError(
                f"{var}={raw!r} is not a whole number; set it to an integer such as {example}, or unset it"
            ) from None
        if value < minimum:
            raise SettingsError(f"{var}={raw!r} must be >= {minimum}; for example {example}")
        return value

    return parse


def _float(minimum: float, example: str, strictly_above: bool = False) -> Callable[[str, str], float]:
    def parse(var: str, raw: str) -> float:
        try:
            value = float(raw)
        except ValueError:
            raise SettingsError(
                f"{var}={raw!r} is not a number; set it to a number such as {example}, or unset it"
            ) from None
        if value != value or (value <= minimum if strictly_above else value < minimum):
            bound = f"> {minimum:g}" if strictly_above else f">= {minimum:g}"
            raise SettingsError(f"{var}={raw!r} must be {bound}; for example {example}")
        return value

    return parse


def _bool(var: str, raw: str) -> bool:
    lowered = raw.lower()
    if lowered in ("1", "true", "yes", "on"):
        return True
    if lowered in ("0", "false", "no", "off"):
        return False
    raise SettingsError(f"{var}={raw!r} is not a boolean; use 1 or 0")


def _not_bool(var: str, raw: str) -> bool:
    return not _bool(var, raw)


def _log_level(var: str, raw: str) -> str:
    lowered = raw.lower()
    if lowered not in _LOG_LEVELS:
        raise SettingsError(f"{var}={raw!r} is not a log level; use one of {', '.join(_LOG_LEVELS)}")
    return lowered


def _cpu_operations(var: str, raw: str) -> str:
    lowered = raw.lower()
    if lowered not in ("gloo", "mpi"):
        raise SettingsError(f"{var}={raw!r} is not a CPU transport roundel has; use gloo or mpi")
    return lowered


def _gpu_operations(var: str, raw: str) -> str:
    lowered = raw.lower()
    if lowered not in ("nccl", "gloo", "mpi"):
        raise SettingsError(f"{var}={raw!r} is not a GPU transport roundel has; use nccl, or gloo or mpi "
                            "to move CUDA tensors through host memory over the CPU transport")
    return lowered


def _straggler_report(var: str, raw: str) -> str:
    lowered = raw.lower()
    return "auto" if lowered == "auto" else ("on" if _bool(var, raw) else "off")


def _metrics_port(var: str, raw: str) -> str:
    _, _, port = raw.rpartition(":")
    if not port.isdigit() or not 0 < int(port) < 65536:
        raise SettingsError(f"{var}={raw!r} is not a port; set it to PORT or HOST:PORT, such as 9100")
    return raw


def _coordinator_reduce_bytes(var: str, raw: str) -> int:
    value = _int(0, "4096 (0 sends every allreduce over the transport)")(var, raw)
    if value > _COORDINATOR_REDUCE_MAX:
        raise SettingsError(f"{var}={raw!r} is over {_COORDINATOR_REDUCE_MAX} bytes: every rank's data goes "
                            f"through rank 0; use at most {_COORDINATOR_REDUCE_MAX}, such as 4096")
    return value


_COORDINATOR_REDUCE_MAX = 65536


def _text(var: str, raw: str) -> str:
    return raw


def _fraction(var: str, raw: str) -> float:
    value = _float(0.0, "0.8")(var, raw)
    if value > 1:
        raise SettingsError(f"{var}={raw!r} must be between 0 and 1; for example 0.8")
    return value


def _whole(var: str, raw: str) -> int:
    return _int(0, "1")(var, raw)


def _one_nccl_stream(var: str, raw: str) -> int:
    if _int(1, "1")(var, raw) != 1:
        raise SettingsError(f"{var}={raw!r}: roundel runs each rank's NCCL collectives in order on one CUDA stream "
                            "of its own (beside the training's streams) and takes no other number of streams; "
                            "set it to 1 or unset it")
    return 1


def _interfaces(var: str, raw: str) -> str:
    names = [name.strip() for name in raw.split(",") if name.strip()]
    if not names:
        raise SettingsError(f"{var}={raw!r} names no network interface; set it to a name such as eth0, or "
                            "names such as eth0,ib0, or unset it")
    return ",".join(names)


def _mib_to_bytes(value: float) -> str:
    return str(int(value * MIB))


def _bit_not(value: bool) -> str:
    return "0" if value else "1"


def _flag(*names: str, help: str, group: str, **more) -> Flag:
    return Flag(names=names, help=help, group=group, **more)


SPECS = (
    Spec("fusion_threshold", "FUSION_THRESHOLD", _int(0, "134217728 (128 MiB; 0 disables fusion)"),
         "largest fused buffer in bytes; 0 disables fusion",
         _flag("--fusion-threshold-mb", type=float, to_env=_mib_to_bytes, config="params.fusion_threshold_mb",
               group="params", help="fuse tensors up to this many MiB; 0 disables fusion")),
    Spec("cycle_time_ms", "CYCLE_TIME", _float(0.0, "1 (milliseconds)"),
         "while a reduction is running, how long ready tensors wait (milliseconds) to be fused together",
         _flag("--cycle-time-ms", type=float, config="params.cycle_time_ms", group="params",
               help="milliseconds between engine cycles")),
    Spec("cache_capacity", "CACHE_CAPACITY", _int(0, "1024 (0 disables the response cache)"),
         "names remembered for one-bit negotiation; 0 disables the response cache",
         _flag("--cache-capacity", type=int, config="params.cache_capacity", group="params",
               help="entries in the response cache; 0 turns it off")),
    Spec("stall_check_time_s", "STALL_CHECK_TIME_SECONDS", _float(0.0, "60", strictly_above=True),
         "seconds a collective may wait for some ranks before the stall warning",
         _flag("--stall-check-warning-time-seconds", type=float, config="stall_check.warning_time_seconds",
               group="stall", help="warn about ranks missing from a collective after this many seconds")),
    Spec("stall_check_enabled", "STALL_CHECK_DISABLE", _not_bool,
         "1 turns the stall warning off",
         _flag("--no-stall-check", off=("--stall-check",), config="stall_check.enabled", config_negated=True,
               group="stall", help="turn the stall warning off")),
    Spec("stall_shutdown_time_s", "STALL_SHUTDOWN_TIME_SECONDS", _float(0.0, "600 (0 never shuts down)"),
         "fail a collective that stalled this many seconds (0: never)",
         _flag("--stall-check-shutdown-time-seconds", type=float, config="stall_check.shutdown_time_seconds",
               group="stall", help="fail a collective that stalled this many seconds; 0: never")),
    Spec("collective_timeout_s", "GLOO_TIMEOUT_SECONDS", _float(0.0, "60", strictly_above=True),
         "longest wait inside one transfer, in seconds (Horovod: 30; a stopped or lost peer is caught by "
         "the heartbeat)",
         _flag("--gloo-timeout-seconds", type=float, config="library_options.gloo_timeout_seconds",
               group="library", help="seconds a collective may wait for its peers")),
    Spec("start_timeout_s", "START_TIMEOUT", _float(0.0, "30", strictly_above=True),
         "how long ranks wait for each other at init(), in seconds",
         _flag("--start-timeout", type=float, group="",
               help="seconds workers wait for each other at start")),
    Spec("heartbeat_timeout_s", "HEARTBEAT_TIMEOUT_SECONDS", _float(0.0, "15", strictly_above=True),
         "a rank silent this many seconds is declared lost (roundel only)",
         _flag("--heartbeat-timeout-seconds", type=float, group="library",
               help="declare a rank lost after this many seconds of silence")),
    Spec("timeline_filename", "TIMELINE", _text,
         "write a timeline to this file (DYNAMIC: start it later with hvd.start_timeline)",
         _flag("--timeline-filename", config="timeline.filename", group="timeline",
               help="write a timeline of collectives to this file")),
    Spec("timeline_mark_cycles", "TIMELINE_MARK_CYCLES", _bool,
         "1 marks each engine cycle in the timeline",
         _flag("--timeline-mark-cycles", off=("--no-timeline-mark-cycles",), config="timeline.mark_cycles",
               group="timeline", help="mark engine cycles in the timeline")),
    Spec("autotune", "AUTOTUNE", _bool,
         "1 tunes fusion threshold, cycle time and response cache while the job runs",
         _flag("--autotune", off=("--no-autotune",), config="autotune.enabled", group="autotune",
               help="tune fusion threshold, cycle time and response cache while training (needs scikit-learn)")),
    Spec("autotune_log", "AUTOTUNE_LOG", _text,
         "autotune writes each sample to this CSV file",
         _flag("--autotune-log-file", config="autotune.log_file", group="autotune",
               help="file to log autotune samples to")),
    Spec("autotune_warmup_samples", "AUTOTUNE_WARMUP_SAMPLES", _int(0, "3"),
         "samples autotune discards before tuning",
         _flag("--autotune-warmup-samples", type=int, config="autotune.warmup_samples", group="autotune",
               help="samples to discard first")),
    Spec("autotune_steps_per_sample", "AUTOTUNE_STEPS_PER_SAMPLE", _int(1, "10"),
         "steps per autotune sample (at least 1)",
         _flag("--autotune-steps-per-sample", type=int, config="autotune.steps_per_sample", group="autotune",
               help="steps per autotune sample")),
    Spec("autotune_bayes_opt_max_samples", "AUTOTUNE_BAYES_OPT_MAX_SAMPLES", _int(0, "20"),
         "most samples of autotune's Bayesian optimization",
         _flag("--autotune-bayes-opt-max-samples", type=int, config="autotune.bayes_opt_max_samples",
               group="autotune", help="most Bayesian optimisation samples")),
    Spec("autotune_gaussian_process_noise", "AUTOTUNE_GAUSSIAN_PROCESS_NOISE", _fraction,
         "noise of autotune's Gaussian process, between 0 and 1",
         _flag("--autotune-gaussian-process-noise", type=float, config="autotune.gaussian_process_noise",
               group="autotune", help="noise of the Gaussian process")),
    Spec("hierarchical_allreduce", "HIERARCHICAL_ALLREDUCE", _bool,
         "1: allreduce through one leader per host when the job spans hosts with equal slots",
         _flag("--hierarchical-allreduce", off=("--no-hierarchical-allreduce",),
               config="params.hierarchical_allreduce", group="params",
               help="hierarchical allreduce (equal slots per host)")),
    Spec("hierarchical_allgather", "HIERARCHICAL_ALLGATHER", _bool,
         "1: allgather through one leader per host when the job spans hosts with equal slots",
         _flag("--hierarchical-allgather", off=("--no-hierarchical-allgather",),
               config="params.hierarchical_allgather", group="params",
               help="hierarchical allgather (equal slots per host)")),
    Spec("torus_allreduce", "TORUS_ALLREDUCE", _bool,
         "read and validated; no effect yet",
         _flag("--torus-allreduce", off=("--no-torus-allreduce",), config="params.torus_allreduce",
               group="params", help="torus allreduce (not yet used)"),
         not_yet=True),
    Spec("elastic_timeout_s", "ELASTIC_TIMEOUT", _float(0.0, "600", strictly_above=True),
         "elastic: how long to wait for --min-np slots, in seconds",
         _flag("--elastic-timeout", type=float, group="elastic",
               help="seconds to wait for --min-np slots or for workers to rejoin")),
    Spec("log_level", "LOG_LEVEL", _log_level,
         "trace, debug, info, warning, error or fatal",
         _flag("--log-level", type=str.upper, choices=tuple(level.upper() for level in _LOG_LEVELS),
               to_env=str.lower, implied_by=("verbose", "DEBUG"), config="logging.level", group="logging",
               help="the workers' log level")),
    Spec("log_hide_time", "LOG_HIDE_TIME", _bool,
         "1 drops the time from roundel's log lines",
         _flag("--log-with-timestamp", "--no-log-hide-timestamp",
               off=("--log-without-timestamp", "--log-hide-timestamp"),
               off_help="leave the time off the workers' log lines", to_env=_bit_not,
               config="logging.with_timestamp", group="logging",
               help="put the time on the workers' log lines")),
    Spec("network_interface", "NETWORK_INTERFACE", _interfaces,
         "network interfaces the hosts reach each other on, such as eth0 or eth0,ib0: each host uses the first of "
         "them it has for the rendezvous store and the ranks' connections (Horovod's name: HOROVOD_GLOO_IFACE)",
         _flag("--network-interfaces", "--network-interface", metavar="NICS", repeat=True, group="",
               help="comma-separated network interfaces the hosts reach each other on; each host uses the first "
                    "of them that it has"),
         horovod="HOROVOD_GLOO_IFACE"),
    Spec("cpu_operations", "CPU_OPERATIONS", _cpu_operations,
         "transport of CPU tensors: gloo, or mpi under mpirun (`roundelrun --mpi` chooses mpi when mpi4py "
         "is installed)"),
    Spec("gpu_operations", "GPU_OPERATIONS", _gpu_operations,
         "transport of CUDA tensors: nccl, or gloo/mpi through host memory",
         _flag("--gpu-operations", type=str.lower, choices=("nccl", "gloo", "mpi"), group="library",
               help="what moves CUDA tensors: nccl, or gloo/mpi through host memory")),
    Spec("bucket_cap_mb", "BUCKET_CAP_MB", _float(0.0, "25 (MiB per gradient bucket; 0 reduces each gradient alone)"),
         "default gradient bucket size (MiB) of the torch DistributedOptimizer; 0 reduces each gradient "
         "alone (roundel only)",
         _flag("--bucket-cap-mb", type=float, group="params",
               help="torch DistributedOptimizer's gradient bucket size in MiB where the script sets none; "
                    "0: none")),
    Spec("coordinator_reduce_bytes", "COORDINATOR_REDUCE_BYTES", _coordinator_reduce_bytes,
         "CPU allreduces up to this many bytes are reduced by rank 0's coordinator from data sent with the "
         "requests; 0 sends all over the transport; at most 65536 (roundel only)",
         _flag("--coordinator-reduce-bytes", type=int, group="params",
               help="CPU allreduces up to this many bytes ride with the requests to rank 0; 0: none, "
                    "at most 65536")),
    Spec("shared_memory", "SHARED_MEMORY", _bool,
         "on one host, collectives go through shared memory; 0 keeps them on Gloo (roundel only)",
         _flag("--shared-memory", off=("--no-shared-memory",), off_help="keep collectives on one host on Gloo",
               group="library", help="collectives among the ranks of one host go through shared memory")),
    Spec("peer_links", "PEER_LINKS", _bool,
         "Gloo communicators of up to 64 ranks move allreduces, broadcasts and allgathers (with 3 ranks or more, up "
         "to 4 MiB) over roundel's own TCP links between the ranks, on the calling thread; 0 keeps them in Gloo's "
         "process group (roundel only)",
         _flag("--peer-links", off=("--no-peer-links",), off_help="keep collectives in Gloo's process group",
               group="library", help="allreduces, broadcasts and allgathers go over roundel's own links")),
    Spec("steady_replay", "STEADY_REPLAY", _bool,
         "once the job's allreduces, broadcasts and allgathers repeat, each rank runs them from the learned schedule "
         "without asking rank 0 "
         "(a rank that leaves the schedule makes every rank fall back); 0 always asks (roundel only)",
         _flag("--steady-replay", off=("--no-steady-replay",), off_help="ask rank 0 for every collective",
               group="params", help="replay the repeating allreduces without a round trip to rank 0")),
    Spec("straggler_report", "STRAGGLER_REPORT", _straggler_report,
         "1: each rank's lag behind the others is reported when the job ends; auto: when it ran longer "
         "than a minute (roundel only)",
         _flag("--straggler-report", off=("--no-straggler-report",), off_help="never print the straggler table",
               group="observability", help="print each rank's lag behind the others when the job ends, even when it "
                                           "ran for less than a minute")),
    Spec("metrics_port", "METRICS_PORT", _metrics_port,
         "[HOST:]PORT where rank 0 serves the job's counters for Prometheus (roundel only)",
         _flag("--metrics-port", metavar="[HOST:]PORT", group="observability",
               help="serve the job's counters in Prometheus' text format from rank 0 "
                    "(HOST default: every interface)")),
    Spec("disable_group_fusion", "DISABLE_GROUP_FUSION", _bool,
         "1: a grouped call's tensors are fused only with each other",
         _flag("--disable-group-fusion", off=("--no-disable-group-fusion",), group="params",
               help="fuse a grouped call's tensors only with each other")),
    Spec("relay_from_ranks", "RELAY_FROM_RANKS", _int(0, "64 (0: every rank talks to rank 0 itself)"),
         "in jobs of at least this many ranks, one rank per host (its first; the second on rank 0's host) "
         "relays the control messages of its host's other ranks to rank 0, merging their cache bits; "
         "0: never (roundel only)",
         _flag("--relay-from-ranks", type=int, group="params",
               help="relay control messages through one rank per host in jobs of at least this many ranks; "
                    "0: never")),
    Spec("relay_fanout", "RELAY_FANOUT", _int(1, "4"),
         "with relays, at most this many hosts' relays report to each relay; rank 0's host's relay is the top "
         "(roundel only)",
         _flag("--relay-fanout", type=int, group="params",
               help="hosts' relays under each relay; rank 0's host's relay is the top")),
    Spec(None, "MPI_THREADS_DISABLE", _bool,
         "accepted and handed to the workers; no effect in roundel (it drives no MPI threads)",
         _flag("--mpi-threads-disable", off=("--no-mpi-threads-disable",), config="library_options.mpi_threads_disable",
               group="library", help="no effect in roundel")),
    Spec("num_nccl_streams", "NUM_NCCL_STREAMS", _one_nccl_stream,
         "CUDA streams for NCCL collectives per rank: 1, the only value roundel takes (its collectives run in "
         "order on one stream of roundel's own, beside the training's streams)",
         _flag("--num-nccl-streams", type=int, config="library_options.num_nccl_streams", group="library",
               help="must be 1: roundel runs NCCL collectives on one stream of its own per rank")),
    Spec(None, "THREAD_AFFINITY", _whole,
         "accepted and handed to the workers; no effect in roundel",
         _flag("--thread-affinity", type=int, config="library_options.thread_affinity", group="library",
               help="no effect in roundel")),
)
"""The one table of settings: ``Settings.from_env``, ``roundelrun``'s settings flags, the variables handed to
the workers, the config-file keys and docs/settings.md are all made from it."""
