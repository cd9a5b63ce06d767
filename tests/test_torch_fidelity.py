"""Horovod 0.28.1 PyTorch API fidelity under the real launcher, at 2 and 3 ranks.

Each test launches ``tests/workers/torch_fidelity.py`` with a group of
scenarios (one launch per rank count, to keep the time down); the worker compares
every result with a NumPy or single-process torch reference of Horovod's
definition and prints ``CHECKS PASSED <scenario>``.
"""

import pytest

from launch_util import assert_checks_passed, run_job

WORKER = "torch_fidelity.py"

GROUPS = {
    "api_grads_state_optimizers_comm": ("api", "grads", "broadcast_state", "sparse_optimizer", "adasum", "registry",
                                        "comm"),
}


@pytest.mark.parametrize("np", [2, 3])
@pytest.mark.parametrize("group", list(GROUPS))
def test_fidelity(np, group):
    scenarios = GROUPS[group]
    result = run_job(np, WORKER, ",".join(scenarios), env={"ROUNDEL_START_TIMEOUT": "30"}, timeout=180)
    assert_checks_passed(result, np, *scenarios)
