"""Elastic training for TensorFlow 2: ``hvd.elastic.run``, ``TensorFlowState`` and ``TensorFlowKerasState``.

A collective that fails inside a ``tf.function`` reaches Python as a
``tf.errors.OpError`` whose message carries roundel's error; ``run`` treats
it as HorovodInternalError. A ``tf.function`` of your own keeps what
``hvd.size()`` was when it was traced (a ``gradient_predivide_factor``'s
scale, shapes that depend on it): trace it again after a reset, e.g. by
creating it in the training function or in a reset callback.
``TensorFlowKerasState`` does this for the model's Keras functions.
"""

from __future__ import annotations

from roundel.common import elastic as common
from roundel.common.elastic import ObjectState, State
from roundel.errors import HorovodInternalError, HostsUpdatedInterrupt
from roundel.tensorflow.functions import broadcast_variables
from roundel.tfops.tf_errors import internal_errors_raised

__all__ = ["HorovodInternalError", "HostsUpdatedInterrupt", "ObjectState", "State", "TensorFlowKerasState",
           "TensorFlowState", "run"]


def run(func):
    """Decorate a training function ``func(state, ...)`` to survive failures and membership changes.

    On HorovodInternalError (also when raised by a collective inside a
    ``tf.function``) the state is restored to its last commit; on
    HostsUpdatedInterrupt it is kept. Either way the job is re-formed, the
    reset callbacks run, every rank takes rank 0's state, and ``func`` is
    called again with the same state.
    """
    return common.run_fn(internal_errors_raised(func))


class TensorFlowState(common.VariablesState):
    """Elastic state of ``tf.Variable``s: ``TensorFlowState(variables, epoch=0, ...)``.

    The variables (the same list, in the same order, on every rank) are
    copied at ``commit()``, assigned back by ``restore()`` and broadcast
    from rank 0 by ``sync()``; other keywords are picklable values handled
    as by ``ObjectState``.
    """

    def __init__(self, variables=None, **kwargs):
        super().__init__(broadcast_variables, variables or [], **kwargs)


class TensorFlowKerasState(common.ModelState):
    """Elastic state of a Keras model and optimizer: ``TensorFlowKerasState(model, optimizer=None, epoch=0, ...)``.

    As ``roundel.keras.elastic.KerasState``, on Keras' TensorFlow backend.
    """

    def __init__(self, model, optimizer=None, **kwargs):
        super().__init__(broadcast_variables, model, optimizer, **kwargs)
