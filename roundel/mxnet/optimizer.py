"""Data-parallel training for MXNet: ``DistributedOptimizer`` and the Gluon ``DistributedTrainer``.

Both average every gradient over the process set before the optimizer uses
it, as Horovod 0.28.1's do: each gradient is scaled by
``1 / gradient_predivide_factor`` before the sum and by
``gradient_predivide_factor / size`` after it. All of a step's allreduces are
submitted before any is waited on, so the engine can fuse them.
"""

from __future__ import annotations

import warnings
from collections import OrderedDict, defaultdict

import mxnet as mx

from roundel.common.gradient_groups import split
from roundel.common.gradient_options import GradientOptions
from roundel.common.process_sets import global_process_set
from roundel.mxnet.compression import Compression
from roundel.mxnet.mpi_ops import start_allreduce_, start_grouped_allreduce_

__all__ = ["DistributedOptimizer", "DistributedTrainer"]


def _start_averages(grads: list, names: list, options: GradientOptions, grouped: bool = True) -> list:
    """Submit in-place averaging allreduces of ``grads`` as ``options`` say; returns the functions that wait
    for them.

    With ``options.num_groups`` > 0 (and ``grouped``) the gradients are cut
    into that many consecutive groups, each reduced by one grouped allreduce
    per dtype named ``"first:last"``; otherwise each gradient alone under its name.
    """
    factor = options.gradient_predivide_factor
    scale = {"average": True, "prescale_factor": 1.0 / factor, "postscale_factor": factor,
             "process_set": options.process_set}
    num_groups = options.num_groups if grouped else 0
    if num_groups == 0:
        return [start_allreduce_(g, name=n, priority=-i, **scale) for i, (g, n) in enumerate(zip(grads, names))]
    waits = []
    for i, group in enumerate(split(list(range(len(grads))), num_groups)):
        by_dtype = defaultdict(list)
        for k in group:
            by_dtype[grads[k].dtype].append(k)
        for members in by_dtype.values():
            waits.append(start_grouped_allreduce_([grads[k] for k in members],
                                                  name=f"{names[members[0]]}:{names[members[-1]]}", priority=-i,
                                                  **scale))
    return waits


class DistributedOptimizer(mx.optimizer.Optimizer):
    """Wraps an ``mx.optimizer.Optimizer``: ``update``/``update_multi_precision`` first average the gradient.

    Gradients named by their index (``str(index)``); with ``num_groups`` > 0 a
    list of indices is reduced in that many grouped allreduces. Everything
    else (learning rate, states, ...) is the wrapped optimizer's; setting a
    public attribute sets it there too (so ``gluon.Trainer.step`` setting
    ``rescale_grad`` reaches the optimizer that uses it, which Horovod's
    wrapper does not do).
    """

    def __init__(self, optimizer, gradient_predivide_factor=1.0, num_groups=0, process_set=global_process_set):
        # the base class's __init__ is not called: attributes come from the wrapped optimizer
        self._optimizer = optimizer
        self._roundel_options = GradientOptions(gradient_predivide_factor=gradient_predivide_factor,
                                                num_groups=num_groups, process_set=process_set)

    def __getattr__(self, item):
        if item == "_optimizer":  # not set yet (copy, pickle): no recursion
            raise AttributeError(item)
        return getattr(self._optimizer, item)

    def __setattr__(self, item, value):
        if item.startswith("_"):
            object.__setattr__(self, item, value)
        else:
            setattr(self._optimizer, item, value)

    def create_state(self, index, weight):
        return self._optimizer.create_state(index, weight)

    def create_state_multi_precision(self, index, weight):
        return self._optimizer.create_state_multi_precision(index, weight)

    def _do_allreduce(self, index, grad) -> None:
        if self._roundel_options.process_set.size() == 1:
            return
        grouped = isinstance(index, (tuple, list))
        if grouped:
            grads, names = list(grad), [str(i) for i in index]
        else:
            grads, names = [grad], [str(index)]
        for wait in _start_averages(grads, names, self._roundel_options, grouped):
            wait()

    def update(self, index, weight, grad, state):
        if self._roundel_options.process_set.included():
            self._do_allreduce(index, grad)
        self._optimizer.update(index, weight, grad, state)

    def update_multi_precision(self, index, weight, grad, state):
        if self._roundel_options.process_set.included():
            self._do_allreduce(index, grad)
        self._optimizer.update_multi_precision(index, weight, grad, state)

    def set_learning_rate(self, lr):
        self._optimizer.set_learning_rate(lr)

    def set_lr_mult(self, args_lr_mult):
        self._optimizer.set_lr_mult(args_lr_mult)

    def set_wd_mult(self, args_wd_mult):
        self._optimizer.set_wd_mult(args_wd_mult)


class DistributedTrainer(mx.gluon.Trainer):
    """A Gluon ``Trainer`` that averages gradients with roundel's allreduce instead of a kvstore.

    ``params``, ``optimizer`` and ``optimizer_params`` as for ``gluon.Trainer``
    (a ``DistributedOptimizer`` is unwrapped, with a warning). ``compression``:
    ``Compression.none`` or ``Compression.fp16``. ``gradient_predivide_factor``:
    see the module notes. ``prefix`` names this trainer's allreduces
    (``prefix + str(i)`` for the i-th parameter); give each trainer of a
    program its own. ``num_groups`` > 0 reduces the gradients in that many
    grouped allreduces.
    """

    def __init__(self, params, optimizer, optimizer_params=None, compression=Compression.none,
                 gradient_predivide_factor=1.0, prefix=None, num_groups=0, process_set=global_process_set):
        if prefix is not None and not isinstance(prefix, str):
            raise ValueError(f"DistributedTrainer prefix must be a string, not {type(prefix).__name__}")
        self._roundel_options = GradientOptions(compression=compression,
                                                gradient_predivide_factor=gradient_predivide_factor,
                                                num_groups=num_groups, process_set=process_set)
        self._prefix = prefix or ""
        if isinstance(optimizer, DistributedOptimizer):
            optimizer = optimizer._optimizer
            warnings.warn("DistributedTrainer does not take a DistributedOptimizer as its optimizer; "
                          "it was unwrapped", stacklevel=2)
        # the same parameter order on every rank
        if isinstance(params, dict):
            params = OrderedDict(params)
        elif isinstance(params, (list, tuple)):
            params = sorted(params, key=lambda p: p.name)
        super().__init__(params, optimizer, optimizer_params=optimizer_params, kvstore=None)

    def _allreduce_grads(self):
        options = self._roundel_options
        if options.process_set.size() == 1 or not options.process_set.included():
            return
        compression = options.compression
        entries = []  # (parameter, NDArray sent, compression context)
        for param in self._params:
            if param.grad_req != "null":
                sent, ctx = compression.compress(param.list_grad()[0])
                entries.append((param, sent, ctx))
        names = [self._prefix + str(i) for i, param in enumerate(self._params) if param.grad_req != "null"]
        for wait in _start_averages([sent for _, sent, _ in entries], names, options):
            wait()
        if compression is not Compression.none:
            for param, sent, ctx in entries:
                param.list_grad()[0][:] = compression.decompress(sent, ctx)
