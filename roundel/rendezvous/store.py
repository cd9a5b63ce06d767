"""Authenticated key-value store through which a job's workers find each other.

``roundelrun`` runs a :class:`RendezvousServer`; every worker talks to it with a
:class:`RendezvousClient` (directly, or through a ``torch.distributed`` Store
adapter that Gloo calls from its own threads).

Wire protocol (TCP; the handshake and frame tags are ``roundel.authwire``'s, the
framing wire.py's): after a handshake in which both sides prove they hold the
job's secret, each request and response is one frame tagged with a
per-connection, per-direction session key and an implicit sequence number. A
request body is ``!BdI`` (op code, seconds to wait, key length), the key
(UTF-8) and the value; a response body is ``!B`` (status) and the payload.
The server never parses anything but these fixed fields, and only after the
frame's tag checks.

Bounds:

- Server: at most MAX_PENDING_HANDSHAKES connections waiting to prove the
  secret at once; when full, a new one evicts the one waiting longest (a real
  client proves it at once, so connections held open by someone else cannot
  keep it out). Each has FIRST_MESSAGE_S to finish the handshake however
  slowly it sends; a request or response frame, once begun,
  must arrive within wire.FRAME_DEADLINE_S (plus one second per MiB).
  Idle authenticated connections stay open (workers pool them for the whole
  job); TCP keepalive and TCP_USER_TIMEOUT drop those whose peer vanished.
  Failed ``accept`` calls (out of file descriptors, memory) are logged,
  rate-limited, and retried (see ``authwire.accept_loop``).
- Client: every answer is awaited at most RESPONSE_GRACE_S, plus the server-side
  wait of a ``get``; a ``get`` is served as waits of at most GET_POLL_S each,
  so whatever its timeout, a stopped, crashed or unreachable server is
  reported (RendezvousError) within GET_POLL_S + RESPONSE_GRACE_S = 15 s.
  The first connection is retried for ``connect_timeout`` (the server may
  still be starting or be shedding connections; a wrong proof from the server,
  which means the two hold different secrets, is not retried); a later one
  (more threads than pooled connections, or one lost) for at most
  RESPONSE_GRACE_S. TCP keepalive and TCP_USER_TIMEOUT are set on every
  socket.
"""

from __future__ import annotations

import logging
import queue
import secrets
import socket
import struct
import threading
import time
from typing import Callable

from roundel import authwire
from roundel.errors import RoundelError
from roundel.rendezvous import wire
from roundel.retry import Backoff

__all__ = [
    "RendezvousClient",
    "RendezvousError",
    "RendezvousServer",
    "RendezvousTimeout",
    "new_secret",
]

log = logging.getLogger(__name__)

MAX_MESSAGE_BYTES = 64 * 1024 * 1024
HANDSHAKE_TIMEOUT_S = 5.0  # a client's wait for the server's side of the handshake
FIRST_MESSAGE_S = 1.0  # the server's wait for a client's whole side of the handshake
MAX_PENDING_HANDSHAKES = 64
GET_POLL_S = 5.0
RESPONSE_GRACE_S = 10.0
LOG_INTERVAL_S = 10.0

_REQUEST = struct.Struct("!BdI")
_STATUS = struct.Struct("!B")
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
    waits on a condition variable until the key is set or its wait passes.
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
        self._pending = authwire.PendingConnections(MAX_PENDING_HANDSHAKES)
        self._refusals: authwire.RateLimitedLog | None = None
        self._troubles: authwire.RateLimitedLog | None = None
        # Called with (key, value) after each client's set, on that client's thread (roundelrun --verbose).
        self.on_set: Callable[[str, bytes], None] | None = None

    def start(self) -> int:
        """Bind, start serving in the background, and return the port actually bound."""
        # every worker of a job connects at its start: a short accept queue would drop the SYNs of a
        # thousand at once, and each dropped one waits out TCP's retransmission (1, 3, 7 s...)
        listener = socket.create_server((self.host, self.port), backlog=socket.SOMAXCONN)
        self._listener = listener
        self.port = listener.getsockname()[1]
        where = f"roundel rendezvous server on port {self.port}"
        self._refusals = authwire.RateLimitedLog(log, f"{where} refused connections", LOG_INTERVAL_S)
        self._troubles = authwire.RateLimitedLog(log, f"{where} could not accept connections", LOG_INTERVAL_S)
        self._accept_thread = threading.Thread(
            target=authwire.accept_loop, name="roundel-rendezvous-accept", daemon=True,
            args=(listener, self._pending, self._serve, lambda: self._stopping, self._refusals, self._troubles,
                  "roundel-rendezvous-conn"))
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
            for rate_limited in (self._refusals, self._troubles):
                if rate_limited is not None:  # made with the thread
                    rate_limited.flush()

    def set(self, key: str, value: bytes) -> None:
        """Store ``value`` under ``key`` and wake clients waiting for it."""
        with self._cond:
            self._data[key] = bytes(value)
            self._cond.notify_all()

    def get(self, key: str) -> bytes | None:
        """The value under ``key``, or None if it is not set (never blocks)."""
        with self._cond:
            return self._data.get(key)

    def pop(self, key: str) -> bytes | None:
        """Remove ``key`` and return its value, or None if it is not set (never blocks)."""
        with self._cond:
            return self._data.pop(key, None)

    def _serve(self, conn: socket.socket, peer: str) -> None:
        with self._conns_lock:
            self._conns.add(conn)
        try:
            channel = wire.server_handshake(conn, self._secret, time.monotonic() + FIRST_MESSAGE_S, self._pending)
            while not self._stopping:
                try:
                    body = channel.receive(_REQUEST.size + MAX_MESSAGE_BYTES, first_byte_timeout=None)
                except wire.PeerClosed:
                    return
                op, timeout, key, value = self._parse(body)
                status, payload = self._handle(op, timeout, key, value)
                channel.send(_STATUS.pack(status) + payload)
                if op == _OP_SET and self.on_set is not None:
                    self.on_set(key, value)
        except Exception as exc:  # anything a hostile or broken peer can cause
            log.debug("rendezvous: dropped %s: %s", peer, exc)
        finally:
            self._pending.release(conn)  # in case it failed before the handshake did
            with self._conns_lock:
                self._conns.discard(conn)
            conn.close()

    @staticmethod
    def _parse(body: bytes) -> tuple[int, float, str, bytes]:
        op, timeout, key_len = _REQUEST.unpack_from(body)
        if _REQUEST.size + key_len > len(body):
            raise ValueError("request key runs past the end of the frame")
        key = body[_REQUEST.size:_REQUEST.size + key_len].decode()
        return op, timeout, key, body[_REQUEST.size + key_len:]

    def _handle(self, op: int, timeout: float, key: str, value: bytes) -> tuple[int, bytes]:
        with self._cond:
            if op == _OP_SET:
                self._data[key] = value
                self._cond.notify_all()
                return _OK, b""
            if op == _OP_GET:
                # Never wait longer than GET_POLL_S, so a thread is never held by a vanished client;
                # negative or NaN waits mean the longest.
                deadline = time.monotonic() + (min(timeout, GET_POLL_S) if timeout >= 0 else GET_POLL_S)
                while key not in self._data and not self._stopping:
                    remaining = deadline - time.monotonic()
                    if remaining <= 0:
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
    ``connect_timeout`` seconds or refuses the secret, and whenever the server
    does not answer a request within its bound (see the module docstring).
    """

    def __init__(self, host: str, port: int, secret: bytes, connect_timeout: float = 30.0,
                 served_by: str = "roundelrun"):
        self.host = host
        self.port = port
        self._served_by = served_by  # the process that runs the server, as errors name it
        self._secret = secret
        self._connect_timeout = connect_timeout
        self._idle: queue.SimpleQueue[wire.Channel] = queue.SimpleQueue()
        self._all: set[wire.Channel] = set()
        self._lock = threading.Lock()
        self._closed = False
        self._was_connected = False
        self._idle.put(self._connect())

    def set(self, key: str, value: bytes) -> None:
        """Store ``value`` under ``key``."""
        self._request(_OP_SET, key, bytes(value))

    def get(self, key: str, timeout: float | None = None) -> bytes:
        """The value under ``key``, waiting until it is set.

        Raises RendezvousTimeout if ``timeout`` seconds pass first, and
        RendezvousError if the server stops answering (within GET_POLL_S +
        RESPONSE_GRACE_S seconds, whatever ``timeout`` is).
        """
        deadline = None if timeout is None else time.monotonic() + max(0.0, float(timeout))
        while True:
            wait = GET_POLL_S if deadline is None else min(GET_POLL_S, max(0.0, deadline - time.monotonic()))
            status, payload = self._request(_OP_GET, key, b"", wait)
            if status != _TIMED_OUT:
                return payload
            if timeout is not None and deadline is not None and time.monotonic() >= deadline:
                raise RendezvousTimeout(
                    f"rendezvous key {key!r} was not set within {max(0.0, float(timeout)):g} seconds; "
                    "check that every rank of the job started and reached the same point"
                )

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
            channels = list(self._all)
            self._all.clear()
        for channel in channels:
            channel.close()

    def _where(self) -> str:
        return f"the rendezvous server at {self.host}:{self.port}"

    def _unreachable(self, seconds: float, detail) -> RendezvousError:
        return RendezvousError(
            f"could not reach {self._where()} within {seconds:g} seconds ({detail}); "
            f"check that {self._served_by} is still running and that ROUNDEL_RENDEZVOUS_ADDR and "
            "ROUNDEL_RENDEZVOUS_PORT name an address this host can reach (firewall, network)"
        )

    def _connect(self) -> wire.Channel:
        """A new authenticated connection, retried while the server may be starting or busy.

        The first connection is retried for connect_timeout seconds; later ones
        (the server was up) for at most RESPONSE_GRACE_S.
        """
        seconds = min(self._connect_timeout, RESPONSE_GRACE_S) if self._was_connected else self._connect_timeout
        deadline = time.monotonic() + seconds
        backoff = Backoff(0.05, 1.0, deadline)
        while True:
            try:
                channel = self._open(deadline)
                self._was_connected = True
                return channel
            except OSError as exc:  # refused, reset, timed out, or closed by a busy server
                if not backoff.pause():
                    raise self._unreachable(seconds, exc) from None

    def _open(self, deadline: float) -> wire.Channel:
        """One attempt at connecting and authenticating; OSError means it is worth another try."""
        sock = socket.create_connection((self.host, self.port), timeout=max(0.1, deadline - time.monotonic()))
        try:
            channel = wire.client_handshake(sock, self._secret, time.monotonic() + HANDSHAKE_TIMEOUT_S)
        except authwire.ProofFailed:
            sock.close()
            raise RendezvousError(
                f"{self._where()} and this client hold different secrets: the job secret does not match (check "
                "ROUNDEL_SECRET; it must be the one roundelrun handed to this job), or the process at that "
                "address does not hold this job's secret; refusing to use it") from None
        except authwire.NotThisProtocol:
            sock.close()
            raise RendezvousError(f"the process at {self.host}:{self.port} does not speak roundel's rendezvous "
                                  "protocol (it is not this job's store, or runs another roundel version)") from None
        except BaseException:
            sock.close()
            raise
        with self._lock:
            if self._closed:
                sock.close()
                raise RendezvousError("the rendezvous client is closed")
            self._all.add(channel)
        return channel

    def _discard(self, channel: wire.Channel) -> None:
        with self._lock:
            self._all.discard(channel)
        channel.close()

    def _request(self, op: int, key: str, value: bytes, wait: float = 0.0) -> tuple[int, bytes]:
        raw_key = key.encode()
        if len(raw_key) + len(value) > MAX_MESSAGE_BYTES:
            raise RendezvousError(f"rendezvous request for key {key!r} exceeds {MAX_MESSAGE_BYTES} bytes")
        if self._closed:
            raise RendezvousError("the rendezvous client is closed")
        try:
            channel = self._idle.get_nowait()
        except queue.Empty:
            channel = self._connect()
        bound = wait + RESPONSE_GRACE_S
        try:
            channel.send(_REQUEST.pack(op, wait, len(raw_key)) + raw_key + value)
            body = channel.receive(_STATUS.size + MAX_MESSAGE_BYTES, first_byte_timeout=bound)
        except (OSError, ValueError) as exc:
            self._discard(channel)
            if self._closed:
                raise RendezvousError("the rendezvous client is closed") from None
            raise self._request_failed(key, bound, exc) from None
        self._idle.put(channel)
        (status,) = _STATUS.unpack_from(body)
        payload = body[_STATUS.size:]
        if status == _FAILED:
            raise RendezvousError(f"{self._where()} failed the request for key {key!r}: {payload.decode()}")
        return status, payload

    def _request_failed(self, key: str, bound: float, exc: Exception) -> RendezvousError:
        if isinstance(exc, wire.IntegrityError):
            return RendezvousError(
                f"an answer from {self._where()} (key {key!r}) failed its integrity check: it was altered or "
                "corrupted on the way; check the network path to the launcher and that nothing else answers "
                "on that address")
        if isinstance(exc, TimeoutError):
            return RendezvousError(
                f"{self._where()} did not answer within {bound:g} seconds (key {key!r}); check that "
                f"{self._served_by} is still running and not stopped, and that this host "
                f"can still reach {self.host}:{self.port}")
        return RendezvousError(f"lost the connection to {self._where()} (key {key!r}): {exc}; check that "
                               f"{self._served_by} is still running")
