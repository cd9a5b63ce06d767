"""The shared-memory transport's barrier, members as threads over real Unix socket pairs.

Checks that no member leaves a wait before every member has entered it, at
member counts that are and are not powers of two, that a member that goes
away (its sockets closed) fails every other member's wait at once rather than
only its neighbours', that a member that stops answering fails them within
the socket timeout, and that a failed barrier stays failed.
"""

import itertools
import socket
import threading
import time

import pytest

from roundel.transport.host_barrier import HostBarrier


def barriers(size: int, timeout_s: float) -> list[HostBarrier]:
    peers = [{} for _ in range(size)]
    for a, b in itertools.combinations(range(size), 2):
        peers[a][b], peers[b][a] = socket.socketpair()
        peers[a][b].settimeout(timeout_s)
        peers[b][a].settimeout(timeout_s)
    return [HostBarrier(m, size, peers[m]) for m in range(size)]


def run_members(size: int, body, timeout_s: float = 30.0) -> list:
    """Run ``body(member, barrier)`` in one thread per member; returns each one's result or exception."""
    members = barriers(size, timeout_s)
    outcomes: list = [None] * size

    def run(m):
        try:
            outcomes[m] = body(m, members[m])
        except Exception as exc:  # noqa: BLE001 - the test inspects it
            outcomes[m] = exc

    threads = [threading.Thread(target=run, args=(m,), daemon=True) for m in range(size)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(60)
    assert not any(thread.is_alive() for thread in threads), "a member never returned from its waits"
    return outcomes


@pytest.mark.parametrize("size", [2, 3, 5, 8])
def test_no_member_leaves_a_wait_before_every_member_entered_it(size):
    entered = [0] * size
    early = []

    def body(m, barrier):
        for call in range(1, 41):
            if m == call % size:
                time.sleep(0.001)  # a different member is late each time
            entered[m] = call
            barrier.wait()
            if min(entered) < call:
                early.append((m, call, list(entered)))

    assert run_members(size, body) == [None] * size
    assert not early, early[:3]


def test_a_member_that_goes_away_fails_every_other_members_wait_at_once():
    # member 3 of 7 closes its sockets instead of waiting: only members 4, 5 and 0 read from it
    # directly; the rest must learn of it through the others' failures, well before the 30 s timeout
    def body(m, barrier):
        barrier.wait()
        if m == 3:
            time.sleep(0.2)
            barrier.close()
            return "left"
        start = time.monotonic()
        with pytest.raises(RuntimeError, match="stopped answering in a shared-memory collective"):
            barrier.wait()
        return time.monotonic() - start

    outcomes = run_members(7, body)
    assert outcomes[3] == "left"
    assert all(isinstance(took, float) and took < 5.0 for m, took in enumerate(outcomes) if m != 3), outcomes


def test_a_member_that_stops_answering_fails_the_others_within_the_timeout_and_the_barrier_stays_failed():
    def body(m, barrier):
        if m == 2:
            time.sleep(3.0)  # never waits, keeps its sockets open: stopped, not dead
            return "stopped"
        start = time.monotonic()
        with pytest.raises(RuntimeError):
            barrier.wait()
        took = time.monotonic() - start
        with pytest.raises(RuntimeError, match="stopped answering"):  # the first error, at once
            barrier.wait()
        return took

    outcomes = run_members(4, body, timeout_s=0.5)
    assert outcomes[2] == "stopped"
    assert all(isinstance(took, float) and took < 2.5 for m, took in enumerate(outcomes) if m != 2), outcomes
