"""``DistributedOptimizer``: an optax transformation that averages gradients across ranks, then applies yours."""

from __future__ import annotations

from typing import NamedTuple

import jax
import jax.numpy as jnp
import optax

from roundel.common import gradient_groups
from roundel.common.gradient_options import GradientOptions
from roundel.common.process_sets import global_process_set
from roundel.jax import host_calls, mpi_ops
from roundel.jax.compression import Compression
from roundel.ops import ReduceOp

__all__ = ["DistributedOptimizer", "DistributedState"]


class DistributedState(NamedTuple):
    """The wrapped transformation's state, and the gradients summed locally since the last reduction."""

    inner: optax.OptState
    accumulated: optax.Updates
    passes: jax.Array


def DistributedOptimizer(optimizer: optax.GradientTransformation, compression=Compression.none,
                         backward_passes_per_step: int = 1, op=ReduceOp.Average, gradient_predivide_factor=1.0,
                         num_groups: int = 0, process_set=global_process_set) -> optax.GradientTransformation:
    """Wrap an optax transformation so that ``update`` first reduces the gradients across ranks.

    Every step reduces the gradient pytree in one grouped allreduce
    (``num_groups`` > 0: that many, over consecutive leaves), compressed with
    ``compression``; with Average (the default) ``gradient_predivide_factor``
    divides before the sum and the rest after it, as in Horovod. With
    ``backward_passes_per_step`` k > 1 the gradients of k calls are averaged
    locally and reduced on every k-th call, which alone applies ``optimizer``;
    the others return zero updates. ``op=Adasum`` combines the gradients
    with Adasum (not roundel.torch's delta-based Adasum optimizer). Works
    eagerly and inside ``jax.jit``. The options are checked once, as a
    ``roundel.common.gradient_options.GradientOptions`` (its ValueError or
    TypeError for a bad argument), which every reduction uses.
    """
    options = GradientOptions(op=op, compression=compression, gradient_predivide_factor=gradient_predivide_factor,
                              num_groups=num_groups, backward_passes_per_step=backward_passes_per_step,
                              process_set=process_set)
    pre, post = 1.0 / options.gradient_predivide_factor, options.gradient_predivide_factor

    def reduce(grads):
        leaves, treedef = jax.tree_util.tree_flatten(grads)
        reduced = list(leaves)
        for number, group in enumerate(gradient_groups.split(list(range(len(leaves))), options.num_groups)):
            values = mpi_ops.grouped_allreduce([leaves[i] for i in group], name=None,
                                               compression=options.compression, op=options.op, prescale_factor=pre,
                                               postscale_factor=post, process_set=options.process_set)
            for i, value in zip(group, values):
                reduced[i] = value
        return treedef.unflatten(reduced)

    if options.backward_passes_per_step == 1:
        def update_now(grads, state, params=None):
            return optimizer.update(reduce(grads), state, params)

        return optax.GradientTransformation(optimizer.init, update_now)

    k = options.backward_passes_per_step

    def init(params):
        return DistributedState(optimizer.init(params), jax.tree_util.tree_map(jnp.zeros_like, params),
                                jnp.zeros([], jnp.int32))

    def update(grads, state, params=None):
        accumulated = jax.tree_util.tree_map(jnp.add, state.accumulated, grads)
        passes = state.passes + 1

        def apply(_):
            updates, inner = optimizer.update(reduce(jax.tree_util.tree_map(lambda g: g / k, accumulated)),
                                              state.inner, params)
            return updates, DistributedState(inner, jax.tree_util.tree_map(jnp.zeros_like, accumulated),
                                             jnp.zeros([], jnp.int32))

        def wait(_):
            return jax.tree_util.tree_map(jnp.zeros_like, grads), DistributedState(state.inner, accumulated, passes)

        if host_calls.is_traced(jax.tree_util.tree_leaves((grads, state))):
            return jax.lax.cond(passes >= k, apply, wait, None)
        return apply(None) if int(passes) >= k else wait(None)

    return optax.GradientTransformation(init, update)
