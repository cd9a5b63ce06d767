"""roundel.transport.peer_links: the members' own TCP links, on real sockets through a real c10d store.

The members run as threads of this process here (the links do not care); the
job-level tests with ``ROUNDEL_SHARED_MEMORY=0`` (test_steady_replay.py,
test_shared_memory.py, the multi-host tests) run them under the launcher.
"""

from __future__ import annotations

import contextlib
import functools
import itertools
import json
import socket
import struct
import threading
import time
import warnings
from datetime import timedelta

import pytest
import torch
import torch.distributed as dist

from roundel.ops import ReduceOp
from roundel.transport.gloo import GlooBackend
from roundel.transport.peer_links import PeerLinks


_CONNECTIONS = 8  # handed out in turn; a test takes at most 7: no two of its members share one
_calls, _handed = itertools.count(), itertools.count()


@functools.cache
def _server_and_connections() -> tuple:
    """One TCPStore server and ``_CONNECTIONS`` client connections to it, for the whole module.

    Opening new connections for every test made this file take three times as long (22.6 s against 7.3 s on
    a 2-core machine), so the tests share these and keep apart by prefix.
    """
    master = dist.TCPStore("127.0.0.1", 0, None, True, timeout=timedelta(seconds=30), wait_for_workers=False)
    return master, [dist.TCPStore("127.0.0.1", master.port, None, False, timeout=timedelta(seconds=30))
                    for _ in range(_CONNECTIONS)]


def _store(size: int):
    """The server and one store per member: a connection of its own under a prefix no other call uses."""
    master, connections = _server_and_connections()
    call = next(_calls)
    return master, [dist.PrefixStore(f"call{call}/", connections[next(_handed) % _CONNECTIONS])
                    for _ in range(size)]


def _together(size: int, make, timeout: float = 30.0) -> list:
    """``make(rank)`` on ``size`` threads at once; their results in rank order (raises the first error)."""
    results: list = [None] * size
    errors: list = []

    def run(rank):
        try:
            results[rank] = make(rank)
        except BaseException as exc:  # handed to the test
            errors.append(exc)

    threads = [threading.Thread(target=run, args=(r,), daemon=True) for r in range(size)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout)
    assert not any(t.is_alive() for t in threads), "a member hung"
    if errors:
        raise errors[0]
    return results


def _linked(size: int, timeout_s: float = 10.0) -> list:
    _, stores = _store(size)
    return _together(size, lambda r: PeerLinks(stores[r], r, size, "127.0.0.1", timeout_s))


@pytest.mark.parametrize("size", [2, 3, 4, 5, 8])
def test_allgather_fills_every_members_row(size):
    links = _linked(size)
    sent: list = []  # each member's sends per call: n - 1 at once, or log2(n) by recursive doubling
    for one in links:
        one.exchange = lambda sends, receives, real=one.exchange: sent.append(len(sends)) or real(sends, receives)
    try:
        def gather(rank):
            rows = torch.zeros((size, 3000))
            rows[rank] = torch.arange(3000) + 10_000 * rank
            links[rank].allgather(rows)
            return rows
        for _ in range(3):  # the links are reused call after call
            for rows in _together(size, gather):
                assert torch.equal(rows, torch.stack([torch.arange(3000) + 10_000.0 * r for r in range(size)]))
        doubling = size in (4, 8)
        assert sorted(sent) == sorted(([1] * (size.bit_length() - 1) if doubling else [size - 1]) * size * 3), sent
        empty = _together(size, lambda r: links[r].allgather(torch.zeros((size, 0))))  # returns at once
        assert empty == [None] * size
    finally:
        for one in links:
            one.close()


def _expected(inputs: list, op) -> torch.Tensor:
    """The members' ``inputs`` combined in rank order."""
    expected = inputs[0].clone()
    for other in inputs[1:]:
        if op == ReduceOp.Sum:
            expected = expected + other if expected.dtype != torch.bool else expected | other
        elif op == ReduceOp.Product:
            expected = expected * other if expected.dtype != torch.bool else expected & other
        elif op == ReduceOp.Min:
            expected = torch.minimum(expected, other)
        else:
            expected = torch.maximum(expected, other)
    return expected


def _backends(size: int, **options) -> list:
    _, stores = _store(size)
    return _together(size, lambda r: GlooBackend(stores[r], r, size, 20.0, "127.0.0.1", **options))


@contextlib.contextmanager
def _gloo_backends(size: int):
    """``size`` linked Gloo backends, closed afterwards."""
    backends = _backends(size)
    try:
        yield backends
    finally:
        for backend in backends:
            backend.close()


def _count_exchanges(backends: list) -> list:
    """The length of each exchange any of ``backends``' links makes from now on (one entry per member's call)."""
    calls: list = []
    for backend in backends:
        links = backend._links
        links.exchange = lambda sends, receives, real=links.exchange: (
            calls.append(sum(len(view) for view in receives.values())) or real(sends, receives))
    return calls


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16, torch.int16, torch.int64,
                                   torch.bool])
@pytest.mark.parametrize("op", [ReduceOp.Sum, ReduceOp.Min, ReduceOp.Max, ReduceOp.Product])
@pytest.mark.parametrize("size", [2, 3, 4])
def test_gloo_backend_reduces_small_tensors_on_the_links_alike_on_every_member(dtype, op, size):
    with _gloo_backends(size) as backends:
        assert backends[0].carrier("allreduce") == "gloo+links"
        for call in range(2):  # the second call reuses what the first set up for this dtype and size
            inputs = [(torch.arange(1, 601) % 7 + r + call).to(dtype).reshape(20, 30) for r in range(size)]
            expected = _expected(inputs, op)

            def reduce(rank):
                tensor = inputs[rank].clone().t()  # not contiguous: reduced in a copy, written back
                backends[rank].allreduce(tensor, op)
                return tensor.t()
            for result in _together(size, reduce):
                assert torch.equal(result, expected), (call, result, expected)


@pytest.mark.parametrize("size", [4, 8])
def test_a_small_sum_among_a_power_of_two_members_is_pairwise_with_one_partner_a_round(size):
    """Recursive doubling: log2(size) exchanges with one partner each; every member gets the same bits, those of
    the pairwise sum (lower ranks' partial first)."""
    generator = torch.Generator().manual_seed(size)
    inputs = [torch.randn(5, generator=generator) * 10 ** r for r in range(size)]  # far from associative
    pairs = list(inputs)
    while len(pairs) > 1:
        pairs = [pairs[i] + pairs[i + 1] for i in range(0, len(pairs), 2)]
    with _gloo_backends(size) as backends:
        calls = _count_exchanges(backends)

        def reduce(rank):
            tensor = inputs[rank].clone()
            backends[rank].allreduce(tensor, ReduceOp.Sum)
            return tensor
        results = _together(size, reduce)
    assert calls == [4 * 5] * (size * (size.bit_length() - 1)), calls  # one partner's 5 float32 per exchange
    for result in results:
        assert torch.equal(result, pairs[0]), (result, pairs[0])


def test_a_member_gone_mid_doubling_fails_every_member_at_once():
    """Member 3 closes its links: member 2, its first partner, fails and closes its own, so that members 0 and 1,
    whose second-round partners are 2 and 3, fail at once too instead of waiting out the 20 s timeout."""
    with _gloo_backends(4) as backends:
        backends[3]._links.close()
        started = time.monotonic()

        def reduce(rank):
            with pytest.raises(RuntimeError, match=r"rank \d closed its link to rank \d"):
                backends[rank].allreduce(torch.ones(3), ReduceOp.Sum)
            return time.monotonic() - started
        assert max(_together(3, reduce)) < 5


def test_a_conjugate_view_is_reduced_in_place_on_the_links():
    with _gloo_backends(2) as backends:
        def reduce(rank):
            values = torch.tensor([1 + 2j, -3 + 0.5j], dtype=torch.complex64) * (rank + 1)
            view = values.conj()  # torch's lazy conjugate: no NumPy view of it
            backends[rank].allreduce(view, ReduceOp.Sum)
            return view.clone(), values
        for view, values in _together(2, reduce):
            assert view.tolist() == [3 - 6j, -9 - 1.5j], view
            assert values.tolist() == [3 + 6j, -9 + 1.5j], values  # the view's storage holds the conjugate


def test_a_sum_that_overflows_on_the_links_is_inf_without_a_warning():
    with _gloo_backends(2) as backends:
        def reduce(rank):
            tensor = torch.tensor([60000.0, 1.0, -60000.0], dtype=torch.float16)
            with warnings.catch_warnings():
                warnings.simplefilter("error")  # NumPy's overflow warning would fail the call
                backends[rank].allreduce(tensor, ReduceOp.Sum)
            return tensor
        for result in _together(2, reduce):
            assert result.tolist() == [float("inf"), 2.0, float("-inf")], result


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.int16, torch.bool])
@pytest.mark.parametrize("op", [ReduceOp.Sum, ReduceOp.Min, ReduceOp.Max, ReduceOp.Product])
def test_gloo_backend_reduces_larger_tensors_part_by_part_on_the_links(dtype, op):
    """Above LINK_BYTES each member combines the part it owns and sends it back: 300,001 elements (parts of
    unequal length) come out the same, bit for bit, on every member, and as expected."""
    size = 3
    backends = _backends(size)
    try:
        calls = _count_exchanges(backends)
        inputs = [((torch.arange(300_001) * (r + 1)) % 5 + r).to(dtype) for r in range(size)]
        results = _together(size, lambda r: backends[r].allreduce(t := inputs[r].clone(), op) or t)
        expected = _expected(inputs, op)
        for result in results:
            assert torch.equal(result, results[0])
            if dtype.is_floating_point:  # a part's copies are combined by its owner, own copy first
                torch.testing.assert_close(result, expected, rtol=1e-2, atol=0)
            else:
                assert torch.equal(result, expected)
        assert len(calls) == 2 * size, calls  # two exchanges a member
    finally:
        for backend in backends:
            backend.close()


def test_which_allreduces_take_the_links_and_turning_them_off():
    """Two members: every allreduce takes the links; three: up to SCATTER_BYTES; with the links off,
    everything goes through Gloo."""
    pair, trio = _backends(2), _backends(3)
    try:
        on_pair, on_trio = _count_exchanges(pair), _count_exchanges(trio)
        big = 5 * 1024 * 1024 // 4 + 3  # just above SCATTER_BYTES in float32
        for backends, on_links in ((pair, on_pair), (trio, on_trio)):
            size = len(backends)
            results = _together(size, lambda r: backends[r].allreduce(t := torch.full((big,), r + 1.0),
                                                                       ReduceOp.Sum) or t)
            assert all(torch.equal(t, torch.full((big,), size * (size + 1) / 2)) for t in results)
            assert len(on_links) == (2 * size if size == 2 else 0), on_links
            on_links.clear()
        # the way is chosen from the size alone, alike on every member: a tensor one member passes transposed
        # goes the same way as the other's contiguous one, and a call that does not block as a call that does
        mixed = _together(2, lambda r: pair[r].allreduce(
            t := (torch.full((400, 400), r + 1.0).t() if r else torch.full((400, 400), r + 1.0)), ReduceOp.Max) or t)
        assert all(torch.equal(t, torch.full((400, 400), 2.0)) for t in mixed) and len(on_pair) == 4, on_pair
        on_pair.clear()

        def blocking_or_not(rank):
            tensor = torch.full((400_000,), rank + 1.0)
            if rank:
                pair[rank].allreduce_async(tensor, ReduceOp.Sum).wait()
            else:
                pair[rank].allreduce(tensor, ReduceOp.Sum)
            return tensor
        assert all(torch.equal(t, torch.full((400_000,), 3.0)) for t in _together(2, blocking_or_not))
        assert len(on_pair) == 4, on_pair
        on_pair.clear()
        _together(2, lambda r: pair[r].allreduce(torch.ones(5), ReduceOp.Sum))
        assert on_pair == [20] * 2, on_pair  # a small one: one exchange, the peer's 5 floats
        off = _backends(2, peer_links=False)
        assert off[0].carrier("allreduce") == "gloo" and off[0]._links is None
        small = _together(2, lambda r: off[r].allreduce(t := torch.full((5,), r + 1.0), ReduceOp.Sum) or t)
        assert all(torch.equal(t, torch.full((5,), 3.0)) for t in small)
        for backend in off:
            backend.close()
    finally:
        for backend in (*pair, *trio):
            backend.close()


_GATHERED_DTYPES = (torch.bool, torch.uint8, torch.int8, torch.int16, torch.int32, torch.int64, torch.float16,
                    torch.bfloat16, torch.float32, torch.float64, torch.complex64, torch.complex128)


@pytest.mark.parametrize("size", [2, 4])
def test_gloo_backend_allgathers_every_dtype_on_the_links_through_numpy_where_it_can(size):
    """Every dtype gathers bit for bit; those NumPy views (not bfloat16, nor a conjugate view) skip the links'
    torch entry (``PeerLinks.allgather``) for their NumPy one, and a non-contiguous input takes the torch one."""
    with _gloo_backends(size) as backends:
        torch_entries: list = []
        for backend in backends:
            links = backend._links
            links.allgather = lambda rows, real=links.allgather: torch_entries.append(rows.dtype) or real(rows)

        def gather(inputs: list) -> list:
            return _together(size, lambda r: backends[r].allgather(
                out := torch.empty((size * inputs[r].shape[0],) + inputs[r].shape[1:], dtype=inputs[r].dtype),
                inputs[r]) or out)

        for dtype in _GATHERED_DTYPES:
            inputs = [(torch.arange(-5, 6) * (r + 1)).to(dtype) for r in range(size)]
            for out in gather(inputs):
                assert torch.equal(out, torch.cat(inputs)), dtype
        assert torch_entries == [torch.bfloat16] * size, torch_entries
        torch_entries.clear()
        conjugates = [torch.complex(torch.arange(3.0), torch.full((3,), float(r))).conj() for r in range(size)]
        transposed = [torch.arange(6.0).view(2, 3).t() + r for r in range(size)]
        for inputs in (conjugates, transposed):
            for out in gather(inputs):
                assert torch.equal(out, torch.cat([t.resolve_conj() for t in inputs])), inputs[0]
        assert len(torch_entries) == 2 * size, torch_entries


@pytest.mark.parametrize("size", [2, 3, 4])
def test_gloo_backend_broadcasts_and_allgathers_on_the_links(size):
    """From every root, in a dtype Gloo widens (int16) and one it keeps; a tensor too large for 3 members' links
    goes through Gloo, with the same results; a transposed one takes the links as a contiguous one does."""
    backends = _backends(size)
    try:
        calls = _count_exchanges(backends)
        assert backends[0].carrier("broadcast") == backends[0].carrier("allgather") == "gloo+links"
        for dtype in (torch.float32, torch.int16):
            for root in range(size):
                results = _together(size, lambda r: backends[r].broadcast(
                    t := torch.full((1000,), 10 * r + 1).to(dtype), root) or t)
                assert all(torch.equal(t, torch.full((1000,), 10 * root + 1).to(dtype)) for t in results)
            gathered = _together(size, lambda r: backends[r].allgather(
                out := torch.empty((size, 700), dtype=dtype), torch.arange(700).to(dtype) + r) or out)
            expected = torch.stack([torch.arange(700).to(dtype) + r for r in range(size)])
            assert all(torch.equal(out, expected) for out in gathered)
        per_allgather = 2 if size == 4 else 1  # by recursive doubling among 4: two exchanges, one partner each
        assert len(calls) == 2 * (size + per_allgather) * size, calls  # every member, every call above
        # an empty tensor (as torch may make one, with a stride of 0) moves nothing, and fails nothing
        empty = _together(size, lambda r: backends[r].broadcast(t := torch.empty_strided((0,), (0,)), 0) or t)
        assert all(t.shape == (0,) for t in empty)
        calls.clear()
        big = 5 * 1024 * 1024 // 4  # 5 MiB of float32: within the links for 2 members only
        results = _together(size, lambda r: backends[r].broadcast(t := torch.full((big,), float(r)), size - 1) or t)
        assert all(torch.equal(t, torch.full((big,), float(size - 1))) for t in results)
        assert len(calls) == (size if size == 2 else 0), calls
        calls.clear()
        strided = _together(size, lambda r: backends[r].broadcast(
            t := torch.full((50, 40), float(r)).t() if r % 2 else torch.full((40, 50), float(r)), 0) or t)
        assert all(torch.equal(t, torch.zeros((40, 50))) for t in strided)
        assert len(calls) == size, calls  # the transposed tensors too, through a contiguous copy
    finally:
        for backend in backends:
            backend.close()


def test_a_connection_without_the_token_is_refused_and_linking_goes_on():
    _, stores = _store(2)
    rogue_answer: list = []

    def rogue():
        host, port, _ = json.loads(stores[0].get("roundel_peer_links/0"))
        with socket.create_connection((host, port), timeout=5) as sock:
            sock.sendall(struct.pack("!I32s", 1, b"x" * 32))  # claims rank 1, without rank 0's token
            rogue_answer.append(sock.recv(64))  # b"": closed without a word

    def member(rank):
        if rank == 1:
            stores[1].wait(["roundel_peer_links/0"])
            rogue()  # first, so that rank 0 sees it before rank 1's real link
            silent = socket.create_connection(tuple(json.loads(stores[0].get("roundel_peer_links/0"))[:2]))
            links = PeerLinks(stores[1], 1, 2, "127.0.0.1", 10.0)
            silent.close()  # held open while rank 0 linked: a silent connection blocks nothing
            return links
        return PeerLinks(stores[0], 0, 2, "127.0.0.1", 10.0)

    links = _together(2, member)
    try:
        assert rogue_answer == [b""]
        rows = _together(2, lambda r: links[r].allgather(x := torch.full((2, 4), float(r))) or x)
        assert all(torch.equal(x[r], torch.full((4,), float(r))) for x in rows for r in range(2))
    finally:
        for one in links:
            one.close()


def test_a_member_that_never_comes_is_named_after_the_timeout():
    _, stores = _store(3)
    started = time.monotonic()
    with pytest.raises(RuntimeError, match=r"rank\(s\) 2 did not link to rank [01] within 1 s"):
        _together(2, lambda r: PeerLinks(stores[r], r, 3, "127.0.0.1", 1.0))
    assert time.monotonic() - started < 10


def test_a_peer_that_closes_or_stays_silent_fails_the_call_and_every_later_one():
    links = _linked(2, timeout_s=1.0)
    rows = torch.zeros((2, 8))
    started = time.monotonic()
    with pytest.raises(RuntimeError, match=r"rank\(s\) 1 sent nothing to rank 0 for 1 s"):
        links[0].allgather(rows)  # rank 1 never calls
    assert time.monotonic() - started < 5
    with pytest.raises(RuntimeError, match="sent nothing"):
        links[0].allgather(rows)  # broken for good: the streams are out of step
    links[0].close()

    links = _linked(2, timeout_s=30.0)
    threading.Timer(0.3, links[1].close).start()
    started = time.monotonic()
    with pytest.raises(RuntimeError, match="rank 1 closed its link to rank 0"):
        links[0].allgather(torch.zeros((2, 8)))
    assert time.monotonic() - started < 5
    links[0].close()
