"""Worker for tests/test_output.py: ``output_worker.py SCENARIO``.

* ``keras_progress``: rank 0 runs Keras ``fit`` with its progress bar (verbose=1), 2 epochs of 5
  slowed-down steps, so that the bar is redrawn several times per epoch;
* ``tqdm``: every rank draws a tqdm bar of 20 steps on stderr, redrawn at each step;
* ``before_init``: an allreduce before ``hvd.init()`` (a user mistake), once every rank has imported roundel
  (each rank marks itself ready in the directory ``BEFORE_INIT_MEETING`` names, when set, and waits for the others).
"""

from __future__ import annotations

import os
import sys
import time

SCENARIO = sys.argv[1]

if SCENARIO == "keras_progress":
    os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
    os.environ.setdefault("TF_ENABLE_ONEDNN_OPTS", "0")
    os.environ.setdefault("KERAS_BACKEND", "tensorflow")
    import keras
    import numpy as np

    import roundel.keras as hvd

    class SlowSteps(keras.callbacks.Callback):
        """Spread each epoch over about a second, so that progress updates are far apart in time."""

        def on_train_batch_end(self, batch, logs=None):
            time.sleep(0.25)

    hvd.init()
    model = keras.Sequential([keras.Input((4,)), keras.layers.Dense(1)])
    model.compile(optimizer=hvd.DistributedOptimizer(keras.optimizers.SGD(0.01)), loss="mse")
    x = np.ones((40, 4), np.float32)
    y = np.ones((40, 1), np.float32)
    model.fit(x, y, batch_size=8, epochs=2, verbose=1 if hvd.rank() == 0 else 0,
              callbacks=[hvd.callbacks.BroadcastGlobalVariablesCallback(0), SlowSteps()])
    print("FIT DONE", flush=True)
elif SCENARIO == "tqdm":
    from tqdm import tqdm

    import roundel.torch as hvd

    hvd.init()
    for _ in tqdm(range(20), desc=f"rank {hvd.rank()}", mininterval=0, miniters=1, ascii=True):
        time.sleep(0.01)
    print("BAR DONE", flush=True)
elif SCENARIO == "before_init":
    import torch

    import roundel.torch as hvd

    def train_step():
        return hvd.allreduce(torch.ones(2))

    meeting = os.environ.get("BEFORE_INIT_MEETING")
    if meeting:  # every rank gets this far before any fails: the launcher stops the others at the first failure
        open(os.path.join(meeting, f"ready.{os.environ['HOROVOD_RANK']}"), "w").close()
        deadline = time.monotonic() + 60
        while len(os.listdir(meeting)) < int(os.environ["HOROVOD_SIZE"]) and time.monotonic() < deadline:
            time.sleep(0.01)
    train_step()
else:
    sys.exit(f"unknown scenario {SCENARIO!r}")
