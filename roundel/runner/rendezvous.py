"""Authenticated key-value store through which a job's workers find each other.

``roundelrun`` runs a :class:`RendezvousServer`; every worker talks to it with a
:class:`RendezvousClient` (directly, or through a ``torch.distributed`` Store
adapter that Gloo calls from its own threads).

Wire protocol (TCP, all integers big-endian):

1. Handshake, proving on both sides that the peer holds the job's secret:
   the server sends a 32-byte random nonce ``ns``; the client answers
   ``HMAC-SHA256(secret, b"client" + ns)`` followed by its own 32-byte nonce
   ``nc``; the server checks it (dropping the connection on mismatch) and
   answers ``HMAC-SHA256(secret, b"server" + nc)``, which the client checks.
2. Requests: header ``!BdII`` (op code, timeout in seconds or -1 for none,
   key length, value length), then the key (UTF-8) and the value.
3. Responses: header ``!BI`` (status, payload length), then the payload.

The server never deserializes anything but these fixed fields; a peer that
fails the handshake, sends a malformed or oversized message, or goes silent
during the handshake is dropped without affecting anyone else.
"""

from __future__ import annotations

import hashlib
import hmac
import logging
import queue
import secrets
import socket
import struct
import threading
import time

from roundel.common.errors import RoundelError

__all__ = [
    "RendezvousClient",
    "RendezvousError",
    "RendezvousServer",
    "RendezvousTimeout",
    "new_secret",
]

log = logging.getLogger(__name__)

MAX_MESSAGE_BYTES = 64 * 1024 * 1024
HANDSHAKE_TIMEOUT_S = 10.0
_NONCE_BYTES = 32

_REQUEST = struct.Struct("!BdII")
_RESPONSE = struct.Struct("!BI")
_I64 = struct.Struct("!q")
_U32 = struct.Struct("!I")

_OP_SET, _OP_GET, _OP_ADD, _OP_CHECK, _OP_DELETE, _OP_NUM_KEYS = range(1, 7)
_OK, _TIMED_OUT, _FAILED = range(3)


class RendezvousError(RoundelError):
    """The rendezvous store could not be reached, refused this client, or failed a request."""


class RendezvousTimeout(RendezvousError, TimeoutError):
    """A blocking ``get`` waited longer than its timeout for a key to appear."""


def new_secret() -> bytes:
    """A fresh random 32-byte job secret (the launcher hands it to workers hex-encoded)."""
    return secrets.token_bytes(32)


def _proof(secret: bytes, role: bytes, nonce: bytes) -> bytes:
    return hmac.new(secret, role + nonce, hashlib.sha256).digest()


def _recv_exact(sock: socket.socket, n: int) -> bytes:
    """Read exactly n bytes; raise ConnectionError if the peer closes first."""
    buf = bytearray()
    while len(buf) < n:
        chunk = sock.recv(min(n - len(buf), 1 << 20))
        if not chunk:
            raise ConnectionError(f"peer closed the connection after {len(buf)} of {n} bytes")
        buf += chunk
    return bytes(buf)


def _pack_keys(keys: list[str]) -> bytes:
    parts = []
    for key in keys:
        raw = key.encode()
        parts.append(_U32.pack(len(raw)) + raw)
    return b"".join(parts)


def _unpack_keys(data: bytes) -> list[str]:
    keys, pos = [], 0
    while pos < len(data):
        (length,) = _U32.unpack_from(data, pos)
        pos += _U32.size
        if pos + length > len(data):
            raise ValueError("truncated key list")
        keys.append(data[pos:pos + length].decode())
        pos += length
    return keys


class RendezvousServer:
    """Key-value store served over TCP to clients that hold ``secret``.

    Each connection is served on its own daemon thread; a blocking ``get``
    waits on a condition variable until the key is set or its timeout passes.
    """

    def __init__(self, secret: bytes, host: str = "127.0.0.1", port: int = 0):
        self._secret = secret
        self.host = host
        self.port = port
        self._data: dict[str, bytes] = {}
        self._cond = threading.Condition()
        self._stopping = False
        self._listener: socket.socket | None = None
        self._accept_thread: threading.Thread | None = None
        self._conns: set[socket.socket] = set()
        self._conns_lock = threading.Lock()

    def start(self) -> int:
        """Bind, start serving in the background, and return the port actually bound."""
        listener = socket.create_server((self.host, self.port), backlog=128)
        self._listener = listener
        self.port = listener.getsockname()[1]
        self._accept_thread = threading.Thread(
            target=self._accept_loop, name="roundel-rendezvous-accept", daemon=True
        )
        self._accept_thread.start()
        return self.port

    def stop(self) -> None:
        """Stop accepting, close every connection and wake every waiting ``get``."""
        with self._cond:
            self._stopping = True
            self._cond.notify_all()
        if self._listener is not None:
            try:
                self._listener.shutdown(socket.SHUT_RDWR)
            except OSError:
                pass
            self._listener.close()
        with self._conns_lock:
            conns = list(self._conns)
        for conn in conns:
            try:
                conn.shutdown(socket.SHUT_RDWR)
            except OSError:
                pass
        if self._accept_thread is not None:
            self._accept_thread.join(timeout=5)

    def set(self, key: str, value: bytes) -> None:
        """Store ``value`` under ``key`` and wake clients waiting for it."""
        with self._cond:
            self._data[key] = bytes(value)
            self._cond.notify_all()

    def get(self, key: str) -> bytes | None:
        """The value under ``key``, or None if it is not set (never blocks)."""
        with self._cond:
            return self._data.get(key)

    def _accept_loop(self) -> None:
        while True:
            try:
                conn, addr = self._listener.accept()
            except OSError:
                return
            if self._stopping:
                conn.close()
                return
            threading.Thread(
                target=self._serve, args=(conn, addr), name="roundel-rendezvous-conn", daemon=True
            ).start()

    def _serve(self, conn: socket.socket, addr) -> None:
        with self._conns_lock:
            self._conns.add(conn)
        try:
            conn.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            conn.settimeout(HANDSHAKE_TIMEOUT_S)
            if not self._handshake(conn):
                log.debug("rendezvous: dropped %s: failed authentication", addr)
                return
            conn.settimeout(None)
            while not self._stopping:
                header = conn.recv(_REQUEST.size, socket.MSG_WAITALL)
                if not header:
                    return
                if len(header) < _REQUEST.size:
                    raise ConnectionError("truncated request header")
                op, timeout, key_len, value_len = _REQUEST.unpack(header)
                if key_len + value_len > MAX_MESSAGE_BYTES:
                    raise ValueError(f"request of {key_len + value_len} bytes exceeds {MAX_MESSAGE_BYTES}")
                key = _recv_exact(conn, key_len).decode()
                value = _recv_exact(conn, value_len)
                status, payload = self._handle(op, timeout, key, value)
                conn.sendall(_RESPONSE.pack(status, len(payload)) + payload)
        except Exception as exc:  # anything a hostile or broken peer can cause
            log.debug("rendezvous: dropped %s: %s", addr, exc)
        finally:
            with self._conns_lock:
                self._conns.discard(conn)
            conn.close()

    def _handshake(self, conn: socket.socket) -> bool:
        nonce = secrets.token_bytes(_NONCE_BYTES)
        conn.sendall(nonce)
        answer = _recv_exact(conn, 32 + _NONCE_BYTES)
        if not hmac.compare_digest(answer[:32], _proof(self._secret, b"client", nonce)):
            return False
        conn.sendall(_proof(self._secret, b"server", answer[32:]))
        return True

    def _handle(self, op: int, timeout: float, key: str, value: bytes) -> tuple[int, bytes]:
        with self._cond:
            if op == _OP_SET:
                self._data[key] = value
                self._cond.notify_all()
                return _OK, b""
            if op == _OP_GET:
                # Negative, infinite or NaN timeouts all mean "wait until set".
                deadline = time.monotonic() + timeout if 0 <= timeout < 1e9 else None
                while key not in self._data and not self._stopping:
                    remaining = None if deadline is None else deadline - time.monotonic()
                    if remaining is not None and remaining <= 0:
                        return _TIMED_OUT, b""
                    self._cond.wait(remaining)
                if self._stopping:
                    return _FAILED, b"the rendezvous server is shutting down"
                return _OK, self._data[key]
            if op == _OP_ADD:
                (amount,) = _I64.unpack(value)
                try:
                    total = int(self._data.get(key, b"0")) + amount
                except ValueError:
                    return _FAILED, f"key {key!r} does not hold an integer counter".encode()
                self._data[key] = str(total).encode()
                self._cond.notify_all()
                return _OK, _I64.pack(total)
            if op == _OP_CHECK:
                present = all(k in self._data for k in _unpack_keys(value))
                return _OK, bytes([present])
            if op == _OP_DELETE:
                return _OK, bytes([self._data.pop(key, None) is not None])
            if op == _OP_NUM_KEYS:
                return _OK, _I64.pack(len(self._data))
        raise ValueError(f"unknown op code {op}")


class RendezvousClient:
    """Client of a :class:`RendezvousServer`; safe to share between threads.

    Requests from concurrent threads go over separate pooled connections, so
    one thread blocked in ``get`` never holds up another.
    Raises RendezvousError if the server cannot be reached within
    ``connect_timeout`` seconds or refuses the secret.
    """

    def __init__(self, host: str, port: int, secret: bytes, connect_timeout: float = 30.0):
        self.host = host
        self.port = port
        self._secret = secret
        self._connect_timeout = connect_timeout
        self._idle: queue.SimpleQueue[socket.socket] = queue.SimpleQueue()
        self._all: set[socket.socket] = set()
        self._lock = threading.Lock()
        self._closed = False
        self._idle.put(self._connect())

    def set(self, key: str, value: bytes) -> None:
        """Store ``value`` under ``key``."""
        self._request(_OP_SET, key, bytes(value))

    def get(self, key: str, timeout: float | None = None) -> bytes:
        """The value under ``key``, waiting until it is set.

        Raises RendezvousTimeout if ``timeout`` seconds pass first.
        """
        wait = -1.0 if timeout is None else max(0.0, float(timeout))
        status, payload = self._request(_OP_GET, key, b"", wait)
        if status == _TIMED_OUT:
            raise RendezvousTimeout(
                f"rendezvous key {key!r} was not set within {wait:g} seconds; "
                "check that every rank of the job started and reached the same point"
            )
        return payload

    def add(self, key: str, amount: int) -> int:
        """Atomically add ``amount`` to the counter under ``key`` (missing = 0); return the new value."""
        return _I64.unpack(self._request(_OP_ADD, key, _I64.pack(amount))[1])[0]

    def check(self, keys: list[str]) -> bool:
        """Whether every one of ``keys`` is set."""
        return self._request(_OP_CHECK, "", _pack_keys(keys))[1] == b"\x01"

    def delete(self, key: str) -> bool:
        """Remove ``key``; return whether it was set."""
        return self._request(_OP_DELETE, key, b"")[1] == b"\x01"

    def num_keys(self) -> int:
        """How many keys the store holds."""
        return _I64.unpack(self._request(_OP_NUM_KEYS, "", b"")[1])[0]

    def close(self) -> None:
        """Close every connection; later requests raise RendezvousError."""
        with self._lock:
            self._closed = True
            conns = list(self._all)
            self._all.clear()
        for conn in conns:
            try:
                conn.shutdown(socket.SHUT_RDWR)
            except OSError:
                pass
            conn.close()

    def _where(self) -> str:
        return f"the rendezvous server at {self.host}:{self.port}"

    def _connect(self) -> socket.socket:
        deadline = time.monotonic() + self._connect_timeout
        delay = 0.05
        while True:
            try:
                sock = socket.create_connection(
                    (self.host, self.port), timeout=max(0.1, deadline - time.monotonic())
                )
                break
            except OSError as exc:
                if time.monotonic() + delay >= deadline:
                    raise RendezvousError(
                        f"could not reach {self._where()} within {self._connect_timeout:g} seconds ({exc}); "
                        "check that roundelrun is still running and that ROUNDEL_RENDEZVOUS_ADDR and "
                        "ROUNDEL_RENDEZVOUS_PORT name an address this host can reach (firewall, network)"
                    ) from None
                time.sleep(delay)
                delay = min(delay * 2, 1.0)
        try:
            sock.settimeout(HANDSHAKE_TIMEOUT_S)
            sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            nonce = secrets.token_bytes(_NONCE_BYTES)
            sock.sendall(_proof(self._secret, b"client", _recv_exact(sock, _NONCE_BYTES)) + nonce)
            try:
                answer = _recv_exact(sock, 32)
            except ConnectionError:
                raise RendezvousError(
                    f"{self._where()} refused this client: the job secret does not match "
                    "(check ROUNDEL_SECRET; it must be the one roundelrun handed to this job)"
                ) from None
            if not hmac.compare_digest(answer, _proof(self._secret, b"server", nonce)):
                raise RendezvousError(f"{self._where()} does not hold this job's secret; refusing to use it")
            sock.settimeout(None)
        except OSError as exc:
            sock.close()
            raise RendezvousError(f"handshake with {self._where()} failed: {exc}") from None
        except RendezvousError:
            sock.close()
            raise
        with self._lock:
            if self._closed:
                sock.close()
                raise RendezvousError("the rendezvous client is closed")
            self._all.add(sock)
        return sock

    def _request(self, op: int, key: str, value: bytes, timeout: float = -1.0) -> tuple[int, bytes]:
        raw_key = key.encode()
        if len(raw_key) + len(value) > MAX_MESSAGE_BYTES:
            raise RendezvousError(f"rendezvous request for key {key!r} exceeds {MAX_MESSAGE_BYTES} bytes")
        if self._closed:
            raise RendezvousError("the rendezvous client is closed")
        try:
            sock = self._idle.get_nowait()
        except queue.Empty:
            sock = self._connect()
        try:
            sock.sendall(_REQUEST.pack(op, timeout, len(raw_key), len(value)) + raw_key + value)
            status, length = _RESPONSE.unpack(_recv_exact(sock, _RESPONSE.size))
            payload = _recv_exact(sock, length)
        except OSError as exc:
            with self._lock:
                self._all.discard(sock)
            sock.close()
            if self._closed:
                raise RendezvousError("the rendezvous client is closed") from None
            raise RendezvousError(f"lost the connection to {self._where()}: {exc}") from None
        self._idle.put(sock)
        if status == _FAILED:
            raise RendezvousError(f"{self._where()} failed the request for key {key!r}: {payload.decode()}")
        return status, payload
