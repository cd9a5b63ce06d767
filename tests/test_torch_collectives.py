"""PyTorch collectives under the real launcher, checked against NumPy references.

Each test launches ``tests/workers/torch_collectives.py`` with one or more
scenario names; the worker raises on any mismatch (its rank then exits
non-zero, and roundelrun names it) and prints ``CHECKS PASSED <scenario>``.
Scenarios are grouped into few launches because each launch costs seconds.
"""

import pytest

from launch_util import assert_checks_passed, run_job

WORKER = "torch_collectives.py"

GROUPS = {
    "allreduce_gather_bcast_a2a_rs": ("allreduce", "allreduce_sizes", "grouped", "group_batches", "message_limits",
                                      "coordinator_reduce", "allgather", "broadcast", "alltoall", "reducescatter"),
    "async_autograd_join": ("ordering", "barrier", "autograd", "inference_mode", "join"),
}


@pytest.mark.parametrize("np", [2, 3])
@pytest.mark.parametrize("group", list(GROUPS))
def test_collectives(np, group):
    scenarios = GROUPS[group]
    result = run_job(np, WORKER, ",".join(scenarios), timeout=240)
    assert_checks_passed(result, np, *scenarios)


# Fusion and response-cache settings must never change results: the same checks
# with fusion off, with the HOROVOD_ spelling of a large threshold, with the
# cache off, and with a cache so small that names repeat while being evicted.
SETTINGS = {
    "fusion_off": {"ROUNDEL_FUSION_THRESHOLD": "0"},
    "horovod_fusion_64mb": {"HOROVOD_FUSION_THRESHOLD": "67108864", "HOROVOD_CYCLE_TIME": "5"},
    "cache_off": {"ROUNDEL_CACHE_CAPACITY": "0"},
    "cache_tiny": {"ROUNDEL_CACHE_CAPACITY": "2"},
    "horovod_cache_tiny_fusion_small": {"HOROVOD_CACHE_CAPACITY": "3", "HOROVOD_FUSION_THRESHOLD": "64"},
    "coordinator_reduce_largest": {"ROUNDEL_COORDINATOR_REDUCE_BYTES": "65536"},
    "steady_replay_off": {"ROUNDEL_STEADY_REPLAY": "0"},
}


@pytest.mark.parametrize("setting", list(SETTINGS))
def test_settings_do_not_change_results(setting):
    scenarios = ("steady", "allreduce", "ordering")
    result = run_job(3, WORKER, ",".join(scenarios), env=SETTINGS[setting])
    assert_checks_passed(result, 3, *scenarios)


@pytest.mark.parametrize("prefix", ["HOROVOD_", "ROUNDEL_"])
def test_disable_group_fusion_keeps_each_group_in_a_batch_of_its_own(prefix):
    scenarios = ("group_batches", "grouped")
    result = run_job(3, WORKER, ",".join(scenarios), env={prefix + "DISABLE_GROUP_FUSION": "1"})
    assert_checks_passed(result, 3, *scenarios)


def test_small_allreduces_on_the_transport():
    """With the coordinator's reduction off, small allreduces (every op and dtype, around the sizes where
    the Gloo backend changes algorithm) go over the transport and give the same results."""
    scenarios = ("allreduce_sizes", "coordinator_reduce", "steady")
    result = run_job(3, WORKER, ",".join(scenarios), env={"ROUNDEL_COORDINATOR_REDUCE_BYTES": "0"})
    assert_checks_passed(result, 3, *scenarios)


def test_launcher_flags_for_fusion_and_cache():
    result = run_job(2, WORKER, "steady", launcher_args=["--fusion-threshold-mb", "0", "--cache-capacity", "1"])
    assert_checks_passed(result, 2, "steady")
