"""``RoundelStrategy``: Lightning 2.x training on roundel's ranks, the way Lightning 1.x's ``HorovodStrategy`` did.

One process per device, started by a launcher (``roundelrun``, ``mpirun``,
``srun``, ``torchrun``): Lightning starts no processes of its own. The
strategy joins the job in ``setup_environment`` (``hvd.init()``), tells
Lightning each process's ranks, broadcasts rank 0's parameters and optimizer
state, wraps each optimizer in ``roundel.torch.DistributedOptimizer`` (so that
gradients are averaged while backward runs), and answers Lightning's
collectives (``reduce`` for ``self.log(..., sync_dist=True)``, ``all_gather``,
``broadcast``, ``barrier``) with roundel's.

Gradients are reduced during the closure Lightning passes to
``optimizer.step``: right after its backward pass, so that gradient clipping
and ``on_before_optimizer_step`` see the averaged gradients, and only on the
backward pass that ends an accumulation cycle (``accumulate_grad_batches``
becomes the optimizer's ``backward_passes_per_step``).
"""

from __future__ import annotations

import functools
import os
import weakref
from collections.abc import Callable
from typing import Any

import torch
from torch import Tensor
from torch.nn import Module
from torch.optim import Optimizer

import lightning.pytorch as pl
from lightning.fabric.plugins import CheckpointIO, ClusterEnvironment
from lightning.fabric.utilities.optimizer import _optimizers_to_device
from lightning.pytorch.core.optimizer import LightningOptimizer
from lightning.pytorch.plugins import LayerSync, TorchSyncBatchNorm
from lightning.pytorch.plugins.precision import Precision
from lightning.pytorch.strategies import ParallelStrategy
from lightning.pytorch.trainer.states import TrainerFn
from lightning.pytorch.utilities.rank_zero import rank_zero_only, rank_zero_warn

import roundel.torch as hvd
from roundel.errors import SettingsError
from roundel.ops import ReduceOp
from roundel.rendezvous.identity import Identity, detect_launcher
from roundel.torch.compression import Compression

__all__ = ["RoundelEnvironment", "RoundelStrategy", "RoundelSyncBatchNorm"]

# Lightning's reduce_op (a string or torch.distributed.ReduceOp) -> roundel's operator. A torch ReduceOp is
# matched by its name: its integer value would read as a different roundel operator.
_OPS = {"mean": ReduceOp.Average, "avg": ReduceOp.Average, "average": ReduceOp.Average, "sum": ReduceOp.Sum,
        "max": ReduceOp.Max, "min": ReduceOp.Min, "product": ReduceOp.Product, "prod": ReduceOp.Product,
        "adasum": ReduceOp.Adasum}


def _reduce_op(reduce_op) -> ReduceOp:
    """roundel's operator for Lightning's ``reduce_op``; ValueError for one it cannot name."""
    if reduce_op is None:
        return ReduceOp.Average
    if isinstance(reduce_op, ReduceOp):
        return reduce_op
    key = reduce_op if isinstance(reduce_op, str) else getattr(reduce_op, "name", None)
    op = _OPS.get(key.lower()) if isinstance(key, str) else None
    if op is None:
        raise ValueError(f"RoundelStrategy.reduce: unknown reduce_op {reduce_op!r}; use 'mean', 'sum', 'max', "
                         "'min', 'product', a torch.distributed.ReduceOp of those, or a roundel operator")
    return op


def _process_set(group):
    """The roundel process set for Lightning's ``group``: None/WORLD is every rank; a ProcessSet is itself."""
    if group is None or group is torch.distributed.group.WORLD:
        return hvd.global_process_set
    if isinstance(group, hvd.ProcessSet):
        return group
    raise ValueError(f"RoundelStrategy: group={group!r} is not a roundel ProcessSet; pass None for every rank "
                     "or a registered hvd.ProcessSet (torch.distributed groups do not apply to roundel)")


def _identity_before_init() -> tuple[int, int, int, int, int]:
    """(rank, size, local rank, local size, cross rank) as the launcher's variables tell them before
    ``hvd.init()``; (0, 1, 0, 1, 0) where they do not (``hvd.init()`` reports a malformed value)."""
    try:
        ident = Identity.from_env()
        if ident is not None:
            return ident.rank, ident.size, ident.local_rank, ident.local_size, ident.cross_rank
        found = detect_launcher()
    except SettingsError:
        return 0, 1, 0, 1, 0
    if found is None:
        return 0, 1, 0, 1, 0
    local_rank = found.local_rank or 0
    return found.rank, found.size or 1, local_rank, found.local_size or local_rank + 1, 0


def _unwrap(optimizer) -> Optimizer:
    return optimizer._optimizer if isinstance(optimizer, LightningOptimizer) else optimizer


def _is_distributed_optimizer(optimizer) -> bool:
    return hasattr(optimizer, "synchronize") and hasattr(optimizer, "skip_synchronize")


def _delegating(lightning_optimizer: LightningOptimizer) -> LightningOptimizer:
    """Make the methods of a DistributedOptimizer's class run on the optimizer itself when called through
    Lightning's wrapper (``self.optimizers()`` in manual optimization: ``opt.zero_grad()``, ``opt.synchronize()``).

    The wrapper takes the optimizer's class as a base, so those methods would otherwise run with the wrapper
    as ``self``: their attribute writes would land on the wrapper, and their ``super(self.__class__, self)``
    would find themselves again. ``step`` stays the wrapper's (it goes through the strategy).
    """
    inner = lightning_optimizer._optimizer
    if not _is_distributed_optimizer(inner):
        return lightning_optimizer
    for name, value in vars(type(inner)).items():
        if callable(value) and not name.startswith("__") and not hasattr(LightningOptimizer, name):
            setattr(lightning_optimizer, name, getattr(inner, name))
    return lightning_optimizer


def _mark_steps(optimizer: Optimizer) -> None:
    """Record ``optimizer.step()`` calls as a torch LR scheduler does on the optimizer it was built with, so that
    a scheduler moved to the wrapped optimizer does not warn that its optimizer never stepped."""
    step = optimizer.step
    if hasattr(step, "_wrapped_by_lr_sched"):
        return

    @functools.wraps(step)
    def counted(*args, **kwargs):
        optimizer._opt_called = True
        return step(*args, **kwargs)

    counted._wrapped_by_lr_sched = True
    optimizer.step = counted


class RoundelEnvironment(ClusterEnvironment):
    """Lightning's view of a roundel job: the launcher creates the processes, roundel numbers them.

    The numbers are the strategy's (``hvd.rank()`` and the others once
    ``hvd.init()`` ran; the launcher's variables before). Lightning itself sets
    up no process group: roundel connects the ranks.
    """

    def __init__(self, strategy: "RoundelStrategy"):
        super().__init__()
        self._strategy = strategy

    @property
    def creates_processes_externally(self) -> bool:
        return True

    @property
    def main_address(self) -> str:
        return os.environ.get("ROUNDEL_RENDEZVOUS_ADDR", os.environ.get("MASTER_ADDR", "127.0.0.1"))

    @property
    def main_port(self) -> int:
        port = os.environ.get("ROUNDEL_RENDEZVOUS_PORT", os.environ.get("MASTER_PORT", "0"))
        return int(port) if port.isdigit() else 0

    @staticmethod
    def detect() -> bool:
        return "ROUNDEL_RANK" in os.environ

    def world_size(self) -> int:
        return self._strategy.world_size

    def set_world_size(self, size: int) -> None:
        pass  # roundel's launcher decides

    def global_rank(self) -> int:
        return self._strategy.global_rank

    def set_global_rank(self, rank: int) -> None:
        pass  # roundel's launcher decides

    def local_rank(self) -> int:
        return self._strategy.local_rank

    def node_rank(self) -> int:
        return self._strategy.node_rank


class RoundelSyncBatchNorm(LayerSync):
    """``Trainer(sync_batchnorm=True)`` under RoundelStrategy: BatchNorm layers become ``hvd.SyncBatchNorm``.

    Lightning's own ``TorchSyncBatchNorm`` needs ``torch.distributed``'s
    process group, which a roundel job does not set up. ``revert`` turns back
    only the layers ``apply`` made (a model's own ``hvd.SyncBatchNorm`` stays).
    """

    def __init__(self) -> None:
        self._made: weakref.WeakSet = weakref.WeakSet()

    def apply(self, model: Module) -> Module:
        def make(m: Module) -> Module:
            layer = hvd.SyncBatchNorm(m.num_features, m.eps, m.momentum, m.affine, m.track_running_stats)
            self._made.add(layer)
            return layer

        return _convert(model, lambda m: isinstance(m, _BATCH_NORMS), make)

    def revert(self, model: Module) -> Module:
        return _convert(model, lambda m: m in self._made,
                        lambda m: _BatchNormXd(m.num_features, m.eps, m.momentum, m.affine, m.track_running_stats))


_BATCH_NORMS = (torch.nn.BatchNorm1d, torch.nn.BatchNorm2d, torch.nn.BatchNorm3d)


class _BatchNormXd(torch.nn.modules.batchnorm._BatchNorm):
    """A plain batch norm for any input rank (what a SyncBatchNorm reverts to, as Lightning's revert does)."""

    def _check_input_dim(self, input: Tensor) -> None:
        return


def _convert(module: Module, replace: Callable[[Module], bool], make: Callable[[Module], Module]) -> Module:
    """``module`` with each sub-module for which ``replace`` holds swapped for ``make(it)``, which takes over
    its parameters and running statistics."""
    result = module
    if replace(module):
        result = make(module)
        if module.affine:
            result.weight = module.weight
            result.bias = module.bias
        result.running_mean = module.running_mean
        result.running_var = module.running_var
        result.num_batches_tracked = module.num_batches_tracked
        result.training = module.training
    for name, child in module.named_children():
        result.add_module(name, _convert(child, replace, make))
    return result


class RoundelStrategy(ParallelStrategy):
    """Data-parallel training over roundel's ranks: one process per device, started by a launcher.

    ``Trainer(strategy=RoundelStrategy(...), accelerator="cpu" or "gpu", devices=1)``
    in a script that ``roundelrun -np N`` (or ``mpirun``, ``srun``,
    ``torchrun``) starts; ``strategy="roundel"`` after ``import roundel.lightning``
    is the same with the defaults. Each rank uses one device: the CPU, or the
    GPU of its local rank (among the visible ones).

    Args:
        compression: gradient compression for the allreduce (``hvd.Compression.fp16``,
            ``hvd.Compression.bf16``, or an instance of ``hvd.PowerSGD``).
        op: how gradients are combined: ``hvd.Average`` (default), ``hvd.Sum`` or ``hvd.Adasum``.
        backward_passes_per_step: with automatic optimization, leave it None: it follows
            ``Trainer(accumulate_grad_batches=...)`` (another value is refused). With manual
            optimization, the number of ``manual_backward`` calls before each ``optimizer.step()``.
        sparse_as_dense: reduce sparse gradients (embeddings) as dense tensors.
        gradient_predivide_factor: divide gradients by this before the sum and by
            ``size / factor`` after it (``op=hvd.Average`` only).
        scale_lr: multiply every learning rate (and LR schedulers' ``base_lrs``) by the number of
            ranks at setup, as Lightning 1.x's ``HorovodStrategy`` did. Off by default, as in
            Lightning 2.x's DDP.
        accelerator: as for any Lightning strategy (usually left to ``Trainer(accelerator=...)``).
        checkpoint_io: as for any Lightning strategy; only rank 0 writes checkpoints.
        precision_plugin: as for any Lightning strategy (usually left to ``Trainer(precision=...)``).
        **optimizer_kwargs: passed to ``hvd.DistributedOptimizer`` as they are, for roundel's
            further options: ``shard_optimizer_state=True`` (ZeRO-1), ``bucket_cap_mb``,
            ``groups``/``num_groups``, ``process_set``.

    Raises:
        ValueError: at ``fit``, a ``backward_passes_per_step`` that differs from
            ``accumulate_grad_batches``, or ``gradient_clip_val`` with ``shard_optimizer_state=True``;
            a bad option of ``DistributedOptimizer`` raises its own error there.
    """

    strategy_name = "roundel"

    def __init__(
        self,
        compression: Any = Compression.none,
        op: ReduceOp = ReduceOp.Average,
        backward_passes_per_step: int | None = None,
        sparse_as_dense: bool = False,
        gradient_predivide_factor: float = 1.0,
        scale_lr: bool = False,
        accelerator: "pl.accelerators.Accelerator | None" = None,
        checkpoint_io: CheckpointIO | None = None,
        precision_plugin: Precision | None = None,
        **optimizer_kwargs: Any,
    ) -> None:
        super().__init__(accelerator=accelerator, parallel_devices=None, cluster_environment=None,
                         checkpoint_io=checkpoint_io, precision_plugin=precision_plugin)
        if backward_passes_per_step is not None and (isinstance(backward_passes_per_step, bool) or
                                                     not isinstance(backward_passes_per_step, int) or
                                                     backward_passes_per_step < 1):
            raise ValueError(f"backward_passes_per_step={backward_passes_per_step!r} must be a whole number >= 1 "
                             "(or None to follow Trainer(accumulate_grad_batches=...))")
        for reserved in ("named_parameters", "optimizer"):
            if reserved in optimizer_kwargs:
                raise TypeError(f"RoundelStrategy sets DistributedOptimizer's {reserved}= itself; do not pass it")
        self._optimizer_options = dict(compression=compression, op=op, sparse_as_dense=sparse_as_dense,
                                       gradient_predivide_factor=gradient_predivide_factor, **optimizer_kwargs)
        self._backward_passes_per_step = backward_passes_per_step
        self._scale_lr = scale_lr
        self.cluster_environment = RoundelEnvironment(self)
        self._ranks = _identity_before_init()  # (rank, size, local rank, local size, cross rank)
        self._owns_runtime = False  # whether setup_environment's hvd.init() started roundel (then teardown stops it)
        self._failed = False

    # ------------------------------------------------------------------ where this process is
    @property
    def global_rank(self) -> int:
        return hvd.rank() if hvd.is_initialized() else self._ranks[0]

    @property
    def world_size(self) -> int:
        return hvd.size() if hvd.is_initialized() else self._ranks[1]

    @property
    def local_rank(self) -> int:
        return hvd.local_rank() if hvd.is_initialized() else self._ranks[2]

    @property
    def node_rank(self) -> int:
        return hvd.cross_rank() if hvd.is_initialized() else self._ranks[4]

    @property
    def is_distributed(self) -> bool:
        """Lightning reads this to add a DistributedSampler to the data loaders."""
        return True

    @property
    def root_device(self) -> torch.device:
        devices = self.parallel_devices or [torch.device("cpu")]
        if devices[0].type == "cuda":
            count = torch.cuda.device_count()
            return torch.device("cuda", self.local_rank % count if count else 0)
        return devices[0]

    @property
    def distributed_sampler_kwargs(self) -> dict[str, Any]:
        return {"num_replicas": self.world_size, "rank": self.global_rank}

    @property
    def optimizers(self) -> list[Optimizer]:
        return self._optimizers

    @optimizers.setter
    def optimizers(self, optimizers: list[Optimizer]) -> None:
        self._optimizers = optimizers
        self._lightning_optimizers = [_delegating(LightningOptimizer._to_lightning_optimizer(opt, self))
                                      for opt in optimizers]

    def set_world_ranks(self) -> None:
        """Called while the Trainer is built (before ``hvd.init()``): Lightning's rank-zero-only output
        follows the launcher's rank from the start."""
        rank_zero_only.rank = self.global_rank

    # ------------------------------------------------------------------ setup
    def setup_environment(self) -> None:
        if not hvd.is_initialized():
            hvd.init()
            self._owns_runtime = True
        self._ranks = (hvd.rank(), hvd.size(), hvd.local_rank(), hvd.local_size(), hvd.cross_rank())
        rank_zero_only.rank = self.global_rank
        self._failed = False
        devices = self.parallel_devices or [torch.device("cpu")]
        if devices[0].type == "cpu" and len(devices) > 1:
            rank_zero_warn(f"RoundelStrategy runs one process per device: devices={len(devices)} is ignored "
                           "and each rank trains on the CPU; start more ranks with roundelrun -np N")
        self.parallel_devices = [self.root_device] if devices[0].type == "cuda" else [devices[0]]
        super().setup_environment()  # the accelerator's device (torch.cuda.set_device for a GPU)

    def setup(self, trainer: "pl.Trainer") -> None:
        assert self.accelerator is not None and self.model is not None
        self.accelerator.setup(trainer)
        fitting = trainer.state.fn == TrainerFn.FITTING
        if fitting and self._layer_sync is not None:
            if isinstance(self._layer_sync, TorchSyncBatchNorm):
                self._layer_sync = RoundelSyncBatchNorm()
            self.model = self._layer_sync.apply(self.model)
        self.model = self.precision_plugin.convert_module(self.model)
        self.model_to_device()
        assert self.lightning_module is not None
        hvd.broadcast_parameters(self.lightning_module.state_dict(), root_rank=0)
        if fitting:
            self.setup_optimizers(trainer)
        self.setup_precision_plugin()
        if fitting:
            _optimizers_to_device(self.optimizers, self.root_device)
            self._wrap_optimizers(trainer)

    def _wrap_optimizers(self, trainer: "pl.Trainer") -> None:
        """Each optimizer as a DistributedOptimizer over the module's named parameters, with rank 0's state."""
        module = self.lightning_module
        assert module is not None
        if module.automatic_optimization:
            passes = trainer.accumulate_grad_batches
            if self._backward_passes_per_step not in (None, passes):
                raise ValueError(
                    f"RoundelStrategy(backward_passes_per_step={self._backward_passes_per_step}) differs from "
                    f"Trainer(accumulate_grad_batches={passes}); with automatic optimization set only "
                    "accumulate_grad_batches and the strategy follows it")
        else:
            passes = self._backward_passes_per_step or 1
        originals = [_unwrap(opt) for opt in self.optimizers]
        if self._scale_lr:
            for opt in originals:
                for group in opt.param_groups:
                    group["lr"] *= self.world_size
            for config in self.lr_scheduler_configs:
                if hasattr(config.scheduler, "base_lrs"):
                    config.scheduler.base_lrs = [lr * self.world_size for lr in config.scheduler.base_lrs]
        names = dict(module.named_parameters())
        wrapped = []
        for opt in originals:
            if _is_distributed_optimizer(opt):  # wrapped in configure_optimizers already
                wrapped.append(opt)
                continue
            mine = {p for group in opt.param_groups for p in group["params"]}
            named = [(name, p) for name, p in names.items() if p in mine]
            wrapped.append(hvd.DistributedOptimizer(opt, named_parameters=named, backward_passes_per_step=passes,
                                                    **self._optimizer_options))
        if trainer.gradient_clip_val and any(getattr(opt, "_roundel_sharded", False) for opt in wrapped):
            raise ValueError(
                "Trainer(gradient_clip_val=...) with shard_optimizer_state=True: Lightning would clip each rank's "
                "own gradients, not the reduced shards the update uses; leave gradient_clip_val unset and clip in "
                "LightningModule.configure_gradient_clipping with optimizer.clip_grad_norm_(max_norm)")
        for config in self.lr_scheduler_configs:  # schedulers follow the wrapped optimizer (same param groups)
            for opt, new in zip(originals, wrapped):
                if getattr(config.scheduler, "optimizer", None) is opt and new is not opt:
                    config.scheduler.optimizer = new
                    _mark_steps(new)
        self.optimizers = wrapped
        for opt in wrapped:
            self._broadcast_optimizer(opt)

    def _broadcast_optimizer(self, optimizer: Optimizer) -> None:
        """Rank 0's optimizer state (``hvd.broadcast_optimizer_state``) or, while it has none, its
        hyper-parameters alone: the zero-gradient update that creates missing state would count as a step
        (Adam's bias correction) that a single-process run never takes."""
        has_state = hvd.broadcast_object(bool(optimizer.state_dict()["state"]), root_rank=0,
                                         name="roundel.lightning.optimizer_has_state")
        if has_state:
            hvd.broadcast_optimizer_state(optimizer, root_rank=0)
            return
        groups = [{k: v for k, v in group.items() if k != "params"} for group in optimizer.param_groups]
        groups = hvd.broadcast_object(groups, root_rank=0, name="roundel.lightning.optimizer_hyperparameters")
        for group, values in zip(optimizer.param_groups, groups):
            group.update(values)

    def model_to_device(self) -> None:
        assert self.model is not None
        self.model.to(self.root_device)

    def on_train_batch_start(self, batch: Any, batch_idx: int) -> None:
        """Follow a changed ``accumulate_grad_batches`` (GradientAccumulationScheduler, at an epoch's start)."""
        module = self.lightning_module
        if batch_idx != 0 or module is None or not module.automatic_optimization or module._trainer is None:
            return
        passes = module.trainer.accumulate_grad_batches
        for opt in self.optimizers:
            opt = _unwrap(opt)
            if _is_distributed_optimizer(opt) and opt.backward_passes_per_step != passes:
                opt.set_backward_passes_per_step(passes)

    # ------------------------------------------------------------------ steps
    def optimizer_step(self, optimizer: Optimizer, closure: Callable[[], Any],
                       model: "pl.LightningModule | Module | None" = None, **kwargs: Any) -> Any:
        """Reduce the gradients right after the closure's backward pass (before clipping and the
        ``on_before_optimizer_step`` hook), then step without reducing again."""
        inner = _unwrap(optimizer)
        if not _is_distributed_optimizer(inner):
            return super().optimizer_step(optimizer, closure, model, **kwargs)

        def closure_then_reduce():
            result = closure()
            inner.synchronize()
            return result

        with inner.skip_synchronize():
            return super().optimizer_step(optimizer, closure_then_reduce, model, **kwargs)

    # ------------------------------------------------------------------ collectives
    def reduce(self, tensor: Tensor | Any, group: Any | None = None,
               reduce_op: Any = "mean") -> Tensor | Any:
        """Reduce ``tensor`` over the ranks ('mean' by default; 'sum', 'max', 'min', 'product', a
        ``torch.distributed.ReduceOp`` or a roundel operator); anything but a tensor comes back as it is."""
        if not isinstance(tensor, Tensor):
            return tensor
        op = _reduce_op(reduce_op)
        process_set = _process_set(group)
        if not hvd.is_initialized():
            return tensor
        if op == ReduceOp.Average and not (tensor.is_floating_point() or tensor.is_complex()):
            tensor = tensor.float()
        return hvd.allreduce(tensor, op=op, process_set=process_set)

    def all_gather(self, tensor: Tensor, group: Any | None = None, sync_grads: bool = False) -> Tensor:
        """Every rank's ``tensor`` stacked along a new first dimension (shape ``(world_size, *tensor.shape)``),
        as Lightning's DDP returns it; with ``sync_grads`` the gradient flows back to each rank's input
        (summed over the ranks' losses, as DDP's)."""
        process_set = _process_set(group)
        if not hvd.is_initialized():
            return tensor.unsqueeze(0)
        if sync_grads:
            return _AllGather.apply(tensor, process_set)
        with torch.no_grad():
            return hvd.allgather(tensor.detach().unsqueeze(0).contiguous(), process_set=process_set)

    def broadcast(self, obj: Any, src: int = 0) -> Any:
        if not hvd.is_initialized() or hvd.size() == 1:
            return obj
        return hvd.broadcast_object(obj, root_rank=src)

    def barrier(self, name: str | None = None, *args: Any, **kwargs: Any) -> None:
        if hvd.is_initialized() and hvd.size() > 1:
            hvd.barrier()

    # ------------------------------------------------------------------ the end
    def on_exception(self, exception: BaseException) -> None:
        """A failing rank skips teardown's barrier and shutdown: the exception reaches the top of the script,
        where roundel reports it and the launcher stops the other ranks."""
        self._failed = True

    def teardown(self) -> None:
        for opt in self.optimizers:
            for hook in getattr(_unwrap(opt), "_hooks", ()):
                hook.remove()  # the model may be trained again by another optimizer
        if self._layer_sync is not None and self.model is not None:
            module = self.lightning_module
            if module is not None and module._trainer is not None and module.trainer.state.fn == TrainerFn.FITTING:
                self.model = self._layer_sync.revert(self.model)
        failed, self._failed = self._failed, False
        if not failed:
            self.barrier("teardown")  # every rank is done with this stage before roundel stops
        super().teardown()
        if self._owns_runtime and not failed and hvd.is_initialized():
            hvd.shutdown()  # the next fit/validate/test of this Trainer joins again
        self._owns_runtime = False

    @classmethod
    def register_strategies(cls, strategy_registry) -> None:
        strategy_registry.register(cls.strategy_name, cls,
                                   description="data-parallel training on roundel's ranks (Horovod's model)")


class _AllGather(torch.autograd.Function):
    """allgather whose backward gives each rank the sum, over the ranks, of the gradient for its rows."""

    @staticmethod
    def forward(ctx, tensor: Tensor, process_set) -> Tensor:
        ctx.process_set = process_set
        return hvd.allgather(tensor.unsqueeze(0).contiguous(), process_set=process_set)

    @staticmethod
    def backward(ctx, grad: Tensor):
        summed = hvd.allreduce(grad.contiguous(), op=ReduceOp.Sum, process_set=ctx.process_set)
        return summed[ctx.process_set.rank()], None
