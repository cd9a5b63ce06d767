"""The watchdog between ``roundelrun`` and one local rank: ``python -m roundel.runner.reaper COMMAND...``.

roundelrun starts it as the leader of a new process group, with a pipe on
its stdin that only roundelrun holds open. It starts the rank's command in
the same group and waits for it. Whatever ends roundelrun (an exit, a crash,
``kill -9``) closes that pipe; then everything in the group (the command, a
wrapper script's children, whatever they started) gets SIGTERM, and SIGKILL
after GRACE_SECONDS. What the command leaves running in the group when it
exits is stopped the same way. So nothing a rank starts outlives the launcher
(short of leaving the process group on purpose, as ``setsid`` does).

roundelrun's own signals to the group reach the command directly: this
process ignores SIGTERM and SIGINT and waits for it, and SIGKILL ends both.
Its exit status is the command's (death by a signal is passed on as the same
signal).
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import threading
import time

from roundel.rendezvous.identity import LAUNCHER_PID

GRACE_SECONDS = 5.0
"""Between SIGTERM and SIGKILL of what is left in the rank's process group."""

_POLL_SECONDS = 0.05


def _others_in_group() -> list[int]:
    """The other live processes of this process group (Linux: from /proc; elsewhere none are known)."""
    me, group = os.getpid(), os.getpgid(0)
    found = []
    try:
        entries = os.listdir("/proc")
    except OSError:
        return found
    for entry in entries:
        if not entry.isdigit() or int(entry) == me:
            continue
        try:
            with open(f"/proc/{entry}/stat", "rb") as f:
                fields = f.read().rsplit(b")", 1)[1].split()
        except (OSError, IndexError):
            continue
        if len(fields) > 2 and fields[0] != b"Z" and int(fields[2]) == group:  # state, ppid, pgrp
            found.append(int(entry))
    return found


def _stop_group() -> None:
    """SIGTERM (and SIGCONT) the group but this process, wait up to GRACE_SECONDS for it to empty,
    then SIGKILL what is left."""
    try:
        os.killpg(0, signal.SIGTERM)  # ignored here
        os.killpg(0, signal.SIGCONT)
    except (ProcessLookupError, PermissionError):
        return
    deadline = time.monotonic() + GRACE_SECONDS
    while time.monotonic() < deadline:
        if not _others_in_group():
            return
        time.sleep(_POLL_SECONDS)
    for pid in _others_in_group():
        try:
            os.kill(pid, signal.SIGKILL)
        except (ProcessLookupError, PermissionError):
            pass


def _watch_launcher(process: subprocess.Popen) -> None:
    """Block until roundelrun's pipe closes, then stop the whole group and exit."""
    try:
        while os.read(0, 4096):
            pass
    except OSError:
        pass
    _stop_group()
    process.wait()
    os._exit(1)


def main(argv: list[str]) -> int:
    if not argv:
        print("usage: python -m roundel.runner.reaper COMMAND [ARGS...]", file=sys.stderr)
        return 2
    for signum in (signal.SIGTERM, signal.SIGINT):
        signal.signal(signum, signal.SIG_IGN)
    env = dict(os.environ, **{LAUNCHER_PID: str(os.getpid())})  # a Python rank follows this process
    try:  # the command must not inherit the ignored signals
        process = subprocess.Popen(argv, env=env, stdin=subprocess.DEVNULL, preexec_fn=_default_signals)
    except OSError as exc:
        rank = os.environ.get("ROUNDEL_RANK")
        print(f"roundelrun: cannot start {f'rank {rank}' if rank else 'the worker'}: {exc}", file=sys.stderr)
        return 127
    threading.Thread(target=_watch_launcher, args=(process,), daemon=True).start()
    code = process.wait()
    if _others_in_group():
        _stop_group()
    if code < 0:  # die of the same signal (SIGKILL cannot be handled, so it needs no reset)
        if -code != signal.SIGKILL:
            signal.signal(-code, signal.SIG_DFL)
        os.kill(os.getpid(), -code)
    return code if code >= 0 else 128 - code


def _default_signals() -> None:
    for signum in (signal.SIGTERM, signal.SIGINT):
        signal.signal(signum, signal.SIG_DFL)


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
