"""``DistributedGradientTape``: ``tf.GradientTape`` whose gradients are reduced across the ranks."""

from __future__ import annotations

import keras
import tensorflow as tf

_do_not_convert = tf.autograph.experimental.do_not_convert

from roundel.ops import ReduceOp
from roundel.common.gradient_options import GradientOptions
from roundel.common.process_sets import global_process_set
from roundel.tfops.compression import Compression
from roundel.tfops.gradients import reduce_gradients


def variable_key(variable):
    """A hashable key for a ``tf.Variable`` or a Keras 3 variable (keyed by the ``tf.Variable`` it holds)."""
    inner = getattr(variable, "value", None)
    if isinstance(inner, tf.Variable):
        variable = inner
    return variable.ref() if isinstance(variable, tf.Variable) else None


def _index_groups(variable_groups, sources):
    """``variable_groups`` (``GradientOptions.groups``) as lists of positions in ``sources`` (variables
    not among them are left out); None without groups."""
    if variable_groups is None:
        return None
    position = {}
    for i, s in enumerate(sources):
        position.setdefault(variable_key(s), i)
    return [[position[variable_key(v)] for v in group if variable_key(v) in position] for group in variable_groups]


def _scaled(grad, factor):
    if isinstance(grad, tf.IndexedSlices):
        return tf.IndexedSlices(grad.values / factor, grad.indices, grad.dense_shape)
    return grad / factor


class _DistributedGradientTape(tf.GradientTape):
    """Mixed into the wrapped tape's class by ``DistributedGradientTape``."""

    def register_local_source(self, source):
        """Keep ``source``'s gradient local: not reduced (divided by the size with ``scale_local_gradients``)."""
        key = variable_key(source)
        if key is None:
            raise ValueError(f"register_local_source expects a variable, got a {type(source).__name__}")
        self._roundel_local.add(key)

    @_do_not_convert
    def gradient(self, target, sources, output_gradients=None, unconnected_gradients=None,
                 use_generic_names=False):
        kwargs = {} if unconnected_gradients is None else {"unconnected_gradients": unconnected_gradients}
        grads = super().gradient(target, sources, output_gradients, **kwargs)
        options = self._roundel_options
        flat_sources = tf.nest.flatten(sources)
        flat = tf.nest.flatten(grads)
        local = [variable_key(s) in self._roundel_local for s in flat_sources]
        shared = [i for i, is_local in enumerate(local) if not is_local]
        groups = _index_groups(options.groups, flat_sources)
        if groups is not None:
            new_position = {old: new for new, old in enumerate(shared)}
            groups = [[new_position[i] for i in group if i in new_position] for group in groups]
        reduced = reduce_gradients([flat[i] for i in shared], options, index_groups=groups)
        results = list(flat)
        for i, r in zip(shared, reduced):
            results[i] = r
        if options.scale_local_gradients:
            for i, is_local in enumerate(local):
                if is_local and results[i] is not None:
                    results[i] = _scaled(results[i], options.process_set.size())
        return tf.nest.pack_sequence_as(grads, results)

    def get_local_and_global_gradients(self, target, sources, output_gradients=None, use_generic_names=False):
        """``gradient()``, split into ``(local [(source, grad)], global [(source, grad)])`` lists."""
        grads = self.gradient(target, sources, output_gradients)
        local, shared = [], []
        for s, g in zip(sources, grads):
            (local if variable_key(s) in self._roundel_local else shared).append((s, g))
        return local, shared


@_do_not_convert
def DistributedGradientTape(gradtape, device_dense="", device_sparse="", compression=Compression.none,
                            sparse_as_dense=False, op=ReduceOp.Average, gradient_predivide_factor=1.0,
                            num_groups=0, groups=None, process_set=global_process_set,
                            scale_local_gradients=True):
    """Wrap ``gradtape`` so ``gradient()`` returns gradients averaged (``op``) across the ranks.

    Returns a tape of a subclass of ``gradtape``'s class sharing its recorded
    operations. ``groups`` is Horovod's: a number of fused allreduce groups,
    or lists of ``tf.Variable`` whose gradients are reduced together (every
    other gradient alone); ``num_groups`` is its older spelling. Sources
    registered with ``register_local_source`` keep their local gradient,
    divided by the set's size when ``scale_local_gradients``. ``device_*``
    are accepted for Horovod compatibility. The options are checked once, as
    a ``roundel.common.gradient_options.GradientOptions`` (its ValueError or
    TypeError for a bad argument), which every ``gradient()`` call reduces with.
    """
    if groups is not None:
        num_groups = 0  # Horovod's tape: groups= takes the place of the older num_groups=
    options = GradientOptions(op=op, compression=compression, gradient_predivide_factor=gradient_predivide_factor,
                              sparse_as_dense=sparse_as_dense, num_groups=num_groups, groups=groups,
                              process_set=process_set, scale_local_gradients=scale_local_gradients,
                              variable_key=variable_key)
    cls = type(gradtape.__class__.__name__, (_DistributedGradientTape, gradtape.__class__), {})
    tape = cls.__new__(cls)
    tape.__dict__.update(gradtape.__dict__)
    tape._roundel_options = options
    tape._roundel_local = set()
    return tape


def local_layer_variables(local_layers) -> list:
    """The trainable variables of ``local_layers`` (one Keras layer or a collection of them)."""
    if local_layers is None:
        return []
    if isinstance(local_layers, keras.layers.Layer):
        local_layers = [local_layers]
    local_layers = list(local_layers)
    if not all(isinstance(layer, keras.layers.Layer) for layer in local_layers):
        raise ValueError("All local layers must be of keras.layers.Layer type.")
    return [v for layer in local_layers for v in layer.trainable_weights]


@_do_not_convert
def PartialDistributedGradientTape(gradtape, device_dense="", device_sparse="", compression=Compression.none,
                                   sparse_as_dense=False, op=ReduceOp.Average, gradient_predivide_factor=1.0,
                                   num_groups=0, groups=None, process_set=global_process_set, local_layers=None,
                                   scale_local_gradients=True):
    """``DistributedGradientTape`` whose ``local_layers``' gradients stay local (not reduced).

    With ``scale_local_gradients`` those gradients are divided by the set's
    size, as in Horovod. Without ``local_layers`` it is ``DistributedGradientTape``.
    """
    local_vars = local_layer_variables(local_layers)
    tape = DistributedGradientTape(gradtape, device_dense, device_sparse, compression, sparse_as_dense, op,
                                   gradient_predivide_factor, num_groups, groups, process_set,
                                   scale_local_gradients)
    for v in local_vars:
        tape.register_local_source(v)
    return tape
