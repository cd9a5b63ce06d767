"""The schedule's learning and holding (``roundel.common.engine.replay``), without processes: what every rank
decides alike from the batches it runs, and what one rank holds back."""

from __future__ import annotations

from roundel.common.control.records import Batch, Entry, OpKind, Request
from roundel.common.engine.replay import ARM_AFTER, UNLEARN_AFTER, ScheduleReplay
from roundel.ops import ReduceOp


class _Handle:
    def __init__(self):
        self.error = None

    def set_error(self, error):
        self.error = error


class _Work:
    def __init__(self, name, shape=(4,), set_id=0):
        self.request = Request(name, OpKind.ALLREDUCE, set_id, "float32", shape, reduce_op=int(ReduceOp.Sum))
        self.handle = _Handle()


def _batch(*names, error=None, set_id=0):
    return Batch(OpKind.ALLREDUCE, set_id, tuple(Entry(n, _Work(n).request) for n in names), error=error)


def _replay(waits=False):
    woken = []
    replay = ScheduleReplay(True, woken.append, lambda: waits)
    return replay, woken


def _dispatch(replay, *names, **kw):
    """A batch from the coordinator, as the executor runs one: a pending slot is given up first."""
    if replay.armed:
        slot, _ = replay.begin(force_give_up=True)
        replay.given_up(slot)
    batch = _batch(*names, **kw)
    replay.dispatched(batch, [_Work(n) for n in names])


def test_a_repeated_successor_arms_the_next_batch():
    replay, _ = _replay()
    seen = 0
    while not replay.armed:
        _dispatch(replay, "a" if seen % 2 == 0 else "b")
        seen += 1
    # a b a b a: "b" has followed "a" twice, and "a" "b" twice, when the last "a" runs: "b" is armed
    assert seen == 2 * ARM_AFTER + 1 and replay.pending_names == ("b",)


def _armed_after_two_names():
    replay, woken = _replay()
    for _ in range(ARM_AFTER + 1):
        _dispatch(replay, "a")
        _dispatch(replay, "b")
    assert replay.armed
    return replay, woken


def test_the_expected_names_are_held_and_complete_the_slot():
    replay, woken = _armed_after_two_names()  # after "b", "a" is armed, "b" sure to follow
    works = [_Work("b"), _Work("a")]
    assert replay.take(works) == []
    assert woken, "the slot was complete and the executor was not told"
    slot, taken = replay.begin(False)
    assert slot.names == ("a",) and [w.request.name for w in taken] == ["a"]
    assert replay.ran(slot) == []  # "b" is armed next and holds its work
    slot, taken = replay.begin(False)
    assert slot.names == ("b",) and [w.request.name for w in taken] == ["b"]


def test_a_caller_that_waits_runs_the_slot_itself():
    replay, woken = _armed_after_two_names()
    assert replay.take([_Work("a")], caller_waits=True) == []
    assert not woken and replay.ready_now() is not None


def test_an_expected_name_unlike_last_time_gives_the_slot_up():
    replay, woken = _armed_after_two_names()
    other = _Work("a", shape=(5,))
    assert replay.take([other]) == [other]
    assert woken
    slot, taken = replay.begin(False)
    assert taken is None


def test_unexpected_names_go_to_the_coordinator_without_giving_up():
    replay, woken = _armed_after_two_names()
    stranger = _Work("z")
    assert replay.take([stranger]) == [stranger]
    assert not woken
    assert replay.take([_Work("a")]) == []
    slot, taken = replay.begin(False)
    assert taken is not None


def test_a_dispatch_while_pending_gives_up_and_releases_the_held_works():
    replay, _ = _armed_after_two_names()
    held = _Work("b")
    replay.take([held])
    slot, taken = replay.begin(force_give_up=True)
    assert taken is None
    released = replay.given_up(slot)
    assert released == [held] and not replay.armed


def test_a_slot_given_up_again_and_again_is_learned_anew():
    replay, _ = _armed_after_two_names()  # "a" armed after "b"
    for attempt in range(UNLEARN_AFTER):
        assert replay.pending_names == ("a",), attempt
        _dispatch(replay, "a")  # gives "a" up; then "b" is armed after "a"
        _dispatch(replay, "b")  # gives "b" up; "a" armed again until unlearned
    assert not replay.armed, "the step into 'a' was not unlearned"


def test_a_slot_whose_name_went_to_the_coordinator_is_given_up_when_armed():
    replay, woken = _replay()
    for _ in range(ARM_AFTER):
        _dispatch(replay, "a")
        _dispatch(replay, "b")
    assert not replay.armed
    assert replay.take([_Work("b")])  # not armed: sent to the coordinator
    _dispatch(replay, "a")  # arms "b", which this rank can only get back from the coordinator
    assert replay.armed and woken
    slot, taken = replay.begin(False)
    assert slot.names == ("b",) and taken is None


def test_batches_with_errors_and_other_sets_teach_nothing():
    replay, _ = _replay()
    for _ in range(ARM_AFTER):
        _dispatch(replay, "a")
        _dispatch(replay, "e", error="mismatch")
        _dispatch(replay, "p", set_id=1)
    assert not replay.armed
    _dispatch(replay, "a")
    assert replay.pending_names == ("a",)  # "a" followed "a": the others were skipped


def test_a_thread_waiting_on_an_incomplete_slot_gives_it_up_at_the_second_check():
    """The slot expects "a", then "b"; this rank submitted "b" first (another order) and waits."""
    replay, _ = _replay(waits=True)
    for _ in range(ARM_AFTER + 1):
        _dispatch(replay, "a")
        _dispatch(replay, "b")
    assert replay.pending_names == ("a",)
    assert replay.take([_Work("b")]) == []
    assert not replay.overdue()
    assert replay.overdue()
    slot, taken = replay.begin(False)
    assert taken is None


def test_a_thread_waiting_while_nothing_is_held_gives_nothing_up():
    """What it waits for is with the coordinator (its last small allreduce, say): the others may never enter
    the slot (they leave the job once that returns), so giving it up would leave this rank inside it."""
    replay, _ = _replay(waits=True)
    for _ in range(ARM_AFTER + 1):
        _dispatch(replay, "a")
        _dispatch(replay, "b")
    assert replay.armed
    assert not any(replay.overdue() for _ in range(50))
    assert replay.begin(False) is None


def test_failing_fails_the_held_works():
    replay, _ = _armed_after_two_names()
    held = _Work("b")
    replay.take([held])
    error = RuntimeError("broken")
    replay.fail(error)
    assert held.handle.error is error and not replay.armed


def test_a_changed_shape_is_expected_next_time_not_the_old_one():
    """A schedule of one batch that follows itself: one step with another shape (an epoch's last batch) runs
    through the coordinator, and the slot after it expects that shape, not the one held before."""
    replay, _ = _replay()
    for _ in range(ARM_AFTER + 1):
        _dispatch(replay, "x")
    assert replay.armed
    small = _Work("x", shape=(2,))
    assert replay.take([small]) == [small]  # unlike last time: given up, to the coordinator
    slot, taken = replay.begin(False)
    replay.given_up(slot)
    replay.dispatched(_batch("x"), [small])  # the coordinator runs it with the new shape
    assert replay.armed
    usual = _Work("x")
    assert replay.take([usual]) == [usual], "held against a request the slot does not expect"


def test_a_slot_being_run_is_not_given_up_by_the_waiter_check():
    replay, _ = _replay(waits=True)
    for _ in range(ARM_AFTER + 1):
        _dispatch(replay, "a")
        _dispatch(replay, "b")
    replay.take([_Work("a")])
    slot, taken = replay.begin(False)
    assert taken is not None
    assert not replay.overdue() and not replay.overdue() and not replay.overdue()
    assert replay.ran(slot) == [] and replay.armed  # "b" armed next, not given up


def test_an_incomplete_slot_is_not_run_unless_given_up():
    replay, _ = _armed_after_two_names()
    assert replay.begin(False) is None


def test_a_slot_held_in_part_for_long_is_given_up_without_waiters():
    from roundel.common.engine.replay import PARTIAL_LIMIT_S, WAIT_GRACE_S
    replay, _ = _replay()
    for _ in range(ARM_AFTER + 1):
        _dispatch(replay, "a", "c")
        _dispatch(replay, "b")
    assert replay.pending_names == ("a", "c")
    replay.take([_Work("a")])  # "c" never comes, and nobody waits (a program that polls)
    checks = 0
    while not replay.overdue():
        checks += 1
        assert checks * WAIT_GRACE_S <= PARTIAL_LIMIT_S + WAIT_GRACE_S, "never given up"
