"""Elastic training for JAX: ``hvd.elastic.run`` and ``JaxState``.

A collective that fails inside compiled code reaches Python as a
``jax.errors.JaxRuntimeError`` whose message carries roundel's error; ``run``
treats it as HorovodInternalError. A jitted function whose shapes depend on
the number of ranks (allgather, reducescatter) keeps the size it was traced
with: create it again after a reset (in the training function or a reset
callback). Allreduce-only steps, such as those of ``DistributedOptimizer``,
need not be traced again.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from roundel.common import elastic as common
from roundel.common.elastic import ObjectState, State
from roundel.errors import HorovodInternalError, HostsUpdatedInterrupt
from roundel.jax.functions import broadcast_optimizer_state, broadcast_parameters

__all__ = ["HorovodInternalError", "HostsUpdatedInterrupt", "JaxState", "ObjectState", "State", "run"]


def run(func):
    """Decorate a training function ``func(state, ...)`` to survive failures and membership changes.

    On HorovodInternalError (also when raised by a collective inside compiled
    code) the state is restored to its last commit; on HostsUpdatedInterrupt
    it is kept. Either way the job is re-formed, the reset callbacks run,
    every rank takes rank 0's state, and ``func`` is called again with it.
    """
    return common.run_fn(common.raising_internal_errors(func, jax.errors.JaxRuntimeError))


def _copy(tree):
    # a copy, not the arrays themselves: a jitted step may donate (and so delete) the buffers it was given
    return jax.tree_util.tree_map(lambda x: jnp.array(x, copy=True) if isinstance(x, jax.Array) else x, tree)


class JaxState(ObjectState):
    """Elastic state of JAX pytrees: ``JaxState(params=..., opt_state=..., epoch=0, ...)``.

    Assign the new pytrees to ``state.params`` and ``state.opt_state`` after
    each step. ``commit()`` keeps copies of them, ``restore()`` puts the
    copies back and ``sync()`` broadcasts rank 0's (with
    ``broadcast_parameters`` / ``broadcast_optimizer_state``); the other
    keywords are picklable values handled as by ``ObjectState``.
    """

    def __init__(self, params=None, opt_state=None, **kwargs):
        self.params, self.opt_state = params, opt_state
        self._saved_trees = _copy((params, opt_state))
        super().__init__(**kwargs)

    def save(self) -> None:
        self._saved_trees = _copy((self.params, self.opt_state))
        super().save()

    def restore(self) -> None:
        self.params, self.opt_state = _copy(self._saved_trees)
        super().restore()

    def sync(self) -> None:
        if self.params is not None:
            self.params = broadcast_parameters(self.params, root_rank=0)
        if self.opt_state is not None:
            self.opt_state = broadcast_optimizer_state(self.opt_state, root_rank=0)
        self._saved_trees = _copy((self.params, self.opt_state))
        super().sync()
