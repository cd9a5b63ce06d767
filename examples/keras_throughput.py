"""A Keras callback that adds the job's samples/s to each epoch's logs, so Keras' own progress line shows it.

Keras' bar already shows time per step; this adds one figure at the end of
each epoch, ``samples/s``: the samples every rank trained on that epoch
(this rank's batches times the rank count: every rank's batch is the same
size) over the epoch's wall time on this rank. Put it before any callback
that should see the figure (it is in ``History`` too).
"""

from __future__ import annotations

import time
from typing import Callable

import keras


class SamplesPerSecond(keras.callbacks.Callback):
    """Adds ``logs["samples/s"]`` at every epoch's end: ``batch_size x size() x batches / seconds``.

    ``size`` is called at each epoch's end (pass ``hvd.size``: an elastic
    reset changes it).
    """

    def __init__(self, batch_size: int, size: Callable[[], int]):
        super().__init__()
        self.batch_size, self.size = batch_size, size
        self.batches, self.started = 0, time.perf_counter()

    def on_epoch_begin(self, epoch, logs=None):
        self.batches, self.started = 0, time.perf_counter()

    def on_train_batch_end(self, batch, logs=None):
        self.batches += 1

    def on_epoch_end(self, epoch, logs=None):
        if logs is not None:
            seconds = max(time.perf_counter() - self.started, 1e-9)
            logs["samples/s"] = self.batch_size * self.size() * self.batches / seconds
