"""Relays: one rank per host carries its host's control messages to rank 0 (``roundel.common.engine.relay``).

The first tests drive a real ``Relay`` (its listener, authenticated
connections, codec) from this process, with children that connect to it as
ranks do. The others run real jobs under ``roundelrun`` with relays forced on
(``ROUNDEL_RELAY_FROM_RANKS=2``) over loopback "hosts", so that ranks reach
rank 0 through one relay, or through a chain of them (``ROUNDEL_RELAY_FANOUT=1``):
the collectives, process sets, join, mismatches, stalls, deadlocks, a killed
relay, a stopped rank behind a relay, the timeline and an elastic job whose
relay fails behave as without relays.
"""

from __future__ import annotations

import json
import os
import random
import selectors
import time
from collections import Counter

import pytest

from elastic_util import ElasticJob, check_training
from launch_util import WORKERS_DIR, assert_checks_passed, describe, rank_lines, run_job
from roundel.common.control import channel as control_channel, codec as control_codec
from roundel.common.control.messages import (Abort, Bye, Deliver, Heartbeat, Joined, Lost, Merged, Relayed, Submit,
                                              Waits)
from roundel.common.engine import relay as relays
from roundel.common.engine.negotiation import Negotiator
from roundel.common.control.records import OpKind, Request

SECRET = os.urandom(32)


# ------------------------------------------------------------------ the relay in this process
class _Harness:
    """A relay of rank 2 in a job of 8, with children that connect as ranks 3.. do."""

    def __init__(self, hold_s: float = 0.05, **options):
        self.selector = selectors.DefaultSelector()
        self.up: list = []
        self.relay = relays.Relay(2, 8, SECRET, "127.0.0.1", self.selector, self.up.append, lambda: None,
                                  hold_s, 30.0, "relay-host", **options)
        self.children: dict[int, control_channel.Connection] = {}
        self.readers: dict[int, control_channel.FrameReader] = {}

    def connect(self, rank: int) -> None:
        connection = control_channel.connect("127.0.0.1", self.relay.listener.port, SECRET, rank, 10.0)
        connection._sock.setblocking(True)
        connection._sock.settimeout(10.0)
        self.children[rank] = connection
        self.readers[rank] = control_channel.FrameReader(connection)
        self.pump(lambda: self.relay.children >= len(self.children))

    def pump(self, until, seconds: float = 5.0) -> None:
        """Run the relay's side of the engine loop until ``until()`` holds."""
        deadline = time.monotonic() + seconds
        while not until():
            assert time.monotonic() < deadline, f"gave up waiting; sent up so far: {self.up}"
            for key, events in self.selector.select(0.01):
                self.relay.serve(key.data[1], events)
            self.relay.poll(time.monotonic())

    def read(self, rank: int) -> list:
        """The messages child ``rank`` has received (waits for the first)."""
        found: list = []
        while not found:
            found = self.readers[rank].feed(self.children[rank].recv(65536))
        return found

    def sent_up(self, kind) -> list:
        return [message for message in self.up if type(message) is kind]

    def close(self) -> None:
        for connection in self.children.values():
            connection.close()
        self.relay.close(time.monotonic())


@pytest.fixture
def harness():
    made = _Harness()
    yield made
    made.close()


def test_a_relay_announces_its_children_and_merges_their_steady_submissions_with_its_own(harness):
    harness.connect(3)
    harness.connect(4)
    assert [(m.rank, m.host) for m in harness.sent_up(Joined)] == [(3, ""), (4, "")]
    assert harness.read(3)[0] == Heartbeat("relay-host")
    for rank in (3, 4):
        harness.children[rank].send(Heartbeat(f"host-of-{rank}"))
        harness.children[rank].send(Submit(7, 0b1011, [], {}, []))
    harness.pump(lambda: len(harness.relay._held) == 2)
    assert not harness.sent_up(Merged), "sent before every rank below (the relay's own too) had submitted"
    harness.relay.hold(7, 2, 0b0011, 0.0, time.monotonic())
    harness.relay.poll(time.monotonic())
    (merged,) = harness.sent_up(Merged)
    assert merged.version == 7
    groups = {bits: list(ranks) for ranks, bits, _ in map(relays.unpack_group, merged.groups)}
    assert groups == {0b1011: [3, 4], 0b0011: [2]}
    assert [(m.rank, m.host) for m in harness.sent_up(Joined)][2:] == [(3, "host-of-3"), (4, "host-of-4")]


def test_what_is_held_goes_up_after_the_hold_time_and_before_a_ranks_next_message(harness):
    harness.connect(3)
    harness.connect(4)
    harness.children[3].send(Submit(1, 0b1, [], {}, []))
    harness.pump(lambda: harness.sent_up(Merged), seconds=2.0)  # rank 4 and the relay never submit
    (merged,) = harness.sent_up(Merged)
    ((ranks, bits, held),) = map(relays.unpack_group, merged.groups)
    assert (list(ranks), bits) == ([3], 0b1)
    assert held[0] >= 0.04  # held for the hold time (0.05 s)
    harness.children[4].send(Submit(1, 0b10, [], {}, []))
    harness.children[4].send(Waits(1, ((0, "x", "allreduce"),)))
    harness.pump(lambda: harness.sent_up(Relayed))
    kinds = [type(m) for m in harness.up if type(m) in (Merged, Relayed)]
    assert kinds == [Merged, Merged, Relayed], "rank 4's waits overtook its submission"
    (relayed,) = harness.sent_up(Relayed)
    assert relayed.rank == 4 and control_codec.decode(relayed.payload) == Waits(1, ((0, "x", "allreduce"),))


def test_a_submission_that_carries_requests_or_data_or_answers_a_resend_is_relayed_as_it_was_sent(harness):
    harness.connect(3)
    request = Request("full", OpKind.ALLREDUCE, 0, "float32", (2,))
    harness.children[3].send(Submit(0, 0, [request], {}, [None]))
    harness.children[3].send(Submit(0, 0b1, [], {0: b"\0" * 8}, []))
    harness.children[3].send(Submit(0, 0, [], {}, [], resent=True))  # nothing left to resend: still an answer
    harness.pump(lambda: len(harness.sent_up(Relayed)) == 3)
    first, second, third = (control_codec.decode(m.payload) for m in harness.sent_up(Relayed))
    assert first.full == [request] and second.bit_data == {0: b"\0" * 8}
    assert third == Submit(0, 0, [], {}, [], resent=True)
    assert not harness.sent_up(Merged)


def test_deliveries_reach_the_named_ranks_and_a_child_relay_gets_a_delivery_of_its_own(harness):
    harness.connect(3)
    harness.connect(4)
    harness.children[4].send(Joined(5, "far"))  # rank 4 relays for rank 5
    harness.pump(lambda: any(m.rank == 5 for m in harness.sent_up(Joined)))
    payload = control_codec.encode(Abort("stop"))
    assert harness.relay.deliver((2, 3, 4, 5), payload) is True
    assert harness.read(3) == [Heartbeat("relay-host"), Abort("stop")]
    assert harness.read(4) == [Heartbeat("relay-host"), Deliver((4, 5), payload)]
    assert harness.relay.deliver((3,), payload) is False
    assert harness.read(3) == [Abort("stop")]
    assert harness.relay.deliver((), payload) is True  # everyone below, this rank too
    assert harness.read(3) == [Abort("stop")]
    assert harness.read(4) == [Deliver((), payload)]


def test_a_child_that_dies_is_reported_lost_and_one_that_says_goodbye_is_relayed(harness):
    harness.connect(3)
    harness.connect(4)
    harness.children[4].send(Joined(6, "far"))
    harness.children[3].send(Bye())
    harness.pump(lambda: harness.sent_up(Relayed))
    assert harness.sent_up(Relayed) == [Relayed(3, relays.BYE)]
    harness.children[4].close()
    harness.pump(lambda: harness.sent_up(Lost))
    (lost,) = harness.sent_up(Lost)
    assert lost.rank == 4 and "died" in lost.reason and "relay, rank 2" in lost.reason
    assert harness.relay.children == 0 and not harness.relay._route  # rank 6 went with rank 4


def test_a_relay_refuses_a_second_connection_for_a_rank_it_already_serves(harness):
    harness.connect(3)
    intruder = control_channel.connect("127.0.0.1", harness.relay.listener.port, SECRET, 3, 10.0)
    deadline = time.monotonic() + 5
    closed = False
    while not closed and time.monotonic() < deadline:
        harness.relay.poll(time.monotonic())
        try:
            closed = intruder.recv(1) == b""
        except BlockingIOError:
            time.sleep(0.01)
    assert closed and harness.relay.children == 1
    intruder.close()


@pytest.fixture
def global_harness():
    """A relay whose rank knows bits 0-3 as global names: they wait for the whole subtree (up to 1 s)."""
    made = _Harness(hold_s=0.01, global_bits=lambda: 0b1111, subtree_wait_s=1.0)
    made.connect(3)
    made.connect(4)
    yield made
    made.close()


def _merged_groups(message) -> dict:
    return {bits: sorted(ranks) for ranks, bits, _ in map(relays.unpack_group, message.groups)}


def _settle(harness, seconds: float = 0.15) -> None:
    """Run the relay's loop for a while, well past the 10 ms hold time."""
    deadline = time.monotonic() + seconds
    harness.pump(lambda: time.monotonic() >= deadline)


def test_a_global_name_waits_for_the_whole_subtree_then_goes_up_at_once(global_harness):
    harness = global_harness
    harness.children[3].send(Submit(1, 0b1, [], {}, []))
    _settle(harness)
    harness.children[4].send(Submit(1, 0b1, [], {}, []))
    _settle(harness)
    assert not harness.sent_up(Merged), "sent before the relay's own rank had submitted"
    harness.relay.hold(1, 2, 0b1, 0.0, time.monotonic())
    harness.relay.poll(time.monotonic())
    (merged,) = harness.sent_up(Merged)
    assert _merged_groups(merged) == {0b1: [2, 3, 4]}
    assert merged.matched == 0b1
    held = dict(zip(*(relays.unpack_group(merged.groups[0])[0::2])))
    assert held[3] >= 0.25 and held[2] < 0.1  # rank 3's straggler record keeps its whole wait


def test_masks_split_differently_go_up_as_soon_as_every_rank_has_sent_a_bit(global_harness):
    harness = global_harness
    harness.children[3].send(Submit(1, 0b01, [], {}, []))
    harness.children[4].send(Submit(1, 0b11, [], {}, []))
    harness.pump(lambda: len(harness.relay._held) == 2)
    harness.relay.hold(1, 2, 0b01, 0.0, time.monotonic())
    harness.relay.poll(time.monotonic())
    assert [_merged_groups(m) for m in harness.sent_up(Merged)] == [{0b01: [2, 3], 0b11: [4]}]
    harness.children[3].send(Submit(1, 0b10, [], {}, []))  # rank 4 sent bit 1 already
    _settle(harness)
    assert len(harness.sent_up(Merged)) == 1
    harness.relay.hold(1, 2, 0b10, 0.0, time.monotonic())
    harness.relay.poll(time.monotonic())
    assert [_merged_groups(m) for m in harness.sent_up(Merged)][1:] == [{0b10: [2, 3]}]


def test_a_rank_in_join_is_not_waited_for_until_it_submits_again(global_harness):
    harness = global_harness
    harness.children[4].send(Submit(1, 0, [Request("__join__", OpKind.JOIN, 0, cacheable=False)], {}, [None]))
    harness.pump(lambda: harness.sent_up(Relayed))
    harness.children[3].send(Submit(1, 0b1, [], {}, []))
    harness.relay.hold(1, 2, 0b1, 0.0, time.monotonic())
    harness.pump(lambda: harness.sent_up(Merged), seconds=0.5)  # at once, not after a second
    assert _merged_groups(harness.sent_up(Merged)[0]) == {0b1: [2, 3]}
    harness.children[4].send(Submit(1, 0b10, [], {}, []))  # out of join: waited for again
    harness.children[3].send(Submit(1, 0b100, [], {}, []))
    harness.relay.hold(1, 2, 0b100, 0.0, time.monotonic())
    _settle(harness)
    assert len(harness.sent_up(Merged)) == 1


def test_a_subtree_all_in_join_says_so_and_the_relay_above_does_not_wait_for_it():
    below = _Harness(hold_s=0.01, global_bits=lambda: 0b111, subtree_wait_s=1.0, above_is_relay=True)
    above = _Harness(hold_s=0.01, global_bits=lambda: 0b111, subtree_wait_s=1.0)
    join = Submit(1, 0, [Request("__join__", OpKind.JOIN, 0, cacheable=False)], {}, [None])
    try:
        below.connect(3)
        below.children[3].send(join)
        below.pump(lambda: below.sent_up(Relayed))
        below.relay.note_sent(2, join)
        below.relay.poll(time.monotonic())
        assert below.sent_up(Merged) == [Merged(0, [], -1)]
        above.connect(3)
        above.connect(4)
        above.children[3].send(Merged(1, [], -1))  # rank 3 as the relay below, all of its subtree in join
        above.children[4].send(Submit(1, 0b1, [], {}, []))
        above.relay.hold(1, 2, 0b1, 0.0, time.monotonic())
        above.pump(lambda: above.sent_up(Merged), seconds=0.5)  # at once, not after a second
        assert _merged_groups(above.sent_up(Merged)[0]) == {0b1: [2, 4]}
        above.children[3].send(Merged(1, [relays.pack_group([3], 0b10, [0.0])], 0b10))  # out of join again
        above.children[4].send(Submit(1, 0b10, [], {}, []))
        above.relay.hold(1, 2, 0b10, 0.0, time.monotonic())
        above.pump(lambda: len(above.sent_up(Merged)) == 2, seconds=0.5)
        above.children[4].send(Submit(1, 0b100, [], {}, []))
        above.relay.hold(1, 2, 0b100, 0.0, time.monotonic())
        _settle(above)
        assert len(above.sent_up(Merged)) == 2, "went up without the subtree below rank 3, out of join()"
    finally:
        below.close()
        above.close()


def test_what_the_subtree_has_not_all_sent_goes_up_at_the_latest_after_the_wait():
    harness = _Harness(hold_s=0.01, global_bits=lambda: 0b1, subtree_wait_s=0.2)
    try:
        harness.connect(3)
        harness.children[3].send(Submit(1, 0b10, [], {}, []))  # not a global name's bit: after the hold time
        harness.pump(lambda: harness.sent_up(Merged), seconds=0.15)
        harness.children[3].send(Submit(1, 0b1, [], {}, []))  # a global name's: after the wait
        started = time.monotonic()
        harness.pump(lambda: len(harness.sent_up(Merged)) == 2, seconds=1.0)
        assert time.monotonic() - started >= 0.15
        assert [_merged_groups(m) for m in harness.sent_up(Merged)] == [{0b10: [3]}, {0b1: [3]}]
    finally:
        harness.close()


@pytest.mark.parametrize("above_is_relay", [True, False])
def test_bits_sent_with_data_count_for_the_subtree_and_a_relay_above_hears_what_it_matched(above_is_relay):
    harness = _Harness(hold_s=0.01, global_bits=lambda: -1, subtree_wait_s=1.0, above_is_relay=above_is_relay)
    try:
        harness.connect(3)
        harness.connect(4)
        harness.children[3].send(Submit(1, 0b1, [], {0: b"\0" * 4}, []))  # relayed as sent, never held
        harness.children[4].send(Submit(1, 0b1, [], {}, []))
        harness.pump(lambda: harness.sent_up(Relayed) and harness.relay._held)
        harness.relay.hold(1, 2, 0b1, 0.0, time.monotonic())
        harness.relay.poll(time.monotonic())
        (merged,) = harness.sent_up(Merged)
        assert _merged_groups(merged) == {0b1: [2, 4]} and merged.matched == 0b1
        for rank in (3, 4):  # nothing held: only a relay above needs to hear it
            harness.children[rank].send(Submit(1, 0b10, [], {1: b"\0" * 4}, []))
        harness.pump(lambda: len(harness.sent_up(Relayed)) == 3)
        harness.relay.note_sent(2, Submit(1, 0b10, [], {1: b"\0" * 4}, []))
        harness.relay.poll(time.monotonic())
        expected = [Merged(1, [], 0b10)] if above_is_relay else []
        assert harness.sent_up(Merged)[1:] == expected
        harness.children[3].send(Submit(1, 0b100, [], {}, []))  # the next step waits for rank 4 and the relay's
        _settle(harness)
        assert harness.sent_up(Merged)[1:] == expected
    finally:
        harness.close()


def test_the_tree_of_relays():
    prefix = "p/"
    assert relays.parent_key(prefix, "h", 1, 5, 16) == relays.host_key(prefix, "h")
    # on rank 0's host (cross rank 0) the second rank relays, straight to rank 0, for the third and later
    assert [relays.relay_local_rank(c) for c in (0, 1, 2)] == [1, 0, 0]
    assert relays.parent_key(prefix, "h", 1, 0, 16) is None
    assert relays.parent_key(prefix, "h", 2, 0, 16) == relays.parent_key(prefix, "h", 7, 0, 16) == \
        relays.host_key(prefix, "h")
    # the relay on rank 0's host is the top of the tree: the first hosts' relays connect to it, not to rank 0
    assert [relays.parent_key(prefix, "h", 0, c, 2) for c in (1, 2, 3, 4, 5)] == [
        relays.leader_key(prefix, 0), relays.leader_key(prefix, 0), relays.leader_key(prefix, 1),
        relays.leader_key(prefix, 1), relays.leader_key(prefix, 2)]
    assert relays.fan_out([5, 6, 7, 9], {5: 1, 6: 2, 7: 1}) == {1: [5, 7], 2: [6]}
    assert relays.addressed(3, [3], b"x") == b"x"
    assert control_codec.decode(relays.addressed(3, [3, 8], b"x")) == Deliver((3, 8), b"x")


# ------------------------------------------------------------------ merged submissions at rank 0
def _cached_negotiator(size: int, names: int) -> Negotiator:
    negotiator = Negotiator(size, 64)
    for i in range(names):
        request = Request(f"t{i}", OpKind.ALLREDUCE, 0, "float32", (4,))
        for rank in range(size):
            negotiator.submit(rank, request, 0.0)
    negotiator.take(1 << 20)
    return negotiator


@pytest.mark.parametrize("size", [2, 3, 64, 1024])
def test_merged_submissions_agree_with_each_ranks_own(size):
    names = 6
    rng = random.Random(size)
    masks = {rank: rng.getrandbits(names) | 1 for rank in range(1, size)}
    separate, merged = _cached_negotiator(size, names), _cached_negotiator(size, names)
    for rank, mask in masks.items():
        assert separate.submit_bits(rank, mask, separate.cache.version, 1.0) == []
    by_mask: dict[int, list] = {}
    for rank, mask in masks.items():
        by_mask.setdefault(mask, []).append(rank)
    for mask, ranks in by_mask.items():
        assert merged.submit_bits_of(tuple(ranks), mask, merged.cache.version, 1.0) == []
    everything = (1 << names) - 1
    for negotiator in (separate, merged):
        assert negotiator.submit_bits(0, everything, negotiator.cache.version, 1.0) == []
    agreed = [sorted(e.name for _, b in n.take(1 << 20) for e in b.entries) for n in (separate, merged)]
    assert agreed[0] == agreed[1]
    common = everything
    for mask in masks.values():
        common &= mask
    assert agreed[1] == sorted(f"t{bit}" for bit in range(names) if common >> bit & 1)


def test_merged_submissions_after_a_rank_joined_or_left_take_the_careful_path():
    negotiator = _cached_negotiator(4, 2)
    negotiator.rank_left(3, "rank 3 has shut down")
    assert negotiator.submit_bits_of((1, 2), 0b11, negotiator.cache.version, 1.0) == []
    assert negotiator.submit_bits(0, 0b11, negotiator.cache.version, 1.0) == []
    batches = negotiator.take(1 << 20)
    assert all(batch.error for _, batch in batches), "names could complete without rank 3"


def test_merged_submissions_at_an_old_cache_version_are_stale():
    negotiator = _cached_negotiator(3, 2)
    old = negotiator.cache.version
    negotiator.set_cache_capacity(1)  # evicts a bit: a mask from before that names it is stale
    evicted = [bit for bit, _ in negotiator.take_evictions()]
    assert evicted
    stale = negotiator.submit_bits_of((1, 2), 0b11, old, 1.0)
    assert set(stale) >= set(evicted)


# ------------------------------------------------------------------ real jobs through relays
RELAYS = {"ROUNDEL_RELAY_FROM_RANKS": "2", "ROUNDEL_RELAY_FANOUT": "1"}
# rank 0 alone; ranks 1-2 on a second host (1 relays for 2); rank 3 on a third host, below rank 1's relay
# (fanout 1) and relaying for rank 4 with it
FIVE = ("-H", "localhost:1,127.0.0.1:2,127.0.0.2:2")
THREE = ("-H", "localhost:1,127.0.0.1:2")  # rank 1 relays for rank 2
# on rank 0's host its second rank relays: rank 1 for rank 2 there; rank 3 for rank 4 on the other host
RANK_0_HOST = ("-H", "localhost:3,127.0.0.1:2")


def _relayed(np, worker, scenarios, launcher_args, env=None, timeout=120):
    return run_job(np, worker, ",".join(scenarios), env={**RELAYS, **(env or {})}, launcher_args=launcher_args,
                   timeout=timeout)


def test_collectives_through_a_chain_of_relays():
    scenarios = ("steady", "allreduce", "grouped", "coordinator_reduce", "allgather", "broadcast", "alltoall",
                 "ordering", "barrier", "join")
    result = _relayed(5, "torch_collectives.py", scenarios, FIVE)
    assert_checks_passed(result, 5, *scenarios)


def test_collectives_through_the_relay_on_rank_0s_host():
    scenarios = ("steady", "allreduce", "grouped", "coordinator_reduce", "broadcast", "join")
    result = _relayed(5, "torch_collectives.py", scenarios, RANK_0_HOST)
    assert_checks_passed(result, 5, *scenarios)


def test_a_tiny_cache_through_relays_evicts_and_resends():
    scenarios = ("steady", "allreduce", "ordering")
    result = _relayed(5, "torch_collectives.py", scenarios, FIVE, env={"ROUNDEL_CACHE_CAPACITY": "2"})
    assert_checks_passed(result, 5, *scenarios)


def test_process_sets_through_relays():
    scenarios = ("static", "concurrent", "dynamic")
    result = _relayed(5, "torch_process_sets.py", scenarios, FIVE)
    assert_checks_passed(result, 5, *scenarios)


def test_mismatches_through_relays_fail_on_every_rank_and_the_job_goes_on():
    scenarios = ("mismatch", "mismatch_cached", "duplicate")
    result = _relayed(3, "torch_errors.py", scenarios, THREE)
    assert_checks_passed(result, 3, *scenarios)


def test_the_stall_warning_names_a_rank_behind_a_relay():
    result = _relayed(3, "torch_errors.py", ("stall",), THREE, env={"HOROVOD_STALL_CHECK_TIME_SECONDS": "1"})
    assert_checks_passed(result, 3, "stall")
    warnings = [line for line in rank_lines(result.stderr, 0, "stderr") if "roundel stall" in line]
    assert any("'stall.late'" in line and "not yet by rank(s) 1" in line for line in warnings), describe(result)


def test_a_deadlock_across_relays_is_found():
    result = _relayed(3, "torch_hangs.py", ("diverged",), THREE, env={"ROUNDEL_HEARTBEAT_TIMEOUT_SECONDS": "3"},
                      timeout=60)
    assert_checks_passed(result, 3, "diverged")
    for rank in range(3):
        errors = [line for line in rank_lines(result.stdout, rank, "stdout") if line.startswith("ERROR ")]
        assert len(errors) == 1 and "CollectiveDeadlockError" in errors[0], describe(result)
        assert "rank 1 waits for broadcast 'diverged.bcast'" in errors[0], describe(result)


def test_a_killed_relay_fails_every_rank_at_once():
    # rank 1, the relay of rank 2, dies 0.5 s after ranks 0 and 2 block in an allreduce it never submits
    result = _relayed(3, "torch_errors.py", ("killed",), THREE, timeout=60)
    assert result.returncode == 128 + 9, describe(result)
    for rank in (0, 2):
        assert "CHECKS PASSED killed" in rank_lines(result.stdout, rank, "stdout"), describe(result)
        errors = [line for line in rank_lines(result.stdout, rank, "stdout") if "HorovodInternalError" in line]
        assert any("rank 1" in line and "died" in line for line in errors), describe(result)
        measured = [float(line.split()[1]) for line in rank_lines(result.stdout, rank, "stdout")
                    if line.startswith("MEASURED ")]
        assert measured and measured[0] < 10, describe(result)


def test_on_rank_0s_host_the_second_rank_relays_for_the_others():
    # one host of 3: rank 2 reaches rank 0 through rank 1, so rank 1's death cuts rank 2's line to rank 0
    result = _relayed(3, "torch_errors.py", ("killed",), ("-H", "localhost:3"), timeout=60)
    assert result.returncode == 128 + 9, describe(result)
    errors = [line for line in rank_lines(result.stdout, 2, "stdout") if "HorovodInternalError" in line]
    assert any("rank 1, which relays this rank's control messages to rank 0" in line for line in errors), \
        describe(result)


def test_a_stopped_rank_behind_a_relay_is_found_by_its_relay():
    # rank 2 is stopped (SIGSTOP); its relay, rank 1, finds it silent and rank 0 breaks the job
    env = {**RELAYS, "ROUNDEL_HEARTBEAT_TIMEOUT_SECONDS": "3", "HOROVOD_GLOO_TIMEOUT_SECONDS": "120"}
    result = run_job(3, "torch_hangs.py", "stopped", 2, env=env, launcher_args=THREE, timeout=90)
    last = result.stderr.rstrip().splitlines()[-1]
    assert last.startswith("roundelrun: rank 2 (host ") and "was lost: stopped responding" in last, describe(result)
    for rank in (0, 1):
        assert "CHECKS PASSED stopped" in rank_lines(result.stdout, rank, "stdout"), describe(result)
        errors = [line for line in rank_lines(result.stdout, rank, "stdout") if line.startswith("ERROR ")]
        assert any("rank 2 (host " in line and "stopped responding" in line for line in errors), describe(result)


def test_an_elastic_job_goes_on_without_the_host_whose_relay_failed(tmp_path):
    # ranks 0-1 on one host, 2-3 on another (rank 2 relays for rank 3); rank 2 fails in the first generation:
    # its host is taken out, rank 3 (cut off from rank 0 with it) stops, and the first host trains on
    env = {"EPOCHS": 2, "SAMPLES": 96, "BATCH": 4, "STEP_SLEEP": 0.05, "EXIT_SCHEDULE": '{"0": [2]}', **RELAYS}
    job = ElasticJob(tmp_path, None, str(WORKERS_DIR / "torch_elastic.py"),
                     ("-np", "4", "-H", "127.0.0.2:2,127.0.0.3:2", "--min-np", "2", "--elastic-timeout", "60"), env)
    assert job.finish(timeout=120) == 0, job.describe()
    text = job.text()
    assert "worker 127.0.0.3:0 exited with code 1; host 127.0.0.3 blacklisted for the rest of the job" in text, \
        job.describe()
    assert "generation 1: 2 worker(s), ranks 127.0.0.2:0=0, 127.0.0.2:1=1" in text, job.describe()
    assert len(check_training(text, 2, 96, 4, 1 * 2 * 4 * 4 + 2 * 4)) == 2  # one failure, two generations


def test_the_timeline_shows_when_each_rank_behind_a_relay_submitted(tmp_path):
    path = tmp_path / "timeline.json"
    # every step negotiated (a replayed steady state has no arrivals at rank 0 to show)
    env = {**RELAYS, "HOROVOD_STALL_CHECK_DISABLE": "1", "ROUNDEL_STEADY_REPLAY": "0"}
    result = run_job(3, "torch_timeline.py", "steps", tmp_path, env=env,
                     launcher_args=[*THREE, "--timeline-filename", path], timeout=90)
    assert_checks_passed(result, 3, "steps")
    events = json.loads(path.read_text())
    rows = {e["pid"]: e["args"]["name"] for e in events
            if e.get("ph") == "M" and e.get("name") == "process_name" and e["pid"]}
    for name in ("allreduce.grad.a", "allreduce.grad.late"):  # rank 2's arrivals come through rank 1's relay
        arrivals = Counter(e["name"] for e in events if e.get("ph") == "X" and rows.get(e.get("pid")) == name)
        assert arrivals == {"0": 3, "1": 3, "2": 3}, (name, arrivals)
    # rank 1 sends 'grad.c' 300 ms after the others; from the second step it is a cache bit, and the relay holds
    # rank 2's bit until rank 1's: rank 2's mark must still show when rank 2 sent it, not when it was let go
    # (on a loaded machine rank 2 itself may lag rank 0 by tens of ms: the bounds leave room for that)
    [pid] = [pid for pid, name in rows.items() if name == "allreduce.grad.c"]
    marks = [(e["name"], e["ts"]) for e in events if e.get("ph") == "X" and e.get("pid") == pid]
    steps = [dict(marks[i:i + 3]) for i in range(0, len(marks), 3)]
    assert len(steps) == 3 and all(len(step) == 3 for step in steps), marks
    for step in steps[1:]:
        assert step["1"] - step["2"] >= 150_000 and abs(step["2"] - step["0"]) < 150_000, steps
