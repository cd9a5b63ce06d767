"""hvd.SyncBatchNorm under the real launcher: equal to one process's BatchNorm on the whole batch.

Forward output, input gradients, running statistics and eval mode agree to
1e-12 in float64 (checks.py's float64 tolerance); the weight and bias
gradients summed over the ranks equal the single process's. A small float32
CNN with SyncBatchNorm trained by DistributedOptimizer matches one process
stepping on the concatenated batch to 1e-5.
"""

import pytest

from launch_util import assert_checks_passed, run_job

SCENARIOS = ("shapes", "empty_batch", "float32_training", "bad_input", "no_host_reads")


@pytest.mark.parametrize("np_", [2, 3])
def test_sync_batch_norm(np_):
    result = run_job(np_, "torch_sync_batch_norm.py", ",".join(SCENARIOS), timeout=180)
    assert_checks_passed(result, np_, *SCENARIOS)
