"""How replay slots lay out their transfer (roundel.common.engine.slot_plans): every rank's plan of one slot, with
the rows moved between them as an allgather would, gives each rank the collective's result and every rank's
agreement; which slots travel in rows."""

import pytest
import torch

from roundel.common.control.records import OpKind, Request
from roundel.common.engine.replay import Slot
from roundel.common.engine.slot_plans import ROWS_BYTES, ReducedPlan, RowsPlan, plan_slot


def _allgather(plans: list) -> None:
    """What the transport's allgather of the plans' rows does: every rank's ``send`` into every rank's row."""
    width = plans[0].send.numel()
    for plan in plans:
        for rank, sender in enumerate(plans):
            plan.rows[rank * width:(rank + 1) * width].copy_(sender.send)


def _broadcast_slot(shapes: list, dtype: str, root: int) -> Slot:
    requests = tuple(Request(f"b{i}", OpKind.BROADCAST, 0, dtype, shape, root_rank=root) for i, shape in enumerate(shapes))
    return Slot(tuple(r.name for r in requests), requests, 1)


def _allgather_slots(inner: list, dims: list, dtype: str, members: int) -> list:
    """One allgather slot per rank: name i has first dimension ``dims[i][rank]`` on each rank and ``inner[i]``."""
    slots = []
    for rank in range(members):
        requests = tuple(Request(f"g{i}", OpKind.ALLGATHER, 0, dtype, (d[rank],) + tuple(shape))
                         for i, (shape, d) in enumerate(zip(inner, dims)))
        slots.append(Slot(tuple(r.name for r in requests), requests, 1, tuple(tuple(d) for d in dims)))
    return slots


def _tensor(shape, dtype: torch.dtype, seed: int) -> torch.Tensor:
    values = torch.arange(seed, seed + max(1, torch.Size(shape).numel()))[:torch.Size(shape).numel()]
    return (values % 2 == 0).view(shape) if dtype == torch.bool else values.to(dtype).view(shape)


@pytest.mark.parametrize("dtype", ["bool", "int8", "float16", "float64", "complex64"])
@pytest.mark.parametrize("members,root", [(2, 0), (2, 1), (3, 2)])
def test_broadcast_rows_carry_the_roots_tensors_and_every_agreement(dtype, members, root):
    shapes = [(3,), (2, 5), (1,)]  # odd byte counts: the next tensor starts unaligned within the row
    torch_dtype = getattr(torch, dtype)
    plans = [RowsPlan(_broadcast_slot(shapes, dtype, root), rank, root, members) for rank in range(members)]
    tensors = [[_tensor(s, torch_dtype, 10 * rank + i) for i, s in enumerate(shapes)] for rank in range(members)]
    for rank, plan in enumerate(plans):
        if plan.sends_data:
            for into, tensor in zip(plan.inputs, tensors[rank]):
                into.copy_(tensor)
        plan.fill_agreement(False, 1.5 * rank)
    _allgather(plans)
    for rank, plan in enumerate(plans):
        assert not plan.given_up()
        assert plan.waits() == [1.5 * r for r in range(members)]
        outputs = [torch.empty(s, dtype=torch_dtype) for s in shapes] if rank % 2 else tensors[rank]
        results = plan.results(tensors[rank], outputs)
        assert all(r is o for r, o in zip(results, outputs))
        for result, expected in zip(results, tensors[root]):
            assert torch.equal(result, expected), (rank, result, expected)


@pytest.mark.parametrize("dtype", ["uint8", "int32", "bfloat16", "float64"])
def test_allgather_rows_concatenate_every_ranks_rows_in_rank_order(dtype):
    members, inner = 3, [(3,), (2, 2), ()]
    dims = [[1, 0, 4], [2, 3, 1], [5, 5, 5]]
    torch_dtype = getattr(torch, dtype)
    slots = _allgather_slots(inner, dims, dtype, members)
    plans = [RowsPlan(slots[rank], rank, None, members) for rank in range(members)]
    tensors = [[_tensor(r.shape, torch_dtype, 7 * rank + i) for i, r in enumerate(slots[rank].requests)]
               for rank in range(members)]
    for rank, plan in enumerate(plans):
        for into, tensor in zip(plan.inputs, tensors[rank]):
            into.copy_(tensor)
        plan.fill_agreement(rank == 1, 0.0)
    _allgather(plans)
    for rank, plan in enumerate(plans):
        assert plan.given_up()  # rank 1 gave it up: every rank sees it
        for i, result in enumerate(plan.results([], [])):
            assert torch.equal(result, torch.cat([tensors[r][i] for r in range(members)])), (rank, i)


def test_which_slots_travel_in_rows():
    allreduce = Request("a", OpKind.ALLREDUCE, 0, "float32", (10,))
    assert isinstance(plan_slot(Slot(("a",), (allreduce,), 1), [0, 1], 0, lambda dtype, n: torch.empty(n, dtype=dtype)),
                      ReducedPlan)
    fits = (ROWS_BYTES - 16) // 4  # float32 elements whose row, after its 16 bytes of agreement, fills ROWS_BYTES
    assert RowsPlan.fits(_broadcast_slot([(fits,)], "float32", 0), 2)
    assert not RowsPlan.fits(_broadcast_slot([(fits + 1,)], "float32", 0), 2)
    assert not RowsPlan.fits(_broadcast_slot([(fits,)], "float32", 0), 3)  # two rows from the others
    large = _allgather_slots([(fits,)], [[1, 1]], "float32", 2)[0]
    assert isinstance(plan_slot(large, [0, 1], 0, lambda dtype, n: torch.empty(n, dtype=dtype)), RowsPlan)
    larger = _allgather_slots([(fits,)], [[1, 2]], "float32", 2)[0]
    assert isinstance(plan_slot(larger, [0, 1], 0, lambda dtype, n: torch.empty(n, dtype=dtype)), ReducedPlan)
