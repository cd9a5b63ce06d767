"""Starting worker processes and relaying their output with rank prefixes.

Every line a worker writes comes out of the launcher as
``[<rank>]<stdout>:<line>`` on stdout or ``[<rank>]<stderr>:<line>`` on
stderr, as Horovod's gloo launcher prints it. Each worker runs in its own
process group so that the whole tree it starts can be signalled at once.
A local worker's command runs under :mod:`roundel.runner.reaper`, which stops its
process group when the launcher goes, even by ``kill -9``.
Workers on other hosts are started over ssh (:func:`start_remote`) through
:mod:`roundel.runner.remote`, and are stopped by closing the connection.
With an output directory, each rank's lines also go, unprefixed, to
``DIR/rank.<N>/stdout`` and ``DIR/rank.<N>/stderr`` (as Horovod writes them).
Progress bars that redraw a line come through live on a terminal, and as
finished lines (their last state) in pipes and files (:mod:`roundel.runner.redraw`).
"""

from __future__ import annotations

import collections
import json
import logging
import os
import queue
import shlex
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import BinaryIO, Mapping, TextIO

from roundel.rendezvous.identity import rendezvous_env
from roundel.runner.hosts import SlotInfo, validate_hostname
from roundel.runner.lost_ranks import EXIT_GRACE_S
from roundel.runner.redraw import LineAssembler, LivePrefixer
from roundel.runner.worker import Worker

__all__ = ["FORWARDED_NAMES", "FORWARDED_PREFIXES", "FORWARD_VARS", "GRACE_SECONDS", "HOST_SPECIFIC",
           "ProcessWorker", "REMOTE_ENV", "RemoteWorker", "STRICT_HOST_KEY_CHECKING", "TERMINAL", "WorkerGroup",
           "describe_exit", "exit_status", "is_shown", "prefix_output_with_timestamp", "rank_output_dir",
           "remote_env", "say", "show_ranks", "signal_name", "ssh_command", "start_local", "start_remote",
           "strict_host_key_args", "worker_env"]

GRACE_SECONDS = 5.0
"""How long workers get between SIGTERM and SIGKILL when the job is stopped."""

_OUTPUT_DRAIN_SECONDS = 2.0
_READ_SIZE = 65536

_write_lock = threading.Lock()
_timestamps = threading.Event()
_shown_ranks: frozenset | None = None  # None: every rank's output is shown


def show_ranks(ranks: frozenset | None) -> None:
    """Relay only ``ranks``' output to this process's stdout and stderr from now on (None: every
    rank's); the others' output still goes to ``--output-filename`` and is kept for error reports."""
    global _shown_ranks
    _shown_ranks = ranks


def is_shown(rank: int) -> bool:
    """Whether ``rank``'s output is relayed to this process's console."""
    return _shown_ranks is None or rank in _shown_ranks


def prefix_output_with_timestamp(enabled: bool) -> None:
    """Put the local time (``time.asctime()``) before the ``[rank]<stream>:`` prefix of every relayed
    line from now on, as ``horovodrun --prefix-output-with-timestamp`` does."""
    if enabled:
        _timestamps.set()
    else:
        _timestamps.clear()


TERMINAL = "ROUNDEL_TERMINAL"
"""Set to 1 for the ranks when roundelrun's stderr is a terminal: their redrawn lines (progress bars,
``\r``) are then shown live, though each rank's own stderr is a pipe."""


def worker_env(
    slot: SlotInfo,
    rendezvous_host: str,
    rendezvous_port: int,
    secret_hex: str,
    settings_env: Mapping[str, str],
    base: Mapping[str, str] | None = None,
) -> dict[str, str]:
    """The environment of the worker in ``slot``: ``base`` (default os.environ) plus
    its identity, the rendezvous address and secret, the settings, unbuffered output, TERMINAL
    when this process's stderr is a terminal, and TensorFlow's C++ log level at warnings
    (``TF_CPP_MIN_LOG_LEVEL=1``) unless the environment sets one."""
    env = dict(os.environ if base is None else base)
    env.pop(TERMINAL, None)
    if _is_terminal(sys.stderr):
        env[TERMINAL] = "1"
    env.setdefault("TF_CPP_MIN_LOG_LEVEL", "1")
    env.update(slot.to_identity().to_env())
    env.update(rendezvous_env(rendezvous_host, rendezvous_port, secret_hex))
    env.update(settings_env)
    env["PYTHONUNBUFFERED"] = "1"
    return env


def _is_terminal(stream: TextIO) -> bool:
    try:
        return stream.isatty()
    except (AttributeError, ValueError):
        return False


def _stamp(prefix: bytes) -> bytes:
    return (time.asctime().encode() + prefix) if _timestamps.is_set() else prefix


def say(line: str) -> None:
    """Write one of the launcher's own lines to stderr whole, never inside a line relayed from a rank."""
    _emit(sys.stderr, (line + "\n").encode(errors="replace"))


class LauncherLog(logging.Handler):
    """A log handler that writes each record as one of the launcher's own lines (``say``)."""

    def emit(self, record: logging.LogRecord) -> None:
        try:
            say(self.format(record))
        except Exception:  # as logging's own handlers: report, never raise into the caller
            self.handleError(record)


def _emit(stream: TextIO, data: bytes) -> None:
    """Write ``data`` to ``stream`` at once, never interleaved with another relay's write; never raises."""
    if not data:
        return
    out = getattr(stream, "buffer", None)
    try:
        with _write_lock:
            if out is not None:
                stream.flush()  # text written to the stream before goes first
                view = memoryview(data)
                while view:  # an unbuffered stream (PYTHONUNBUFFERED) may take part of it at a time
                    written = out.write(view)
                    if not written:
                        break  # a non-blocking stream that is full: drop the rest, never spin
                    view = view[written:]
                out.flush()
            else:
                stream.write(data.decode(errors="replace"))
                stream.flush()
    except (OSError, ValueError):
        pass  # our own output is gone (closed pipe); keep draining so the worker never blocks


def _relay(pipe: BinaryIO, prefix: bytes, stream: TextIO | None, log: BinaryIO | None = None,
           tail: collections.deque | None = None) -> None:
    """Copy ``pipe`` to ``stream`` (None: nowhere) with ``prefix`` before every line, and its finished
    lines, unprefixed, to ``log``; keep the last finished lines in ``tail``; never raises.

    A terminal gets redrawn lines (progress bars) live, the prefix repeated after each
    carriage return; anything else gets each line once, in the last state it was drawn in.
    """
    live = LivePrefixer(prefix) if stream is not None and _is_terminal(stream) else None
    lines = LineAssembler()
    with pipe:
        while True:
            try:
                data = pipe.read1(_READ_SIZE)
            except (OSError, ValueError):
                data = b""
            finished = lines.feed(data) if data else lines.flush()
            if tail is not None:
                tail.extend(finished)
            if log is not None and finished:
                try:
                    log.write(b"".join(finished))
                    log.flush()
                except (OSError, ValueError):
                    pass
            if live is not None:
                _emit(stream, live.feed(data, _stamp(prefix)) if data else live.finish())
            elif stream is not None:
                _emit(stream, b"".join(_stamp(prefix) + line for line in finished))
            if not data:
                return


class ProcessWorker(Worker):
    """A worker process started on this machine (under the reaper), and the threads relaying its output."""

    def __init__(self, slot: SlotInfo, process: subprocess.Popen, relays: list[threading.Thread],
                 stderr_tail: collections.deque):
        super().__init__(slot)
        self.process = process
        self._relays = relays
        self.stderr_tail = stderr_tail

    @property
    def returncode(self) -> int | None:
        """The exit status once reaped: negative for death by signal, None while running."""
        return self.process.returncode

    @property
    def where(self) -> str:
        """Where the worker runs, for the launcher's messages: the pid of its watchdog (its parent)."""
        return f"watchdog pid {self.process.pid}"

    def wait(self) -> int:
        """Block until the worker has ended; return its exit status."""
        return self.process.wait()

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


def rank_output_dir(output_dir: str, rank: int, size: int) -> Path:
    """``DIR/rank.<N>`` with N zero-padded to the width of the largest rank, as Horovod names it."""
    return Path(output_dir) / f"rank.{str(rank).zfill(len(str(max(size - 1, 0))))}"


def _start_relays(slot: SlotInfo, process: subprocess.Popen, output_dir: str | None, label: str | None = None
                  ) -> tuple[list[threading.Thread], collections.deque]:
    logs = {}
    if output_dir is not None:
        where = Path(output_dir) / f"worker.{label}" if label else rank_output_dir(output_dir, slot.rank, slot.size)
        where.mkdir(parents=True, exist_ok=True)
        logs = {name: open(where / name, "wb") for name in ("stdout", "stderr")}
    tail: collections.deque = collections.deque(maxlen=5)
    relays = []
    shown = is_shown(slot.rank)
    for pipe, name, stream in ((process.stdout, "stdout", sys.stdout), (process.stderr, "stderr", sys.stderr)):
        prefix = f"[{label or slot.rank}]<{name}>:".encode()
        stream = stream if shown else None
        log = logs.get(name)

        def run(pipe=pipe, prefix=prefix, stream=stream, log=log, name=name):
            try:
                _relay(pipe, prefix, stream, log, tail if name == "stderr" else None)
            finally:
                if log is not None:
                    log.close()

        relay = threading.Thread(target=run, name=f"roundel-relay-{slot.rank}-{name}", daemon=True)
        relay.start()
        relays.append(relay)
    return relays, tail


def start_local(slot: SlotInfo, command: list[str], env: Mapping[str, str],
                output_dir: str | None = None, label: str | None = None) -> ProcessWorker:
    """Start ``command`` on this machine as the worker of ``slot``, in a new process group.

    The command runs under :mod:`roundel.runner.reaper`, in the same group,
    which stops the whole group when this process ends, however it ends.
    Its output lines are prefixed with ``label`` (an elastic worker's id) instead of its rank.

    Raises OSError if the command cannot be started or the output directory not created.
    """
    process = subprocess.Popen(
        [sys.executable, "-m", "roundel.runner.reaper", *command],
        env=dict(env),
        stdin=subprocess.PIPE,  # never written: its end of file tells the reaper this process is gone
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        start_new_session=True,
    )
    relays, tail = _start_relays(slot, process, output_dir, label)
    return ProcessWorker(slot, process, relays, tail)


class RemoteWorker(ProcessWorker):
    """A worker on another host: ``process`` is the local ssh client.

    SIGTERM closes the ssh client's stdin, on which the remote side stops the
    worker's process group; SIGKILL kills the ssh client (the remote side then
    sees the connection close and stops the worker too).
    """

    remote = True

    @property
    def where(self) -> str:
        return "over ssh"

    def signal_group(self, signum: int) -> None:
        if signum == signal.SIGKILL:
            super().signal_group(signum)
            return
        if signum == signal.SIGCONT:
            return  # the remote side sends SIGCONT along with its own SIGTERM
        try:
            self.process.stdin.close()
        except (OSError, ValueError):
            pass


STRICT_HOST_KEY_CHECKING = ("yes", "no", "accept-new")
"""The values of ``--ssh-strict-host-key-checking`` (ssh's ``StrictHostKeyChecking``)."""


def ssh_command(host: str, remote_command: str, port: int | None = None, identity_file: str | None = None,
                connect_timeout: float | None = None, extra_args: str = "") -> list[str]:
    """The ssh invocation that runs ``remote_command`` on ``host``: ``BatchMode`` (never a password
    prompt), then ``extra_args`` (shell words: ``--ssh-strict-host-key-checking``'s option, then
    ``ROUNDEL_SSH_ARGS``; ssh keeps the first value given for an option). Host keys are otherwise
    checked as the user's ssh configuration says: roundel adds no ``StrictHostKeyChecking`` of its own.
    ``--`` ends ssh's options before the host. Raises ValueError for an unsafe host name."""
    validate_hostname(host, "ssh")
    cmd = ["ssh", "-o", "BatchMode=yes"]
    if connect_timeout:
        cmd += ["-o", f"ConnectTimeout={max(1, int(round(connect_timeout)))}"]
    if port is not None:
        cmd += ["-p", str(port)]
    if identity_file:
        cmd += ["-i", identity_file]
    cmd += shlex.split(extra_args)
    cmd += ["--", host, remote_command]
    return cmd


def strict_host_key_args(policy: str | None) -> str:
    """The ssh option words for ``--ssh-strict-host-key-checking POLICY`` ("" for None);
    raise ValueError for a policy ssh does not know."""
    if policy is None:
        return ""
    if policy not in STRICT_HOST_KEY_CHECKING:
        raise ValueError(f"--ssh-strict-host-key-checking {policy!r}: use one of {', '.join(STRICT_HOST_KEY_CHECKING)}")
    return f"-o StrictHostKeyChecking={policy}"


FORWARD_VARS = "ROUNDEL_FORWARD_ENV"
"""Comma-separated names (the ``-x`` ones) that go to remote workers in any case."""

REMOTE_ENV = "ROUNDEL_REMOTE_ENV"
"""What of the launcher's environment remote workers get: ``all`` (the default, as horovodrun: everything
but HOST_SPECIFIC) or ``listed`` (only FORWARDED_NAMES, FORWARDED_PREFIXES and the ``-x`` names);
``roundelrun --remote-env``."""

REMOTE_ENV_MODES = ("all", "listed")

FORWARDED_NAMES = frozenset({
    "PATH", "PYTHONPATH", "LD_LIBRARY_PATH", "PYTHONUNBUFFERED", "VIRTUAL_ENV", "LANG", "LC_ALL", "TZ",
    "CUDA_VISIBLE_DEVICES", "CUDA_DEVICE_ORDER", "OMP_NUM_THREADS", "MKL_NUM_THREADS", "TF_CPP_MIN_LOG_LEVEL",
})
"""With ``--remote-env listed``: the variables every remote worker gets (when set), besides the prefixes below."""

FORWARDED_PREFIXES = ("ROUNDEL_", "HOROVOD_", "NCCL_", "GLOO_")

HOST_SPECIFIC = frozenset({
    "HOSTNAME", "HOST", "PWD", "OLDPWD", "SHLVL", "_", "HOME", "USER", "LOGNAME", "MAIL", "SHELL", "TERM",
    "TERMCAP", "COLUMNS", "LINES", "DISPLAY", "XAUTHORITY", "WINDOWID", "TMUX", "TMUX_PANE", "STY", "WINDOW",
    "DBUS_SESSION_BUS_ADDRESS", "KRB5CCNAME", "GPG_AGENT_INFO", "MOTD_SHOWN", "PS1", "PS2", "PROMPT_COMMAND",
    "LS_COLORS", "CUDA_VISIBLE_DEVICES", "ROUNDEL_LAUNCHER_PID",
})
"""Variables of this machine or login session that a remote host sets for itself (horovodrun leaves out
``OLDPWD``, ``BASH_FUNC_*`` and ``CUDA_VISIBLE_DEVICES`` too); never sent with ``--remote-env all``."""

HOST_SPECIFIC_PREFIXES = ("SSH_", "XDG_", "BASH_FUNC_")


def _host_specific(name: str) -> bool:
    return name in HOST_SPECIFIC or name.startswith(HOST_SPECIFIC_PREFIXES)


def remote_env(env: Mapping[str, str]) -> dict[str, str]:
    """What of a worker's environment ``env`` is sent to another host (over ssh's stdin, never on a
    command line), by ``env[REMOTE_ENV]``:

    ``all`` (default), as horovodrun exports it: every variable except HOST_SPECIFIC ones (this
    machine's name, working directory, login session, terminal, ssh agent, GPUs: the remote host has
    its own). ``listed``: only roundel's and Horovod's identity and settings variables (``ROUNDEL_*``,
    ``HOROVOD_*``), ``NCCL_*``, ``GLOO_*`` and FORWARDED_NAMES; nothing else (credentials, tokens)
    leaves this machine. The ``-x`` names (``ROUNDEL_FORWARD_ENV``) are sent in both modes.
    Raises ValueError for another mode."""
    mode = env.get(REMOTE_ENV) or "all"
    if mode not in REMOTE_ENV_MODES:
        raise ValueError(f"{REMOTE_ENV}={mode!r}: use one of {', '.join(REMOTE_ENV_MODES)}")
    extra = {name for name in env.get(FORWARD_VARS, "").split(",") if name}
    if mode == "all":
        return {k: v for k, v in env.items() if k in extra or not _host_specific(k)}
    return {k: v for k, v in env.items()
            if k in FORWARDED_NAMES or k in extra or k.startswith(FORWARDED_PREFIXES)}


def start_remote(slot: SlotInfo, command: list[str], env: Mapping[str, str], rendezvous: tuple[str, int],
                 start_timeout: float, ssh_port: int | None = None, identity_file: str | None = None,
                 output_dir: str | None = None, python: str | None = None, cwd: str | None = None,
                 extra_ssh_args: str = "", label: str | None = None) -> RemoteWorker:
    """Start ``command`` as the worker of ``slot`` on host ``slot.hostname`` over ssh.

    The remote side runs ``cd CWD && exec PYTHON -m roundel.runner.remote`` with
    this machine's working directory and interpreter (the same paths must
    exist there) and gets the environment on stdin (:func:`remote_env`'s part of
    ``env``: by default all but this host's own variables, as horovodrun). Raises OSError if ssh cannot be started, ValueError for an unsafe host name.
    """
    cwd = cwd or os.getcwd()
    python = python or sys.executable
    remote_command = f"cd {shlex.quote(cwd)} && exec {shlex.quote(python)} -m roundel.runner.remote"
    cmd = ssh_command(slot.hostname, remote_command, ssh_port, identity_file, start_timeout, extra_ssh_args)
    process = subprocess.Popen(cmd, stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                               start_new_session=True)
    spec = {"rank": slot.rank, "host": slot.hostname, "command": list(command), "cwd": cwd,
            "env": remote_env(env), "rendezvous": list(rendezvous), "start_timeout": start_timeout}
    try:
        process.stdin.write(json.dumps(spec).encode() + b"\n")
        process.stdin.flush()
    except OSError:
        pass  # ssh already failed; its exit status and stderr say why
    relays, tail = _start_relays(slot, process, output_dir, label)
    return RemoteWorker(slot, process, relays, tail)


def signal_name(signum: int) -> str:
    try:
        return signal.Signals(signum).name
    except ValueError:
        return f"signal {signum}"


def describe_exit(worker: Worker, server=None, who: str | None = None) -> str:
    """Who failed and how, for the launcher's last line (a remote worker's own status from ``server``).

    ``who`` names the worker (default: its rank and host)."""
    code = worker.returncode
    who = who or f"rank {worker.rank} (host {worker.host})"
    if worker.remote and server is not None:
        recorded = server.get(f"launch/exit/{worker.rank}")
        if recorded is not None and int(recorded) != 0:
            code = int(recorded)  # the worker's own status, as the remote side saw it
        elif server.get(f"launch/started/{worker.rank}") is None:
            last = b"".join(worker.stderr_tail).decode(errors="replace").strip().splitlines()
            why = f": {last[-1]}" if last else ""
            if code == 254:
                return f"{who}: host {worker.host} could not reach the rendezvous server{why}"
            if "Host key verification failed" in why:
                why += (f" (add {worker.host}'s host key to your known_hosts, or pass "
                        "--ssh-strict-host-key-checking accept-new to accept a new key on first use)")
            return f"{who}: could not start on host {worker.host} over ssh (exit {code}){why}"
    if code < 0:
        return f"{who} was killed by signal {signal_name(-code)}{_known_cause(worker)}"
    return f"{who} exited with code {code}{_known_cause(worker)}"


def _known_cause(worker: Worker) -> str:
    """What the last lines of ``worker``'s stderr say about an abort roundel cannot catch ("" if nothing)."""
    if "Too many open files" not in b"".join(worker.stderr_tail).decode(errors="replace"):
        return ""
    return ("; it ran out of file descriptors (Gloo aborts a rank that runs out while accepting connections, "
            "as a burst of connections to its port from outside the job can make it): raise the hard open-file "
            "limit (ulimit -Hn), run the job on a private interface (--network-interface) or firewall its ports; "
            "see docs/security.md in roundel's repository, 'Network exposure'")


def own_exit_code(worker: Worker, server=None) -> int:
    """The worker's exit status; for a remote worker, as the remote side recorded it in ``server``."""
    code = worker.returncode
    if worker.remote and server is not None:
        recorded = server.get(f"launch/exit/{worker.rank}")
        if recorded is not None and int(recorded) != 0:
            code = int(recorded)
    return code


def exit_status(code: int) -> int:
    """The launcher's exit status for a worker's: 128+signal for a signal, 1..255 otherwise."""
    if code < 0:
        return 128 + (-code)
    return code if 1 <= code <= 255 else 1


LOST_POLL_SECONDS = 0.25


class WorkerGroup:
    """The running workers and the queue of events (worker exits, signals) the launcher reacts to."""

    def __init__(self):
        self.workers: list[Worker] = []
        self.events: queue.SimpleQueue = queue.SimpleQueue()

    def on_signal(self, signum, frame) -> None:
        self.events.put(("signal", signum))

    def add(self, worker: Worker) -> None:
        self.workers.append(worker)
        threading.Thread(
            target=self._wait, args=(worker,), name=f"roundel-wait-{worker.rank}", daemon=True
        ).start()

    def _wait(self, worker: Worker) -> None:
        worker.wait()
        self.events.put(("exit", worker))

    def watch(self, started=None, start_timeout: float = 0.0, lost=None) -> tuple[str, object] | None:
        """Wait until every worker exited 0 (None), one failed ("exit", worker), a signal came
        ("signal", num), or ``start_timeout`` seconds after the start ``started()`` still names workers
        that have not checked in ("timeout", [workers]).

        ``lost()``, asked every LOST_POLL_SECONDS, names workers the others declared lost (stopped,
        hung or cut off: they would never exit). Those that have not exited ``EXIT_GRACE_S`` after they
        were first named are killed, and the others may finish handling the error; if the others then
        all exit 0, the result is ("lost", [workers]).
        """
        running = set(self.workers)
        killed: list[Worker] = []
        named: dict[Worker, float] = {}  # a worker lost() named -> when it was first named
        deadline = time.monotonic() + start_timeout if started is not None else None
        while running - set(killed):
            waits = [] if deadline is None else [max(0.0, deadline - time.monotonic())]
            if lost is not None:
                waits.append(LOST_POLL_SECONDS)
            try:
                kind, item = self.events.get(timeout=min(waits) if waits else None)
            except queue.Empty:
                if deadline is not None and time.monotonic() >= deadline:
                    late = [w for w in started() if w in running]
                    if late:
                        return "timeout", late
                    deadline = None
                now = time.monotonic()
                for worker in lost() if lost is not None else ():
                    if worker in running and worker not in killed and \
                            now - named.setdefault(worker, now) >= EXIT_GRACE_S:
                        worker.signal_group(signal.SIGKILL)
                        killed.append(worker)
                continue
            if kind == "signal":
                return kind, item
            running.discard(item)
            if item.returncode != 0 and item not in killed:
                return kind, item
        return ("lost", killed) if killed else None

    def settle(self, timeout: float) -> list[Worker]:
        """Wait up to ``timeout`` seconds for the workers still running to exit by themselves (a signal to
        the launcher ends the wait, and stays queued for :meth:`stop`); return the workers whose exits were
        queued, in the order they came."""
        exited: list[Worker] = []
        deadline = time.monotonic() + timeout
        while True:
            wait = deadline - time.monotonic()
            if not any(w.returncode is None for w in self.workers):
                wait = 0.05  # all have ended: their exits are queued, or are about to be
            try:
                kind, item = self.events.get(timeout=max(0.0, wait))
            except queue.Empty:
                return exited
            if kind == "signal":
                self.events.put((kind, item))
                return exited
            exited.append(item)

    def stop(self) -> None:
        """SIGTERM (and SIGCONT, so that a stopped worker handles it) every process group, wait up to
        GRACE_SECONDS (cut short by another signal), then SIGKILL, which ends even a stopped process."""
        for worker in self.workers:
            worker.signal_group(signal.SIGTERM)
            worker.signal_group(signal.SIGCONT)
        deadline = time.monotonic() + GRACE_SECONDS
        while any(w.returncode is None for w in self.workers):
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                break
            try:
                kind, _ = self.events.get(timeout=remaining)
            except queue.Empty:
                break
            if kind == "signal":
                break
        for worker in self.workers:
            worker.signal_group(signal.SIGKILL)
        for worker in self.workers:
            worker.wait()

    def drain_output(self) -> None:
        deadline = time.monotonic() + _OUTPUT_DRAIN_SECONDS
        for worker in self.workers:
            worker.join_output(max(0.0, deadline - time.monotonic()))
