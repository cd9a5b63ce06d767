"""More cases of the deadlock rule (see tests/test_deadlock_logic.py for the basic ones)."""

from roundel.common.engine.deadlock import deadlocked_ranks, describe
from roundel.common.engine.negotiation import JOIN_NAME, Negotiator
from roundel.common.control.records import OpKind, Request


def wait_for(name, set_id=0, kind="allreduce"):
    return ((set_id, name, kind),)


def negotiator(size, submitted, process_sets=None):
    n = Negotiator(size, 0)
    for set_id, ranks in (process_sets or {}).items():
        n.add_process_set(set_id, ranks)
    for rank, names in submitted.items():
        for set_id, name in names:
            n.submit(rank, Request(name, OpKind.ALLREDUCE, set_id, "float32", (1,)), 0.0)
    return n


def test_a_cycle_through_three_ranks_is_deadlocked_as_a_whole():
    n = negotiator(3, {0: [(0, "a")], 1: [(0, "b")], 2: [(0, "c")]})
    waits = {0: wait_for("a"), 1: wait_for("b"), 2: wait_for("c")}
    assert sorted(deadlocked_ranks(waits, n.live_ranks(), n.missing_ranks)) == [0, 1, 2]


def test_a_rank_with_one_completable_wait_among_several_is_not_stuck():
    # rank 0 waits on 'a' (which rank 1 will never submit) and on 'b' (which only needs free rank 2)
    n = negotiator(3, {0: [(0, "a"), (0, "b")], 1: [(0, "x"), (0, "b")]})
    waits = {0: wait_for("a") + wait_for("b"), 1: wait_for("x")}
    stuck = deadlocked_ranks(waits, n.live_ranks(), n.missing_ranks)
    assert stuck == {}


def test_process_sets_are_told_apart_and_named_in_the_description():
    n = negotiator(3, {0: [(1, "p")], 2: [(0, "q")]}, {1: (0, 2)})
    waits = {0: wait_for("p", set_id=1), 2: wait_for("q")}
    # 'p' (set 1) needs rank 2, blocked on 'q' (set 0), which needs rank 0: free rank 1 cannot help
    stuck = deadlocked_ranks(waits, n.live_ranks(), n.missing_ranks)
    assert stuck == waits
    assert describe(stuck, n.missing_ranks) == (
        "rank 0 waits for allreduce 'p' in process set 1 (not submitted by rank 2); "
        "rank 2 waits for allreduce 'q' (not submitted by ranks 0, 1)")


def test_only_ranks_whose_waits_all_depend_on_stuck_ranks_are_reported():
    n = negotiator(3, {0: [(1, "p")], 2: [(0, "q")], 1: [(0, "q")]}, {1: (0, 2)})
    waits = {0: wait_for("p", set_id=1), 1: wait_for("q"), 2: wait_for("q")}
    stuck = deadlocked_ranks(waits, n.live_ranks(), n.missing_ranks)
    assert stuck == waits
    assert describe(stuck, n.missing_ranks) == (
        "rank 0 waits for allreduce 'p' in process set 1 (not submitted by rank 2); "
        "rank 1 waits for allreduce 'q' (not submitted by rank 0); "
        "rank 2 waits for allreduce 'q' (not submitted by rank 0)")


def test_ranks_that_left_are_neither_free_nor_reported():
    n = negotiator(3, {0: [(0, "a")], 1: [(0, "a")]})
    n.rank_left(2, "gone")
    n.take_direct()
    n.submit(0, Request("b", OpKind.ALLREDUCE, 0, "float32", (1,)), 0.0)
    waits = {0: wait_for("b"), 2: wait_for("c")}
    assert deadlocked_ranks(waits, n.live_ranks(), n.missing_ranks) == {}  # 'b' failed at once: not pending


def test_an_allreduce_does_not_wait_for_a_joined_rank():
    n = negotiator(2, {})
    n.submit(0, Request(JOIN_NAME, OpKind.JOIN, 0), 0.0)
    n.submit(1, Request("a", OpKind.ALLREDUCE, 0, "float32", (1,)), 0.0)  # runs without rank 0
    assert n.missing_ranks(0, "a") is None
    waits = {0: wait_for(JOIN_NAME, kind="join"), 1: wait_for("a")}
    assert deadlocked_ranks(waits, n.live_ranks(), n.missing_ranks) == {}


def test_a_join_and_a_name_nobody_else_submits_deadlock_when_the_others_are_blocked():
    n = negotiator(3, {1: [(0, "x")]})
    n.submit(0, Request(JOIN_NAME, OpKind.JOIN, 0), 0.0)
    waits = {0: wait_for(JOIN_NAME, kind="join"), 1: wait_for("x"), 2: wait_for("y")}
    n.submit(2, Request("y", OpKind.ALLREDUCE, 0, "float32", (1,)), 0.0)
    stuck = deadlocked_ranks(waits, n.live_ranks(), n.missing_ranks)
    assert sorted(stuck) == [0, 1, 2]
    text = describe(stuck, n.missing_ranks)
    assert "rank 0 waits for join '__join__' (not submitted by ranks 1, 2)" in text
    assert "rank 1 waits for allreduce 'x' (not submitted by rank 2)" in text
    assert "rank 2 waits for allreduce 'y' (not submitted by rank 1)" in text
