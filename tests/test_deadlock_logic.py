"""The deadlock rule on its own (no processes): which blocked ranks can never proceed."""

from roundel.common.engine.deadlock import deadlocked_ranks, describe
from roundel.common.engine.negotiation import JOIN_NAME, Negotiator
from roundel.common.control.records import OpKind, Request


def _waits(*names, kind="allreduce", set_id=0):
    return tuple((set_id, name, kind) for name in names)


def _negotiator(size, submitted):
    negotiator = Negotiator(size, 0)
    for rank, names in submitted.items():
        for name in names:
            negotiator.submit(rank, Request(name, OpKind.ALLREDUCE, 0, "float32", (1,)), 0.0)
    return negotiator


def test_ranks_blocked_on_different_names_are_deadlocked():
    n = _negotiator(2, {0: ["a"], 1: ["b"]})
    stuck = deadlocked_ranks({0: _waits("a"), 1: _waits("b")}, n.live_ranks(), n.missing_ranks)
    assert stuck == {0: _waits("a"), 1: _waits("b")}
    assert describe(stuck, n.missing_ranks) == ("rank 0 waits for allreduce 'a' (not submitted by rank 1); "
                                                "rank 1 waits for allreduce 'b' (not submitted by rank 0)")


def test_a_rank_busy_outside_roundel_can_still_submit():
    n = _negotiator(3, {0: ["a"], 1: ["a"]})
    assert deadlocked_ranks({0: _waits("a"), 1: _waits("a")}, n.live_ranks(), n.missing_ranks) == {}


def test_a_name_waiting_on_a_rank_that_can_proceed_is_not_stuck():
    # rank 0 waits for 'a' (needs rank 1); rank 1 waits for 'b', which only rank 2 (busy) still misses
    n = _negotiator(3, {0: ["a", "b"], 1: ["b"]})
    waits = {0: _waits("a"), 1: _waits("b")}
    assert deadlocked_ranks(waits, n.live_ranks(), n.missing_ranks) == {}


def test_names_already_dispatched_or_unknown_count_as_progressing():
    n = _negotiator(2, {0: ["a"]})
    assert deadlocked_ranks({0: _waits("a"), 1: _waits("gone")}, n.live_ranks(), n.missing_ranks) == {}


def test_a_rank_waiting_for_a_name_it_has_not_sent_yet_is_on_its_way():
    """Rank 0's request for 'a' reached the coordinator; ranks 1 and 2 hold theirs in a replayed slot (the
    schedule was armed while rank 0 had already sent its own) and wait for it: the slot is given up, or runs,
    by itself, so that is no deadlock (it was reported as one while thousands of requests were in flight)."""
    n = _negotiator(3, {0: ["a"]})
    assert deadlocked_ranks({1: _waits("a"), 2: _waits("a")}, n.live_ranks(), n.missing_ranks) == {}
    stuck = deadlocked_ranks({0: _waits("a"), 1: _waits("a")}, n.live_ranks(), n.missing_ranks)
    assert stuck == {}, "rank 1 is on its way, so rank 0's wait for it can complete too"


def test_failing_the_waits_clears_them_for_the_submitters():
    n = _negotiator(2, {0: ["a"], 1: ["b"]})
    n.fail_waits(_waits("a") + _waits("b"), "deadlock")
    failures = n.take_direct()
    assert sorted((targets, batch.entries[0].name, batch.error_type) for targets, batch in failures) == [
        ((0,), "a", "deadlock"), ((1,), "b", "deadlock")]
    assert not n.has_pending()


def test_join_waits_for_the_ranks_that_have_not_joined():
    n = _negotiator(2, {1: ["a"]})
    n.submit(0, Request(JOIN_NAME, OpKind.JOIN, 0), 0.0)  # rank 0 joins; 'a' then needs nobody else
    assert n.missing_ranks(0, JOIN_NAME) == (1,)
