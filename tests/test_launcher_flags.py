"""roundelrun's Horovod flags beyond the basics: config file, output files, check-build, ssh options."""

import json
import os
import subprocess
import sys

from roundel.runner import spawn
from roundel.runner.hosts import SlotInfo

LAUNCHER = [sys.executable, "-m", "roundel.runner.launch"]
DUMP = "import json, os; print(json.dumps({k: v for k, v in os.environ.items() if k.startswith('ROUNDEL_')}))"


def roundelrun(*args, timeout=60):
    return subprocess.run([*LAUNCHER, *map(str, args)], capture_output=True, text=True, timeout=timeout)


def worker_env(result, rank=0):
    for line in result.stdout.splitlines():
        if line.startswith(f"[{rank}]<stdout>:"):
            return json.loads(line.split(":", 1)[1])
    raise AssertionError(result.stdout + result.stderr)


def test_check_build():
    result = roundelrun("--check-build")
    assert result.returncode == 0, result.stderr
    assert "Available Frameworks:" in result.stdout and "[X] PyTorch" in result.stdout
    assert "[X] Gloo" in result.stdout


def test_config_file_settings_and_command_line_precedence(tmp_path):
    config = tmp_path / "roundel.yaml"
    config.write_text("params:\n  fusion_threshold_mb: 2\n  cache_capacity: 9\ntimeline:\n  filename: /tmp/t.json\n"
                      "stall_check:\n  enabled: false\n  warning_time_seconds: 5\nstart-timeout: 11\n")
    result = roundelrun("-np", 1, "--config-file", config, "--cache-capacity", 3, sys.executable, "-c", DUMP)
    assert result.returncode == 0, result.stderr
    env = worker_env(result)
    assert env["ROUNDEL_FUSION_THRESHOLD"] == str(2 * 1024 * 1024)
    assert env["ROUNDEL_CACHE_CAPACITY"] == "3"  # the command line wins
    assert env["ROUNDEL_TIMELINE"] == "/tmp/t.json"
    assert env["ROUNDEL_STALL_CHECK_DISABLE"] == "1" and env["ROUNDEL_STALL_CHECK_TIME_SECONDS"] == "5.0"
    assert float(env["ROUNDEL_START_TIMEOUT"]) == 11.0


def test_command_line_beats_the_config_file(tmp_path):
    # the file's log level does not cancel --verbose; a flag given at its default value still wins
    config = tmp_path / "roundel.yaml"
    config.write_text("logging:\n  level: WARNING\nstall_check:\n  enabled: false\n")
    result = roundelrun("-np", 1, "--config-file", config, "--verbose", "--stall-check", sys.executable, "-c", DUMP)
    assert result.returncode == 0, result.stderr
    env = worker_env(result)
    assert env["ROUNDEL_LOG_LEVEL"] == "debug" and env["ROUNDEL_STALL_CHECK_DISABLE"] == "0", env
    assert "roundelrun: rank 0 on localhost" in result.stderr  # --verbose's launch plan
    result = roundelrun("-np", 1, "--config-file", config, sys.executable, "-c", DUMP)
    assert worker_env(result)["ROUNDEL_LOG_LEVEL"].lower() == "warning"


def test_flags_beat_the_config_file_which_beats_the_environment(tmp_path):
    config = tmp_path / "roundel.yaml"
    config.write_text("logging: {level: warning}\ntimeline: {filename: ''}\n"
                      "params: {cycle_time_ms: 4, cache_capacity: 9}\n")
    code = "from roundel.common.settings import Settings; s = Settings.from_env(); " \
           "print(s.log_level, repr(s.timeline_filename), s.cycle_time_ms, s.cache_capacity)"
    env = {**os.environ, "HOROVOD_LOG_LEVEL": "error", "HOROVOD_TIMELINE": str(tmp_path / "env.json"),
           "ROUNDEL_CYCLE_TIME": "9", "HOROVOD_CACHE_CAPACITY": "5"}
    result = subprocess.run([*LAUNCHER, "-np", "1", "--config-file", str(config), "--verbose", "--cache-capacity", "3",
                             sys.executable, "-c", code], capture_output=True, text=True, timeout=60, env=env)
    assert result.returncode == 0, result.stderr
    assert result.stdout == "[0]<stdout>:debug '' 4.0 3\n", result.stderr


def test_a_mistyped_flag_gets_the_closest_one_in_one_line():
    result = roundelrun("-np", 2, "--fusion-treshold-mb", 3, "true")
    assert result.returncode == 2
    assert result.stderr == ("roundelrun: error: unrecognized arguments: --fusion-treshold-mb; did you mean "
                             "--fusion-threshold-mb? (roundelrun --help lists the flags)\n")
    result = roundelrun("-np", 2, "-H", "localhost:1", "true")
    assert result.returncode == 2
    assert "requested -np 2 but the hosts offer only 1 slot (localhost:1)" in result.stderr


def test_tensorflow_logs_warnings_and_up_unless_the_user_says_otherwise():
    code = "import os; print(os.environ['TF_CPP_MIN_LOG_LEVEL'])"
    env = {k: v for k, v in os.environ.items() if k != "TF_CPP_MIN_LOG_LEVEL"}
    for given, seen in ((None, "1"), ("0", "0")):
        result = subprocess.run([*LAUNCHER, "-np", "1", sys.executable, "-c", code], capture_output=True, text=True,
                                timeout=60, env=env if given is None else {**env, "TF_CPP_MIN_LOG_LEVEL": given})
        assert result.stdout == f"[0]<stdout>:{seen}\n", result.stderr


def test_config_file_errors(tmp_path):
    config = tmp_path / "bad.yaml"
    config.write_text("params:\n  fusion_treshold_mb: 2\n")
    result = roundelrun("-np", 1, "--config-file", config, "true")
    assert result.returncode == 2
    assert f"--config-file {config}: params.fusion_treshold_mb: unknown setting" in result.stderr
    config.write_text("cycle-time-ms: fast\n")
    result = roundelrun("-np", 1, "--config-file", config, "true")
    assert result.returncode == 2 and "cycle-time-ms: expected a number, not 'fast'" in result.stderr
    assert "cannot read" in roundelrun("-np", 1, "--config-file", tmp_path / "none.yaml", "true").stderr


def test_output_filename_writes_one_log_per_rank_and_still_echoes(tmp_path):
    code = "import os, sys; r = os.environ['ROUNDEL_RANK']; print('out', r); print('err', r, file=sys.stderr)"
    result = roundelrun("-np", 3, "--output-filename", tmp_path / "logs", sys.executable, "-c", code)
    assert result.returncode == 0, result.stderr
    assert sorted(result.stdout.splitlines()) == [f"[{r}]<stdout>:out {r}" for r in range(3)]
    for r in range(3):
        assert (tmp_path / "logs" / f"rank.{r}" / "stdout").read_text() == f"out {r}\n"
        assert (tmp_path / "logs" / f"rank.{r}" / "stderr").read_text() == f"err {r}\n"
    assert spawn.rank_output_dir("d", 3, 12).name == "rank.03"


def test_timeline_and_network_interface_are_forwarded():
    result = roundelrun("-np", 1, "--timeline-filename", "/tmp/tl.json", "--network-interface", "lo",
                        "--verbose", sys.executable, "-c", DUMP)
    assert result.returncode == 0, result.stderr
    env = worker_env(result)
    assert env["ROUNDEL_TIMELINE"] == "/tmp/tl.json" and env["ROUNDEL_NETWORK_INTERFACE"] == "lo"
    assert "roundelrun: rendezvous server at 127.0.0.1:" in result.stderr
    bad = roundelrun("-np", 1, "--network-interface", "nosuchif0", "true")
    assert bad.returncode == 2 and "network interface 'nosuchif0' does not exist" in bad.stderr


def test_usage_errors_for_new_flags(tmp_path):
    assert "-np is required" in roundelrun("true").stderr
    missing_key = roundelrun("-np", 1, "-i", tmp_path / "nokey", "true")
    assert missing_key.returncode == 2 and "--ssh-identity-file" in missing_key.stderr


def test_ssh_command_line():
    cmd = spawn.ssh_command("h1", "cd /x && exec py", port=2222, identity_file="/k", connect_timeout=7,
                            extra_args="-o LogLevel=ERROR")
    assert cmd == ["ssh", "-o", "BatchMode=yes", "-o", "ConnectTimeout=7", "-p", "2222", "-i", "/k",
                   "-o", "LogLevel=ERROR", "--", "h1", "cd /x && exec py"]
    env = spawn.remote_env({"HOME": "/root", "PATH": "/bin", "ROUNDEL_RANK": "1", "SSH_AUTH_SOCK": "s"})
    assert env == {"PATH": "/bin", "ROUNDEL_RANK": "1"}
    mine = {"MY_VAR": "v", "HOSTNAME": "a", "PWD": "/x", "ROUNDEL_RANK": "1", "OTHER": "o", "ROUNDEL_FORWARD_ENV": "OTHER"}
    assert spawn.remote_env(mine) == {"MY_VAR": "v", "ROUNDEL_RANK": "1", "OTHER": "o", "ROUNDEL_FORWARD_ENV": "OTHER"}
    assert spawn.remote_env({**mine, "ROUNDEL_REMOTE_ENV": "listed"}) == {
        "ROUNDEL_RANK": "1", "OTHER": "o", "ROUNDEL_FORWARD_ENV": "OTHER", "ROUNDEL_REMOTE_ENV": "listed"}
    slot = SlotInfo("h1", 0, 1, 0, 1, 0, 1)
    assert spawn.worker_env(slot, "10.0.0.1", 5, "ab", {})["ROUNDEL_RENDEZVOUS_ADDR"] == "10.0.0.1"
