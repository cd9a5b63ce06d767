"""The coordinator's Negotiator on its own (no processes, no sockets).

Ranks are simulated by calling submit() with their requests; the batches
take() returns are what every rank would execute.
"""

import itertools
import random

import pytest

from roundel.common.engine.negotiation import JOIN_NAME, Negotiator
from roundel.ops import ReduceOp
from roundel.common.control.records import OpKind, Request
from roundel.common.engine.response_cache import RankCache


def allreduce(name, shape=(4,), dtype="float32", set_id=0, **fields):
    return Request(name, OpKind.ALLREDUCE, set_id, dtype, shape, **fields)


def allgather(name, shape=(2, 3), dtype="float32", set_id=0, **fields):
    return Request(name, OpKind.ALLGATHER, set_id, dtype, shape, **fields)


def join():
    return Request(JOIN_NAME, OpKind.JOIN, 0)


def submit_all(negotiator, requests_by_rank, now=0.0):
    for rank, requests in requests_by_rank.items():
        for request in requests:
            negotiator.submit(rank, request, now)


def names(batches):
    """The entry names of each batch, in execution order."""
    return [tuple(e.name for e in batch.entries) for _, batch in batches]


# ------------------------------------------------------------------ matching
@pytest.mark.parametrize("order", list(itertools.permutations("abc")))
def test_names_are_matched_across_ranks_whatever_the_submission_order(order):
    n = Negotiator(2, 0)
    submit_all(n, {0: [allreduce(x) for x in "abc"]})
    assert not n.has_ready() and n.take(1 << 20) == []
    for name in order:
        n.submit(1, allreduce(name), 0.0)
    batches = n.take(1 << 20)
    assert [sorted(e for e in entries) for entries in names(batches)] == [["a", "b", "c"]]
    assert all(members == (0, 1) and batch.error is None for members, batch in batches)
    assert not n.has_pending()


def test_ready_order_is_the_order_the_last_rank_completed_names():
    n = Negotiator(3, 0)
    submit_all(n, {0: [allreduce("x"), allreduce("y")], 1: [allreduce("y"), allreduce("x")]})
    assert n.missing_ranks(0, "x") == (2,)
    n.submit(2, allreduce("y"), 0.0)
    n.submit(2, allreduce("x"), 0.0)
    assert names(n.take(0)) == [("y",), ("x",)]  # threshold 0: one batch per name


def test_a_name_is_not_ready_until_every_member_submitted_it():
    n = Negotiator(3, 0)
    submit_all(n, {0: [allreduce("a")], 2: [allreduce("a")]})
    assert n.has_pending() and not n.has_ready()
    assert n.missing_ranks(0, "a") == (1,)
    assert n.missing_ranks(0, "other") is None
    n.submit(1, allreduce("a"), 0.0)
    assert n.has_ready() and not n.has_pending()
    assert n.missing_ranks(0, "a") is None


def test_a_name_can_be_reused_after_it_was_taken():
    n = Negotiator(2, 0)
    for _ in range(3):
        submit_all(n, {0: [allreduce("step")], 1: [allreduce("step")]})
        assert names(n.take(1 << 20)) == [("step",)]


# -------------------------------------------------------------------- fusion
def test_take_fuses_compatible_entries_up_to_the_threshold():
    n = Negotiator(2, 0)
    requests = [allreduce(f"t{i}", shape=(4,)) for i in range(5)]  # 16 bytes each
    submit_all(n, {0: requests, 1: requests})
    assert names(n.take(48)) == [("t0", "t1", "t2"), ("t3", "t4")]


def test_threshold_zero_disables_fusion():
    n = Negotiator(2, 0)
    requests = [allreduce(f"t{i}") for i in range(3)]
    submit_all(n, {0: requests, 1: requests})
    assert names(n.take(0)) == [("t0",), ("t1",), ("t2",)]


def test_a_tensor_larger_than_the_threshold_runs_alone_and_order_is_kept():
    n = Negotiator(2, 0)
    requests = [allreduce("s1", shape=(1,)), allreduce("s2", shape=(1,)), allreduce("big", shape=(100,)),
                allreduce("s3", shape=(1,))]
    submit_all(n, {0: requests, 1: requests})
    assert names(n.take(64)) == [("s1", "s2"), ("big",), ("s3",)]


@pytest.mark.parametrize("different", [
    {"dtype": "float64"}, {"reduce_op": int(ReduceOp.Sum)}, {"prescale": 2.0}, {"postscale": 0.5},
    {"device": "cuda:0"}, {"set_id": 1},
])
def test_entries_that_differ_in_a_fusion_field_run_in_separate_batches(different):
    n = Negotiator(2, 0)
    n.add_process_set(1, (0, 1))
    requests = [allreduce("a"), allreduce("b", **different), allreduce("c")]
    submit_all(n, {0: requests, 1: requests})
    assert names(n.take(1 << 20)) == [("a", "c"), ("b",)]


def test_groups_fuse_with_everything_else_by_default():
    n = Negotiator(2, 0)
    requests = [allreduce("g.0", group="g"), allreduce("plain"), allreduce("g.1", group="g"),
                allreduce("h.0", group="h")]
    submit_all(n, {0: requests, 1: requests})
    assert names(n.take(1 << 20)) == [("g.0", "plain", "g.1", "h.0")]


def test_disable_group_fusion_fuses_each_group_only_with_itself():
    n = Negotiator(2, 0, separate_groups=True)
    requests = [allreduce("g.0", group="g"), allreduce("plain"), allreduce("h.0", group="h"),
                allreduce("g.1", group="g"), allreduce("other"), allreduce("h.1", group="h")]
    submit_all(n, {0: requests, 1: requests})
    assert names(n.take(1 << 20)) == [("g.0", "g.1"), ("plain", "other"), ("h.0", "h.1")]


def test_a_group_over_the_fusion_threshold_is_split_in_order():
    n = Negotiator(2, 0, separate_groups=True)
    requests = [allreduce(f"g.{i}", group="g") for i in range(3)]  # 16 bytes each
    submit_all(n, {0: requests, 1: requests})
    assert names(n.take(32)) == [("g.0", "g.1"), ("g.2",)]


def test_allgather_fusion_counts_every_rank_s_rows():
    n = Negotiator(2, 0)
    # each entry gathers 3 + 5 rows of 2 float32 = 64 bytes
    submit_all(n, {0: [allgather("g1", (3, 2)), allgather("g2", (3, 2))],
                   1: [allgather("g1", (5, 2)), allgather("g2", (5, 2))]})
    assert names(n.take(127)) == [("g1",), ("g2",)]
    submit_all(n, {0: [allgather("g1", (3, 2)), allgather("g2", (3, 2))],
                   1: [allgather("g1", (5, 2)), allgather("g2", (5, 2))]})
    batches = n.take(128)
    assert names(batches) == [("g1", "g2")]
    assert [e.first_dims for e in batches[0][1].entries] == [(3, 5), (3, 5)]


@pytest.mark.parametrize("kind", [OpKind.ALLTOALL, OpKind.REDUCESCATTER])
def test_alltoall_and_reducescatter_are_never_fused(kind):
    n = Negotiator(2, 0)
    splits = (1, 1) if kind == OpKind.ALLTOALL else None
    requests = [Request(name, kind, 0, "float32", (2,), splits=splits) for name in ("a", "b")]
    submit_all(n, {0: requests, 1: requests})
    assert names(n.take(1 << 20)) == [("a",), ("b",)]


def test_alltoall_entry_carries_every_sender_s_splits():
    n = Negotiator(2, 0)
    n.submit(0, Request("x", OpKind.ALLTOALL, 0, "float32", (3, 2), splits=(1, 2)), 0.0)
    n.submit(1, Request("x", OpKind.ALLTOALL, 0, "float32", (4, 2), splits=(4, 0)), 0.0)
    [(_, batch)] = n.take(0)
    assert batch.error is None and batch.entries[0].splits == ((1, 2), (4, 0))


# ----------------------------------------------------------------- mismatches
BASE = {
    OpKind.ALLREDUCE: Request("t", OpKind.ALLREDUCE, 0, "float32", (2, 3)),
    OpKind.BROADCAST: Request("t", OpKind.BROADCAST, 0, "float32", (2, 3), root_rank=0),
    OpKind.REDUCESCATTER: Request("t", OpKind.REDUCESCATTER, 0, "float32", (2, 3)),
    OpKind.ALLGATHER: Request("t", OpKind.ALLGATHER, 0, "float32", (2, 3)),
    OpKind.ALLTOALL: Request("t", OpKind.ALLTOALL, 0, "float32", (2, 3), splits=(1, 1)),
    OpKind.BARRIER: Request("t", OpKind.BARRIER, 0, "", (0, 1)),
}

MISMATCHES = [
    (OpKind.ALLREDUCE, {"kind": OpKind.ALLGATHER}, "collective operations", "'allgather'"),
    (OpKind.ALLREDUCE, {"dtype": "float64"}, "allreduce data types", "'float64'"),
    (OpKind.ALLGATHER, {"dtype": "int32"}, "allgather data types", "'int32'"),
    (OpKind.BROADCAST, {"device": "cuda:0"}, "broadcast devices", "'cuda:0'"),
    (OpKind.ALLREDUCE, {"reduce_op": int(ReduceOp.Max)}, "allreduce reduction ops", "'Max'"),
    (OpKind.REDUCESCATTER, {"reduce_op": int(ReduceOp.Sum)}, "reducescatter reduction ops", "'Sum'"),
    (OpKind.ALLREDUCE, {"prescale": 3.0}, "allreduce prescale factors", "3.0"),
    (OpKind.REDUCESCATTER, {"postscale": 0.25}, "reducescatter postscale factors", "0.25"),
    (OpKind.ALLREDUCE, {"shape": (3, 2)}, "allreduce tensor shapes", "(3, 2)"),
    (OpKind.BROADCAST, {"shape": (2,)}, "broadcast tensor shapes", "(2,)"),
    (OpKind.REDUCESCATTER, {"shape": (4, 3)}, "reducescatter tensor shapes", "(4, 3)"),
    (OpKind.ALLGATHER, {"shape": (2,)}, "allgather tensor ranks", "1"),
    (OpKind.ALLGATHER, {"shape": (2, 4)}, "allgather tensor shapes (beyond the first dimension)", "(4,)"),
    (OpKind.ALLTOALL, {"shape": (2, 3, 1)}, "alltoall tensor ranks", "3"),
    (OpKind.ALLTOALL, {"shape": (2, 5)}, "alltoall tensor shapes (beyond the first dimension)", "(5,)"),
    (OpKind.BARRIER, {"shape": (0, 2)}, "barrier process set ranks", "(0, 2)"),
    (OpKind.BROADCAST, {"root_rank": 1}, "broadcast root ranks", "1"),
]


@pytest.mark.parametrize("kind, change, what, shown", MISMATCHES,
                         ids=[f"{k.label}-{next(iter(c))}" for k, c, _, _ in MISMATCHES])
def test_each_field_that_must_agree_is_checked(kind, change, what, shown):
    n = Negotiator(3, 0)
    base = BASE[kind]
    odd = base._replace(**change)
    if kind == OpKind.ALLTOALL:
        base, odd = base._replace(splits=(1, 1, 0)), odd._replace(splits=(1, 1, 0))
    submit_all(n, {0: [base], 1: [odd], 2: [base]})
    [(members, batch)] = n.take(1 << 20)
    assert members == (0, 1, 2) and batch.error_type == "mismatch"
    assert f"Mismatched {what} for 't'" in batch.error
    assert "ranks 0, 2:" in batch.error and f"rank 1: {shown}" in batch.error


@pytest.mark.parametrize("kind", [OpKind.ALLGATHER, OpKind.ALLTOALL])
def test_first_dimensions_may_differ_where_the_op_allows_it(kind):
    n = Negotiator(2, 0)
    splits = (1, 1) if kind == OpKind.ALLTOALL else None
    n.submit(0, Request("t", kind, 0, "float32", (2, 3), splits=splits), 0.0)
    n.submit(1, Request("t", kind, 0, "float32", (7, 3), splits=(splits and (3, 4))), 0.0)
    [(_, batch)] = n.take(0)
    assert batch.error is None


def test_a_rank_s_own_error_fails_the_name_everywhere():
    n = Negotiator(2, 0)
    n.submit(0, allreduce("a"), 0.0)
    n.submit(1, allreduce("a", error="tensor is on the wrong device"), 0.0)
    [(members, batch)] = n.take(0)
    assert members == (0, 1)
    assert batch.error == "'a' failed on rank(s) 1: rank 1: tensor is on the wrong device"


@pytest.mark.parametrize("request_, message", [
    (Request("b", OpKind.BROADCAST, 0, "float32", (1,), root_rank=5), "root_rank 5 is not a member"),
    (Request("r", OpKind.REDUCESCATTER, 0, "float32", ()), "a 0-d tensor cannot be scattered"),
    (Request("x", OpKind.ALLTOALL, 0, "float32", (3,), splits=(1, 1, 1)), "gave 3 splits but the process set has 2"),
])
def test_requests_that_agree_but_cannot_run_fail(request_, message):
    n = Negotiator(2, 0)
    submit_all(n, {0: [request_], 1: [request_]})
    [(_, batch)] = n.take(0)
    assert message in batch.error


# ---------------------------------------------------------------------- join
def test_joined_ranks_let_allreduce_run_without_them():
    n = Negotiator(3, 0)
    n.submit(2, join(), 0.0)
    submit_all(n, {0: [allreduce("a")], 1: [allreduce("a")]})
    [(members, batch)] = n.take(0)
    assert members == (0, 1, 2) and batch.error is None and batch.joined == (2,)


def test_joining_completes_names_that_only_waited_for_the_joiner():
    n = Negotiator(2, 0)
    n.submit(0, allreduce("a"), 0.0)
    assert not n.has_ready()
    n.submit(1, join(), 0.0)
    [(_, batch)] = n.take(0)
    assert batch.entries[0].name == "a" and batch.joined == (1,)


@pytest.mark.parametrize("kind", [OpKind.ALLGATHER, OpKind.BROADCAST, OpKind.ALLTOALL, OpKind.REDUCESCATTER])
def test_ops_that_cannot_run_with_joined_ranks_fail(kind):
    n = Negotiator(2, 0)
    n.submit(1, join(), 0.0)
    n.submit(0, Request("t", kind, 0, "float32", (2,), root_rank=0, splits=(1, 1)), 0.0)
    [(_, batch)] = n.take(0)
    assert "cannot run while rank(s) 1 have called join()" in batch.error


def test_broadcast_from_a_joined_root_fails():
    n = Negotiator(3, 0)
    n.submit(0, join(), 0.0)
    request = Request("b", OpKind.BROADCAST, 0, "float32", (1,), root_rank=0)
    submit_all(n, {1: [request], 2: [request]})
    [(_, batch)] = n.take(0)
    assert batch.error  # broadcast is refused with joined ranks at all; the root's join is one more reason


def test_join_completes_when_every_live_rank_joined_and_reports_the_last():
    n = Negotiator(3, 0)
    for rank in (2, 0):
        n.submit(rank, join(), 0.0)
        assert not n.has_ready()
    assert n.missing_ranks(0, JOIN_NAME) == (1,)
    n.submit(1, join(), 0.0)
    [(members, batch)] = n.take(0)
    assert batch.kind == OpKind.JOIN and members == (0, 1, 2)
    assert batch.joined == (2, 0, 1) and batch.last_joined == 1
    n.submit(0, allreduce("after"), 0.0)  # joins are over: 'after' needs everyone again
    assert not n.has_ready()


def test_names_run_with_joined_ranks_are_not_cached():
    n = Negotiator(2, 16)
    n.submit(1, join(), 0.0)
    n.submit(0, allreduce("a"), 0.0)
    [(_, batch)] = n.take(0)
    assert batch.entries[0].cache_bit == -1


# ---------------------------------------------------------------- rank_left
def test_a_rank_leaving_fails_its_pending_names_on_the_others():
    n = Negotiator(3, 0)
    submit_all(n, {0: [allreduce("a")], 2: [allreduce("a")]})
    n.rank_left(1, "rank 1 exited")
    assert not n.has_pending() and n.has_direct()
    [(targets, batch)] = n.take_direct()
    assert targets == (0, 2) and batch.error_type == "internal"
    assert batch.error == "'a' cannot complete: rank 1 exited"
    assert n.live_ranks() == [0, 2]


def test_a_name_submitted_after_a_member_left_fails_at_once():
    n = Negotiator(2, 0)
    n.rank_left(1, "gone")
    n.submit(0, allreduce("late"), 0.0)
    [(targets, batch)] = n.take_direct()
    assert targets == (0,) and batch.error_type == "internal"
    assert "rank(s) 1 of its process set have already shut down" in batch.error


def test_a_rank_leaving_fails_the_ranks_waiting_in_join():
    n = Negotiator(3, 0)
    n.submit(1, join(), 0.0)
    n.submit(0, join(), 0.0)
    n.rank_left(2, "rank 2 died")
    [(targets, batch)] = n.take_direct()
    assert targets == (1, 0) and batch.kind == OpKind.JOIN
    assert batch.error == "join() cannot complete: rank 2 died"
    n.submit(0, join(), 0.0)  # a later join cannot complete either
    [(targets, batch)] = n.take_direct()
    assert targets == (0,) and "rank(s) 2 of its process set have already shut down" in batch.error


def test_names_of_other_process_sets_survive_a_rank_leaving():
    n = Negotiator(3, 0)
    n.add_process_set(1, (0, 2))
    n.submit(0, allreduce("a", set_id=1), 0.0)
    n.rank_left(1, "gone")
    assert n.take_direct() == [] and n.missing_ranks(1, "a") == (2,)
    n.submit(2, allreduce("a", set_id=1), 0.0)
    [(members, batch)] = n.take(0)
    assert members == (0, 2) and batch.error is None


# ------------------------------------------------------------------- stalls
def test_stalled_reports_each_waiting_name_once():
    n = Negotiator(3, 0)
    n.submit(0, allreduce("a"), 10.0)
    n.submit(2, allreduce("a"), 11.0)
    n.submit(1, allreduce("b"), 30.0)
    assert n.stalled(40.0, 60.0) == []
    report = n.stalled(75.0, 60.0)
    assert report == [("a", 0, [1], [0, 2], 65.0)]
    assert n.stalled(100.0, 60.0) == [("b", 0, [0, 2], [1], 70.0)]  # 'a' already reported
    assert n.has_pending()


def test_stalled_does_not_count_joined_ranks_as_missing():
    n = Negotiator(3, 0)
    n.submit(0, allreduce("a"), 0.0)
    n.submit(1, join(), 0.0)
    assert n.stalled(100.0, 1.0) == [("a", 0, [2], [0], 100.0)]


def test_fail_stalled_shuts_down_names_past_the_limit_on_every_member():
    n = Negotiator(3, 0)
    n.submit(0, allreduce("old"), 0.0)
    n.submit(0, allreduce("new"), 50.0)
    n.fail_stalled(60.0, 60.0)
    [(targets, batch)] = n.take_direct()
    assert targets == (0, 1, 2) and batch.error_type == "internal"
    assert batch.error.startswith("'old' stalled for 60 s waiting for rank(s) 1, 2")
    assert n.missing_ranks(0, "new") == (1, 2) and n.missing_ranks(0, "old") is None


# ------------------------------------------------------------- process sets
def test_a_process_set_name_needs_only_its_members():
    n = Negotiator(4, 0)
    n.add_process_set(3, (1, 3))
    n.submit(1, allreduce("p", set_id=3), 0.0)
    n.submit(3, allreduce("p", set_id=3), 0.0)
    n.submit(0, allreduce("p"), 0.0)  # the same name in the global set is a different collective
    [(members, batch)] = n.take(0)
    assert members == (1, 3) and batch.process_set_id == 3
    assert n.missing_ranks(0, "p") == (1, 2, 3)


def test_submissions_to_unknown_sets_or_from_non_members_fail_for_that_rank():
    n = Negotiator(3, 0)
    n.add_process_set(1, (0, 1))
    n.submit(2, allreduce("a", set_id=1), 0.0)
    n.submit(0, allreduce("b", set_id=9), 0.0)
    failures = n.take_direct()
    assert [(targets, batch.error_type) for targets, batch in failures] == [((2,), "mismatch"), ((0,), "mismatch")]
    assert "rank 2 is not a member of process set 1 [0, 1]" in failures[0][1].error
    assert "process set 9 is not registered" in failures[1][1].error
    n.remove_process_set(1)
    n.submit(0, allreduce("c", set_id=1), 0.0)
    assert "process set 1 is not registered" in n.take_direct()[0][1].error


def test_barrier_of_a_process_set_is_ready_with_its_members():
    n = Negotiator(3, 0)
    n.add_process_set(1, (0, 2))
    barrier = Request("__barrier__.1", OpKind.BARRIER, 1, "", (0, 2))
    submit_all(n, {0: [barrier], 2: [barrier]})
    [(members, batch)] = n.take(1 << 20)
    assert members == (0, 2) and batch.kind == OpKind.BARRIER and batch.error is None


# -------------------------------------------------------------------- cache
def test_agreed_names_get_cache_bits_and_can_then_be_submitted_by_bit():
    n = Negotiator(2, 4)
    submit_all(n, {0: [allreduce("a")], 1: [allreduce("a")]})
    [(_, batch)] = n.take(0)
    bit = batch.entries[0].cache_bit
    assert bit >= 0
    version = n.cache.version
    assert n.submit_bit(0, bit, version, 1.0) and n.submit_bit(1, bit, version, 1.0)
    [(_, again)] = n.take(0)
    assert again.entries[0].name == "a" and again.entries[0].cache_bit == bit


def test_names_marked_uncacheable_or_a_zero_capacity_cache_get_no_bit():
    n = Negotiator(2, 4)
    submit_all(n, {0: [allreduce("a", cacheable=False)], 1: [allreduce("a")]})
    assert n.take(0)[0][1].entries[0].cache_bit == -1
    n = Negotiator(2, 0)
    submit_all(n, {0: [allreduce("a")], 1: [allreduce("a")]})
    assert n.take(0)[0][1].entries[0].cache_bit == -1


def test_a_bit_used_after_its_entry_was_evicted_is_refused():
    n = Negotiator(2, 1)
    submit_all(n, {0: [allreduce("a")], 1: [allreduce("a")]})
    bit_a = n.take(0)[0][1].entries[0].cache_bit
    version_a = n.cache.version
    submit_all(n, {0: [allreduce("b")], 1: [allreduce("b")]})
    bit_b = n.take(0)[0][1].entries[0].cache_bit
    assert bit_b == bit_a  # capacity 1: 'b' took over the only bit
    assert n.take_evictions() == [(bit_a, (0, "a"))]
    assert not n.submit_bit(0, bit_a, version_a, 0.0)  # the rank still thinks the bit means 'a'
    assert n.submit_bit(0, bit_b, n.cache.version, 0.0)
    assert n.missing_ranks(0, "b") == (1,)
    assert not n.submit_bit(0, 3, n.cache.version, 0.0)  # a bit never assigned


def _steady_state(n, names_, ranks=(0, 1)):
    """Negotiate ``names_`` once in full, then submit them again as rank 0's request and the others' bits."""
    submit_all(n, {r: [allreduce(x) for x in names_] for r in ranks})
    first = n.take(1 << 30)
    version = n.cache.version
    bits = {e.name: e.cache_bit for _, batch in first for e in batch.entries}
    for name in reversed(names_):  # another order than the first time
        n.submit(0, allreduce(name), 1.0)
        for rank in ranks[1:]:
            assert n.submit_bit(rank, bits[name], version, 1.0)
    return first, bits


def test_a_batch_every_other_rank_sent_as_bits_goes_back_as_bits_in_bit_order():
    n = Negotiator(3, 8)
    first, bits = _steady_state(n, ["c", "a", "b"], ranks=(0, 1, 2))
    assert all(n.compact_form(batch) is None for _, batch in first)  # the bits were new then
    [(members, batch)] = n.take(1 << 30)
    assert [e.cache_bit for e in batch.entries] == sorted(bits.values())  # ranks rebuild it in bit order
    compact = n.compact_form(batch)
    assert compact is not None and compact.kind == OpKind.ALLREDUCE and compact.process_set_id == 0
    assert compact.bits == sum(1 << b for b in bits.values())


def test_a_batch_with_a_fully_sent_request_is_sent_in_full():
    n = Negotiator(2, 8)
    submit_all(n, {0: [allreduce("a")], 1: [allreduce("a")]})
    n.take(0)
    submit_all(n, {0: [allreduce("a")], 1: [allreduce("a")]})  # rank 1 sent it in full this time
    [(_, batch)] = n.take(0)
    assert n.compact_form(batch) is None


def test_bits_are_not_used_for_an_entry_evicted_in_the_same_dispatch():
    n = Negotiator(2, 1)
    _steady_state(n, ["a"])
    submit_all(n, {0: [allreduce("b")], 1: [allreduce("b")]})  # 'b' takes the only bit in this take
    batches = n.take(0)
    assert [n.compact_form(batch) for _, batch in batches] == [None, None]


def test_a_changed_request_is_checked_again_and_sent_in_full():
    n = Negotiator(2, 8)
    _, bits = _steady_state(n, ["a"])
    n.take(0)
    n.submit(0, allreduce("a", shape=(5,)), 2.0)  # rank 0's request changed: not the cached one
    assert n.submit_bit(1, bits["a"], n.cache.version, 2.0)
    [(_, batch)] = n.take(0)
    assert batch.error is not None and "shape" in batch.error and n.compact_form(batch) is None


def test_removing_a_process_set_evicts_its_cached_names():
    n = Negotiator(2, 8)
    n.add_process_set(1, (0, 1))
    submit_all(n, {0: [allreduce("g"), allreduce("s", set_id=1)], 1: [allreduce("g"), allreduce("s", set_id=1)]})
    bits = {batch.entries[0].name: batch.entries[0].cache_bit for _, batch in n.take(0)}
    assert n.take_evictions() == []
    n.remove_process_set(1)
    assert n.take_evictions() == [(bits["s"], (1, "s"))]
    assert n.cache.get_bit((0, "g")) == bits["g"]


def test_fail_stalled_does_not_name_joined_ranks_as_missing():
    n = Negotiator(3, 0)
    n.submit(0, allreduce("a"), 0.0)
    n.submit(1, join(), 0.0)
    n.fail_stalled(100.0, 60.0)
    [(targets, batch)] = n.take_direct()
    assert "waiting for rank(s) 2;" in batch.error


def test_removing_a_process_set_fails_its_pending_names_and_later_joins_still_work():
    n = Negotiator(2, 0)
    n.add_process_set(1, (0, 1))
    n.submit(0, allreduce("left-behind", set_id=1), 0.0)  # rank 1 never submits it
    n.remove_process_set(1)
    [(targets, batch)] = n.take_direct()
    assert targets == (0,) and batch.entries[0].name == "left-behind"
    assert "process set 1 was removed" in batch.error
    assert not n.has_pending()
    for rank in (0, 1):
        n.submit(rank, join(), 0.0)
    [(_, done)] = n.take(0)
    assert done.kind == OpKind.JOIN and done.error is None


# ------------------------------------------------- masks of cache bits (the steady state at scale)
def _cached_names(n, names_, ranks):
    """Negotiate ``names_`` once in full among ``ranks``; returns their bits."""
    submit_all(n, {r: [allreduce(x) for x in names_] for r in ranks})
    return {e.name: e.cache_bit for _, batch in n.take(1 << 30) for e in batch.entries}


def _masks(n, bits, names_, ranks, now=1.0):
    mask = sum(1 << bits[name] for name in names_)
    for rank in ranks:
        assert n.submit_bits(rank, mask, n.cache.version, now) == []


@pytest.mark.parametrize("size", [2, 3, 1024])
def test_masks_from_every_rank_make_the_same_batches_as_bits_one_by_one(size):
    n = Negotiator(size, 64)
    names_ = [f"g{i}" for i in range(10)]
    bits = _cached_names(n, names_, range(size))
    for _ in range(3):  # several steady cycles
        for name in names_:
            n.submit(0, allreduce(name), 1.0)
        assert not n.has_ready()  # rank 0 alone
        _masks(n, bits, names_, range(1, size))
        [(members, batch)] = n.take(1 << 30)
        assert members == tuple(range(size)) and batch.error is None
        assert sorted(e.name for e in batch.entries) == sorted(names_)
        compact = n.compact_form(batch)
        assert compact is not None and compact.bits == sum(1 << b for b in bits.values())
        assert not n.has_pending()


def test_a_name_one_rank_has_not_sent_waits_and_is_reported_with_that_rank():
    n = Negotiator(5, 8)
    bits = _cached_names(n, ["a", "b"], range(5))
    n.submit(0, allreduce("a"), 10.0)
    n.submit(0, allreduce("b"), 10.0)
    _masks(n, bits, ["a", "b"], (1, 2, 4), now=10.0)
    _masks(n, bits, ["b"], (3,), now=10.0)
    [(_, batch)] = n.take(1 << 30)
    assert [e.name for e in batch.entries] == ["b"]
    assert n.has_pending() and n.missing_ranks(0, "a") == (3,)
    assert n.stalled(11.0, 60.0) == []
    [(name, _, missing, present, waited)] = n.stalled(80.0, 60.0)
    assert (name, missing, present, waited) == ("a", [3], [0, 1, 2, 4], 70.0)
    n.submit_bits(3, 1 << bits["a"], n.cache.version, 81.0)  # it comes at last, per rank now
    [(_, batch)] = n.take(1 << 30)
    assert [e.name for e in batch.entries] == ["a"] and batch.error is None


def test_a_stall_shutdown_fails_a_name_held_as_masks_on_every_member():
    n = Negotiator(4, 8)
    bits = _cached_names(n, ["a"], range(4))
    _masks(n, bits, ["a"], (1, 2), now=0.0)  # neither rank 0 nor rank 3 sent it
    n.fail_stalled(100.0, 60.0)
    [(members, batch)] = n.take(1 << 30)
    assert members == (0, 1, 2, 3) and "stalled" in batch.error and "rank(s) 0, 3" in batch.error


def test_a_rank_sending_a_name_in_full_while_the_others_send_bits_still_completes_it():
    n = Negotiator(4, 8)
    bits = _cached_names(n, ["a"], range(4))
    _masks(n, bits, ["a"], (1, 2))
    n.submit(3, allreduce("a"), 1.0)  # e.g. a rank whose view of the cache was stale
    assert not n.has_ready()
    n.submit(0, allreduce("a"), 1.0)
    [(_, batch)] = n.take(1 << 30)
    assert batch.error is None and [e.name for e in batch.entries] == ["a"]
    assert n.compact_form(batch) is None and not n.has_pending()
    n.submit(0, allreduce("a"), 2.0)  # the next cycle is all masks again
    _masks(n, bits, ["a"], (1, 2, 3), now=2.0)
    [(_, batch)] = n.take(1 << 30)
    assert n.compact_form(batch) is not None


def test_rank_zero_changing_a_request_the_others_sent_as_bits_is_a_mismatch():
    n = Negotiator(3, 8)
    bits = _cached_names(n, ["a"], range(3))
    _masks(n, bits, ["a"], (1, 2))
    n.submit(0, allreduce("a", shape=(5,)), 1.0)
    [(_, batch)] = n.take(1 << 30)
    assert batch.error is not None and "shape" in batch.error and "rank 0" in batch.error


def test_a_process_set_without_rank_zero_completes_from_its_members_masks_alone():
    n = Negotiator(5, 8)
    n.add_process_set(1, (2, 3, 4))
    submit_all(n, {r: [allreduce("s", set_id=1)] for r in (2, 3, 4)})
    bit = n.take(1 << 30)[0][1].entries[0].cache_bit
    for rank in (2, 3):
        n.submit_bits(rank, 1 << bit, n.cache.version, 1.0)
    assert not n.has_ready()
    n.submit_bits(4, 1 << bit, n.cache.version, 1.0)
    [(members, batch)] = n.take(1 << 30)
    assert members == (2, 3, 4) and batch.error is None and n.compact_form(batch) is not None


def test_a_rank_leaving_fails_the_names_others_sent_as_masks():
    n = Negotiator(3, 8)
    bits = _cached_names(n, ["a"], range(3))
    n.submit(0, allreduce("a"), 1.0)
    _masks(n, bits, ["a"], (1,))
    n.rank_left(2, "rank 2 died")
    [(members, batch)] = n.take(1 << 30)
    assert members == (0, 1) and "rank 2 died" in batch.error and not n.has_pending()


def test_a_join_while_names_are_held_as_masks_lets_them_complete_with_the_joined_rank():
    n = Negotiator(3, 8)
    bits = _cached_names(n, ["a"], range(3))
    n.submit(0, allreduce("a"), 1.0)
    _masks(n, bits, ["a"], (1,))
    n.submit(2, join(), 1.0)
    batches = n.take(1 << 30)
    assert names(batches) == [("a",)] and batches[0][1].joined == (2,)


def test_bits_still_held_as_masks_survive_the_eviction_of_their_entry():
    n = Negotiator(2, 1)
    bits = _cached_names(n, ["a"], range(2))
    _masks(n, bits, ["a"], (1,))  # rank 1 sent 'a' by bit; rank 0 has not yet
    submit_all(n, {0: [allreduce("b")], 1: [allreduce("b")]})
    n.take(1 << 30)  # 'b' takes the only bit, evicting 'a'
    n.submit(0, allreduce("a"), 2.0)
    [(_, batch)] = n.take(1 << 30)
    assert [e.name for e in batch.entries] == ["a"] and batch.error is None


def test_stale_bits_in_a_mask_are_returned_for_a_resend():
    n = Negotiator(2, 1)
    bit_a = _cached_names(n, ["a"], range(2))["a"]
    version_a = n.cache.version
    _cached_names(n, ["b"], range(2))  # 'b' took over the bit
    assert n.submit_bits(1, 1 << bit_a, version_a, 1.0) == [bit_a]
    assert not n.has_pending()


def test_rank_zero_s_own_mask_completes_names_like_any_rank_s():
    n = Negotiator(4, 8)
    bits = _cached_names(n, ["a", "b"], range(4))
    for order in ((0, 1, 2, 3), (3, 2, 1, 0), (1, 0, 3, 2)):  # rank 0's mask first, last, between
        for rank in order[:-1]:
            _masks(n, bits, ["a", "b"], (rank,))
            assert not n.has_ready()
        _masks(n, bits, ["a", "b"], order[-1:])
        [(members, batch)] = n.take(1 << 30)
        assert members == (0, 1, 2, 3) and batch.error is None
        assert [e.name for e in batch.entries] == sorted(["a", "b"], key=bits.get)
        assert n.compact_form(batch).bits == (1 << bits["a"]) | (1 << bits["b"])
        assert not n.has_pending()


def test_rank_zero_sending_a_cached_name_in_full_makes_the_others_masks_count_rank_by_rank():
    n = Negotiator(3, 8)
    bits = _cached_names(n, ["a", "b"], range(3))
    _masks(n, bits, ["a", "b"], (1, 2))
    n.submit(0, allreduce("a"), 1.0)  # with data to reduce, say, or a changed view
    _masks(n, bits, ["b"], (0,))
    batches = n.take(1 << 30)
    assert sorted(name for batch in names(batches) for name in batch) == ["a", "b"]
    assert all(batch.error is None for _, batch in batches) and not n.has_pending()


@pytest.mark.parametrize("size, seed", [(3, 0), (16, 1), (64, 2), (64, 3)])
def test_masks_arriving_in_pieces_in_any_order_complete_a_name_exactly_when_its_last_member_sent_it(size, seed):
    rng = random.Random(seed)
    n = Negotiator(size, 64)
    n.add_process_set(1, tuple(range(0, size, 2)))
    everyone = [f"g{i}" for i in range(12)]
    evens = [f"e{i}" for i in range(4)]
    submit_all(n, {r: [allreduce(x) for x in everyone] + ([allreduce(x, set_id=1) for x in evens] if r % 2 == 0
                                                        else []) for r in range(size)})
    bits = {e.name: e.cache_bit for _, batch in n.take(1 << 30) for e in batch.entries}
    members = {**{name: set(range(size)) for name in everyone}, **{name: set(range(0, size, 2)) for name in evens}}
    for _ in range(3):  # steady cycles: each rank sends its names as a few masks, ranks interleaved at random
        queued = {}
        for rank in range(size):
            mine = everyone + (evens if rank % 2 == 0 else [])
            rng.shuffle(mine)
            cuts = sorted(rng.sample(range(1, len(mine)), 2))
            queued[rank] = [mine[:cuts[0]], mine[cuts[0]:cuts[1]], mine[cuts[1]:]]
        turns = [rank for rank in range(size) for _ in range(3)]
        rng.shuffle(turns)
        pieces = [(rank, queued[rank].pop(0)) for rank in turns]
        sent: dict = {}
        done = set()
        for rank, part in pieces:
            assert n.submit_bits(rank, sum(1 << bits[x] for x in part), n.cache.version, 1.0) == []
            for name in part:
                sent.setdefault(name, set()).add(rank)
            expected = {name for name, ranks in sent.items() if ranks >= members[name]} - done
            ready = {e.name for _, batch in n.take(1 << 30) for e in batch.entries}
            assert ready == expected
            done |= ready
        assert done == set(everyone + evens) and not n.has_pending()


def test_a_name_cached_again_under_the_same_bit_runs_with_its_new_request():
    n = Negotiator(2, 1)
    bit = _cached_names(n, ["a"], range(2))["a"]
    _cached_names(n, ["b"], range(2))  # evicts 'a'
    submit_all(n, {r: [allreduce("a", shape=(5,))] for r in range(2)})
    [(_, batch)] = n.take(1 << 30)
    assert batch.entries[0].cache_bit == bit  # the only bit, reused
    n.take_evictions()  # sent with that batch
    _masks(n, {"a": bit}, ["a"], (0, 1))
    [(_, batch)] = n.take(1 << 30)
    assert batch.entries[0].request.shape == (5,) and n.compact_form(batch) is not None


def test_the_cache_gives_a_rank_s_bit_only_for_the_request_it_cached():
    n = Negotiator(2, 4)
    bit = _cached_names(n, ["a"], range(2))["a"]
    assert n.cache.bit_of((0, "a"), 0, allreduce("a")) == bit
    assert n.cache.bit_of((0, "a"), 0, allreduce("a", shape=(5,))) == -1
    assert n.cache.bit_of((0, "a"), 7, allreduce("a")) == -1
    assert n.cache.bit_of((0, "zzz"), 0, allreduce("zzz")) == -1


def _replayed(batches, evicted):
    """A rank's mirror after it applied one dispatch: the evictions, then each entry's bit in order."""
    mirror = RankCache()
    mirror.evict(evicted)
    for _, batch in batches:
        for entry in batch.entries:
            if entry.cache_bit >= 0:
                mirror.record((batch.process_set_id, entry.name), entry.cache_bit, entry.request)
    return mirror


def test_a_name_ready_from_masks_but_evicted_earlier_in_the_same_dispatch_is_cached_again_in_order():
    n = Negotiator(3, 1)
    bit = _cached_names(n, ["a"], range(3))["a"]
    n.take_evictions()
    submit_all(n, {r: [allreduce("c")] for r in range(3)})  # ready first: caching it evicts 'a'
    _masks(n, {"a": bit}, ["a"], range(3))
    batches = n.take(1 << 30)
    assert names(batches) == [("c", "a")]
    mirror = _replayed(batches, [b for b, _ in n.take_evictions()])
    assert n.cache.entry_key(bit) == (0, "a") and mirror.bit_for((0, "a"), allreduce("a")) == bit
    assert mirror.bit_for((0, "c"), allreduce("c")) == -1 and n.compact_form(batches[0][1]) is None


def test_the_same_names_ready_from_masks_again_make_the_same_batches_at_each_threshold():
    n = Negotiator(3, 16)
    names_ = [f"g{i}" for i in range(6)]
    bits = _cached_names(n, names_, range(3))
    n.take_evictions()
    seen = {}
    for threshold in (1 << 30, 32, 1 << 30, 32, 0):
        _masks(n, bits, names_, range(3))
        batches = n.take(threshold)
        got = (names(batches), [n.compact_form(batch).bits for _, batch in batches])
        assert seen.setdefault(threshold, got) == got
        assert not n.has_pending()
    assert len(seen[1 << 30][0]) == 1 and len(seen[32][0]) == 3 and len(seen[0][0]) == 6  # 16 bytes a name
    _masks(n, bits, names_[:2], range(3))  # fewer names ready: not the plan of six
    assert [name for batch in names(n.take(1 << 30)) for name in batch] == sorted(names_[:2], key=bits.get)


def test_a_name_submitted_again_before_it_is_cached_completes_when_the_others_send_its_bit():
    n = Negotiator(2, 8)
    submit_all(n, {0: [allreduce("a")], 1: [allreduce("a")]})
    n.submit(0, allreduce("a"), 1.0)  # the next step's, before the first is taken (and cached)
    [(_, batch)] = n.take(1 << 30)
    bit = batch.entries[0].cache_bit
    assert bit >= 0
    assert n.submit_bits(1, 1 << bit, n.cache.version, 2.0) == []
    [(_, batch)] = n.take(1 << 30)
    assert [e.name for e in batch.entries] == ["a"] and batch.error is None and not n.has_pending()


def test_names_ready_together_again_count_as_used_for_the_cache_s_eviction_order():
    n = Negotiator(2, 3)
    bits = _cached_names(n, ["a", "b", "c"], range(2))
    n.take_evictions()
    for together in (["a", "b"], ["c"], ["a", "b"]):  # the second time 'a' and 'b' are ready as a known group
        _masks(n, bits, together, range(2))
        assert [name for batch in names(n.take(1 << 30)) for name in batch] == together
    _cached_names(n, ["d"], range(2))  # a fourth name takes the least recently used one's bit: 'c'
    assert n.take_evictions() == [(bits["c"], (0, "c"))]


def test_names_held_as_masks_are_reported_stalled_from_when_their_bits_were_first_sent():
    n = Negotiator(3, 8)
    bits = _cached_names(n, ["a", "b", "c"], range(3))
    for names_, ranks, now in ((["a", "b"], (1, 2), 10.0), (["c"], (1,), 30.0), (["a"], (0,), 35.0)):
        _masks(n, bits, names_, ranks, now=now)
        n.has_ready()  # as the coordinator asks after every message
    assert names(n.take(1 << 30)) == [("a",)]  # 'b' and 'c' wait on
    assert n.stalled(50.0, 30.0) == [("b", 0, [0], [1, 2], 40.0)]  # 'c', first sent at 30, is not old enough
    assert n.stalled(70.0, 30.0) == [("c", 0, [0, 2], [1], 40.0)]
