"""roundel.retry.Backoff: the pauses of every retry loop (doubling, capped, within a deadline, jittered)."""

import time

import pytest

from roundel import retry
from roundel.retry import Backoff


def _timed(backoff: Backoff) -> tuple[bool, float]:
    started = time.monotonic()
    went_on = backoff.pause()
    return went_on, time.monotonic() - started


def test_pauses_double_up_to_the_cap_and_reset_starts_again():
    backoff = Backoff(0.05, 0.1)
    lengths = [_timed(backoff)[1] for _ in range(5)]
    # a pause lasts at least its length (a loaded machine only lengthens it): 0.05, then 0.1 (doubled, capped)
    assert all(length >= want for length, want in zip(lengths, (0.05, 0.1, 0.1, 0.1, 0.1))), lengths
    assert sum(lengths) < 1.2, lengths  # uncapped, the doubling would take 0.05 + 0.1 + 0.2 + 0.4 + 0.8 s
    backoff.reset()
    went_on, length = _timed(backoff)
    assert went_on and 0.05 <= length < 0.1 + 0.5


def test_a_pause_that_would_reach_the_deadline_is_not_taken():
    deadline = time.monotonic() + 0.12
    backoff = Backoff(0.05, 1.0, deadline)
    assert backoff.pause()  # 0.05 s: ends before the deadline
    went_on, length = _timed(backoff)  # 0.1 s more would pass it
    assert not went_on and length < 0.05
    assert time.monotonic() < deadline + 0.5


def test_without_a_deadline_it_always_pauses():
    backoff = Backoff(0.001, 0.002)
    assert all(backoff.pause() for _ in range(5))


def test_jitter_spreads_each_pause_around_its_length(monkeypatch):
    slept = []
    monkeypatch.setattr(retry.time, "sleep", slept.append)
    backoff = Backoff(0.1, 0.1, jitter=0.5)
    for _ in range(50):
        backoff.pause()
    assert all(0.05 <= s <= 0.15 for s in slept)
    assert len(set(slept)) > 40 and min(slept) < 0.09 and max(slept) > 0.11


@pytest.mark.parametrize("first, cap, jitter, says", [
    (0.0, 1.0, 0.0, "need 0 < first <= cap"),
    (2.0, 1.0, 0.0, "need 0 < first <= cap"),
    (0.1, 1.0, 1.0, "need 0 <= jitter < 1"),
])
def test_bad_pauses_are_refused(first, cap, jitter, says):
    with pytest.raises(ValueError, match=says):
        Backoff(first, cap, jitter=jitter)
