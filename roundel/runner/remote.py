"""The process ``roundelrun`` starts on a remote host over ssh: ``python -m roundel.runner.remote``.

It reads one JSON line from stdin (the worker's command, working directory,
environment, rank and rendezvous address; the job secret travels here rather
than on a command line that ``ps`` would show), checks in with the launcher's
rendezvous store (so a host that cannot reach it fails at once with a clear
message), starts the command in its own process group, and waits.

Stopping is tied to the ssh connection: when stdin reaches end of file
(roundelrun closed it, or the connection or roundelrun died) or this process
gets SIGTERM/SIGHUP/SIGINT, the worker's whole process group gets SIGTERM
and, after a grace period, SIGKILL. Nothing is left running on the host.
When the worker exits, whatever it left running in its process group is
stopped the same way (it would otherwise hold the ssh session open).
The worker's exit status is recorded in the store under
``launch/exit/<rank>`` (negative: killed by that signal) and becomes this
process's status (128 + signal for a signal).
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import threading

from roundel.rendezvous.store import RendezvousClient, RendezvousError

GRACE_SECONDS = 3.0
"""Between SIGTERM and SIGKILL of the remote worker's process group."""

UNREACHABLE_EXIT = 254
"""This process's status when the launcher's rendezvous store cannot be reached."""


def _stop_group(process: subprocess.Popen, done: threading.Event) -> None:
    """SIGTERM the worker's group (with SIGCONT, so a stopped worker handles it), then after
    GRACE_SECONDS SIGKILL, which ends stopped processes too."""
    for signum, wait in ((signal.SIGTERM, GRACE_SECONDS), (signal.SIGKILL, None)):
        try:
            os.killpg(process.pid, signum)
            if signum == signal.SIGTERM:
                os.killpg(process.pid, signal.SIGCONT)
        except (ProcessLookupError, PermissionError):
            return
        if wait is not None and done.wait(wait):
            # the leader is gone; still make sure no member of its group outlives it
            try:
                os.killpg(process.pid, signal.SIGKILL)
            except (ProcessLookupError, PermissionError):
                pass
            return


def _reap_group(pgid: int) -> None:
    """Stop what the worker left running in its process group (it would hold the ssh session open):
    SIGTERM, up to GRACE_SECONDS, then SIGKILL."""
    import time

    deadline = time.monotonic() + GRACE_SECONDS
    signum = signal.SIGTERM
    while True:
        try:
            os.killpg(pgid, signum)
            if signum == signal.SIGTERM:
                os.killpg(pgid, signal.SIGCONT)
        except (ProcessLookupError, PermissionError):
            return
        if signum == signal.SIGKILL:
            return
        if time.monotonic() > deadline:
            signum = signal.SIGKILL
        time.sleep(0.05)
        signum = signal.SIGKILL if time.monotonic() > deadline else 0


def _read_line(fd: int) -> bytes:
    """The first line on ``fd``, read unbuffered (a buffered reader's lock upsets interpreter exit
    while another thread still waits on it)."""
    data = b""
    while b"\n" not in data:
        chunk = os.read(fd, 65536)
        if not chunk:
            break
        data += chunk
    return data.split(b"\n", 1)[0]


def main() -> int:
    spec = json.loads(_read_line(0))
    rank, host = spec["rank"], spec["host"]
    env = dict(os.environ)
    env.update(spec["env"])


    addr, port = spec["rendezvous"]
    try:
        client = RendezvousClient(addr, int(port), bytes.fromhex(env["ROUNDEL_SECRET"]),
                                  connect_timeout=float(spec["start_timeout"]))
        client.set(f"launch/started/{rank}", b"1")
    except RendezvousError as exc:
        print(f"roundelrun: host {host} (rank {rank}) cannot reach the launcher: {exc}", file=sys.stderr)
        return UNREACHABLE_EXIT
    try:
        process = subprocess.Popen(spec["command"], env=env, cwd=spec["cwd"], stdin=subprocess.DEVNULL,
                                   start_new_session=True)
    except OSError as exc:
        print(f"roundelrun: cannot start rank {rank} on host {host}: {exc}", file=sys.stderr)
        client.set(f"launch/exit/{rank}", b"127")
        client.close()
        return 127
    done = threading.Event()
    stopping = threading.Lock()

    def stop(*_):
        if stopping.acquire(blocking=False):
            threading.Thread(target=_stop_group, args=(process, done), daemon=True).start()

    for signum in (signal.SIGTERM, signal.SIGHUP, signal.SIGINT):
        signal.signal(signum, stop)

    def watch_stdin():
        try:
            while os.read(0, 4096):
                pass
        except OSError:
            pass
        stop()

    threading.Thread(target=watch_stdin, daemon=True).start()
    code = process.wait()
    done.set()
    _reap_group(process.pid)
    try:
        client.set(f"launch/exit/{rank}", str(code).encode())
    except RendezvousError:
        pass
    client.close()
    return 128 - code if code < 0 else code


if __name__ == "__main__":
    sys.exit(main())
