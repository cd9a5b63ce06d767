"""roundel.transport.peer_links: the members' own TCP links, on real sockets through a real c10d store.

The members run as threads of this process here (the links do not care); the
job-level tests with ``ROUNDEL_SHARED_MEMORY=0`` (test_steady_replay.py,
test_shared_memory.py, the multi-host tests) run them under the launcher.
"""

from __future__ import annotations

import json
import socket
import struct
import threading
import time
from datetime import timedelta

import pytest
import torch
import torch.distributed as dist

from roundel.ops import ReduceOp
from roundel.transport.gloo import GlooBackend
from roundel.transport.peer_links import PeerLinks


def _store(size: int):
    master = dist.TCPStore("127.0.0.1", 0, size + 1, True, timeout=timedelta(seconds=30), wait_for_workers=False)
    return master, [dist.TCPStore("127.0.0.1", master.port, size + 1, False, timeout=timedelta(seconds=30))
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


@pytest.mark.parametrize("size", [2, 3, 5])
def test_allgather_fills_every_members_row(size):
    links = _linked(size)
    try:
        def gather(rank):
            rows = torch.zeros((size, 3000))
            rows[rank] = torch.arange(3000) + 10_000 * rank
            links[rank].allgather(rows)
            return rows
        for _ in range(3):  # the links are reused call after call
            for rows in _together(size, gather):
                assert torch.equal(rows, torch.stack([torch.arange(3000) + 10_000.0 * r for r in range(size)]))
        empty = _together(size, lambda r: links[r].allgather(torch.zeros((size, 0))))  # returns at once
        assert empty == [None] * size
    finally:
        for one in links:
            one.close()


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16, torch.int16, torch.int64,
                                   torch.bool])
@pytest.mark.parametrize("op", [ReduceOp.Sum, ReduceOp.Min, ReduceOp.Max, ReduceOp.Product])
def test_gloo_backend_reduces_small_tensors_on_the_links_alike_on_every_member(dtype, op):
    size = 3
    _, stores = _store(size)
    backends = _together(size, lambda r: GlooBackend(stores[r], r, size, 20.0, "127.0.0.1"))
    try:
        assert backends[0].carrier("allreduce") == "gloo+links"
        inputs = [(torch.arange(1, 601) % 7 + r).to(dtype).reshape(20, 30) for r in range(size)]
        expected = inputs[0].clone()
        for other in inputs[1:]:
            if op == ReduceOp.Sum:
                expected = expected + other if dtype != torch.bool else expected | other
            elif op == ReduceOp.Product:
                expected = expected * other if dtype != torch.bool else expected & other
            elif op == ReduceOp.Min:
                expected = torch.minimum(expected, other)
            else:
                expected = torch.maximum(expected, other)

        def reduce(rank):
            tensor = inputs[rank].clone().t()  # not contiguous: reduced in a copy, written back
            backends[rank].allreduce(tensor, op)
            return tensor.t()
        for result in _together(size, reduce):
            assert torch.equal(result, expected), (result, expected)
    finally:
        for backend in backends:
            backend.close()


def test_large_tensors_stay_in_gloo_and_links_can_be_turned_off():
    size = 2
    _, stores = _store(size)
    backends = _together(size, lambda r: GlooBackend(stores[r], r, size, 20.0, "127.0.0.1"))
    try:
        _, stores = _store(size)
        off = _together(size, lambda r: GlooBackend(stores[r], r, size, 20.0, "127.0.0.1", peer_links=False))
        on_links: list = []
        for backend in backends:
            links = backend._links
            links.allgather = lambda rows, gather=links.allgather: on_links.append(rows.shape) or gather(rows)
        big = _together(size, lambda r: backends[r].allreduce(t := torch.full((300_000,), r + 1.0), ReduceOp.Sum)
                        or t)
        assert all(torch.equal(t, torch.full((300_000,), 3.0)) for t in big)
        assert on_links == [], on_links  # 1.2 MB: Gloo's ring
        _together(size, lambda r: backends[r].allreduce(torch.ones(5), ReduceOp.Sum))
        assert on_links == [(2, 5)] * size, on_links  # and a small one on the links
        assert off[0].carrier("allreduce") == "gloo"
        small = _together(size, lambda r: off[r].allreduce(t := torch.full((5,), r + 1.0), ReduceOp.Sum) or t)
        assert all(torch.equal(t, torch.full((5,), 3.0)) for t in small)
        for backend in off:
            backend.close()
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
