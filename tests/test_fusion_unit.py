"""The executor's packing and unpacking, run on an in-memory backend (no processes, no sockets).

Each simulated rank has its own Executor whose backend exchanges buffers with
the others' through shared memory and computes the collective by plain
arithmetic, so the test checks what lands in which output tensor.
"""

import concurrent.futures
import json
import threading

import pytest
import torch

from roundel.errors import CollectiveDeadlockError, CollectiveMismatchError, RoundelInternalError
from roundel.common.engine.executor import OWN_CALL_BYTES, Executor, Work
from roundel.common.engine.handles import Handle
from roundel.common.engine.process_set_registry import ProcessSetRegistry
from roundel.common.engine.timeline import Timeline
from roundel.ops import ReduceOp
from roundel.common.control.records import Batch, Entry, OpKind, Request
from roundel.transport.backend import Backend, ShapedViews

TIMEOUT_S = 20


class Exchange:
    """Lets ``size`` threads swap one value each and see everyone's."""

    def __init__(self, size: int):
        self._values = [None] * size
        self._barrier = threading.Barrier(size, timeout=TIMEOUT_S)

    def swap(self, rank: int, value):
        self._values[rank] = value
        self._barrier.wait()
        seen = list(self._values)
        self._barrier.wait()  # nobody overwrites before everyone has read
        return seen


def _reduce(tensors, op):
    stacked = torch.stack(tensors)
    if op in (ReduceOp.Sum, ReduceOp.Average):  # the executor divides for Average itself
        return stacked.sum(0)
    if op == ReduceOp.Min:
        return stacked.min(0).values
    if op == ReduceOp.Max:
        return stacked.max(0).values
    return stacked.prod(0)


class MemoryBackend(Backend):
    """A Backend for one simulated rank; counts its calls."""

    name = "memory"

    def __init__(self, rank, size, exchange, fail=False):
        super().__init__(rank, size)
        self.exchange = exchange
        self.calls = []
        self.fail = fail

    def _swap(self, call, value):
        self.calls.append(call)
        if self.fail:
            raise RuntimeError("connection reset by peer")
        return self.exchange.swap(self.rank, value)

    def allreduce(self, tensor, op):
        tensor.copy_(_reduce(self._swap("allreduce", tensor.clone()), op))

    def allgather(self, output, tensor):
        output.copy_(torch.cat(self._swap("allgather", tensor.clone())))

    def broadcast(self, tensor, root):
        tensor.copy_(self._swap("broadcast", tensor.clone())[root])

    def alltoall(self, output, tensor, output_splits, input_splits):
        sent = self._swap("alltoall", list(tensor.split(list(input_splits))))
        received = [sent[j][self.rank] for j in range(self.size)]
        assert [len(r) for r in received] == list(output_splits)
        output.copy_(torch.cat(received))

    def reducescatter(self, output, tensor, op):
        total = _reduce(self._swap("reducescatter", tensor.clone()), op)
        output.copy_(total.chunk(self.size)[self.rank])

    def barrier(self):
        self._swap("barrier", None)

    def close(self):
        pass


class AsyncMemoryBackend(MemoryBackend):
    """A MemoryBackend that also offers ``allreduce_async``: calls run in order on one thread of its own."""

    name = "async memory"

    def __init__(self, rank, size, exchange, fail=False):
        super().__init__(rank, size, exchange, fail)
        self._thread = concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix="memory-transport")

    def allreduce_async(self, tensor, op):
        future = torch.futures.Future()

        def run():
            try:
                self.allreduce(tensor, op)
                self.calls[-1] = "allreduce_async"
            except RuntimeError as exc:
                future.set_exception(exc)
            else:
                future.set_result(None)
        self._thread.submit(run)
        return future

    def close(self):
        self._thread.shutdown()


class RefusingAsyncMemoryBackend(AsyncMemoryBackend):
    """An AsyncMemoryBackend whose async call fails before it starts (its connection already gone, say)."""

    def allreduce_async(self, tensor, op):
        raise RuntimeError("connection reset by peer")


class HeldAsyncMemoryBackend(AsyncMemoryBackend):
    """An AsyncMemoryBackend whose async calls wait for ``release`` before they exchange anything."""

    def __init__(self, rank, size, exchange, fail=False):
        super().__init__(rank, size, exchange, fail)
        self.release = threading.Event()

    def allreduce_async(self, tensor, op):
        self._thread.submit(self.release.wait, TIMEOUT_S)
        return super().allreduce_async(tensor, op)



def _registry(set_id, ranks, backend):
    """The process sets of one simulated rank: the job's own and, when ``set_id`` is another, that set too."""
    registry = ProcessSetRegistry(ranks, backend)
    if set_id != 0:
        registry.add(set_id, ranks, backend)
    return registry

class Group:
    """``size`` simulated ranks, each with an Executor over one process set 0."""

    def __init__(self, size, fail=False, set_id=0, ranks=None, backend=MemoryBackend):
        exchange = Exchange(size)
        self.size = size
        self.backends = [backend(r, size, exchange, fail) for r in range(size)]
        self.transport_failures = []
        ranks = tuple(range(size)) if ranks is None else ranks
        self.executors = [Executor(_registry(set_id, ranks, backend), self.transport_failures.append,
                                   lambda: None) for backend in self.backends]

    def run(self, batch, works_by_rank):
        """Put ``batch`` on every rank with that rank's works; return each rank's handle results (or errors)."""
        for executor, works in zip(self.executors, works_by_rank):
            executor.put(batch, works)
        outcomes = []
        for works in works_by_rank:
            results = []
            for work in works:
                if work is None:
                    results.append(None)
                    continue
                try:
                    results.append(wait(work.handle))
                except Exception as exc:  # the test looks at the error
                    results.append(exc)
            outcomes.append(results)
        return outcomes

    def stop(self):
        for executor in self.executors:
            assert executor.stop(TIMEOUT_S)
        for backend in self.backends:
            backend.close()


def wait(handle):
    """``handle.wait()``, bounded by TIMEOUT_S."""
    outcome = {}

    def waiter():
        try:
            outcome["result"] = handle.wait()
        except Exception as exc:  # re-raised below, in the test's thread
            outcome["error"] = exc

    thread = threading.Thread(target=waiter, daemon=True)
    thread.start()
    thread.join(TIMEOUT_S)
    if thread.is_alive():
        pytest.fail(f"{handle.name} did not complete within {TIMEOUT_S} s")
    if "error" in outcome:
        raise outcome["error"]
    return outcome["result"]


@pytest.fixture
def group():
    """Makes Groups; stops their executors after the test."""
    made = []

    def make(size, **kwargs):
        made.append(Group(size, **kwargs))
        return made[-1]

    yield make
    for g in made:
        g.stop()


def work(request, tensor, output="in-place"):
    out = tensor if output == "in-place" else output
    return Work(request, tensor, out, Handle(request.name))


def batch_of(kind, requests, **fields):
    return Batch(kind, 0, tuple(Entry(r.name, r, **fields.get(r.name, {})) for r in requests))


# ----------------------------------------------------------------- allreduce
@pytest.mark.parametrize("op, combine", [
    (ReduceOp.Sum, lambda xs: sum(xs)), (ReduceOp.Average, lambda xs: sum(xs) / len(xs)),
    (ReduceOp.Max, lambda xs: torch.stack(xs).max(0).values), (ReduceOp.Min, lambda xs: torch.stack(xs).min(0).values),
    (ReduceOp.Product, lambda xs: torch.stack(xs).prod(0)),
], ids=["sum", "average", "max", "min", "product"])
def test_fused_allreduce_lands_each_result_in_its_own_tensor(group, op, combine):
    g = group(3)
    shapes = {"a": (2, 3), "b": (5,), "c": (1, 1, 4)}
    requests = [Request(name, OpKind.ALLREDUCE, 0, "float32", shape, reduce_op=int(op))
                for name, shape in shapes.items()]
    inputs = [{name: torch.arange(torch.Size(shape).numel(), dtype=torch.float32).reshape(shape) * (r + 1) + r
               for name, shape in shapes.items()} for r in range(3)]
    expected = {name: combine([inputs[r][name] for r in range(3)]) for name in shapes}
    tensors = [{name: t.clone() for name, t in rank_inputs.items()} for rank_inputs in inputs]
    works = [[work(q, tensors[r][q.name]) for q in requests] for r in range(3)]
    outcomes = g.run(batch_of(OpKind.ALLREDUCE, requests), works)
    for r in range(3):
        for q, result in zip(requests, outcomes[r]):
            assert result is tensors[r][q.name]  # in place: the caller's own tensor
            torch.testing.assert_close(result, expected[q.name])
    assert all(b.calls == ["allreduce"] for b in g.backends)  # one fused call


def test_allreduce_applies_prescale_before_and_postscale_after(group):
    g = group(2)
    requests = [Request(n, OpKind.ALLREDUCE, 0, "float64", (3,), reduce_op=int(ReduceOp.Average),
                        prescale=2.0, postscale=10.0) for n in ("x", "y")]
    values = [torch.tensor([1.0, 2.0, 3.0], dtype=torch.float64), torch.tensor([5.0, 6.0, 7.0], dtype=torch.float64)]
    works = [[work(q, values[r].clone() * (i + 1)) for i, q in enumerate(requests)] for r in range(2)]
    outcomes = g.run(batch_of(OpKind.ALLREDUCE, requests), works)
    base = (values[0] + values[1]) * 2.0 / 2 * 10.0
    for r in range(2):
        torch.testing.assert_close(outcomes[r][0], base)
        torch.testing.assert_close(outcomes[r][1], base * 2)


def test_integer_allreduce_average_truncates(group):
    g = group(2)
    request = Request("i", OpKind.ALLREDUCE, 0, "int64", (3,), reduce_op=int(ReduceOp.Average))
    values = [torch.tensor([1, 4, -3]), torch.tensor([2, 4, 0])]
    outcomes = g.run(batch_of(OpKind.ALLREDUCE, [request]), [[work(request, v.clone())] for v in values])
    for r in range(2):
        assert outcomes[r][0].tolist() == [1, 4, -1]


def test_allreduce_into_a_separate_output_leaves_the_input_alone(group):
    g = group(2)
    requests = [Request(n, OpKind.ALLREDUCE, 0, "float32", (2,), reduce_op=int(ReduceOp.Sum)) for n in "pq"]
    inputs = [[torch.ones(2) * (r + 1) * (i + 1) for i in range(2)] for r in range(2)]
    outputs = [[torch.full((2,), -1.0) for _ in range(2)] for _ in range(2)]
    works = [[work(q, inputs[r][i], outputs[r][i]) for i, q in enumerate(requests)] for r in range(2)]
    outcomes = g.run(batch_of(OpKind.ALLREDUCE, requests), works)
    for r in range(2):
        assert outcomes[r][0] is outputs[r][0] and outcomes[r][1] is outputs[r][1]
        assert outputs[r][0].tolist() == [3.0, 3.0] and outputs[r][1].tolist() == [6.0, 6.0]
        assert inputs[r][0].tolist() == [float(r + 1)] * 2


def test_a_non_contiguous_tensor_gets_its_result(group):
    g = group(2)
    request = Request("t", OpKind.ALLREDUCE, 0, "float32", (3, 2), reduce_op=int(ReduceOp.Sum))
    tensors = [torch.arange(6, dtype=torch.float32).reshape(2, 3).t() + r for r in range(2)]
    expected = tensors[0] + tensors[1]
    outcomes = g.run(batch_of(OpKind.ALLREDUCE, [request]), [[work(request, t)] for t in tensors])
    for r in range(2):
        assert outcomes[r][0] is tensors[r]
        torch.testing.assert_close(tensors[r], expected)


def test_a_joined_rank_contributes_zeros(group):
    g = group(3)
    requests = [Request(n, OpKind.ALLREDUCE, 0, "float32", (2,), reduce_op=int(ReduceOp.Sum)) for n in "ab"]
    batch = batch_of(OpKind.ALLREDUCE, requests)._replace(joined=(2,))
    works = [[work(q, torch.full((2,), float(r + 1))) for q in requests] for r in range(2)] + [[None, None]]
    outcomes = g.run(batch, works)
    for r in range(2):
        assert [t.tolist() for t in outcomes[r]] == [[3.0, 3.0], [3.0, 3.0]]


def test_a_single_rank_allreduce_scales_only(group):
    g = group(1)
    requests = [Request(n, OpKind.ALLREDUCE, 0, "float32", (2,), reduce_op=int(ReduceOp.Average), postscale=3.0)
                for n in "ab"]
    tensors = [torch.tensor([1.0, 2.0]), torch.tensor([4.0, 5.0])]
    [results] = g.run(batch_of(OpKind.ALLREDUCE, requests), [[work(q, t) for q, t in zip(requests, tensors)]])
    assert [t.tolist() for t in results] == [[3.0, 6.0], [12.0, 15.0]]


def test_consecutive_fused_batches_of_different_sizes_do_not_mix(group):
    g = group(2)
    for count, length in ((4, 8), (2, 3), (3, 0), (5, 1)):
        requests = [Request(f"n{i}", OpKind.ALLREDUCE, 0, "float32", (length,), reduce_op=int(ReduceOp.Sum))
                    for i in range(count)]
        tensors = [[torch.full((length,), float(i * 10 + r)) for i in range(count)] for r in range(2)]
        outcomes = g.run(batch_of(OpKind.ALLREDUCE, requests),
                         [[work(q, tensors[r][i]) for i, q in enumerate(requests)] for r in range(2)])
        for r in range(2):
            assert [t.tolist() for t in outcomes[r]] == [[float(i * 20 + 1)] * length for i in range(count)]


def test_shaped_views_cut_the_buffer_in_order_and_are_kept_for_the_same_buffer_and_shapes():
    views = ShapedViews(kept=2)
    buffer = torch.arange(20, dtype=torch.float32)
    shapes = (torch.Size([2, 3]), torch.Size([]), torch.Size([0]), torch.Size([4]))
    cut = views.of(buffer, shapes)
    assert [v.shape for v in cut] == list(shapes)
    assert [v.tolist() for v in cut] == [[[0, 1, 2], [3, 4, 5]], 6, [], [7, 8, 9, 10]]
    assert views.of(buffer[:11], shapes) is cut  # the same memory and shapes: the same views
    assert views.of(buffer, shapes[:2]) is not cut
    assert views.of(buffer.to(torch.float64), shapes) is not cut  # other memory
    other = torch.zeros(20)
    assert views.of(other, shapes)[0].data_ptr() == other.data_ptr()
    assert views.of(buffer, shapes) is not cut  # only 2 kept: forgotten when the third came
    views.clear()
    assert views.of(buffer, shapes) is not cut
    inner = views.at(buffer, 7, torch.Size([2, 2]))
    assert inner.tolist() == [[7, 8], [9, 10]] and views.at(buffer, 7, torch.Size([2, 2])) is inner
    assert views.at(buffer, 8, torch.Size([2, 2])).tolist() == [[8, 9], [10, 11]]


def test_the_same_batch_again_and_a_grown_fusion_buffer_land_every_result_in_its_own_tensor(group):
    g = group(2)
    for length in (3, 3, 50, 3):  # the views of the buffer kept, then the buffer grown and cut anew
        shapes = [(2, length), (), (0,), (length,)]
        requests = [Request(f"m{i}", OpKind.ALLREDUCE, 0, "float32", shape, reduce_op=int(ReduceOp.Sum))
                    for i, shape in enumerate(shapes)]
        tensors = [[torch.full(shape, float(i * 10 + r)) for i, shape in enumerate(shapes)] for r in range(2)]
        outputs = [[torch.full(shape, -1.0) for shape in shapes] for _ in range(2)]
        outcomes = g.run(batch_of(OpKind.ALLREDUCE, requests),
                         [[work(q, tensors[r][i], outputs[r][i]) for i, q in enumerate(requests)] for r in range(2)])
        for r in range(2):
            assert all(result is outputs[r][i] for i, result in enumerate(outcomes[r]))
            assert [t.tolist() for t in outcomes[r]] == [torch.full(shape, float(i * 20 + 1)).tolist()
                                                         for i, shape in enumerate(shapes)]


def test_fused_adasum_combines_each_tensor_separately(group):
    g = group(2)
    requests = [Request(n, OpKind.ALLREDUCE, 0, "float32", (2,), reduce_op=int(ReduceOp.Adasum)) for n in "ab"]
    inputs = [[torch.tensor([1.0, 0.0]), torch.tensor([2.0, 2.0])],   # rank 0
              [torch.tensor([0.0, 3.0]), torch.tensor([2.0, 2.0])]]   # rank 1
    outcomes = g.run(batch_of(OpKind.ALLREDUCE, requests),
                     [[work(q, inputs[r][i]) for i, q in enumerate(requests)] for r in range(2)])
    for r in range(2):
        torch.testing.assert_close(outcomes[r][0], torch.tensor([1.0, 3.0]))  # orthogonal: added
        torch.testing.assert_close(outcomes[r][1], torch.tensor([2.0, 2.0]))  # equal: averaged


def _big_and_small(ranks: int) -> tuple:
    """Requests for two tensors of OWN_CALL_BYTES and one small one, each rank's inputs, their sums."""
    big = OWN_CALL_BYTES // 4
    shapes = {"big1": (big,), "small": (3, 5), "big2": (2, big // 2)}
    requests = [Request(name, OpKind.ALLREDUCE, 0, "float32", shape, reduce_op=int(ReduceOp.Sum))
                for name, shape in shapes.items()]
    inputs = [{name: torch.full(shape, float(r + 1)) + torch.arange(torch.Size(shape).numel()).reshape(shape)
               for name, shape in shapes.items()} for r in range(ranks)]
    expected = {name: sum(inputs[r][name] for r in range(ranks)) for name in shapes}
    return requests, inputs, expected


def test_large_entries_of_a_fused_batch_are_reduced_in_their_own_memory(group):
    """On a backend that runs calls side by side, each entry of OWN_CALL_BYTES or more is its own call
    (no copy into the fusion buffer and back); the small ones are packed into one call."""
    g = group(2, backend=AsyncMemoryBackend)
    requests, inputs, expected = _big_and_small(2)
    works = [[work(q, inputs[r][q.name].clone()) for q in requests] for r in range(2)]
    outcomes = g.run(batch_of(OpKind.ALLREDUCE, requests), works)
    for r in range(2):
        for q, w, result in zip(requests, works[r], outcomes[r]):
            assert result is w.tensor
            torch.testing.assert_close(result, expected[q.name])
        assert g.backends[r].calls == ["allreduce_async"] * 3


def test_large_entries_reduced_side_by_side_are_prescaled_and_averaged(group):
    g = group(2, backend=AsyncMemoryBackend)
    big = OWN_CALL_BYTES // 8
    requests = [Request(name, OpKind.ALLREDUCE, 0, "float64", (big,), reduce_op=int(ReduceOp.Average),
                        prescale=2.0, postscale=10.0) for name in ("g1", "g2")]
    values = [[torch.full((big,), float(r + 1 + i), dtype=torch.float64) for i in range(2)] for r in range(2)]
    works = [[work(q, values[r][i].clone()) for i, q in enumerate(requests)] for r in range(2)]
    outcomes = g.run(batch_of(OpKind.ALLREDUCE, requests), works)
    for r in range(2):
        for i in range(2):
            torch.testing.assert_close(outcomes[r][i], (values[0][i] + values[1][i]) * 2.0 / 2 * 10.0)
        assert g.backends[r].calls == ["allreduce_async"] * 2


def test_a_transport_failure_of_calls_side_by_side_fails_the_handles_and_is_reported(group):
    g = group(1, fail=True, backend=AsyncMemoryBackend)
    requests, inputs, _ = _big_and_small(1)
    outcomes = g.run(batch_of(OpKind.ALLREDUCE, requests), [[work(q, inputs[0][q.name]) for q in requests]])
    assert all(isinstance(error, RoundelInternalError) for error in outcomes[0])
    assert "allreduce of 'big1', 'small', 'big2' failed in the async memory transport: connection reset by peer" \
        in str(outcomes[0][0])
    assert g.transport_failures == [outcomes[0][0]]


def test_a_large_allreduce_runs_in_the_background_while_later_batches_run(group):
    """An allreduce of OWN_CALL_BYTES or more does not hold back the next batch: while its call is still
    on the transport, a later small allreduce runs and completes; the large one completes once its call has."""
    g = group(2, backend=HeldAsyncMemoryBackend)
    count = OWN_CALL_BYTES // 4
    big = Request("big", OpKind.ALLREDUCE, 0, "float32", (count,), reduce_op=int(ReduceOp.Average),
                  postscale=10.0)
    small = Request("small", OpKind.ALLREDUCE, 0, "float32", (4,), reduce_op=int(ReduceOp.Sum))
    bigs = [work(big, torch.full((count,), float(r + 1))) for r in range(2)]
    for executor, w in zip(g.executors, bigs):
        executor.put(batch_of(OpKind.ALLREDUCE, [big]), [w])
    outcomes = g.run(batch_of(OpKind.ALLREDUCE, [small]), [[work(small, torch.ones(4))] for _ in range(2)])
    assert [torch.equal(o[0], torch.full((4,), 2.0)) for o in outcomes] == [True, True]
    assert not any(w.handle.done() for w in bigs)
    assert not any(executor.idle() for executor in g.executors)  # the coordinator still waits for it
    for backend in g.backends:
        backend.release.set()
    for r, w in enumerate(bigs):
        result = wait(w.handle)
        assert result is w.tensor
        torch.testing.assert_close(result, torch.full((count,), 1.5 * 10.0))
        assert g.backends[r].calls == ["allreduce", "allreduce_async"]
    for executor in g.executors:
        assert executor.stop(TIMEOUT_S) and executor.idle()


def test_stopping_finishes_allreduces_still_in_the_background(group):
    g = group(1, backend=HeldAsyncMemoryBackend)
    request = Request("big", OpKind.ALLREDUCE, 0, "float32", (OWN_CALL_BYTES // 4,), postscale=3.0)
    w = work(request, torch.ones(OWN_CALL_BYTES // 4))
    g.executors[0].put(batch_of(OpKind.ALLREDUCE, [request]), [w])
    g.backends[0].release.set()
    assert g.executors[0].stop(TIMEOUT_S)
    assert w.handle.done()
    torch.testing.assert_close(w.handle.wait(), torch.full((OWN_CALL_BYTES // 4,), 3.0))


@pytest.mark.parametrize("backend, fail", [(AsyncMemoryBackend, True), (RefusingAsyncMemoryBackend, False)],
                         ids=["fails_on_the_wire", "refused_at_the_start"])
def test_a_transport_failure_in_the_background_fails_the_handle_and_is_reported(group, backend, fail):
    g = group(1, fail=fail, backend=backend)
    request = Request("big", OpKind.ALLREDUCE, 0, "float32", (OWN_CALL_BYTES // 4,))
    [[error]] = g.run(batch_of(OpKind.ALLREDUCE, [request]), [[work(request, torch.ones(OWN_CALL_BYTES // 4))]])
    assert isinstance(error, RoundelInternalError)
    assert "allreduce of 'big' failed in the async memory transport: connection reset by peer" in str(error)
    assert g.transport_failures == [error]
    assert g.executors[0].idle()


# ----------------------------------------------------------------- broadcast
def test_fused_broadcast_uses_the_root_s_values(group):
    g = group(3)
    requests = [Request(n, OpKind.BROADCAST, 0, "int32", (2,), root_rank=1) for n in "xy"]
    tensors = [[torch.full((2,), 10 * r + i, dtype=torch.int32) for i in range(2)] for r in range(3)]
    outcomes = g.run(batch_of(OpKind.BROADCAST, requests),
                     [[work(q, tensors[r][i]) for i, q in enumerate(requests)] for r in range(3)])
    for r in range(3):
        assert [t.tolist() for t in outcomes[r]] == [[10, 10], [11, 11]]
        assert outcomes[r][1] is tensors[r][1]


def test_broadcast_root_is_a_global_rank_of_the_process_set(group):
    g = group(2, set_id=7, ranks=(3, 5))
    request = Request("w", OpKind.BROADCAST, 7, "float32", (3,), root_rank=5)
    tensors = [torch.zeros(3), torch.tensor([1.0, 2.0, 3.0])]
    outcomes = g.run(Batch(OpKind.BROADCAST, 7, (Entry("w", request),)), [[work(request, t)] for t in tensors])
    assert outcomes[0][0].tolist() == outcomes[1][0].tolist() == [1.0, 2.0, 3.0]


# ----------------------------------------------------------------- allgather
def test_fused_allgather_with_differing_first_dimensions(group):
    g = group(3)
    first = {"u": (2, 0, 3), "v": (1, 4, 2)}
    requests = {r: [Request(n, OpKind.ALLGATHER, 0, "float32", (first[n][r], 2)) for n in ("u", "v")]
                for r in range(3)}
    inputs = {r: {n: torch.full((first[n][r], 2), float(10 * r + (n == "v"))) for n in first} for r in range(3)}
    batch = Batch(OpKind.ALLGATHER, 0, tuple(Entry(n, requests[0][i], first_dims=first[n])
                                             for i, n in enumerate(("u", "v"))))
    works = [[work(q, inputs[r][q.name], None) for q in requests[r]] for r in range(3)]
    outcomes = g.run(batch, works)
    expected = {n: torch.cat([inputs[r][n] for r in range(3)]) for n in first}
    for r in range(3):
        assert outcomes[r][0].shape == (5, 2) and outcomes[r][1].shape == (7, 2)
        torch.testing.assert_close(outcomes[r][0], expected["u"])
        torch.testing.assert_close(outcomes[r][1], expected["v"])
    assert all(b.calls == ["allgather"] for b in g.backends)


def test_allgather_of_scalars_rows(group):
    g = group(2)
    requests = [Request("s", OpKind.ALLGATHER, 0, "int64", (r + 1,)) for r in range(2)]
    batch = Batch(OpKind.ALLGATHER, 0, (Entry("s", requests[0], first_dims=(1, 2)),))
    outcomes = g.run(batch, [[work(requests[r], torch.arange(r + 1) + 100 * r, None)] for r in range(2)])
    assert outcomes[0][0].tolist() == outcomes[1][0].tolist() == [0, 100, 101]


def test_allgather_where_no_rank_has_rows(group):
    g = group(2)
    request = Request("e", OpKind.ALLGATHER, 0, "float32", (0, 3))
    batch = Batch(OpKind.ALLGATHER, 0, (Entry("e", request, first_dims=(0, 0)),))
    outcomes = g.run(batch, [[work(request, torch.empty(0, 3), None)] for _ in range(2)])
    assert outcomes[0][0].shape == outcomes[1][0].shape == (0, 3)


# ------------------------------------------------------------------ alltoall
def test_alltoall_sends_each_rank_its_rows_and_returns_the_received_splits(group):
    g = group(3)
    splits = ((1, 0, 2), (2, 2, 0), (0, 0, 0))  # row per sender; rank 2 sends nothing
    requests = [Request("a2a", OpKind.ALLTOALL, 0, "float32", (sum(splits[r]), 2), splits=splits[r])
                for r in range(3)]
    inputs = [torch.arange(sum(splits[r]) * 2, dtype=torch.float32).reshape(-1, 2) + 100 * r for r in range(3)]
    batch = Batch(OpKind.ALLTOALL, 0, (Entry("a2a", requests[0], splits=splits),))
    outcomes = g.run(batch, [[work(requests[r], inputs[r], None)] for r in range(3)])
    for me in range(3):
        output, received = outcomes[me][0]
        assert received.tolist() == [splits[j][me] for j in range(3)]
        parts = []
        for j in range(3):
            start = sum(splits[j][:me])
            parts.append(inputs[j][start:start + splits[j][me]])
        torch.testing.assert_close(output, torch.cat(parts))


# ------------------------------------------------------------- reducescatter
@pytest.mark.parametrize("op", [ReduceOp.Sum, ReduceOp.Average])
@pytest.mark.parametrize("rows, bounds", [(5, [(0, 2), (2, 4), (4, 5)]), (2, [(0, 1), (1, 2), (2, 2)])])
def test_reducescatter_splits_uneven_first_dimensions_with_scaling(group, op, rows, bounds):
    g = group(3)
    request = Request("rs", OpKind.REDUCESCATTER, 0, "float32", (rows, 2), reduce_op=int(op), postscale=2.0)
    inputs = [torch.arange(rows * 2, dtype=torch.float32).reshape(rows, 2) * (r + 1) for r in range(3)]
    total = (inputs[0] + inputs[1] + inputs[2]) * 2.0 / (3 if op == ReduceOp.Average else 1)
    outcomes = g.run(batch_of(OpKind.REDUCESCATTER, [request]), [[work(request, t, None)] for t in inputs])
    for r, (start, stop) in enumerate(bounds):  # the first rows % size ranks get one row more
        torch.testing.assert_close(outcomes[r][0], total[start:stop])


# ------------------------------------------------------- control and errors
@pytest.mark.parametrize("error_type, exc_type", [
    ("mismatch", CollectiveMismatchError), ("deadlock", CollectiveDeadlockError), ("internal", RoundelInternalError),
])
def test_a_failed_batch_raises_its_error_type_on_every_handle(group, error_type, exc_type):
    g = group(1)
    requests = [Request(n, OpKind.ALLREDUCE, 0, "float32", (1,)) for n in "ab"]
    batch = batch_of(OpKind.ALLREDUCE, requests)._replace(error="shapes differ", error_type=error_type)
    [results] = g.run(batch, [[work(q, torch.ones(1)) for q in requests]])
    assert all(type(e) is exc_type and str(e) == "shapes differ" for e in results)
    assert g.backends[0].calls == []


def test_barrier_and_join_results(group):
    g = group(2)
    barrier = Request("__barrier__", OpKind.BARRIER, 0)
    assert g.run(Batch(OpKind.BARRIER, 0, (Entry(barrier.name, barrier),)),
                 [[work(barrier, None)] for _ in range(2)]) == [[None], [None]]
    join = Request("__join__", OpKind.JOIN, 0)
    batch = Batch(OpKind.JOIN, 0, (Entry(join.name, join),), joined=(1, 0), last_joined=0)
    assert g.run(batch, [[work(join, None)] for _ in range(2)]) == [[0], [0]]


def test_a_transport_failure_fails_the_handles_and_is_reported(group):
    g = group(1, fail=True)
    request = Request("t", OpKind.ALLREDUCE, 0, "float32", (2,))
    [[error]] = g.run(batch_of(OpKind.ALLREDUCE, [request]), [[work(request, torch.ones(2))]])
    assert isinstance(error, RoundelInternalError)
    assert "allreduce of 't' failed in the memory transport: connection reset by peer" in str(error)
    assert g.transport_failures == [error]


class HeldMemoryBackend(MemoryBackend):
    """A MemoryBackend whose allreduce waits for ``release`` first (the executor's thread is busy meanwhile)."""

    def __init__(self, rank, size, exchange, fail=False):
        super().__init__(rank, size, exchange, fail)
        self.release = threading.Event()

    def allreduce(self, tensor, op):
        self.release.wait(TIMEOUT_S)
        super().allreduce(tensor, op)


def test_an_abort_completes_the_batches_whose_outcome_came_with_them_at_once(group, tmp_path):
    """Rank 0 sends a small allreduce it reduced itself, then exits: this rank reads its result, then the
    closed connection, which aborts the executor while the result is still queued behind a running batch.
    The result is in hand, so its handle completes, at once, not after the running transfer (which may be
    stuck on a peer that stopped): the job's last allreduce returned on rank 0 alone before. Its timeline
    span ends too."""
    g = group(1, backend=HeldMemoryBackend)
    backend, timeline = g.backends[0], Timeline()
    timeline.start(str(tmp_path / "timeline.json"))
    assert g.executors[0].stop(TIMEOUT_S)  # replaced by one that records the timeline
    executor = g.executors[0] = Executor(_registry(0, (0,), backend), g.transport_failures.append, lambda: None,
                                         timeline)
    running = Request("running", OpKind.ALLREDUCE, 0, "float32", (2,))
    reduced = Request("reduced", OpKind.ALLREDUCE, 0, "float32", (2,))
    failed = Request("failed", OpKind.ALLREDUCE, 0, "float32", (2,))
    busy, result, refused = (work(r, torch.ones(2)) for r in (running, reduced, failed))
    executor.put(batch_of(OpKind.ALLREDUCE, [running]), [busy])
    executor.put(batch_of(OpKind.ALLREDUCE, [reduced])._replace(reduced=torch.tensor([3.0, 4.0]).numpy().tobytes()),
                 [result])
    executor.put(batch_of(OpKind.ALLREDUCE, [failed])._replace(error="shapes differ"), [refused])
    executor.abort(RoundelInternalError("lost the connection to rank 0"))
    assert busy.handle.done() and result.handle.done() and refused.handle.done()
    timeline.stop()
    events = json.loads((tmp_path / "timeline.json").read_text())
    rows = {e["args"]["name"]: e["pid"] for e in events if e.get("name") == "process_name"}
    for row in ("allreduce.reduced", "allreduce.failed"):
        phases = [e["ph"] for e in events if e.get("pid") == rows[row] and e["ph"] in "BE"]
        assert phases.count("B") == phases.count("E") > 0, (row, phases)
    torch.testing.assert_close(wait(result.handle), torch.tensor([3.0, 4.0]))
    with pytest.raises(CollectiveMismatchError, match="shapes differ"):
        wait(refused.handle)
    with pytest.raises(RoundelInternalError, match="lost the connection"):
        wait(busy.handle)
    backend.release.set()
    assert executor.stop(TIMEOUT_S) and executor.idle()  # the queued batches are passed over
