"""Metrics worker: ``torch_metrics.py FLAG_FILE``.

Runs allreduces and allgathers (and one that fails on purpose), then rank 0
writes ``FLAG_FILE`` and every rank keeps running allreduces until the file
``FLAG_FILE.done`` exists, so the test can scrape the endpoint mid-job.
"""

import os
import sys
import time

import torch

import roundel.torch as hvd

hvd.init()
flag = sys.argv[1]
for step in range(20):
    hvd.allreduce(torch.ones(256), name="grad")
    hvd.allgather(torch.ones(2, 3), name="gathered")
try:
    hvd.allreduce(torch.ones(3 + hvd.rank()), name="mismatched")  # shapes differ: fails on every rank
except Exception:  # noqa: BLE001 - on purpose
    pass
if hvd.rank() == 0:
    open(flag, "w").close()
while True:  # rank 0 decides when to stop for everyone: the ranks may see the file at different times
    hvd.allreduce(torch.ones(256), name="grad")
    time.sleep(0.01)
    if hvd.broadcast_object(os.path.exists(flag + ".done"), name="done?"):
        break
print("DONE", flush=True)
hvd.shutdown()
