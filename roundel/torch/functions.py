"""Python objects across ranks: ``broadcast_object`` and ``allgather_object``."""

from __future__ import annotations

import io

import cloudpickle
import torch

from roundel.common import basics
from roundel.common.process_sets import global_process_set
from roundel.torch.mpi_ops import allgather, broadcast_, broadcast_async_, synchronize


def _to_bytes_tensor(obj) -> torch.Tensor:
    buffer = io.BytesIO()
    cloudpickle.dump(obj, buffer)
    return torch.frombuffer(bytearray(buffer.getvalue()), dtype=torch.uint8)


def broadcast_object(obj, root_rank=0, name=None, process_set=global_process_set):
    """Return the root rank's ``obj`` on every rank (any object cloudpickle can serialize).

    Without ``name``, calls are matched across ranks by their order since
    ``init()``, so the other ranks may pass any placeholder (such as None).
    """
    name = name or f"unnamed.{basics.runtime('broadcast_object()').next_unnamed()}"
    payload = _to_bytes_tensor(obj) if basics.rank() == root_rank else torch.empty(0, dtype=torch.uint8)
    length = broadcast_(torch.tensor([payload.numel()], dtype=torch.int64), root_rank,
                        name=f"broadcast_object.{name}.size", process_set=process_set)
    if basics.rank() != root_rank:
        payload = torch.empty(int(length.item()), dtype=torch.uint8)
    broadcast_(payload, root_rank, name=f"broadcast_object.{name}.data", process_set=process_set)
    if basics.rank() == root_rank:
        return obj
    return cloudpickle.loads(payload.numpy().tobytes())


def allgather_object(obj, name=None, process_set=global_process_set) -> list:
    """Return the list of every rank's ``obj``, in rank order."""
    name = name or type(obj).__name__
    payload = _to_bytes_tensor(obj)
    sizes = allgather(torch.tensor([payload.numel()], dtype=torch.int64),
                      name=f"allgather_object.{name}.size", process_set=process_set)
    gathered = allgather(payload, name=f"allgather_object.{name}.data", process_set=process_set).numpy()
    objects, offset = [], 0
    for size in sizes.tolist():
        objects.append(cloudpickle.loads(gathered[offset:offset + size].tobytes()))
        offset += size
    return objects


def broadcast_parameters(params, root_rank=0, process_set=global_process_set) -> None:
    """Overwrite parameters/buffers on every rank with the root's, in place.

    ``params`` is a ``state_dict()`` or an iterable of ``(name, tensor)`` such
    as ``model.named_parameters()``. Raises ValueError for anything else.
    """
    if isinstance(params, dict):
        items = sorted(params.items())
    else:
        try:
            items = list(params)
        except TypeError:
            raise ValueError("broadcast_parameters expects a state_dict or (name, tensor) pairs") from None
        if any(not (isinstance(i, tuple) and len(i) == 2) for i in items):
            raise ValueError("broadcast_parameters expects a state_dict or (name, tensor) pairs, as "
                             "model.named_parameters() gives")
    handles = []
    for name, tensor in items:
        if not isinstance(tensor, torch.Tensor):
            raise ValueError(f"broadcast_parameters: '{name}' is a {type(tensor).__name__}, not a tensor")
        target = tensor.data if isinstance(tensor, torch.nn.Parameter) else tensor
        handles.append(broadcast_async_(target, root_rank, name=f"broadcast.param.{name}",
                                        process_set=process_set))
    for handle in handles:
        synchronize(handle)


def _split_tensors(obj, tensors: list):
    """``obj`` with every tensor replaced by a placeholder; the tensors are appended to ``tensors``."""
    if isinstance(obj, torch.Tensor):
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


def broadcast_optimizer_state(optimizer, root_rank=0, process_set=global_process_set) -> None:
    """Give every rank the root's optimizer state and hyper-parameters (works when state is still empty)."""
    is_root = basics.rank() == root_rank
    tensors: list = []
    skeleton = _split_tensors(optimizer.state_dict(), tensors) if is_root else None
    skeleton = broadcast_object(skeleton, root_rank, name="optimizer_state", process_set=process_set)
    if not is_root:
        tensors = []
        slots: list = []
        _collect_slots(skeleton, slots)
        tensors = [torch.empty(s.shape, dtype=s.dtype) for s in sorted(slots, key=lambda s: s.index)]
    handles = [broadcast_async_(t.contiguous() if is_root else t, root_rank, name=f"broadcast.optimizer.{i}",
                                process_set=process_set) for i, t in enumerate(tensors)]
    for handle in handles:
        synchronize(handle)
    if not is_root:
        optimizer.load_state_dict(_join_tensors(skeleton, tensors))


def _collect_slots(obj, slots: list) -> None:
    if isinstance(obj, _TensorSlot):
        slots.append(obj)
    elif isinstance(obj, dict):
        for v in obj.values():
            _collect_slots(v, slots)
    elif isinstance(obj, (list, tuple)):
        for v in obj:
            _collect_slots(v, slots)
