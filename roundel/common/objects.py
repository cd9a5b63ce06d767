"""Python objects across ranks: ``broadcast_object`` and ``allgather_object``, for every adapter.

An object is pickled with protocol 5 and its large buffers (NumPy arrays,
tensors' storage) taken out of band, so they are copied once into the message
instead of through the pickle stream, and unpickled as views of the received
bytes. Every message, and the size record sent ahead of it, is sealed with the
job's key for this generation, name and call (:mod:`roundel.common.object_auth`)
and checked before anything is allocated or unpickled.

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
_SIZE_RECORD_BYTES = _LENGTH.size + object_auth.SEAL_BYTES


class _Seal:
    """What binds one object collective's seals: the job secret, the generation, and this call's number."""

    def __init__(self, runtime, process_set, name: str):
        self.secret = runtime.secret
        self.generation = runtime.prefix
        self.sequence = runtime.next_object_call(process_set.process_set_id, name)
        self.size_name, self.data_name = f"{name}.size", f"{name}.data"

    def size_record(self, sender: int, length: int) -> torch.Tensor:
        """The sealed length of ``sender``'s message, as a uint8 buffer of _SIZE_RECORD_BYTES."""
        field = _LENGTH.pack(length)
        record = field + object_auth.seal(self.secret, self.generation, self.size_name, self.sequence, sender, field)
        return torch.frombuffer(bytearray(record), dtype=torch.uint8)

    def length(self, sender: int, record) -> int:
        """The length in ``sender``'s size record, once its seal checks (nothing is allocated before)."""
        field = object_auth.unseal(self.secret, self.generation, self.size_name, self.sequence, sender, record)
        return _LENGTH.unpack(field)[0]

    def message(self, obj, sender: int) -> torch.Tensor:
        """``obj`` pickled and sealed, as a uint8 buffer."""
        buffers: list = []
        stream = cloudpickle.dumps(obj, protocol=5, buffer_callback=buffers.append)
        views = [b.raw() for b in buffers]
        header = _COUNT.pack(len(views)) + b"".join(_LENGTH.pack(v.nbytes) for v in views) + \
            _LENGTH.pack(len(stream))
        parts = [header, stream, *views]
        message = bytearray(sum(len(p) if isinstance(p, bytes) else p.nbytes for p in parts) + object_auth.SEAL_BYTES)
        offset = 0
        for part in parts:
            size = len(part) if isinstance(part, bytes) else part.nbytes
            message[offset:offset + size] = part
            offset += size
        message[offset:] = object_auth.seal(self.secret, self.generation, self.data_name, self.sequence, sender,
                                            memoryview(message)[:offset])
        return torch.frombuffer(message, dtype=torch.uint8)

    def object(self, sender: int, message: memoryview):
        """The object in ``sender``'s sealed ``message``; RoundelInternalError if the seal fails."""
        payload = object_auth.unseal(self.secret, self.generation, self.data_name, self.sequence, sender, message)
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
    seal = _Seal(runtime, process_set, f"broadcast_object.{name or f'unnamed.{runtime.next_unnamed()}'}")
    is_root = basics.rank() == root_rank
    if is_root:
        message = seal.message(obj, root_rank)
        record = seal.size_record(root_rank, message.numel())
    else:
        record = torch.zeros(_SIZE_RECORD_BYTES, dtype=torch.uint8)
    collectives.blocking(lambda: collectives.broadcast_async(record, root_rank, seal.size_name, process_set,
                                                             in_place=True))
    if not is_root:
        message = torch.empty(seal.length(root_rank, record.numpy().data), dtype=torch.uint8)
    collectives.blocking(lambda: collectives.broadcast_async(message, root_rank, seal.data_name, process_set,
                                                             in_place=True))
    if is_root:
        return obj
    return seal.object(root_rank, message.numpy().data)


def allgather_object(obj, name=None, process_set=global_process_set) -> list:
    """Return the list of every rank's ``obj``, in rank order."""
    runtime = basics.runtime("allgather_object()")
    seal = _Seal(runtime, process_set, f"allgather_object.{name or type(obj).__name__}")
    me = process_set.rank()  # senders are numbered by their rank in the set, as the gathered list is
    sender = -1 if me is None else me
    message = seal.message(obj, sender)
    record = seal.size_record(sender, message.numel())
    records = memoryview(collectives.blocking(
        lambda: collectives.allgather_async(record, seal.size_name, process_set)).numpy())
    sizes = [seal.length(r, records[r * _SIZE_RECORD_BYTES:(r + 1) * _SIZE_RECORD_BYTES])
             for r in range(len(records) // _SIZE_RECORD_BYTES)]
    gathered = memoryview(collectives.blocking(
        lambda: collectives.allgather_async(message, seal.data_name, process_set)).numpy())
    objects, offset = [], 0
    for r, size in enumerate(sizes):
        objects.append(seal.object(r, gathered[offset:offset + size]))
        offset += size
    return objects
