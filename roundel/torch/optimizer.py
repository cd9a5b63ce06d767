"""``DistributedOptimizer``: reduce gradients across ranks while ``backward()`` runs.

Each trainable parameter gets a post-accumulate-grad hook. The parameters are
packed into buckets as PyTorch DDP packs them: in reverse registration order
(about the order in which backward produces their gradients), about
``bucket_cap_mb`` each, the first one small. When every gradient of a bucket
is final for the step (after ``backward_passes_per_step`` passes), the hook
copies them into the bucket's flat buffer and starts one asynchronous
allreduce of it, so communication overlaps the rest of the backward pass and
the engine matches a few names per step instead of one per parameter.
``step()`` waits for them and applies the wrapped optimizer's update.

As in DDP, the first step records the order in which gradients became ready
and rebuilds the buckets in that order (rank 0's order, broadcast, so that
every rank has the same buckets). From then on, without compression, each
``.grad`` in a bucket of several parameters is a view into the bucket's flat
buffer (DDP's ``gradient_as_bucket_view=True``): backward accumulates straight
into the bucket, which is reduced in place, with no copy in or out. A gradient
that is not the view when its bucket starts (``zero_grad(set_to_none=True)``
left None, or user code replaced it) is copied into the view once and ``.grad``
pointed at the view again, as DDP does; sparse gradients are reduced apart.
"""

from __future__ import annotations

import contextlib
import copy
import functools
import warnings
import weakref

import torch

from roundel.common import basics, collectives
from roundel.common.compression import as_compressor
from roundel.ops import ReduceOp, resolve_op
from roundel.common.process_sets import global_process_set
from roundel.common.settings import Settings
from roundel.torch.compression import Compression
from roundel.torch.adasum_optimizer import _DistributedAdasumOptimizer
from roundel.torch.gradient_layout import MIB, GradientSyncError, check_bucket_cap, parameter_names, split_by_size
from roundel.torch.mpi_ops import (allreduce_async_, broadcast_, grouped_allreduce_async_, sparse_allreduce_async,
                                   synchronize)
from roundel.torch.sharded_optimizer import sharded_optimizer

__all__ = ["DistributedOptimizer", "GradientSyncError"]


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
    known, seen = set(params), set()
    for group in result:
        for p in group:
            if p not in known:
                raise ValueError("groups= lists a tensor that is not a trainable parameter of this optimizer")
            if p in seen:
                raise ValueError("groups= lists a parameter more than once; each may be in one group only")
            seen.add(p)
    return [g for g in result if g]


class _Bucket:
    """Parameters whose gradients are reduced together, once per step."""

    __slots__ = ("params", "names", "name", "sizes", "flat", "views", "ready", "started")

    def __init__(self, params: tuple, names: dict, flat: bool, kind: str = "bucket"):
        self.params = params
        self.names = [names[p] for p in params]
        flat = flat and len({(p.dtype, p.device) for p in params}) == 1  # else one request per gradient
        first = names[params[0]]
        if len(params) == 1:
            self.name = f"allreduce.{first}"
        elif flat:
            self.name = f"allreduce.{kind}.{first}.{len(params)}"
        else:
            self.name = f"grouped_allreduce.{first}"
        self.sizes = [p.numel() for p in params] if flat else None
        self.flat = None  # the flat gradient buffer, allocated on first use
        self.views = None  # per parameter, its gradient's place in ``flat`` (gradients as bucket views)
        self.ready = 0  # gradients final for this step
        self.started = False

    def attach_views(self) -> None:
        """Make each dense gradient a view into a new flat buffer holding its current value."""
        first = self.params[0]
        self.flat = torch.zeros(sum(self.sizes), dtype=first.dtype, device=first.device)
        self.views = [chunk.view(p.shape) for p, chunk in zip(self.params, self.flat.split(self.sizes))]
        with torch.no_grad():
            for p, view in zip(self.params, self.views):
                if p.grad is None or not p.grad.is_sparse:
                    if p.grad is not None:
                        view.copy_(p.grad)
                    p.grad = view


def _with_context(exc: Exception, context: str) -> Exception:
    """A copy of ``exc``, of the same type (what users catch), its message followed by ``context``."""
    named = copy.copy(exc)  # not ``exc`` itself: the engine may raise the same object again
    named.args = (f"{exc.args[0] if exc.args else exc} ({context})",) + tuple(exc.args[1:])
    return named


def _is_view(grad: torch.Tensor, view: torch.Tensor) -> bool:
    return grad.data_ptr() == view.data_ptr() and grad.shape == view.shape and grad.stride() == view.stride()


def _write_back(targets: list, results) -> None:
    """Copy each result into its gradient (None: a sparse gradient, finished apart)."""
    for target, result in zip(targets, results):
        if target is not None and result.data_ptr() != target.data_ptr():
            target.copy_(result.view(target.shape))


def _land(flat: torch.Tensor, result: torch.Tensor) -> None:
    """A bucket's reduced flat buffer into ``flat``: nothing to do when it was reduced in place (as it is)."""
    if result is not flat:
        flat.copy_(result)


class _Slot:
    """A parameter as its gradient hook sees it: its name, its bucket and its passes left in this round."""

    __slots__ = ("param", "name", "bucket", "round", "left")

    def __init__(self, param, name: str):
        self.param = param
        self.name = name
        self.bucket = None  # set by every layout of the buckets
        self.round = -1  # the optimizer's round that ``left`` counts in (an older one: no pass counted yet)
        self.left = 0


class _DistributedOptimizer(torch.optim.Optimizer):
    """Mixed into the wrapped optimizer's class by ``DistributedOptimizer``."""

    def __init__(self, params, named, compression, backward_passes_per_step, op,
                 gradient_predivide_factor, groups, sparse_as_dense, process_set, bucket_cap_mb):
        super(self.__class__, self).__init__(params)
        if bucket_cap_mb is None:
            bucket_cap_mb = Settings.from_env().bucket_cap_mb
        if backward_passes_per_step < 1:
            raise ValueError(f"backward_passes_per_step={backward_passes_per_step} must be >= 1")
        if gradient_predivide_factor != 1.0 and op != ReduceOp.Average:
            raise ValueError("gradient_predivide_factor only applies to op=Average")
        check_bucket_cap(bucket_cap_mb)
        self._parameter_names = parameter_names(self.param_groups, named)
        self._compression = compression
        self.backward_passes_per_step = backward_passes_per_step
        self.op = op
        self.gradient_predivide_factor = gradient_predivide_factor
        self._sparse_as_dense = sparse_as_dense
        self._process_set = process_set
        trainable = {p for group in self.param_groups for p in group["params"] if p.requires_grad}
        explicit = _split_groups(sorted(trainable, key=self._parameter_names.get), groups)  # the same on every rank
        grouped = {p for group in explicit for p in group}
        rest = [p for p in reversed(self._parameter_names) if p in trainable and p not in grouped]  # backward order
        self._cap = 0 if op == ReduceOp.Adasum else bucket_cap_mb * MIB  # Adasum combines each gradient alone
        self._own_cap = self._cap  # autotune may change _cap; its "as configured" means this one
        self._explicit = [_Bucket(g, self._parameter_names, flat=op != ReduceOp.Adasum) for g in explicit]
        self._sized = rest  # the parameters bucketed by size, in the order of their first buckets
        self._views = compression is Compression.none and op != ReduceOp.Adasum
        self._slots = {p: _Slot(p, self._parameter_names[p]) for g in explicit for p in g}
        self._slots.update((p, _Slot(p, self._parameter_names[p])) for p in rest)
        self._round = 0  # bumped by _reset: a slot's passes counted in an older round are stale
        self._step_open = False  # whether this step's first gradient hook has run (_open_step)
        self._idle = False  # this rank is outside the process set this step: it reduces nothing
        self._start_over()
        self._pending: list = []  # per started reduction: (its bucket or sparse parameter, a function that waits
        #                           and writes the gradients)
        self._densified: list = []  # parameters whose sparse gradient is reduced dense (sparse_as_dense)
        self._synchronized = False
        self._should_synchronize = True
        self._hooks = [p.register_post_accumulate_grad_hook(functools.partial(self._on_grad_ready, slot))
                       for p, slot in self._slots.items()]

    def _start_over(self) -> None:
        """The first buckets (reverse registration order), to be rebuilt after the next step."""
        flat = self.op != ReduceOp.Adasum
        self._buckets = self._explicit + [_Bucket(g, self._parameter_names, flat)
                                          for g in split_by_size(self._sized, self._cap)]
        self._place_slots()
        self._ready_order: list | None = []  # gradients in the order they became final; None once rebuilt
        self._agreed: tuple[list, list] | None = None  # rank 0's ready order and sparse flags, once agreed
        self._runtime = None  # a weak reference to the runtime (the init()) these buckets were agreed in

    def _follow_runtime(self) -> None:
        """After an elastic reset (a new ``init()``) start over, as the optimizer of a worker that just joined."""
        if not basics.is_initialized():
            return
        current = basics.runtime()
        if self._runtime is None:
            self._runtime = weakref.ref(current)
        elif self._runtime() is not current:
            self._reset()
            self._cap = self._own_cap
            self._start_over()
            self._compression.reset()  # as a joining rank's (PowerSGD: plain steps first, new Q, no error)
            self._runtime = weakref.ref(current)
        else:
            return
        if self._own_cap and current.settings.autotune:
            collectives.note_gradient_buckets()

    def _place_slots(self) -> None:
        """Point each parameter's slot at its bucket of the current layout."""
        slots = self._slots
        for bucket in self._buckets:
            for p in bucket.params:
                slots[p].bucket = bucket

    # ---------------------------------------------------------------- hooks
    def _outside_process_set(self) -> bool:
        """Whether this rank is not a member of the optimizer's process set (it then reduces nothing, as Horovod)."""
        return self._process_set.included() is False

    def _open_step(self) -> None:
        """At the first gradient of a step: follow an elastic reset, and see whether this rank reduces at all
        (checked once per step, not in every parameter's hook; ``_reset`` closes the step)."""
        self._follow_runtime()
        self._idle = self._outside_process_set()
        self._step_open = True

    def _on_grad_ready(self, slot: _Slot, _param) -> None:
        """A gradient is final for this backward pass: count it; start its bucket once all of the bucket's are."""
        if not self._step_open:
            self._open_step()
        if self._idle:
            return
        left = slot.left if slot.round == self._round else self.backward_passes_per_step
        if left <= 0:
            raise GradientSyncError(
                f"the gradient of '{slot.name}' was computed more than backward_passes_per_step="
                f"{self.backward_passes_per_step} times before optimizer.step(); raise "
                "backward_passes_per_step to accumulate more passes locally")
        slot.round, slot.left = self._round, left - 1
        if left == 1:
            if self._ready_order is not None:
                self._ready_order.append(slot.param)
            bucket = slot.bucket
            bucket.ready += 1
            if bucket.ready == len(bucket.params):
                self._start(bucket)

    def _prepare_grad(self, p) -> None:
        if p.grad is None:
            p.grad = torch.zeros_like(p)
        elif p.grad.is_sparse and self._sparse_as_dense:
            p.grad = p.grad.to_dense()
            self._densified.append(p)  # handed back to the optimizer sparse, as Horovod does

    def _allreduce_async(self, tensors, name) -> int:
        prescale, postscale = 1.0, 1.0
        if self.op == ReduceOp.Average:
            prescale, postscale = 1.0 / self.gradient_predivide_factor, self.gradient_predivide_factor
        start = grouped_allreduce_async_ if isinstance(tensors, list) else allreduce_async_
        return start(tensors, name=name, op=self.op, prescale_factor=prescale, postscale_factor=postscale,
                     process_set=self._process_set)

    def _start(self, bucket: _Bucket) -> None:
        bucket.started = True
        if bucket.views is not None:
            self._start_viewed(bucket)
            return
        targets = []  # the dense gradients that receive the results; None for a sparse one
        for p in bucket.params:
            self._prepare_grad(p)
            if p.grad.is_sparse:
                self._pending.append((p, self._start_sparse(p)))
            targets.append(None if p.grad.is_sparse else p.grad)
        if len(targets) == 1 and targets[0] is None:
            return
        # a sparse gradient's place in a bucket carries zeros, so that the bucket is the same on every rank
        grads = [torch.zeros_like(p) if t is None else t for p, t in zip(bucket.params, targets)]
        compression = self._compression
        if compression.reduces_buckets:
            finish = compression.reduce_bucket(bucket.name, bucket.names, grads, self._allreduce_async)
            self._pending.append((bucket, lambda: _write_back(targets, finish())))
            return
        if len(grads) == 1:
            compressed, ctx = compression.compress(grads[0])
            handle = self._allreduce_async(compressed, bucket.name)
            self._pending.append((bucket, lambda: _write_back(
                targets, [compression.decompress(synchronize(handle), ctx)])))
        elif bucket.sizes is not None:
            if bucket.flat is None:
                bucket.flat = grads[0].new_empty(sum(bucket.sizes))
            with torch.no_grad():
                torch.cat([g.reshape(-1) for g in grads], out=bucket.flat)
            compressed, ctx = compression.compress(bucket.flat)
            handle = self._allreduce_async(compressed, bucket.name)
            self._pending.append((bucket, lambda: _write_back(
                targets, compression.decompress(synchronize(handle), ctx).split(bucket.sizes))))
        else:
            compressed = [compression.compress(g) for g in grads]
            handle = self._allreduce_async([c for c, _ in compressed], bucket.name)
            self._pending.append((bucket, lambda: _write_back(
                targets, [compression.decompress(r, c[1]) for r, c in zip(synchronize(handle), compressed)])))

    def _start_viewed(self, bucket: _Bucket) -> None:
        """Reduce the flat buffer in place; a gradient that is not its view is copied in and re-pointed."""
        with torch.no_grad():
            for p, view in zip(bucket.params, bucket.views):
                grad = p.grad
                if grad is view:  # backward accumulated into the bucket: nothing to do
                    continue
                if grad is None:
                    view.zero_()
                elif grad.is_sparse:
                    if not self._sparse_as_dense:  # reduced apart; its place in the bucket is zeros
                        view.zero_()
                        self._pending.append((p, self._start_sparse(p)))
                        continue
                    view.copy_(grad.to_dense())
                    self._densified.append(p)  # handed back to the optimizer sparse, as Horovod does
                elif not _is_view(grad, view):  # a new gradient (zero_grad set it to None) or one replaced
                    view.copy_(grad)
                p.grad = view
        flat = bucket.flat
        handle = self._allreduce_async(flat, bucket.name)
        self._pending.append((bucket, lambda: _land(flat, synchronize(handle))))

    def _rebuild_buckets(self) -> None:
        """Re-bucket in the order rank 0's gradients became ready in the first step, then attach views.

        Parameters whose gradient was never ready keep their order after the
        others; those with a sparse gradient on the wire go in buckets of
        their own.
        """
        if self._sized:
            self._agreed = self._agreed_order()
        self._lay_out()

    def _lay_out(self) -> None:
        """Buckets of about ``_cap`` bytes in the agreed order (gradients as views into them)."""
        if self._agreed is not None:
            order, sparse = self._agreed
            dense = [p for p, on_wire in zip(order, sparse) if not on_wire]
            alone = [(p,) for p, on_wire in zip(order, sparse) if on_wire]
            flat = self.op != ReduceOp.Adasum
            self._buckets = self._explicit + [_Bucket(g, self._parameter_names, flat, kind="rebuilt")
                                              for g in split_by_size(dense, self._cap) + alone]
        self._place_slots()
        if self._views:
            for bucket in self._buckets:
                if bucket.sizes is not None and len(bucket.params) > 1:
                    bucket.attach_views()

    def _follow_tuning(self) -> None:
        """Re-lay the buckets when autotune's bucket size changed before this step's reductions ran
        (every rank sees the change after the same step)."""
        runtime = self._runtime() if self._runtime is not None else None
        if self._agreed is None or not self._own_cap or runtime is None or not runtime.settings.autotune:
            return
        tuned = collectives.tuned_settings([b.name for b in self._buckets], self._process_set)
        if tuned is None:
            return
        cap = tuned.bucket_cap_mb * MIB if tuned.bucket_cap_mb else self._own_cap
        if cap != self._cap:
            self._cap = cap
            self._lay_out()

    def _agreed_order(self) -> tuple[list, list]:
        """Rank 0's ready order of the size-bucketed parameters (never ready: last) and which are sparse."""
        index = {p: i for i, p in enumerate(self._sized)}
        seen = [p for p in dict.fromkeys(self._ready_order) if p in index]
        seen_set = set(seen)
        order = seen + [p for p in self._sized if p not in seen_set]
        plan = torch.tensor([[index[p] for p in order], [int(self._sparse_on_wire(p)) for p in order]])
        if self._process_set.size() > 1:
            name = f"broadcast.bucket_order.{self._parameter_names[self._sized[0]]}"
            broadcast_(plan, root_rank=self._process_set.ranks[0], name=name, process_set=self._process_set)
        return [self._sized[i] for i in plan[0].tolist()], [bool(flag) for flag in plan[1].tolist()]

    def _sparse_on_wire(self, p) -> bool:
        return p.grad is not None and p.grad.is_sparse and not self._sparse_as_dense

    def _start_sparse(self, p):
        wait = sparse_allreduce_async(p.grad, name=f"sparse.{self._parameter_names[p]}", op=self.op,
                                      process_set=self._process_set)

        def finish():
            p.grad = wait()

        return finish

    def _reducing(self, subject) -> str:
        """Which gradients a reduction carries, in the user's names, for its error message."""
        if isinstance(subject, _Bucket):
            params = subject.params
            where = f"bucket {self._buckets.index(subject)} of {len(self._buckets)}, {subject.name!r}"
        else:
            params, where = (subject,), "sparse, reduced alone"
        names = ", ".join(f"{self._parameter_names[p]} {list(p.shape)}" for p in params)
        return f"while reducing gradients of: {names} ({where})"

    # ----------------------------------------------------------- public API
    def synchronize(self) -> None:
        """Wait for every gradient reduction of this step (starting those whose hooks did not fire).

        On a rank outside the optimizer's process set there is nothing to wait for: the gradients stay local.
        """
        self._follow_runtime()
        if self._outside_process_set():
            self._reset()  # closes the step, so that the next one checks the process set again
            self._synchronized = True
            return
        try:
            for bucket in self._buckets:
                if not bucket.started:  # unused parameters: every rank must still take part
                    self._start(bucket)
            for subject, finish in self._pending:
                try:
                    finish()
                except (RuntimeError, ValueError) as exc:  # ranks disagree, a rank is lost, ...
                    raise _with_context(exc, self._reducing(subject)) from exc
            for p in self._densified:
                p.grad = p.grad.to_sparse()
            self._compression.end_step()
            if self._ready_order is not None:
                self._rebuild_buckets()
            else:
                self._follow_tuning()
        finally:
            self._ready_order = None
            self._reset()
        self._synchronized = True

    def _reset(self) -> None:
        """Close the step: nothing pending, no gradient counted (a new round), the next hook opens a step."""
        self._pending.clear()
        self._densified.clear()
        for bucket in self._buckets:
            bucket.ready, bucket.started = 0, False
        self._round += 1
        self._step_open = False

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
                warnings.warn("optimizer.step() called without optimizer.skip_synchronize() context after "
                              "optimizer.synchronize(). This can cause training slowdown. You may want to "
                              "consider using optimizer.skip_synchronize() context if you use "
                              "optimizer.synchronize() in your code. (roundel does not reduce the gradients "
                              "twice.)")
            else:
                self.synchronize()
        self._synchronized = False
        return super(self.__class__, self).step(closure)

    def _local_step(self, closure=None):
        """The wrapped optimizer's update alone, without reducing gradients."""
        return super(self.__class__, self).step(closure)

    def zero_grad(self, set_to_none: bool = True):
        """Clear gradients; an error while reductions of this step are still in flight."""
        self._follow_runtime()
        if self._pending or any(bucket.ready for bucket in self._buckets):
            raise GradientSyncError(
                "optimizer.zero_grad() was called after loss.backward() but before optimizer.step() or "
                "optimizer.synchronize(); the gradient reductions still in flight would race with it")
        return super(self.__class__, self).zero_grad(set_to_none=set_to_none)

    def load_state_dict(self, state_dict):
        self._reset()
        self._synchronized = False
        return super(self.__class__, self).load_state_dict(state_dict)

    def set_backward_passes_per_step(self, passes: int) -> None:
        """Change how many backward passes are accumulated locally before reducing."""
        if passes < 1:
            raise ValueError(f"backward_passes_per_step={passes} must be >= 1")
        self.backward_passes_per_step = passes
        self._round += 1  # passes counted so far start over at the new count


def DistributedOptimizer(optimizer, named_parameters=None, compression=Compression.none,
                         backward_passes_per_step=1, op=ReduceOp.Average, gradient_predivide_factor=1.0,
                         num_groups=0, groups=None, sparse_as_dense=False, process_set=global_process_set,
                         bucket_cap_mb=None, shard_optimizer_state=False):
    """Wrap ``optimizer`` so that gradients are averaged (or summed, or Adasum-combined) across ranks.

    Returns an instance of a subclass of the optimizer's own class, built on
    its parameter groups (so learning-rate schedulers and ``state_dict`` work
    as before). Gradients are reduced in buckets, each as one flat buffer:
    ``groups`` (a count, or lists of parameters; ``num_groups`` is the older
    count form) sets buckets explicitly, and the other gradients go in buckets
    of about ``bucket_cap_mb`` MiB, the first one small: by default
    ``ROUNDEL_BUCKET_CAP_MB`` (``roundelrun --bucket-cap-mb``), else 25, as
    PyTorch DDP. ``bucket_cap_mb=0`` reduces each gradient on its own. After
    the first step the buckets follow the order in which gradients became
    ready, and without compression each ``.grad`` is a view into its bucket.
    ``op=Adasum`` (with more than one rank) is Horovod's delta-based Adasum
    optimizer: as soon as a gradient is ready, the wrapped optimizer updates
    that parameter locally, and ``step()`` applies the Adasum combination of
    every rank's parameter change (see ``roundel.torch.adasum_optimizer``).
    Compression applies to a bucket's flat buffer, so it must work element by
    element (as ``fp16`` and ``bf16`` do) unless ``bucket_cap_mb=0``.
    ``shard_optimizer_state=True`` shards the optimizer state across ranks
    (ZeRO stage 1): gradients are reduce-scattered in segments of about
    ``bucket_cap_mb`` MiB (default: 8 at most) while backward runs, each rank
    updates its 1/N slice of the parameters with its 1/N of the state, and
    the parameters are allgathered (see ``roundel.torch.sharded_optimizer``).
    ``compression=hvd.PowerSGD(...)`` compresses gradients to low rank
    (see ``roundel.torch.powersgd``).
    Raises ValueError for missing or duplicate ``named_parameters``, a
    parameter in two ``groups``, a negative ``bucket_cap_mb``, or an option
    that ``shard_optimizer_state=True`` does not support.
    """
    op = resolve_op(op)
    if groups is not None and num_groups:
        raise ValueError("pass groups= or num_groups=, not both")
    compression = as_compressor(compression)
    if compression.reduce_ops is not None and op not in compression.reduce_ops:
        accepted = " or ".join(f"op={o.name}" for o in sorted(compression.reduce_ops))
        raise ValueError(f"compression={compression!r} reduces with {accepted}, not op={op.name}")
    if shard_optimizer_state:
        return sharded_optimizer(optimizer, named_parameters, op, gradient_predivide_factor, backward_passes_per_step,
                                 bucket_cap_mb, compression, groups if groups is not None else num_groups,
                                 sparse_as_dense, process_set)
    if op == ReduceOp.Adasum and basics.size() > 1:
        if gradient_predivide_factor != 1.0:
            raise ValueError("gradient_predivide_factor only applies to op=Average")
        cls = type(optimizer.__class__.__name__, (optimizer.__class__,), dict(_DistributedAdasumOptimizer.__dict__))
        names = parameter_names(optimizer.param_groups, named_parameters)
        return cls(optimizer.param_groups, names, compression, backward_passes_per_step, process_set)
    cls = type(optimizer.__class__.__name__, (optimizer.__class__,), dict(_DistributedOptimizer.__dict__))
    return cls(optimizer.param_groups, named_parameters, compression, backward_passes_per_step, op,
               gradient_predivide_factor, groups if groups is not None else num_groups, sparse_as_dense,
               process_set, bucket_cap_mb)
