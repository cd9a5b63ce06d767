"""The shared-memory transport of a job on one host, under the real launcher.

Each job runs ``tests/workers/torch_shared_memory.py``: collectives of several
shared-memory pieces and of every dtype, checked against NumPy. The job's
communicator must be the shared-memory one by default, Gloo when
``ROUNDEL_SHARED_MEMORY=0`` or when shared memory cannot be set up (then on
every rank alike), and no segment may be left in ``/dev/shm``. The ranks also
reach the coordinator over its local socket rather than TCP.
"""

import glob

import pytest
import torch

from roundel.ops import ReduceOp
from roundel.transport.shared_memory import _outside, _pieces, _scaling, _within_one
from launch_util import assert_checks_passed, describe, rank_lines, run_job

WORKER = "torch_shared_memory.py"
SCENARIOS = ("allreduce", "fused", "many_small", "allgather", "broadcast", "reducescatter")


def backends(result, np):
    return [[line for line in rank_lines(result.stdout, rank, "stdout") if line.startswith("BACKEND")]
            for rank in range(np)]


def segments() -> set:
    return set(glob.glob("/dev/shm/roundel-*"))


def test_a_job_on_one_host_moves_collectives_through_shared_memory_and_leaves_no_segment():
    before = segments()
    result = run_job(3, WORKER, ",".join(SCENARIOS), timeout=300)
    assert_checks_passed(result, 3, *SCENARIOS)
    assert backends(result, 3) == [["BACKEND SharedMemoryBackend"]] * 3, describe(result)
    assert segments() <= before, segments() - before
    for rank in (1, 2):  # the control messages also stay off TCP on one host
        assert "CONTROL local" in rank_lines(result.stdout, rank, "stdout"), describe(result)


@pytest.mark.parametrize("np", [2, 3, 5])
def test_scaled_float_reductions_are_bitwise_a_sum_then_scaled(np):
    result = run_job(np, WORKER, "exact", timeout=300)
    assert_checks_passed(result, np, "exact")
    assert backends(result, np) == [["BACKEND SharedMemoryBackend"]] * np, describe(result)


@pytest.mark.parametrize("np", [2, 4])
def test_small_sums_and_gathers_go_through_numpy_views_with_the_bits_torch_gives(np):
    result = run_job(np, WORKER, "small", timeout=300)
    assert_checks_passed(result, np, "small")
    assert backends(result, np) == [["BACKEND SharedMemoryBackend"]] * np, describe(result)


@pytest.mark.parametrize("dtype, op, prescale, postscale, expected", [
    (torch.float32, ReduceOp.Average, 1.0, 0.5, (0.5, 1.0, 1.0)),  # an average over 2: all on the copy
    (torch.float64, ReduceOp.Sum, 3.0, 0.25, (0.75, 1.0, 1.0)),
    (torch.float32, ReduceOp.Average, 0.5, 1 / 3, (0.5, 1.0, 1 / 3)),  # over 3: the postscale stays after
    (torch.float32, ReduceOp.Max, 1.0, 0.5, (1.0, 1.0, 0.5)),  # not a sum
    (torch.float32, ReduceOp.Sum, 2.0, -0.5, (2.0, 1.0, -0.5)),
    (torch.float16, ReduceOp.Average, 2.0, 0.5, (1.0, 2.0, 0.5)),  # halving may round: separate passes
    (torch.int32, ReduceOp.Average, 1.0, 0.5, (1.0, 1.0, 0.5)),
])
def test_which_scaling_rides_on_the_copy_into_the_slot(dtype, op, prescale, postscale, expected):
    assert _scaling(dtype, op, prescale, postscale) == expected


def test_shared_memory_off_keeps_gloo():
    result = run_job(2, WORKER, "allreduce", env={"ROUNDEL_SHARED_MEMORY": "0"}, timeout=300)
    assert_checks_passed(result, 2, "allreduce")
    assert backends(result, 2) == [["BACKEND GlooBackend"]] * 2, describe(result)


def test_when_shared_memory_cannot_be_set_up_every_rank_stays_on_gloo(tmp_path):
    # a temporary directory too long for a Unix socket's path (at most 107 bytes): no rank can listen
    deep = tmp_path / ("d" * 100)
    deep.mkdir()
    result = run_job(2, WORKER, "allreduce", env={"TMPDIR": str(deep), "ROUNDEL_LOG_LEVEL": "info"},
                     timeout=300)
    assert_checks_passed(result, 2, "allreduce")
    assert backends(result, 2) == [["BACKEND GlooBackend"]] * 2, describe(result)
    for rank in range(2):
        assert any("no shared memory" in line and "cannot listen" in line
                   for line in rank_lines(result.stderr, rank, "stderr")), describe(result)


@pytest.mark.parametrize("sizes, per_slot", [([10], 10), ([3, 4, 5], 7), ([1] * 9, 4), ([25, 2], 8)])
def test_a_piece_less_a_members_share_keeps_every_other_element_where_it_was(sizes, per_slot):
    # a member whose share lies in one input combines it from there and copies in only the rest
    for count, spans in _pieces(sizes, per_slot):
        where = {at + i: (which, start + i) for at, which, start, take in spans for i in range(take)}
        for low in range(count):
            for high in range(low + 1, count + 1):
                kept = _outside(spans, low, high)
                elements = [(at + i, (which, start + i)) for at, which, start, take in kept for i in range(take)]
                assert dict(elements) == {k: v for k, v in where.items() if not low <= k < high}
                assert len(elements) == count - (high - low) and all(take > 0 for *_, take in kept)


def test_a_share_within_one_input_is_read_from_that_input_and_one_across_two_is_not():
    sources = [torch.arange(5), torch.arange(10, 14)]
    (count, spans), = _pieces([5, 4], 9)
    concatenation = torch.cat(sources)
    for low in range(count):
        for high in range(low + 1, count + 1):
            view = _within_one(sources, spans, low, high)
            if high <= 5 or low >= 5:
                assert view is not None and torch.equal(view, concatenation[low:high])
                assert view.data_ptr() == sources[low >= 5][low - 5 * (low >= 5)].data_ptr()
            else:
                assert view is None
