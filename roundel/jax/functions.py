"""Parameters, optimizer state and Python objects across ranks, for JAX pytrees."""

from __future__ import annotations

import jax
import numpy as np

from roundel.common import objects
from roundel.common.process_sets import global_process_set
from roundel.jax import mpi_ops

__all__ = ["allgather_object", "broadcast_object", "broadcast_optimizer_state", "broadcast_parameters"]


def _is_array(leaf) -> bool:
    return isinstance(leaf, (jax.Array, np.ndarray, np.generic))


def _broadcast_tree(tree, root_rank: int, name: str, process_set):
    """``tree`` with rank ``root_rank``'s values: arrays in one fused broadcast, other leaves as one object."""
    leaves, treedef = jax.tree_util.tree_flatten(tree)
    arrays = [i for i, leaf in enumerate(leaves) if _is_array(leaf)]
    others = [i for i, leaf in enumerate(leaves) if not _is_array(leaf)]
    result = list(leaves)
    if arrays:
        received = mpi_ops.broadcast([leaves[i] for i in arrays], root_rank, name=name, process_set=process_set)
        for i, value in zip(arrays, received):
            result[i] = value
    if others:
        values = objects.broadcast_object([leaves[i] for i in others], root_rank, name=f"{name}.objects",
                                          process_set=process_set)
        for i, value in zip(others, values):
            result[i] = value
    return treedef.unflatten(result)


def broadcast_parameters(params, root_rank=0, process_set=global_process_set):
    """Return the pytree ``params`` with the root rank's values (same structure on every rank). Eager only."""
    return _broadcast_tree(params, root_rank, "broadcast_parameters", process_set)


def broadcast_optimizer_state(opt_state, root_rank=0, process_set=global_process_set):
    """Return an optax state (any pytree) with the root rank's values; non-array leaves travel pickled."""
    return _broadcast_tree(opt_state, root_rank, "broadcast_optimizer_state", process_set)


def broadcast_object(obj, root_rank=0, name=None, process_set=global_process_set):
    """Return the root rank's ``obj`` on every rank (anything cloudpickle can serialize). Eager only."""
    return objects.broadcast_object(obj, root_rank, name=name, process_set=process_set)


def allgather_object(obj, name=None, process_set=global_process_set) -> list:
    """Return the list of every rank's ``obj``, in rank order. Eager only."""
    return objects.allgather_object(obj, name=name, process_set=process_set)
