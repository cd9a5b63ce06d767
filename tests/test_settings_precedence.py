"""Every setting of the table, set three ways: a flag beats the config file, which beats the environment.

Each case runs what ``roundelrun`` runs before it starts a worker (parse, apply the config file, make the
settings variables) and reads the worker's settings from the environment the worker would get.
"""

import os

import pytest
import yaml

from roundel.common.settings import SPECS, Settings
from roundel.runner import config as configlib
from roundel.runner import flags
from roundel.runner.options import LaunchOptions

FLAGGED = [spec for spec in SPECS if spec.flag is not None]
# Settings that accept one value only (Horovod's flag kept for its scripts): no order between sources to show,
# so they are set to that value every way.
ONE_VALUE = {"NUM_NCCL_STREAMS": 1}


def samples(flag):
    """Three values of ``flag``, the middle one differing from the others (environment, config, flag)."""
    only = next((value for spec in FLAGGED for suffix, value in ONE_VALUE.items()
                 if spec.flag is flag and spec.suffix == suffix), None)
    if only is not None:
        return [only] * 3
    if flag.switch:
        return [True, False, True]
    if flag.choices:
        return list(flag.choices[:3])
    if flag.type is int:
        return [1, 2, 3]
    if flag.type is float:
        return [0.25, 0.5, 0.75]
    return ["9101", "9102", "9103"]  # a port, and a file name too


def config_text(flag, value) -> str:
    """A config file setting ``flag`` to ``value``, under Horovod's key where it has one."""
    if not flag.config:
        return yaml.safe_dump({flag.dest: value})
    section, key = flag.config.split(".")
    return yaml.safe_dump({section: {key: (not value) if flag.config_negated else value}})


def argv_for(flag, value) -> list[str]:
    if flag.switch:
        return [flag.names[0] if value else flag.off[0]]
    return [flag.names[0], str(value)]


def worker_environ(monkeypatch, tmp_path, environ, argv, config=None):
    """The environment a worker of ``roundelrun ARGV true`` gets, with ``environ`` as roundelrun's own."""
    for name in list(os.environ):
        if name.startswith(("ROUNDEL_", "HOROVOD_")):
            monkeypatch.delenv(name)
    for name, value in environ.items():
        monkeypatch.setenv(name, value)
    if config is not None:
        path = tmp_path / "config.yaml"
        path.write_text(config)
        argv = ["--config-file", str(path), *argv]
    argv = [*argv, "true"]
    args = flags.parser().parse_args(argv)
    if args.config_file:
        configlib.apply(args, configlib.load(args.config_file), flags.given_flags(argv))
    return {**environ, **flags.settings_env(LaunchOptions.from_args(args))}


def seen(spec, env):
    """What the worker makes of ``spec`` in ``env``: its ``Settings`` field, or the variable's text
    (``ROUNDEL_`` first) where it has no field."""
    if spec.field is None:
        return next(env[name] for name in (spec.var, spec.horovod_var) if env.get(name, "").strip())
    return getattr(Settings.from_env(env), spec.field)


def expect(spec, value):
    text = spec.flag.env_value(value)
    return text if spec.field is None else getattr(Settings.from_env({spec.var: text}), spec.field)


@pytest.mark.parametrize("spec", FLAGGED, ids=[spec.suffix for spec in FLAGGED])
def test_flag_beats_config_beats_environment(spec, monkeypatch, tmp_path):
    in_env, in_config, on_line = samples(spec.flag)
    environ = {spec.horovod_var: spec.flag.env_value(in_env)}
    assert seen(spec, worker_environ(monkeypatch, tmp_path, environ, [])) == expect(spec, in_env)
    config = config_text(spec.flag, in_config)
    assert seen(spec, worker_environ(monkeypatch, tmp_path, environ, [], config)) == expect(spec, in_config)
    both = worker_environ(monkeypatch, tmp_path, environ, argv_for(spec.flag, on_line), config)
    assert seen(spec, both) == expect(spec, on_line)


@pytest.mark.parametrize("spec", FLAGGED, ids=[spec.suffix for spec in FLAGGED])
def test_every_flag_name_and_config_key_sets_the_setting(spec, monkeypatch, tmp_path):
    flag = spec.flag
    for name in flag.names:
        args = flags.parser().parse_args([name, *([] if flag.switch else [str(samples(flag)[1])]), "true"])
        assert getattr(args, flag.dest) == (True if flag.switch else samples(flag)[1]), name
    for name in flag.off:
        assert getattr(flags.parser().parse_args([name, "true"]), flag.dest) is False, name
    value = samples(flag)[1]
    for key in {flag.dest, flag.dest.replace("_", "-")}:  # the flag's name is a top-level key
        env = worker_environ(monkeypatch, tmp_path, {}, [], yaml.safe_dump({key: value}))
        assert seen(spec, env) == expect(spec, value), key


def test_an_empty_value_in_the_config_file_beats_the_environment(monkeypatch, tmp_path):
    environ = {"HOROVOD_TIMELINE": "/tmp/env-timeline.json", "HOROVOD_AUTOTUNE_LOG": "env.csv"}
    config = "timeline: {filename: ''}\nautotune: {log_file: ''}\n"
    settings = Settings.from_env(worker_environ(monkeypatch, tmp_path, environ, [], config))
    assert settings.timeline_filename == "" and settings.autotune_log == ""
    on_line = worker_environ(monkeypatch, tmp_path, environ, ["--timeline-filename", ""], None)
    assert Settings.from_env(on_line).timeline_filename == ""


def test_the_config_files_log_level_does_not_cancel_verbose(monkeypatch, tmp_path):
    environ = {"HOROVOD_LOG_LEVEL": "error"}
    for config in ("logging: {level: warning}\n", "log-level: info\n", "log_level: WARNING\nverbose: false\n"):
        env = worker_environ(monkeypatch, tmp_path, environ, ["--verbose"], config)
        assert Settings.from_env(env).log_level == "debug", config
    # the file's verbose beats the environment; its level, being the more precise, beats its verbose
    assert Settings.from_env(worker_environ(monkeypatch, tmp_path, environ, [], "verbose: true\n")).log_level == "debug"
    env = worker_environ(monkeypatch, tmp_path, environ, [], "verbose: true\nlogging: {level: info}\n")
    assert Settings.from_env(env).log_level == "info"
    # --log-level is more precise than --verbose, wherever each is
    env = worker_environ(monkeypatch, tmp_path, environ, ["--verbose", "--log-level", "ERROR"], "verbose: true\n")
    assert Settings.from_env(env).log_level == "error"
    assert Settings.from_env(worker_environ(monkeypatch, tmp_path, environ, [])).log_level == "error"


def test_a_config_value_is_checked_like_the_flag(tmp_path):
    path = tmp_path / "config.yaml"
    for text, message in (("logging: {level: loud}\n", "logging.level: 'loud' is not one of TRACE"),
                          ("gpu-operations: ccl\n", "gpu-operations: 'ccl' is not one of nccl, gloo, mpi"),
                          ("autotune: {enabled: 1}\n", "autotune.enabled: expected true or false"),
                          ("autotune: yes please\n", "autotune: expected true or false")):
        path.write_text(text)
        with pytest.raises(configlib.ConfigError, match=message):
            configlib.load(str(path))
    path.write_text("logging: {level: info}\ngpu_operations: GLOO\nautotune: true\n")
    assert configlib.load(str(path)) == {"log_level": "INFO", "gpu_operations": "gloo", "autotune": True}
