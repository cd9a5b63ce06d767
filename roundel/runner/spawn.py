"""Starting worker processes and relaying their output with rank prefixes.

Every line a worker writes comes out of the launcher as
``[<rank>]<stdout>:<line>`` on stdout or ``[<rank>]<stderr>:<line>`` on
stderr, as Horovod's gloo launcher prints it. Each worker runs in its own
process group so that the whole tree it starts can be signalled at once.
Only local workers exist so far; a remote starter (ssh) will return the same
:class:`Worker`.
"""

from __future__ import annotations

import os
import subprocess
import sys
import threading
from typing import BinaryIO, Mapping, TextIO

from roundel.common.identity import rendezvous_env
from roundel.runner.hosts import SlotInfo

__all__ = ["Worker", "start_local", "worker_env"]

_write_lock = threading.Lock()


def worker_env(
    slot: SlotInfo,
    rendezvous_host: str,
    rendezvous_port: int,
    secret_hex: str,
    settings_env: Mapping[str, str],
    base: Mapping[str, str] | None = None,
) -> dict[str, str]:
    """The environment of the worker in ``slot``: ``base`` (default os.environ) plus
    its identity, the rendezvous address and secret, the settings, and unbuffered output."""
    env = dict(os.environ if base is None else base)
    env.update(slot.to_identity().to_env())
    env.update(rendezvous_env(rendezvous_host, rendezvous_port, secret_hex))
    env.update(settings_env)
    env["PYTHONUNBUFFERED"] = "1"
    return env


def _relay(pipe: BinaryIO, prefix: bytes, stream: TextIO) -> None:
    """Copy ``pipe`` to ``stream`` line by line, each line prefixed; never raises."""
    out = getattr(stream, "buffer", None)
    with pipe:
        for line in iter(pipe.readline, b""):
            if not line.endswith(b"\n"):
                line += b"\n"
            try:
                with _write_lock:
                    if out is not None:
                        out.write(prefix + line)
                        out.flush()
                    else:
                        stream.write((prefix + line).decode(errors="replace"))
                        stream.flush()
            except (OSError, ValueError):
                pass  # our own output is gone (closed pipe); keep draining so the worker never blocks


class Worker:
    """A started worker process, its slot, and the threads relaying its output."""

    def __init__(self, slot: SlotInfo, process: subprocess.Popen, relays: list[threading.Thread]):
        self.slot = slot
        self.process = process
        self._relays = relays

    @property
    def returncode(self) -> int | None:
        """The exit status once reaped: negative for death by signal, None while running."""
        return self.process.returncode

    def signal_group(self, signum: int) -> None:
        """Send ``signum`` to the worker's whole process group; ignore a group already gone."""
        try:
            os.killpg(self.process.pid, signum)
        except (ProcessLookupError, PermissionError):
            pass

    def join_output(self, timeout: float) -> None:
        """Wait up to ``timeout`` seconds for the worker's output to be relayed completely."""
        for relay in self._relays:
            relay.join(timeout)


def start_local(slot: SlotInfo, command: list[str], env: Mapping[str, str]) -> Worker:
    """Start ``command`` on this machine as the worker of ``slot``, in a new process group.

    Raises OSError if the command cannot be started.
    """
    process = subprocess.Popen(
        command,
        env=dict(env),
        stdin=subprocess.DEVNULL,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        start_new_session=True,
    )
    relays = []
    for pipe, name, stream in ((process.stdout, "stdout", sys.stdout), (process.stderr, "stderr", sys.stderr)):
        prefix = f"[{slot.rank}]<{name}>:".encode()
        relay = threading.Thread(
            target=_relay, args=(pipe, prefix, stream), name=f"roundel-relay-{slot.rank}-{name}", daemon=True
        )
        relay.start()
        relays.append(relay)
    return Worker(slot, process, relays)
