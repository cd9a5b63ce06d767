"""Keras 3 ``DistributedOptimizer`` and value-level collectives, for the TensorFlow and PyTorch backends.

Value-level helpers (``allreduce``, ``broadcast_variables``, ...) work on any
backend: they read values with ``keras.ops.convert_to_numpy``, reduce them
through the engine (:mod:`roundel.common.collectives`), and assign or return
NumPy arrays. ``DistributedOptimizer`` reduces gradients inside the compiled
train step: with ``roundel.tfops`` ops on the TensorFlow backend, and
directly on the gradients (torch tensors, the engine's own buffer type) on
the PyTorch backend.
"""

from __future__ import annotations

import keras
import numpy as np

from roundel.common import basics, buffers, collectives, objects
from roundel.common.compression import NoneCompressor
from roundel.common.gradient_groups import group_indices
from roundel.common.gradient_options import GradientOptions
from roundel.common.process_sets import global_process_set
from roundel.errors import RoundelError
from roundel.keras import keras2_names
from roundel.ops import ReduceOp, resolve_op


class Compression:
    """Gradient compression for ``DistributedOptimizer``: ``none``, ``fp16`` or ``bf16`` (any backend).

    Any compressor (an object with ``compress(tensor) -> (tensor, ctx)`` and
    ``decompress(tensor, ctx)``, such as ``roundel.tensorflow.Compression.fp16``
    or ``roundel.torch.Compression.fp16`` for their backend) is accepted too.
    """

    none = "none"
    fp16 = "fp16"
    bf16 = "bf16"


def _backend() -> str:
    return keras.backend.backend()


def init(comm=None, process_sets=None) -> None:
    """Join the job, as ``roundel.common.basics.init`` (Horovod's ``hvd.init``).

    On the TensorFlow backend, first gives torch one thread
    (:func:`roundel.common.buffers.use_one_packing_thread`): there torch only
    moves the engine's buffers.
    """
    if _backend() == "tensorflow":
        buffers.use_one_packing_thread()
    basics.init(comm, process_sets)


def _resolve_compression(compression):
    """The compressor for ``compression``: a ``Compression`` name is cast with Keras ops; others are kept."""
    if not isinstance(compression, str):
        return compression  # a compressor object, or None (no compression), checked by GradientOptions
    if compression not in ("none", "fp16", "bf16"):
        raise ValueError(f"compression={compression!r}: use hvd.Compression.none, fp16 or bf16")
    if compression == "none":
        return NoneCompressor
    return _Cast(compression.replace("fp", "float").replace("bf", "bfloat"))


class _Cast:
    """Sends floating-point gradients as ``wire`` (float16 or bfloat16), on any Keras backend."""

    def __init__(self, wire: str):
        self.wire = wire

    def compress(self, tensor):
        dtype = keras.backend.standardize_dtype(tensor.dtype)
        if "float" in dtype and dtype != self.wire:
            return keras.ops.cast(tensor, self.wire), dtype
        return tensor, None

    def decompress(self, tensor, ctx):
        return tensor if ctx is None else keras.ops.cast(tensor, ctx)


# ------------------------------------------------------------ value-level collectives
def _buffer(value):
    """An engine buffer holding a copy of ``value`` (a copy: the caller may change ``value`` meanwhile)."""
    return buffers.from_numpy(np.array(keras.ops.convert_to_numpy(value), copy=True, order="C"))


def _result(start) -> np.ndarray:
    """Start a collective with ``start()``, wait for it, and return its result as NumPy (bfloat16 comes back
    as float32)."""
    return buffers.to_numpy(collectives.blocking(start))


def allreduce(value, name=None, average=None, prescale_factor=1.0, postscale_factor=1.0, op=None,
              compression=None, process_set=global_process_set):
    """Reduce a tensor-like ``value`` (Average by default) across the set; returns a NumPy array."""
    op = resolve_op(op, average)
    buffer = _buffer(value)
    return _result(lambda: collectives.allreduce_async(buffer, name, op, prescale_factor, postscale_factor,
                                                       process_set))


def allgather(value, name=None, process_set=global_process_set):
    """Concatenate every rank's ``value`` along dimension 0; returns a NumPy array."""
    buffer = _buffer(value)
    return _result(lambda: collectives.allgather_async(buffer, name, process_set))


def broadcast(value, root_rank, name=None, process_set=global_process_set):
    """The root rank's ``value`` on every rank, as a NumPy array."""
    buffer = _buffer(value)
    return _result(lambda: collectives.broadcast_async(buffer, root_rank, name, process_set))


def reducescatter(value, name=None, op=ReduceOp.Average, process_set=global_process_set):
    """Reduce ``value`` and return this rank's slice of dimension 0, as a NumPy array."""
    buffer = _buffer(value)
    return _result(lambda: collectives.reducescatter_async(buffer, name, resolve_op(op), process_set))


def broadcast_object(obj, root_rank=0, name=None, process_set=global_process_set):
    """The root rank's ``obj`` on every rank (anything cloudpickle can serialize)."""
    return objects.broadcast_object(obj, root_rank, name=name or "object", process_set=process_set)


def allgather_object(obj, name=None, process_set=global_process_set) -> list:
    """Every rank's ``obj``, in rank order."""
    return objects.allgather_object(obj, name=name or "object", process_set=process_set)


def broadcast_variables(variables, root_rank=0, process_set=global_process_set, prefix="variables") -> None:
    """Assign the root rank's value to every Keras variable of ``variables`` (matched by position)."""
    variables = list(variables)
    handles = []
    for i, v in enumerate(variables):
        handles.append(collectives.broadcast_async(_buffer(v), root_rank, f"keras.{prefix}.{i}", process_set))
    for v, h in zip(variables, handles):
        v.assign(buffers.to_numpy(collectives.synchronize(h)))  # Keras casts to the variable's dtype


_optimizers: list = []
keras2_names.install()  # Horovod-era scripts assign optimizer.lr of plain Keras optimizers too


def broadcast_global_variables(root_rank, model=None, process_set=global_process_set) -> None:
    """Give every rank the root's model and optimizer state.

    Keras 3 has no global variable collection: pass ``model`` (its variables
    and its optimizer's are broadcast); without it the trainable and optimizer
    variables of every ``DistributedOptimizer`` built in this process are.
    Raises ValueError when there is nothing to broadcast.
    """
    if model is not None:
        variables = list(model.variables)
        optimizer = getattr(model, "optimizer", None)
        if optimizer is not None and getattr(optimizer, "built", False):
            variables += list(optimizer.variables)
    else:
        variables = []
        for opt in _optimizers:
            if getattr(opt, "built", False):
                variables += list(opt._trainable_variables) + list(opt.variables)
        if not variables:
            raise ValueError("broadcast_global_variables: Keras 3 has no global variables; pass model=, "
                             "or build a DistributedOptimizer first (or use BroadcastGlobalVariablesCallback)")
    broadcast_variables(variables, root_rank, process_set, prefix="global")


# ------------------------------------------------------------ DistributedOptimizer
def _in_xla_context() -> bool:
    import tensorflow as tf
    from tensorflow.python.ops import control_flow_util
    return control_flow_util.GraphOrParentsInXlaContext(tf.compat.v1.get_default_graph())


class _DistributedOptimizerMixin:
    """Mixed in before the wrapped optimizer's class: gradients are reduced before they are used.

    Without gradient accumulation ``apply`` reduces them first (so a wrapped
    ``LossScaleOptimizer`` checks the reduced gradients). With it (Keras's
    ``gradient_accumulation_steps``, which ``backward_passes_per_step`` sets)
    Keras calls ``_clip_gradients`` and ``_backend_update_step`` only on update
    steps, with the accumulated gradients: they are reduced there, then clipped.
    ``lr`` is the learning rate under its Keras 2 name (with a DeprecationWarning).
    """

    lr = keras2_names.LR_ALIAS

    def apply(self, grads, trainable_variables=None):
        if not self.gradient_accumulation_steps:
            variables = self._trainable_variables if trainable_variables is None else trainable_variables
            grads = self._roundel_reduce(list(grads), list(variables))
        return super().apply(grads, trainable_variables)

    def _clip_gradients(self, grads):
        if self.gradient_accumulation_steps:
            return grads  # clipped after the reduction, in _backend_update_step
        return super()._clip_gradients(grads)

    def _backend_update_step(self, grads, trainable_variables, learning_rate):
        if self.gradient_accumulation_steps:
            trainable_variables = list(trainable_variables)
            grads = self._roundel_reduce(list(grads), trainable_variables)
            steps = self._roundel_options.backward_passes_per_step
            if steps > 1 and not self._roundel_options.average_aggregated_gradients:
                grads = [g * steps for g in grads]  # Keras averages the accumulated gradients; Horovod sums
            grads = super()._clip_gradients(grads)
        super()._backend_update_step(grads, trainable_variables, learning_rate)

    def _roundel_groups(self, variables):
        """``groups=`` as lists of positions in ``variables`` (None without ``groups=``)."""
        if self._roundel_options.groups is None:
            return None
        position = {self._var_key(v): i for i, v in enumerate(variables)}
        known = position.keys() | self._trainable_variables_indices.keys()
        index_groups = []
        for group in self._roundel_options.groups:
            for v in group:
                if self._var_key(v) not in known:
                    raise ValueError(f"DistributedOptimizer groups=: variable {v.path!r} is not one this "
                                     "optimizer trains")
            index_groups.append([position[self._var_key(v)] for v in group if self._var_key(v) in position])
        return index_groups

    def register_local_var(self, var):
        """Keep ``var``'s gradient local: it is not reduced (Horovod's ``register_local_var``)."""
        self._roundel_local_keys.add(self._var_key(var))

    def _roundel_reduce(self, grads, variables):
        """Reduce the gradients of shared variables; those of local variables stay local (scaled by 1/size)."""
        options = self._roundel_options
        if options.process_set.size() <= 1:
            return grads
        local = [self._var_key(v) in self._roundel_local_keys for v in variables]
        if not any(local):
            return self._roundel_reduce_shared(grads, variables)
        shared = [i for i, is_local in enumerate(local) if not is_local]
        reduced = self._roundel_reduce_shared([grads[i] for i in shared], [variables[i] for i in shared])
        results = list(grads)
        for i, r in zip(shared, reduced):
            results[i] = r
        if options.scale_local_gradients:
            size = options.process_set.size()
            results = [g / size if is_local and g is not None else g for g, is_local in zip(results, local)]
        return results

    def _roundel_reduce_shared(self, grads, variables):
        options = self._roundel_options
        groups = self._roundel_groups(variables)
        if _backend() == "tensorflow":
            if _in_xla_context():
                raise RoundelError(
                    "roundel's DistributedOptimizer cannot run inside an XLA-compiled train step: its "
                    "collectives are Python ops that XLA cannot compile. Pass jit_compile=False to "
                    "model.compile() (Keras enables XLA by default on machines with a GPU).")
            from roundel.tfops.gradients import reduce_gradients
            return reduce_gradients(grads, options, name="keras.gradients", index_groups=groups)
        if _backend() == "torch":
            return _reduce_torch(grads, options, groups)
        raise NotImplementedError(f"roundel.keras supports the tensorflow and torch backends, not {_backend()!r}")


def _reduce_torch(grads, options: GradientOptions, index_groups):
    """Allreduce the torch-tensor gradients of the PyTorch backend as ``options`` say, in ``index_groups``
    (positions in ``grads``; None: ``options.num_groups``); None entries stay None."""
    process_set = options.process_set
    op, prescale, postscale = options.reduction_scaling(process_set.size())
    present = [i for i, g in enumerate(grads) if g is not None]
    results = list(grads)
    compression = options.compression
    for number, group in enumerate(group_indices(present, options.num_groups, index_groups)):
        compressed = [compression.compress(grads[i].detach()) for i in group]
        reduced = collectives.synchronize(collectives.grouped_allreduce_async(
            [c[0] for c in compressed], f"keras.gradients.group{number}", op, prescale, postscale, process_set))
        for i, r, (_, ctx) in zip(group, reduced, compressed):
            results[i] = compression.decompress(r, ctx)
    return results


def _keras_variable_key(value):
    """``id(value)`` for a Keras variable (``groups=`` entries are told apart by identity), else None."""
    return id(value) if isinstance(value, keras.Variable) else None


def DistributedOptimizer(optimizer, name=None, device_dense="", device_sparse="", compression=Compression.none,
                         sparse_as_dense=False, gradient_predivide_factor=1.0, op=ReduceOp.Average,
                         backward_passes_per_step=1, average_aggregated_gradients=False, num_groups=0, groups=None,
                         process_set=global_process_set, scale_local_gradients=True):
    """A copy of the Keras 3 ``optimizer`` whose updates first average the gradients across ranks.

    The copy is made from ``optimizer.get_config()`` and is an instance of a
    subclass of the optimizer's class, with the same name and module, so a
    saved model loads as the plain optimizer (``load_model`` re-wraps it).
    Usable in ``model.compile``/``model.fit`` (also with ``steps_per_execution``
    > 1) and in custom loops (``apply``/``apply_gradients``). Raises
    ``RoundelError`` inside an XLA-compiled step (compile with ``jit_compile=False``).

    ``backward_passes_per_step`` N > 1 accumulates gradients locally for N
    steps (with Keras's ``gradient_accumulation_steps=N``; the weights and
    ``iterations`` change every Nth step) and reduces them only then; the
    update uses their sum, or with ``average_aggregated_gradients`` their mean.
    An optimizer made with Keras's ``gradient_accumulation_steps`` is reduced
    on its update steps too (mean). Gradients are reduced in ``num_groups``
    fused allreduces (0: one), or in ``groups``: lists of the model's
    variables whose gradients go together, the others each alone (an int
    ``groups`` is ``num_groups``). Raises ValueError for bad arguments.
    ``scale_local_gradients`` divides the gradients of local variables (see
    ``PartialDistributedOptimizer``) by the set's size. ``device_*`` are
    accepted for Horovod compatibility and ignored. The options are checked
    once, as a ``roundel.common.gradient_options.GradientOptions`` (the
    wrapped optimizer's ``_roundel_options``), which every step reduces with.
    """
    if isinstance(optimizer, _DistributedOptimizerMixin):
        raise ValueError("this optimizer is already a DistributedOptimizer")
    options = GradientOptions(
        op=op, compression=_resolve_compression(compression), gradient_predivide_factor=gradient_predivide_factor,
        sparse_as_dense=sparse_as_dense, num_groups=num_groups, groups=groups,
        backward_passes_per_step=backward_passes_per_step, average_aggregated_gradients=average_aggregated_gradients,
        process_set=process_set, scale_local_gradients=scale_local_gradients, variable_key=_keras_variable_key)
    base = optimizer.__class__
    cls = type(base.__name__, (_DistributedOptimizerMixin, base),
               {"__module__": base.__module__, "__qualname__": base.__qualname__,
                "__doc__": f"{base.__name__} that averages gradients across ranks (roundel)."})
    registered = keras.saving.get_registered_name(base)
    if registered != base.__name__:  # a registered custom class: saved under its name, loaded as the base
        package, _, short_name = registered.rpartition(">")
        keras.saving.register_keras_serializable(package, short_name)(cls)
        keras.saving.get_custom_objects()[registered] = base
    config = optimizer.get_config()
    if name is not None:
        config["name"] = name
    if options.backward_passes_per_step > 1:
        if config.get("gradient_accumulation_steps"):
            raise ValueError("the optimizer already has gradient_accumulation_steps="
                             f"{config['gradient_accumulation_steps']}; do not pass backward_passes_per_step too")
        config["gradient_accumulation_steps"] = options.backward_passes_per_step
    wrapped = cls.from_config(config)
    wrapped._roundel_options = options
    wrapped._roundel_local_keys = set()
    _optimizers.append(wrapped)
    return wrapped


def load_model(filepath, custom_optimizers=None, custom_objects=None, compression=Compression.none,
               legacy_opts=False, **kwargs):
    """``keras.models.load_model`` whose compiled optimizer comes back wrapped in ``DistributedOptimizer``.

    Works on Keras's TensorFlow and PyTorch backends. The loaded optimizer's
    state (iterations, slots) is kept. ``custom_optimizers`` (a list of
    optimizer classes) are made known to the loader as custom objects. An
    optimizer saved with ``backward_passes_per_step`` N comes back with Keras's
    ``gradient_accumulation_steps=N``, which averages the N gradients.
    ``legacy_opts`` is Horovod's switch to ``tf.keras.optimizers.legacy``
    classes, which Keras 3 does not have: ``legacy_opts=True`` raises
    ValueError saying so; False (the default) is accepted.
    """
    if legacy_opts:
        raise ValueError("load_model(legacy_opts=True): Keras 3 has no keras.optimizers.legacy optimizers; "
                         "load with legacy_opts=False (Keras 3 optimizers), or use tf_keras with Horovod")
    objects = dict(custom_objects or {})
    for cls in custom_optimizers or ():
        objects.setdefault(cls.__name__, cls)
    model = keras.models.load_model(filepath, custom_objects=objects or None, **kwargs)
    loaded = getattr(model, "optimizer", None)
    if loaded is None or isinstance(loaded, _DistributedOptimizerMixin):
        return model
    wrapped = DistributedOptimizer(loaded, compression=compression)
    if getattr(loaded, "built", False):
        wrapped.build(model.trainable_variables)
        for target, source in zip(wrapped.variables, loaded.variables):
            target.assign(source)
    model.optimizer = wrapped
    model.train_function = model.test_function = model.predict_function = None
    return model


def PartialDistributedOptimizer(optimizer, name=None, device_dense="", device_sparse="",
                                compression=Compression.none, sparse_as_dense=False, gradient_predivide_factor=1.0,
                                op=ReduceOp.Average, groups=None, process_set=global_process_set, local_layers=None,
                                scale_local_gradients=True):
    """``DistributedOptimizer`` whose ``local_layers``' gradients are not reduced (Horovod's signature).

    ``local_layers`` is a Keras layer or a collection of them; their trainable
    variables keep their local gradient, divided by the set's size when
    ``scale_local_gradients``. Raises ValueError for ops other than Average
    and Sum or entries that are not Keras layers.
    """
    op = resolve_op(op)
    if op not in (ReduceOp.Average, ReduceOp.Sum):
        raise ValueError("PartialDistributedOptimizer: op currently only supports Average and Sum")
    if local_layers is None:
        local_layers = []
    elif isinstance(local_layers, keras.layers.Layer):
        local_layers = [local_layers]
    local_layers = list(local_layers)
    if not all(isinstance(layer, keras.layers.Layer) for layer in local_layers):
        raise ValueError("All local layers must be of keras.layers.Layer type.")
    wrapped = DistributedOptimizer(optimizer, name=name, device_dense=device_dense, device_sparse=device_sparse,
                                   compression=compression, sparse_as_dense=sparse_as_dense,
                                   gradient_predivide_factor=gradient_predivide_factor, op=op, groups=groups,
                                   process_set=process_set, scale_local_gradients=scale_local_gradients)
    for layer in local_layers:
        for v in layer.trainable_weights:
            wrapped.register_local_var(v)
    return wrapped
