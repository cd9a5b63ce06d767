"""Every tunable of roundel, read from the environment in one place.

Each setting has a ``ROUNDEL_*`` variable and accepts the ``HOROVOD_*`` name that
Horovod job scripts already set; when both are present the ``ROUNDEL_*`` one
wins. ``roundelrun`` flags are turned into these variables for the workers, so
the launcher and the workers validate with the same code.
"""

from __future__ import annotations

import dataclasses
import os
from typing import Callable, Mapping

from roundel.common.errors import SettingsError

MIB = 1024 * 1024

_LOG_LEVELS = ("trace", "debug", "info", "warning", "error", "fatal")


@dataclasses.dataclass(frozen=True)
class Settings:
    """Validated engine and job settings (see README "Settings" for each one)."""

    fusion_threshold: int = 64 * MIB
    cycle_time_ms: float = 1.0
    cache_capacity: int = 1024
    stall_check_time_s: float = 60.0
    stall_check_enabled: bool = True
    stall_shutdown_time_s: float = 0.0
    collective_timeout_s: float = 60.0
    start_timeout_s: float = 30.0
    timeline_filename: str = ""
    autotune: bool = False
    log_level: str = "warning"

    @classmethod
    def from_env(cls, environ: Mapping[str, str] | None = None) -> "Settings":
        """Read and validate every setting; raise SettingsError naming the bad variable."""
        env = os.environ if environ is None else environ
        values = {}
        for spec in _SPECS:
            raw, var = _lookup(env, spec.suffix)
            if raw is None:
                continue
            values[spec.field] = spec.parse(var, raw)
        return cls(**values)


@dataclasses.dataclass(frozen=True)
class _Spec:
    field: str
    suffix: str
    parse: Callable[[str, str], object]


def _lookup(env: Mapping[str, str], suffix: str) -> tuple[str | None, str]:
    for prefix in ("ROUNDEL_", "HOROVOD_"):
        var = prefix + suffix
        raw = env.get(var)
        if raw is not None and raw.strip() != "":
            return raw.strip(), var
    return None, "ROUNDEL_" + suffix


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


def _text(var: str, raw: str) -> str:
    return raw


_SPECS = (
    _Spec("fusion_threshold", "FUSION_THRESHOLD", _int(0, "67108864 (64 MiB; 0 disables fusion)")),
    _Spec("cycle_time_ms", "CYCLE_TIME", _float(0.0, "1 (milliseconds)")),
    _Spec("cache_capacity", "CACHE_CAPACITY", _int(0, "1024 (0 disables the response cache)")),
    _Spec("stall_check_time_s", "STALL_CHECK_TIME_SECONDS", _float(0.0, "60", strictly_above=True)),
    _Spec("stall_check_enabled", "STALL_CHECK_DISABLE", _not_bool),
    _Spec("stall_shutdown_time_s", "STALL_SHUTDOWN_TIME_SECONDS", _float(0.0, "600 (0 never shuts down)")),
    _Spec("collective_timeout_s", "GLOO_TIMEOUT_SECONDS", _float(0.0, "60", strictly_above=True)),
    _Spec("start_timeout_s", "START_TIMEOUT", _float(0.0, "30", strictly_above=True)),
    _Spec("timeline_filename", "TIMELINE", _text),
    _Spec("autotune", "AUTOTUNE", _bool),
    _Spec("log_level", "LOG_LEVEL", _log_level),
)


def env_for_flags(
    fusion_threshold_mb: float | None = None,
    cycle_time_ms: float | None = None,
    cache_capacity: int | None = None,
    disable_cache: bool = False,
    timeline_filename: str | None = None,
    verbose: bool = False,
) -> dict[str, str]:
    """Turn ``roundelrun`` flags into the worker environment; raise SettingsError if a value is bad."""
    env: dict[str, str] = {}
    if fusion_threshold_mb is not None:
        if fusion_threshold_mb < 0:
            raise SettingsError(f"--fusion-threshold-mb {fusion_threshold_mb:g} must be >= 0 (0 disables fusion)")
        env["ROUNDEL_FUSION_THRESHOLD"] = str(int(fusion_threshold_mb * MIB))
    if cycle_time_ms is not None:
        env["ROUNDEL_CYCLE_TIME"] = repr(float(cycle_time_ms))
    if cache_capacity is not None:
        env["ROUNDEL_CACHE_CAPACITY"] = str(cache_capacity)
    if disable_cache:
        env["ROUNDEL_CACHE_CAPACITY"] = "0"
    if timeline_filename:
        env["ROUNDEL_TIMELINE"] = timeline_filename
    if verbose:
        env["ROUNDEL_LOG_LEVEL"] = "debug"
    Settings.from_env(env)
    return env
