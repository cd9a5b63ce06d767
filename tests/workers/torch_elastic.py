"""Elastic PyTorch training for the elastic tests: a small linear model on synthetic data.

Prints, for the tests to check: ``SEEN <json>`` for
every batch (epoch, global step, rank, size and the dataset indices);
``COMMIT <step>`` on rank 0 after each commit; ``RESET <size>`` from the
reset callback; ``FINAL <json>`` at the end (epoch, step and a fingerprint
of the parameters). Settings come from the environment: ``EPOCHS``,
``SAMPLES``, ``BATCH``, ``COMMIT_EVERY``, ``STEP_SLEEP``, and ``STOP_FILE``:
once that file exists, training ends after the current epoch (rank 0
decides, all ranks follow).
"""

import json
import os
import time

import torch

import roundel.torch as hvd

EPOCHS = int(os.environ.get("EPOCHS", "3"))
SAMPLES = int(os.environ.get("SAMPLES", "96"))
BATCH = int(os.environ.get("BATCH", "4"))
COMMIT_EVERY = int(os.environ.get("COMMIT_EVERY", "1"))
STEP_SLEEP = float(os.environ.get("STEP_SLEEP", "0.05"))
STOP_FILE = os.environ.get("STOP_FILE")

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
                                     named_parameters=model.named_parameters())
sampler = hvd.elastic.ElasticSampler(dataset, shuffle=True, seed=3)
loader = torch.utils.data.DataLoader(dataset, batch_size=BATCH, sampler=sampler)
state = hvd.elastic.TorchState(model, optimizer, sampler=sampler, epoch=0, step=0)


def on_reset():
    for group in optimizer.param_groups:
        group["lr"] = 0.01 * hvd.size()
    print(f"RESET {hvd.size()}", flush=True)


state.register_reset_callbacks([on_reset])


@hvd.elastic.run
def train(state):
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
            if state.step % COMMIT_EVERY == 0:
                state.commit()
                if hvd.rank() == 0:
                    print(f"COMMIT {state.step}", flush=True)
            time.sleep(STEP_SLEEP)
        state.epoch += 1
        state.commit()
        if STOP_FILE and hvd.broadcast_object(os.path.exists(STOP_FILE), name="stop"):
            break


train(state)
fingerprint = [float(v) for p in model.parameters() for v in p.detach().flatten()]
print("FINAL " + json.dumps({"epoch": state.epoch, "step": state.step, "rank": hvd.rank(), "size": hvd.size(),
                             "params": fingerprint}), flush=True)
