"""Variables and Python objects across ranks: ``broadcast_variables``, ``broadcast_object``, ``allgather_object``."""

from __future__ import annotations

import tensorflow as tf

from roundel.common import collectives, objects
from roundel.common.process_sets import global_process_set
from roundel.tfops import mpi_ops

_do_not_convert = tf.autograph.experimental.do_not_convert


@_do_not_convert
def broadcast_variables(variables, root_rank, process_set=global_process_set, inplace=False):
    """Overwrite every variable of ``variables`` with the root rank's value.

    Eagerly this assigns at once and returns None; inside ``tf.function`` it
    returns the group op of the assignments. Variables are matched across
    ranks by their position in the list, so pass them in the same order on
    every rank (as ``model.variables`` does). ``inplace`` is accepted for
    Horovod compatibility.
    """
    variables = list(variables)
    if not variables:
        return None if tf.executing_eagerly() else tf.no_op()
    values = [tf.convert_to_tensor(v) for v in variables]
    names = [f"broadcast_variables.{i}.{getattr(v, 'path', None) or getattr(v, 'name', '')}"
             for i, v in enumerate(variables)]
    if tf.executing_eagerly():
        handles = [collectives.broadcast_async(mpi_ops.to_buffer(t.numpy()), root_rank, name=n,
                                                process_set=process_set) for t, n in zip(values, names)]
        for v, h in zip(variables, handles):
            v.assign(mpi_ops.to_numpy(collectives.synchronize(h)))
        return None
    assigns = [v.assign(mpi_ops.broadcast(t, root_rank, name=n, process_set=process_set))
               for v, t, n in zip(variables, values, names)]
    return tf.group(*assigns)


@_do_not_convert
def broadcast_global_variables(root_rank):
    """Horovod's TF1 helper: in a ``tf.compat.v1`` graph, the op that sets every global variable to the root's.

    Returns the group op of the assignments (run it in the session, as in
    Horovod). Eagerly (TensorFlow 2 has no global variable collection) it
    raises RuntimeError pointing to ``broadcast_variables``, as Horovod does.
    """
    if tf.executing_eagerly():
        raise RuntimeError("hvd.broadcast_global_variables() does not support eager execution: TensorFlow 2 has "
                           "no global variable collection; use hvd.broadcast_variables(model.variables, root_rank) "
                           "(and the optimizer's variables), or roundel.keras's BroadcastGlobalVariablesCallback")
    return broadcast_variables(tf.compat.v1.global_variables(), root_rank)


@_do_not_convert
def broadcast_object(obj, root_rank=0, name=None, process_set=global_process_set):
    """Return the root rank's ``obj`` on every rank (anything cloudpickle can serialize). Eager only."""
    # A fixed default name: the root's object and the others' placeholders may differ in type.
    return objects.broadcast_object(obj, root_rank, name=name or "object", process_set=process_set)


@_do_not_convert
def allgather_object(obj, name=None, process_set=global_process_set) -> list:
    """Return the list of every rank's ``obj``, in rank order. Eager only."""
    return objects.allgather_object(obj, name=name or "object", process_set=process_set)


@_do_not_convert
def broadcast_object_fn(root_rank=0, session=None, name=None, process_set=global_process_set):
    """Horovod's TF1-style helper: a function ``fn(obj)`` returning the root rank's ``obj`` on every rank.

    ``session`` is accepted for Horovod compatibility (TensorFlow 2 runs
    eagerly); each call of ``fn`` is one ``broadcast_object``, so every rank
    must call it the same number of times.
    """
    base = name or "broadcast_object_fn"

    def broadcast_fn(obj):
        return broadcast_object(obj, root_rank, name=base, process_set=process_set)

    return broadcast_fn
