"""DistributedOptimizer(shard_optimizer_state=True) (ZeRO stage 1) under the real launcher.

The worker (tests/workers/torch_zero.py) trains one model with the sharded and
the unsharded optimizer side by side (Adam with weight decay, SGD with
Nesterov momentum; two parameter groups, 174 elements so that slices are
padded) for 20 steps and requires equal parameters (rtol 1e-5); checks each
rank's state bytes are ceil(elements / N) per state tensor; round-trips
``state_dict()`` (equal to the unsharded optimizer's, loadable both ways);
``broadcast_optimizer_state``; elastic ``TorchState`` save/restore/sync; and
the ValueErrors for unsupported options.
"""

import pytest

import roundel.torch as hvd
import torch
from launch_util import assert_checks_passed, rank_lines, run_job


@pytest.mark.parametrize("np_", [2, 3])
def test_sharded_optimizer_matches_unsharded(np_):
    result = run_job(np_, "torch_zero.py", timeout=120)
    assert_checks_passed(result, np_, "torch_zero")
    ratios = [line for line in rank_lines(result.stdout) if line.startswith("STATE BYTES")]
    assert len(ratios) == 2 * np_, ratios


def test_unsupported_option_names_what_to_do():
    model = torch.nn.Linear(2, 2)
    with pytest.raises(ValueError, match="compression"):
        hvd.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1), shard_optimizer_state=True,
                                 compression=hvd.Compression.fp16)
    with pytest.raises(ValueError, match="groups"):
        hvd.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1), shard_optimizer_state=True,
                                 num_groups=2)


def test_elastic_sharded_state_survives_resize_and_kill(tmp_path):
    # tests/workers/torch_elastic.py with shard_optimizer_state=True: 2 ranks, then 3 (planned: the state is
    # re-sharded from rank 0's commit), then a worker SIGKILLed (its slice is lost; the committed full state
    # is restored and re-sharded over the survivors)
    from elastic_util import ElasticJob, check_training
    from launch_util import WORKERS_DIR

    env = {"EPOCHS": 1000, "SAMPLES": 96, "BATCH": 4, "STEP_SLEEP": 0.05, "SHARDED": 1,
           "STOP_FILE": tmp_path / "stop"}
    # one-slot hosts: a failure takes its whole host out, as in Horovod
    job = ElasticJob(tmp_path, "localhost:1\n127.0.0.2:1\n", str(WORKERS_DIR / "torch_elastic.py"),
                     ("-np", "2", "--min-np", "1", "--elastic-timeout", "60"), env)
    job.wait_count("COMMIT", 5)
    job.set_hosts("localhost:1\n127.0.0.2:1\n127.0.0.3:1\n")
    job.wait_count("generation 1: 3 worker(s)", 1)
    before = sum("COMMIT" in line for line in job.text().splitlines())
    # killed once the 3 ranks train (not while they still join): their commits come after the new generation
    job.wait_for(lambda lines: sum("COMMIT" in line for line in lines) >= before + 8, what="training at 3 ranks")
    job.kill("127.0.0.2:0")
    job.wait_count("generation 2:", 1, timeout=60)
    job.wait_for(lambda lines: sum("COMMIT" in line for line in lines) >= 25, what="training after the kill")
    (tmp_path / "stop").touch()
    assert job.finish(timeout=90) == 0, job.describe()
    check_training(job.text(), None, 96, 4, 1 * 2 * 4 * 3 + 3 * 3)
