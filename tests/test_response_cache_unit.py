"""The response cache on its own: the coordinator's cache and a rank's mirror of it."""

import pytest

from roundel.common.control.records import CachedBatch, OpKind, Request
from roundel.common.engine.response_cache import CoordinatorCache, RankCache


def requests(name, shape=(4,)):
    request = Request(name, OpKind.ALLREDUCE, 0, "float32", shape)
    return {0: request, 1: request}


# --------------------------------------------------------------- coordinator
def test_put_assigns_distinct_bits_and_lookup_returns_the_requests():
    cache = CoordinatorCache(4)
    bit_a, evicted_a = cache.put((0, "a"), requests("a"))
    bit_b, evicted_b = cache.put((0, "b"), requests("b"))
    assert bit_a != bit_b and evicted_a == evicted_b == []
    assert cache.get_bit((0, "a")) == bit_a and cache.get_bit((0, "zzz")) == -1
    assert cache.lookup(bit_b, cache.version) == ((0, "b"), requests("b"))
    assert cache.lookup(7, cache.version) is None


def test_putting_the_same_requests_again_keeps_the_bit_and_the_version():
    cache = CoordinatorCache(4)
    bit, _ = cache.put((0, "a"), requests("a"))
    version = cache.version
    assert cache.put((0, "a"), requests("a")) == (bit, [])
    assert cache.version == version


def test_changed_requests_keep_the_bit_but_make_older_views_stale():
    cache = CoordinatorCache(4)
    bit, _ = cache.put((0, "a"), requests("a"))
    old_version = cache.version
    assert cache.put((0, "a"), requests("a", shape=(8,))) == (bit, [])
    assert cache.version > old_version
    assert cache.lookup(bit, old_version) is None  # a rank that saw the old request must resend
    assert cache.lookup(bit, cache.version)[1] == requests("a", shape=(8,))


def test_every_change_bumps_the_version_once():
    cache = CoordinatorCache(2)
    versions = [cache.version]
    for name in ("a", "b", "c"):
        cache.put((0, name), requests(name))
        versions.append(cache.version)
    assert versions == [0, 1, 2, 3]


def test_a_full_cache_evicts_the_least_recently_used_name():
    cache = CoordinatorCache(2)
    bit_a, _ = cache.put((0, "a"), requests("a"))
    bit_b, _ = cache.put((0, "b"), requests("b"))
    assert cache.lookup(bit_a, cache.version) is not None  # 'a' used: 'b' is now the oldest
    bit_c, evicted = cache.put((0, "c"), requests("c"))
    assert evicted == [(bit_b, (0, "b"))] and bit_c == bit_b
    assert cache.get_bit((0, "b")) == -1 and cache.get_bit((0, "a")) == bit_a


def test_putting_an_existing_name_counts_as_a_use():
    cache = CoordinatorCache(2)
    bit_a, _ = cache.put((0, "a"), requests("a"))
    cache.put((0, "b"), requests("b"))
    cache.put((0, "a"), requests("a"))
    _, evicted = cache.put((0, "c"), requests("c"))
    assert [key for _, key in evicted] == [(0, "b")]
    assert cache.get_bit((0, "a")) == bit_a


def test_a_reassigned_bit_is_stale_for_views_before_the_reassignment():
    cache = CoordinatorCache(1)
    bit, _ = cache.put((0, "a"), requests("a"))
    seen = cache.version
    assert cache.put((0, "b"), requests("b"))[0] == bit
    assert cache.lookup(bit, seen) is None
    assert cache.lookup(bit, cache.version)[0] == (0, "b")


def test_zero_capacity_caches_nothing():
    cache = CoordinatorCache(0)
    assert cache.put((0, "a"), requests("a")) == (-1, [])
    assert cache.version == 0 and cache.get_bit((0, "a")) == -1


def test_dropping_a_process_set_forgets_only_its_names_and_frees_their_bits():
    cache = CoordinatorCache(3)
    bit_g, _ = cache.put((0, "g"), requests("g"))
    bit_s, _ = cache.put((5, "s"), requests("s"))
    before = cache.version
    assert cache.drop_process_set(5) == [(bit_s, (5, "s"))]
    assert cache.version == before + 1
    assert cache.lookup(bit_s, cache.version) is None and cache.get_bit((0, "g")) == bit_g
    assert cache.drop_process_set(5) == [] and cache.version == before + 1  # nothing left: no change
    bit_new, evicted = cache.put((0, "n"), requests("n"))
    assert evicted == [] and bit_new != bit_g
    assert cache.lookup(bit_new, before) is None  # reused bit: older views are stale


def test_bits_stay_below_capacity_across_drops_and_refills():
    cache = CoordinatorCache(3)
    for round_ in range(4):
        bits = [cache.put((round_ + 1, name), requests(name))[0] for name in "xyz"]
        assert sorted(bits) == [0, 1, 2]
        cache.drop_process_set(round_ + 1)


# ---------------------------------------------------------------------- rank
def test_a_rank_sends_a_bit_only_for_the_exact_request_it_recorded():
    cache = RankCache()
    request = requests("a")[0]
    assert cache.bit_for((0, "a"), request) == -1
    cache.record((0, "a"), 3, request)
    assert cache.bit_for((0, "a"), request) == 3
    assert cache.bit_for((0, "a"), request._replace(shape=(5,))) == -1
    assert cache.bit_for((1, "a"), request) == -1


def test_evicted_bits_are_forgotten():
    cache = RankCache()
    a, b = requests("a")[0], requests("b")[0]
    cache.record((0, "a"), 0, a)
    cache.record((0, "b"), 1, b)
    cache.evict([0, 9])
    assert cache.bit_for((0, "a"), a) == -1 and cache.bit_for((0, "b"), b) == 1


def test_a_bit_recorded_for_a_new_name_drops_the_old_name():
    cache = RankCache()
    a, b = requests("a")[0], requests("b")[0]
    cache.record((0, "a"), 0, a)
    cache.record((0, "b"), 0, b)
    assert cache.bit_for((0, "a"), a) == -1 and cache.bit_for((0, "b"), b) == 0
    cache.evict([0])
    assert cache.bit_for((0, "b"), b) == -1


def test_a_name_moved_to_another_bit_is_not_evicted_with_its_old_bit():
    cache = RankCache()
    a = requests("a")[0]
    cache.record((0, "a"), 0, a)
    cache.record((0, "a"), 2, a)
    cache.evict([0])
    assert cache.bit_for((0, "a"), a) == 2


def test_the_mirror_knows_which_bits_are_global_names_through_moves_and_evictions():
    cache = RankCache()
    a, b = requests("a")[0], requests("b")[0]
    cache.record((0, "a"), 0, a)
    cache.record((1, "b"), 1, b)  # a name of process set 1
    assert cache.global_set_bits() == 0b1
    cache.record((0, "a"), 2, a)  # moved
    assert cache.global_set_bits() == 0b100
    cache.record((1, "b"), 2, b)  # bit 2 now names a set-1 name
    assert cache.global_set_bits() == 0
    cache.record((0, "a"), 3, a)
    cache.evict([3])
    assert cache.global_set_bits() == 0


def test_the_mirror_follows_the_coordinator_through_evictions():
    coordinator, mirror = CoordinatorCache(2), RankCache()
    for name in ("a", "b", "c", "a"):
        reqs = requests(name)
        bit, evicted = coordinator.put((0, name), reqs)
        mirror.evict([b for b, _ in evicted])
        mirror.record((0, name), bit, reqs[0])
        mirror.version = coordinator.version
    for name in ("a", "b", "c"):
        bit = mirror.bit_for((0, name), requests(name)[0])
        assert bit == coordinator.get_bit((0, name))
        if bit >= 0:
            assert coordinator.lookup(bit, mirror.version)[0] == (0, name)
    assert coordinator.get_bit((0, "b")) == -1


def test_after_a_partial_drop_new_names_get_unused_bits():
    cache = CoordinatorCache(3)
    for set_id, name in ((0, "a"), (1, "b"), (0, "c")):
        cache.put((set_id, name), requests(name))
    cache.drop_process_set(1)
    bit_d, evicted = cache.put((0, "d"), requests("d"))
    assert evicted == []
    assert {cache.get_bit((0, name)) for name in "acd"} == {cache.get_bit((0, "a")), cache.get_bit((0, "c")), bit_d}
    assert len({cache.get_bit((0, name)) for name in "acd"}) == 3
    for name in "acd":
        assert cache.lookup(cache.get_bit((0, name)), cache.version)[0] == (0, name)


def test_a_rank_expands_a_cached_batch_into_its_own_requests_in_bit_order():
    mirror = RankCache()
    mirror.record((0, "b"), 2, requests("b")[1])
    mirror.record((0, "a"), 0, requests("a")[1])
    batch = mirror.expand(CachedBatch(OpKind.ALLREDUCE, 0, (1 << 2) | 1))
    assert batch.kind == OpKind.ALLREDUCE and batch.process_set_id == 0
    assert [(e.name, e.cache_bit, e.request) for e in batch.entries] == [
        ("a", 0, requests("a")[1]), ("b", 2, requests("b")[1])]
    mirror.evict([2])
    with pytest.raises(KeyError):
        mirror.expand(CachedBatch(OpKind.ALLREDUCE, 0, 1 << 2))
