"""Small allreduces reduced by the coordinator: the reduction, and the Negotiator's batches that carry it.

No processes here; ``test_torch_collectives.py`` checks the results in real jobs on both paths.
"""

import pytest
import torch

from roundel.common.engine import small_allreduce
from roundel.common.engine.negotiation import JOIN_NAME, Negotiator
from roundel.common.control.records import OpKind, Request
from roundel.ops import ReduceOp
from roundel.transport.backend import scale

LIMIT = 4096


def allreduce(name, shape=(4,), dtype="float32", **fields):
    return Request(name, OpKind.ALLREDUCE, 0, dtype, shape, **fields)


def rank_tensor(rank, dtype, shape=(4,)):
    return (torch.arange(4, dtype=torch.float64).reshape(shape) + rank * 3 + 1).to(dtype)


@pytest.mark.parametrize("op, expected", [
    (ReduceOp.Sum, lambda ts: ts[0] + ts[1] + ts[2]),
    (ReduceOp.Average, lambda ts: ts[0] + ts[1] + ts[2]),  # then divided by 3, in the dtype
    (ReduceOp.Min, lambda ts: torch.minimum(torch.minimum(ts[0], ts[1]), ts[2])),
    (ReduceOp.Max, lambda ts: torch.maximum(torch.maximum(ts[0], ts[1]), ts[2])),
    (ReduceOp.Product, lambda ts: ts[0] * ts[1] * ts[2]),
])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.int16, torch.uint32, torch.int64])
def test_the_coordinator_combines_every_rank_in_rank_order(op, expected, dtype):
    request = allreduce("x", dtype=str(dtype).removeprefix("torch."), reduce_op=int(op))
    tensors = [rank_tensor(r, dtype) for r in range(3)]
    reduced = small_allreduce.reduce(request, [small_allreduce.snapshot(t) for t in tensors])
    wide = [t.to(torch.float64) for t in tensors]
    want = expected(wide).to(dtype)
    if op == ReduceOp.Average:
        scale(want, 1 / 3)
    got = torch.frombuffer(bytearray(reduced), dtype=dtype)
    assert torch.equal(got, want.reshape(-1))


def test_prescale_applies_to_each_contribution_and_integers_truncate_as_in_the_transport():
    request = allreduce("x", dtype="int32", reduce_op=int(ReduceOp.Sum), prescale=0.5)
    tensors = [torch.tensor([3, 5, -3, 7], dtype=torch.int32), torch.tensor([1, 1, 1, 1], dtype=torch.int32)]
    reduced = small_allreduce.reduce(request, [small_allreduce.snapshot(t) for t in tensors])
    # each scaled in float64 and truncated first: trunc(1.5) + trunc(0.5), ...
    assert torch.frombuffer(bytearray(reduced), dtype=torch.int32).tolist() == [1, 2, -1, 3]


def test_data_of_the_wrong_size_or_type_is_not_reduced():
    request = allreduce("x")
    good = small_allreduce.snapshot(torch.ones(4))
    assert small_allreduce.reduce(request, [good, good[:-1]]) is None
    assert small_allreduce.reduce(request, [good, "text"]) is None
    assert small_allreduce.reduce(request, [good, good]) is not None


def test_a_non_contiguous_tensor_is_sent_in_row_major_order():
    tensor = torch.arange(6, dtype=torch.float32).reshape(2, 3).t()
    sent = torch.frombuffer(bytearray(small_allreduce.snapshot(tensor)), dtype=torch.float32)
    assert sent.tolist() == [0.0, 3.0, 1.0, 4.0, 2.0, 5.0]


@pytest.mark.parametrize("dtype", ["float32", "bfloat16", "int32"])
def test_postscale_and_the_average_apply_after_the_combination_in_the_dtype(dtype):
    request = allreduce("x", dtype=dtype, reduce_op=int(ReduceOp.Average), postscale=3.0)
    tensors = [torch.tensor(values).to(getattr(torch, dtype)) for values in ([1, 2, -3, 7], [2, 2, 0, 0])]
    reduced = small_allreduce.reduce(request, [small_allreduce.snapshot(t) for t in tensors])
    want = tensors[0] + tensors[1]
    scale(want, 3.0 / 2)  # integers: in float64, truncated (-4.5 -> -4), as on the transport
    assert torch.equal(torch.frombuffer(bytearray(reduced), dtype=getattr(torch, dtype)), want)
    if dtype == "int32":
        assert want.tolist() == [4, 6, -4, 10]


def test_unpack_fills_each_output_in_entry_order():
    result = torch.arange(6, dtype=torch.float32)
    outputs = [torch.zeros(2, 2), torch.zeros(())]
    outputs.append(torch.zeros(1))
    small_allreduce.unpack(result.numpy().tobytes(), torch.float32, outputs)
    assert outputs[0].tolist() == [[0.0, 1.0], [2.0, 3.0]]
    assert outputs[1].item() == 4.0 and outputs[2].tolist() == [5.0]


@pytest.mark.parametrize("request_, limit, expected", [
    (allreduce("x"), LIMIT, True),
    (allreduce("x", shape=(1024,)), LIMIT, True),
    (allreduce("x", shape=(1025,)), LIMIT, False),
    (allreduce("x"), 0, False),
    (allreduce("x", shape=(0,)), LIMIT, False),
    (allreduce("x", device="cuda"), LIMIT, False),
    (allreduce("x", dtype="bool"), LIMIT, False),
    (allreduce("x", dtype="complex64"), LIMIT, False),
    (allreduce("x", reduce_op=int(ReduceOp.Adasum)), LIMIT, False),
    (allreduce("x", error="bad input"), LIMIT, False),
    (Request("x", OpKind.BROADCAST, 0, "float32", (4,), root_rank=0), LIMIT, False),
])
def test_which_requests_travel_with_their_data(request_, limit, expected):
    assert small_allreduce.eligible(request_, limit) is expected


# ------------------------------------------------------------- negotiation
def submit_with_data(negotiator, request, ranks, by_bit=False):
    for rank in ranks:
        data = small_allreduce.snapshot(rank_tensor(rank, torch.float32))
        negotiator.submit(rank, request, 0.0, by_bit=by_bit and rank != 0, data=data)


def test_a_batch_carries_the_result_once_every_member_sent_data():
    n = Negotiator(2, 8, LIMIT)
    submit_with_data(n, allreduce("loss"), (0, 1))
    (_, batch), = n.take(1 << 20)
    assert torch.frombuffer(bytearray(batch.reduced), dtype=torch.float32).tolist() == [2.5, 3.5, 4.5, 5.5]


def test_without_every_members_data_or_with_a_joined_rank_the_batch_uses_the_transport():
    n = Negotiator(3, 8, LIMIT)
    submit_with_data(n, allreduce("a"), (0, 1))
    n.submit(2, allreduce("a"), 0.0)  # no data from rank 2
    (_, batch), = n.take(1 << 20)
    assert batch.reduced is None

    n.submit(2, Request(JOIN_NAME, OpKind.JOIN, 0), 0.0)
    submit_with_data(n, allreduce("b"), (0, 1))
    (_, batch), = n.take(1 << 20)
    assert batch.joined == (2,) and batch.reduced is None


def test_a_coordinator_limit_of_zero_reduces_nothing():
    n = Negotiator(2, 8, 0)
    submit_with_data(n, allreduce("loss"), (0, 1))
    (_, batch), = n.take(1 << 20)
    assert batch.reduced is None


def test_reduced_entries_fuse_only_with_each_other_in_entry_order():
    n = Negotiator(2, 0, LIMIT)
    submit_with_data(n, allreduce("a"), (0, 1))
    for rank in (0, 1):
        n.submit(rank, allreduce("big"), 0.0)
    submit_with_data(n, allreduce("b", shape=(2, 2)), (0, 1))
    batches = [batch for _, batch in n.take(1 << 20)]
    assert [tuple(e.name for e in b.entries) for b in batches] == [("a", "b"), ("big",)]
    assert batches[1].reduced is None
    assert torch.frombuffer(bytearray(batches[0].reduced), dtype=torch.float32).tolist() == [2.5, 3.5, 4.5, 5.5] * 2


def test_the_cache_bits_form_of_a_reduced_batch_carries_its_result_in_bit_order():
    n = Negotiator(2, 8, LIMIT)
    for name in ("b", "a"):  # first step: agreed in full, cached under bits 0 ("b") and 1 ("a")
        submit_with_data(n, allreduce(name), (0, 1))
    n.take(1 << 20)
    for name in ("a", "b"):  # second step, by bits, "a" first
        submit_with_data(n, allreduce(name), (0, 1), by_bit=True)
    (_, batch), = n.take(1 << 20)
    compact = n.compact_form(batch)
    assert [e.name for e in batch.entries] == ["b", "a"] and compact.bits == 0b11
    assert compact.reduced == batch.reduced and len(batch.reduced) == 32


@pytest.mark.parametrize("output", [torch.zeros(()), torch.zeros(2, 2, dtype=torch.int64),
                                    torch.zeros(3, dtype=torch.bfloat16, requires_grad=True)])
def test_a_result_is_copied_into_a_single_output_as_it_is(output):
    result = torch.arange(output.numel(), dtype=output.dtype) + 1
    small_allreduce.unpack(result.detach().view(torch.uint8).numpy().tobytes(), output.dtype, [output])
    assert torch.equal(output.detach().reshape(-1), result)


def test_overflow_is_silent_as_in_torch(recwarn):
    request = allreduce("x", shape=(2,), dtype="float16")
    big = small_allreduce.snapshot(torch.full((2,), 60000.0, dtype=torch.float16))
    reduced = small_allreduce.reduce(request, [big, big])
    assert torch.frombuffer(bytearray(reduced), dtype=torch.float16).isinf().all()
    assert not recwarn.list, [str(w.message) for w in recwarn.list]
