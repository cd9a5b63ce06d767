"""Timeline worker: ``torch_timeline.py MODE DIR``.

* ``steps``: the timeline comes from HOROVOD_TIMELINE / --timeline-filename;
  run STEPS of named and unnamed collectives of every kind, rank 1 late to
  submit 'grad.c' and 'grad.late' in every step.
* ``dynamic``: no file at start; ``start_timeline(DIR/dynamic.json)`` after a
  first step, ``stop_timeline()`` after the next, one more step (not in the
  file); ``start_timeline`` before ``init()`` raises ValueError.
* ``reinit``: the timeline comes from the environment; a step, ``shutdown()``,
  ``init()`` again (as an elastic reset does), another step: one file.
* ``horovod``: Horovod's test_timeline: HOROVOD_TIMELINE set here before
  ``init()``; 0.1 s after an allreduce named 'test_allreduce' the file holds
  its row ``allreduce.test_allreduce`` and its phases.
* ``kill``: the timeline comes from the environment; rank 0 SIGKILLs itself
  after several steps, mid-run, while the writer thread streams events.
"""

from __future__ import annotations

import os
import signal
import sys
import time

import torch

import roundel.torch as hvd

STEPS = 3
LATE_S = 0.05
# rank 1's lag before 'grad.c': far above what a loaded 2-core machine adds to any rank's step
LATE_C_S = 0.3


def step(n: int) -> None:
    rank, size = hvd.rank(), hvd.size()
    a = torch.full((2000,), float(rank))  # over the coordinator's 4 KiB: on the transport (shared memory)
    b = torch.ones(10, 10)
    handles = [hvd.allreduce_async(a, name="grad.a"), hvd.allreduce_async(b, name="grad.b")]
    if rank == 1:
        time.sleep(LATE_S)
    # a Max: rank 0 reduces it from the requests (a small Sum or Average would be left to the replayed schedule)
    late = hvd.allreduce(torch.full((4,), float(rank)), name="grad.late", op=hvd.Max)
    assert late.tolist() == [float(size - 1)] * 4, late
    out_a, out_b = (hvd.synchronize(h) for h in handles)
    assert torch.allclose(out_a, torch.full((2000,), (size - 1) / 2)), out_a[:4]
    assert torch.equal(out_b, b)
    if rank == 1:
        time.sleep(LATE_C_S)
    # cached from the second step on: a bit of the cache and nothing after it, which a relay holds until the
    # ranks below it have all sent theirs (rank 1's, here)
    c = hvd.allreduce(torch.ones(2000), name="grad.c", op=hvd.Sum)
    assert torch.equal(c, torch.full((2000,), float(size))), c[:4]
    hvd.allreduce(torch.ones(3))  # unnamed
    gathered = hvd.allgather(torch.full((rank + 1, 2), rank), name="gather")
    assert gathered.shape == (size * (size + 1) // 2, 2)
    root = hvd.broadcast(torch.full((5,), rank + n), root_rank=0, name="bcast")
    assert root.tolist() == [n] * 5
    hvd.alltoall(torch.arange(size * 2), name="a2a")
    hvd.reducescatter(torch.ones(size * 2), name="rs")


def main() -> None:
    mode, directory = sys.argv[1], sys.argv[2]
    if mode == "dynamic":
        try:
            hvd.start_timeline(os.path.join(directory, "early.json"))
        except ValueError as exc:
            assert "init" in str(exc), exc
        else:
            raise AssertionError("start_timeline before init() did not raise")
    if mode == "horovod":
        os.environ["HOROVOD_TIMELINE"] = path = os.path.join(directory, "horovod.json")
        os.environ["HOROVOD_TIMELINE_MARK_CYCLES"] = "1"
    hvd.init()
    if mode == "horovod":
        hvd.allreduce(torch.tensor([1, 2, 3], dtype=torch.float32), name="test_allreduce")
        time.sleep(0.1)
        if hvd.rank() == 0:
            with open(path) as f:
                text = f.read()
            for needle in ("allreduce.test_allreduce", "NEGOTIATE_ALLREDUCE", "ALLREDUCE", "CYCLE_START"):
                assert needle in text, (needle, text)
    elif mode == "steps":
        for n in range(STEPS):
            step(n)
    elif mode == "dynamic":
        step(0)
        hvd.start_timeline(os.path.join(directory, "dynamic.json"), mark_cycles=True)
        step(1)
        hvd.stop_timeline()
        step(2)
        hvd.stop_timeline()  # stopping twice is harmless
    elif mode == "reinit":
        step(0)
        hvd.shutdown()
        hvd.init()
        step(1)
    elif mode == "kill":
        for n in range(1000):
            step(n)
            if n == 5 and hvd.rank() == 0:
                sys.stdout.flush()
                os.kill(os.getpid(), signal.SIGKILL)
    hvd.shutdown()
    print(f"CHECKS PASSED {mode}", flush=True)


if __name__ == "__main__":
    main()
