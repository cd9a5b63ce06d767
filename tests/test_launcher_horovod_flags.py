"""roundelrun as a drop-in for horovodrun 0.28.1: every flag parses, and the ones roundel honours take effect.

FLAG_TABLE is Horovod 0.28.1's argument parser (horovod/runner/launch.py,
``parse_args``) written out: each option string with a sample value, the
argparse destination roundel stores it in and the value it must hold.
"""

import json
import re
import stat
import sys
import time

import pytest

from launch_util import LAUNCHER, describe, rank_lines, run_command
from roundel.common.settings import Settings
from roundel.runner import config as configlib
from roundel.runner import flags

DUMP = ("import json, os; print(json.dumps({k: v for k, v in os.environ.items() "
        "if k.startswith(('ROUNDEL_', 'HOROVOD_', 'NCCL_'))}))")

# (option strings, sample arguments, dest, expected value) for every option of horovodrun 0.28.1
FLAG_TABLE = [
    (("-np", "--num-proc"), ["3"], "np", 3),
    (("-cb", "--check-build"), [], "check_build", True),
    (("--disable-cache",), [], "disable_cache", True),
    (("--start-timeout",), ["45"], "start_timeout", 45.0),
    (("--network-interfaces", "--network-interface"), ["eth0, ib0"], "network_interfaces", "eth0,ib0"),
    (("--output-filename",), ["/tmp/out"], "output_filename", "/tmp/out"),
    (("--verbose",), [], "verbose", True),
    (("--config-file",), ["c.yaml"], "config_file", "c.yaml"),
    (("-p", "--ssh-port"), ["2222"], "ssh_port", 2222),
    (("-i", "--ssh-identity-file"), ["/k"], "ssh_identity_file", "/k"),
    (("--fusion-threshold-mb",), ["32"], "fusion_threshold_mb", 32.0),
    (("--cycle-time-ms",), ["2.5"], "cycle_time_ms", 2.5),
    (("--cache-capacity",), ["512"], "cache_capacity", 512),
    (("--hierarchical-allreduce",), [], "hierarchical_allreduce", True),
    (("--no-hierarchical-allreduce",), [], "hierarchical_allreduce", False),
    (("--hierarchical-allgather",), [], "hierarchical_allgather", True),
    (("--no-hierarchical-allgather",), [], "hierarchical_allgather", False),
    (("--torus-allreduce",), [], "torus_allreduce", True),
    (("--no-torus-allreduce",), [], "torus_allreduce", False),
    (("--autotune",), [], "autotune", True),
    (("--no-autotune",), [], "autotune", False),
    (("--autotune-log-file",), ["at.csv"], "autotune_log_file", "at.csv"),
    (("--autotune-warmup-samples",), ["4"], "autotune_warmup_samples", 4),
    (("--autotune-steps-per-sample",), ["11"], "autotune_steps_per_sample", 11),
    (("--autotune-bayes-opt-max-samples",), ["21"], "autotune_bayes_opt_max_samples", 21),
    (("--autotune-gaussian-process-noise",), ["0.5"], "autotune_gaussian_process_noise", 0.5),
    (("--min-np", "--min-num-proc"), ["2"], "min_np", 2),
    (("--max-np", "--max-num-proc"), ["5"], "max_np", 5),
    (("--slots-per-host",), ["4"], "slots", 4),
    (("--elastic-timeout",), ["90"], "elastic_timeout", 90.0),
    (("--reset-limit",), ["3"], "reset_limit", 3),
    (("--blacklist-cooldown-range",), ["10", "100"], "blacklist_cooldown_range", [10.0, 100.0]),
    (("--timeline-filename",), ["/tmp/tl.json"], "timeline_filename", "/tmp/tl.json"),
    (("--timeline-mark-cycles",), [], "timeline_mark_cycles", True),
    (("--no-timeline-mark-cycles",), [], "timeline_mark_cycles", False),
    (("--no-stall-check",), [], "no_stall_check", True),
    (("--stall-check",), [], "no_stall_check", False),
    (("--stall-check-warning-time-seconds",), ["30"], "stall_check_warning_time_seconds", 30.0),
    (("--stall-check-shutdown-time-seconds",), ["120"], "stall_check_shutdown_time_seconds", 120.0),
    (("--mpi-threads-disable",), [], "mpi_threads_disable", True),
    (("--no-mpi-threads-disable",), [], "mpi_threads_disable", False),
    (("--mpi-args",), ["--map-by ppr:6:node"], "mpi_args", "--map-by ppr:6:node"),
    (("--tcp",), [], "tcp_flag", True),
    (("--binding-args",), ["--rankfile f"], "binding_args", "--rankfile f"),
    (("--num-nccl-streams",), ["2"], "num_nccl_streams", 2),
    (("--thread-affinity",), ["1"], "thread_affinity", 1),
    (("--gloo-timeout-seconds",), ["40"], "gloo_timeout_seconds", 40.0),
    (("--gpu-operations",), ["GLOO"], "gpu_operations", "gloo"),
    (("--log-level",), ["DEBUG"], "log_level", "DEBUG"),
    (("--log-with-timestamp",), [], "log_with_timestamp", True),
    (("--log-without-timestamp",), [], "log_with_timestamp", False),
    (("-prefix-timestamp", "--prefix-output-with-timestamp"), [], "prefix_output_with_timestamp", True),
    (("--log-hide-timestamp",), [], "log_with_timestamp", False),
    (("--no-log-hide-timestamp",), [], "log_with_timestamp", True),
    (("-H", "--hosts"), ["a:2,b:2"], "hosts", "a:2,b:2"),
    (("-hostfile", "--hostfile"), ["hosts.txt"], "hostfile", "hosts.txt"),
    (("--host-discovery-script",), ["./discover.sh"], "host_discovery_script", "./discover.sh"),
    (("--gloo",), [], "gloo", True),
    (("--mpi",), [], "mpi", True),
    (("--jsrun",), [], "use_jsrun", True),
]


def roundelrun(*args, env=None, timeout=60):
    return run_command([*LAUNCHER, *map(str, args)], env=env, timeout=timeout)


def worker_env(result, rank=0):
    for line in rank_lines(result.stdout, rank, "stdout"):
        if line.startswith("{"):
            return json.loads(line)
    raise AssertionError(describe(result))


@pytest.mark.parametrize("options, values, dest, expected", FLAG_TABLE, ids=[row[0][-1] for row in FLAG_TABLE])
def test_every_horovodrun_flag_parses(options, values, dest, expected):
    for option in options:
        args = flags.parser().parse_args([option, *values, "python", "train.py"])
        assert getattr(args, dest) == expected, option
        assert args.command == ["python", "train.py"]


def test_version_flag():
    for option in ("-v", "--version"):
        result = roundelrun(option)
        assert result.returncode == 0 and re.fullmatch(r"\d+\.\d+\.\d+\s*", result.stdout), describe(result)
    assert roundelrun("-cb").stdout.startswith("roundel v")


def test_flags_become_worker_settings():
    result = roundelrun("-np", 1, "--gloo-timeout-seconds", 7, "--stall-check-warning-time-seconds", 3,
                        "--stall-check-shutdown-time-seconds", 9, "--no-stall-check", "--log-level", "INFO",
                        "--log-without-timestamp", "--elastic-timeout", 70, "--start-timeout", 8,
                        "--autotune", "--autotune-warmup-samples", 2, "--hierarchical-allreduce", "--tcp",
                        "--gpu-operations", "MPI",
                        sys.executable, "-c", DUMP + "; from roundel.common.settings import Settings; "
                        "print(repr(Settings.from_env()))")
    assert result.returncode == 0, describe(result)
    env = worker_env(result)
    settings = eval(rank_lines(result.stdout, 0, "stdout")[1], {"Settings": Settings})  # the worker's own view
    assert settings.collective_timeout_s == 7.0 and env["ROUNDEL_GLOO_TIMEOUT_SECONDS"] == "7.0"
    assert settings.stall_check_time_s == 3.0 and settings.stall_shutdown_time_s == 9.0
    assert settings.stall_check_enabled is False
    assert settings.log_level == "info" and settings.log_hide_time is True
    assert settings.elastic_timeout_s == 70.0 and settings.start_timeout_s == 8.0
    assert settings.autotune is True and settings.autotune_warmup_samples == 2
    assert settings.hierarchical_allreduce is True
    assert settings.gpu_operations == "mpi"
    assert env["NCCL_IB_DISABLE"] == "1"
    notes = [line for line in result.stderr.splitlines() if line.startswith("roundelrun: note:")]
    assert notes == ["roundelrun: note: no effect here (hardware or libraries roundel does not drive): --tcp"], \
        describe(result)


def test_ignored_flags_print_one_line_and_the_job_runs():
    result = roundelrun("-np", 2, "--thread-affinity", 1, "--binding-args", "x",
                        "--mpi-threads-disable", "--jsrun", "--tcp", sys.executable, "-c", "print('ran')")
    assert result.returncode == 0, describe(result)
    assert sorted(rank_lines(result.stdout)) == ["ran", "ran"]
    notes = [line for line in result.stderr.splitlines() if "no effect" in line]
    assert notes == ["roundelrun: note: no effect here (hardware or libraries roundel does not drive): "
                     "--mpi-threads-disable, --thread-affinity, --tcp, --binding-args, "
                     "--jsrun"], describe(result)


def test_environment_variables_have_horovods_meaning():
    env = {"HOROVOD_ELASTIC_TIMEOUT": "33", "HOROVOD_LOG_LEVEL": "DEBUG", "HOROVOD_GLOO_TIMEOUT_SECONDS": "12",
           "HOROVOD_STALL_CHECK_TIME_SECONDS": "5", "HOROVOD_STALL_SHUTDOWN_TIME_SECONDS": "6",
           "HOROVOD_STALL_CHECK_DISABLE": "1", "HOROVOD_CYCLE_TIME": "3.5", "HOROVOD_FUSION_THRESHOLD": "1048576",
           "HOROVOD_CACHE_CAPACITY": "0", "HOROVOD_START_TIMEOUT": "44", "HOROVOD_LOG_HIDE_TIME": "1",
           "HOROVOD_TIMELINE": "/tmp/t.json", "HOROVOD_TIMELINE_MARK_CYCLES": "1", "HOROVOD_AUTOTUNE": "1",
           "HOROVOD_AUTOTUNE_LOG": "a.csv", "HOROVOD_HIERARCHICAL_ALLGATHER": "1"}
    s = Settings.from_env(env)
    assert (s.elastic_timeout_s, s.log_level, s.collective_timeout_s) == (33.0, "debug", 12.0)
    assert (s.stall_check_time_s, s.stall_shutdown_time_s, s.stall_check_enabled) == (5.0, 6.0, False)
    assert (s.cycle_time_ms, s.fusion_threshold, s.cache_capacity, s.start_timeout_s) == (3.5, 1048576, 0, 44.0)
    assert s.log_hide_time and s.timeline_filename == "/tmp/t.json" and s.timeline_mark_cycles
    assert s.autotune and s.autotune_log == "a.csv" and s.hierarchical_allgather
    defaults = Settings.from_env({})
    assert (defaults.elastic_timeout_s, defaults.log_level, defaults.log_hide_time) == (600.0, "warning", False)
    assert (defaults.stall_check_time_s, defaults.stall_shutdown_time_s, defaults.start_timeout_s) == (60.0, 0.0, 30.0)
    assert defaults.autotune_gaussian_process_noise == 0.8 and defaults.autotune_warmup_samples == 3


def test_log_level_debug_shows_worker_debug_and_timestamps():
    code = ("import torch, roundel.torch as hvd; hvd.init(); hvd.allreduce(torch.ones(1)); "
            "print('rank', hvd.rank())")
    result = roundelrun("-np", 2, "--log-level", "DEBUG", sys.executable, "-c", code, timeout=90)
    assert result.returncode == 0, describe(result)
    debug = [line for line in rank_lines(result.stderr, 1, "stderr") if "roundel: settings" in line]
    assert debug and re.match(r"\[\d{4}-\d\d-\d\d \d\d:\d\d:\d\d\.\d{3}\] roundel: settings", debug[0]), describe(result)
    quiet = roundelrun("-np", 2, "--log-without-timestamp", "--log-level", "debug", sys.executable, "-c", code,
                       timeout=90)
    assert quiet.returncode == 0, describe(quiet)
    assert any(line.startswith("roundel: settings") for line in rank_lines(quiet.stderr, 0, "stderr")), describe(quiet)


def test_prefix_output_with_timestamp():
    result = roundelrun("-np", 2, "-prefix-timestamp", sys.executable, "-c", "print('hello')")
    assert result.returncode == 0, describe(result)
    stamp = r"[A-Z][a-z]{2} [A-Z][a-z]{2} [ \d]\d \d\d:\d\d:\d\d \d{4}"  # time.asctime(), as Horovod prints it
    assert sorted(re.sub(stamp, "T", line) for line in result.stdout.splitlines()) == \
        ["T[0]<stdout>:hello", "T[1]<stdout>:hello"], describe(result)


def test_stall_check_shutdown_time_turns_a_stall_into_an_error(tmp_path):
    # rank 1 stays up (never submitting 'never') until rank 0 has its error, at most 30 s
    done = tmp_path / "done"
    code = ("import os, sys, time, torch, roundel.torch as hvd; hvd.init()\n"
            "if hvd.rank() == 0:\n"
            "    try:\n"
            "        hvd.allreduce(torch.ones(1), name='never')\n"
            "    except Exception as exc:\n"
            "        print('STALL ERROR', type(exc).__name__, exc, flush=True)\n"
            "    open(sys.argv[1], 'w').close()\n"
            "else:\n"
            "    deadline = time.monotonic() + 30\n"
            "    while not os.path.exists(sys.argv[1]) and time.monotonic() < deadline:\n"
            "        time.sleep(0.1)\n")
    start = time.monotonic()
    result = roundelrun("-np", 2, "--stall-check-warning-time-seconds", 1, "--stall-check-shutdown-time-seconds", 2,
                        sys.executable, "-c", code, done, timeout=90)
    assert time.monotonic() - start < 60
    errors = [line for line in rank_lines(result.stdout, 0, "stdout") if line.startswith("STALL ERROR")]
    assert errors and "never" in errors[0], describe(result)


def test_config_file_takes_every_horovod_section(tmp_path):
    config = tmp_path / "horovod.yaml"
    config.write_text(
        "controller: gloo\n"
        "params: {fusion_threshold_mb: 2, cycle_time_ms: 4, cache_capacity: 8, hierarchical_allreduce: true,\n"
        "         hierarchical_allgather: false, torus_allreduce: false}\n"
        "autotune: {enabled: true, log_file: at.csv, warmup_samples: 1, steps_per_sample: 2,\n"
        "           bayes_opt_max_samples: 3, gaussian_process_noise: 0.5}\n"
        "timeline: {filename: /tmp/tl.json, mark_cycles: true}\n"
        "stall_check: {enabled: false, warning_time_seconds: 7, shutdown_time_seconds: 9}\n"
        "library_options: {mpi_threads_disable: true, num_nccl_streams: 1, thread_affinity: 1,\n"
        "                  gloo_timeout_seconds: 13}\n"
        "logging: {level: INFO, with_timestamp: false}\n")
    result = roundelrun("-np", 1, "--config-file", config, "--cycle-time-ms", 6, sys.executable, "-c", DUMP)
    assert result.returncode == 0, describe(result)
    env = worker_env(result)
    expected = {"ROUNDEL_FUSION_THRESHOLD": str(2 * 1024 * 1024), "ROUNDEL_CYCLE_TIME": "6.0",
                "ROUNDEL_CACHE_CAPACITY": "8", "ROUNDEL_HIERARCHICAL_ALLREDUCE": "1",
                "ROUNDEL_HIERARCHICAL_ALLGATHER": "0", "ROUNDEL_AUTOTUNE": "1", "ROUNDEL_AUTOTUNE_LOG": "at.csv",
                "ROUNDEL_AUTOTUNE_WARMUP_SAMPLES": "1", "ROUNDEL_AUTOTUNE_STEPS_PER_SAMPLE": "2",
                "ROUNDEL_AUTOTUNE_BAYES_OPT_MAX_SAMPLES": "3", "ROUNDEL_AUTOTUNE_GAUSSIAN_PROCESS_NOISE": "0.5",
                "ROUNDEL_TIMELINE": "/tmp/tl.json", "ROUNDEL_TIMELINE_MARK_CYCLES": "1",
                "ROUNDEL_STALL_CHECK_DISABLE": "1", "ROUNDEL_STALL_CHECK_TIME_SECONDS": "7.0",
                "ROUNDEL_STALL_SHUTDOWN_TIME_SECONDS": "9.0", "ROUNDEL_MPI_THREADS_DISABLE": "1",
                "ROUNDEL_NUM_NCCL_STREAMS": "1", "ROUNDEL_THREAD_AFFINITY": "1",
                "ROUNDEL_GLOO_TIMEOUT_SECONDS": "13.0", "ROUNDEL_LOG_LEVEL": "info", "ROUNDEL_LOG_HIDE_TIME": "1"}
    assert {k: env.get(k) for k in expected} == expected
    config.write_text("controller: tcp\n")
    assert "is not a controller" in roundelrun("-np", 1, "--config-file", config, "true").stderr
    with pytest.raises(configlib.ConfigError, match="autotune.enable: unknown setting"):
        config.write_text("autotune: {enable: true}\n")
        configlib.load(str(config))


def test_network_interface_list_uses_the_interfaces_each_host_has():
    result = roundelrun("-np", 1, "--network-interfaces", "nosuchif0,lo", sys.executable, "-c", DUMP)
    assert result.returncode == 0, describe(result)
    assert worker_env(result)["ROUNDEL_NETWORK_INTERFACE"] == "nosuchif0,lo"
    result = roundelrun("-np", 1, "--network-interface", "nosuchif0", "--network-interface", "lo",
                        sys.executable, "-c", DUMP)
    assert result.returncode == 0 and worker_env(result)["ROUNDEL_NETWORK_INTERFACE"] == "nosuchif0,lo"
    bad = roundelrun("-np", 1, "--network-interfaces", "nosuchif0,nosuchif1", "true")
    assert bad.returncode == 2
    assert "none of the network interfaces 'nosuchif0', 'nosuchif1' exists" in bad.stderr, describe(bad)


def test_network_interface_list_reaches_a_collective():
    code = ("import torch, roundel.torch as hvd; hvd.init(); "
            "print('SUM', hvd.allreduce(torch.ones(1), op=hvd.Sum).item()); hvd.shutdown()")
    result = roundelrun("-np", 2, "--network-interfaces", "nosuchif0,lo", sys.executable, "-c", code, timeout=90)
    assert result.returncode == 0, describe(result)
    assert sorted(rank_lines(result.stdout)) == ["SUM 2.0", "SUM 2.0"]


def test_horovod_style_launch_script_runs_unchanged(tmp_path):
    """A job script written for horovodrun, with roundelrun put in its place."""
    hostfile = tmp_path / "hostfile"
    hostfile.write_text("localhost slots=2\n")
    script = tmp_path / "train.sh"
    script.write_text(
        "#!/bin/sh\nset -e\n"
        "horovodrun() { \"$PYTHON\" -m roundel.runner.launch \"$@\"; }\n"
        f"horovodrun -np 2 -hostfile {hostfile} --gloo --network-interface lo --start-timeout 30 \\\n"
        "    --fusion-threshold-mb 32 --cycle-time-ms 1 --cache-capacity 1024 --no-hierarchical-allreduce \\\n"
        "    --timeline-filename '' --no-stall-check --gloo-timeout-seconds 30 --log-level WARNING \\\n"
        "    --log-without-timestamp --mpi-threads-disable --num-nccl-streams 1 -prefix-timestamp \\\n"
        "    --disable-cache --output-filename \"$LOGS\" \\\n"
        "    \"$PYTHON\" -c 'import torch, roundel.torch as hvd; hvd.init(); "
        "print(\"SUM\", hvd.allreduce(torch.ones(1), op=hvd.Sum).item())'\n")
    script.chmod(script.stat().st_mode | stat.S_IXUSR)
    result = run_command([str(script)], env={"PYTHON": sys.executable, "LOGS": str(tmp_path / "logs")}, timeout=90)
    assert result.returncode == 0, describe(result)
    assert [line.split(">:")[1] for line in result.stdout.splitlines()] == ["SUM 2.0", "SUM 2.0"]
    assert (tmp_path / "logs" / "rank.1" / "stdout").read_text() == "SUM 2.0\n"


def test_min_num_proc_starts_an_elastic_job(tmp_path):
    discover = tmp_path / "discover.sh"
    discover.write_text("#!/bin/sh\necho localhost:2\n")
    discover.chmod(0o755)
    code = ("import torch, roundel.torch as hvd; hvd.init(); "
            "print('SIZE', hvd.size(), hvd.allreduce(torch.ones(1), op=hvd.Sum).item())")
    result = roundelrun("--min-num-proc", 2, "--max-num-proc", 2, "--host-discovery-script", discover,
                        "--elastic-timeout", 30, "--start-timeout", 20, sys.executable, "-c", code, timeout=90)
    assert result.returncode == 0, describe(result)
    assert sorted(line for line in rank_lines_any(result.stdout) if line.startswith("SIZE")) == \
        ["SIZE 2 2.0", "SIZE 2 2.0"], describe(result)
    start = time.monotonic()
    too_few = roundelrun("--min-num-proc", 3, "--host-discovery-script", discover, "--elastic-timeout", 3,
                         sys.executable, "-c", code, timeout=60)
    assert too_few.returncode != 0 and time.monotonic() - start < 45, describe(too_few)
    assert "fewer than --min-np 3" in too_few.stderr, describe(too_few)


def rank_lines_any(text):
    """Payloads of lines prefixed by any worker label (elastic workers are labelled host:slot)."""
    return [m.group(1) for m in re.finditer(r"^\[[^\]]+\]<stdout>:(.*)$", text, re.M)]


def test_usage_errors_name_the_flag():
    bad = roundelrun("-np", 1, "--log-level", "LOUD", "true")
    assert bad.returncode == 2 and "--log-level" in bad.stderr
    bad = roundelrun("-np", 1, "--autotune-gaussian-process-noise", 2, "true")
    assert bad.returncode == 2 and "--autotune-gaussian-process-noise 2.0" in bad.stderr, bad.stderr
    bad = roundelrun("-np", 1, "--gloo", "--mpi", "true")
    assert bad.returncode == 2 and "not allowed with argument" in bad.stderr
    bad = roundelrun("-np", 1, "--stall-check-warning-time-seconds", -1, "true")
    assert bad.returncode == 2 and "--stall-check-warning-time-seconds -1 must be >= 0" in bad.stderr
