"""Direct TCP links between the members of a Gloo communicator: allreduces on the calling thread.

Gloo hands each collective to a worker thread of its process group, whose
transfer waits on Gloo's own I/O thread, and wakes the caller when it is done:
three thread wake-ups a call, which on a busy host cost more than moving a few
kilobytes does. A ``PeerLinks`` keeps one TCP connection to every other member
instead. Its ``exchange`` sends each peer its bytes on every link at once and
reads what each peer sends (``allgather``: the same bytes to every peer). The
Gloo communicator reduces on top of it (see ``roundel.transport.gloo``): a
small tensor as one exchange of whole copies, which every member combines in
rank order (a small sum among 4, 8, 16... members by recursive doubling, one
partner a round); a larger one as two, each member combining the part it
owns. Either way every member gets the same result, bit for bit, with no
thread but the caller's.

The links are made with the communicator. Every member listens on its
advertised address, publishes the address it bound and a fresh random token in the
communicator's store (which only the job's ranks can read), connects to the
members before it, and accepts the members after it. A connection counts once
it shows the listener's token and gets the connector's token back; any other
is closed. The listener closes once every member is linked.

A link whose peer is gone, or silent for the collective timeout, fails the
call and every later one with an error that names the peer, and closes every
link of this member, so that the peers waiting on it fail too: a failed
transport breaks the job, as a failed Gloo call does.
"""

from __future__ import annotations

import hmac
import json
import secrets
import select
import selectors
import socket
import struct
import time

import numpy as np
import torch

MOST_LINKED = 64  # larger communicators make no links (each member would hold a connection to every other)
_TOKEN_BYTES = 32
_HELLO = struct.Struct(f"!I{_TOKEN_BYTES}s")  # the connector's rank, the listener's token
_SOCKET_BUFFER_BYTES = 1 << 20
_MOST_PENDING = 256  # accepted connections yet to say hello; beyond this the oldest is dropped
_CLOSED = bytes(_HELLO.size)  # the hello of a connection closed before it said one: rank 0, no token (refused)


def _key(rank: int) -> str:
    return f"roundel_peer_links/{rank}"


def _tuned(sock: socket.socket) -> socket.socket:
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF, _SOCKET_BUFFER_BYTES)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, _SOCKET_BUFFER_BYTES)
    return sock


def _family(address: str) -> socket.AddressFamily:
    return socket.getaddrinfo(address, 0, type=socket.SOCK_STREAM)[0][0]


class PeerLinks:
    """One authenticated TCP connection from this member to every other; ``allgather`` small tensors over them."""

    def __init__(self, store, rank: int, size: int, address: str, timeout_s: float):
        """Link member ``rank`` of ``size`` to the others through ``store`` (a c10d store only the job can read),
        listening on ``address``; raises RuntimeError when a member does not link within ``timeout_s``."""
        self.rank, self.size = rank, size
        self._timeout_s = timeout_s
        self._links: dict[int, socket.socket] = {}
        self._broken: str | None = None
        self._order: list[tuple[int, socket.socket]] = []  # (peer, link), in rank order
        # among a power of two members from 4 up, small collectives go by recursive doubling: this member's
        # partner in each round (none otherwise)
        doubles = size > 2 and size & (size - 1) == 0
        self.partners = [rank ^ (1 << bit) for bit in range(size.bit_length() - 1)] if doubles else []
        token = secrets.token_bytes(_TOKEN_BYTES)
        listener = _tuned(socket.socket(_family(address), socket.SOCK_STREAM))
        try:
            listener.bind((address, 0))
            listener.listen(max(16, size))
            bound = listener.getsockname()  # the address itself, as resolved here (as Gloo publishes its own)
            store.set(_key(rank), json.dumps([bound[0], bound[1], token.hex()]))
            deadline = time.monotonic() + timeout_s
            for peer in range(rank):
                self._links[peer] = self._connect(store, peer, token, deadline)
            self._accept(store, listener, token, deadline)
        except BaseException:
            self.close()
            raise
        finally:
            listener.close()
        for sock in self._links.values():
            sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            sock.setblocking(False)
        self._order = sorted(self._links.items())

    # ------------------------------------------------------------------ linking
    def _connect(self, store, peer: int, token: bytes, deadline: float) -> socket.socket:
        """The link to ``peer`` (before this member): show its token, expect ours back."""
        host, port, theirs = json.loads(store.get(_key(peer)))
        sock = _tuned(socket.socket(_family(host), socket.SOCK_STREAM))
        try:
            sock.settimeout(max(0.001, deadline - time.monotonic()))
            sock.connect((host, port))
            sock.sendall(_HELLO.pack(self.rank, bytes.fromhex(theirs)))
            answer = b""
            while len(answer) < _TOKEN_BYTES:
                chunk = sock.recv(_TOKEN_BYTES - len(answer))
                if not chunk:
                    break
                answer += chunk
        except OSError as exc:
            sock.close()
            raise RuntimeError(f"rank {self.rank} could not link to rank {peer} at {host}:{port}: {exc}") from exc
        if not hmac.compare_digest(answer, token):
            sock.close()
            raise RuntimeError(f"rank {peer}'s listener at {host}:{port} did not answer with this rank's token")
        return sock

    def _accept(self, store, listener: socket.socket, token: bytes, deadline: float) -> None:
        """Accept the members after this one; close every connection that does not show ``token``."""
        waiting = set(range(self.rank + 1, self.size))
        pending: dict[socket.socket, bytes] = {}
        chooser = selectors.DefaultSelector()
        listener.setblocking(False)
        chooser.register(listener, selectors.EVENT_READ)
        try:
            while waiting:
                left = deadline - time.monotonic()
                if left <= 0:
                    raise RuntimeError(f"rank(s) {', '.join(map(str, sorted(waiting)))} did not link to rank "
                                       f"{self.rank} within {self._timeout_s:g} s")
                for ready, _ in chooser.select(left):
                    if ready.data is None:  # the listener
                        self._take_connection(listener, chooser, pending)
                        continue
                    conn: socket.socket = ready.data
                    hello = _read_hello(conn, pending)
                    if hello is None:
                        continue
                    chooser.unregister(conn)
                    del pending[conn]
                    peer, shown = _HELLO.unpack(hello)
                    if peer not in waiting or not hmac.compare_digest(shown, token):
                        conn.close()
                        continue
                    try:
                        conn.settimeout(max(0.001, deadline - time.monotonic()))
                        conn.sendall(bytes.fromhex(json.loads(store.get(_key(peer)))[2]))
                    except OSError:  # gone already: its rank stays awaited (and times out if it was the member)
                        conn.close()
                        continue
                    self._links[peer] = conn
                    waiting.discard(peer)
        finally:
            for conn in pending:
                conn.close()
            chooser.close()

    @staticmethod
    def _take_connection(listener: socket.socket, chooser, pending: dict) -> None:
        try:
            conn, _ = listener.accept()
        except (BlockingIOError, InterruptedError):
            return
        if len(pending) >= _MOST_PENDING:
            oldest = next(iter(pending))
            chooser.unregister(oldest)
            oldest.close()
            del pending[oldest]
        conn.setblocking(False)
        chooser.register(conn, selectors.EVENT_READ, conn)
        pending[conn] = b""

    # ------------------------------------------------------------------ collectives
    def allgather(self, rows: torch.Tensor) -> None:
        """Fill each row of the contiguous CPU tensor ``rows`` (one per member, in rank order) with that member's
        (see ``allgather_bytes``)."""
        self.allgather_bytes(rows.view(torch.uint8).numpy())

    def allgather_bytes(self, raw: np.ndarray) -> None:
        """Fill each row of the contiguous 2-D uint8 array ``raw`` (one per member, in rank order) with that
        member's: send this member's row on every link, receive each peer's into its row. Among a power of two
        members from 4 up, by recursive doubling instead: each round, the rows gathered so far go to one partner,
        whose own come back (log2(n) messages a member, not n - 1; the same bytes)."""
        if self.partners:
            for round_, peer in enumerate(self.partners):
                width = 1 << round_
                own, theirs = self.rank & -width, peer & -width  # the first row of each side's block
                self.exchange({peer: raw[own:own + width].reshape(-1).data},
                              {peer: raw[theirs:theirs + width].reshape(-1).data})
            return
        mine = memoryview(raw[self.rank])
        self.exchange({peer: mine for peer, _ in self._order}, {peer: memoryview(raw[peer]) for peer, _ in self._order})

    def exchange(self, sends: dict, receives: dict) -> None:
        """Send ``sends[peer]`` (bytes-like) to each peer named and fill ``receives[peer]`` (a writable memoryview
        of the same length as what that peer sends) from it, all links at once; empty views move nothing."""
        if self._broken is not None:
            raise RuntimeError(self._broken)
        links = self._links
        sending = {links[peer]: (peer, view) for peer, view in sends.items() if len(view)}
        receiving = {links[peer]: (peer, view) for peer, view in receives.items() if len(view)}
        deadline = None
        while sending or receiving:
            sent = self._move(sending, receive=False)
            received = self._move(receiving, receive=True)
            if sent or received:
                deadline = None  # silence is timed from the last byte moved
            # after bytes came in, more may have; otherwise wait in poll(), which returns at once for a link that
            # can take more or has bytes, rather than trying every link again first (with a few ranks on each
            # core, the receive tried again at once is one that finds nothing: a system call and an exception)
            if received or not (sending or receiving):
                continue
            if deadline is None:
                deadline = time.monotonic() + self._timeout_s
            left_s = deadline - time.monotonic()
            if left_s <= 0:
                peers = sorted({peer for peer, _ in (*sending.values(), *receiving.values())})
                raise self._broken_by(f"rank(s) {', '.join(map(str, peers))} sent nothing to rank {self.rank} "
                                      f"for {self._timeout_s:g} s (the collective timeout): stopped or hung?")
            poller = select.poll()
            for sock in receiving:
                poller.register(sock, select.POLLIN)
            for sock in sending:
                poller.register(sock, select.POLLOUT | (select.POLLIN if sock in receiving else 0))
            poller.poll(left_s * 1e3)

    def _move(self, pending: dict, receive: bool) -> bool:
        """One non-blocking send (or receive) on each link of ``pending`` (link -> (peer, the bytes left)); drop
        the links that are done; whether any byte moved."""
        moved = False
        for sock, (peer, left) in list(pending.items()):
            count = self._io(sock.recv_into if receive else sock.send, peer, left)
            if count == 0 and receive:
                raise self._closed_by(peer)
            if count:
                moved = True
                left = left[count:]
                if left:
                    pending[sock] = (peer, left)
                else:
                    del pending[sock]
        return moved

    def _io(self, call, peer: int, view: memoryview) -> int | None:
        """``call(view)`` on a non-blocking socket: the bytes moved, None when it would block; a failed link
        breaks the links."""
        try:
            return call(view)
        except (BlockingIOError, InterruptedError):
            return None
        except ConnectionError as exc:  # reset, or a broken pipe: the peer closed it
            raise self._closed_by(peer) from exc
        except OSError as exc:
            raise self._broken_by(f"the link from rank {self.rank} to rank {peer} failed: {exc}") from exc

    def _closed_by(self, peer: int) -> RuntimeError:
        return self._broken_by(f"rank {peer} closed its link to rank {self.rank} (the process probably exited or "
                               "died); see its output")

    def _broken_by(self, reason: str) -> RuntimeError:
        """Mark the links broken for good (a call cut short leaves the peers' streams out of step) and close every
        link: a peer waiting on this member (recursive doubling waits on one partner a round, not on the member
        that failed) then sees it closed at once, rather than silence until the timeout."""
        self._broken = reason
        self.close()
        return RuntimeError(reason)

    def close(self) -> None:
        """Close every link (a peer still inside a call then sees this member gone)."""
        for sock in self._links.values():
            sock.close()
        self._links.clear()
        self._order = []


def _read_hello(conn: socket.socket, pending: dict) -> bytes | None:
    """The hello ``conn`` sent, once all of it is in; None before. A connection that closes first comes back as
    ``_CLOSED`` (which shows no token, so it is closed)."""
    try:
        chunk = conn.recv(_HELLO.size - len(pending[conn]))
    except (BlockingIOError, InterruptedError):
        return None
    except OSError:
        chunk = b""
    if not chunk:
        return _CLOSED
    pending[conn] += chunk
    return pending[conn] if len(pending[conn]) == _HELLO.size else None
