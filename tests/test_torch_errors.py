"""Failures under the real launcher: clear errors on every rank, no hangs.

Each test launches ``tests/workers/torch_errors.py`` (or runs it with plain
``python``) with scenario names; the worker asserts the exception type and
message on every rank and prints ``CHECKS PASSED <scenario>``. Covered:
every kind of collective mismatch and duplicate in-flight names (the job goes
on working after each), ops before ``init()`` and init/shutdown/init, a rank
killed by SIGKILL (in negotiation and inside a data transfer), a rank that
finishes early, bad settings values, and the stall warning and stall shutdown.
"""

import re

import pytest

from launch_util import LAUNCHER, assert_checks_passed, describe, rank_lines, run_command, run_job, run_python

WORKER = "torch_errors.py"


@pytest.mark.parametrize("np", [2, 3])
def test_mismatches_fail_on_every_rank_and_the_job_goes_on(np):
    scenarios = ("mismatch", "mismatch_cached", "duplicate")
    result = run_job(np, WORKER, ",".join(scenarios))
    assert_checks_passed(result, np, *scenarios)


def _measured(result, rank):
    values = [float(line.split()[1]) for line in rank_lines(result.stdout, rank, "stdout")
              if line.startswith("MEASURED ")]
    assert len(values) == 1, f"rank {rank} printed no MEASURED line\n" + describe(result)
    return values[0]


def _assert_launcher_names_killed_rank_1(result):
    assert result.returncode == 128 + 9, describe(result)
    assert result.stderr.rstrip().splitlines()[-1] == (
        "roundelrun: rank 1 (host localhost) was killed by signal SIGKILL; stopped the other ranks"
    ), describe(result)


def test_rank_killed_while_others_wait_in_allreduce():
    # np 3: rank 1 dies 0.5 s after ranks 0 and 2 block in an allreduce it never submits
    result = run_job(3, WORKER, "killed", timeout=60)
    _assert_launcher_names_killed_rank_1(result)
    for rank in (0, 2):
        assert "CHECKS PASSED killed" in rank_lines(result.stdout, rank, "stdout"), describe(result)
        assert _measured(result, rank) < 10, describe(result)
        errors = [line for line in rank_lines(result.stdout, rank, "stdout") if "HorovodInternalError" in line]
        assert any("rank 1 died" in line for line in errors), describe(result)


@pytest.mark.parametrize("np", [2, 4])
def test_rank_killed_during_a_data_transfer(np):
    # rank 1 dies while 16 MiB allreduces are in flight; at 4 ranks some survivors' transfers wait on
    # live peers, and rank 0's abort must still reach them at once
    result = run_job(np, WORKER, "killed_in_transfer", timeout=60)
    _assert_launcher_names_killed_rank_1(result)
    for rank in [0, *range(2, np)]:
        assert "CHECKS PASSED killed_in_transfer" in rank_lines(result.stdout, rank, "stdout"), describe(result)
        assert _measured(result, rank) < 10, describe(result)


def test_rank_that_finishes_early():
    # np 3: rank 1 leaves (exit 0) after one collective; ranks 0 and 2 get HorovodInternalError for
    # collectives that need it (rank 0 was already waiting, rank 2 submits later), while a process
    # set without rank 1 keeps working. Nothing hangs and the job exits 0.
    result = run_job(3, WORKER, "early_exit", timeout=60)
    assert_checks_passed(result, 3, "early_exit")
    for rank in (0, 2):
        errors = [line for line in rank_lines(result.stdout, rank, "stdout") if "HorovodInternalError" in line]
        assert len(errors) == 2 and all("1" in line and "shut down" in line for line in errors), describe(result)


BAD_SETTINGS = {
    "HOROVOD_FUSION_THRESHOLD": "abc",
    "ROUNDEL_CYCLE_TIME": "-1",
    "HOROVOD_CACHE_CAPACITY": "x",
    "HOROVOD_STALL_CHECK_TIME_SECONDS": "0",
    "ROUNDEL_LOG_LEVEL": "loud",
}


def test_init_errors_and_reinit_in_a_plain_python_process():
    # bad settings come from the environment; the worker tries each one alone, then none; then
    # ops before init() and init -> shutdown -> init, in a job of one process
    scenarios = ("bad_settings", "before_init", "reinit")
    result = run_python(WORKER, ",".join(scenarios), *BAD_SETTINGS, env=BAD_SETTINGS, timeout=60)
    assert result.returncode == 0, describe(result)
    for scenario in scenarios:
        assert f"CHECKS PASSED {scenario}" in result.stdout.splitlines(), describe(result)
    for var, value in BAD_SETTINGS.items():
        assert f"bad setting {var}: {var}={value!r}" in result.stdout, describe(result)
    assert ("before-init message: roundel has not been initialized; call hvd.init() before allreduce."
            in result.stdout), describe(result)


def test_init_errors_and_reinit_on_every_rank():
    # the bad settings are set in the workers' own environment (as a job script would), out of
    # roundelrun's sight; then the same init/shutdown checks with 2 ranks
    scenarios = ("bad_settings", "before_init", "reinit")
    pairs = [f"{var}={value}" for var, value in BAD_SETTINGS.items()]
    result = run_job(2, WORKER, ",".join(scenarios), *pairs, timeout=60)
    assert_checks_passed(result, 2, *scenarios)
    for rank in range(2):
        for var in BAD_SETTINGS:
            assert any(line.startswith(f"bad setting {var}: {var}=")
                       for line in rank_lines(result.stdout, rank, "stdout")), describe(result)


@pytest.mark.parametrize("var,value,message", [
    ("HOROVOD_CACHE_CAPACITY", "x", "HOROVOD_CACHE_CAPACITY='x' is not a whole number"),
    ("ROUNDEL_STALL_CHECK_TIME_SECONDS", "0", "ROUNDEL_STALL_CHECK_TIME_SECONDS='0' must be > 0"),
])
def test_roundelrun_refuses_bad_settings_before_starting_ranks(var, value, message):
    result = run_command([*LAUNCHER, "-np", "2", "python", "-c", "print('RANK STARTED')"], env={var: value},
                         timeout=30)
    assert result.returncode != 0, describe(result)
    assert message in result.stderr, describe(result)
    assert "RANK STARTED" not in result.stdout, describe(result)


def test_stall_warning_names_tensor_and_missing_rank():
    result = run_job(3, WORKER, "stall", env={"HOROVOD_STALL_CHECK_TIME_SECONDS": "1"}, timeout=60)
    assert_checks_passed(result, 3, "stall")
    warnings = [line for line in rank_lines(result.stdout + result.stderr, 0, "stderr") if "stall" in line]
    assert any(re.search(r"'stall\.late'.*submitted by rank\(s\) 0, 2, not yet by rank\(s\) 1", line)
               for line in warnings), describe(result)
    # the warning comes from the coordinator only, and only for the late name
    assert not any("roundel stall" in line for r in (1, 2) for line in rank_lines(result.stderr, r)), describe(result)
    assert all("stall.late" in line for line in warnings if "roundel stall" in line), describe(result)


def test_stall_shutdown_turns_a_stall_into_an_error():
    env = {"HOROVOD_STALL_CHECK_TIME_SECONDS": "1", "HOROVOD_STALL_SHUTDOWN_TIME_SECONDS": "2"}
    result = run_job(3, WORKER, "stall_shutdown", env=env, timeout=60)
    assert_checks_passed(result, 3, "stall_shutdown")
    for rank in (0, 2):
        # the stall check runs every second, so on a busy machine it may first see 3 s
        assert any(re.search(r"'stall\.dead' stalled for [23] s waiting for rank\(s\) 1", line)
                   for line in rank_lines(result.stdout, rank, "stdout")), describe(result)
