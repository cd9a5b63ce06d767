"""Keras 2 names that Horovod-era scripts still use, kept on Keras 3's optimizers with a DeprecationWarning.

Keras 3 renamed ``optimizer.lr`` to ``optimizer.learning_rate``. Horovod's
elastic scripts and many Keras 2 callbacks still read and ``assign`` to
``optimizer.lr``; :data:`LR_ALIAS` answers them with the learning rate
itself (the same variable, so ``optimizer.lr.assign(x)`` changes it).
"""

from __future__ import annotations

import warnings

import keras

__all__ = ["LR_ALIAS", "install"]

_RENAMED = ("optimizer.lr is the Keras 2 name of optimizer.learning_rate, which Keras 3 dropped; roundel keeps it "
            "for Horovod-era scripts: use optimizer.learning_rate")


def _get_lr(optimizer):
    warnings.warn(_RENAMED, DeprecationWarning, stacklevel=2)
    return optimizer.learning_rate


def _set_lr(optimizer, value) -> None:
    warnings.warn(_RENAMED, DeprecationWarning, stacklevel=2)
    optimizer.learning_rate = value


LR_ALIAS = property(_get_lr, _set_lr, doc="Deprecated: ``learning_rate`` (the Keras 2 name).")


def install() -> None:
    """Give Keras 3's optimizers their Keras 2 ``lr`` (only where Keras itself has no such name)."""
    if not hasattr(keras.optimizers.Optimizer, "lr"):
        keras.optimizers.Optimizer.lr = LR_ALIAS
