"""Handles on their own: completion once, every waiter woken, errors raised where waited."""

import threading

import pytest

from roundel.common.engine.handles import Handle


def _waiters(handle, count):
    results = []

    def wait():
        try:
            results.append(handle.wait())
        except RuntimeError as exc:
            results.append(exc)

    threads = [threading.Thread(target=wait) for _ in range(count)]
    for thread in threads:
        thread.start()
    return threads, results


def test_every_waiter_gets_the_result_and_later_waits_return_at_once():
    handle = Handle("x")
    threads, results = _waiters(handle, 4)
    assert not handle.done()
    handle.set_result(42)
    for thread in threads:
        thread.join(10)
    assert results == [42] * 4 and handle.done() and handle.wait() == 42


def test_the_first_completion_wins_and_an_error_is_raised_to_every_waiter():
    done = []
    handle = Handle("x", on_done=done.append)
    threads, results = _waiters(handle, 2)
    error = RuntimeError("boom")
    handle.set_error(error)
    handle.set_result(1)  # too late: ignored
    for thread in threads:
        thread.join(10)
    assert results == [error, error] and done == [error]
    with pytest.raises(RuntimeError, match="boom"):
        handle.wait()


def test_a_waiter_is_tracked_only_while_it_waits():
    class Waits:
        def __init__(self):
            self.inside = []

        def enter(self, what):
            self.inside.append(what)
            return what

        def leave(self, token):
            self.inside.remove(token)

    waits = Waits()
    handle = Handle("x", waits, (0, "x", "allreduce"))
    threads, _ = _waiters(handle, 1)
    while not waits.inside:
        threading.Event().wait(0.001)
    assert waits.inside == [(0, "x", "allreduce")]
    handle.set_result(None)
    threads[0].join(10)
    assert waits.inside == []
    handle.wait()  # finished: not tracked
    assert waits.inside == []
