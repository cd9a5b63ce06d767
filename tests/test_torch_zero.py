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
