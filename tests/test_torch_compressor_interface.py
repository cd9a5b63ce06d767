"""The Compressor interface the torch DistributedOptimizer calls: PowerSGD is one compressor among others.

Without a launcher: ``as_compressor`` keeps the built-in compressors and
PowerSGD as they are, completes a Horovod-style object that has only
``compress`` and ``decompress``, and refuses the rest, and the optimizer
refuses an operator outside a compressor's ``reduce_ops`` with the accepted
ones named. Under the real launcher (tests/workers/torch_compressor_interface.py):
a compressor of the test's own that reduces buckets itself gets every bucket
of every step and one ``end_step`` a step, and its gradients are the ranks'
average; so are a Horovod-style compressor's; and the optimizer asks its
process set about this rank once or twice a step, not once per parameter.
"""

import pytest
import torch

import roundel.torch as hvd
from launch_util import assert_checks_passed, run_job
from roundel.common.compression import Compressor, as_compressor


def test_built_in_compressors_and_powersgd_are_kept_as_they_are():
    psgd = hvd.PowerSGD(rank=2)
    for compression in (hvd.Compression.none, hvd.Compression.fp16, hvd.Compression.bf16, psgd):
        assert as_compressor(compression) is compression
    assert psgd.stateful and psgd.reduces_buckets and psgd.reduce_ops == {hvd.Average, hvd.Sum}
    assert not hvd.Compression.fp16.stateful and not hvd.Compression.fp16.reduces_buckets
    assert hvd.Compression.fp16.reduce_ops is None


class _Negate:
    def compress(self, tensor):
        return -tensor, "negated"

    def decompress(self, tensor, ctx):
        assert ctx == "negated"
        return -tensor


def test_a_horovod_style_object_gets_the_rest_of_the_interface():
    completed = as_compressor(_Negate())
    assert issubclass(completed, Compressor) and not completed.stateful and not completed.reduces_buckets
    sent, ctx = completed.compress(torch.tensor([1.0, -2.0]))
    assert sent.tolist() == [-1.0, 2.0]
    assert completed.decompress(sent, ctx).tolist() == [1.0, -2.0]
    completed.end_step()
    completed.reset()


def test_what_is_not_a_compressor_is_refused():
    with pytest.raises(TypeError, match="not a compressor"):
        as_compressor("fp16")
    with pytest.raises(ValueError, match="needs an instance"):
        as_compressor(hvd.PowerSGD)
    model = torch.nn.Linear(2, 2)
    with pytest.raises(TypeError, match="not a compressor"):
        hvd.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1), compression=object())


def test_an_operator_outside_reduce_ops_is_refused_naming_the_accepted_ones():
    model = torch.nn.Linear(2, 2)
    with pytest.raises(ValueError, match=r"reduces with op=Average or op=Sum, not op=Max"):
        hvd.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1), compression=hvd.PowerSGD(),
                                 op=hvd.Max)


def test_the_optimizer_uses_only_the_interface():
    assert_checks_passed(run_job(2, "torch_compressor_interface.py", timeout=120), 2, "torch_compressor_interface")
