"""An attacker that holds a server's pre-authentication slots, in a forked child (as another user when root).

It keeps COUNT connections open to every target (``(host, port)``, or
``"@name"`` for an abstract Unix socket) and opens a new one whenever the
server closes one. Mode ``silent`` sends nothing; ``opening`` sends a
control-channel opening message (any rank, any nonce: no secret needed) and
then stalls.
"""

from __future__ import annotations

import os
import selectors
import signal
import socket
import struct
import time

OPENING = b"RNDLCTL1" + struct.pack("!I", 1)
OTHER_USER = 65534


def _open(mode: str, target) -> socket.socket:
    if isinstance(target, str):
        sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        address = "\0" + target[1:]
    else:
        sock = socket.socket()
        address = target
    sock.settimeout(1.0)
    try:
        sock.connect(address)
        if mode == "opening":
            sock.sendall(OPENING + os.urandom(32))
    except OSError:  # refused, or the backlog is full: seen as closed, and tried again
        time.sleep(0.01)
    sock.setblocking(False)
    return sock


def _hold(mode: str, count: int, targets, report) -> None:
    stop = []
    signal.signal(signal.SIGTERM, lambda *_: stop.append(True))
    selector = selectors.DefaultSelector()
    for target in targets:
        for _ in range(count):
            selector.register(_open(mode, target), selectors.EVENT_READ, target)
    os.write(report, b"HOLDING\n")
    reopened = 0
    while not stop:
        for key, _ in selector.select(timeout=0.2):
            try:
                if key.fileobj.recv(4096):
                    continue  # the server's nonce or hello: never answered
            except BlockingIOError:
                continue
            except OSError:
                pass
            selector.unregister(key.fileobj)
            key.fileobj.close()
            selector.register(_open(mode, key.data), selectors.EVENT_READ, key.data)
            reopened += 1
    os.write(report, f"REOPENED {reopened}\n".encode())


class Attacker:
    """The attack running in a forked child; ``stop()`` returns how many connections the server closed."""

    def __init__(self, mode: str, count: int, targets, other_user: bool):
        read, write = os.pipe()
        self.pid = os.fork()
        if self.pid == 0:  # the child: drop to another user, attack until SIGTERM
            code = 1
            try:
                os.close(read)
                if other_user:
                    os.setgroups([])
                    os.setgid(OTHER_USER)
                    os.setuid(OTHER_USER)
                _hold(mode, count, targets, write)
                code = 0
            finally:
                os._exit(code)
        os.close(write)
        self._out = os.fdopen(read)
        line = self._out.readline()
        assert line == "HOLDING\n", f"the attacker did not start: {line!r}"

    def stop(self) -> int:
        os.kill(self.pid, signal.SIGTERM)
        text = self._out.read()
        self._out.close()
        os.waitpid(self.pid, 0)
        return int(text.split()[-1])
