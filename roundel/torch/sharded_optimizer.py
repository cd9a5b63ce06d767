"""Sharded optimizer state (ZeRO stage 1): ``DistributedOptimizer(..., shard_optimizer_state=True)``.

Each parameter group's trainable parameters of one dtype and device, in
backward order, are split into *segments* of about ``bucket_cap_mb`` MiB:
their values laid end to end, padded with zeros to a multiple of the number
of ranks N. Rank r owns the r-th of N equal slices of every
segment. The wrapped optimizer's class is instantiated a second time (the
*inner* optimizer) over one flat tensor per segment holding this rank's
slice, so its state (Adam's moments, SGD's momentum) takes 1/N of the memory.

A segment's flat gradient is reduce-scattered (average, or sum) from the
gradient hooks as soon as all its gradients are final (in ``step()`` with
several backward passes per step); ``step()`` waits for them,
copies the outer parameter groups' hyper-parameters (learning rate, ...) into
the inner ones, lets the inner optimizer update this rank's slice, and
allgathers the slices back into the parameters. For an optimizer whose update
treats every element on its own (SGD, momentum, Adam, AdamW, RMSprop,
Adagrad, ...) the result equals the unsharded optimizer's up to float
rounding; one that looks at a whole parameter (LAMB/LARS trust ratios, a
per-parameter norm) would see slices instead and is not supported.

``state_dict()`` gathers the full state, in the wrapped optimizer's own
format (the same as the unsharded optimizer would return), and is therefore a
collective: call it on every rank. ``load_state_dict()`` takes such a full
state dict on every rank and keeps this rank's slices; it communicates
nothing, and it is applied at the next use, with the shard layout of the job
as it is then (so an elastic job can load a state saved before a resize).
``local_state_dict()`` is this rank's slice alone, without communication.
``p.grad`` keeps this rank's own gradient (the reduced slice is the inner
optimizer's): clip with ``clip_grad_norm_``, which uses the reduced slices.
"""

from __future__ import annotations

import contextlib
import copy
import weakref

import torch

from roundel.common import basics
from roundel.common.process_sets import global_process_set
from roundel.common.settings import Settings
from roundel.ops import ReduceOp
from roundel.torch.compression import Compression
from roundel.torch.gradient_layout import MIB, GradientSyncError, check_bucket_cap, parameter_names, split_by_size
from roundel.torch.mpi_ops import allgather_async, allreduce, reducescatter_async, synchronize

_DEFAULT_CAP_MB = 8  # at most: smaller than for allreduce, as the update of a segment runs faster in cache


class _Segment:
    """Trainable parameters of one outer group, one dtype and device, laid end to end; this rank's slice."""

    __slots__ = ("group", "params", "sizes", "total", "shard", "size", "start", "name", "param")

    def __init__(self, group: int, params: list, names: dict, size: int, rank: int):
        self.group = group
        self.params = params
        self.sizes = [p.numel() for p in params]
        self.total = sum(self.sizes)
        self.shard = -(-self.total // size)  # elements per rank (the last rank's slice may hold padding)
        self.size = size
        self.start = rank * self.shard
        self.name = f"{group}.{str(params[0].dtype).split('.')[-1]}.{names[params[0]]}.{len(params)}"
        self.param = None  # this rank's slice, the tensor the inner optimizer updates

    def flat(self, tensors) -> torch.Tensor:
        """``tensors`` (one per parameter) flattened end to end and padded to ``shard * size``."""
        first = self.params[0]
        out = torch.zeros(self.shard * self.size, dtype=first.dtype, device=first.device)
        torch.cat([t.reshape(-1) for t in tensors], out=out[:self.total])
        return out

    def copy_slice(self, tensors, out: torch.Tensor) -> None:
        """Copy this rank's slice of ``tensors`` laid end to end into ``out`` (padding left as it is)."""
        lo, hi, offset = self.start, self.start + self.shard, 0
        for t, n in zip(tensors, self.sizes):
            a, b = max(lo, offset), min(hi, offset + n)
            if a < b:
                out[a - lo:b - lo].copy_(t.reshape(-1)[a - offset:b - offset])
            offset += n

    def my_slice(self, flat: torch.Tensor) -> torch.Tensor:
        return flat[self.start:self.start + self.shard]


class _ShardedOptimizer(torch.optim.Optimizer):
    """Mixed into the wrapped optimizer's class by ``DistributedOptimizer(..., shard_optimizer_state=True)``."""

    _roundel_sharded = True

    def __init__(self, params, names, original, op, gradient_predivide_factor, bucket_cap_mb):
        super(self.__class__, self).__init__(params)
        self._cap = bucket_cap_mb * MIB
        self._parameter_names = names
        self._original_class = original.__class__
        self._original_defaults = dict(original.defaults)
        self.op = op
        self.gradient_predivide_factor = gradient_predivide_factor
        self._segments: list[_Segment] = []
        self._inner = None
        self._runtime = None  # weak reference to the runtime the layout was made for
        self._pending_full = None  # a full state dict to shard at the next use (load_state_dict)
        self._synchronized = False
        self._should_synchronize = True
        self._segment_of: dict = {}
        self._handles: dict = {}  # per segment started this step: its reduce-scatter's handle
        self._ready: dict = {}  # per segment: gradients final for this step
        self._step_open = False  # whether this step's first gradient hook checked the job and the layout
        self.backward_passes_per_step = 1
        self._hooks = [p.register_post_accumulate_grad_hook(self._on_grad_ready)
                       for group in self.param_groups for p in group["params"] if p.requires_grad]

    def _on_grad_ready(self, p) -> None:
        """Start a segment's reduce-scatter as soon as all its gradients are final (one backward pass a step)."""
        if self.backward_passes_per_step != 1:
            return
        if not self._step_open:  # once a step, not in every parameter's hook
            if not basics.is_initialized():
                return
            self._ensure_layout()
            self._step_open = True
        seg = self._segment_of.get(p)
        if seg is None:
            return
        if seg in self._handles:
            raise GradientSyncError(
                f"the gradient of '{self._parameter_names[p]}' was computed again before optimizer.step(); "
                "pass backward_passes_per_step to accumulate several backward passes")
        self._ready[seg] = self._ready.get(seg, 0) + 1
        if self._ready[seg] == len(seg.params):
            self._start(seg)

    # ------------------------------------------------------------ layout
    def _layout_is_current(self) -> bool:
        return (self._inner is not None and self._runtime is not None and basics.is_initialized()
                and self._runtime() is basics.runtime())

    def _ensure_layout(self) -> None:
        """Lay out the shards for the job as it is now; shard a loaded full state dict into them."""
        if self._layout_is_current() and self._pending_full is None:
            return
        if not self._layout_is_current():
            if self._inner is not None and self._inner.state and self._pending_full is None:
                raise RuntimeError(
                    "the sharded optimizer state was laid out for another job (the ranks changed, e.g. an "
                    "elastic reset) and each rank holds only its slice; load a full state dict with "
                    "optimizer.load_state_dict() (hvd.elastic.TorchState does this) before the next step")
            self._make_layout()
        if self._pending_full is not None:
            full, self._pending_full = self._pending_full, None
            self._load_full(full)

    def _make_layout(self) -> None:
        size, rank = basics.size(), basics.rank()
        segments = []
        for g, group in enumerate(self.param_groups):
            by_kind: dict = {}
            for p in reversed(group["params"]):  # about the order backward produces gradients, as DDP buckets
                if p.requires_grad:
                    by_kind.setdefault((p.dtype, p.device), []).append(p)
            for params in by_kind.values():
                for bucket in split_by_size(params, self._cap):
                    segments.append(_Segment(g, list(bucket), self._parameter_names, size, rank))
        inner_groups = []
        for seg in segments:
            with torch.no_grad():
                seg.param = seg.my_slice(seg.flat([p.detach() for p in seg.params])).clone()
            seg.param.requires_grad_(True)
            group = {k: v for k, v in self.param_groups[seg.group].items() if k != "params"}
            group["params"] = [seg.param]
            inner_groups.append(group)
        self._segments = segments
        self._segment_of = {p: seg for seg in segments for p in seg.params}
        self._handles, self._ready = {}, {}
        self._inner = self._new_inner(inner_groups)
        self._runtime = weakref.ref(basics.runtime())

    def _new_inner(self, groups):
        try:
            return self._original_class(groups, **self._original_defaults)
        except TypeError:  # a constructor that does not take its defaults back as keywords
            inner = self._original_class.__new__(self._original_class)
            torch.optim.Optimizer.__init__(inner, groups, self._original_defaults)
            return inner

    # ------------------------------------------------------------ step
    def _start(self, seg: _Segment) -> None:
        prescale, postscale = 1.0, 1.0
        if self.op == ReduceOp.Average:
            prescale, postscale = 1.0 / self.gradient_predivide_factor, self.gradient_predivide_factor
        grads = []
        for p in seg.params:
            if p.grad is not None and p.grad.is_sparse:
                raise ValueError(f"shard_optimizer_state=True does not support sparse gradients "
                                 f"('{self._parameter_names[p]}'); use a dense embedding or the "
                                 "unsharded DistributedOptimizer")
            grads.append(p.grad if p.grad is not None else torch.zeros_like(p))
        with torch.no_grad():
            flat = seg.flat(grads)
        self._handles[seg] = reducescatter_async(flat, name=f"zero.reducescatter.{seg.name}", op=self.op,
                                                 prescale_factor=prescale, postscale_factor=postscale)

    def synchronize(self) -> None:
        """Reduce-scatter the gradients: each segment's slice of the average lands in its shard's ``.grad``.

        Segments whose gradients all became final during backward are already
        on their way; the others (unused parameters, several backward passes)
        start here. ``p.grad`` keeps this rank's own gradient.
        """
        self._ensure_layout()
        try:
            for seg in self._segments:
                if seg not in self._handles:
                    self._start(seg)
            for seg in self._segments:
                seg.param.grad = synchronize(self._handles[seg])
        finally:
            self._handles, self._ready, self._step_open = {}, {}, False
        self._synchronized = True

    def step(self, closure=None):
        """Reduce-scatter the gradients, update this rank's shard, allgather the parameters."""
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        if self._should_synchronize and not self._synchronized:
            self.synchronize()
        self._ensure_layout()
        self._synchronized = False
        for seg, group in zip(self._segments, self._inner.param_groups):
            group.update({k: v for k, v in self.param_groups[seg.group].items() if k != "params"})
            with torch.no_grad():  # the parameters may have been changed (broadcast_parameters, a load)
                seg.copy_slice([p.detach() for p in seg.params], seg.param)
        self._inner.step()
        handles = [allgather_async(seg.param.detach(), name=f"zero.allgather.{seg.name}")
                   for seg in self._segments]
        with torch.no_grad():
            for seg, handle in zip(self._segments, handles):
                full = synchronize(handle)
                for p, chunk in zip(seg.params, full[:seg.total].split(seg.sizes)):
                    p.copy_(chunk.view_as(p))
        return loss

    def clip_grad_norm_(self, max_norm: float, norm_type: float = 2.0) -> torch.Tensor:
        """Scale the reduced gradients so that their norm over every rank's shard is at most ``max_norm``.

        ``torch.nn.utils.clip_grad_norm_(model.parameters(), ...)`` would see
        this rank's own, unreduced ``p.grad``; call this instead, before
        ``step()`` (it synchronizes first if needed). Returns the total norm
        before clipping (the same on every rank).
        """
        if not self._synchronized:
            self.synchronize()
        norm_type = float(norm_type)
        grads = [seg.param.grad for seg in self._segments]
        if norm_type == float("inf"):
            local = torch.stack([g.abs().max() for g in grads]).max().to(torch.float64)
            total = allreduce(local.reshape(1), name="zero.clip_norm", op=ReduceOp.Max)[0]
        else:
            local = sum((g.to(torch.float64).abs() ** norm_type).sum() for g in grads)
            total = allreduce(local.reshape(1), name="zero.clip_norm", op=ReduceOp.Sum)[0] ** (1.0 / norm_type)
        coef = max_norm / (float(total) + 1e-6)
        if coef < 1:
            for g in grads:
                g.mul_(coef)
        return total.to(grads[0].dtype)

    def _local_step(self, closure=None):
        """The update without reducing gradients (as ``broadcast_optimizer_state`` uses it): unsupported."""
        raise NotImplementedError("a sharded optimizer has no local update")

    @contextlib.contextmanager
    def skip_synchronize(self):
        """Make ``step()`` skip its own synchronize (after ``synchronize()`` or ``clip_grad_norm_``)."""
        self._should_synchronize = False
        try:
            yield
        finally:
            self._should_synchronize = True

    def zero_grad(self, set_to_none: bool = True):
        """Clear gradients; an error while reduce-scatters of this step are still in flight."""
        if self._handles or self._ready:
            raise GradientSyncError(
                "optimizer.zero_grad() was called after loss.backward() but before optimizer.step() or "
                "optimizer.synchronize(); the gradient reductions of this step are still in flight")
        return super(self.__class__, self).zero_grad(set_to_none=set_to_none)

    def set_backward_passes_per_step(self, passes: int) -> None:
        """Gradients accumulate in ``.grad`` until ``step()``; the count only matters to the unsharded optimizer."""
        if passes < 1:
            raise ValueError(f"backward_passes_per_step={passes} must be >= 1")
        self.backward_passes_per_step = passes

    def add_param_group(self, param_group):
        if getattr(self, "_segments", None) is not None and hasattr(self, "_inner"):
            raise ValueError("add_param_group is not supported with shard_optimizer_state=True; "
                             "pass every parameter group to the optimizer before wrapping it")
        return super(self.__class__, self).add_param_group(param_group)

    # ------------------------------------------------------------ state
    def _elementwise(self, value, seg: _Segment) -> bool:
        return isinstance(value, torch.Tensor) and value.dim() == 1 and value.numel() == seg.shard

    def local_state_dict(self) -> dict:
        """This rank's slice of the state (the inner optimizer's ``state_dict()``); no communication."""
        self._ensure_layout()
        return self._inner.state_dict()

    def local_state_bytes(self) -> int:
        """Bytes of optimizer-state tensors this rank holds."""
        self._ensure_layout()
        return sum(v.numel() * v.element_size() for state in self._inner.state.values()
                   for v in state.values() if isinstance(v, torch.Tensor))

    def state_dict(self) -> dict:
        """The full state, as the unsharded optimizer would return it; a collective (call it on every rank)."""
        if getattr(self, "_segments", None) is None:  # called during construction
            return super(self.__class__, self).state_dict()
        self._ensure_layout()
        index, i = {}, 0
        for group in self.param_groups:
            for p in group["params"]:
                index[p] = i
                i += 1
        state: dict = {}
        gathers = []
        for seg in self._segments:
            inner = self._inner.state.get(seg.param, {})
            for key, value in sorted(inner.items()):
                if self._elementwise(value, seg):
                    gathers.append((seg, key, allgather_async(value.detach().contiguous(),
                                                              name=f"zero.state.{key}.{seg.name}")))
                else:
                    for p in seg.params:
                        state.setdefault(index[p], {})[key] = (value.clone() if isinstance(value, torch.Tensor)
                                                               else copy.deepcopy(value))
        for seg, key, handle in gathers:
            full = synchronize(handle)
            for p, chunk in zip(seg.params, full[:seg.total].split(seg.sizes)):
                state.setdefault(index[p], {})[key] = chunk.view_as(p).clone()
        groups = []
        for group in self.param_groups:
            saved = {k: v for k, v in group.items() if k != "params"}
            saved["params"] = [index[p] for p in group["params"]]
            groups.append(saved)
        return {"state": {k: state[k] for k in sorted(state)}, "param_groups": groups}

    def load_state_dict(self, state_dict) -> None:
        """Load a full state dict (as ``state_dict()`` or the unsharded optimizer returns it) on every rank.

        Hyper-parameters take effect at once; the state is sharded at the next
        use with the layout of the job as it is then. Raises ValueError when
        the parameter groups do not match.
        """
        groups = state_dict["param_groups"]
        if len(groups) != len(self.param_groups) or any(
                len(s["params"]) != len(g["params"]) for s, g in zip(groups, self.param_groups)):
            raise ValueError("loaded state dict has a different number of parameter groups or parameters "
                             "than this optimizer")
        for saved, group in zip(groups, self.param_groups):
            group.update({k: v for k, v in saved.items() if k != "params"})
        self._pending_full = state_dict
        self._step_open = False  # the next gradient lays the state out again
        self._synchronized = False
        if self._inner is not None:
            self._inner.state.clear()

    def _load_full(self, full: dict) -> None:
        ids = [i for saved in full["param_groups"] for i in saved["params"]]
        flat_params = [p for group in self.param_groups for p in group["params"]]
        by_param = {p: full["state"].get(i, full["state"].get(str(i))) for p, i in zip(flat_params, ids)}
        inner_state = {}
        for n, seg in enumerate(self._segments):
            states = [by_param[p] or {} for p in seg.params]
            keys = sorted({k for s in states for k in s})
            if not keys:
                continue
            shard = {}
            for key in keys:
                values = [s.get(key) for s in states]
                tensors = [v for v in values if v is not None]
                sample = tensors[0]
                elementwise = all(isinstance(v, torch.Tensor) and v.shape == p.shape and (p.dim() > 0 or key != "step")
                                  for v, p in zip(values, seg.params) if v is not None)
                if elementwise and isinstance(sample, torch.Tensor):
                    parts = [v.to(p.device) if v is not None else torch.zeros_like(p, dtype=sample.dtype)
                             for v, p in zip(values, seg.params)]
                    flat = torch.zeros(seg.shard * seg.size, dtype=sample.dtype, device=seg.params[0].device)
                    torch.cat([t.reshape(-1).to(sample.dtype) for t in parts], out=flat[:seg.total])
                    shard[key] = seg.my_slice(flat).clone()
                else:
                    shard[key] = sample.clone() if isinstance(sample, torch.Tensor) else copy.deepcopy(sample)
            inner_state[n] = shard
        groups = []
        for n, (seg, group) in enumerate(zip(self._segments, self._inner.param_groups)):
            saved = {k: v for k, v in self.param_groups[seg.group].items() if k != "params"}
            saved["params"] = [n]
            groups.append(saved)
        self._inner.load_state_dict({"state": inner_state, "param_groups": groups})
        # load_state_dict replaced the inner groups' dicts but kept the parameters: re-read them
        for seg, group in zip(self._segments, self._inner.param_groups):
            seg.param = group["params"][0]


def sharded_optimizer(optimizer, named, op, gradient_predivide_factor, backward_passes_per_step,
                      bucket_cap_mb, compression, groups, sparse_as_dense, process_set):
    """``DistributedOptimizer(..., shard_optimizer_state=True)``: ``optimizer``'s class with sharded state.

    ``bucket_cap_mb`` None is ``ROUNDEL_BUCKET_CAP_MB``, at most 8. Raises
    ValueError for an option it does not support, naming what to change.
    """
    _check_supported(optimizer, op, compression, groups, sparse_as_dense, process_set)
    if gradient_predivide_factor != 1.0 and op != ReduceOp.Average:
        raise ValueError("gradient_predivide_factor only applies to op=Average")
    if backward_passes_per_step < 1:
        raise ValueError(f"backward_passes_per_step={backward_passes_per_step} must be >= 1")
    names = parameter_names(optimizer.param_groups, named)
    if bucket_cap_mb is None:
        bucket_cap_mb = min(Settings.from_env().bucket_cap_mb, _DEFAULT_CAP_MB)
    check_bucket_cap(bucket_cap_mb)
    cls = type(optimizer.__class__.__name__, (optimizer.__class__,), dict(_ShardedOptimizer.__dict__))
    sharded = cls(optimizer.param_groups, names, optimizer, op, gradient_predivide_factor, bucket_cap_mb)
    sharded.backward_passes_per_step = backward_passes_per_step
    return sharded


def _check_supported(optimizer, op, compression, groups, sparse_as_dense, process_set) -> None:
    """Raise ValueError naming what to change for a combination ``shard_optimizer_state=True`` does not support."""
    if op not in (ReduceOp.Average, ReduceOp.Sum):
        raise ValueError(f"shard_optimizer_state=True reduces gradients with op=Average or op=Sum, not {op}; "
                         "use the unsharded DistributedOptimizer for Adasum and other ops")
    if compression is not Compression.none:
        raise ValueError("shard_optimizer_state=True does not support gradient compression; pass "
                         "compression=hvd.Compression.none or drop shard_optimizer_state")
    if groups:
        raise ValueError("shard_optimizer_state=True lays out its own flat buffers; drop groups=/num_groups=")
    if sparse_as_dense:
        raise ValueError("shard_optimizer_state=True does not support sparse gradients (sparse_as_dense); "
                         "use a dense embedding")
    if process_set is not global_process_set:
        raise ValueError("shard_optimizer_state=True shards over every rank of the job (the global process "
                         "set); drop process_set= or use the unsharded DistributedOptimizer")
    if isinstance(optimizer, (torch.optim.LBFGS, torch.optim.SparseAdam)):
        raise ValueError(f"shard_optimizer_state=True does not support {type(optimizer).__name__} (its update "
                         "is not element by element); use the unsharded DistributedOptimizer")
