"""Straggler worker: ``torch_stragglers.py STEPS SLOW_RANK`` (SLOW_RANK -1: nobody is slow).

Each step every rank allreduces one tensor of 8 KiB (more than rank 0 reduces
itself, so the steps after the first few are replayed, and rank 0 learns who
came last from the replayed transfers); the slow rank first sleeps 50 ms, as a
rank with a slower device or more data would.
"""

import sys
import time

import torch

import roundel.torch as hvd

hvd.init()
steps, slow = int(sys.argv[1]), int(sys.argv[2])
for step in range(steps):
    if hvd.rank() == slow:
        time.sleep(0.05)
    hvd.allreduce(torch.ones(2048), name="grad")
print("DONE", flush=True)
hvd.shutdown()
