"""DistributedOptimizer and state broadcast under the real launcher.

The worker trains the same model distributed and in one process on the
concatenated batch and requires equal parameters: 1e-5 in float32, 2e-2 with
fp16/bf16 compression; Adasum is checked against a NumPy version of the
pairwise formula (rtol 1e-5).
"""

import pytest

from launch_util import assert_checks_passed, run_job


@pytest.mark.parametrize("np_", [2, 3])
def test_distributed_optimizer(np_):
    result = run_job(np_, "torch_optimizer.py", timeout=180)
    assert_checks_passed(result, np_, "torch_optimizer")
