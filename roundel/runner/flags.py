"""``roundelrun``'s command line: every ``horovodrun`` 0.28.1 flag, and what each becomes for the workers.

The parser accepts Horovod's flags with their short forms and aliases.
:func:`settings_env` turns the parsed flags into the workers' ``ROUNDEL_*``
settings variables (as Horovod's launcher turns them into ``HOROVOD_*``
ones); :func:`ignored_flags` names the flags given that have no effect in
roundel, for the launcher's one-line notice.
"""

from __future__ import annotations

import argparse
import difflib
import os

from roundel import __version__
from roundel.errors import SettingsError
from roundel.common.settings import MIB, Settings
from roundel.runner.spawn import FORWARD_VARS, REMOTE_ENV, REMOTE_ENV_MODES, STRICT_HOST_KEY_CHECKING

__all__ = ["NO_EFFECT", "NOT_YET", "UsageError", "exports", "given_flags", "ignored_flags", "parser",
           "settings_env"]

LOG_LEVELS = ("TRACE", "DEBUG", "INFO", "WARNING", "ERROR", "FATAL")

NO_EFFECT = {
    "mpi_threads_disable": "--mpi-threads-disable",
    "tcp_flag": "--tcp",
    "binding_args": "--binding-args",
    "num_nccl_streams": "--num-nccl-streams",
    "thread_affinity": "--thread-affinity",
    "use_jsrun": "--jsrun",
    "ccl_bgt_affinity": "--ccl-bgt-affinity",
}
"""Flags for hardware or libraries roundel does not drive: accepted (their variables are still set), no effect."""

NOT_YET = {
    "torus_allreduce": "--torus-allreduce",
}
"""Flags whose variables are passed to the workers but which roundel's engine does not act on yet."""


class UsageError(Exception):
    """A bad command line or setting, reported before anything starts."""


def _level(raw: str) -> str:
    if raw.upper() not in LOG_LEVELS:
        raise argparse.ArgumentTypeError(f"invalid choice: {raw!r} (choose from {', '.join(LOG_LEVELS)})")
    return raw.upper()


def _ranks(raw: str) -> frozenset:
    """``0,2-3`` -> {0, 2, 3}."""
    ranks = set()
    try:
        for part in raw.split(","):
            first, _, last = part.strip().partition("-")
            ranks.update(range(int(first), int(last or first) + 1))
    except ValueError:
        raise argparse.ArgumentTypeError(f"{raw!r}: expected ranks such as 0 or 0,2-3") from None
    if not ranks or min(ranks) < 0:
        raise argparse.ArgumentTypeError(f"{raw!r}: expected ranks such as 0 or 0,2-3")
    return frozenset(ranks)


class _NicsAction(argparse.Action):
    """``--network-interfaces eth0,ib0`` (may repeat): a list of interface names."""

    def __call__(self, parser, namespace, values, option_string=None):
        nics = list(getattr(namespace, self.dest) or [])
        nics += [name.strip() for name in values.split(",") if name.strip()]
        setattr(namespace, self.dest, nics)


def _pair(group, name: str, dest: str, help: str) -> None:
    """``--NAME`` / ``--no-NAME`` setting ``dest`` to True / False (None when neither is given)."""
    both = group.add_mutually_exclusive_group()
    both.add_argument(f"--{name}", dest=dest, action="store_const", const=True, default=None, help=help)
    both.add_argument(f"--no-{name}", dest=dest, action="store_const", const=False, help=argparse.SUPPRESS)


class _Parser(argparse.ArgumentParser):
    """argparse with a one-line error: a mistyped flag gets the closest real one, not the usage block."""

    def error(self, message):
        prefix = "unrecognized arguments: "
        if message.startswith(prefix):
            known = [o for action in self._actions for o in action.option_strings]
            for word in message[len(prefix):].split():
                close = difflib.get_close_matches(word.split("=", 1)[0], known, n=1, cutoff=0.6)
                if word.startswith("-") and close:
                    message += f"; did you mean {close[0]}?"
                    break
        self.exit(2, f"{self.prog}: error: {message} ({self.prog} --help lists the flags)\n")


def parser() -> argparse.ArgumentParser:
    """The ``roundelrun`` argument parser (every ``horovodrun`` 0.28.1 flag, plus ``-x`` and ssh policy)."""
    p = _Parser(
        prog="roundelrun",
        description="Run a command as the ranks of a roundel (Horovod-style) distributed job.",
        allow_abbrev=False,
    )
    p.add_argument("-v", "--version", action="version", version=__version__, help="print roundel's version")
    p.add_argument("-np", "--num-proc", dest="np", type=int, help="number of ranks to start")
    p.add_argument("-cb", "--check-build", action="store_true",
                   help="show which frameworks, controllers and tensor operations are available, and exit")
    p.add_argument("--disable-cache", action="store_true",
                   help="do not cache host checks (roundel never caches them; the response cache is "
                        "turned off with --cache-capacity 0)")
    p.add_argument("--start-timeout", type=float,
                   help="seconds workers wait for each other at start (default HOROVOD_START_TIMEOUT or 30)")
    p.add_argument("--network-interfaces", "--network-interface", dest="nics", action=_NicsAction,
                   metavar="NICS", help="comma-separated network interfaces the hosts reach each other on; "
                                        "each host uses the first of them that it has")
    p.add_argument("--output-filename", metavar="DIR",
                   help="also write each rank's output to DIR/rank.<N>/stdout and stderr")
    p.add_argument("--ranks-filter", type=_ranks, metavar="RANKS",
                   help="show only these ranks' output on the console, e.g. 0 or 0,2-3 (torchrun's "
                        "--local-ranks-filter; --output-filename still gets every rank's)")
    p.add_argument("--verbose", action="store_true", help="print the launch plan and log at debug level")
    p.add_argument("--config-file", help="YAML file of settings (flags given on the command line win)")
    ssh = p.add_argument_group("ssh")
    ssh.add_argument("-p", "--ssh-port", type=int, help="ssh port of the remote hosts")
    ssh.add_argument("-i", "--ssh-identity-file", help="ssh private key for the remote hosts")
    ssh.add_argument("--ssh-strict-host-key-checking", choices=STRICT_HOST_KEY_CHECKING,
                     help="ssh's StrictHostKeyChecking for the hosts (default: whatever your ssh "
                          "configuration says, ssh's own default being ask, which BatchMode turns into no "
                          "connection to an unknown host)")
    params = p.add_argument_group("tunable parameters")
    params.add_argument("--fusion-threshold-mb", type=float, help="fuse tensors up to this many MiB (0 disables)")
    params.add_argument("--bucket-cap-mb", type=float,
                        help="torch DistributedOptimizer's default gradient bucket size in MiB (default 25; 0: none)")
    params.add_argument("--cycle-time-ms", type=float, help="milliseconds between engine cycles")
    params.add_argument("--cache-capacity", type=int, help="entries in the response cache (0 turns it off)")
    _pair(params, "hierarchical-allreduce", "hierarchical_allreduce", "hierarchical allreduce (equal slots per host)")
    _pair(params, "hierarchical-allgather", "hierarchical_allgather", "hierarchical allgather (equal slots per host)")
    _pair(params, "torus-allreduce", "torus_allreduce", "torus allreduce (not yet used)")
    autotune = p.add_argument_group("autotune")
    _pair(autotune, "autotune", "autotune",
          "tune fusion threshold, cycle time and response cache while training (needs scikit-learn)")
    autotune.add_argument("--autotune-log-file", help="file to log autotune samples to")
    autotune.add_argument("--autotune-warmup-samples", type=int, help="samples to discard first")
    autotune.add_argument("--autotune-steps-per-sample", type=int, help="steps per autotune sample")
    autotune.add_argument("--autotune-bayes-opt-max-samples", type=int, help="most Bayesian optimisation samples")
    autotune.add_argument("--autotune-gaussian-process-noise", type=float, help="noise of the Gaussian process")
    elastic = p.add_argument_group("elastic training (enabled by --host-discovery-script, or by --min-np with -H)")
    elastic.add_argument("--min-np", "--min-num-proc", dest="min_np", type=int,
                         help="fewest workers to train with (default -np); with -H/--hostfile it makes the job elastic "
                              "on those fixed hosts, as in horovodrun")
    elastic.add_argument("--max-np", "--max-num-proc", dest="max_np", type=int,
                         help="most workers to train with (default: every discovered slot)")
    elastic.add_argument("--slots-per-host", "--slots", dest="slots", type=int, default=1,
                         help="slots of a discovered host that prints no count (default 1)")
    elastic.add_argument("--elastic-timeout", type=float,
                         help="seconds to wait for --min-np slots or for workers to rejoin "
                              "(default HOROVOD_ELASTIC_TIMEOUT or 600)")
    elastic.add_argument("--reset-limit", type=int, help="end the job after this many membership resets")
    elastic.add_argument("--blacklist-cooldown-range", type=float, nargs=2, metavar=("LO", "HI"),
                         help="re-admit a blacklisted host after a cooldown of LO..HI seconds (default: never)")
    timeline = p.add_argument_group("timeline")
    timeline.add_argument("--timeline-filename", help="write a timeline of collectives to this file")
    _pair(timeline, "timeline-mark-cycles", "timeline_mark_cycles", "mark engine cycles in the timeline")
    stall = p.add_argument_group("stall check")
    both = stall.add_mutually_exclusive_group()
    both.add_argument("--no-stall-check", dest="no_stall_check", action="store_const", const=True, default=None,
                      help="turn the stall warning off")
    both.add_argument("--stall-check", dest="no_stall_check", action="store_const", const=False,
                      help=argparse.SUPPRESS)
    stall.add_argument("--stall-check-warning-time-seconds", type=float,
                       help="warn about ranks missing from a collective after this many seconds (default 60)")
    stall.add_argument("--stall-check-shutdown-time-seconds", type=float,
                       help="fail a collective that stalled this many seconds (default 0: never)")
    observe = p.add_argument_group("observability")
    report = observe.add_mutually_exclusive_group()
    report.add_argument("--straggler-report", dest="straggler_report", action="store_const", const=True,
                        default=None, help="print each rank's lag behind the others when the job ends "
                                           "(default: when the job ran longer than a minute)")
    report.add_argument("--no-straggler-report", dest="straggler_report", action="store_const", const=False,
                        help="never print the straggler table")
    observe.add_argument("--metrics-port", metavar="[HOST:]PORT",
                         help="serve the job's counters in Prometheus' text format from rank 0 "
                              "(HOST default: every interface)")
    library = p.add_argument_group("library options")
    _pair(library, "mpi-threads-disable", "mpi_threads_disable", "no effect in roundel")
    library.add_argument("--mpi-args", default="", help="extra arguments for mpirun (with --mpi)")
    library.add_argument("--tcp", dest="tcp_flag", action="store_true", help="no effect in roundel (sets NCCL_IB_DISABLE=1)")
    library.add_argument("--binding-args", help="no effect in roundel")
    library.add_argument("--num-nccl-streams", type=int, help="no effect in roundel")
    library.add_argument("--thread-affinity", type=int, help="no effect in roundel")
    library.add_argument("--ccl-bgt-affinity", type=int, help="no effect in roundel")
    library.add_argument("--gpu-operations", type=str.lower, choices=("nccl", "gloo", "mpi"),
                         help="what moves CUDA tensors: nccl (the default), or gloo/mpi through host memory")
    library.add_argument("--gloo-timeout-seconds", type=float,
                         help="seconds a collective may wait for its peers (default 60)")
    logs = p.add_argument_group("logging")
    logs.add_argument("--log-level", type=_level, metavar="{TRACE,DEBUG,INFO,WARNING,ERROR,FATAL}",
                      help="the workers' log level (default WARNING)")
    stamp = logs.add_mutually_exclusive_group()
    stamp.add_argument("--log-with-timestamp", dest="log_with_timestamp", action="store_const", const=True,
                       default=None, help="put the time on the workers' log lines (the default)")
    stamp.add_argument("--log-without-timestamp", "--log-hide-timestamp", dest="log_with_timestamp",
                       action="store_const", const=False, help="leave the time off the workers' log lines")
    stamp.add_argument("--no-log-hide-timestamp", dest="log_with_timestamp", action="store_const", const=True,
                       help=argparse.SUPPRESS)
    logs.add_argument("-prefix-timestamp", "--prefix-output-with-timestamp", dest="prefix_output_with_timestamp",
                      action="store_true", help="put the time before each line of the workers' output")
    hosts = p.add_argument_group("hosts").add_mutually_exclusive_group()
    hosts.add_argument("-H", "--hosts", help="hosts and their slots, e.g. a:2,b:2 (default localhost:NP)")
    hosts.add_argument("-hostfile", "--hostfile", help="file of 'host slots=N' lines")
    hosts.add_argument("--host-discovery-script",
                       help="executable printing the usable hosts as host[:slots] lines (elastic training)")
    controller = p.add_argument_group("controller").add_mutually_exclusive_group()
    controller.add_argument("--gloo", action="store_true", help="start the ranks with roundelrun itself (the default)")
    controller.add_argument("--mpi", action="store_true", help="start the ranks with mpirun/mpiexec instead of ssh")
    controller.add_argument("--jsrun", dest="use_jsrun", action="store_true",
                            help="no effect in roundel (ranks start over ssh)")
    p.add_argument("--remote-env", choices=REMOTE_ENV_MODES,
                   help="what of this environment ranks on other hosts get: all (the default, as horovodrun) but "
                        "this host's own variables (HOSTNAME, PWD, HOME, SSH_*, DISPLAY, ...), or listed: only "
                        "roundel's, Horovod's, NCCL's and Gloo's variables, PATH and the like, and the -x ones")
    p.add_argument("-x", dest="export", action="append", default=[], metavar="VAR[=VALUE]",
                   help="pass VAR (from this environment, or set to VALUE) to the workers, also over ssh; may repeat")
    p.add_argument("command", nargs=argparse.REMAINDER, help="the command each rank runs")
    return p


def exports(names: list[str]) -> dict[str, str]:
    """The ``-x VAR[=VALUE]`` variables; raise UsageError for a VAR that is not set here."""
    env = {}
    for item in names:
        name, sep, value = item.partition("=")
        if not sep:
            if name not in os.environ:
                raise UsageError(f"-x {name}: {name} is not set in roundelrun's environment")
            value = os.environ[name]
        env[name] = value
    return env


def _bit(value: bool) -> str:
    return "1" if value else "0"


# The flags that set a setting: (dest, flag, variable, conversion); a dest left at None sets nothing
ENV_FLAGS = (
    ("fusion_threshold_mb", "--fusion-threshold-mb", "ROUNDEL_FUSION_THRESHOLD", lambda v: str(int(v * MIB))),
    ("bucket_cap_mb", "--bucket-cap-mb", "ROUNDEL_BUCKET_CAP_MB", repr),
    ("cycle_time_ms", "--cycle-time-ms", "ROUNDEL_CYCLE_TIME", lambda v: repr(float(v))),
    ("cache_capacity", "--cache-capacity", "ROUNDEL_CACHE_CAPACITY", str),
    ("hierarchical_allreduce", "--hierarchical-allreduce", "ROUNDEL_HIERARCHICAL_ALLREDUCE", _bit),
    ("hierarchical_allgather", "--hierarchical-allgather", "ROUNDEL_HIERARCHICAL_ALLGATHER", _bit),
    ("torus_allreduce", "--torus-allreduce", "ROUNDEL_TORUS_ALLREDUCE", _bit),
    ("autotune", "--autotune", "ROUNDEL_AUTOTUNE", _bit),
    ("autotune_log_file", "--autotune-log-file", "ROUNDEL_AUTOTUNE_LOG", str),
    ("autotune_warmup_samples", "--autotune-warmup-samples", "ROUNDEL_AUTOTUNE_WARMUP_SAMPLES", str),
    ("autotune_steps_per_sample", "--autotune-steps-per-sample", "ROUNDEL_AUTOTUNE_STEPS_PER_SAMPLE", str),
    ("autotune_bayes_opt_max_samples", "--autotune-bayes-opt-max-samples",
     "ROUNDEL_AUTOTUNE_BAYES_OPT_MAX_SAMPLES", str),
    ("autotune_gaussian_process_noise", "--autotune-gaussian-process-noise",
     "ROUNDEL_AUTOTUNE_GAUSSIAN_PROCESS_NOISE", repr),
    ("timeline_filename", "--timeline-filename", "ROUNDEL_TIMELINE", str),
    ("timeline_mark_cycles", "--timeline-mark-cycles", "ROUNDEL_TIMELINE_MARK_CYCLES", _bit),
    ("no_stall_check", "--no-stall-check", "ROUNDEL_STALL_CHECK_DISABLE", _bit),
    ("stall_check_warning_time_seconds", "--stall-check-warning-time-seconds",
     "ROUNDEL_STALL_CHECK_TIME_SECONDS", repr),
    ("stall_check_shutdown_time_seconds", "--stall-check-shutdown-time-seconds",
     "ROUNDEL_STALL_SHUTDOWN_TIME_SECONDS", repr),
    ("straggler_report", "--straggler-report", "ROUNDEL_STRAGGLER_REPORT", _bit),
    ("metrics_port", "--metrics-port", "ROUNDEL_METRICS_PORT", str),
    ("mpi_threads_disable", "--mpi-threads-disable", "ROUNDEL_MPI_THREADS_DISABLE", _bit),
    ("num_nccl_streams", "--num-nccl-streams", "ROUNDEL_NUM_NCCL_STREAMS", str),
    ("thread_affinity", "--thread-affinity", "ROUNDEL_THREAD_AFFINITY", str),
    ("gloo_timeout_seconds", "--gloo-timeout-seconds", "ROUNDEL_GLOO_TIMEOUT_SECONDS", repr),
    ("gpu_operations", "--gpu-operations", "ROUNDEL_GPU_OPERATIONS", str),
    ("start_timeout", "--start-timeout", "ROUNDEL_START_TIMEOUT", repr),
    ("elastic_timeout", "--elastic-timeout", "ROUNDEL_ELASTIC_TIMEOUT", repr),
    ("log_level", "--log-level", "ROUNDEL_LOG_LEVEL", str.lower),
    ("log_with_timestamp", "--log-with-timestamp", "ROUNDEL_LOG_HIDE_TIME", lambda v: _bit(not v)),
)


def settings_env(args: argparse.Namespace) -> dict[str, str]:
    """The workers' settings variables for the flags given, plus the ``-x`` exports (and their names in
    ``ROUNDEL_FORWARD_ENV`` so that ssh forwards them); raise UsageError naming a bad flag.

    The whole worker environment (this one, overridden by these) is validated too."""
    env: dict[str, str] = {}
    for dest, flag, var, convert in ENV_FLAGS:
        value = getattr(args, dest, None)
        if value is None:
            continue
        if isinstance(value, (int, float)) and not isinstance(value, bool) and value < 0:
            raise UsageError(f"{flag} {value:g} must be >= 0")
        env[var] = convert(value)
        try:
            Settings.from_env({var: env[var]})
        except SettingsError as exc:
            raise UsageError(f"{flag} {value}: {exc}") from None
    if args.tcp_flag:
        env["NCCL_IB_DISABLE"] = "1"
    if args.verbose and "ROUNDEL_LOG_LEVEL" not in env:
        env["ROUNDEL_LOG_LEVEL"] = "debug"
    if args.nics:
        env["ROUNDEL_NETWORK_INTERFACE"] = ",".join(args.nics)
    if getattr(args, "remote_env", None):
        env[REMOTE_ENV] = args.remote_env
    mode = env.get(REMOTE_ENV) or os.environ.get(REMOTE_ENV)
    if mode and mode not in REMOTE_ENV_MODES:
        raise UsageError(f"{REMOTE_ENV}={mode!r}: use one of {', '.join(REMOTE_ENV_MODES)}")
    exported = exports(args.export)
    env.update(exported)
    if exported:
        env[FORWARD_VARS] = ",".join(exported)
    try:
        Settings.from_env({**os.environ, **env})  # the workers' whole environment must be valid too
    except SettingsError as exc:
        raise UsageError(str(exc)) from None
    return env


def given_flags(argv: list[str]) -> set[str]:
    """The ``dest`` of every flag ``argv`` sets (before the command), whatever its value."""
    p = parser()
    for action in p._actions:
        action.default = argparse.SUPPRESS
    args, _ = p.parse_known_args(argv)
    return set(vars(args)) - {"command"}


def ignored_flags(args: argparse.Namespace) -> tuple[list[str], list[str]]:
    """(flags given that have no effect in roundel, flags given that roundel does not act on yet)."""
    def given(dest: str) -> bool:
        return getattr(args, dest, None) not in (None, False)

    return ([flag for dest, flag in NO_EFFECT.items() if given(dest)],
            [flag for dest, flag in NOT_YET.items() if given(dest)])
