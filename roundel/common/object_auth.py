"""Authentication of the pickled objects ranks send each other (``broadcast_object``, ``allgather_object``).

Gloo moves bytes without authentication, and unpickling bytes runs whatever
code they name. So every sender seals what it sends: it appends the call's
sequence number and an HMAC-SHA256 tag, computed with a key derived from the
job secret, over the job generation (the ``init()`` or elastic generation),
the collective's name, that sequence number (the how-many-th call of that
name since ``init()``), the sender's rank and the payload. A receiver checks
the tag (in constant time) against the generation and sequence number it
expects before it uses anything. Bytes injected or altered on the wire, sent
under another name or rank, or replayed from an earlier call or generation
are refused.
"""

from __future__ import annotations

import functools
import hmac
import struct

from roundel import authwire
from roundel.errors import RoundelInternalError

__all__ = ["SEAL_BYTES", "seal", "unseal"]

_SEQUENCE = struct.Struct("!Q")
SEAL_BYTES = _SEQUENCE.size + authwire.TAG_BYTES
"""Bytes a seal adds after the payload: the sequence number, then the tag."""
_CONTEXT = struct.Struct("!qQQQ")  # sender rank, sequence number, lengths of the generation and the name


@functools.lru_cache(maxsize=4)
def _object_key(secret: bytes) -> bytes:
    return authwire.mac(secret, b"roundel/object-auth/v2")


def _tag(secret: bytes, generation: str, name: str, sequence: int, sender: int, payload) -> bytes:
    generation_label, label = generation.encode(), name.encode()
    return authwire.mac(_object_key(secret), _CONTEXT.pack(sender, sequence, len(generation_label), len(label)),
                        generation_label, label, payload)


def seal(secret: bytes, generation: str, name: str, sequence: int, sender: int, payload) -> bytes:
    """The SEAL_BYTES a sender appends to ``payload`` (bytes-like) for call ``sequence`` of ``name``."""
    return _SEQUENCE.pack(sequence) + _tag(secret, generation, name, sequence, sender, payload)


def unseal(secret: bytes, generation: str, name: str, sequence: int, sender: int, sealed):
    """The payload of ``sealed`` (payload then seal, bytes-like) once its seal checks out for this call.

    Raises RoundelInternalError, before anything is used, when the seal is
    missing or wrong, or was made for another call of ``name`` (a replay).
    """
    if len(sealed) >= SEAL_BYTES:
        payload, trailer = sealed[:-SEAL_BYTES], sealed[-SEAL_BYTES:]
        (claimed,) = _SEQUENCE.unpack_from(trailer)
        received = bytes(trailer[_SEQUENCE.size:])
        if claimed == sequence and hmac.compare_digest(received, _tag(secret, generation, name, sequence, sender,
                                                                      payload)):
            return payload
        if claimed != sequence and hmac.compare_digest(received, _tag(secret, generation, name, claimed, sender,
                                                                      payload)):
            raise RoundelInternalError(
                f"object from rank {sender} in {name!r} was replayed: it was sent for call {claimed} of that "
                f"name, and this is call {sequence}; refusing to unpickle it (old bytes injected on the "
                "network?). Fence the job's network (see docs/security.md in roundel's repository, 'Network exposure')")
    raise RoundelInternalError(
        f"object from rank {sender} failed authentication in {name!r}: its bytes were not sent by a rank of "
        "this job for this call (injected or altered on the network, or replayed from an earlier init() or "
        "elastic generation?); refusing to unpickle them. Fence the job's network (see docs/security.md "
        "in roundel's repository, 'Network exposure')")
