"""``roundelrun``'s options once parsed: one typed object the launcher passes around.

:meth:`LaunchOptions.from_args` turns the parser's ``argparse.Namespace``
(:mod:`roundel.runner.flags`, with the config file applied) into it. The
flags that set a setting of the table (:data:`roundel.common.settings.SPECS`)
stay together in :attr:`LaunchOptions.setting_flags`, keyed by the flag's
``dest``, for :func:`roundel.runner.flags.settings_env` to turn into the
workers' variables; the launcher's own flags are fields.
"""

from __future__ import annotations

import argparse
import dataclasses
from typing import Mapping

from roundel.common.settings import SPECS, setting

__all__ = ["LaunchOptions"]

_NICS = setting("network_interface")


@dataclasses.dataclass(frozen=True)
class LaunchOptions:
    """What ``roundelrun`` was asked to do (see ``roundelrun --help`` for each flag).

    ``command``: what each rank runs. ``nics``: the ``--network-interfaces`` given (comma-separated),
    None when not given. ``exports``: the ``-x VAR[=VALUE]`` items. ``tcp``: ``--tcp``.
    ``setting_flags``: each settings-table flag given, on the command line or in the config file
    (``dest``: value), with the value a flag implies where only that flag was given
    (``--verbose``: the log level ``DEBUG``).
    """

    command: tuple[str, ...]
    np: int | None = None
    hosts: str | None = None
    hostfile: str | None = None
    host_discovery_script: str | None = None
    min_np: int | None = None
    max_np: int | None = None
    slots: int = 1
    reset_limit: int | None = None
    blacklist_cooldown_range: tuple[float, float] | None = None
    ssh_port: int | None = None
    ssh_identity_file: str | None = None
    ssh_strict_host_key_checking: str | None = None
    remote_env: str | None = None
    output_filename: str | None = None
    ranks_filter: frozenset[int] | None = None
    verbose: bool = False
    prefix_output_with_timestamp: bool = False
    mpi: bool = False
    mpi_args: str = ""
    nics: str | None = None
    exports: tuple[str, ...] = ()
    tcp: bool = False
    setting_flags: Mapping[str, object] = dataclasses.field(default_factory=dict)

    @property
    def elastic(self) -> bool:
        """Whether the job is elastic: ``--host-discovery-script``, or ``--min-np`` (horovodrun's rule)."""
        return bool(self.host_discovery_script) or self.min_np is not None

    @classmethod
    def from_args(cls, args: argparse.Namespace) -> "LaunchOptions":
        """The options of a parsed command line (the config file already applied to ``args``)."""
        setting_flags: dict[str, object] = {}
        for spec in SPECS:
            flag = spec.flag
            if flag is None:
                continue
            value = getattr(args, flag.dest, None)
            if value is None and flag.implied_by is not None and getattr(args, flag.implied_by[0], None):
                value = flag.implied_by[1]
            if value is not None:
                setting_flags[flag.dest] = value
        cooldown = args.blacklist_cooldown_range
        nics = setting_flags.get(_NICS.flag.dest) if _NICS.flag is not None else None
        return cls(
            command=tuple(args.command), np=args.np, hosts=args.hosts, hostfile=args.hostfile,
            host_discovery_script=args.host_discovery_script, min_np=args.min_np, max_np=args.max_np,
            slots=args.slots, reset_limit=args.reset_limit,
            blacklist_cooldown_range=(float(cooldown[0]), float(cooldown[1])) if cooldown else None,
            ssh_port=args.ssh_port, ssh_identity_file=args.ssh_identity_file,
            ssh_strict_host_key_checking=args.ssh_strict_host_key_checking, remote_env=args.remote_env,
            output_filename=args.output_filename, ranks_filter=args.ranks_filter, verbose=bool(args.verbose),
            prefix_output_with_timestamp=bool(args.prefix_output_with_timestamp), mpi=bool(args.mpi),
            mpi_args=args.mpi_args or "", nics=str(nics) if nics else None,
            exports=tuple(args.export or ()), tcp=bool(args.tcp_flag), setting_flags=setting_flags)
