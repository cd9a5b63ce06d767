"""``DistributedOptimizer``: reduce gradients across ranks while ``backward()`` runs.

Each trainable parameter gets a post-accumulate-grad hook. When its gradient
is final for the step (after ``backward_passes_per_step`` passes), the hook
starts an asynchronous allreduce at once, so communication overlaps the rest
of the backward pass; ``step()`` waits for all of them and then applies the
wrapped optimizer's update.
"""

from __future__ import annotations

import contextlib
import warnings

import torch

from roundel.common.errors import RoundelError
from roundel.common.ops import ReduceOp, resolve_op
from roundel.common.process_sets import global_process_set
from roundel.torch.compression import Compression
from roundel.torch.mpi_ops import allgather_async, allreduce_async_, grouped_allreduce_async_, synchronize


class GradientSyncError(RoundelError, AssertionError):
    """The training loop called the optimizer in an order that would race with gradient reduction."""


def _named_parameters(optimizer_groups, named_parameters) -> dict:
    """Map each parameter to its name; raise ValueError for bad, duplicate or missing names."""
    if named_parameters is None:
        return {p: f"allreduce.noname.{g}.{i}" for g, group in enumerate(optimizer_groups)
                for i, p in enumerate(group["params"])}
    pairs = list(named_parameters)
    if any(not (isinstance(pair, tuple) and len(pair) == 2) for pair in pairs):
        raise ValueError("named_parameters must be a sequence of (name, parameter) tuples, as "
                         "model.named_parameters() gives")
    seen, duplicates = set(), set()
    for name, _ in pairs:
        (duplicates if name in seen else seen).add(name)
    if duplicates:
        raise ValueError(f"named_parameters has duplicate names: {', '.join(sorted(duplicates))}; "
                         "each parameter needs a unique name")
    names = {p: name for name, p in pairs}
    unnamed = [p for group in optimizer_groups for p in group["params"] if p not in names]
    if unnamed:
        shapes = ", ".join(str(tuple(p.shape)) for p in unnamed[:5])
        raise ValueError(f"{len(unnamed)} parameter(s) of the optimizer are missing from named_parameters "
                         f"(shapes {shapes}); pass model.named_parameters() of the model being optimized")
    return names


def _split_groups(params: list, groups) -> list[tuple]:
    """Parameters partitioned into groups reduced together (``groups``: a count or lists of parameters)."""
    if groups is None or groups == 0:
        return []
    if isinstance(groups, int):
        if groups < 0:
            raise ValueError(f"num_groups={groups} must be >= 0")
        count = min(groups, len(params)) or 1
        size, extra = divmod(len(params), count)
        result, start = [], 0
        for i in range(count):
            end = start + size + (1 if i < extra else 0)
            result.append(tuple(params[start:end]))
            start = end
        return [g for g in result if g]
    result = [tuple(g) for g in groups]
    known = set(params)
    for group in result:
        for p in group:
            if p not in known:
                raise ValueError("groups= lists a tensor that is not a trainable parameter of this optimizer")
    return result


class _DistributedOptimizer(torch.optim.Optimizer):
    """Mixed into the wrapped optimizer's class by ``DistributedOptimizer``."""

    def __init__(self, params, named_parameters, compression, backward_passes_per_step, op,
                 gradient_predivide_factor, groups, sparse_as_dense, process_set):
        super(self.__class__, self).__init__(params)
        if backward_passes_per_step < 1:
            raise ValueError(f"backward_passes_per_step={backward_passes_per_step} must be >= 1")
        if gradient_predivide_factor != 1.0 and op != ReduceOp.Average:
            raise ValueError("gradient_predivide_factor only applies to op=Average")
        self._names = _named_parameters(self.param_groups, named_parameters)
        self._compression = compression
        self.backward_passes_per_step = backward_passes_per_step
        self.op = op
        self.gradient_predivide_factor = gradient_predivide_factor
        self._sparse_as_dense = sparse_as_dense
        self._process_set = process_set
        trainable = [p for group in self.param_groups for p in group["params"] if p.requires_grad]
        trainable.sort(key=lambda p: self._names[p])  # the same order on every rank
        self._trainable = trainable
        self._groups = _split_groups(trainable, groups)
        self._group_of = {p: g for g in self._groups for p in g}
        self._group_ready: dict[tuple, int] = {g: 0 for g in self._groups}
        self._passes_left = {p: backward_passes_per_step for p in trainable}
        self._pending: dict = {}  # parameter or group -> (handle, contexts)
        self._synchronized = False
        self._should_synchronize = True
        self._hooks = [p.register_post_accumulate_grad_hook(self._on_grad_ready) for p in trainable]

    # ---------------------------------------------------------------- hooks
    def _scale_factors(self) -> tuple[float, float]:
        if self.op == ReduceOp.Average:
            return 1.0 / self.gradient_predivide_factor, self.gradient_predivide_factor
        return 1.0, 1.0

    def _on_grad_ready(self, p) -> None:
        if self._passes_left[p] <= 0:
            raise GradientSyncError(
                f"the gradient of '{self._names[p]}' was computed more than backward_passes_per_step="
                f"{self.backward_passes_per_step} times before optimizer.step(); raise "
                "backward_passes_per_step to accumulate more passes locally")
        self._passes_left[p] -= 1
        if self._passes_left[p] > 0:
            return
        group = self._group_of.get(p)
        if group is None:
            self._pending[p] = self._start(p)
            return
        self._group_ready[group] += 1
        if self._group_ready[group] == len(group):
            self._group_ready[group] = 0
            self._pending[group] = self._start_group(group)

    def _prepare_grad(self, p) -> None:
        if p.grad is None:
            p.grad = torch.zeros_like(p)
        elif p.grad.is_sparse and self._sparse_as_dense:
            p.grad = p.grad.to_dense()

    def _start(self, p):
        self._prepare_grad(p)
        if p.grad.is_sparse:
            return self._start_sparse(p)
        compressed, ctx = self._compression.compress(p.grad)
        prescale, postscale = self._scale_factors()
        handle = allreduce_async_(compressed, name=f"allreduce.{self._names[p]}", op=self.op,
                                  prescale_factor=prescale, postscale_factor=postscale,
                                  process_set=self._process_set)
        return handle, ctx, compressed

    def _start_group(self, group):
        for p in group:
            self._prepare_grad(p)
        compressed = [self._compression.compress(p.grad) for p in group]
        prescale, postscale = self._scale_factors()
        handle = grouped_allreduce_async_([c[0] for c in compressed],
                                          name=f"grouped_allreduce.{self._names[group[0]]}", op=self.op,
                                          prescale_factor=prescale, postscale_factor=postscale,
                                          process_set=self._process_set)
        return handle, [c[1] for c in compressed], [c[0] for c in compressed]

    def _start_sparse(self, p):
        grad = p.grad.coalesce()
        name = self._names[p]
        indices = allgather_async(grad.indices().t().contiguous(), name=f"sparse.indices.{name}",
                                  process_set=self._process_set)
        values = allgather_async(grad.values(), name=f"sparse.values.{name}", process_set=self._process_set)
        return (indices, values), None, grad

    # ----------------------------------------------------------- public API
    def synchronize(self) -> None:
        """Wait for every gradient reduction of this step (starting those whose hooks did not fire)."""
        started = set()
        for key in self._pending:
            started.update(key if isinstance(key, tuple) else (key,))
        for p in self._trainable:  # unused parameters: every rank must still take part
            if p not in started:
                group = self._group_of.get(p)
                if group is None:
                    self._pending[p] = self._start(p)
                elif group not in self._pending:
                    self._group_ready[group] = 0
                    self._pending[group] = self._start_group(group)
                started.update(group or (p,))
        for key, (handle, ctx, sent) in self._pending.items():
            if isinstance(key, tuple):
                outputs = synchronize(handle)
                for p, output, c in zip(key, outputs, ctx):
                    self._finish_dense(p, output, c)
            elif isinstance(handle, tuple):
                self._finish_sparse(key, handle, sent)
            else:
                self._finish_dense(key, synchronize(handle), ctx)
        self._pending.clear()
        for p in self._trainable:
            self._passes_left[p] = self.backward_passes_per_step
        self._synchronized = True

    def _finish_dense(self, p, output, ctx) -> None:
        result = self._compression.decompress(output, ctx)
        if result.data_ptr() != p.grad.data_ptr():
            p.grad.copy_(result)

    def _finish_sparse(self, p, handles, grad) -> None:
        indices = synchronize(handles[0]).t()
        values = synchronize(handles[1])
        if self.op == ReduceOp.Average:
            values = values / self._process_set.size()
        p.grad = torch.sparse_coo_tensor(indices, values, grad.shape, check_invariants=True).coalesce()

    @contextlib.contextmanager
    def skip_synchronize(self):
        """Make ``step()`` skip its own synchronize (after calling ``synchronize()`` yourself, e.g. to clip)."""
        self._should_synchronize = False
        try:
            yield
        finally:
            self._should_synchronize = True

    def step(self, closure=None):
        """Wait for the gradient reductions, then apply the wrapped optimizer's update."""
        if self._should_synchronize:
            if self._synchronized:
                warnings.warn("optimizer.step() was called after optimizer.synchronize() without the "
                              "optimizer.skip_synchronize() context; the gradients are not reduced twice, "
                              "but wrap step() in skip_synchronize() to make the intent explicit")
            else:
                self.synchronize()
        self._synchronized = False
        return super(self.__class__, self).step(closure)

    def zero_grad(self, set_to_none: bool = True):
        """Clear gradients; an error while reductions of this step are still in flight."""
        if self._pending:
            raise GradientSyncError(
                "optimizer.zero_grad() was called after loss.backward() but before optimizer.step() or "
                "optimizer.synchronize(); the gradient reductions still in flight would race with it")
        return super(self.__class__, self).zero_grad(set_to_none=set_to_none)

    def load_state_dict(self, state_dict):
        self._pending.clear()
        self._synchronized = False
        for p in self._trainable:
            self._passes_left[p] = self.backward_passes_per_step
        return super(self.__class__, self).load_state_dict(state_dict)

    def set_backward_passes_per_step(self, passes: int) -> None:
        """Change how many backward passes are accumulated locally before reducing."""
        if passes < 1:
            raise ValueError(f"backward_passes_per_step={passes} must be >= 1")
        self.backward_passes_per_step = passes
        for p in self._trainable:
            self._passes_left[p] = passes


def DistributedOptimizer(optimizer, named_parameters=None, compression=Compression.none,
                         backward_passes_per_step=1, op=ReduceOp.Average, gradient_predivide_factor=1.0,
                         num_groups=0, groups=None, sparse_as_dense=False, process_set=global_process_set):
    """Wrap ``optimizer`` so that gradients are averaged (or summed, or Adasum-combined) across ranks.

    Returns an instance of a subclass of the optimizer's own class, built on
    its parameter groups (so learning-rate schedulers and ``state_dict`` work
    as before). ``groups`` is a count or a list of parameter lists whose
    gradients are reduced together; ``num_groups`` is the older count form.
    Raises ValueError for missing or duplicate ``named_parameters``.
    """
    op = resolve_op(op)
    if groups is not None and num_groups:
        raise ValueError("pass groups= or num_groups=, not both")
    cls = type(optimizer.__class__.__name__, (optimizer.__class__,), dict(_DistributedOptimizer.__dict__))
    return cls(optimizer.param_groups, named_parameters, compression, backward_passes_per_step, op,
               gradient_predivide_factor, groups if groups is not None else num_groups, sparse_as_dense,
               process_set)
