"""Parameter broadcast for MXNet (``broadcast_parameters``), and Python objects across ranks."""

from __future__ import annotations

import mxnet as mx

from roundel.common import basics
from roundel.common.objects import allgather_object, broadcast_object
from roundel.mxnet.mpi_ops import broadcast_, start_broadcast_

__all__ = ["allgather_object", "broadcast_object", "broadcast_parameters"]


def _broadcast_after_init(param: mx.gluon.Parameter, root_rank: int, name: str) -> None:
    """Make ``param``'s deferred initialization end with a broadcast of its value from ``root_rank``."""
    initialize = param._init_impl

    def initialize_then_broadcast(*args, **kwargs):
        initialize(*args, **kwargs)
        broadcast_(param.data(), root_rank, name=name)

    param._init_impl = initialize_then_broadcast


def broadcast_parameters(params, root_rank=0, prefix=None) -> None:
    """Overwrite every rank's parameters with ``root_rank``'s, as Horovod's MXNet ``broadcast_parameters``.

    ``params``: a dict of NDArrays (``Module.get_params()``) or of Gluon
    Parameters, or a Gluon ``ParameterDict`` (``Block.collect_params()``).
    Parameters are broadcast in the order of their sorted names, each named
    ``prefix + name`` (pass different prefixes to broadcast several sets). A
    Parameter whose initialization is deferred (its shape is known only after
    the first forward pass) is broadcast right after that initialization.
    """
    try:
        from mxnet.gluon.parameter import ParameterDict
        valid = (dict, ParameterDict)
    except ImportError:  # MXNet 2 has no ParameterDict
        valid = (dict,)
    if not isinstance(params, valid):
        raise ValueError(f"broadcast_parameters expects a dict or a gluon ParameterDict, not "
                         f"{type(params).__name__}; pass net.collect_params() or a dict of NDArrays")
    if prefix is not None and not isinstance(prefix, str):
        raise ValueError(f"broadcast_parameters prefix must be a string, not {type(prefix).__name__}")
    if basics.size() == 1:
        return
    prefix = prefix or ""
    waits = []
    for name, value in sorted(params.items()):
        if isinstance(value, mx.gluon.Parameter):
            try:
                value = value.data()
            except mx.gluon.parameter.DeferredInitializationError:
                _broadcast_after_init(value, root_rank, prefix + str(name))
                continue
        waits.append(start_broadcast_(value, root_rank, name=prefix + str(name)))
    for wait in waits:
        wait()
