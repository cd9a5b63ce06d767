"""Running worker scripts under the real ``roundelrun`` launcher from pytest.

``run_job(np, script, *args)`` starts ``roundelrun -np NP python SCRIPT ARGS``
with a clean settings environment (no ``ROUNDEL_*``/``HOROVOD_*`` variables
leak in from the caller), waits with a timeout, and on timeout stops the
launcher with SIGTERM (so it stops its workers) before failing the test with
whatever output there was: a hang fails, it never blocks the suite.
"""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
from pathlib import Path

import psutil
import pytest

TESTS_DIR = Path(__file__).resolve().parent
WORKERS_DIR = TESTS_DIR / "workers"
LAUNCHER = [sys.executable, "-m", "roundel.runner.launch"]

_LINE = re.compile(r"^\[(\d+)\]<(stdout|stderr)>:(.*)$")


def clean_env(env: dict | None = None) -> dict:
    """os.environ without roundel/Horovod settings, updated with ``env`` (a value of None deletes)."""
    result = {k: v for k, v in os.environ.items() if not k.startswith(("ROUNDEL_", "HOROVOD_"))}
    for key, value in (env or {}).items():
        if value is None:
            result.pop(key, None)
        else:
            result[key] = str(value)
    return result


def alive(pid: int) -> bool:
    """Whether process ``pid`` still runs (a zombie about to be reaped, or one gone while asked, does not)."""
    try:
        return psutil.Process(pid).status() != psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return False


def _script_path(script) -> str:
    path = Path(script)
    if not path.is_absolute():
        path = WORKERS_DIR / path
    return str(path)


def run_command(command: list, env: dict | None = None, timeout: float = 120) -> subprocess.CompletedProcess:
    """Run ``command``; on timeout stop it with SIGTERM (then SIGKILL) and fail the test with its output."""
    proc = subprocess.Popen(command, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            env=clean_env(env))
    try:
        out, err = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        proc.send_signal(signal.SIGTERM)  # roundelrun stops every rank on SIGTERM
        try:
            out, err = proc.communicate(timeout=20)
        except subprocess.TimeoutExpired:
            proc.kill()
            out, err = proc.communicate()
        pytest.fail(f"{' '.join(map(str, command))} did not finish within {timeout} s (hang?)\n"
                    f"--- stdout ---\n{out}\n--- stderr ---\n{err}")
    return subprocess.CompletedProcess(command, proc.returncode, out, err)


def run_job(np: int, script, *args, env: dict | None = None, launcher_args=(), timeout: float = 120
            ) -> subprocess.CompletedProcess:
    """``roundelrun [launcher_args] -np NP python SCRIPT ARGS``; returns the CompletedProcess (text)."""
    command = [*LAUNCHER, *map(str, launcher_args), "-np", str(np), sys.executable, _script_path(script),
               *map(str, args)]
    return run_command(command, env=env, timeout=timeout)


def run_python(script, *args, env: dict | None = None, timeout: float = 120) -> subprocess.CompletedProcess:
    """``python SCRIPT ARGS`` without the launcher (roundel then makes a job of one)."""
    return run_command([sys.executable, _script_path(script), *map(str, args)], env=env, timeout=timeout)


def rank_lines(text: str, rank: int | None = None, stream: str | None = None) -> list[str]:
    """The payload of each launcher-prefixed line of ``text`` from ``rank`` (any if None)."""
    lines = []
    for line in text.splitlines():
        match = _LINE.match(line)
        if match and (rank is None or int(match.group(1)) == rank) and \
                (stream is None or match.group(2) == stream):
            lines.append(match.group(3))
    return lines


def describe(result: subprocess.CompletedProcess) -> str:
    tail = 12000
    return (f"exit status {result.returncode}\n--- stdout ---\n{result.stdout[-tail:]}\n"
            f"--- stderr ---\n{result.stderr[-tail:]}")


def assert_checks_passed(result: subprocess.CompletedProcess, np: int, *scenarios: str) -> None:
    """The job exited 0 and every rank printed ``CHECKS PASSED <scenario>`` exactly once per scenario."""
    assert result.returncode == 0, describe(result)
    for scenario in scenarios:
        for rank in range(np):
            found = rank_lines(result.stdout, rank, "stdout").count(f"CHECKS PASSED {scenario}")
            assert found == 1, f"rank {rank} printed 'CHECKS PASSED {scenario}' {found} times\n" + describe(result)
