"""Authentication of the pickled objects ranks send each other (``broadcast_object``, ``allgather_object``).

Gloo moves bytes without authentication, and unpickling bytes runs whatever
code they name. So every sender appends an HMAC-SHA256 tag computed with a
key derived from the job secret, over the collective's name, the sender's rank
and the payload; a receiver checks the tag (in constant time) before it
unpickles anything. Bytes injected or altered on the wire, or sent under
another name or rank, are refused.
"""

from __future__ import annotations

import functools
import hashlib
import hmac
import struct

from roundel.errors import RoundelInternalError

__all__ = ["TAG_BYTES", "tag", "unseal"]

TAG_BYTES = 32
_HEADER = struct.Struct("!qQ")  # sender rank, length of the name


@functools.lru_cache(maxsize=4)
def _object_key(secret: bytes) -> bytes:
    return hmac.new(secret, b"roundel/object-auth/v1", hashlib.sha256).digest()


def tag(secret: bytes, name: str, sender: int, payload) -> bytes:
    """The tag a sender appends to ``payload`` (bytes-like) for the collective ``name`` from rank ``sender``."""
    label = name.encode()
    mac = hmac.new(_object_key(secret), _HEADER.pack(sender, len(label)) + label, hashlib.sha256)
    mac.update(payload)
    return mac.digest()


def unseal(secret: bytes, name: str, sender: int, sealed):
    """The payload of ``sealed`` (payload then tag, bytes-like) once its tag checks out.

    Raises RoundelInternalError, before anything is unpickled, when the tag is
    missing or does not match (bytes not sent by a holder of the job secret).
    """
    payload, received = sealed[:-TAG_BYTES], sealed[-TAG_BYTES:]
    if len(sealed) < TAG_BYTES or not hmac.compare_digest(received, tag(secret, name, sender, payload)):
        raise RoundelInternalError(
            f"object from rank {sender} failed authentication in {name!r}: its bytes were not sent by a "
            "rank of this job (injected or altered on the network?); refusing to unpickle them. Fence "
            "the job's network (see roundel's README, 'Network exposure')")
    return payload
