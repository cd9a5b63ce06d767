"""Already-flat inputs are not copied: the executor runs the transport call in the caller's own memory.

A batch of one contiguous tensor (a DistributedOptimizer bucket) is allreduced, broadcast, gathered,
reduce-scattered or Adasum-combined from the tensor itself, not through the fusion buffer; on a backend
that queues its calls on a device (NCCL), each large entry of a fused allreduce is a call in its own
memory too. The in-memory backend records the address of every buffer it is handed, so each test sees
where the call ran; the results are compared with the fusion-buffer path's, bit for bit.
"""

import torch

from roundel.common.control.records import Batch, Entry, OpKind, Request
from roundel.common.engine.executor import OWN_CALL_BYTES
from roundel.ops import ReduceOp
from test_fusion_unit import MemoryBackend, batch_of, group, work  # noqa: F401 (group: the fixture)


class PointerBackend(MemoryBackend):
    """A MemoryBackend that records the address of each buffer a call sends from."""

    def __init__(self, rank, size, exchange, fail=False):
        super().__init__(rank, size, exchange, fail)
        self.pointers = []

    def allreduce(self, tensor, op):
        self.pointers.append(tensor.data_ptr())
        super().allreduce(tensor, op)

    def allgather(self, output, tensor):
        self.pointers.append(tensor.data_ptr())
        super().allgather(output, tensor)

    def broadcast(self, tensor, root):
        self.pointers.append(tensor.data_ptr())
        super().broadcast(tensor, root)

    def reducescatter(self, output, tensor, op):
        self.pointers.append(tensor.data_ptr())
        super().reducescatter(output, tensor, op)


class QueuingBackend(PointerBackend):
    """A PointerBackend that says its calls are queued on a device, as NCCL's are."""

    queues_on_device = True


def _values(rank, shape, dtype=torch.float32):
    return (torch.arange(torch.Size(shape).numel(), dtype=dtype).reshape(shape) * 0.37 + rank * 1.1).to(dtype)


def test_a_bucket_is_allreduced_in_its_own_memory(group):
    g = group(2, backend=PointerBackend)
    request = Request("bucket", OpKind.ALLREDUCE, 0, "float32", (1000,), reduce_op=int(ReduceOp.Average),
                      postscale=0.5)
    buckets = [_values(r, (1000,)) for r in range(2)]
    expected = (buckets[0] + buckets[1]) / 2 * 0.5
    addresses = [b.data_ptr() for b in buckets]
    outcomes = g.run(batch_of(OpKind.ALLREDUCE, [request]), [[work(request, buckets[r])] for r in range(2)])
    for r in range(2):
        assert outcomes[r][0] is buckets[r] and torch.equal(buckets[r], expected)
        assert g.backends[r].pointers == [addresses[r]]


def test_a_single_broadcast_and_allgather_send_from_the_tensor_itself(group):
    g = group(2, backend=PointerBackend)
    request = Request("b", OpKind.BROADCAST, 0, "float64", (6,), root_rank=1)
    tensors = [_values(r, (6,), torch.float64) for r in range(2)]
    expected = tensors[1].clone()
    g.run(batch_of(OpKind.BROADCAST, [request]), [[work(request, tensors[r])] for r in range(2)])
    assert [b.pointers for b in g.backends] == [[tensors[0].data_ptr()], [tensors[1].data_ptr()]]
    assert all(torch.equal(t, expected) for t in tensors)

    rows = [_values(r, (2, 3)) for r in range(2)]
    gather = Request("g", OpKind.ALLGATHER, 0, "float32", (2, 3))
    batch = Batch(OpKind.ALLGATHER, 0, (Entry("g", gather, first_dims=(2, 2)),))
    outcomes = g.run(batch, [[work(gather, rows[r], None)] for r in range(2)])
    assert [b.pointers[1:] for b in g.backends] == [[rows[0].data_ptr()], [rows[1].data_ptr()]]
    assert all(torch.equal(outcome[0], torch.cat(rows)) for outcome in outcomes)


def test_an_evenly_split_reducescatter_sends_from_the_tensor_itself_and_leaves_it_alone(group):
    g = group(2, backend=PointerBackend)
    request = Request("rs", OpKind.REDUCESCATTER, 0, "float32", (4, 3), reduce_op=int(ReduceOp.Sum), postscale=3.0)
    tensors = [_values(r, (4, 3)) for r in range(2)]
    before = [t.clone() for t in tensors]
    total = (tensors[0] + tensors[1]) * 3.0
    outcomes = g.run(batch_of(OpKind.REDUCESCATTER, [request]), [[work(request, t, None)] for t in tensors])
    assert [b.pointers for b in g.backends] == [[tensors[0].data_ptr()], [tensors[1].data_ptr()]]
    assert torch.equal(outcomes[0][0], total[:2]) and torch.equal(outcomes[1][0], total[2:])
    assert all(torch.equal(t, b) for t, b in zip(tensors, before))


def test_a_prescaled_or_uneven_reducescatter_still_copies_and_leaves_the_input_alone(group):
    g = group(2, backend=PointerBackend)
    for shape, prescale in (((4, 3), 2.0), ((5, 3), 1.0)):
        request = Request("rs", OpKind.REDUCESCATTER, 0, "float32", shape, reduce_op=int(ReduceOp.Sum),
                          prescale=prescale)
        tensors = [_values(r, shape) for r in range(2)]
        before = [t.clone() for t in tensors]
        total = tensors[0] * prescale + tensors[1] * prescale
        outcomes = g.run(batch_of(OpKind.REDUCESCATTER, [request]), [[work(request, t, None)] for t in tensors])
        assert all(b.pointers[-1] != t.data_ptr() for b, t in zip(g.backends, tensors))
        first = (shape[0] + 1) // 2
        assert torch.equal(outcomes[0][0], total[:first]) and torch.equal(outcomes[1][0], total[first:])
        assert all(torch.equal(t, b) for t, b in zip(tensors, before))


def test_a_single_adasum_tensor_is_gathered_from_its_own_memory(group):
    g = group(2, backend=PointerBackend)
    request = Request("a", OpKind.ALLREDUCE, 0, "float32", (2,), reduce_op=int(ReduceOp.Adasum))
    tensors = [torch.tensor([1.0, 0.0]), torch.tensor([0.0, 3.0])]
    addresses = [t.data_ptr() for t in tensors]
    outcomes = g.run(batch_of(OpKind.ALLREDUCE, [request]), [[work(request, t)] for t in tensors])
    assert [b.pointers for b in g.backends] == [[addresses[0]], [addresses[1]]]
    assert all(torch.equal(outcome[0], torch.tensor([1.0, 3.0])) for outcome in outcomes)  # orthogonal: added


def _fused_batch(g):
    big = OWN_CALL_BYTES // 4
    shapes = {"big1": (big,), "small": (7,), "big2": (big,)}
    requests = [Request(name, OpKind.ALLREDUCE, 0, "float32", shape, reduce_op=int(ReduceOp.Average),
                        prescale=0.5, postscale=3.0) for name, shape in shapes.items()]
    tensors = [[_values(r, shape) for shape in shapes.values()] for r in range(2)]
    addresses = [[t.data_ptr() for t in row] for row in tensors]
    g.run(batch_of(OpKind.ALLREDUCE, requests), [[work(q, t) for q, t in zip(requests, row)] for row in tensors])
    return tensors, addresses


def test_large_entries_of_a_fused_batch_go_in_their_own_calls_only_where_calls_are_queued(group):
    queuing, plain = group(2, backend=QueuingBackend), group(2, backend=PointerBackend)
    queued, addresses = _fused_batch(queuing)
    packed, _ = _fused_batch(plain)
    for r in range(2):
        assert all(torch.equal(a, b) for a, b in zip(queued[r], packed[r]))  # the same results, bit for bit
        big1, small, big2 = addresses[r]
        sent = queuing.backends[r].pointers
        assert sent[:2] == [big1, big2] and len(sent) == 3 and sent[2] not in (small, big1, big2)
        assert len(plain.backends[r].pointers) == 1  # one call over the fusion buffer
