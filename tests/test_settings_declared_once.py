"""Each setting declared once, in the table, and read from it everywhere: a worker's elastic join, the
network interface, the launcher's flags and --help, its typed options, its choice of MPI's data path."""

from __future__ import annotations

import re
import sys
import time

import pytest
import yaml

from launch_util import LAUNCHER, describe, rank_lines, run_command
from roundel.common.settings import SPECS, setting
from roundel.rendezvous.elastic_join import join_key
from roundel.rendezvous.store import RendezvousServer, new_secret
from roundel.runner import config as configlib
from roundel.runner import flags, launch
from roundel.runner.options import LaunchOptions

INIT = "import roundel.torch as hvd; hvd.init()"


def roundelrun(*args, env=None, timeout=90):
    return run_command([*LAUNCHER, *map(str, args)], env=env, timeout=timeout)


@pytest.fixture
def store():
    secret = new_secret()
    server = RendezvousServer(secret, host="127.0.0.1")
    server.start()
    yield server, secret
    server.stop()


def _elastic_worker(server: RendezvousServer, secret: bytes, **settings: str):
    """An elastic worker's ``hvd.init()`` against ``server``, where no driver ever answers its join."""
    env = {"ROUNDEL_ELASTIC_WORKER_ID": "localhost:0", "ROUNDEL_RENDEZVOUS_ADDR": "127.0.0.1",
           "ROUNDEL_RENDEZVOUS_PORT": server.port, "ROUNDEL_SECRET": secret.hex(), **settings}
    started = time.monotonic()
    result = run_command([sys.executable, "-c", INIT], env=env, timeout=120)
    return result, time.monotonic() - started


def test_an_elastic_worker_waits_the_tables_elastic_timeout_under_horovods_name_too(store):
    server, secret = store
    result, _ = _elastic_worker(server, secret, HOROVOD_ELASTIC_TIMEOUT="1")
    assert result.returncode != 0, describe(result)
    # the join reached the store, and the wait was the table's 1 s (the worker's own parser read only
    # ROUNDEL_ELASTIC_TIMEOUT and waited 600 s)
    assert server.get(join_key("localhost:0")) is not None
    assert "elastic worker localhost:0 was not given a place in the job within 1 s" in result.stderr, \
        describe(result)


@pytest.mark.parametrize("var, raw", [("ROUNDEL_ELASTIC_TIMEOUT", "0"), ("HOROVOD_ELASTIC_TIMEOUT", "-5")])
def test_an_elastic_worker_refuses_an_elastic_timeout_of_zero_or_less_before_joining(store, var, raw):
    server, secret = store
    result, _ = _elastic_worker(server, secret, **{var: raw})
    assert result.returncode != 0
    assert f"SettingsError: {var}={raw!r} must be > 0; for example 600" in result.stderr, describe(result)
    assert server.get(join_key("localhost:0")) is None  # refused before it asked for a place


def test_roundelrun_refuses_an_elastic_timeout_of_zero_with_the_tables_message():
    result = roundelrun("-np", 1, "--elastic-timeout", 0, "true")
    assert result.returncode == 2
    assert "--elastic-timeout 0.0: ROUNDEL_ELASTIC_TIMEOUT='0.0' must be > 0" in result.stderr, describe(result)


def test_horovods_interface_variable_is_the_tables_network_interface():
    ok = roundelrun("-np", 1, sys.executable, "-c", f"{INIT}; print('ran'); hvd.shutdown()",
                    env={"HOROVOD_GLOO_IFACE": "nosuchif0, lo"})
    assert ok.returncode == 0 and rank_lines(ok.stdout) == ["ran"], describe(ok)
    missing = roundelrun("-np", 1, sys.executable, "-c", INIT, env={"HOROVOD_GLOO_IFACE": "nosuchif0"})
    assert missing.returncode != 0
    assert "network interface 'nosuchif0' does not exist" in missing.stderr, describe(missing)
    assert "ROUNDEL_NETWORK_INTERFACE (roundelrun --network-interfaces)" in missing.stderr, describe(missing)
    empty = roundelrun("-np", 1, "true", env={"HOROVOD_GLOO_IFACE": ","})
    assert empty.returncode == 2
    assert "HOROVOD_GLOO_IFACE=',' names no network interface" in empty.stderr, describe(empty)


def test_help_takes_each_default_from_the_table_and_no_help_string_restates_one():
    text = " ".join(flags.parser().format_help().split())
    shown = 0
    for spec in SPECS:
        if spec.flag is None:
            continue
        assert not re.search(r"\(default\b|the default|default \d", spec.flag.help), \
            f"{spec.flag.names[0]}: --help adds the table's default"
        if spec.field is not None and not spec.flag.switch and spec.default_text() != "unset":
            assert f"{spec.flag.help} (default {spec.default_text()})" in text, spec.flag.names[0]
            shown += 1
    assert shown >= 20
    assert "--start-timeout START_TIMEOUT seconds workers wait for each other at start (default 30)" in text
    # a switch says which side is the default
    assert "--shared-memory collectives among the ranks of one host go through shared memory (the default)" in text
    assert "--hierarchical-allreduce hierarchical allreduce (equal slots per host) --" in text


def test_the_command_line_becomes_typed_options_once():
    argv = ["-np", "2", "--verbose", "--network-interface", "a", "--network-interfaces", "b, c", "-x", "A=1",
            "--blacklist-cooldown-range", "1", "2", "--ranks-filter", "0,1", "--tcp", "python", "t.py"]
    options = LaunchOptions.from_args(flags.parser().parse_args(argv))
    assert options.command == ("python", "t.py") and options.np == 2 and not options.elastic
    assert options.nics == "a,b,c" and options.exports == ("A=1",) and options.tcp
    assert options.blacklist_cooldown_range == (1.0, 2.0) and options.ranks_filter == frozenset({0, 1})
    assert options.setting_flags == {"network_interfaces": "a,b,c", "log_level": "DEBUG"}  # --verbose implies it
    env = flags.settings_env(options)
    assert env["ROUNDEL_NETWORK_INTERFACE"] == "a,b,c" and env["ROUNDEL_LOG_LEVEL"] == "debug"
    assert env["A"] == "1" and env["NCCL_IB_DISABLE"] == "1"
    assert LaunchOptions.from_args(flags.parser().parse_args(["--min-np", "1", "true"])).elastic


def test_the_config_file_takes_each_name_of_the_interface_flag(tmp_path):
    path = tmp_path / "config.yaml"
    for key in ("network-interfaces", "network_interface"):
        path.write_text(yaml.safe_dump({key: "eth0, ib0"}))
        args = flags.parser().parse_args(["--config-file", str(path), "true"])
        configlib.apply(args, configlib.load(str(path)), flags.given_flags(["--config-file", str(path), "true"]))
        assert LaunchOptions.from_args(args).nics == "eth0,ib0", key


def test_mpi_moves_the_data_unless_the_cpu_operations_setting_is_given(monkeypatch):
    spec = setting("cpu_operations")
    for name in (spec.var, spec.horovod_var):
        monkeypatch.delenv(name, raising=False)
    has_mpi4py = launch._mpi_data_path_wanted({})
    monkeypatch.setenv(spec.horovod_var, "gloo")
    assert not launch._mpi_data_path_wanted({})
    monkeypatch.setenv(spec.horovod_var, "  ")  # blank counts as unset, as everywhere in the table
    assert launch._mpi_data_path_wanted({}) == has_mpi4py
    assert not launch._mpi_data_path_wanted({spec.var: "mpi"})
