"""Horovod's delta-based Adasum optimizer, behind ``DistributedOptimizer(op=hvd.Adasum)``.

Per parameter, once its gradient is final for the step: remember the
parameter, let the wrapped optimizer update that parameter alone (with this
rank's gradient and this rank's optimizer state), turn the parameter into
the change the update made, and start an in-place Adasum allreduce of that
change. ``step()`` waits for each and sets the parameter to where it started
plus the Adasum-combined change. Adasum thus combines what each rank's
optimizer would do, not the raw gradients, as in Horovod's
``_DistributedAdasumOptimizer``.
"""

from __future__ import annotations

import torch

from roundel.errors import RoundelError
from roundel.ops import ReduceOp
from roundel.torch.mpi_ops import allreduce_async_, synchronize


class AdasumSyncError(RoundelError, AssertionError):
    """The training loop called the Adasum optimizer in an order it cannot serve."""


class _DistributedAdasumOptimizer(torch.optim.Optimizer):
    """Mixed into the wrapped optimizer's class by ``DistributedOptimizer(op=Adasum)``."""

    def __init__(self, params, parameter_names: dict, compression, backward_passes_per_step, process_set):
        super(self.__class__, self).__init__(params)
        if backward_passes_per_step < 1:
            raise ValueError(f"backward_passes_per_step={backward_passes_per_step} must be >= 1")
        self._parameter_names = parameter_names
        self._compression = compression
        self.backward_passes_per_step = backward_passes_per_step
        self._process_set = process_set
        self._trainable = [p for group in self.param_groups for p in group["params"] if p.requires_grad]
        self._starts = {p: torch.zeros_like(p, requires_grad=False) for p in self._trainable}
        self._passes_left = dict.fromkeys(self._trainable, backward_passes_per_step)
        self._pending: dict = {}  # parameter -> (handle, compression context)
        for p in self._trainable:
            p.grad = torch.zeros_like(p)  # as Horovod: every parameter has a gradient from the start
        self._hooks = [p.register_post_accumulate_grad_hook(self._on_grad_ready) for p in self._trainable]

    def _on_grad_ready(self, p) -> None:
        left = self._passes_left[p]
        if left <= 0:
            raise AdasumSyncError(
                f"the gradient of '{self._parameter_names[p]}' was computed more than backward_passes_per_step="
                f"{self.backward_passes_per_step} times before optimizer.step(); raise backward_passes_per_step "
                "to accumulate more passes locally")
        self._passes_left[p] = left - 1
        if left == 1:
            self._start(p)

    def _update_alone(self, p) -> None:
        """Run the wrapped optimizer's update on ``p`` only (its group's hyper-parameters, its state)."""
        stashed = [group["params"] for group in self.param_groups]
        try:
            for group in self.param_groups:
                group["params"] = [p] if any(p is q for q in group["params"]) else []
            super(self.__class__, self).step()
        finally:
            for group, params in zip(self.param_groups, stashed):
                group["params"] = params

    def _start(self, p) -> None:
        start = self._starts[p]
        with torch.no_grad():
            start.copy_(p)
            self._update_alone(p)
            p.sub_(start)  # p now holds this rank's change
        compressed, ctx = self._compression.compress(p.data)
        handle = allreduce_async_(compressed, name=f"adasum.{self._parameter_names[p]}", op=ReduceOp.Adasum,
                                  process_set=self._process_set)
        self._pending[p] = (handle, ctx)

    def step(self, closure=None):
        """Apply the Adasum combination of every rank's change to each parameter; returns the closure's loss."""
        loss = closure() if closure is not None else None
        for p in self._trainable:
            if p not in self._pending:  # unused in this step: every rank must still take part
                self._start(p)
        try:
            for p, (handle, ctx) in self._pending.items():
                delta = self._compression.decompress(synchronize(handle), ctx)
                with torch.no_grad():
                    self._starts[p].add_(delta.to(p.dtype))
                    p.copy_(self._starts[p])
        finally:
            self._pending.clear()
            self._passes_left = dict.fromkeys(self._trainable, self.backward_passes_per_step)
        return loss

    def synchronize(self) -> None:
        """Nothing to do: ``step()`` applies the combined changes (as in Horovod)."""

    def skip_synchronize(self):
        """Not supported with Adasum, as in Horovod: the update happens before the reduction."""
        raise AdasumSyncError("skip_synchronize() is not supported with op=Adasum: each parameter is updated "
                              "locally before the reduction, so gradients cannot be edited in between")

    def _local_step(self, closure=None):
        """The wrapped optimizer's update alone, without reducing."""
        return super(self.__class__, self).step(closure)

    def zero_grad(self, set_to_none: bool = True):
        """Clear gradients; an error while this step's reductions are still in flight."""
        if self._pending or any(left != self.backward_passes_per_step for left in self._passes_left.values()):
            raise AdasumSyncError(
                "optimizer.zero_grad() was called after loss.backward() but before optimizer.step(); the "
                "Adasum reductions in flight would race with it")
        return super(self.__class__, self).zero_grad(set_to_none=set_to_none)

    def load_state_dict(self, state_dict):
        self._pending.clear()
        self._passes_left = dict.fromkeys(self._trainable, self.backward_passes_per_step)
        return super(self.__class__, self).load_state_dict(state_dict)

    def set_backward_passes_per_step(self, passes: int) -> None:
        """Change how many backward passes are accumulated locally before the update."""
        if passes < 1:
            raise ValueError(f"backward_passes_per_step={passes} must be >= 1")
        self.backward_passes_per_step = passes
        self._passes_left = dict.fromkeys(self._trainable, passes)
