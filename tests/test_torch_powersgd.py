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


def test_elastic_resize_with_powersgd(tmp_path):
    # tests/workers/torch_elastic.py with PowerSGD(rank=1, start_iter=3): after the job grows from 2 to 3 ranks
    # the survivors start over as the new rank does (plain steps first), so their requests match
    from elastic_util import ElasticJob, check_training
    from launch_util import WORKERS_DIR

    env = {"EPOCHS": 1000, "SAMPLES": 96, "BATCH": 4, "STEP_SLEEP": 0.05, "POWERSGD": 1,
           "STOP_FILE": tmp_path / "stop"}
    job = ElasticJob(tmp_path, "localhost:2\n", str(WORKERS_DIR / "torch_elastic.py"),
                     ("-np", "2", "--elastic-timeout", "60"), env)
    job.wait_count("COMMIT", 6)
    job.set_hosts("localhost:3\n")
    job.wait_count("generation 1: 3 worker(s)", 1)
    job.wait_for(lambda lines: sum("COMMIT" in line for line in lines) >= 16, what="training at 3 ranks")
    (tmp_path / "stop").touch()
    assert job.finish(timeout=90) == 0, job.describe()
    check_training(job.text(), None, 96, 4, 2 * 3)
