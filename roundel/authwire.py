"""The authenticated wire under roundel's connections: one handshake, tagged frames, bounded reads, load shedding.

Both of roundel's own connections, the rendezvous store (``roundel.rendezvous``)
and the engine's control channel (``roundel.common.control``), start with the
handshake below and tag every frame after it as described here. Each keeps its
own framing on top (the store's blocking request/response, the control
channel's non-blocking message stream) and its own I/O model; what they share
is in this module, so there is one handshake to audit.

Handshake. Each service has an 8-byte ``magic`` naming it and its version; the
initiator (a store client, a rank) claims a 32-bit ``claim`` (its rank, or 0);
nonces are 32 fresh random bytes::

    initiator -> responder   OPENING   magic | claim (!I) | nonce_i
    responder -> initiator   ANSWER    magic | nonce_r | HMAC(secret, RESPONDER_PROOF | transcript)
    initiator -> responder   PROOF     HMAC(secret, INITIATOR_PROOF | transcript)
    responder -> initiator   WELCOME   an empty frame, sequence 0 of the responder-to-initiator direction

    transcript = magic | claim | nonce_i | nonce_r        (fixed length: 76 bytes)

The labels are ASCII strings of their own (``RESPONDER_PROOF`` and the others
below, all starting ``roundel-wire/v1``). Every handshake message has a fixed
size (44, 72, 32 and 36 bytes), so nothing a peer sends before it has proven
the secret sets how much is read.

Every MAC is HMAC-SHA256. Each side proves the secret over the other's fresh
nonce (so a proof cannot be replayed) under its own role label (so a proof
cannot be reflected back to its maker), over the magic (so a proof for one
service is no use to the other) and the claim (so a proof cannot be moved to
another rank). The initiator checks the responder's proof before it reveals
its own; the responder checks the initiator's before it sends anything keyed.
The welcome tells the initiator it was admitted. Session keys, one per
direction::

    session = HMAC(secret, SESSION | transcript)
    initiator-to-responder key = HMAC(session, INITIATOR_TO_RESPONDER)
    responder-to-initiator key = HMAC(session, RESPONDER_TO_INITIATOR)

Frames, each way: ``!I`` payload length | payload | tag, the tag being
``HMAC(direction key, !Q sequence | !I length | payload)``. Sequence numbers
count the frames of one direction from 0 (the welcome is the responder's
frame 0) and are never sent, so a frame altered, replayed, reordered, dropped
or moved from another connection or direction fails its check. A frame's
length is checked against the reader's bound before anything is allocated.

Bounds and load shedding: every handshake read is bounded by a deadline
however slowly bytes trickle in (``recv_exact``); connections that have not yet
proven the secret wait in a ``PendingConnections`` table of fixed size, where
the one waiting longest makes way for a newcomer (a real peer answers at
once); ``accept_loop`` survives running out of file descriptors or threads;
and ``RateLimitedLog`` keeps what a flood leaves in the log to a line per
interval.
"""

from __future__ import annotations

import errno
import hmac
import logging
import os
import secrets
import socket
import struct
import threading
import time
from dataclasses import dataclass
from typing import Callable

from roundel.retry import Backoff

__all__ = [
    "HEADER", "NONCE_BYTES", "TAG_BYTES", "Incomplete", "HandshakeError", "NotThisProtocol", "PendingConnections",
    "ProofFailed", "RateLimitedLog", "Refused", "Session", "TimedOut", "Unwelcome", "accept_loop", "answer",
    "frame_ok", "frame_tag", "initiate", "mac", "peer_name", "read_opening", "recv_exact", "tune",
]

NONCE_BYTES = 32
TAG_BYTES = 32
MAGIC_BYTES = 8
HEADER = struct.Struct("!I")
"""A frame's header: the payload's length."""
_SEQUENCE = struct.Struct("!Q")
_CLAIM = struct.Struct("!I")
OPENING_BYTES = MAGIC_BYTES + _CLAIM.size + NONCE_BYTES
ANSWER_BYTES = MAGIC_BYTES + NONCE_BYTES + TAG_BYTES
WELCOME_BYTES = HEADER.size + TAG_BYTES

RESPONDER_PROOF = b"roundel-wire/v1 responder proof"
INITIATOR_PROOF = b"roundel-wire/v1 initiator proof"
SESSION = b"roundel-wire/v1 session key"
INITIATOR_TO_RESPONDER = b"roundel-wire/v1 initiator-to-responder"
RESPONDER_TO_INITIATOR = b"roundel-wire/v1 responder-to-initiator"

# TCP liveness probes: KEEPALIVE_COUNT probes KEEPALIVE_INTERVAL_S apart after the idle time.
KEEPALIVE_INTERVAL_S = 5
KEEPALIVE_COUNT = 3

_BACKOFF_S = (0.01, 0.5)  # first and longest pause after a failed accept
_SCARCE = {errno.EMFILE, errno.ENFILE, errno.ENOBUFS, errno.ENOMEM}  # out of a resource for now
_TRANSIENT = {errno.ECONNABORTED, errno.EINTR, errno.EAGAIN, errno.EPROTO}  # that connection is gone
_LISTENER_GONE = {errno.EBADF, errno.EINVAL, errno.ENOTSOCK}


# ------------------------------------------------------------------ MACs and frames
def mac(key: bytes, *parts) -> bytes:
    """HMAC-SHA256 under ``key`` over the concatenation of ``parts`` (bytes-like)."""
    return hmac.digest(key, b"".join(parts), "sha256")  # one call into OpenSSL: a control frame's cost


def frame_tag(key: bytes, sequence: int, header, payload) -> bytes:
    """The TAG_BYTES tag of frame number ``sequence`` (``header`` being HEADER.pack(len(payload)))."""
    return mac(key, _SEQUENCE.pack(sequence), header, payload)


def frame_ok(key: bytes, sequence: int, header, payload, tag) -> bool:
    """Whether ``tag`` is frame ``sequence``'s tag for ``header`` and ``payload`` (constant-time compare)."""
    return hmac.compare_digest(bytes(tag), frame_tag(key, sequence, header, payload))


# ------------------------------------------------------------------ bounded reads
class HandshakeError(ConnectionError):
    """The handshake failed: the peer closed, stalled, or sent what the protocol does not allow."""


class Incomplete(HandshakeError):
    """Fewer bytes than expected arrived before the peer closed; ``received`` holds those that did."""

    def __init__(self, message: str, received: bytes):
        super().__init__(message)
        self.received = received


class TimedOut(Incomplete, TimeoutError):
    """Fewer bytes than expected arrived before the deadline."""


def recv_exact(sock: socket.socket, n: int, deadline: float, what: str) -> bytes:
    """Exactly ``n`` bytes of ``what``, all of them before ``deadline`` (time.monotonic).

    The deadline holds however slowly the bytes trickle in. Raises TimedOut
    when it passes, Incomplete when the peer closes first (both with the
    bytes received so far), OSError as the socket does.
    """
    chunks: list[bytes] = []
    while n:
        remaining = deadline - time.monotonic()
        if remaining <= 0:
            raise TimedOut(f"timed out waiting for {what}", b"".join(chunks))
        sock.settimeout(remaining)
        try:
            chunk = sock.recv(min(n, 1 << 20))
        except socket.timeout:
            raise TimedOut(f"timed out waiting for {what}", b"".join(chunks)) from None
        if not chunk:
            raise Incomplete(f"connection closed while waiting for {what}", b"".join(chunks))
        chunks.append(chunk)
        n -= len(chunk)
    return b"".join(chunks)


def tune(sock: socket.socket, dead_after_s: float) -> None:
    """Over TCP: no Nagle delay, and keepalive probes and TCP_USER_TIMEOUT (where the OS has them) so a
    vanished peer is noticed after about ``dead_after_s`` seconds, idle or not. A Unix socket is left as
    it is (a local peer that dies closes its end at once)."""
    if sock.family == socket.AF_UNIX:
        return
    sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_KEEPALIVE, 1)
    idle = max(1, int(dead_after_s) - KEEPALIVE_INTERVAL_S * KEEPALIVE_COUNT)
    for name, value in (("TCP_KEEPIDLE", idle), ("TCP_KEEPINTVL", KEEPALIVE_INTERVAL_S),
                        ("TCP_KEEPCNT", KEEPALIVE_COUNT), ("TCP_USER_TIMEOUT", int(dead_after_s * 1000))):
        option = getattr(socket, name, None)
        if option is not None:
            sock.setsockopt(socket.IPPROTO_TCP, option, value)


# ------------------------------------------------------------------ the handshake
class Refused(HandshakeError):
    """The responder closed or reset the connection before its answer began (it sheds load, or stops)."""


class NotThisProtocol(HandshakeError):
    """The peer's first bytes are not this service's magic: it speaks another protocol or version."""


class ProofFailed(HandshakeError):
    """The peer's proof (or the welcome's tag) is wrong: it does not hold the secret this side holds."""


class Unwelcome(HandshakeError):
    """The responder closed the connection after the initiator's proof, or fell silent, without a welcome."""


@dataclass(frozen=True)
class Session:
    """What a handshake establishes: the initiator's claim, this side's keys and its next sequence numbers."""

    claim: int
    send_key: bytes
    recv_key: bytes
    send_sequence: int
    recv_sequence: int


def _transcript(magic: bytes, claim: int, initiator_nonce: bytes, responder_nonce: bytes) -> bytes:
    return magic + _CLAIM.pack(claim) + initiator_nonce + responder_nonce


def _keys(secret: bytes, transcript: bytes) -> tuple[bytes, bytes]:
    """(initiator-to-responder key, responder-to-initiator key)."""
    session = mac(secret, SESSION, transcript)
    return mac(session, INITIATOR_TO_RESPONDER), mac(session, RESPONDER_TO_INITIATOR)


def _check_magic(magic: bytes) -> None:
    if len(magic) != MAGIC_BYTES:
        raise ValueError(f"a service's magic is {MAGIC_BYTES} bytes, not {len(magic)}")


def _send_by(sock: socket.socket, data: bytes, deadline: float) -> None:
    sock.settimeout(max(0.001, deadline - time.monotonic()))
    sock.sendall(data)


def initiate(sock: socket.socket, secret: bytes, magic: bytes, claim: int, deadline: float) -> Session:
    """Run the initiator's side of the handshake on the connected ``sock``; the Session once both proofs check.

    Everything must arrive before ``deadline`` (time.monotonic). Raises
    Refused (closed, reset or silent before the answer: worth another try),
    NotThisProtocol, ProofFailed (the responder does not hold ``secret``; this
    side's proof was never sent), Unwelcome (closed or silent after this
    side's proof), TimedOut or Incomplete (the answer or welcome stopped part
    way), OSError.
    """
    _check_magic(magic)
    nonce = secrets.token_bytes(NONCE_BYTES)
    try:
        _send_by(sock, magic + _CLAIM.pack(claim) + nonce, deadline)
        their_magic = recv_exact(sock, MAGIC_BYTES, deadline, "the responder's answer")
    except Incomplete as exc:
        if exc.received:
            their_magic = exc.received
        else:
            raise Refused(str(exc)) from None
    except (ConnectionResetError, BrokenPipeError) as exc:
        raise Refused(f"connection reset ({exc})") from None
    if their_magic != magic:
        raise NotThisProtocol("the peer's answer does not start with this service's magic")
    rest = recv_exact(sock, ANSWER_BYTES - MAGIC_BYTES, deadline, "the responder's proof")
    their_nonce, their_proof = rest[:NONCE_BYTES], rest[NONCE_BYTES:]
    transcript = _transcript(magic, claim, nonce, their_nonce)
    if not hmac.compare_digest(their_proof, mac(secret, RESPONDER_PROOF, transcript)):
        raise ProofFailed("the responder's proof is wrong")
    _send_by(sock, mac(secret, INITIATOR_PROOF, transcript), deadline)
    to_responder, to_initiator = _keys(secret, transcript)
    try:
        welcome = recv_exact(sock, WELCOME_BYTES, deadline, "the responder's welcome")
    except Incomplete as exc:
        if exc.received:
            raise
        raise Unwelcome(str(exc)) from None
    except ConnectionResetError as exc:
        raise Unwelcome(f"connection reset ({exc})") from None
    header, tag = welcome[:HEADER.size], welcome[HEADER.size:]
    if header != HEADER.pack(0) or not frame_ok(to_initiator, 0, header, b"", tag):
        raise ProofFailed("the responder's welcome fails its integrity check")
    return Session(claim, to_responder, to_initiator, send_sequence=0, recv_sequence=1)


def read_opening(sock: socket.socket, magic: bytes, hello_by: float) -> bytes:
    """The initiator's opening message, which must arrive by ``hello_by`` (time.monotonic).

    Raises NotThisProtocol as soon as its first bytes differ from ``magic``
    (junk is not waited for), TimedOut or Incomplete, OSError.
    """
    _check_magic(magic)
    head = recv_exact(sock, MAGIC_BYTES, hello_by, "the opening message")
    if head != magic:
        raise NotThisProtocol("the peer does not speak this service's protocol")
    return head + recv_exact(sock, OPENING_BYTES - MAGIC_BYTES, hello_by, "the opening message")


def answer(sock: socket.socket, secret: bytes, opening: bytes, deadline: float,
           proven: Callable[[], bool] = lambda: True) -> Session:
    """Run the responder's side once ``opening`` (from ``read_opening``) has arrived; the Session once the
    initiator's proof checks and the welcome is sent.

    ``proven()`` is called once the proof checks; False (the connection was
    displaced meanwhile) ends the handshake with HandshakeError before the
    welcome. Everything must happen before ``deadline``. Raises ProofFailed
    (the initiator does not hold ``secret``), TimedOut or Incomplete,
    HandshakeError, OSError.
    """
    if len(opening) != OPENING_BYTES:
        raise ValueError(f"an opening message is {OPENING_BYTES} bytes, not {len(opening)}")
    magic = opening[:MAGIC_BYTES]
    (claim,) = _CLAIM.unpack_from(opening, MAGIC_BYTES)
    their_nonce = opening[-NONCE_BYTES:]
    nonce = secrets.token_bytes(NONCE_BYTES)
    transcript = _transcript(magic, claim, their_nonce, nonce)
    _send_by(sock, magic + nonce + mac(secret, RESPONDER_PROOF, transcript), deadline)
    their_proof = recv_exact(sock, TAG_BYTES, deadline, "the initiator's proof")
    if not hmac.compare_digest(their_proof, mac(secret, INITIATOR_PROOF, transcript)):
        raise ProofFailed(f"a peer claiming {claim} failed to prove it holds the job's secret")
    if not proven():
        raise HandshakeError("dropped to make room for a newer connection before its handshake finished")
    to_responder, to_initiator = _keys(secret, transcript)
    header = HEADER.pack(0)
    _send_by(sock, header + frame_tag(to_initiator, 0, header, b""), deadline)
    return Session(claim, to_initiator, to_responder, send_sequence=1, recv_sequence=0)


# ------------------------------------------------------------------ load shedding
class RateLimitedLog:
    """At most one warning per ``interval`` seconds, counting by kind what it held back. Thread-safe.

    Each line reads ``<subject>[ in the last N s]: <count> <kind>; ... (latest: <detail>)``.
    """

    def __init__(self, logger: logging.Logger, subject: str, interval: float):
        self._logger = logger
        self._subject = subject
        self._interval = interval
        self._lock = threading.Lock()
        self._last = -float("inf")
        self._held: dict[str, int] = {}

    def note(self, kind: str, detail: str) -> None:
        """Count one event of ``kind``; log it (with those held back) unless a line went out within the interval."""
        with self._lock:
            self._held[kind] = self._held.get(kind, 0) + 1
            now = time.monotonic()
            if now - self._last >= self._interval:
                self._emit(detail, now)

    def flush(self) -> None:
        """Log the events held back, if any (when closing)."""
        with self._lock:
            if self._held:
                self._emit("", time.monotonic())

    def _emit(self, detail: str, now: float) -> None:
        counts = "; ".join(f"{count} {kind}" for kind, count in sorted(self._held.items()))
        since = "" if self._last == -float("inf") else f" in the last {now - self._last:.0f} s"
        self._logger.warning("%s%s: %s%s", self._subject, since, counts, f" (latest: {detail})" if detail else "")
        self._held.clear()
        self._last = now


class PendingConnections:
    """Accepted connections that have not yet proven the secret, oldest first, at most ``limit``. Thread-safe.

    When the table is full, a newcomer takes the place of the connection
    waiting longest, which is shut down (that wakes the thread serving it): a
    real peer sends its opening at once and proves the secret right after the
    answer, so connections held open by someone else give way to it. A
    newcomer that has not sent anything yet does so only if that connection
    has waited ``patience_s`` (0: always), and is turned away otherwise.
    """

    def __init__(self, limit: int, patience_s: float = 0.0):
        self.limit = limit
        self._patience_s = patience_s
        self._lock = threading.Lock()
        self._waiting: dict[socket.socket, float] = {}  # socket -> when admitted; insertion order: oldest first

    def admit(self, sock: socket.socket, spoke: bool = True) -> tuple[bool, bool]:
        """Track ``sock``; (admitted, whether the oldest waiting connection was displaced for it)."""
        with self._lock:
            displaced = False
            if len(self._waiting) >= self.limit:
                if not spoke and time.monotonic() - next(iter(self._waiting.values())) < self._patience_s:
                    return False, False
                displaced = self._displace_oldest()
            self._waiting[sock] = time.monotonic()
            return True, displaced

    def displace_oldest(self) -> bool:
        """Shut down the connection waiting longest (to free its descriptor); False if none waits."""
        with self._lock:
            return self._displace_oldest()

    def _displace_oldest(self) -> bool:
        if not self._waiting:
            return False
        oldest = next(iter(self._waiting))
        del self._waiting[oldest]
        try:  # under the lock, so the thread serving it has not closed it yet (see release)
            oldest.shutdown(socket.SHUT_RDWR)
        except OSError:
            pass
        return True

    def release(self, sock: socket.socket) -> bool:
        """Stop tracking ``sock`` (it proved the secret, or its handshake ended); False if it was displaced first."""
        with self._lock:
            return self._waiting.pop(sock, None) is not None


def peer_name(address) -> str:
    """A socket peer address for messages: ``host:port``, or "a local socket" for a Unix socket's."""
    if isinstance(address, (str, bytes)):  # a Unix socket's peer has no name
        return "a local socket"
    try:
        return f"{address[0]}:{address[1]}"
    except (TypeError, IndexError):
        return str(address)


def accept_loop(listening: socket.socket, pending: PendingConnections, serve: Callable[[socket.socket, str], None],
                stopped: Callable[[], bool], refusals: RateLimitedLog, troubles: RateLimitedLog,
                thread_name: str) -> None:
    """Accept on ``listening`` until ``stopped()`` or the socket is closed, serving each connection on a
    daemon thread as ``serve(sock, peer)`` (``peer`` describes the address).

    Each connection is first admitted to ``pending`` (``serve`` calls
    ``pending.release(sock)`` once it proves the secret, and closes ``sock``);
    one turned away is closed. Running out of file descriptors displaces the
    oldest pending connection to free one; other failures to accept, or to
    start a thread, pause accepting briefly (doubling up to half a second).
    Refusals and troubles are logged through the rate-limited logs.
    """
    backoff = Backoff(*_BACKOFF_S)
    while not stopped():
        try:
            sock, address = listening.accept()
        except OSError as exc:
            if stopped() or exc.errno in _LISTENER_GONE:
                return
            if exc.errno in _TRANSIENT:
                continue
            if exc.errno in _SCARCE:
                troubles.note(f"accept failed ({os.strerror(exc.errno)}; raise the open-file limit, `ulimit -n`)",
                              str(exc))
                if pending.displace_oldest():
                    time.sleep(0.001)  # its thread closes it, freeing a descriptor
                    continue
            else:
                troubles.note("accept failed", str(exc))
            backoff.pause()
            continue
        backoff.reset()
        peer = peer_name(address)
        if stopped():
            sock.close()
            return
        admitted, displaced = pending.admit(sock, _has_data(sock))
        if displaced:
            refusals.note("unproven connections closed to make room", peer)
        if not admitted:
            sock.close()
            refusals.note(f"turned away ({pending.limit} connections waiting to prove the secret)", peer)
            continue
        try:
            threading.Thread(target=serve, args=(sock, peer), name=thread_name, daemon=True).start()
        except RuntimeError as exc:  # the process cannot start another thread
            pending.release(sock)
            sock.close()
            troubles.note("connections dropped: cannot start a thread to serve them", str(exc))
            time.sleep(_BACKOFF_S[1])


def _has_data(sock: socket.socket) -> bool:
    """True when the peer has already sent something (a real peer sends its opening at once)."""
    try:
        return bool(sock.recv(1, socket.MSG_PEEK | socket.MSG_DONTWAIT))
    except OSError:
        return False
