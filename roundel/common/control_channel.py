"""Authenticated, framed connections between each rank's engine and the coordinator.

Only control messages (requests, batches, cache bits) travel here; tensor data
goes through the transport backend. A connection is accepted only from a
process that proves it holds the job's secret (HMAC over a fresh nonce), so
after the handshake frames are trusted and may be pickled.
"""

from __future__ import annotations

import hashlib
import hmac
import os
import pickle
import socket
import struct

_HEADER = struct.Struct("!I")
_NONCE_BYTES = 32
MAX_FRAME = 256 * 1024 * 1024


class ChannelError(ConnectionError):
    """The peer failed the handshake, closed the connection or sent a bad frame."""


def _tune(sock: socket.socket) -> None:
    """No Nagle delay; keepalive so a vanished host is noticed in about 30 s."""
    sock.settimeout(None)
    sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_KEEPALIVE, 1)
    for option, value in (("TCP_KEEPIDLE", 10), ("TCP_KEEPINTVL", 5), ("TCP_KEEPCNT", 4)):
        if hasattr(socket, option):
            sock.setsockopt(socket.IPPROTO_TCP, getattr(socket, option), value)


def _recv_exact(sock: socket.socket, n: int) -> bytes:
    chunks = []
    while n:
        chunk = sock.recv(n)
        if not chunk:
            raise ChannelError("connection closed during the handshake")
        chunks.append(chunk)
        n -= len(chunk)
    return b"".join(chunks)


def _proof(secret: bytes, nonce: bytes, rank: int) -> bytes:
    return hmac.new(secret, nonce + struct.pack("!I", rank), hashlib.sha256).digest()


def accept(listener: socket.socket, secret: bytes, timeout: float) -> tuple[socket.socket, int]:
    """Accept one connection and check its proof of the secret; return it with the peer's rank."""
    sock, _ = listener.accept()
    try:
        sock.settimeout(timeout)
        nonce = os.urandom(_NONCE_BYTES)
        sock.sendall(nonce)
        rank = struct.unpack("!I", _recv_exact(sock, 4))[0]
        proof = _recv_exact(sock, 32)
        if not hmac.compare_digest(proof, _proof(secret, nonce, rank)):
            raise ChannelError("a peer failed to prove it holds the job's secret")
        sock.sendall(b"ok")
        _tune(sock)
        return sock, rank
    except (OSError, struct.error) as exc:
        sock.close()
        raise ChannelError(str(exc)) from exc


def connect(host: str, port: int, secret: bytes, rank: int, timeout: float) -> socket.socket:
    """Connect to the coordinator and prove this rank holds the job's secret."""
    sock = socket.create_connection((host, port), timeout=timeout)
    try:
        nonce = _recv_exact(sock, _NONCE_BYTES)
        sock.sendall(struct.pack("!I", rank) + _proof(secret, nonce, rank))
        if _recv_exact(sock, 2) != b"ok":
            raise ChannelError("the coordinator refused this rank's handshake")
        _tune(sock)
        return sock
    except BaseException:
        sock.close()
        raise


def send(sock: socket.socket, message) -> None:
    """Send one message as a length-prefixed frame."""
    payload = pickle.dumps(message, protocol=pickle.HIGHEST_PROTOCOL)
    sock.sendall(_HEADER.pack(len(payload)) + payload)


class FrameReader:
    """Reassembles frames from whatever chunks a non-blocking read returns."""

    def __init__(self):
        self._buffer = bytearray()

    def feed(self, data: bytes) -> list:
        """Add received bytes; return the complete messages now available."""
        self._buffer += data
        messages = []
        while len(self._buffer) >= _HEADER.size:
            (length,) = _HEADER.unpack_from(self._buffer)
            if length > MAX_FRAME:
                raise ChannelError(f"control frame of {length} bytes exceeds the {MAX_FRAME}-byte limit")
            end = _HEADER.size + length
            if len(self._buffer) < end:
                break
            messages.append(pickle.loads(bytes(self._buffer[_HEADER.size:end])))
            del self._buffer[:end]
        return messages
