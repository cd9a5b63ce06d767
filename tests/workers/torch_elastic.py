"""Elastic PyTorch training for the elastic tests: a small linear model on synthetic data.

Prints, for the tests to check: ``SEEN <json>`` for
every batch (epoch, global step, rank, size and the dataset indices);
``COMMIT <step> <params json>`` on rank 0 after each commit; ``START <json>``
on every rank each time the training function starts (step and parameters
just synced from rank 0, the identity ``hvd`` gives and the identity
variables ``HOROVOD_*``/``ROUNDEL_*`` of ``os.environ``); ``RESET <size>`` from the reset callback;
``FINAL <json>`` at the end (epoch, step, a fingerprint of the parameters,
and what an unnamed ``hvd.allgather`` of the ranks returned after training).
Settings come from the environment: ``EPOCHS``,
``SAMPLES``, ``BATCH``, ``COMMIT_EVERY``, ``STEP_SLEEP``, and ``STOP_FILE``:
once that file exists, training ends after the current epoch (rank 0
decides, all ranks follow). ``FAST_FILE``: once that file exists, steps no
longer sleep (the test has done what needed training slowed down; every
epoch is still trained and checked). ``SHARDED=1``: the optimizer shards its state
(``shard_optimizer_state=True``). ``POWERSGD=1``: PowerSGD(rank=1,
start_iter=3) compression. ``LOST_AT_STEP``: in the first generation, at
that step the last rank stops itself (SIGSTOP) and rank 0 reports it lost in
the rendezvous store, as a rank's heartbeat check does; with ``LOST_EXITS=1``
the last rank does not stop but exits with status 1, 0.3 s after the report. ``EXIT_SCHEDULE``:
JSON ``{"<generation>": [ranks]}``: those ranks of that generation exit with
status 1 after ``EXIT_AFTER`` (default 3) steps in it, as Horovod's elastic
integration tests schedule failures.
"""

import json
import os
import signal
import time

import torch

import roundel.torch as hvd
from roundel.common import basics

EPOCHS = int(os.environ.get("EPOCHS", "3"))
SAMPLES = int(os.environ.get("SAMPLES", "96"))
BATCH = int(os.environ.get("BATCH", "4"))
COMMIT_EVERY = int(os.environ.get("COMMIT_EVERY", "1"))
STEP_SLEEP = float(os.environ.get("STEP_SLEEP", "0.05"))
STOP_FILE = os.environ.get("STOP_FILE")
FAST_FILE = os.environ.get("FAST_FILE")
LOST_AT_STEP = int(os.environ.get("LOST_AT_STEP", "0"))
LOST_EXITS = os.environ.get("LOST_EXITS") == "1"
EXIT_SCHEDULE = json.loads(os.environ.get("EXIT_SCHEDULE", "{}"))
EXIT_AFTER = int(os.environ.get("EXIT_AFTER", "3"))
IDENTITY_VARS = [prefix + name for name in ("RANK", "SIZE", "LOCAL_RANK", "LOCAL_SIZE", "CROSS_RANK", "CROSS_SIZE",
                                            "HOSTNAME") for prefix in ("HOROVOD_", "ROUNDEL_")]

hvd.init()
torch.manual_seed(0)
features = torch.randn(SAMPLES, 8)
labels = (features[:, 0] > 0).long()
dataset = torch.utils.data.TensorDataset(features, labels, torch.arange(SAMPLES))
model = torch.nn.Linear(8, 2)
torch.manual_seed(hvd.rank())  # deliberately different: the first sync must make them equal
with torch.no_grad():
    for p in model.parameters():
        p.normal_()
optimizer = hvd.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.01 * hvd.size(), momentum=0.9),
                                     named_parameters=model.named_parameters(),
                                     shard_optimizer_state=os.environ.get("SHARDED") == "1",
                                     compression=(hvd.PowerSGD(rank=1, start_iter=3) if os.environ.get("POWERSGD")
                                                  == "1" else hvd.Compression.none))
sampler = hvd.elastic.ElasticSampler(dataset, shuffle=True, seed=3)
loader = torch.utils.data.DataLoader(dataset, batch_size=BATCH, sampler=sampler)
state = hvd.elastic.TorchState(model, optimizer, sampler=sampler, epoch=0, step=0)


def on_reset():
    for group in optimizer.param_groups:
        group["lr"] = 0.01 * hvd.size()
    print(f"RESET {hvd.size()}", flush=True)


state.register_reset_callbacks([on_reset])


def params() -> list:
    return [float(v) for p in model.parameters() for v in p.detach().flatten()]


def fake_a_lost_rank() -> None:
    """The last rank stops; rank 0 reports it under the agreed key ``<prefix>lost/<rank>``."""
    runtime = basics.runtime()
    victim = hvd.size() - 1
    if hvd.rank() == victim and LOST_EXITS:  # as a rank that fails: its connections close before it has exited
        runtime.client.get(f"{runtime.prefix}lost/{victim}", timeout=60)
        print(f"EXITING {victim}", flush=True)
        time.sleep(0.3)
        os._exit(1)
    elif hvd.rank() == victim:
        print(f"STOPPING {victim}", flush=True)
        os.kill(os.getpid(), signal.SIGSTOP)
    elif hvd.rank() == 0:
        report = {"rank": victim, "host": "test", "reason": "no heartbeat for 0 s (faked by the test)"}
        runtime.client.set(f"{runtime.prefix}lost/{victim}", json.dumps(report).encode())


def generation() -> int:
    return basics.runtime().elastic.generation


@hvd.elastic.run
def train(state):
    print("START " + json.dumps({"step": state.step, "rank": hvd.rank(), "size": hvd.size(), "params": params(),
                                 "local_rank": hvd.local_rank(), "local_size": hvd.local_size(),
                                 "cross_rank": hvd.cross_rank(), "cross_size": hvd.cross_size(),
                                 "env": {name: os.environ.get(name) for name in IDENTITY_VARS}}), flush=True)
    steps_here = 0
    exits = hvd.rank() in EXIT_SCHEDULE.get(str(generation()), [])
    while state.epoch < EPOCHS:
        state.sampler.set_epoch(state.epoch)
        for batch_idx, (x, y, idx) in enumerate(loader):
            print("SEEN " + json.dumps({"epoch": state.epoch, "step": state.step, "rank": hvd.rank(),
                                        "size": hvd.size(), "indices": idx.tolist()}), flush=True)
            optimizer.zero_grad()
            torch.nn.functional.cross_entropy(model(x), y).backward()
            optimizer.step()
            state.sampler.record_batch(batch_idx, BATCH)
            state.step += 1
            steps_here += 1
            if exits and steps_here == EXIT_AFTER:
                print(f"EXITING generation {generation()} rank {hvd.rank()}", flush=True)
                os._exit(1)
            if state.step == LOST_AT_STEP and generation() == 0 and hvd.size() > 1:
                fake_a_lost_rank()
            if state.step % COMMIT_EVERY == 0:
                state.commit()
                if hvd.rank() == 0:
                    print(f"COMMIT {state.step} {json.dumps(params())}", flush=True)
            if not (FAST_FILE and os.path.exists(FAST_FILE)):
                time.sleep(STEP_SLEEP)
        state.epoch += 1
        state.commit()
        if STOP_FILE and hvd.broadcast_object(os.path.exists(STOP_FILE), name="stop"):
            break


train(state)
gathered = hvd.allgather(torch.tensor([hvd.rank()])).tolist()  # unnamed: numbered alike on every rank
print("FINAL " + json.dumps({"epoch": state.epoch, "step": state.step, "rank": hvd.rank(), "size": hvd.size(),
                             "params": params(), "gathered": gathered}), flush=True)
