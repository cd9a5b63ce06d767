"""``roundelrun``'s command line: every ``horovodrun`` 0.28.1 flag, and what each becomes for the workers.

The parser accepts Horovod's flags with their short forms and aliases. The
flags that set a setting are made from the settings table
(:data:`roundel.common.settings.SPECS`, their help and default too); the
others (ranks, hosts, ssh, elastic discovery, output, controller) are
declared here. The parsed flags become a
:class:`roundel.runner.options.LaunchOptions`; :func:`settings_env` turns
those into the workers' ``ROUNDEL_*`` settings variables (as Horovod's
launcher turns them into ``HOROVOD_*`` ones); :func:`ignored_flags` names
the flags given that have no effect in roundel, for the launcher's one-line
notice.
"""

from __future__ import annotations

import argparse
import difflib
import os

from roundel import __version__
from roundel.errors import SettingsError
from roundel.common.settings import SPECS, Settings, Spec
from roundel.runner.options import LaunchOptions
from roundel.runner.spawn import FORWARD_VARS, REMOTE_ENV, REMOTE_ENV_MODES, STRICT_HOST_KEY_CHECKING

__all__ = ["NO_EFFECT", "NOT_YET", "UsageError", "exports", "given_flags", "ignored_flags", "join_list", "parser",
           "settings_env"]

NO_EFFECT = {
    **{spec.flag.dest: spec.flag.names[0] for spec in SPECS if spec.field is None and spec.flag},
    "tcp_flag": "--tcp",
    "binding_args": "--binding-args",
    "ccl_bgt_affinity": "--ccl-bgt-affinity",
    "use_jsrun": "--jsrun",
}
"""Flags for hardware or libraries roundel does not drive: accepted (their variables are still set), no effect."""

NOT_YET = {spec.flag.dest: spec.flag.names[0] for spec in SPECS if spec.not_yet and spec.flag}
"""Flags whose variables are passed to the workers but which roundel's engine does not act on yet."""

_GROUPS = {
    "params": "tunable parameters",
    "autotune": "autotune",
    "elastic": "elastic training (enabled by --host-discovery-script, or by --min-np with -H)",
    "timeline": "timeline",
    "stall": "stall check",
    "observability": "observability",
    "library": "library options",
    "logging": "logging",
}
"""``Flag.group`` -> the ``--help`` section its flag is listed in ("" is the top of the page)."""


class UsageError(Exception):
    """A bad command line or setting, reported before anything starts."""


def _ranks(raw: str) -> frozenset:
    """``0,2-3`` -> {0, 2, 3}."""
    ranks: set[int] = set()
    try:
        for part in raw.split(","):
            first, _, last = part.strip().partition("-")
            ranks.update(range(int(first), int(last or first) + 1))
    except ValueError:
        raise argparse.ArgumentTypeError(f"{raw!r}: expected ranks such as 0 or 0,2-3") from None
    if not ranks or min(ranks) < 0:
        raise argparse.ArgumentTypeError(f"{raw!r}: expected ranks such as 0 or 0,2-3")
    return frozenset(ranks)


class _JoinAction(argparse.Action):
    """A repeat flag (``--network-interfaces eth0,ib0``, given again): one comma-separated list of them all."""

    def __call__(self, parser, namespace, values, option_string=None):
        setattr(namespace, self.dest, join_list(getattr(namespace, self.dest, None) or "", str(values)))


def join_list(*values: str) -> str:
    """Comma-separated ``values`` as one list, blank entries dropped (``"a, b", "c"``: ``"a,b,c"``)."""
    return ",".join(name.strip() for value in values for name in value.split(",") if name.strip())


def _helps(spec: Spec) -> tuple[str, str | None]:
    """The ``--help`` lines of ``spec``'s flag and of its off strings (None: not listed), with the table's
    default: a value flag's in brackets, a switch's on the side that gives it."""
    flag = spec.flag
    assert flag is not None
    if spec.field is None:
        return flag.help, flag.off_help
    if not flag.switch:
        default = spec.default_text()
        return (flag.help if default == "unset" else f"{flag.help} (default {default})"), None
    on, off = (spec.parse(spec.var, flag.env_value(side)) == spec.default for side in (True, False))
    return (f"{flag.help} (the default)" if on else flag.help,
            f"{flag.off_help} (the default)" if off and flag.off_help else flag.off_help)


def _add_setting_flag(group, spec: Spec) -> None:
    """Add ``spec``'s flag (from the settings table) to ``group``; its ``dest`` stays None when it is not given.
    A switch's on and off strings exclude each other."""
    flag = spec.flag
    assert flag is not None
    on_help, off_help = _helps(spec)
    if flag.switch:
        both = group.add_mutually_exclusive_group()
        both.add_argument(*flag.names, dest=flag.dest, action="store_const", const=True, default=None,
                          help=on_help)
        both.add_argument(*flag.off, dest=flag.dest, action="store_const", const=False,
                          help=off_help or argparse.SUPPRESS)
    elif flag.repeat:
        group.add_argument(*flag.names, dest=flag.dest, action=_JoinAction, metavar=flag.metavar, help=on_help)
    else:
        group.add_argument(*flag.names, dest=flag.dest, type=flag.type, choices=flag.choices,
                           metavar=flag.metavar, help=on_help)


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
    """The ``roundelrun`` argument parser (every ``horovodrun`` 0.28.1 flag, plus ``-x`` and ssh policy).

    A flag that sets a setting leaves its ``dest`` None when it is not given."""
    p = _Parser(
        prog="roundelrun",
        description="Run a command as the ranks of a roundel (Horovod-style) distributed job. A setting's flag "
                    "that is not given leaves the workers its ROUNDEL_/HOROVOD_ variable, where this environment "
                    "has one, else the default shown.",
        allow_abbrev=False,
    )
    p.add_argument("-v", "--version", action="version", version=__version__, help="print roundel's version")
    p.add_argument("-np", "--num-proc", dest="np", type=int, help="number of ranks to start")
    p.add_argument("-cb", "--check-build", action="store_true",
                   help="show which frameworks, controllers and tensor operations are available, and exit")
    p.add_argument("--disable-cache", action="store_true",
                   help="do not cache host checks (roundel never caches them; the response cache is "
                        "turned off with --cache-capacity 0)")
    p.add_argument("--output-filename", metavar="DIR",
                   help="also write each rank's output to DIR/rank.<N>/stdout and stderr")
    p.add_argument("--ranks-filter", type=_ranks, metavar="RANKS",
                   help="show only these ranks' output on the console, e.g. 0 or 0,2-3 (torchrun's "
                        "--local-ranks-filter; --output-filename still gets every rank's)")
    p.add_argument("--verbose", action="store_true", help="print the launch plan and log at debug level")
    p.add_argument("--config-file", help="YAML file of settings (flags given on the command line win over it, "
                                         "and it wins over the environment)")
    ssh = p.add_argument_group("ssh")
    ssh.add_argument("-p", "--ssh-port", type=int, help="ssh port of the remote hosts")
    ssh.add_argument("-i", "--ssh-identity-file", help="ssh private key for the remote hosts")
    ssh.add_argument("--ssh-strict-host-key-checking", choices=STRICT_HOST_KEY_CHECKING,
                     help="ssh's StrictHostKeyChecking for the hosts (default: whatever your ssh "
                          "configuration says, ssh's own default being ask, which BatchMode turns into no "
                          "connection to an unknown host)")
    groups = {"": p, **{key: p.add_argument_group(title) for key, title in _GROUPS.items()}}
    for spec in SPECS:
        if spec.flag is not None:
            _add_setting_flag(groups[spec.flag.group], spec)
    elastic = groups["elastic"]
    elastic.add_argument("--min-np", "--min-num-proc", dest="min_np", type=int,
                         help="fewest workers to train with (default -np); with -H/--hostfile it makes the job elastic "
                              "on those fixed hosts, as in horovodrun")
    elastic.add_argument("--max-np", "--max-num-proc", dest="max_np", type=int,
                         help="most workers to train with (default: every discovered slot)")
    elastic.add_argument("--slots-per-host", "--slots", dest="slots", type=int, default=1,
                         help="slots of a discovered host that prints no count (default %(default)s)")
    elastic.add_argument("--reset-limit", type=int, help="end the job after this many membership resets")
    elastic.add_argument("--blacklist-cooldown-range", type=float, nargs=2, metavar=("LO", "HI"),
                         help="re-admit a blacklisted host after a cooldown of LO..HI seconds (default: never)")
    library = groups["library"]
    library.add_argument("--mpi-args", default="", help="extra arguments for mpirun (with --mpi)")
    library.add_argument("--tcp", dest="tcp_flag", action="store_true", help="no effect in roundel (sets NCCL_IB_DISABLE=1)")
    library.add_argument("--binding-args", help="no effect in roundel")
    library.add_argument("--ccl-bgt-affinity", type=int, help="no effect in roundel")
    groups["logging"].add_argument("-prefix-timestamp", "--prefix-output-with-timestamp",
                                   dest="prefix_output_with_timestamp", action="store_true",
                                   help="put the time before each line of the workers' output")
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


def settings_env(options: LaunchOptions) -> dict[str, str]:
    """The workers' settings variables for the flags given, plus the ``-x`` exports (and their names in
    ``ROUNDEL_FORWARD_ENV`` so that ssh forwards them); raise UsageError naming a bad flag.

    Each setting a flag (or the config file) sets is handed over under its ``ROUNDEL_`` name, and under
    its Horovod name too where this environment has that one, so that the environment's value cannot
    win. The whole worker environment (this one, overridden by these) is validated too."""
    env: dict[str, str] = {}
    for spec in SPECS:
        flag = spec.flag
        value = None if flag is None else options.setting_flags.get(flag.dest)
        if flag is None or value is None:
            continue
        name = flag.names[0]
        if isinstance(value, (int, float)) and not isinstance(value, bool) and value < 0:
            raise UsageError(f"{name} {value:g} must be >= 0")
        text = flag.env_value(value)
        if text.strip():
            try:
                spec.parse(spec.var, text.strip())
            except SettingsError as exc:
                raise UsageError(f"{name} {value}: {exc}") from None
        env[spec.var] = text
        if spec.horovod_var in os.environ:
            env[spec.horovod_var] = text
    if options.tcp:
        env["NCCL_IB_DISABLE"] = "1"
    if options.remote_env:
        env[REMOTE_ENV] = options.remote_env
    mode = env.get(REMOTE_ENV) or os.environ.get(REMOTE_ENV)
    if mode and mode not in REMOTE_ENV_MODES:
        raise UsageError(f"{REMOTE_ENV}={mode!r}: use one of {', '.join(REMOTE_ENV_MODES)}")
    exported = exports(list(options.exports))
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
