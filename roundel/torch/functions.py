"""Model and optimizer state across ranks: parameters, optimizer state, and (from roundel.common) Python objects."""

from __future__ import annotations

import torch

from roundel.common import basics
from roundel.common.objects import allgather_object, broadcast_object
from roundel.common.process_sets import global_process_set
from roundel.torch.mpi_ops import broadcast_async_, synchronize

__all__ = ["allgather_object", "broadcast_object", "broadcast_optimizer_state", "broadcast_parameters"]


def broadcast_parameters(params, root_rank=0, process_set=global_process_set) -> None:
    """Overwrite parameters/buffers on every rank with the root's, in place.

    ``params`` is a ``state_dict()``, or an iterable (list or generator) of
    ``(name, tensor)`` pairs such as ``model.named_parameters()``, of tensors
    such as ``model.parameters()``, or a mix. Raises ValueError for anything else.
    """
    if isinstance(params, dict):
        items = sorted(params.items())
    else:
        try:
            items = list(params)
        except TypeError:
            raise ValueError(f"broadcast_parameters expects a state_dict, (name, tensor) pairs or a list of "
                             f"tensors, not {type(params).__name__}") from None
        # a bare tensor is named by its position, which is the same on every rank
        items = [item if isinstance(item, tuple) and len(item) == 2 else (f"#{i}", item)
                 for i, item in enumerate(items)]
    handles = []
    for name, tensor in items:
        if not isinstance(tensor, torch.Tensor):
            raise ValueError(f"broadcast_parameters: '{name}' is a {type(tensor).__name__}, not a tensor")
        target = tensor.data if tensor.requires_grad else tensor
        handles.append(broadcast_async_(target, root_rank, name=f"broadcast.param.{name}",
                                        process_set=process_set))
    for handle in handles:
        synchronize(handle)


def _split_tensors(obj, tensors: list):
    """``obj`` with every tensor replaced by a placeholder; the tensors are appended to ``tensors``."""
    if isinstance(obj, torch.Tensor) and obj.layout == torch.strided:  # sparse state travels pickled
        tensors.append(obj)
        return _TensorSlot(len(tensors) - 1, tuple(obj.shape), obj.dtype)
    if isinstance(obj, dict):
        return {k: _split_tensors(v, tensors) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return type(obj)(_split_tensors(v, tensors) for v in obj)
    return obj


def _join_tensors(obj, tensors: list):
    if isinstance(obj, _TensorSlot):
        return tensors[obj.index]
    if isinstance(obj, dict):
        return {k: _join_tensors(v, tensors) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return type(obj)(_join_tensors(v, tensors) for v in obj)
    return obj


class _TensorSlot:
    __slots__ = ("index", "shape", "dtype")

    def __init__(self, index, shape, dtype):
        self.index, self.shape, self.dtype = index, shape, dtype

    def __getstate__(self):
        return (self.index, self.shape, self.dtype)

    def __setstate__(self, state):
        self.index, self.shape, self.dtype = state


def _sparse_parameters(model) -> set:
    """The parameters of ``model``'s sparse embeddings (their gradients are sparse)."""
    if model is None:
        return set()
    return {p for m in model.modules() if isinstance(m, torch.nn.Embedding) and m.sparse for p in m.parameters()}


def _create_state(optimizer, model) -> None:
    """Give an optimizer with empty state its state, as Horovod does: one step on zero gradients.

    Each trainable parameter's gradient becomes zeros (sparse for
    ``SparseAdam`` and for ``model``'s sparse embeddings under ``SGD``) and is
    left so; the update of a ``DistributedOptimizer`` runs without reducing.
    Unlike Horovod, the parameters are put back afterwards, so that weight
    decay in that step cannot move the ranks whose state was empty away from
    the others.
    """
    sparse = _sparse_parameters(model)
    kept = [(p, p.detach().clone()) for group in optimizer.param_groups for p in group["params"]]
    for group in optimizer.param_groups:
        for p in group["params"]:
            if p.requires_grad:
                p.grad = torch.zeros_like(p)
                if isinstance(optimizer, torch.optim.SparseAdam) or (
                        isinstance(optimizer, torch.optim.SGD) and p in sparse):
                    p.grad = p.grad.to_sparse()
    step = getattr(optimizer, "_local_step", None) or optimizer.step  # a DistributedOptimizer's own update
    step()
    with torch.no_grad():
        for p, value in kept:
            p.copy_(value)


def broadcast_optimizer_state(optimizer, root_rank=0, model=None, process_set=global_process_set) -> None:
    """Give every rank the root's optimizer state and hyper-parameters.

    An optimizer whose state is still empty first gets it as in Horovod, by
    one update with zero gradients (``model``, optional, names the sparse
    embeddings whose gradients are sparse); then every rank loads the root's
    state. Unlike Horovod, hyper-parameters (learning rate, ...) are broadcast
    even for an optimizer without state, such as plain SGD. Raises ValueError
    for ``torch.optim.LBFGS``, whose state cannot be broadcast.
    """
    if isinstance(optimizer, torch.optim.LBFGS):
        raise ValueError("cannot broadcast torch.optim.LBFGS state (it holds closures and history); "
                         "construct it identically on every rank instead")
    if getattr(optimizer, "_roundel_sharded", False):  # shard_optimizer_state=True: gather, then as below
        full = broadcast_state_dict(optimizer.state_dict(), root_rank, process_set)
        optimizer.load_state_dict(full)
        return
    if not optimizer.state_dict()["state"]:
        _create_state(optimizer, model)
    is_root = basics.rank() == root_rank
    full = broadcast_state_dict(optimizer.state_dict() if is_root else None, root_rank, process_set)
    if not is_root:
        optimizer.load_state_dict(full)


def broadcast_state_dict(state_dict, root_rank=0, process_set=global_process_set) -> dict:
    """The root's ``state_dict`` (nested dicts and lists with tensors) on every rank; others pass anything.

    Tensors travel as broadcasts, the rest pickled; returns the root's own dict on the root.
    """
    is_root = basics.rank() == root_rank
    tensors: list = []
    skeleton = _split_tensors(state_dict, tensors) if is_root else None
    skeleton = broadcast_object(skeleton, root_rank, name="optimizer_state", process_set=process_set)
    if not is_root:
        slots: list = []
        _collect_slots(skeleton, slots)
        tensors = [torch.empty(s.shape, dtype=s.dtype) for s in sorted(slots, key=lambda s: s.index)]
    handles = [broadcast_async_(t.contiguous() if is_root else t, root_rank, name=f"broadcast.optimizer.{i}",
                                process_set=process_set) for i, t in enumerate(tensors)]
    for handle in handles:
        synchronize(handle)
    return state_dict if is_root else _join_tensors(skeleton, tensors)


def _collect_slots(obj, slots: list) -> None:
    if isinstance(obj, _TensorSlot):
        slots.append(obj)
    elif isinstance(obj, dict):
        for v in obj.values():
            _collect_slots(v, slots)
    elif isinstance(obj, (list, tuple)):
        for v in obj:
            _collect_slots(v, slots)
