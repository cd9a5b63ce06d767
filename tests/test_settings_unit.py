"""Every setting read from the environment: names, precedence, defaults and errors."""

import dataclasses

import pytest

from roundel.errors import SettingsError
from roundel.common.settings import MIB, SPECS, Settings

# field, variable suffix, default, (raw, parsed) accepted, raws refused
VARIABLES = [
    ("fusion_threshold", "FUSION_THRESHOLD", 128 * MIB, ("0", 0), ["-1", "1.5", "lots"]),
    ("cycle_time_ms", "CYCLE_TIME", 1.0, ("0.5", 0.5), ["-0.1", "fast", "nan"]),
    ("cache_capacity", "CACHE_CAPACITY", 1024, ("0", 0), ["-3", "ten"]),
    ("stall_check_time_s", "STALL_CHECK_TIME_SECONDS", 60.0, ("2.5", 2.5), ["0", "-1", "x"]),
    ("stall_check_enabled", "STALL_CHECK_DISABLE", True, ("1", False), ["maybe", "2"]),
    ("stall_shutdown_time_s", "STALL_SHUTDOWN_TIME_SECONDS", 0.0, ("600", 600.0), ["-5", "never"]),
    ("collective_timeout_s", "GLOO_TIMEOUT_SECONDS", 60.0, ("5", 5.0), ["0", "-2", "soon"]),
    ("start_timeout_s", "START_TIMEOUT", 30.0, ("12", 12.0), ["0", "x"]),
    ("heartbeat_timeout_s", "HEARTBEAT_TIMEOUT_SECONDS", 15.0, ("3", 3.0), ["0", "-1"]),
    ("timeline_filename", "TIMELINE", "", ("/tmp/t.json", "/tmp/t.json"), []),
    ("timeline_mark_cycles", "TIMELINE_MARK_CYCLES", False, ("true", True), ["sometimes"]),
    ("autotune", "AUTOTUNE", False, ("YES", True), ["2"]),
    ("autotune_log", "AUTOTUNE_LOG", "", ("tune.csv", "tune.csv"), []),
    ("autotune_warmup_samples", "AUTOTUNE_WARMUP_SAMPLES", 3, ("0", 0), ["-1", "3.5"]),
    ("autotune_steps_per_sample", "AUTOTUNE_STEPS_PER_SAMPLE", 10, ("4", 4), ["0", "-1", "x"]),
    ("autotune_bayes_opt_max_samples", "AUTOTUNE_BAYES_OPT_MAX_SAMPLES", 20, ("7", 7), ["-2"]),
    ("autotune_gaussian_process_noise", "AUTOTUNE_GAUSSIAN_PROCESS_NOISE", 0.8, ("0.1", 0.1), ["1.5", "-0.1", "x"]),
    ("hierarchical_allreduce", "HIERARCHICAL_ALLREDUCE", False, ("on", True), ["y"]),
    ("hierarchical_allgather", "HIERARCHICAL_ALLGATHER", False, ("1", True), ["enabled"]),
    ("torus_allreduce", "TORUS_ALLREDUCE", False, ("1", True), ["3"]),
    ("elastic_timeout_s", "ELASTIC_TIMEOUT", 600.0, ("30", 30.0), ["0", "x"]),
    ("log_level", "LOG_LEVEL", "warning", ("DEBUG", "debug"), ["verbose"]),
    ("log_hide_time", "LOG_HIDE_TIME", False, ("1", True), ["hide"]),
    ("cpu_operations", "CPU_OPERATIONS", "gloo", ("MPI", "mpi"), ["ccl", "nccl"]),
    ("gpu_operations", "GPU_OPERATIONS", "nccl", ("GLOO", "gloo"), ["ccl", "cuda"]),
    ("bucket_cap_mb", "BUCKET_CAP_MB", 25.0, ("0", 0.0), ["-1", "big"]),
    ("shared_memory", "SHARED_MEMORY", True, ("0", False), ["maybe"]),
    ("peer_links", "PEER_LINKS", True, ("0", False), ["maybe"]),
    ("steady_replay", "STEADY_REPLAY", True, ("0", False), ["maybe"]),
    ("coordinator_reduce_bytes", "COORDINATOR_REDUCE_BYTES", 4096, ("0", 0), ["-1", "65537", "4k"]),
    ("disable_group_fusion", "DISABLE_GROUP_FUSION", False, ("1", True), ["groups"]),
    ("straggler_report", "STRAGGLER_REPORT", "auto", ("1", "on"), ["sometimes"]),
    ("metrics_port", "METRICS_PORT", "", ("0.0.0.0:9100", "0.0.0.0:9100"), ["http", "70000", "host:"]),
    ("relay_from_ranks", "RELAY_FROM_RANKS", 64, ("0", 0), ["-1", "many"]),
    ("relay_fanout", "RELAY_FANOUT", 4, ("2", 2), ["0", "x"]),
    ("num_nccl_streams", "NUM_NCCL_STREAMS", 1, ("1", 1), ["2", "0", "x"]),
    ("network_interface", "NETWORK_INTERFACE", "", ("eth0, ib0", "eth0,ib0"), [",", ",,"]),
]
IDS = [row[1] for row in VARIABLES]


def name(prefix: str, suffix: str) -> str:
    """The variable of a setting under ``prefix``: Horovod's own name where it is not HOROVOD_ + suffix."""
    spec = next(s for s in SPECS if s.suffix == suffix)
    return spec.var if prefix == "ROUNDEL_" else spec.horovod_var


def test_every_setting_is_covered_here():
    assert sorted(f.name for f in dataclasses.fields(Settings)) == sorted(row[0] for row in VARIABLES)


def test_an_empty_environment_gives_every_default():
    settings = Settings.from_env({})
    for field, _, default, _, _ in VARIABLES:
        assert getattr(settings, field) == default, field
    assert settings == Settings()


@pytest.mark.parametrize("field, suffix, default, good, bad", VARIABLES, ids=IDS)
@pytest.mark.parametrize("prefix", ["ROUNDEL_", "HOROVOD_"])
def test_each_variable_is_read_under_both_prefixes(prefix, field, suffix, default, good, bad):
    raw, parsed = good
    assert getattr(Settings.from_env({name(prefix, suffix): f" {raw} "}), field) == parsed


@pytest.mark.parametrize("field, suffix, default, good, bad", VARIABLES, ids=IDS)
def test_the_roundel_variable_wins_over_the_horovod_one(field, suffix, default, good, bad):
    raw, parsed = good
    other = bad[0] if bad else "ignored-value"
    environ = {"ROUNDEL_" + suffix: raw, name("HOROVOD_", suffix): other}
    assert getattr(Settings.from_env(environ), field) == parsed


@pytest.mark.parametrize("field, suffix, default, good, bad", VARIABLES, ids=IDS)
def test_an_empty_variable_counts_as_unset(field, suffix, default, good, bad):
    raw, parsed = good
    assert getattr(Settings.from_env({"ROUNDEL_" + suffix: "  "}), field) == default
    assert getattr(Settings.from_env({"ROUNDEL_" + suffix: "", name("HOROVOD_", suffix): raw}), field) == parsed


BAD_VALUES = [(prefix, suffix, raw) for _, suffix, _, _, bad in VARIABLES for raw in bad
              for prefix in ("ROUNDEL_", "HOROVOD_")]


@pytest.mark.parametrize("prefix, suffix, raw", BAD_VALUES,
                         ids=[f"{name(p, s)}={r}" for p, s, r in BAD_VALUES])
def test_a_bad_value_raises_naming_the_variable_and_the_value(prefix, suffix, raw):
    var = name(prefix, suffix)
    with pytest.raises(SettingsError) as info:
        Settings.from_env({var: raw})
    message = str(info.value)
    assert message.startswith(f"{var}={raw!r}")
    assert len(message) > len(f"{var}={raw!r}") + 10  # says what to use instead


def test_settings_error_is_a_value_error():
    with pytest.raises(ValueError):
        Settings.from_env({"HOROVOD_CYCLE_TIME": "soon"})


def test_unrelated_variables_are_ignored():
    assert Settings.from_env({"HOROVOD_RANK": "3", "ROUNDEL_UNKNOWN": "x", "FUSION_THRESHOLD": "1"}) == Settings()


def test_settings_are_read_from_os_environ_by_default(monkeypatch):
    monkeypatch.setenv("HOROVOD_FUSION_THRESHOLD", "4096")
    monkeypatch.delenv("ROUNDEL_FUSION_THRESHOLD", raising=False)
    assert Settings.from_env().fusion_threshold == 4096
