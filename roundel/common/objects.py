"""Python objects across ranks: ``broadcast_object`` and ``allgather_object``, for every adapter.

An object is pickled with protocol 5 and its large buffers (NumPy arrays,
tensors' storage) taken out of band, so they are copied once into the message
instead of through the pickle stream, and unpickled as views of the received
bytes. Every message is sealed with the job's key (:mod:`roundel.common.object_auth`)
and checked before anything is unpickled.

Message layout: the number of out-of-band buffers, each one's length, the
pickle stream's length, then the pickle stream and the buffers, back to back.
"""

from __future__ import annotations

import pickle
import struct

import cloudpickle
import torch

from roundel.common import basics, collectives, object_auth
from roundel.common.process_sets import global_process_set

__all__ = ["allgather_object", "broadcast_object"]

_COUNT = struct.Struct("!I")
_LENGTH = struct.Struct("!Q")


def _message(obj, secret: bytes, name: str, sender: int) -> torch.Tensor:
    """``obj`` pickled and sealed for collective ``name`` from rank ``sender``, as a uint8 buffer."""
    buffers: list = []
    stream = cloudpickle.dumps(obj, protocol=5, buffer_callback=buffers.append)
    views = [b.raw() for b in buffers]
    header = _COUNT.pack(len(views)) + b"".join(_LENGTH.pack(v.nbytes) for v in views) + \
        _LENGTH.pack(len(stream))
    parts = [header, stream, *views]
    message = bytearray(sum(len(p) if isinstance(p, bytes) else p.nbytes for p in parts) + object_auth.TAG_BYTES)
    offset = 0
    for part in parts:
        size = len(part) if isinstance(part, bytes) else part.nbytes
        message[offset:offset + size] = part
        offset += size
    message[offset:] = object_auth.tag(secret, name, sender, memoryview(message)[:offset])
    return torch.frombuffer(message, dtype=torch.uint8)


def _object(message: memoryview, secret: bytes, name: str, sender: int):
    """The object in a sealed ``message`` from rank ``sender``; RoundelInternalError if it fails authentication."""
    payload = object_auth.unseal(secret, name, sender, message)
    (count,) = _COUNT.unpack_from(payload, 0)
    offset = _COUNT.size
    lengths = [_LENGTH.unpack_from(payload, offset + i * _LENGTH.size)[0] for i in range(count + 1)]
    offset += (count + 1) * _LENGTH.size
    stream = payload[offset:offset + lengths[-1]]
    offset += lengths[-1]
    buffers = []
    for length in lengths[:-1]:
        buffers.append(payload[offset:offset + length])
        offset += length
    return pickle.loads(stream, buffers=buffers)


def broadcast_object(obj, root_rank=0, name=None, process_set=global_process_set):
    """Return the root rank's ``obj`` on every rank (any object cloudpickle can serialize).

    Without ``name``, calls are matched across ranks by their order since
    ``init()``, so the other ranks may pass any placeholder (such as None).
    """
    runtime = basics.runtime("broadcast_object()")
    name = name or f"unnamed.{runtime.next_unnamed()}"
    data_name = f"broadcast_object.{name}.data"
    is_root = basics.rank() == root_rank
    message = _message(obj, runtime.secret, data_name, root_rank) if is_root else torch.empty(0, dtype=torch.uint8)
    length = collectives.synchronize(collectives.broadcast_async(
        torch.tensor([message.numel()], dtype=torch.int64), root_rank, f"broadcast_object.{name}.size",
        process_set, in_place=True))
    if not is_root:
        message = torch.empty(int(length.item()), dtype=torch.uint8)
    collectives.synchronize(collectives.broadcast_async(message, root_rank, data_name, process_set, in_place=True))
    if is_root:
        return obj
    return _object(memoryview(message.numpy()), runtime.secret, data_name, root_rank)


def allgather_object(obj, name=None, process_set=global_process_set) -> list:
    """Return the list of every rank's ``obj``, in rank order."""
    runtime = basics.runtime("allgather_object()")
    name = name or type(obj).__name__
    data_name = f"allgather_object.{name}.data"
    me = process_set.rank()  # senders are numbered by their rank in the set, as the gathered list is
    message = _message(obj, runtime.secret, data_name, -1 if me is None else me)
    sizes = collectives.synchronize(collectives.allgather_async(
        torch.tensor([message.numel()], dtype=torch.int64), f"allgather_object.{name}.size", process_set))
    gathered = memoryview(collectives.synchronize(
        collectives.allgather_async(message, data_name, process_set)).numpy())
    objects, offset = [], 0
    for sender, size in enumerate(sizes.tolist()):
        objects.append(_object(gathered[offset:offset + size], runtime.secret, data_name, sender))
        offset += size
    return objects
