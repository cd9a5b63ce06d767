"""The training job ``elastic_reset.py`` runs and kills: a small MLP on synthetic data, elastic.

Rank 0 prints ``COMMIT <step> <unix time>`` after each commit. In the first
generation, at step ``KILL_AT_STEP`` the last rank prints ``KILLED <unix
time>`` and kills itself with SIGKILL. The job ends after ``STEPS`` steps.
"""

import os
import signal
import time

import torch

import roundel.torch as hvd
from roundel.common import basics

STEPS = int(os.environ.get("STEPS", "60"))
KILL_AT_STEP = int(os.environ.get("KILL_AT_STEP", "20"))
STEP_SLEEP = float(os.environ.get("STEP_SLEEP", "0.02"))

hvd.init()
torch.manual_seed(0)
model = torch.nn.Sequential(torch.nn.Linear(64, 256), torch.nn.ReLU(), torch.nn.Linear(256, 10))
optimizer = hvd.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.01),
                                     named_parameters=model.named_parameters())
state = hvd.elastic.TorchState(model, optimizer, step=0)
features, labels = torch.randn(32, 64), torch.randint(0, 10, (32,))


@hvd.elastic.run
def train(state):
    while state.step < STEPS:
        optimizer.zero_grad()
        torch.nn.functional.cross_entropy(model(features), labels).backward()
        optimizer.step()
        state.step += 1
        if state.step == KILL_AT_STEP and basics.runtime().elastic.generation == 0 \
                and hvd.rank() == hvd.size() - 1:
            print(f"KILLED {time.time()}", flush=True)
            os.kill(os.getpid(), signal.SIGKILL)
        state.commit()
        if hvd.rank() == 0:
            print(f"COMMIT {state.step} {time.time()}", flush=True)
        time.sleep(STEP_SLEEP)


train(state)
