"""Control-channel worker: ``control_loop.py STOP_FILE MAX_SECONDS [--spare-fds N]``.

Rank 0 prints ``CONTROL PORT <port>``, the port of its coordinator's control
listener, so a test can aim traffic at it. Then every rank loops over named
(cached) and unnamed (sent in full each time) allreduces and an allgather,
checking each result exactly, until STOP_FILE exists on any rank or
MAX_SECONDS pass (agreed by an allreduce, so all ranks stop together). Each
rank then prints ``STEPS <n>`` and ``CHECKS PASSED loop``.

With ``--spare-fds N`` rank 0 lowers its soft open-file limit, after init, to
N more than it has open, so a flood of connections exhausts it.
"""

from __future__ import annotations

import os
import resource
import sys
import time

import torch

import roundel.torch as hvd
from roundel.common import basics


def control_port() -> int:
    listener = basics._runtime.engine._coordinator._listener
    port = getattr(listener, "port", None)
    return port if port is not None else listener.getsockname()[1]


def step(rank: int, size: int, n: int) -> None:
    total = sum(range(size))
    handles = [hvd.allreduce_async(torch.arange(8, dtype=torch.int64) * (rank + 1) + n, op=hvd.Sum,
                                   name=f"loop.grad{i}") for i in range(4)]
    unnamed = hvd.allreduce(torch.full((3,), rank + n, dtype=torch.int64), op=hvd.Sum)
    gathered = hvd.allgather(torch.full((rank + 1, 2), rank, dtype=torch.int64), name="loop.gather")
    expected = torch.arange(8, dtype=torch.int64) * (total + size) + n * size
    for handle in handles:
        result = hvd.synchronize(handle)
        assert torch.equal(result, expected), f"step {n}: allreduce gave {result.tolist()}, expected {expected.tolist()}"
    assert torch.equal(unnamed, torch.full((3,), total + n * size, dtype=torch.int64)), unnamed.tolist()
    want = torch.cat([torch.full((r + 1, 2), r, dtype=torch.int64) for r in range(size)])
    assert torch.equal(gathered, want), gathered.tolist()


def limit_open_files(spare: int) -> None:
    in_use = len(os.listdir("/proc/self/fd"))
    _, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    resource.setrlimit(resource.RLIMIT_NOFILE, (in_use + spare, hard))
    print(f"OPEN FILES {in_use}, LIMIT {in_use + spare}", flush=True)


def main() -> None:
    stop_file, max_seconds = sys.argv[1], float(sys.argv[2])
    spare_fds = int(sys.argv[sys.argv.index("--spare-fds") + 1]) if "--spare-fds" in sys.argv else None
    hvd.init()
    rank, size = hvd.rank(), hvd.size()
    if rank == 0:
        if spare_fds is not None:
            limit_open_files(spare_fds)
        print(f"CONTROL PORT {control_port()}", flush=True)
    started = time.monotonic()
    n = 0
    while True:
        step(rank, size, n)
        n += 1
        local_stop = os.path.exists(stop_file) or time.monotonic() - started > max_seconds
        if hvd.allreduce(torch.tensor([int(local_stop)]), op=hvd.Max, name="loop.stop").item():
            break
    print(f"STEPS {n}", flush=True)
    print("CHECKS PASSED loop", flush=True)
    hvd.shutdown()


if __name__ == "__main__":
    main()
