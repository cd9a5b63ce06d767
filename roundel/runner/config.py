"""``roundelrun --config-file FILE``: the launcher's settings in YAML.

Accepted keys are the long flag names (``fusion-threshold-mb`` or
``fusion_threshold_mb``, ``cycle-time-ms``, ``cache-capacity``, ``start-timeout``,
``verbose``, ``ssh-port``, ``network-interfaces``, ``output-filename``, ...)
and every section of Horovod 0.28.1's config file (each setting's key is
declared with it in :data:`roundel.common.settings.SPECS`)::

    controller: gloo                      # or mpi
    params: {fusion_threshold_mb: 32, cycle_time_ms: 5, cache_capacity: 2048,
             hierarchical_allreduce: false, hierarchical_allgather: false, torus_allreduce: false}
    autotune: {enabled: true, log_file: at.csv, warmup_samples: 3, steps_per_sample: 10,
               bayes_opt_max_samples: 20, gaussian_process_noise: 0.8}
    timeline: {filename: /tmp/timeline.json, mark_cycles: false}
    stall_check: {enabled: true, warning_time_seconds: 60, shutdown_time_seconds: 0}
    library_options: {mpi_threads_disable: false, num_nccl_streams: 1, thread_affinity: 0,
                      gloo_timeout_seconds: 60}
    logging: {level: info, with_timestamp: true}

A flag given on the command line wins over the file, and the file wins over
the environment (the launcher hands the workers what it sets). Unknown keys
and values of the wrong type are errors naming the file and key.
"""

from __future__ import annotations

import argparse

import yaml

from roundel.common.settings import SPECS, Flag
from roundel.runner.flags import join_list

__all__ = ["ConfigError", "apply", "load"]


class ConfigError(ValueError):
    """The config file cannot be read or holds an unknown key or a bad value."""


_SETTING_FLAGS = [spec.flag for spec in SPECS if spec.flag is not None]


def _kind(flag: Flag) -> type:
    """The type a config value of ``flag`` must have: bool for a switch, the flag's int or float, else str."""
    if flag.switch:
        return bool
    return flag.type if flag.type in (int, float) else str


# dest -> type of the value, for the top-level keys of the launcher's own flags (a setting's flag is one too)
_FLAGS = {
    "disable_cache": bool, "verbose": bool, "ssh_port": int, "ssh_identity_file": str,
    "ssh_strict_host_key_checking": str, "output_filename": str, "mpi_args": str,
    "prefix_output_with_timestamp": bool,
}
_CONTROLLERS = {"gloo": "gloo", "mpi": "mpi"}
# a setting flag's long names (its dest among them) -> the flag: each is a top-level key
_BY_NAME = {name.lstrip("-").replace("-", "_"): flag for flag in _SETTING_FLAGS for name in flag.names
            if name.startswith("--")}


def _sections() -> dict[str, dict[str, Flag]]:
    """Horovod's sections: section -> key -> the flag of the setting that key sets."""
    sections: dict[str, dict[str, Flag]] = {}
    for flag in _SETTING_FLAGS:
        if flag.config:
            section, key = flag.config.split(".")
            sections.setdefault(section, {})[key] = flag
    return sections


_SECTIONS = _sections()


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


def _setting(flag: Flag, value, where: str, negated: bool = False):
    """The value for ``flag``'s ``dest`` of a setting's config ``value``, as its flag would have parsed it."""
    typed = _typed(value, _kind(flag), where)
    if flag.switch:
        return (not typed) if negated else typed
    if isinstance(typed, str) and flag.type is not None:
        typed = flag.type(typed)  # str.upper, str.lower: the spelling the flag gives
    if flag.choices is not None and typed not in flag.choices:
        raise ConfigError(f"{where}: {value!r} is not one of {', '.join(flag.choices)}")
    return join_list(typed) if flag.repeat else typed


def load(path: str) -> dict:
    """Read ``path`` into ``{dest: value}`` of the launcher's arguments; raise ConfigError."""
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
    flags: dict[str, object] = {}
    for key, value in data.items():
        name = str(key).replace("-", "_")
        where = f"--config-file {path}: {key}"
        if name == "controller":
            controller = _CONTROLLERS.get(str(value).lower())
            if controller is None:
                raise ConfigError(f"{where}: {value!r} is not a controller; use gloo or mpi")
            flags[controller] = True
        elif name in _SECTIONS and (isinstance(value, dict) or name not in _BY_NAME):
            if not isinstance(value, dict):
                raise ConfigError(f"{where}: expected a mapping")
            for sub, subvalue in value.items():
                subwhere = f"{where}.{sub}"
                flag = _SECTIONS[name].get(str(sub).replace("-", "_"))
                if flag is None:
                    raise ConfigError(f"{subwhere}: unknown setting (known: {', '.join(_SECTIONS[name])})")
                flags[flag.dest] = _setting(flag, subvalue, subwhere, negated=flag.config_negated)
        elif name in _BY_NAME:  # `autotune: true` is the flag, `autotune: {...}` Horovod's section
            flag = _BY_NAME[name]
            flags[flag.dest] = _setting(flag, value, where)
        elif name in _FLAGS:
            flags[name] = _typed(value, _FLAGS[name], where)
        else:
            known = ", ".join(sorted({*_FLAGS, *_BY_NAME}))
            raise ConfigError(f"{where}: unknown setting (known: controller, {known}, "
                              f"{', '.join(_SECTIONS)})")
    return flags


def apply(args: argparse.Namespace, config: dict, given: set[str]) -> None:
    """Fill ``args`` from ``config`` (from :func:`load`) where the command line did not set the flag.

    ``given`` holds the flags (their ``dest``) the command line set, even to their default value: those
    win over the file, and so does a flag that implies a setting's value (``--verbose``: the log level).
    """
    for dest, value in config.items():
        if dest in _CONTROLLERS and (args.gloo or args.mpi):
            continue  # a controller chosen on the command line wins
        flag = next((f for f in _SETTING_FLAGS if f.dest == dest), None)
        implied_by = flag.implied_by[0] if flag is not None and flag.implied_by else None
        if dest in given or implied_by in given:
            continue
        setattr(args, dest, value)
