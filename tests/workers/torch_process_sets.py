"""Process-set worker: ``torch_process_sets.py SCENARIO[,SCENARIO...]``.

Run under roundelrun with 3 or more ranks. ``init()`` registers two static
sets, the even and the odd ranks; scenarios add and remove others. Every
collective on a set is compared with a NumPy reference built from the
members' inputs only, and misuse (a non-member calling, a removed set) must
raise a clear error. Horovod's rules apply: ``add_process_set`` and
``remove_process_set`` are called by every rank in the same order, and
``root_rank`` of a broadcast is a global rank.
"""

from __future__ import annotations

import signal
import sys

import numpy as np
import torch

import roundel.torch as hvd
from _checks import check, expect_raises, make, run_scenarios, to_np

EVENS = hvd.ProcessSet(range(0, 64, 2))  # trimmed to the job's size below
ODDS = hvd.ProcessSet(range(1, 64, 2))


def _static_sets():
    import os
    size = int(os.environ["ROUNDEL_SIZE"])
    EVENS.ranks = [r for r in EVENS.ranks if r < size]
    ODDS.ranks = [r for r in ODDS.ranks if r < size]
    return [EVENS, ODDS]


hvd.init(process_sets=_static_sets())
RANK, SIZE = hvd.rank(), hvd.size()
assert SIZE >= 3, "run with at least 3 ranks"


def my_static_set():
    return EVENS if RANK % 2 == 0 else ODDS


def check_collectives(ps: hvd.ProcessSet, tag: str) -> None:
    """allreduce/allgather/broadcast/alltoall/reducescatter/barrier on ``ps`` against NumPy (members only)."""
    members = ps.ranks
    n = len(members)
    me = ps.rank()
    assert me == members.index(RANK), f"{tag}: ps.rank() {me}, expected {members.index(RANK)}"
    assert ps.size() == n and ps.included() is True, f"{tag}: size {ps.size()} included {ps.included()}"

    # allreduce: Sum and Average, async and in place, two dtypes submitted together (fusion)
    a = {r: make(r, f"{tag}.ar", (2, 3), torch.int32) for r in members}
    b = {r: make(r, f"{tag}.arf", (5,), torch.float32) for r in members}
    h1 = hvd.allreduce_async(a[RANK], name=f"{tag}.ar", op=hvd.Sum, process_set=ps)
    h2 = hvd.allreduce_async(b[RANK], name=f"{tag}.arf", op=hvd.Average, process_set=ps)
    inplace = b[RANK].clone()
    hvd.allreduce_(inplace, name=f"{tag}.ar_", op=hvd.Max, process_set=ps)
    check(hvd.synchronize(h1), sum(to_np(a[r]) for r in members), f"{tag}: allreduce Sum", torch.int32)
    check(hvd.synchronize(h2), sum(to_np(b[r]) for r in members) / n, f"{tag}: allreduce Average")
    check(inplace, np.max([to_np(b[r]) for r in members], axis=0), f"{tag}: allreduce_ Max")

    # allgather with a different first dimension per member
    g = {r: make(r, f"{tag}.ag", (members.index(r) + 1, 2), torch.int64) for r in members}
    check(hvd.allgather(g[RANK], name=f"{tag}.ag", process_set=ps),
          np.concatenate([to_np(g[r]) for r in members]), f"{tag}: allgather")

    # broadcast from every member (root_rank is a global rank, as in Horovod)
    for root in members:
        x = make(RANK, f"{tag}.bc{root}", (4,), torch.float64)
        check(hvd.broadcast(x, root, name=f"{tag}.bc{root}", process_set=ps),
              to_np(make(root, f"{tag}.bc{root}", (4,), torch.float64)), f"{tag}: broadcast from {root}")
    obj = hvd.broadcast_object({"from": RANK}, root_rank=members[-1], name=f"{tag}.obj", process_set=ps)
    assert obj == {"from": members[-1]}, f"{tag}: broadcast_object gave {obj}"

    # alltoall: member i sends (i + j + 1) rows to member j
    def a2a_input(r):
        i = members.index(r)
        splits = [i + j + 1 for j in range(n)]
        return make(r, f"{tag}.a2a", (sum(splits), 2), torch.float32), splits

    x, splits = a2a_input(RANK)
    got, received = hvd.alltoall(x, splits=splits, name=f"{tag}.a2a", process_set=ps)
    pieces = []
    for r in members:
        xr, sr = a2a_input(r)
        start = sum(sr[:me])
        pieces.append(to_np(xr)[start:start + sr[me]])
    check(got, np.concatenate(pieces), f"{tag}: alltoall")
    assert received.tolist() == [members.index(r) + me + 1 for r in members], f"{tag}: splits {received}"

    # reducescatter: the set's sum, split along the first dimension among the members
    rs = {r: make(r, f"{tag}.rs", (2 * n + 1, 3), torch.float64) for r in members}
    total = sum(to_np(rs[r]) for r in members)
    rows = [len(chunk) for chunk in np.array_split(np.arange(2 * n + 1), n)]
    start = sum(rows[:me])
    check(hvd.reducescatter(rs[RANK], name=f"{tag}.rs", op=hvd.Sum, process_set=ps),
          total[start:start + rows[me]], f"{tag}: reducescatter")

    hvd.barrier(process_set=ps)


def check_not_member(ps: hvd.ProcessSet, tag: str) -> None:
    assert ps.included() is False and ps.rank() is None, f"{tag}: included {ps.included()} rank {ps.rank()}"
    assert ps.size() == len(ps.ranks)
    exc = expect_raises(hvd.CollectiveMismatchError,
                        lambda: hvd.allreduce(torch.ones(2), name=f"{tag}.intruder", process_set=ps),
                        f"rank {RANK} is not a member of process set {ps.process_set_id}", str(ps.ranks),
                        what=f"{tag}: non-member allreduce")
    print(f"non-member error: {exc}", flush=True)
    expect_raises(hvd.CollectiveMismatchError, lambda: hvd.allgather(torch.ones(1), name=f"{tag}.intruder.ag",
                                                                     process_set=ps),
                  "not a member", what=f"{tag}: non-member allgather")


# ------------------------------------------------------------------ scenarios
def scenario_static():
    assert hvd.global_process_set.size() == SIZE and hvd.global_process_set.rank() == RANK
    assert EVENS.process_set_id is not None and ODDS.process_set_id is not None
    assert EVENS.process_set_id != ODDS.process_set_id != 0
    mine, other = (EVENS, ODDS) if RANK % 2 == 0 else (ODDS, EVENS)
    # the two disjoint sets run the same names at the same time, then the global set does too
    check_collectives(mine, "static")
    check_not_member(other, "static")
    check_collectives(hvd.global_process_set, "static")


def scenario_concurrent():
    """Async ops on a set and on the global set, interleaved, under one name each."""
    ps = my_static_set()
    members = ps.ranks
    handles = []
    for i in range(6):
        for where, s, ranks in (("set", ps, members), ("global", hvd.global_process_set, list(range(SIZE)))):
            x = make(RANK, f"conc.{where}.{i}", (7,), torch.int64)
            handles.append((hvd.allreduce_async(x, name=f"conc.{i}", op=hvd.Sum, process_set=s), where, i, ranks))
    for handle, where, i, ranks in reversed(handles):
        expected = sum(to_np(make(r, f"conc.{where}.{i}", (7,), torch.int64)) for r in ranks)
        check(hvd.synchronize(handle), expected, f"concurrent {where} allreduce {i}")


def scenario_dynamic():
    first = [0, 1]
    ps = hvd.add_process_set(first)  # every rank, in the same order
    assert ps.ranks == first and ps.process_set_id is not None
    if RANK in first:
        check_collectives(ps, "dyn")
    else:
        check_not_member(ps, "dyn")
    # a list of ranks works as well as a ProcessSet, and a set's rank order is sorted
    unsorted = [SIZE - 1, 1] if SIZE % 2 else [SIZE - 1, 1, 0]  # differs from the static sets
    ps2 = hvd.add_process_set(unsorted)
    assert ps2.ranks == sorted(unsorted), ps2.ranks
    if RANK in ps2.ranks:
        check_collectives(ps2, "dyn2")
    hvd.barrier()

    # errors: out-of-range ranks, an already registered set, the same ranks twice
    expect_raises(ValueError, lambda: hvd.add_process_set([0, SIZE]), "must be a non-empty list of ranks",
                  what="rank outside the job")
    expect_raises(ValueError, lambda: hvd.add_process_set([]), what="empty set")
    expect_raises(ValueError, lambda: hvd.add_process_set(ps), "already registered", what="add twice")
    expect_raises(ValueError, lambda: hvd.add_process_set(list(first)), "already registered",
                  what="same ranks twice")

    # remove: the set object is unregistered; using it is a clear error on every rank
    old_id = ps.process_set_id
    assert hvd.remove_process_set(ps) is True
    assert ps.process_set_id is None and ps.size() is None and ps.included() is None and ps.rank() is None
    exc = expect_raises(ValueError, lambda: hvd.allreduce(torch.ones(2), name="removed.ar", process_set=ps),
                        "not registered", "add_process_set", what="op on a removed set")
    print(f"removed-set error: {exc}", flush=True)
    assert hvd.remove_process_set(ps) is False, "removing twice"
    assert hvd.remove_process_set(hvd.global_process_set) is False, "the global set cannot be removed"
    # the other dynamic and the static sets are untouched
    if RANK in ps2.ranks:
        check_collectives(ps2, "dyn2.after")
    check_collectives(my_static_set(), "static.after")

    # re-adding the same object works (a new id, same members), and so does its name space
    again = hvd.add_process_set(ps)
    assert again is ps and ps.process_set_id not in (None, old_id) and ps.ranks == first
    if RANK in first:
        check_collectives(ps, "dyn")  # the same names as before removal
    else:
        check_not_member(ps, "dyn.again")
    assert hvd.remove_process_set(ps) and hvd.remove_process_set(ps2)
    check_collectives(hvd.global_process_set, "global.after")


def scenario_many_sets():
    """Add and remove sets in a loop: ids, groups and caches do not leak or collide."""
    for i in range(3):
        sets = [hvd.add_process_set([r, r + 1]) for r in range(SIZE - 1)]
        for s in sets:
            if s.included():
                x = make(RANK, f"many.{i}", (3,), torch.float32)
                expected = sum(to_np(make(r, f"many.{i}", (3,), torch.float32)) for r in s.ranks)
                for _ in range(2):  # the second round goes through the response cache
                    check(hvd.allreduce(x, name="many", op=hvd.Sum, process_set=s), expected, f"many {i} {s}")
        for s in sets:
            assert hvd.remove_process_set(s)


SCENARIOS = {name[len("scenario_"):]: fn for name, fn in dict(globals()).items() if name.startswith("scenario_")}

if __name__ == "__main__":
    import faulthandler
    faulthandler.register(signal.SIGUSR1, all_threads=True)  # kill -USR1 <pid> shows where a rank hangs
    run_scenarios(SCENARIOS, sys.argv, RANK)
