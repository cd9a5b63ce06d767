"""DistributedOptimizer(compression=hvd.PowerSGD(rank=4, start_iter=10)) under the real launcher.

The worker (tests/workers/torch_powersgd.py) trains a 64-256-256-10 MLP on
scikit-learn's digits with plain allreduce and with PowerSGD, and requires
PowerSGD's test accuracy within 2 points of the uncompressed one, the bytes
the optimizer submits to allreduce per step (counted at the submission)
plain for the first 10 steps and at least 10x fewer afterwards, and the same
parameters on every rank.
"""

import pytest
import torch

import roundel.torch as hvd
from launch_util import assert_checks_passed, rank_lines, run_job


@pytest.mark.parametrize("np_", [2, 3])
def test_powersgd_accuracy_and_bytes(np_):
    result = run_job(np_, "torch_powersgd.py", timeout=150)
    assert_checks_passed(result, np_, "torch_powersgd")
    assert [line for line in rank_lines(result.stdout, 0) if line.startswith("POWERSGD")]


def test_powersgd_arguments():
    with pytest.raises(ValueError, match="rank"):
        hvd.PowerSGD(rank=0)
    with pytest.raises(ValueError, match="start_iter"):
        hvd.PowerSGD(start_iter=-1)
    model = torch.nn.Linear(2, 2)
    with pytest.raises(ValueError, match="instance"):
        hvd.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1), compression=hvd.PowerSGD)


def test_small_and_one_dimensional_gradients_stay_uncompressed():
    psgd = hvd.PowerSGD(rank=4)
    assert psgd._shape(torch.zeros(100)) is None
    assert psgd._shape(torch.zeros(10, 10)) is None  # (10 + 10) * 4 * 2 >= 100
    assert psgd._shape(torch.zeros(256, 64)) == (256, 64, 4)
    assert psgd._shape(torch.zeros(32, 3, 3, 3)) == (32, 27, 4)
