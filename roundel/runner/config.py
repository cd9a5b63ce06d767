"""``roundelrun --config-file FILE``: the launcher's settings in YAML.

Accepted keys are the long flag names (``fusion-threshold-mb`` or
``fusion_threshold_mb``, ``cycle-time-ms``, ``cache-capacity``, ``start-timeout``,
``verbose``, ``ssh-port``, ``network-interfaces``, ``output-filename``, ...)
and every section of Horovod 0.28.1's config file::

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

A flag given on the command line wins over the file. Unknown keys and
values of the wrong type are errors naming the file and key.
"""

from __future__ import annotations

import argparse

import yaml

__all__ = ["ConfigError", "apply", "load"]


class ConfigError(ValueError):
    """The config file cannot be read or holds an unknown key or a bad value."""


# dest -> type of the value, for top-level keys (flag names)
_FLAGS = {
    "fusion_threshold_mb": float, "cycle_time_ms": float, "cache_capacity": int, "disable_cache": bool,
    "timeline_filename": str, "start_timeout": float, "verbose": bool, "ssh_port": int,
    "ssh_identity_file": str, "ssh_strict_host_key_checking": str, "network_interfaces": str,
    "network_interface": str, "output_filename": str, "mpi_args": str, "gloo_timeout_seconds": float,
    "log_level": str, "elastic_timeout": float, "prefix_output_with_timestamp": bool,
}
_NICS = ("network_interfaces", "network_interface")
# section -> key -> (dest, type); "no_stall_check" is stored inverted from stall_check.enabled
_SECTIONS = {
    "params": {"fusion_threshold_mb": ("fusion_threshold_mb", float), "cycle_time_ms": ("cycle_time_ms", float),
               "cache_capacity": ("cache_capacity", int),
               "hierarchical_allreduce": ("hierarchical_allreduce", bool),
               "hierarchical_allgather": ("hierarchical_allgather", bool),
               "torus_allreduce": ("torus_allreduce", bool)},
    "autotune": {"enabled": ("autotune", bool), "log_file": ("autotune_log_file", str),
                 "warmup_samples": ("autotune_warmup_samples", int),
                 "steps_per_sample": ("autotune_steps_per_sample", int),
                 "bayes_opt_max_samples": ("autotune_bayes_opt_max_samples", int),
                 "gaussian_process_noise": ("autotune_gaussian_process_noise", float)},
    "timeline": {"filename": ("timeline_filename", str), "mark_cycles": ("timeline_mark_cycles", bool)},
    "stall_check": {"enabled": ("no_stall_check", bool),
                    "warning_time_seconds": ("stall_check_warning_time_seconds", float),
                    "shutdown_time_seconds": ("stall_check_shutdown_time_seconds", float)},
    "library_options": {"mpi_threads_disable": ("mpi_threads_disable", bool),
                        "num_nccl_streams": ("num_nccl_streams", int),
                        "thread_affinity": ("thread_affinity", int),
                        "gloo_timeout_seconds": ("gloo_timeout_seconds", float)},
    "logging": {"level": ("log_level", str), "with_timestamp": ("log_with_timestamp", bool)},
}
_CONTROLLERS = {"gloo": "gloo", "mpi": "mpi"}


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
    flags = {}
    for key, value in data.items():
        name = str(key).replace("-", "_")
        where = f"--config-file {path}: {key}"
        if name == "controller":
            controller = _CONTROLLERS.get(str(value).lower())
            if controller is None:
                raise ConfigError(f"{where}: {value!r} is not a controller; use gloo or mpi")
            flags[controller] = True
        elif name in _NICS:
            flags["nics"] = [n.strip() for n in _typed(value, str, where).split(",") if n.strip()]
        elif name in _FLAGS:
            flags[name] = _typed(value, _FLAGS[name], where)
        elif name in _SECTIONS:
            if not isinstance(value, dict):
                raise ConfigError(f"{where}: expected a mapping")
            for sub, subvalue in value.items():
                subwhere = f"{where}.{sub}"
                entry = _SECTIONS[name].get(str(sub).replace("-", "_"))
                if entry is None:
                    raise ConfigError(f"{subwhere}: unknown setting (known: {', '.join(_SECTIONS[name])})")
                dest, kind = entry
                typed = _typed(subvalue, kind, subwhere)
                flags[dest] = (not typed) if dest == "no_stall_check" else typed
        else:
            raise ConfigError(f"{where}: unknown setting (known: controller, {', '.join(sorted(_FLAGS))}, "
                              f"{', '.join(_SECTIONS)})")
    return flags


def apply(args: argparse.Namespace, config: dict, given: set[str] = frozenset()) -> None:
    """Fill ``args`` from ``config`` (from :func:`load`) where the command line left the flag unset.

    ``given`` holds the flags (their ``dest``) the command line set, even to their default value: those
    win; so does ``--verbose`` over the file's log level.
    """
    for dest, value in config.items():
        if dest in _CONTROLLERS and (args.gloo or args.mpi):
            continue  # a controller chosen on the command line wins
        if dest in given or (dest == "log_level" and "verbose" in given):
            continue
        current = getattr(args, dest, None)
        if current is None or current is False or current == "":
            setattr(args, dest, value)
