"""Authenticated, integrity-protected connections between each rank's engine and the coordinator.

Only control messages (requests, batches, cache bits, heartbeats) travel here;
tensor data goes through the transport backend.

Handshake (both ends hold the job's secret; nonces are 32 random bytes)::

    rank        -> coordinator   MAGIC, rank, nonce_r
    coordinator -> rank          MAGIC, nonce_c, HMAC(secret, COORDINATOR_PROOF | rank | nonce_r | nonce_c)
    rank        -> coordinator   HMAC(secret, RANK_PROOF | rank | nonce_r | nonce_c)
    coordinator -> rank          an empty frame (sequence 0): "you are in"

Each side proves the secret over the other side's fresh nonce, under its own
role label, so a proof can be neither replayed nor reflected; a rank checks
the coordinator's proof before revealing its own. Every frame afterwards is
``length | payload | MAC``, the MAC being HMAC-SHA256 under a per-direction key
derived from the secret and both nonces, over an implicit per-direction
sequence number, the length and the payload: a frame altered, replayed,
reordered or moved to another connection fails the check, and the connection
is dropped as if its peer were lost. Payloads are ``control_codec`` data,
never pickle.

The coordinator's ``Listener`` accepts on its own thread and runs each
handshake on a short-lived thread, at most ``MAX_HANDSHAKES`` at once, each
bounded overall however slowly its bytes trickle in: the rank's opening
message within ``HELLO_DEADLINE_S``, the whole handshake within
``HANDSHAKE_DEADLINE_S``. A real rank sends its opening message at once and
its proof as soon as the coordinator's arrives, so when slots or file
descriptors run short, the connection that has waited longest without
proving the secret (silent, or stalled after its opening message) makes way
for it; a rank turned away retries with backoff. Idle, stalled or junk
connections thus delay a real rank by about a second at most; running out of file descriptors
or threads only slows accepting down; refusals are logged at most once per
``REFUSAL_LOG_INTERVAL_S``, with counts.

On Linux the listener also accepts on an abstract Unix socket with a random
name (``Listener.local_name``). A rank on the coordinator's host connects
there (``connect(..., local_name=...)``): a message between processes of one
host then skips the TCP stack, which costs less per message. The handshake
and the frames are the same as over TCP, so the name grants nothing without
the secret; a rank that cannot reach it (another network namespace, say)
connects over TCP.
"""

from __future__ import annotations

import errno
import hashlib
import hmac
import logging
import os
import random
import secrets
import select
import socket
import struct
import sys
import threading
import time
from typing import Callable

from roundel.common.control import codec as control_codec

log = logging.getLogger("roundel")

MAGIC = b"RNDLCTL1"
MAX_FRAME = 256 * 1024 * 1024
MAX_HANDSHAKES = 32
HELLO_DEADLINE_S = 1.0
HANDSHAKE_DEADLINE_S = 5.0
DISPLACE_AFTER_S = 0.2
SEND_TIMEOUT_S = 15.0
USER_TIMEOUT_S = 25.0
REFUSAL_LOG_INTERVAL_S = 10.0
#: Bytes the engine threads ask for per read. Python allocates the full size before each read; a size
#: under the allocator's mmap threshold (128 KiB) comes from the heap, where a 1 MiB read made every
#: small message pay for mapping fresh memory. Longer frames take several reads.
RECV_BYTES = 64 * 1024

_NONCE_BYTES = 32
_MAC_BYTES = 32
_HEADER = struct.Struct("!I")
_SEQUENCE = struct.Struct("!Q")
_RANK = struct.Struct("!I")
_RANK_HELLO_BYTES = len(MAGIC) + _RANK.size + _NONCE_BYTES
_COORDINATOR_HELLO_BYTES = len(MAGIC) + _NONCE_BYTES + _MAC_BYTES

_COORDINATOR_PROOF = b"roundel-control/v1/coordinator-proof"
_RANK_PROOF = b"roundel-control/v1/rank-proof"
_SESSION = b"roundel-control/v1/session"
_RANK_TO_COORDINATOR = b"roundel-control/v1/rank-to-coordinator"
_COORDINATOR_TO_RANK = b"roundel-control/v1/coordinator-to-rank"

# accept() failures that mean "out of a resource for now", not "the listener is gone"
_SCARCE = {errno.EMFILE, errno.ENFILE, errno.ENOBUFS, errno.ENOMEM}
_BACKOFF_MIN_S, _BACKOFF_MAX_S = 0.01, 0.5


class ChannelError(ConnectionError):
    """The peer failed the handshake, closed the connection or sent a bad frame."""


class AuthenticationError(ChannelError):
    """The peer could not prove it holds the job's secret."""


class _Busy(ChannelError):
    """The coordinator closed the connection before its handshake began (it sheds load); try again."""


def _mac(key: bytes, data: bytes) -> bytes:
    return hmac.digest(key, data, hashlib.sha256)


def _proofs(secret: bytes, rank: int, rank_nonce: bytes, coordinator_nonce: bytes) -> tuple[bytes, bytes]:
    """(coordinator's proof, rank's proof) for one handshake."""
    transcript = _RANK.pack(rank) + rank_nonce + coordinator_nonce
    return _mac(secret, _COORDINATOR_PROOF + transcript), _mac(secret, _RANK_PROOF + transcript)


def _session_keys(secret: bytes, rank: int, rank_nonce: bytes, coordinator_nonce: bytes) -> tuple[bytes, bytes]:
    """(rank→coordinator key, coordinator→rank key), HKDF-style from the secret and both nonces."""
    session = _mac(secret, _SESSION + _RANK.pack(rank) + rank_nonce + coordinator_nonce)
    return _mac(session, _RANK_TO_COORDINATOR), _mac(session, _COORDINATOR_TO_RANK)


def _tune(sock: socket.socket) -> None:
    """Non-blocking from now on (``Connection`` queues what the socket does not take); over TCP, no
    Nagle delay, and keepalive and TCP_USER_TIMEOUT so a vanished peer is noticed in about 25 s."""
    sock.setblocking(False)
    if sock.family == socket.AF_UNIX:  # a local peer that dies closes its end at once
        return
    sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_KEEPALIVE, 1)
    for option, value in (("TCP_KEEPIDLE", 10), ("TCP_KEEPINTVL", 5), ("TCP_KEEPCNT", 3),
                          ("TCP_USER_TIMEOUT", int(USER_TIMEOUT_S * 1000))):
        if hasattr(socket, option):
            sock.setsockopt(socket.IPPROTO_TCP, getattr(socket, option), value)


class _Incomplete(ChannelError):
    """Fewer bytes than expected arrived before the deadline or the end of the stream."""

    def __init__(self, message: str, received: bytes):
        super().__init__(message)
        self.received = received


def _recv_exact(sock: socket.socket, n: int, deadline: float, what: str) -> bytes:
    """``n`` bytes, all of them before ``deadline`` (time.monotonic), however slowly they trickle in."""
    chunks = []
    while n:
        remaining = deadline - time.monotonic()
        if remaining <= 0:
            raise _Incomplete(f"timed out waiting for {what}", b"".join(chunks))
        sock.settimeout(remaining)
        try:
            chunk = sock.recv(n)
        except socket.timeout:
            raise _Incomplete(f"timed out waiting for {what}", b"".join(chunks)) from None
        if not chunk:
            raise _Incomplete(f"connection closed while waiting for {what}", b"".join(chunks))
        chunks.append(chunk)
        n -= len(chunk)
    return b"".join(chunks)


def _describe(address) -> str:
    if isinstance(address, (str, bytes)):  # a Unix socket's peer has no name
        return "a local socket"
    try:
        return f"{address[0]}:{address[1]}"
    except (TypeError, IndexError):
        return str(address)


class Connection:
    """One authenticated control connection; select on it, ``recv`` raw bytes, ``send`` messages.

    ``rank`` is the rank at the far end (0 for a rank's connection to the
    coordinator). Read messages with a ``FrameReader(connection)``.

    Sending never blocks: what the socket does not take at once is queued, and
    the owner writes it out with ``flush()`` when ``select`` finds the socket
    writable (``pending`` says when to watch for that). Both ends of a
    connection may thus send large messages at the same time without waiting
    on each other to read. Queued bytes that make no progress for
    ``send_timeout_s`` mean the peer stopped reading: the connection is then
    shut down as lost.
    """

    def __init__(self, sock: socket.socket, rank: int, peer: str, send_key: bytes, recv_key: bytes,
                 recv_sequence: int, send_sequence: int, send_timeout_s: float = SEND_TIMEOUT_S):
        self.rank = rank
        self.peer = peer
        self._sock = sock
        self._send_key = send_key
        self._recv_key = recv_key
        self._recv_sequence = recv_sequence
        self._send_sequence = send_sequence
        self._send_lock = threading.Lock()
        self._send_timeout_s = send_timeout_s
        self._queued = bytearray()  # frames, or their tails, the socket has not taken yet
        self._last_progress = 0.0  # when the socket last took queued bytes

    def fileno(self) -> int:
        return self._sock.fileno()

    def recv(self, size: int) -> bytes:
        """Raw bytes for a ``FrameReader`` (call once the socket is readable)."""
        return self._sock.recv(size)

    @property
    def pending(self) -> bool:
        """True while sent messages wait to be written (select for writability, then ``flush``)."""
        return bool(self._queued)

    def send(self, message) -> None:
        """Send one message as an authenticated frame, without blocking; thread-safe.

        Raises OSError (the connection is then shut down) when the peer is gone
        or has taken nothing queued for its send timeout, ChannelError if the
        message exceeds MAX_FRAME, TypeError if it holds a value the codec
        cannot carry.
        """
        self.send_encoded(control_codec.encode(message))

    def send_encoded(self, payload: bytes) -> None:
        """Send a message already encoded with ``control_codec.encode`` (one encoding for several peers)."""
        if len(payload) > MAX_FRAME:
            raise ChannelError(f"control message of {len(payload)} bytes exceeds the {MAX_FRAME}-byte limit")
        header = _HEADER.pack(len(payload))
        with self._send_lock:
            mac = _mac(self._send_key, _SEQUENCE.pack(self._send_sequence) + header + payload)
            self._send_sequence += 1
            frame = header + payload + mac
            if self._queued:
                self._queued += frame
                self._write_queued()
                return
            try:
                sent = self._sock.send(frame)
            except BlockingIOError:
                sent = 0
            except OSError:
                self.abandon()
                raise
            if sent < len(frame):
                self._queued += memoryview(frame)[sent:]
                self._last_progress = time.monotonic()

    def flush(self) -> None:
        """Write what the socket takes of the queued bytes, without blocking.

        Raises OSError (the connection is then shut down) as ``send`` does.
        """
        with self._send_lock:
            if self._queued:
                self._write_queued()

    def drain(self, deadline: float) -> bool:
        """Block until everything queued is written or ``deadline`` (time.monotonic) passes; True if written.

        For a last message before closing; errors count as not written.
        """
        if not self.pending:
            return True
        try:
            poller = select.poll()
            poller.register(self._sock, select.POLLOUT)
            while self.pending:
                remaining = deadline - time.monotonic()
                if remaining <= 0 or not poller.poll(remaining * 1000):
                    return False
                self.flush()
        except (OSError, ValueError):  # ValueError: already closed
            return False
        return True

    def _write_queued(self) -> None:
        queued = self._queued
        try:
            sent = self._sock.send(queued)
        except BlockingIOError:
            sent = 0
        except OSError:
            queued.clear()  # a lost connection has nothing left to send
            self.abandon()
            raise
        now = time.monotonic()
        if sent:
            del queued[:sent]
            self._last_progress = now
        elif now - self._last_progress > self._send_timeout_s:
            stuck = len(queued)
            queued.clear()
            self.abandon()
            raise socket.timeout(f"the peer took none of {stuck} queued bytes for {self._send_timeout_s:.0f} s")

    def abandon(self) -> None:
        """Shut both directions down so whoever selects on this connection sees it as lost."""
        try:
            self._sock.shutdown(socket.SHUT_RDWR)
        except OSError:
            pass

    def close(self) -> None:
        self._sock.close()

    def __repr__(self) -> str:
        return f"<roundel control connection to rank {self.rank} at {self.peer}>"


def send(connection: Connection, message) -> None:
    """Send ``message`` on ``connection`` (see ``Connection.send``)."""
    connection.send(message)


class FrameReader:
    """Checks and decodes the frames of one connection from whatever chunks a read returns.

    A frame that is too long, fails its MAC (tampered, replayed, reordered,
    spliced) or does not decode is logged once, and the connection is shut
    down so its owner treats the peer as lost; nothing after it is read.
    """

    def __init__(self, connection: Connection):
        self._connection = connection
        self._key = connection._recv_key
        self._sequence = connection._recv_sequence
        self._buffer = bytearray()
        self._failed = False

    def feed(self, data: bytes) -> list:
        """Add received bytes; return the complete, verified messages now available."""
        if self._failed:
            return []
        self._buffer += data
        messages = []
        buffer = self._buffer
        while len(buffer) >= _HEADER.size:
            (length,) = _HEADER.unpack_from(buffer)
            if length > MAX_FRAME:
                self._fail(f"it announced a frame of {length} bytes, over the {MAX_FRAME}-byte limit")
                break
            end = _HEADER.size + length + _MAC_BYTES
            if len(buffer) < end:
                break
            signed = bytes(buffer[:end - _MAC_BYTES])
            expected = _mac(self._key, _SEQUENCE.pack(self._sequence) + signed)
            if not hmac.compare_digest(expected, bytes(buffer[end - _MAC_BYTES:end])):
                self._fail(f"frame {self._sequence} failed its integrity check (altered, replayed, "
                           "reordered or not from this connection)")
                break
            try:
                messages.append(control_codec.decode(signed[_HEADER.size:]))
            except control_codec.DecodeError as exc:
                self._fail(f"frame {self._sequence} is not a valid control message ({exc})")
                break
            self._sequence += 1
            del buffer[:end]
        return messages

    def _fail(self, reason: str) -> None:
        self._failed = True
        self._buffer.clear()
        connection = self._connection
        who = "the coordinator" if connection.rank == 0 else f"rank {connection.rank}"
        log.error("roundel control channel: dropping the connection from %s (%s): %s; "
                  "treating that peer as lost", who, connection.peer, reason)
        connection.abandon()


# ------------------------------------------------------------------- rank side
def connect(host: str, port: int, secret: bytes, rank: int, timeout: float,
            send_timeout_s: float = SEND_TIMEOUT_S, local_name: str | None = None) -> Connection:
    """Connect to the coordinator, check that it holds the job's secret, prove this rank does.

    Retries while the coordinator sheds load (closes before its handshake)
    until ``timeout`` seconds have passed. Raises AuthenticationError when the
    coordinator cannot prove the secret, ChannelError or OSError otherwise.
    """
    deadline = time.monotonic() + timeout
    if local_name is not None:
        try:
            return _connect_once(lambda: _local_connection(local_name, max(0.1, deadline - time.monotonic())),
                                 f"local socket {local_name}",
                                 secret, rank, deadline, send_timeout_s)
        except OSError as exc:  # ChannelError and AuthenticationError too: TCP proves the coordinator again
            log.debug("roundel could not reach the coordinator's local socket (%s); connecting over TCP", exc)
    delay = 0.05
    while True:
        try:
            return _connect_once(lambda: socket.create_connection((host, port), timeout=max(
                0.1, deadline - time.monotonic())), f"{host}:{port}", secret, rank, deadline, send_timeout_s)
        except _Busy as exc:
            if time.monotonic() + delay >= deadline:
                raise ChannelError(f"could not join the coordinator at {host}:{port} within {timeout:.0f} s: "
                                   f"{exc}; it may be flooded with connections or overloaded") from None
            time.sleep(delay * random.uniform(0.5, 1.5))
            delay = min(delay * 2, 1.0)


def _local_connection(name: str, timeout: float) -> socket.socket:
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    try:
        sock.settimeout(timeout)
        sock.connect("\0" + name)
    except BaseException:
        sock.close()
        raise
    return sock


def _connect_once(open_socket: Callable[[], socket.socket], where: str, secret: bytes, rank: int,
                  deadline: float, send_timeout_s: float) -> Connection:
    attempt_deadline = min(deadline, time.monotonic() + HANDSHAKE_DEADLINE_S + 1.0)
    sock = open_socket()
    try:
        nonce = os.urandom(_NONCE_BYTES)
        try:
            sock.sendall(MAGIC + _RANK.pack(rank) + nonce)
            magic = _recv_exact(sock, len(MAGIC), attempt_deadline, "the coordinator's handshake")
        except _Incomplete as exc:
            if not exc.received:
                raise _Busy(str(exc)) from None
            magic = exc.received
        except (ConnectionResetError, BrokenPipeError) as exc:
            raise _Busy(f"connection reset ({exc})") from None
        if magic != MAGIC:
            raise AuthenticationError(
                f"the process at {where} does not speak roundel's control protocol (it is not this job's "
                "coordinator, or runs another roundel version); refusing it")
        try:
            hello = magic + _recv_exact(sock, _COORDINATOR_HELLO_BYTES - len(MAGIC), attempt_deadline,
                                        "the coordinator's proof")
        except _Incomplete as exc:
            raise ChannelError(f"the coordinator at {where} stopped in the middle of its handshake: {exc}") from None
        coordinator_nonce = hello[len(MAGIC):len(MAGIC) + _NONCE_BYTES]
        coordinator_proof, rank_proof = _proofs(secret, rank, nonce, coordinator_nonce)
        if not hmac.compare_digest(hello[-_MAC_BYTES:], coordinator_proof):
            raise AuthenticationError(
                f"the coordinator at {where} could not prove it holds this job's secret; refusing to talk to "
                "it (another process may have taken its address, or the ranks were started with different "
                "secrets)")
        sock.sendall(rank_proof)
        to_coordinator, from_coordinator = _session_keys(secret, rank, nonce, coordinator_nonce)
        try:
            welcome = _recv_exact(sock, _HEADER.size + _MAC_BYTES, attempt_deadline, "the coordinator's welcome")
        except _Incomplete as exc:
            if exc.received:
                raise
            raise _Busy(str(exc)) from None
        if welcome[:_HEADER.size] != _HEADER.pack(0) or not hmac.compare_digest(
                welcome[_HEADER.size:], _mac(from_coordinator, _SEQUENCE.pack(0) + _HEADER.pack(0))):
            raise AuthenticationError(f"the coordinator at {where} sent a welcome frame that fails its "
                                      "integrity check; refusing it")
        _tune(sock)
        return Connection(sock, 0, where, to_coordinator, from_coordinator, recv_sequence=1, send_sequence=0,
                          send_timeout_s=send_timeout_s)
    except BaseException:
        sock.close()
        raise


# ------------------------------------------------------------ coordinator side
def handshake(sock: socket.socket, secret: bytes, hello_by: float, deadline: float,
              send_timeout_s: float = SEND_TIMEOUT_S) -> Connection:
    """Authenticate one accepted socket; return its Connection.

    The rank's opening message must arrive by ``hello_by``, the whole
    handshake finish by ``deadline`` (both time.monotonic). Raises
    ChannelError (AuthenticationError for a wrong proof) or OSError; the
    caller closes the socket then.
    """
    return _answer(sock, secret, _read_opening(sock, min(hello_by, deadline)), deadline, send_timeout_s)


def _read_opening(sock: socket.socket, hello_by: float) -> bytes:
    return _recv_exact(sock, _RANK_HELLO_BYTES, hello_by, "the rank's opening message")


def _answer(sock: socket.socket, secret: bytes, hello: bytes, deadline: float, send_timeout_s: float,
            proven: Callable[[], bool] = lambda: True) -> Connection:
    """The coordinator's part of the handshake once the rank's opening message has arrived.

    ``proven()`` is called once the rank's proof checks; False (the connection was displaced meanwhile)
    ends the handshake with ChannelError before the welcome is sent.
    """
    if hello[:len(MAGIC)] != MAGIC:
        raise ChannelError("the peer does not speak roundel's control protocol")
    (rank,) = _RANK.unpack_from(hello, len(MAGIC))
    rank_nonce = hello[-_NONCE_BYTES:]
    nonce = os.urandom(_NONCE_BYTES)
    coordinator_proof, rank_proof = _proofs(secret, rank, rank_nonce, nonce)
    sock.settimeout(max(0.001, deadline - time.monotonic()))
    sock.sendall(MAGIC + nonce + coordinator_proof)
    proof = _recv_exact(sock, _MAC_BYTES, deadline, "the rank's proof")
    if not hmac.compare_digest(proof, rank_proof):
        raise AuthenticationError(f"a peer claiming rank {rank} failed to prove it holds the job's secret")
    if not proven():
        raise ChannelError(f"rank {rank} was dropped to make room before its handshake finished")
    from_rank, to_rank = _session_keys(secret, rank, rank_nonce, nonce)
    sock.settimeout(max(0.001, deadline - time.monotonic()))
    sock.sendall(_HEADER.pack(0) + _mac(to_rank, _SEQUENCE.pack(0) + _HEADER.pack(0)))
    _tune(sock)
    try:
        peer = _describe(sock.getpeername())
    except OSError:
        peer = "?"
    return Connection(sock, rank, peer, to_rank, from_rank, recv_sequence=0, send_sequence=1,
                      send_timeout_s=send_timeout_s)


def _has_data(sock: socket.socket) -> bool:
    """True when the peer has already sent something (a real rank sends its opening message at once)."""
    try:
        return bool(sock.recv(1, socket.MSG_PEEK | socket.MSG_DONTWAIT))
    except OSError:
        return False


class _RateLimitedLog:
    """At most one warning per interval; the ones held back are counted into the next."""

    def __init__(self, what: str, interval: float):
        self._what = what
        self._interval = interval
        self._lock = threading.Lock()
        self._last = -float("inf")
        self._held: dict[str, int] = {}

    def note(self, kind: str, detail: str) -> None:
        with self._lock:
            self._held[kind] = self._held.get(kind, 0) + 1
            now = time.monotonic()
            if now - self._last < self._interval:
                return
            self._emit(detail, now)

    def flush(self) -> None:
        with self._lock:
            if self._held:
                self._emit("", time.monotonic())

    def _emit(self, detail: str, now: float) -> None:
        counts = "; ".join(f"{count} {kind}" for kind, count in sorted(self._held.items()))
        since = "" if self._last == -float("inf") else f" in the last {now - self._last:.0f} s"
        log.warning("roundel coordinator %s%s: %s%s", self._what, since, counts,
                    f" (latest: {detail})" if detail else "")
        self._held.clear()
        self._last = now


def _local_listener(backlog: int) -> tuple[socket.socket | None, str | None]:
    """A listening abstract Unix socket with a random name, and the name; (None, None) where there is none."""
    if not sys.platform.startswith("linux"):  # abstract socket names are Linux's
        return None, None
    name = f"roundel-control-{secrets.token_hex(16)}"
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    try:
        sock.bind("\0" + name)
        sock.listen(backlog)
    except OSError as exc:
        sock.close()
        log.debug("roundel coordinator has no local socket (%s); ranks connect over TCP", exc)
        return None, None
    return sock, name


class Listener:
    """The coordinator's control port (and local socket): accepts ranks' connections and authenticates them.

    ``on_connection(connection)`` is called (from a handshake thread) for each
    connection that completes the handshake; never after ``close()`` returns.
    A real rank sends its opening message at once and its proof right after
    the coordinator's answer, so connections that have not proven the secret
    give way. When all handshake slots are taken, a newcomer that has sent
    something takes the slot of the unproven connection accepted the longest
    ago; a silent newcomer does so only if that one is DISPLACE_AFTER_S old,
    and is closed at once otherwise. When accept() runs out of file
    descriptors, the oldest unproven connection is dropped to free one.
    """

    def __init__(self, host: str, secret: bytes, on_connection: Callable[[Connection], None],
                 backlog: int = 128, max_handshakes: int = MAX_HANDSHAKES,
                 hello_deadline_s: float = HELLO_DEADLINE_S, handshake_deadline_s: float = HANDSHAKE_DEADLINE_S,
                 send_timeout_s: float = SEND_TIMEOUT_S):
        self._sock = socket.create_server((host, 0), backlog=backlog)
        self.port: int = self._sock.getsockname()[1]
        self._local_sock, self.local_name = _local_listener(backlog)
        self._secret = secret
        self._on_connection = on_connection
        self._slots = threading.BoundedSemaphore(max_handshakes)
        self._max_handshakes = max_handshakes
        self._hello_deadline_s = hello_deadline_s
        self._deadline_s = handshake_deadline_s
        self._send_timeout_s = send_timeout_s
        self._unproven: dict[socket.socket, float] = {}  # accepted, proof not yet checked -> since
        self._unproven_lock = threading.Lock()
        self._closed = False
        self._close_lock = threading.Lock()
        self._refusals = _RateLimitedLog("refused connections", REFUSAL_LOG_INTERVAL_S)
        self._troubles = _RateLimitedLog("could not accept connections", REFUSAL_LOG_INTERVAL_S)
        for listening in (self._sock, self._local_sock):
            if listening is not None:
                threading.Thread(target=self._accept_loop, args=(listening,), name="roundel-accept",
                                 daemon=True).start()

    def close(self) -> None:
        """Stop accepting; handshakes still running are discarded."""
        with self._close_lock:
            if self._closed:
                return
            self._closed = True
        for listening in (self._sock, self._local_sock):
            if listening is None:
                continue
            try:
                listening.shutdown(socket.SHUT_RDWR)  # wakes its accept thread
            except OSError:
                pass
            listening.close()
        self._refusals.flush()
        self._troubles.flush()

    def _accept_loop(self, listening: socket.socket) -> None:
        backoff = _BACKOFF_MIN_S
        while not self._closed:
            try:
                sock, address = listening.accept()
            except OSError as exc:
                if self._closed or exc.errno in (errno.EBADF, errno.EINVAL, errno.ENOTSOCK):
                    return  # the listener itself is gone
                scarce = exc.errno in _SCARCE
                self._troubles.note(f"accept() failures ({os.strerror(exc.errno)}; raise `ulimit -n`?)"
                                    if scarce else "accept() failures", str(exc))
                if scarce and self._displace_oldest_unproven(0.0):
                    time.sleep(0.001)  # its handshake thread closes it, freeing a descriptor
                    continue
                time.sleep(backoff)
                backoff = min(backoff * 2, _BACKOFF_MAX_S)
                continue
            backoff = _BACKOFF_MIN_S
            if not self._slots.acquire(blocking=False) and not (
                    self._displace_oldest_unproven(0.0 if _has_data(sock) else DISPLACE_AFTER_S)
                    and self._slots.acquire(timeout=0.5)):
                sock.close()
                self._refusals.note(f"turned away ({self._max_handshakes} handshakes already running)",
                                    _describe(address))
                continue
            with self._unproven_lock:
                self._unproven[sock] = time.monotonic()
            try:
                threading.Thread(target=self._handshake, args=(sock, address),
                                 name="roundel-handshake", daemon=True).start()
            except RuntimeError as exc:  # no thread could be started
                self._stop_waiting(sock)
                self._slots.release()
                sock.close()
                self._troubles.note("handshake threads that could not start", str(exc))
                time.sleep(_BACKOFF_MAX_S)

    def _displace_oldest_unproven(self, at_least_s: float) -> bool:
        """Drop the oldest connection that has not proven the secret, if ``at_least_s`` old; True if one was."""
        with self._unproven_lock:
            if not self._unproven:
                return False
            sock, since = next(iter(self._unproven.items()))  # insertion order: the oldest first
            if time.monotonic() - since < at_least_s:
                return False
            del self._unproven[sock]
            try:  # wakes its handshake thread, which closes it; done under the lock so it is still open
                sock.shutdown(socket.SHUT_RDWR)
            except OSError:
                pass
        return True

    def _stop_waiting(self, sock: socket.socket) -> bool:
        """Forget ``sock`` as unproven; False if it was displaced meanwhile."""
        with self._unproven_lock:
            return self._unproven.pop(sock, None) is not None

    def _handshake(self, sock: socket.socket, address) -> None:
        proven = False

        def prove() -> bool:
            nonlocal proven
            proven = self._stop_waiting(sock)
            return proven

        try:
            started = time.monotonic()
            opening = _read_opening(sock, started + self._hello_deadline_s)
            connection = _answer(sock, self._secret, opening, started + self._deadline_s, self._send_timeout_s,
                                 prove)
        except (OSError, ValueError) as exc:
            displaced = not proven and not self._stop_waiting(sock)
            sock.close()
            if displaced:
                self._refusals.note("unproven ones dropped to make room", _describe(address))
            else:
                self._refusals.note("failed handshakes", f"{_describe(address)}: {exc}")
            return
        finally:
            self._slots.release()
        with self._close_lock:
            if self._closed:
                connection.close()
                return
            self._on_connection(connection)
