"""A barrier among the processes of one host, over connected stream sockets.

The shared-memory collectives wait at this barrier between writing their
slots and reading the others'. It is a dissemination barrier: in round ``k``
(``k = 0 .. ceil(log2 N) - 1``) member ``m`` sends one byte to member
``m + 2**k`` and reads one from member ``m - 2**k`` (mod N), so a wait costs
each member ``ceil(log2 N)`` messages sent and received, not ``N - 1``, and
the host ``N log N`` in all rather than ``N**2``.

A dead member closes its sockets, so the members that read from it fail at
once; a stopped one fails them when the socket timeout passes. Either way a
member whose wait fails closes every socket it holds, which fails its own
readers in turn: the failure reaches every member within ``log2 N`` hops,
and the barrier stays failed (each later wait raises the first error).
"""

from __future__ import annotations

import socket


class HostBarrier:
    """Dissemination barrier of ``size`` members; ``peers`` maps each other member to its socket."""

    def __init__(self, rank: int, size: int, peers: dict[int, socket.socket]):
        self.rank, self.size = rank, size
        self._peers = peers
        distances = []
        distance = 1
        while distance < size:
            distances.append(distance)
            distance *= 2
        self._rounds = [(peers[(rank + d) % size], peers[(rank - d) % size]) for d in distances]
        self._failure: str | None = None

    def wait(self) -> None:
        """Return once every member has called this as often as this member has; ``RuntimeError`` when
        a member died, stopped past the socket timeout, or the barrier failed before."""
        if self._failure is not None:
            raise RuntimeError(self._failure)
        try:
            for to, source in self._rounds:
                to.sendall(b"w")
                if not source.recv(1):
                    raise EOFError("the peer closed its connection")
        except (OSError, EOFError) as exc:
            self._failure = (f"a peer on this host stopped answering in a shared-memory collective ({exc}); "
                             "it has probably died or stopped")
            self.close()
            raise RuntimeError(self._failure) from exc

    def close(self) -> None:
        """Close every socket: members still waiting on this one fail at once."""
        for sock in self._peers.values():
            sock.close()
        self._rounds = []
        if self._failure is None:
            self._failure = "the shared-memory barrier was closed"
