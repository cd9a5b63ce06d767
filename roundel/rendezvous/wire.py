"""The rendezvous store's framing: blocking request and response frames over ``roundel.authwire``.

A connection starts with the handshake of ``roundel.authwire`` under the
magic ``RNDLRDV1`` (the client is the initiator and claims 0); every later
message is one authwire frame (``!I`` length, body, tag over the hidden
sequence number), read and written with blocking calls bounded by deadlines:
a frame in flight must keep moving, FRAME_DEADLINE_S for its first bytes and
one more second per MIN_TRANSFER_RATE bytes of body. Only a frame whose tag
checks is handed on to be parsed.
"""

from __future__ import annotations

import socket
import time

from roundel import authwire

MAGIC = b"RNDLRDV1"
FRAME_DEADLINE_S = 10.0
MIN_TRANSFER_RATE = 1024 * 1024
# An authenticated peer that vanished is noticed after about this long (TCP keepalive, TCP_USER_TIMEOUT).
DEAD_PEER_S = 20


class IntegrityError(ConnectionError):
    """A frame's tag did not check: it was tampered with, replayed, reordered or corrupted."""


class PeerClosed(ConnectionError):
    """The peer closed the connection between frames."""


def transfer_allowance(nbytes: int) -> float:
    """Seconds a frame of ``nbytes`` may take to cross the wire, on top of FRAME_DEADLINE_S."""
    return nbytes / MIN_TRANSFER_RATE


class Channel:
    """One authenticated connection: tagged, sequenced frames each way, blocking I/O. Not thread-safe."""

    def __init__(self, sock: socket.socket, session: authwire.Session):
        self.sock = sock
        self._send_key = session.send_key
        self._recv_key = session.recv_key
        self._send_seq = session.send_sequence
        self._recv_seq = session.recv_sequence

    def send(self, body: bytes) -> None:
        """Send one frame, giving up (TimeoutError) if it does not leave within its deadline."""
        header = authwire.HEADER.pack(len(body))
        tag = authwire.frame_tag(self._send_key, self._send_seq, header, body)
        self._send_seq += 1
        self.sock.settimeout(FRAME_DEADLINE_S + transfer_allowance(len(body)))
        self.sock.sendall(header + body + tag)

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
        header = first + authwire.recv_exact(self.sock, authwire.HEADER.size - 1, deadline, "a frame's length")
        (size,) = authwire.HEADER.unpack(header)
        if size > max_bytes:
            raise ValueError(f"frame of {size} bytes exceeds the limit of {max_bytes}")
        rest = authwire.recv_exact(self.sock, size + authwire.TAG_BYTES, deadline + transfer_allowance(size),
                                   "a frame")
        body, tag = rest[:size], rest[size:]
        if not authwire.frame_ok(self._recv_key, self._recv_seq, header, body, tag):
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


def server_handshake(sock: socket.socket, secret: bytes, deadline: float,
                     pending: authwire.PendingConnections) -> Channel:
    """Run the server's (responder's) side; a Channel once the client has proven the secret.

    The whole exchange must finish before ``deadline`` (time.monotonic).
    ``sock`` leaves ``pending`` once its proof checks. Raises
    authwire.ProofFailed for a wrong proof, other authwire.HandshakeError
    (TimeoutError for a missed deadline) or OSError; the caller closes ``sock``.
    """
    authwire.tune(sock, DEAD_PEER_S)
    opening = authwire.read_opening(sock, MAGIC, deadline)
    return Channel(sock, authwire.answer(sock, secret, opening, deadline, lambda: pending.release(sock)))


def client_handshake(sock: socket.socket, secret: bytes, deadline: float) -> Channel:
    """Run the client's (initiator's) side; a Channel once both proofs check.

    Raises authwire.ProofFailed (the server does not hold ``secret``, or this
    client's is wrong), authwire.Refused and authwire.Unwelcome (closed by a
    busy or stopping server), other authwire.HandshakeError, TimeoutError or
    OSError.
    """
    authwire.tune(sock, DEAD_PEER_S)
    return Channel(sock, authwire.initiate(sock, secret, MAGIC, 0, deadline))
