"""The replayed steady state (``roundel.common.engine.replay``), under the real launcher.

Each job trains a fixed schedule of named allreduces until every rank
replays it without rank 0's coordinator, checks every result, and then
leaves the schedule in one way (a changed shape, another order, fewer names,
polling, join(), a rank far behind, a rank that dies): every rank must get the result
or the error it gets without replay, in bounded time.
"""

from __future__ import annotations

import pytest

from launch_util import assert_checks_passed, describe, rank_lines, run_job

WORKER = "steady_replay.py"


def _measured(result, rank: int) -> float:
    values = [float(line.split()[1]) for line in rank_lines(result.stdout, rank, "stdout")
              if line.startswith("MEASURED ")]
    assert values, f"rank {rank} printed no MEASURED line\n" + describe(result)
    return max(values)


@pytest.mark.parametrize("np,shared_memory", [(2, "0"), (3, "1")])
def test_steady_schedule_is_replayed(np, shared_memory):
    scenarios = ("steady", "other_kinds", "mixed_threads", "caller_runs")
    result = run_job(np, WORKER, ",".join(scenarios), env={"ROUNDEL_SHARED_MEMORY": shared_memory})
    assert_checks_passed(result, np, *scenarios)


def test_leaving_the_schedule_gives_the_usual_results_and_errors():
    scenarios = ("shape_changes_back", "mismatch", "other_order", "fewer_names", "polled", "join", "alone")
    result = run_job(3, WORKER, ",".join(scenarios), env={"ROUNDEL_SHARED_MEMORY": "0"}, timeout=150)
    assert_checks_passed(result, 3, *scenarios)
    for rank in range(3):
        # the mismatch and the fewer names cost no more than the waiter check; the deadlock, its detection
        assert _measured(result, rank) < 10.0, describe(result)
    # rank 1 in join() holds nothing of the schedule, so it gives no slot up; rank 0 sees it wait for what the
    # others hold in a slot and makes every rank give that up at its next tick, not after the transport's wait
    joined_step = [float(line.split()[1]) for line in rank_lines(result.stdout, 0, "stdout")
                   if line.startswith("JOINED_STEP ")]
    assert joined_step and joined_step[0] < 3.0, describe(result)


def test_a_rank_late_by_more_than_the_transport_timeout_times_nothing_out():
    """The others wait in replayed slots while rank 1 sleeps 2.5 Gloo timeouts; they are moved to rank 0's
    coordinator, where waiting has no limit, and the job ends well."""
    env = {"ROUNDEL_SHARED_MEMORY": "0", "HOROVOD_GLOO_TIMEOUT_SECONDS": "2"}
    result = run_job(2, WORKER, "late_rank", env=env)
    assert_checks_passed(result, 2, "late_rank")
    assert _measured(result, 0) >= 4.0, "rank 0 did not wait for rank 1\n" + describe(result)


@pytest.mark.parametrize("scenario", ["rank_dies", "alone_rank_dies"])
def test_a_rank_that_dies_in_the_steady_state_fails_the_others_promptly(scenario):
    env = {"ROUNDEL_SHARED_MEMORY": "0", "ROUNDEL_HEARTBEAT_TIMEOUT_SECONDS": "3"}
    result = run_job(2, WORKER, scenario, env=env)
    assert result.returncode != 0, describe(result)
    errors = [line for line in rank_lines(result.stdout, 0, "stdout") if line.startswith("ERROR ")]
    assert errors and "rank 1" in errors[0], describe(result)
    assert _measured(result, 0) < 8.0, describe(result)


def test_a_rank_waiting_for_the_last_small_allreduce_is_not_left_inside_a_slot():
    """Rank 0 leaves once the job's last (small) allreduce has returned; rank 1 waited for it a second before
    rank 0 submitted it. It used to give its pending slot up meanwhile, and so sat in a transfer rank 0 never
    joined, until rank 0's exit broke it: 'lost the connection to rank 0' instead of its result."""
    result = run_job(2, WORKER, "last_metric", env={"ROUNDEL_SHARED_MEMORY": "0"})
    assert_checks_passed(result, 2, "last_metric")
    assert _measured(result, 1) < 3.0, describe(result)


def test_replay_can_be_turned_off():
    result = run_job(2, WORKER, "off", env={"ROUNDEL_STEADY_REPLAY": "0"})
    assert_checks_passed(result, 2, "off")
