"""Elastic training for Keras 3: ``hvd.elastic.run``, ``KerasState`` and the commit/update callbacks.

    state = hvd.elastic.KerasState(model, epoch=0, batch=0)
    callbacks = [hvd.elastic.UpdateBatchStateCallback(state), hvd.elastic.UpdateEpochStateCallback(state),
                 hvd.elastic.CommitStateCallback(state, batches_per_commit=10)]   # commit last

    @hvd.elastic.run
    def train(state):
        model.fit(data, initial_epoch=state.epoch, epochs=EPOCHS, callbacks=callbacks)

After every reset ``KerasState`` drops the model's compiled train, test and
predict functions, so the next ``fit`` traces them again for the new number
of ranks (a traced step keeps what ``hvd.size()`` was when it was traced).
"""

from __future__ import annotations

import keras

from roundel.common import elastic as common
from roundel.common.elastic import ObjectState, State
from roundel.errors import HorovodInternalError, HostsUpdatedInterrupt
from roundel.keras.core import broadcast_variables

__all__ = ["CommitStateCallback", "HorovodInternalError", "HostsUpdatedInterrupt", "KerasState", "ObjectState",
           "State", "TensorFlowKerasState", "UpdateBatchStateCallback", "UpdateEpochStateCallback", "run"]


def run(func):
    """Decorate a training function ``func(state, ...)`` to survive failures and membership changes.

    As ``roundel.torch.elastic.run``; on the TensorFlow backend a failed
    collective inside a compiled step (a ``tf.errors.OpError``) counts as
    HorovodInternalError.
    """
    if keras.backend.backend() == "tensorflow":
        from roundel.tfops.tf_errors import internal_errors_raised
        func = internal_errors_raised(func)
    return common.run_fn(func)


class KerasState(common.ModelState):
    """Elastic state of a Keras 3 job: ``KerasState(model, optimizer=None, epoch=0, batch=0, ...)``.

    Holds the built ``model``'s weights and ``optimizer``'s variables
    (default ``model.optimizer``; a ``DistributedOptimizer`` is fine) but not
    its learning rate (set it for ``hvd.size()`` in a reset callback). Other
    keywords are picklable values handled as by ``ObjectState``. ``model`` and
    ``optimizer`` are attributes. After every reset the model's traced
    functions are dropped so that the next ``fit``/``evaluate``/``predict``
    traces them again.
    """

    def __init__(self, model, optimizer=None, **kwargs):
        super().__init__(broadcast_variables, model, optimizer, **kwargs)


class CommitStateCallback(keras.callbacks.Callback):
    """``state.commit()`` after every ``batches_per_commit`` training batches and at the end of every epoch.

    Put it after the Update*StateCallbacks in the callback list, so that
    what is committed includes the batch just finished.
    """

    def __init__(self, state, batches_per_commit: int = 1):
        super().__init__()
        if batches_per_commit < 1:
            raise ValueError(f"batches_per_commit={batches_per_commit} must be >= 1")
        self.state = state
        self.batches_per_commit = batches_per_commit
        self._since_commit = 0

    def on_train_batch_end(self, batch, logs=None):
        self._since_commit += 1
        if self._since_commit >= self.batches_per_commit:
            self._since_commit = 0
            self.state.commit()

    def on_epoch_end(self, epoch, logs=None):
        self._since_commit = 0
        self.state.commit()


class UpdateBatchStateCallback(keras.callbacks.Callback):
    """Keep ``state.batch`` = the batches of the current epoch done so far (0 at the end of an epoch).

    A ``fit`` that resumes an epoch a reset interrupted (``steps_per_epoch``
    of what is left) counts on from the ``state.batch`` it started with.
    """

    def __init__(self, state):
        super().__init__()
        self.state = state
        self._first = 0

    def on_epoch_begin(self, epoch, logs=None):
        self._first = self.state.batch

    def on_train_batch_end(self, batch, logs=None):
        self.state.batch = self._first + batch + 1

    def on_epoch_end(self, epoch, logs=None):
        self.state.batch = 0


class UpdateEpochStateCallback(keras.callbacks.Callback):
    """Keep ``state.epoch`` = the number of epochs finished (``fit``'s next ``initial_epoch``)."""

    def __init__(self, state):
        super().__init__()
        self.state = state

    def on_epoch_end(self, epoch, logs=None):
        self.state.epoch = epoch + 1


TensorFlowKerasState = KerasState  # Horovod's name for the Keras state, importable from here as in Horovod
