"""The rendezvous store's wire: handshake, authenticated frames and bounded socket I/O.

Handshake (both sides prove they hold the job's secret, nothing else is parsed):
the server sends a 32-byte random nonce ``ns``; the client answers
``HMAC-SHA256(secret, b"client" + ns)`` and its own 32-byte nonce ``nc``; the
server checks the proof (dropping the connection on mismatch) and answers
``HMAC-SHA256(secret, b"server" + nc)``, which the client checks.

Both sides then derive one session key per direction,
``HMAC-SHA256(secret, b"roundel-rendezvous c2s" + ns + nc)`` and the same with
``s2c``. Every later frame is ``!I`` body length, the body, and a 32-byte tag
``HMAC-SHA256(direction key, !Q sequence number + length + body)``; sequence
numbers count frames per direction from 0 and are never sent, so a tampered,
replayed, reordered or dropped frame fails its check. Only a frame whose tag
checks is handed on to be parsed.
"""

from __future__ import annotations

import hashlib
import hmac
import secrets
import socket
import struct
import threading
import time

NONCE_BYTES = 32
TAG_BYTES = 32
# A frame in flight must keep moving: FRAME_DEADLINE_S for its first bytes and
# one more second per MIN_TRANSFER_RATE bytes of body.
FRAME_DEADLINE_S = 10.0
MIN_TRANSFER_RATE = 1024 * 1024
# TCP liveness probes on authenticated connections: an idle peer that vanished
# is noticed after about KEEPALIVE_IDLE_S + KEEPALIVE_INTERVAL_S * KEEPALIVE_COUNT
# seconds, and unacknowledged data is given up after USER_TIMEOUT_S.
KEEPALIVE_IDLE_S = 5
KEEPALIVE_INTERVAL_S = 5
KEEPALIVE_COUNT = 3
USER_TIMEOUT_S = 20

_LENGTH = struct.Struct("!I")
_SEQUENCE = struct.Struct("!Q")


class IntegrityError(ConnectionError):
    """A frame's tag did not check: it was tampered with, replayed, reordered or corrupted."""


class PeerClosed(ConnectionError):
    """The peer closed the connection between frames."""


def proof(secret: bytes, role: bytes, nonce: bytes) -> bytes:
    """The handshake proof that the side named ``role`` holds ``secret``."""
    return hmac.new(secret, role + nonce, hashlib.sha256).digest()


def session_keys(secret: bytes, server_nonce: bytes, client_nonce: bytes) -> tuple[bytes, bytes]:
    """(client-to-server key, server-to-client key) of one connection."""
    nonces = server_nonce + client_nonce
    return (hmac.new(secret, b"roundel-rendezvous c2s" + nonces, hashlib.sha256).digest(),
            hmac.new(secret, b"roundel-rendezvous s2c" + nonces, hashlib.sha256).digest())


def transfer_allowance(nbytes: int) -> float:
    """Seconds a frame of ``nbytes`` may take to cross the wire, on top of FRAME_DEADLINE_S."""
    return nbytes / MIN_TRANSFER_RATE


def recv_exact(sock: socket.socket, n: int, deadline: float | None) -> bytes:
    """Read exactly ``n`` bytes before ``deadline`` (time.monotonic; None: no limit).

    Raises TimeoutError when the deadline passes (however slowly bytes trickle
    in) and ConnectionError when the peer closes first.
    """
    buf = bytearray()
    while len(buf) < n:
        if deadline is not None:
            left = deadline - time.monotonic()
            if left <= 0:
                raise TimeoutError(f"received {len(buf)} of {n} bytes before the deadline")
            sock.settimeout(left)
        else:
            sock.settimeout(None)
        chunk = sock.recv(min(n - len(buf), 1 << 20))
        if not chunk:
            raise ConnectionError(f"peer closed the connection after {len(buf)} of {n} bytes")
        buf += chunk
    return bytes(buf)


def enable_liveness_probes(sock: socket.socket) -> None:
    """Turn on TCP keepalive and TCP_USER_TIMEOUT (where the OS has them) on ``sock``."""
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_KEEPALIVE, 1)
    for name, value in (("TCP_KEEPIDLE", KEEPALIVE_IDLE_S), ("TCP_KEEPINTVL", KEEPALIVE_INTERVAL_S),
                        ("TCP_KEEPCNT", KEEPALIVE_COUNT), ("TCP_USER_TIMEOUT", USER_TIMEOUT_S * 1000)):
        option = getattr(socket, name, None)
        if option is not None:
            sock.setsockopt(socket.IPPROTO_TCP, option, value)


class Channel:
    """One authenticated connection: tagged, sequenced frames each way. Not thread-safe."""

    def __init__(self, sock: socket.socket, send_key: bytes, recv_key: bytes):
        self.sock = sock
        self._send_key = send_key
        self._recv_key = recv_key
        self._send_seq = 0
        self._recv_seq = 0

    def _tag(self, key: bytes, seq: int, length: bytes, body: bytes) -> bytes:
        mac = hmac.new(key, _SEQUENCE.pack(seq) + length, hashlib.sha256)
        mac.update(body)
        return mac.digest()

    def send(self, body: bytes) -> None:
        """Send one frame, giving up (TimeoutError) if it does not leave within its deadline."""
        length = _LENGTH.pack(len(body))
        tag = self._tag(self._send_key, self._send_seq, length, body)
        self._send_seq += 1
        self.sock.settimeout(FRAME_DEADLINE_S + transfer_allowance(len(body)))
        self.sock.sendall(length + body + tag)

    def receive(self, max_bytes: int, first_byte_timeout: float | None) -> bytes:
        """The body of the next frame, once its tag checks.

        Waits up to ``first_byte_timeout`` seconds (None: indefinitely) for the
        frame to begin; then the whole frame must arrive within its deadline.
        Raises PeerClosed on a clean close between frames, IntegrityError on a
        bad tag, ValueError for a frame over ``max_bytes``, TimeoutError and
        ConnectionError as the socket does.
        """
        self.sock.settimeout(first_byte_timeout)
        first = self.sock.recv(1)
        if not first:
            raise PeerClosed("peer closed the connection")
        deadline = time.monotonic() + FRAME_DEADLINE_S
        length = first + recv_exact(self.sock, _LENGTH.size - 1, deadline)
        (size,) = _LENGTH.unpack(length)
        if size > max_bytes:
            raise ValueError(f"frame of {size} bytes exceeds the limit of {max_bytes}")
        rest = recv_exact(self.sock, size + TAG_BYTES, deadline + transfer_allowance(size))
        body, tag = rest[:size], rest[size:]
        if not hmac.compare_digest(tag, self._tag(self._recv_key, self._recv_seq, length, body)):
            raise IntegrityError("a frame failed its integrity check (tampered, replayed or corrupted)")
        self._recv_seq += 1
        return body

    def close(self) -> None:
        """Shut the connection down and release the socket."""
        try:
            self.sock.shutdown(socket.SHUT_RDWR)
        except OSError:
            pass
        self.sock.close()


class PendingConnections:
    """Accepted connections that have not yet sent their first message, at most ``limit`` of them.

    When full, admitting another evicts the one waiting the longest (shut
    down, which wakes the thread serving it): a real client answers at once,
    so connections held silent by someone else make way for it instead of
    keeping it out. Thread-safe.
    """

    def __init__(self, limit: int):
        self._limit = limit
        self._lock = threading.Lock()
        self._waiting: dict[socket.socket, None] = {}  # oldest first

    def admit(self, sock: socket.socket) -> bool:
        """Track ``sock``; True if the oldest waiting connection was evicted to make room."""
        with self._lock:
            evicted = len(self._waiting) >= self._limit
            if evicted:
                oldest = next(iter(self._waiting))
                del self._waiting[oldest]
                try:  # under the lock, so its thread has not closed it yet (see answered)
                    oldest.shutdown(socket.SHUT_RDWR)
                except OSError:
                    pass
            self._waiting[sock] = None
        return evicted

    def answered(self, sock: socket.socket) -> bool:
        """Stop tracking ``sock`` (its first message came, or it failed); False if it was evicted."""
        with self._lock:
            if sock not in self._waiting:
                return False
            del self._waiting[sock]
            return True


class ServerRefused(ConnectionError):
    """The server closed the connection before it sent its nonce (busy or stopping)."""


class SecretRejected(ConnectionError):
    """The server closed the connection after checking this client's proof."""


class ImpostorServer(ConnectionError):
    """The peer could not prove that it holds the job's secret."""


def server_handshake(sock: socket.socket, secret: bytes, deadline: float,
                     pending: PendingConnections | None = None) -> Channel | None:
    """Run the server's side; a Channel, or None if the client's proof is wrong.

    The whole exchange must finish before ``deadline``: TimeoutError otherwise.
    With ``pending``, ``sock`` is tracked there until the client's answer comes
    (ConnectionError if it was evicted first).
    """
    nonce = secrets.token_bytes(NONCE_BYTES)
    sock.settimeout(max(0.001, deadline - time.monotonic()))
    try:
        sock.sendall(nonce)
        answer = recv_exact(sock, TAG_BYTES + NONCE_BYTES, deadline)
    finally:
        evicted = pending is not None and not pending.answered(sock)
    if evicted:
        raise ConnectionError("evicted to make room for a newer connection before it answered")
    if not hmac.compare_digest(answer[:TAG_BYTES], proof(secret, b"client", nonce)):
        return None
    client_nonce = answer[TAG_BYTES:]
    sock.settimeout(max(0.001, deadline - time.monotonic()))
    sock.sendall(proof(secret, b"server", client_nonce))
    to_server, to_client = session_keys(secret, nonce, client_nonce)
    return Channel(sock, to_client, to_server)


def client_handshake(sock: socket.socket, secret: bytes, deadline: float) -> Channel:
    """Run the client's side; a Channel once both proofs check.

    Raises ServerRefused, SecretRejected, ImpostorServer, TimeoutError or OSError.
    """
    try:
        server_nonce = recv_exact(sock, NONCE_BYTES, deadline)
    except ConnectionError as exc:
        raise ServerRefused(str(exc)) from None
    nonce = secrets.token_bytes(NONCE_BYTES)
    sock.settimeout(max(0.001, deadline - time.monotonic()))
    sock.sendall(proof(secret, b"client", server_nonce) + nonce)
    try:
        answer = recv_exact(sock, TAG_BYTES, deadline)
    except ConnectionError as exc:
        raise SecretRejected(str(exc)) from None
    if not hmac.compare_digest(answer, proof(secret, b"server", nonce)):
        raise ImpostorServer("the server's proof is wrong")
    to_server, to_client = session_keys(secret, server_nonce, nonce)
    return Channel(sock, to_server, to_client)
