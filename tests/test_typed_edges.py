"""The launcher's typed edges on their own: a rank's outcome, the Worker interface, and the elastic
driver's member states."""

from __future__ import annotations

import signal
import sys

import pytest

from roundel.errors import RoundelInternalError
from roundel.rendezvous.elastic_join import WorkerRemoved
from roundel.runner.elastic_driver import IllegalTransition, MemberEvent, MemberState
from roundel.rendezvous.store import RendezvousServer, new_secret
from roundel.runner import spawn
from roundel.runner.hosts import SlotInfo
from roundel.runner.outcome import OutcomeKind, RankFailedError, RankOutcome
from roundel.runner.worker import Worker
from roundel.spark.elastic import SparkTaskDiscovery, TaskWorker


class Point:
    """A value of a class defined here, so that it pickles by reference."""

    def __init__(self, x, y):
        self.x, self.y = x, y


def _ranked(rank):
    return lambda: rank


def test_returned_value_round_trips_through_its_bytes():
    outcome = RankOutcome.of_call(lambda a, b=0: {"sum": a + b, "point": Point(a, b)}, (2,), {"b": 3},
                                  rank_of=_ranked(4))
    assert outcome.ok and outcome.kind is OutcomeKind.RETURNED and outcome.rank == 4
    back = RankOutcome.decode(outcome.encode())
    assert back == outcome
    value = back.result()
    assert value["sum"] == 5 and (value["point"].x, value["point"].y) == (2, 3)


def test_raised_error_carries_rank_and_traceback_text():
    def fails_on_purpose():
        raise KeyError("no such key on this rank")

    outcome = RankOutcome.decode(RankOutcome.of_call(fails_on_purpose, rank_of=_ranked(1)).encode())
    assert outcome.kind is OutcomeKind.RAISED and not outcome.ok and not outcome.internal
    assert outcome.rank == 1
    assert "KeyError: 'no such key on this rank'" in outcome.error and "in fails_on_purpose" in outcome.error
    with pytest.raises(RankFailedError) as info:
        outcome.result("roundel.run: ")
    assert info.value.rank == 1
    assert str(info.value).startswith("roundel.run: rank 1 raised:\nTraceback")
    assert info.value.traceback_text == outcome.error


def test_internal_errors_removal_and_unpicklable_values_are_told_apart():
    def peer_lost():
        raise RoundelInternalError("a peer is gone")

    def left_out():
        raise WorkerRemoved("host h left the job")

    internal = RankOutcome.decode(RankOutcome.of_call(peer_lost).encode())
    assert internal.kind is OutcomeKind.RAISED and internal.internal and internal.rank is None
    assert "a worker raised" in str(internal.failure("x: "))
    removed = RankOutcome.decode(RankOutcome.of_call(left_out, removed=WorkerRemoved).encode())
    assert removed.kind is OutcomeKind.REMOVED and removed.error == "host h left the job"
    # without ``removed``, leaving the job is a failure like any other exception (as under roundel.run)
    assert RankOutcome.of_call(left_out).kind is OutcomeKind.RAISED
    unpicklable = RankOutcome.of_call(lambda: (x for x in ()), rank_of=_ranked(0))
    assert unpicklable.kind is OutcomeKind.RAISED and "generator" in unpicklable.error


def test_died_outcome_names_what_was_seen():
    outcome = RankOutcome.decode(RankOutcome.died(2, "its process exited with code 3").encode())
    assert outcome.kind is OutcomeKind.DIED and outcome.rank == 2
    error = outcome.failure("RayExecutor: ", "the actor of rank 2", "; 1 rank(s) still running")
    assert str(error) == "RayExecutor: the actor of rank 2 died: its process exited with code 3; 1 rank(s) still running"
    assert error.traceback_text == "its process exited with code 3"


def test_bad_bytes_are_refused_without_unpickling():
    good = RankOutcome.of_call(lambda: 1, rank_of=_ranked(0)).encode()
    for bad in (b"", b"1\x80\x04K\x01.", good[:10], good[:good.index(b"{") + 5]):
        with pytest.raises(ValueError):
            RankOutcome.decode(bad)
    header_start = good.index(b"{")
    forged = good[:header_start] + good[header_start:].replace(b'"returned"', b'"exploded"')
    with pytest.raises(ValueError, match="bad header"):
        RankOutcome.decode(forged)
    # a value that cannot be unpickled here is the rank's failure, not a crash of the caller
    broken = RankOutcome(OutcomeKind.RETURNED, 3, payload=b"\x80\x05not a pickle")
    with pytest.raises(RankFailedError, match="rank 3's result could not be unpickled here"):
        broken.result()


# ------------------------------------------------------------ the Worker interface


def test_a_local_process_is_a_worker_the_launcher_can_wait_for():
    slot = SlotInfo("localhost", 3, 4, 1, 2, 0, 1)
    worker = spawn.start_local(slot, [sys.executable, "-c", "import sys; print('bye'); sys.exit(7)"], {})
    assert isinstance(worker, Worker) and (worker.rank, worker.host) == (3, "localhost")
    assert worker.wait() == 7 and worker.returncode == 7
    worker.join_output(10)
    worker.signal_group(signal.SIGKILL)  # a worker already gone is no error


def test_a_spark_slot_without_a_task_is_a_worker_that_ended_killed():
    server = RendezvousServer(new_secret())
    server.start()
    try:
        worker = TaskWorker(SlotInfo("exec-1", 1, 2, 0, 1, 0, 1), None, "exec-1:0#1", server,
                            SparkTaskDiscovery(server, 1))
        assert isinstance(worker, Worker) and not isinstance(worker, spawn.ProcessWorker)
        assert worker.returncode == worker.wait() == -signal.SIGKILL
        assert "no Spark task" in worker.where and worker.outcome() is None
        worker.signal_group(signal.SIGTERM)
        assert server.get("spark/elastic/kill/exec-1:0#1") is None  # nothing to ask of a task that is gone
    finally:
        server.stop()


def test_a_worker_must_say_how_it_is_watched_and_stopped():
    class Incomplete(Worker):
        @property
        def where(self) -> str:
            return "nowhere"

    with pytest.raises(TypeError, match="abstract"):
        Incomplete(SlotInfo("h", 0, 1, 0, 1, 0, 1))


# ------------------------------------------------------------ the elastic driver's member states


def _walk(*events: MemberEvent) -> MemberState:
    state = MemberState.RUNNING
    for event in events:
        state = state.after(event)
    return state


def test_member_life_follows_its_state_machine():
    assert _walk(MemberEvent.LEAVE) is MemberState.LEAVING
    assert _walk(MemberEvent.LEAVE, MemberEvent.EVICT) is MemberState.EVICTED
    assert _walk(MemberEvent.LOSE, MemberEvent.LEAVE) is MemberState.LOST_LEAVING
    assert _walk(MemberEvent.LEAVE, MemberEvent.LOSE) is MemberState.LOST_LEAVING
    assert _walk(MemberEvent.EVICT, MemberEvent.LOSE) is MemberState.LOST_EVICTED
    assert _walk(MemberEvent.LOSE, MemberEvent.LEAVE, MemberEvent.EVICT) is MemberState.LOST_EVICTED
    # what each state means to the driver: a lost member still holds its slot until its exit is seen
    assert [s for s in MemberState if s.kept] == [MemberState.RUNNING, MemberState.LOST]
    assert [s for s in MemberState if s.evicted] == [MemberState.EVICTED, MemberState.LOST_EVICTED]
    assert all(s.leaving for s in MemberState if s.evicted)
    assert all(s.kept != s.leaving for s in MemberState)  # a member either holds its slot or is leaving


@pytest.mark.parametrize("events", [
    (MemberEvent.LEAVE, MemberEvent.LEAVE),  # told to leave twice
    (MemberEvent.EVICT, MemberEvent.EVICT),  # evicted twice
    (MemberEvent.EVICT, MemberEvent.LEAVE),  # an evicted member is leaving already
    (MemberEvent.LOSE, MemberEvent.LOSE),  # killed twice
    (MemberEvent.LEAVE, MemberEvent.LOSE, MemberEvent.LEAVE),  # lost while leaving: still leaving
    (MemberEvent.LOSE, MemberEvent.EVICT, MemberEvent.LOSE),
    (MemberEvent.EVICT, MemberEvent.LOSE, MemberEvent.EVICT),
])
def test_illegal_member_transitions_raise(events):
    *before, last = events
    state = _walk(*before)
    with pytest.raises(IllegalTransition, match=f"cannot {last.value}"):
        state.after(last)



def test_every_state_is_reachable_and_only_running_is_untouched():
    reached = {MemberState.RUNNING}
    frontier = [MemberState.RUNNING]
    while frontier:
        state = frontier.pop()
        for event in MemberEvent:
            try:
                following = state.after(event)
            except IllegalTransition:
                continue
            assert following is not MemberState.RUNNING
            if following not in reached:
                reached.add(following)
                frontier.append(following)
    assert reached == set(MemberState)
    # and each event happens at most once in a life: a member can never take more than three steps
    assert _walk(MemberEvent.LEAVE, MemberEvent.LOSE, MemberEvent.EVICT) is MemberState.LOST_EVICTED
