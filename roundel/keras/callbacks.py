"""Keras 3 callbacks with Horovod's names and behaviour (any Keras backend)."""

from __future__ import annotations

import keras
import numpy as np

from roundel.common import basics
from roundel.common.process_sets import global_process_set
from roundel.keras import core


class BroadcastGlobalVariablesCallback(keras.callbacks.Callback):
    """Give every rank the root rank's model and optimizer variables when training starts.

    Broadcasts at ``on_train_begin`` (building the optimizer first when the
    model is built), so the first step already starts from equal state, and
    once more after the first batch if the optimizer could not be built yet.
    ``local_variables`` (a variable or a collection of them) are left out, as
    are those given to ``register_local_var``. ``device`` is accepted for
    Horovod compatibility. Raises ValueError if ``local_variables`` holds
    something that is not a variable.
    """

    def __init__(self, root_rank=0, device="", local_variables=None, process_set=global_process_set):
        super().__init__()
        self.root_rank = root_rank
        self.device = device
        self.process_set = process_set
        self.broadcast_done = False
        self._optimizer_pending = False
        self._local_vars = set()
        if local_variables is None:
            local_variables = []
        elif _is_variable(local_variables):
            local_variables = [local_variables]
        local_variables = list(local_variables)
        if not all(_is_variable(v) for v in local_variables):
            raise ValueError("All local variables must be Keras or tf.Variable variables.")
        for v in local_variables:
            self.register_local_var(v)

    def register_local_var(self, var):
        """Leave ``var`` out of the broadcast (it stays as each rank has it)."""
        self._local_vars.add(id(var))

    def _broadcast(self):
        variables = [v for v in self.model.variables if id(v) not in self._local_vars]
        optimizer = getattr(self.model, "optimizer", None)
        if optimizer is not None and not getattr(optimizer, "built", False) and self.model.built:
            optimizer.build(self.model.trainable_variables)  # so its state is equal before the first step
        built = optimizer is not None and getattr(optimizer, "built", False)
        if built:
            variables += list(optimizer.variables)
        core.broadcast_variables(variables, self.root_rank, self.process_set,
                                 prefix=f"callback.{len(variables)}")
        return built

    def on_train_begin(self, logs=None):
        if self.broadcast_done:
            return
        self._optimizer_pending = not self._broadcast()
        self.broadcast_done = True

    def on_train_batch_end(self, batch, logs=None):
        if self._optimizer_pending:
            self._broadcast()
            self._optimizer_pending = False


def _is_variable(value) -> bool:
    if isinstance(value, keras.Variable):
        return True
    if keras.backend.backend() == "tensorflow":
        import tensorflow as tf
        return isinstance(value, tf.Variable)
    return False


class BestModelCheckpoint(keras.callbacks.ModelCheckpoint):
    """Keras's ``ModelCheckpoint`` with ``save_best_only=True``, saving on rank 0 only.

    Horovod's signature, plus ``filepath`` (Horovod's Spark estimator sets
    ``callback.filepath`` itself); set one of them before training, ending in
    ``.keras`` (or ``.weights.h5`` with ``save_weights_only``). Put
    ``MetricAverageCallback`` before it to monitor the ranks' average.
    Raises ValueError at training start when no ``filepath`` was set.
    """

    def __init__(self, monitor="val_loss", verbose=0, save_weights_only=False, mode="auto", save_freq="epoch",
                 filepath=None):
        placeholder = "best.weights.h5" if save_weights_only else "best.keras"
        super().__init__(filepath=filepath or placeholder, monitor=monitor, verbose=verbose, save_best_only=True,
                         save_weights_only=save_weights_only, mode=mode, save_freq=save_freq)
        self.filepath = filepath

    def on_train_begin(self, logs=None):
        if not self.filepath:
            raise ValueError("BestModelCheckpoint needs a file path: pass filepath= or set callback.filepath "
                             "before training")
        super().on_train_begin(logs)

    def _save_model(self, epoch, batch, logs):
        if basics.rank() == 0:
            super()._save_model(epoch, batch, logs)


class MetricAverageCallback(keras.callbacks.Callback):
    """Replace every metric in the epoch's logs by its average over the ranks.

    Put it before callbacks that read the logs (checkpoints, early stopping,
    TensorBoard) so they see the averaged values.
    """

    def __init__(self, device="", process_set=global_process_set):
        super().__init__()
        self.process_set = process_set

    def _average(self, logs, tag):
        if not logs:
            return
        keys = sorted(k for k, v in logs.items() if np.ndim(v) == 0 and np.issubdtype(np.asarray(v).dtype, np.number))
        if not keys:
            return
        values = np.array([float(logs[k]) for k in keys], dtype=np.float64)
        averaged = core.allreduce(values, name=f"metric_average.{tag}.{','.join(keys)}",
                                  process_set=self.process_set)
        for k, v in zip(keys, averaged):
            logs[k] = float(v)

    def on_epoch_end(self, epoch, logs=None):
        self._average(logs, "epoch")


def _get_lr(optimizer) -> float:
    lr = optimizer.learning_rate
    return float(keras.ops.convert_to_numpy(lr))


def _set_lr(optimizer, value: float) -> None:
    if not isinstance(optimizer._learning_rate, keras.Variable):
        raise ValueError("this callback needs the optimizer's learning_rate to be a number, not a schedule")
    optimizer.learning_rate.assign(value)


class LearningRateScheduleCallback(keras.callbacks.Callback):
    """Set the learning rate to ``initial_lr * multiplier(epoch)`` for epochs in [start_epoch, end_epoch).

    ``multiplier`` is a number or a function of the (fractional, unless
    ``staircase``) epoch. With ``staircase`` the rate changes at the first
    batch of each epoch; otherwise at every batch, with the epoch advanced by
    ``batch / steps_per_epoch`` (``steps_per_epoch`` found from ``fit`` when
    not given). ``momentum_correction`` scales a momentum held in a Keras
    variable by new_lr/old_lr for the step where the rate changes; Keras 3's
    built-in optimizers hold momentum as a plain number fixed when the train
    step is traced, and then it is left alone.
    """

    def __init__(self, initial_lr, multiplier, start_epoch=0, end_epoch=None, staircase=True,
                 momentum_correction=True, steps_per_epoch=None, verbose=0):
        super().__init__()
        if initial_lr is None:
            raise ValueError("initial_lr is required")
        self.initial_lr = float(initial_lr)
        self.start_epoch = start_epoch
        self.end_epoch = end_epoch
        self.staircase = staircase
        self.momentum_correction = momentum_correction
        self.steps_per_epoch = steps_per_epoch
        self.verbose = verbose
        self.current_epoch = None
        self._restore_momentum = None
        if callable(multiplier):
            self.multiplier = multiplier
        else:
            self.staircase = True
            self.multiplier = lambda epoch: multiplier

    def _autodetect_steps_per_epoch(self):
        steps = (self.params or {}).get("steps")
        if steps:
            return steps
        raise ValueError("could not find the number of steps per epoch; pass steps_per_epoch= to the callback")

    def _adjust_learning_rate(self, epoch):
        optimizer = self.model.optimizer
        old_lr = _get_lr(optimizer)
        new_lr = self.initial_lr * self.multiplier(epoch)
        _set_lr(optimizer, new_lr)
        momentum = getattr(optimizer, "momentum", None)
        if self.momentum_correction and isinstance(momentum, keras.Variable) and old_lr > 0:
            self._restore_momentum = float(keras.ops.convert_to_numpy(momentum))
            momentum.assign(self._restore_momentum * new_lr / old_lr)
        return new_lr

    def on_train_begin(self, logs=None):
        if not self.staircase and not self.steps_per_epoch:
            self.steps_per_epoch = self._autodetect_steps_per_epoch()

    def on_epoch_begin(self, epoch, logs=None):
        self.current_epoch = epoch

    def _in_scope(self) -> bool:
        return not (self.current_epoch < self.start_epoch or
                    (self.end_epoch is not None and self.current_epoch >= self.end_epoch))

    def on_train_batch_begin(self, batch, logs=None):
        if not self._in_scope():
            return
        if self.staircase and batch == 0:
            self._adjust_learning_rate(self.current_epoch)
        elif not self.staircase:
            self._adjust_learning_rate(self.current_epoch + float(batch) / self.steps_per_epoch)

    def on_train_batch_end(self, batch, logs=None):
        if self._restore_momentum is not None:
            self.model.optimizer.momentum.assign(self._restore_momentum)
            self._restore_momentum = None

    def on_epoch_end(self, epoch, logs=None):
        if logs is not None:
            logs["learning_rate"] = _get_lr(self.model.optimizer)


class LearningRateWarmupCallback(LearningRateScheduleCallback):
    """Ramp the learning rate from ``initial_lr / size`` to ``initial_lr`` over ``warmup_epochs``.

    The rate at fractional epoch e (advanced per batch) is
    ``initial_lr / size * (e' * (size - 1) / warmup_epochs + 1)`` with
    ``e' = e + 1 / steps_per_epoch``, reaching ``initial_lr`` at the end of
    the last warm-up epoch (Goyal et al., 2017). With ``verbose`` rank 0
    prints when the warm-up ends.
    """

    def __init__(self, initial_lr, warmup_epochs=5, momentum_correction=True, steps_per_epoch=None, verbose=0):
        def multiplier(epoch):
            epoch += 1.0 / self.steps_per_epoch
            return 1.0 / basics.size() * (epoch * (basics.size() - 1) / warmup_epochs + 1)

        super().__init__(initial_lr, multiplier, start_epoch=0, end_epoch=warmup_epochs, staircase=False,
                         momentum_correction=momentum_correction, steps_per_epoch=steps_per_epoch, verbose=verbose)
        self.warmup_epochs = warmup_epochs

    def on_epoch_end(self, epoch, logs=None):
        super().on_epoch_end(epoch, logs)
        if epoch == self.end_epoch - 1 and self.verbose > 0 and basics.rank() == 0:
            print(f"\nEpoch {epoch + 1}: finished gradual learning rate warmup to "
                  f"{_get_lr(self.model.optimizer):g}.", flush=True)
