"""``SyncBatchNorm``: batch normalization with statistics taken over every rank's batch.

In training mode each rank reduces its batch to per-channel sums, one
allreduce adds them up across the process set, and every rank normalizes its
own slice with the statistics of the whole (concatenated) batch. The backward
pass does the same with the per-channel sums the input gradient needs, so the
gradients are those of one process running ``torch.nn.BatchNorm*`` on the whole
batch. In eval mode with running statistics the layer is plain batch norm and
does not communicate.

Collectives are named ``SyncBatchNorm.<set id>.<layer index>.<what>``. A layer
gets its index the first time it communicates, counting the layers of its
process set in the order they first run, so ranks that run the same model in
the same order agree on the names without any setup. The names stay the same
from step to step (every call waits for its collective, so no two calls of one
layer are ever in flight together), which keeps them in the response cache.
"""

from __future__ import annotations

import itertools
import threading

import torch
import torch.nn.functional as F
from torch.nn.modules.batchnorm import _BatchNorm

from roundel.ops import ReduceOp
from roundel.common.process_sets import global_process_set
from roundel.torch import mpi_ops

__all__ = ["SyncBatchNorm"]

_layer_counters: dict[int, "itertools.count[int]"] = {}
_layer_counters_lock = threading.Lock()


def _next_layer_index(process_set_id: int) -> int:
    with _layer_counters_lock:
        counter = _layer_counters.setdefault(process_set_id, itertools.count())
        return next(counter)


def _compute_dtype(dtype: torch.dtype) -> torch.dtype:
    """float64 for float64 input, float32 for every other floating type (half, bfloat16, float32)."""
    return torch.float64 if dtype == torch.float64 else torch.float32


def _reduce_dims(x: torch.Tensor) -> list[int]:
    return [0] + list(range(2, x.dim()))


def _channel_view(t: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
    """``t`` (shape ``(C,)``) shaped to broadcast against ``x`` (shape ``(N, C, ...)``)."""
    return t.reshape((1, -1) + (1,) * (x.dim() - 2))


def _sum_across(packed: torch.Tensor, name: str, process_set) -> torch.Tensor:
    """``packed`` added up over the ranks of ``process_set`` (a new tensor)."""
    return mpi_ops.synchronize(mpi_ops.allreduce_async(packed, name=name, op=ReduceOp.Sum,
                                                       process_set=process_set))


def _global_stats(x: torch.Tensor, name: str, process_set):
    """Per-channel mean and biased variance over every rank's ``x``, and the total count per channel.

    Each rank packs ``[count, sum, sum of squares]`` in float64; the sum of
    squares is built from the local mean and centred second moment, so the
    subtraction that turns it back into a variance loses only float64 digits,
    not the local data's. Returns ``(mean, var, count)``, all float64 tensors
    on ``x``'s device (``count`` of one element): nothing here waits for the
    device, except on a rank whose own batch has at most one value per channel,
    which reads the total to check it.
    """
    channels = x.shape[1]
    count = x.numel() // channels if channels else 0
    if count > 0:
        var, mean = torch.var_mean(x.detach().to(_compute_dtype(x.dtype)), dim=_reduce_dims(x), correction=0)
        mean, var = mean.double(), var.double()
    else:  # this rank's batch is empty: it contributes nothing but still takes part
        mean = var = torch.zeros(channels, dtype=torch.float64, device=x.device)
    packed = torch.cat([torch.full((1,), float(count), dtype=torch.float64, device=x.device),
                        mean * count, (var + mean * mean) * count])
    total = _sum_across(packed, name, process_set)
    total_count = total[:1]
    if count <= 1:  # with more values here the total has more too, and need not be read
        seen = total[0].item()
        if seen <= 1:
            raise ValueError(f"SyncBatchNorm expected more than 1 value per channel when training, got "
                             f"{int(seen)} over all ranks (this rank's input has size {list(x.shape)})")
    mean = total[1:channels + 1] / total_count
    var = (total[channels + 1:] / total_count - mean * mean).clamp_(min=0)
    return mean, var, total_count


class _SyncBatchNormFunction(torch.autograd.Function):
    """Normalize with given global statistics; the backward pass reduces its per-channel sums globally."""

    @staticmethod
    def forward(ctx, x, weight, bias, mean, invstd, total_count, name, process_set):
        compute = _compute_dtype(x.dtype)
        x_hat = (x.to(compute) - _channel_view(mean, x)) * _channel_view(invstd, x)
        out = x_hat
        if weight is not None:
            out = out * _channel_view(weight.to(compute), x)
        if bias is not None:
            out = out + _channel_view(bias.to(compute), x)
        ctx.save_for_backward(x, weight, mean, invstd)
        ctx.total_count = total_count
        ctx.name = name
        ctx.process_set = process_set
        ctx.has_bias = bias is not None
        return out.to(x.dtype)

    @staticmethod
    def backward(ctx, grad_output):
        x, weight, mean, invstd = ctx.saved_tensors
        compute = mean.dtype
        dims = _reduce_dims(x)
        dy = grad_output.to(compute)
        x_hat = (x.to(compute) - _channel_view(mean, x)) * _channel_view(invstd, x)
        sum_dy = dy.sum(dim=dims)
        sum_dy_xhat = (dy * x_hat).sum(dim=dims)

        # Every rank reduces, even one that needs no input gradient itself: the
        # others' input gradients depend on its sums.
        channels = mean.numel()
        total = _sum_across(torch.cat([sum_dy, sum_dy_xhat]).double(), ctx.name, ctx.process_set)
        grad_input = None
        if ctx.needs_input_grad[0]:
            mean_dy = (total[:channels] / ctx.total_count).to(compute)
            mean_dy_xhat = (total[channels:] / ctx.total_count).to(compute)
            scale = invstd if weight is None else invstd * weight.to(compute)
            grad_input = ((dy - _channel_view(mean_dy, x) - x_hat * _channel_view(mean_dy_xhat, x))
                          * _channel_view(scale, x)).to(x.dtype)

        grad_weight = sum_dy_xhat.to(weight.dtype) if weight is not None and ctx.needs_input_grad[1] else None
        grad_bias = sum_dy.to(weight.dtype if weight is not None else x.dtype) \
            if ctx.has_bias and ctx.needs_input_grad[2] else None
        return grad_input, grad_weight, grad_bias, None, None, None, None, None


class SyncBatchNorm(_BatchNorm):
    """Batch normalization over the union of the batches of every rank in ``process_set``.

    A drop-in replacement for ``torch.nn.BatchNorm1d/2d/3d`` (and Horovod's
    ``hvd.SyncBatchNorm``): input of shape ``(N, C)`` or ``(N, C, *)``; ranks
    may have different batch sizes, including an empty batch. In training
    mode (and in eval mode when running statistics are not tracked) the batch
    mean and variance are those of all ranks' inputs together, found with one
    allreduce per call; running statistics are updated as ``torch.nn.BatchNorm``
    updates them from those global statistics (unbiased variance; ``momentum=None``
    means a cumulative average). In eval mode with running statistics the layer
    is plain batch norm and does not communicate. A process set of one rank
    also runs plain batch norm.

    Gradients: the input gradient on each rank is the gradient of the *sum* of
    all ranks' losses with respect to that rank's input, as a single process
    running on the whole batch with the summed loss would get (its backward
    pass allreduces two per-channel sums, so every rank of the set must run
    backward through the layer the same number of times and in the same order).
    ``weight.grad`` and ``bias.grad`` are this rank's local share: summed over the
    ranks they equal that single process's gradients, so after
    ``hvd.DistributedOptimizer`` averages them every parameter in the model
    holds the gradient of the mean of the ranks' losses, consistently.

    Args:
        num_features: ``C``, the number of channels.
        eps: added to the variance for numerical stability.
        momentum: running-statistics factor, or None for a cumulative average.
        affine: learn a per-channel scale and shift.
        track_running_stats: keep running mean and variance for eval mode.
        process_set: the ranks whose batches are normalized together; every
            member must call the layer the same number of times, in the same order.

    Raises:
        ValueError: input with fewer than 2 dimensions, input with the wrong
            number of channels, a process set this rank is not a member of, or
            at most one value per channel over all ranks in training mode.
    """

    def __init__(self, num_features, eps=1e-5, momentum=0.1, affine=True, track_running_stats=True,
                 process_set=global_process_set):
        super().__init__(num_features, eps, momentum, affine, track_running_stats)
        self.process_set = process_set
        self._collective_prefix: str | None = None

    def _check_input_dim(self, input):
        if input.dim() < 2:
            raise ValueError(f"SyncBatchNorm expected 2D or higher input of shape (N, C) or (N, C, *), "
                             f"got {input.dim()}D input of shape {list(input.shape)}")
        if input.shape[1] != self.num_features:
            raise ValueError(f"SyncBatchNorm has {self.num_features} features but the input has "
                             f"{input.shape[1]} channels (shape {list(input.shape)}); dimension 1 is C")

    def _prefix(self) -> str:
        """The stem of this layer's collective names, fixed at its first collective."""
        if self._collective_prefix is None:
            set_id = self.process_set.process_set_id
            self._collective_prefix = f"SyncBatchNorm.{set_id}.{_next_layer_index(set_id)}"
        return self._collective_prefix

    def forward(self, input: torch.Tensor) -> torch.Tensor:
        self._check_input_dim(input)
        size = self.process_set.size()
        if size == 1:
            return super().forward(input)
        if size and self.process_set.included() is False:
            raise ValueError(f"this rank is not a member of {self.process_set!r}, the process set of "
                             "this SyncBatchNorm")

        factor = 0.0 if self.momentum is None else self.momentum
        if self.training and self.track_running_stats and self.num_batches_tracked is not None:
            self.num_batches_tracked.add_(1)
            factor = 1.0 / float(self.num_batches_tracked) if self.momentum is None else self.momentum

        use_batch_stats = self.training or (self.running_mean is None and self.running_var is None)
        if not use_batch_stats:
            return F.batch_norm(input, self.running_mean, self.running_var, self.weight, self.bias, False,
                                0.0, self.eps)

        prefix = self._prefix()
        mean, var, total_count = _global_stats(input, prefix + ".stats", self.process_set)
        if self.training and self.track_running_stats:
            with torch.no_grad():
                unbiased = var * (total_count / (total_count - 1))
                self.running_mean.mul_(1 - factor).add_(mean.to(self.running_mean.dtype), alpha=factor)
                self.running_var.mul_(1 - factor).add_(unbiased.to(self.running_var.dtype), alpha=factor)
        compute = _compute_dtype(input.dtype)
        invstd = torch.rsqrt(var + self.eps).to(compute)
        return _SyncBatchNormFunction.apply(input, self.weight, self.bias, mean.to(compute), invstd,
                                            total_count, prefix + ".grads", self.process_set)
