"""``roundelrun --config-file FILE``: the launcher's settings in YAML.

Accepted keys are the long flag names (``fusion-threshold-mb`` or
``fusion_threshold_mb``, ``cycle-time-ms``, ``cache-capacity``,
``disable-cache``, ``timeline-filename``, ``start-timeout``, ``verbose``,
``ssh-port``, ``ssh-identity-file``, ``network-interface``,
``output-filename``, ``mpi-args``) and the sections of Horovod's config file::

    params: {fusion_threshold_mb: 32, cycle_time_ms: 5, cache_capacity: 2048}
    timeline: {filename: /tmp/timeline.json}
    stall_check: {enabled: true, warning_time_seconds: 60, shutdown_time_seconds: 0}
    logging: {level: info}

A flag given on the command line wins over the file. Unknown keys and
values of the wrong type are errors naming the file and key.
"""

from __future__ import annotations

import argparse

import yaml

__all__ = ["ConfigError", "apply", "load"]


class ConfigError(ValueError):
    """The config file cannot be read or holds an unknown key or a bad value."""


# dest -> type of the value
_FLAGS = {
    "fusion_threshold_mb": float, "cycle_time_ms": float, "cache_capacity": int, "disable_cache": bool,
    "timeline_filename": str, "start_timeout": float, "verbose": bool, "ssh_port": int,
    "ssh_identity_file": str, "network_interface": str, "output_filename": str, "mpi_args": str,
}
_SECTIONS = {
    "params": {"fusion_threshold_mb": "fusion_threshold_mb", "cycle_time_ms": "cycle_time_ms",
               "cache_capacity": "cache_capacity"},
    "timeline": {"filename": "timeline_filename"},
}
_ENV_SECTIONS = {
    "stall_check": {"warning_time_seconds": ("ROUNDEL_STALL_CHECK_TIME_SECONDS", float),
                    "shutdown_time_seconds": ("ROUNDEL_STALL_SHUTDOWN_TIME_SECONDS", float),
                    "enabled": ("ROUNDEL_STALL_CHECK_DISABLE", bool)},
    "logging": {"level": ("ROUNDEL_LOG_LEVEL", str)},
}


def _typed(value, kind, where: str):
    if kind is bool:
        if not isinstance(value, bool):
            raise ConfigError(f"{where}: expected true or false, not {value!r}")
        return value
    if kind in (int, float):
        if isinstance(value, bool) or not isinstance(value, (int, float)) or (kind is int and value != int(value)):
            raise ConfigError(f"{where}: expected a {'whole ' if kind is int else ''}number, not {value!r}")
        return kind(value)
    if not isinstance(value, (str, int, float)) or isinstance(value, bool):
        raise ConfigError(f"{where}: expected a string, not {value!r}")
    return str(value)


def load(path: str) -> dict:
    """Read ``path`` into ``{"flags": {dest: value}, "env": {VAR: value}}``; raise ConfigError."""
    try:
        with open(path, encoding="utf-8") as f:
            data = yaml.safe_load(f)
    except OSError as exc:
        raise ConfigError(f"--config-file: cannot read {path}: {exc}") from None
    except yaml.YAMLError as exc:
        raise ConfigError(f"--config-file {path}: not valid YAML: {exc}") from None
    if data is None:
        data = {}
    if not isinstance(data, dict):
        raise ConfigError(f"--config-file {path}: expected a mapping of settings at the top level")
    flags, env = {}, {}
    for key, value in data.items():
        name = str(key).replace("-", "_")
        where = f"--config-file {path}: {key}"
        if name in _FLAGS:
            flags[name] = _typed(value, _FLAGS[name], where)
        elif name in _SECTIONS or name in _ENV_SECTIONS:
            if not isinstance(value, dict):
                raise ConfigError(f"{where}: expected a mapping")
            for sub, subvalue in value.items():
                subwhere = f"{where}.{sub}"
                subname = str(sub).replace("-", "_")
                if name in _SECTIONS and subname in _SECTIONS[name]:
                    dest = _SECTIONS[name][subname]
                    flags[dest] = _typed(subvalue, _FLAGS[dest], subwhere)
                elif name in _ENV_SECTIONS and subname in _ENV_SECTIONS[name]:
                    var, kind = _ENV_SECTIONS[name][subname]
                    typed = _typed(subvalue, kind, subwhere)
                    if var == "ROUNDEL_STALL_CHECK_DISABLE":
                        typed = "0" if typed else "1"
                    env[var] = str(typed)
                else:
                    raise ConfigError(f"{subwhere}: unknown setting")
        else:
            raise ConfigError(f"{where}: unknown setting (known: {', '.join(sorted(_FLAGS))}, "
                              f"{', '.join(sorted({*_SECTIONS, *_ENV_SECTIONS}))})")
    return {"flags": flags, "env": env}


def apply(args: argparse.Namespace, config: dict, argv: list[str]) -> None:
    """Fill ``args`` from ``config`` where the command line did not set the flag; the config's
    environment settings become ``-x`` exports unless already exported."""
    for dest, value in config["flags"].items():
        current = getattr(args, dest)
        if current is None or current is False or (dest == "mpi_args" and current == ""):
            setattr(args, dest, value)
    exported = {item.partition("=")[0] for item in args.export}
    for var, value in config["env"].items():
        if var not in exported:
            args.export.append(f"{var}={value}")
