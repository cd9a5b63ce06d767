"""Straggler worker: ``torch_stragglers.py STEPS SLOW_RANK`` (SLOW_RANK -1: nobody is slow).

Each step every rank allreduces one small tensor; the slow rank first sleeps
50 ms, as a rank with a slower device or more data would.
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
    hvd.allreduce(torch.ones(16), name="grad")
print("DONE", flush=True)
hvd.shutdown()
