"""DistributedOptimizer and state broadcast under the real launcher, and its gradient buckets.

The worker trains the same model distributed and in one process on the
concatenated batch and requires equal parameters: 1e-5 in float32, 2e-2 with
fp16/bf16 compression; Adasum is checked against a NumPy version of the
pairwise formula (rtol 1e-5). The worker also checks gradients as bucket views
(each ``.grad`` inside its bucket's flat buffer after backward from the second
step on, at 1 and 2 backward passes, zero_grad with set_to_none both ways) and
the buckets rebuilt in the order gradients became ready. The bucket-name tests
need no launcher: building the optimizer runs no collective. When ranks
disagree on a parameter's shape, the error of ``step()`` names the bucket's
parameters and their shapes on each rank.
"""

import pytest
import torch

import roundel.torch as hvd
from launch_util import assert_checks_passed, describe, rank_lines, run_job


@pytest.mark.parametrize("np_", [2, 3])
def test_distributed_optimizer_and_its_process_sets(np_):
    # process-sets is Horovod's test_optimizer_process_sets: on a rank outside the optimizer's set, step()
    # reduces nothing; removing the sets completes. default-cap: without ROUNDEL_BUCKET_CAP_MB (or the
    # flag) the cap is 25 MB. One job runs them all (each launch costs seconds).
    scenarios = ("training", "process-sets", "default-cap")
    result = run_job(np_, "torch_optimizer.py", ",".join(scenarios), timeout=240)
    assert_checks_passed(result, np_, *scenarios)


@pytest.mark.parametrize("how", ["variable", "flag"])
def test_bucket_cap_from_environment_and_flag(how):
    # the worker builds optimizers without bucket_cap_mb (cap 0 expected) and with bucket_cap_mb=25
    if how == "variable":
        result = run_job(2, "torch_optimizer.py", "cap-from-environment", 0, env={"ROUNDEL_BUCKET_CAP_MB": "0"},
                         timeout=90)
    else:
        result = run_job(2, "torch_optimizer.py", "cap-from-environment", 0, launcher_args=["--bucket-cap-mb", "0"],
                         timeout=90)
    assert_checks_passed(result, 2, "torch_optimizer")


def _bucket_names(model, **kwargs):
    opt = hvd.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1),
                                   named_parameters=model.named_parameters(), **kwargs)
    return [b.name for b in opt._buckets]


def _model():
    # parameters of 4 KiB, 4 B, 1 MiB and 1 KiB, registered in this order
    return torch.nn.ModuleDict({"a": torch.nn.Linear(32, 32, bias=False), "b": torch.nn.Linear(1, 1, bias=False),
                                "c": torch.nn.Linear(512, 512, bias=False), "d": torch.nn.Linear(16, 16, bias=False)})


def test_buckets_follow_reverse_registration_order_the_first_one_small():
    assert _bucket_names(_model()) == ["allreduce.bucket.d.weight.2", "allreduce.bucket.b.weight.2"]
    assert _bucket_names(_model(), bucket_cap_mb=0.001) == [
        "allreduce.bucket.d.weight.2", "allreduce.bucket.b.weight.2"]
    assert _bucket_names(_model(), bucket_cap_mb=0.0001) == [
        "allreduce.d.weight", "allreduce.c.weight", "allreduce.bucket.b.weight.2"]


def test_no_buckets_with_cap_zero_and_groups_stay_together():
    # (op=Adasum with more than one rank is the delta-based Adasum optimizer, without buckets:
    # tests/test_torch_fidelity.py)
    singles = ["allreduce.d.weight", "allreduce.c.weight", "allreduce.b.weight", "allreduce.a.weight"]
    assert _bucket_names(_model(), bucket_cap_mb=0) == singles
    model = _model()
    assert _bucket_names(model, groups=[[model["a"].weight, model["d"].weight]], bucket_cap_mb=0) == [
        "allreduce.bucket.a.weight.2", "allreduce.c.weight", "allreduce.b.weight"]
    model["b"].weight.data = model["b"].weight.data.double()  # one dtype per flat buffer
    assert _bucket_names(model) == ["allreduce.bucket.d.weight.2", "allreduce.b.weight", "allreduce.a.weight"]


def test_frozen_parameters_are_not_bucketed():
    model = _model()
    model["c"].weight.requires_grad_(False)
    assert _bucket_names(model) == ["allreduce.bucket.d.weight.3"]


@pytest.mark.parametrize("bad", [-1, "25", True, float("nan")])
def test_bucket_cap_is_validated(bad):
    with pytest.raises(ValueError, match=r"bucket_cap_mb=.* must be a number >= 0"):
        _bucket_names(_model(), bucket_cap_mb=bad)


def test_groups_may_not_repeat_a_parameter():
    model = _model()
    with pytest.raises(ValueError, match="more than once"):
        _bucket_names(model, groups=[[model["a"].weight], [model["a"].weight, model["b"].weight]])


@pytest.mark.parametrize("naming, last_layer", [("named", ("2.weight", "2.bias")),
                                                 ("unnamed", ("allreduce.noname.0.2", "allreduce.noname.0.3"))])
def test_bucket_error_names_the_users_parameters(naming, last_layer):
    """Rank 1's last layer is 5 wide, rank 0's 3: both ranks' errors name it, with their own shapes."""
    result = run_job(2, "torch_optimizer_mismatch.py", naming, timeout=90)
    assert result.returncode == 0, describe(result)
    for rank, width in ((0, 3), (1, 5)):
        lines = rank_lines(result.stdout, rank, "stdout")
        assert len(lines) == 1 and lines[0].startswith("CAUGHT CollectiveMismatchError True: "), describe(result)
        message = lines[0]
        assert "Mismatched allreduce tensor shapes" in message, message  # the original error is kept
        weight, bias = last_layer
        assert f"while reducing gradients of: {bias} [{width}], {weight} [{width}, 16]" in message, message
        assert "(bucket 0 of 1, 'allreduce." in message, message
