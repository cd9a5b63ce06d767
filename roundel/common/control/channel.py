"""Authenticated, integrity-protected connections between each rank's engine and the coordinator.

Only control messages (requests, batches, cache bits, heartbeats) travel here;
tensor data goes through the transport backend.

Handshake and frames are ``roundel.authwire``'s (its docstring lays out the
bytes): the rank is the initiator and claims its rank, the coordinator the
responder, under the magic ``RNDLCTL1``. Both prove the job's secret over the
other's fresh nonce under their own role label; a rank checks the
coordinator's proof before revealing its own, and the coordinator's welcome
(its frame 0) tells the rank it is in. Every frame afterwards is
``length | payload | MAC`` under a per-direction key, over an implicit
sequence number: a frame altered, replayed, reordered or moved to another
connection fails the check, and the connection is dropped as if its peer were
lost. What this module adds is the control channel's own I/O: frames sent
without blocking (``Connection``) and read from whatever chunks arrive
(``FrameReader``); payloads are ``control_codec`` data, never pickle.

The coordinator's ``Listener`` accepts on its own thread (``authwire.accept_loop``)
and runs each handshake on a short-lived thread, at most ``MAX_HANDSHAKES``
waiting to prove the secret at once, each bounded overall however slowly its
bytes trickle in: the rank's opening message within ``HELLO_DEADLINE_S``, the
whole handshake within ``HANDSHAKE_DEADLINE_S``. A real rank sends its
opening message at once and its proof as soon as the coordinator's arrives,
so when slots or file descriptors run short, the connection that has waited
longest without proving the secret (silent, or stalled after its opening
message) makes way for it; a rank turned away retries with backoff. Idle,
stalled or junk connections thus delay a real rank by about a second at most;
running out of file descriptors or threads only slows accepting down;
refusals are logged at most once per ``REFUSAL_LOG_INTERVAL_S``, with counts.

On Linux the listener also accepts on an abstract Unix socket with a random
name (``Listener.local_name``). A rank on the coordinator's host connects
there (``connect(..., local_name=...)``): a message between processes of one
host then skips the TCP stack, which costs less per message. The handshake
and the frames are the same as over TCP, so the name grants nothing without
the secret; a rank that cannot reach it (another network namespace, say)
connects over TCP.
"""

from __future__ import annotations

import logging
import secrets
import select
import selectors
import socket
import sys
import threading
import time
from typing import Callable

from roundel import authwire
from roundel.common.control import codec as control_codec
from roundel.retry import Backoff

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


class ChannelError(ConnectionError):
    """The peer failed the handshake, closed the connection or sent a bad frame."""


class AuthenticationError(ChannelError):
    """The peer could not prove it holds the job's secret."""


class _Busy(ChannelError):
    """The coordinator closed the connection before answering, or after the proof without a welcome (it
    sheds load); try again."""


def _tune(sock: socket.socket) -> None:
    """Non-blocking from now on (``Connection`` queues what the socket does not take); over TCP, a
    vanished peer is noticed in about USER_TIMEOUT_S."""
    sock.setblocking(False)
    authwire.tune(sock, USER_TIMEOUT_S)


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

    def __init__(self, sock: socket.socket, rank: int, peer: str, session: authwire.Session,
                 send_timeout_s: float = SEND_TIMEOUT_S):
        self.rank = rank
        self.peer = peer
        self._sock = sock
        self._send_key = session.send_key
        self._recv_key = session.recv_key
        self._recv_sequence = session.recv_sequence
        self._send_sequence = session.send_sequence
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
        header = authwire.HEADER.pack(len(payload))
        with self._send_lock:
            tag = authwire.frame_tag(self._send_key, self._send_sequence, header, payload)
            self._send_sequence += 1
            frame = header + payload + tag
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


def watch_writes(selector, connection: Connection, data) -> None:
    """Have ``selector`` report ``connection`` (registered with ``data``) writable exactly while it holds
    queued bytes."""
    events = selectors.EVENT_READ | (selectors.EVENT_WRITE if connection.pending else 0)
    if selector.get_key(connection).events != events:
        selector.modify(connection, events, data)


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
        header_bytes, tag_bytes = authwire.HEADER.size, authwire.TAG_BYTES
        while len(buffer) >= header_bytes:
            (length,) = authwire.HEADER.unpack_from(buffer)
            if length > MAX_FRAME:
                self._fail(f"it announced a frame of {length} bytes, over the {MAX_FRAME}-byte limit")
                break
            end = header_bytes + length + tag_bytes
            if len(buffer) < end:
                break
            payload = bytes(buffer[header_bytes:end - tag_bytes])
            if not authwire.frame_ok(self._key, self._sequence, buffer[:header_bytes], payload,
                                     buffer[end - tag_bytes:end]):
                self._fail(f"frame {self._sequence} failed its integrity check (altered, replayed, "
                           "reordered or not from this connection)")
                break
            try:
                messages.append(control_codec.decode(payload))
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
    backoff = Backoff(0.05, 1.0, deadline, jitter=0.5)
    while True:
        try:
            return _connect_once(lambda: socket.create_connection((host, port), timeout=max(
                0.1, deadline - time.monotonic())), f"{host}:{port}", secret, rank, deadline, send_timeout_s)
        except _Busy as exc:
            if not backoff.pause():
                raise ChannelError(f"could not join the coordinator at {host}:{port} within {timeout:.0f} s: "
                                   f"{exc}; it may be flooded with connections or overloaded") from None


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
        try:
            session = authwire.initiate(sock, secret, MAGIC, rank, attempt_deadline)
        except (authwire.Refused, authwire.Unwelcome) as exc:  # shedding load, or displaced: try again
            raise _Busy(str(exc)) from None
        except authwire.NotThisProtocol:
            raise AuthenticationError(
                f"the process at {where} does not speak roundel's control protocol (it is not this job's "
                "coordinator, or runs another roundel version); refusing it") from None
        except authwire.ProofFailed as exc:
            raise AuthenticationError(
                f"the coordinator at {where} could not prove it holds this job's secret ({exc}); refusing to "
                "talk to it (another process may have taken its address, or the ranks were started with "
                "different secrets)") from None
        except authwire.HandshakeError as exc:
            raise ChannelError(f"the coordinator at {where} stopped in the middle of its handshake: {exc}") from None
        _tune(sock)
        return Connection(sock, 0, where, session, send_timeout_s)
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
    try:
        peer = authwire.peer_name(sock.getpeername())
    except OSError:
        peer = "?"
    return _answer(sock, peer, secret, min(hello_by, deadline), deadline, send_timeout_s)


def _answer(sock: socket.socket, peer: str, secret: bytes, hello_by: float, deadline: float, send_timeout_s: float,
            proven: Callable[[], bool] = lambda: True) -> Connection:
    """The coordinator's part of the handshake (see ``authwire.answer`` for ``proven``)."""
    try:
        opening = authwire.read_opening(sock, MAGIC, hello_by)
        session = authwire.answer(sock, secret, opening, deadline, proven)
    except authwire.ProofFailed as exc:
        raise AuthenticationError(f"{exc}: refused") from None
    except authwire.NotThisProtocol:
        raise ChannelError("the peer does not speak roundel's control protocol") from None
    except authwire.HandshakeError as exc:
        raise ChannelError(str(exc)) from None
    _tune(sock)
    return Connection(sock, session.claim, peer, session, send_timeout_s)


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
    At most ``max_handshakes`` connections wait to prove the secret at once
    (``authwire.PendingConnections``): a real rank sends its opening message
    at once and its proof right after the coordinator's answer, so when the
    table is full, a newcomer that has sent something takes the place of the
    unproven connection accepted the longest ago; a silent newcomer does so
    only if that one is DISPLACE_AFTER_S old, and is closed at once otherwise.
    When accept() runs out of file descriptors, the oldest unproven connection
    is dropped to free one.
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
        self._pending = authwire.PendingConnections(max_handshakes, DISPLACE_AFTER_S)
        self._hello_deadline_s = hello_deadline_s
        self._deadline_s = handshake_deadline_s
        self._send_timeout_s = send_timeout_s
        self._closed = False
        self._close_lock = threading.Lock()
        self._refusals = authwire.RateLimitedLog(log, "roundel coordinator refused connections",
                                                 REFUSAL_LOG_INTERVAL_S)
        self._troubles = authwire.RateLimitedLog(log, "roundel coordinator could not accept connections",
                                                 REFUSAL_LOG_INTERVAL_S)
        for listening in (self._sock, self._local_sock):
            if listening is not None:
                threading.Thread(target=authwire.accept_loop, name="roundel-accept", daemon=True,
                                 args=(listening, self._pending, self._handshake, lambda: self._closed,
                                       self._refusals, self._troubles, "roundel-handshake")).start()

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

    def _handshake(self, sock: socket.socket, peer: str) -> None:
        released = False

        def prove() -> bool:
            nonlocal released
            released = True
            return self._pending.release(sock)

        try:
            started = time.monotonic()
            connection = _answer(sock, peer, self._secret, started + self._hello_deadline_s,
                                 started + self._deadline_s, self._send_timeout_s, prove)
        except (OSError, ValueError) as exc:
            if self._pending.release(sock) or released:  # a displaced one was counted when it was displaced
                self._refusals.note("failed handshakes", f"{peer}: {exc}")
            sock.close()
            return
        with self._close_lock:
            if self._closed:
                connection.close()
                return
            self._on_connection(connection)
