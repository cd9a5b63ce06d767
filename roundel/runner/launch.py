"""``roundelrun``: start a job's workers with their identities and watch over them.

The launcher assigns ranks to host slots, starts a rendezvous store, starts
one worker per rank, and relays their output. When a worker fails, or the
launcher gets SIGINT/SIGTERM, every worker's process group gets SIGTERM and,
after a grace period, SIGKILL; the exit status says what happened.
"""

from __future__ import annotations

import argparse
import os
import queue
import shlex
import signal
import sys
import threading
import time

from roundel.common.errors import SettingsError
from roundel.common.settings import Settings, env_for_flags
from roundel.runner import hosts as hostlib
from roundel.runner import spawn
from roundel.runner.rendezvous import RendezvousServer, new_secret

__all__ = ["GRACE_SECONDS", "main", "run"]

GRACE_SECONDS = 5.0
"""How long workers get between SIGTERM and SIGKILL when the job is stopped."""

_OUTPUT_DRAIN_SECONDS = 2.0


class _UsageError(Exception):
    """A bad command line or setting, reported before anything starts."""


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="roundelrun",
        description="Run a command as the ranks of a roundel (Horovod-style) distributed job.",
        allow_abbrev=False,
    )
    p.add_argument("-np", "--num-proc", dest="np", type=int, required=True, help="number of ranks to start")
    where = p.add_mutually_exclusive_group()
    where.add_argument("-H", "--hosts", help="hosts and their slots, e.g. a:2,b:2 (default localhost:NP)")
    where.add_argument("--hostfile", help="file of 'host slots=N' lines")
    p.add_argument("--fusion-threshold-mb", type=float, help="fuse tensors up to this many MiB (0 disables)")
    p.add_argument("--cycle-time-ms", type=float, help="milliseconds between engine cycles")
    p.add_argument("--cache-capacity", type=int, help="entries in the response cache")
    p.add_argument("--disable-cache", action="store_true", help="turn the response cache off")
    p.add_argument("--timeline-filename", help="write a timeline of collectives to this file")
    p.add_argument("--start-timeout", type=float, help="seconds workers wait for each other at start")
    p.add_argument("--verbose", action="store_true", help="print the launch plan and log at debug level")
    p.add_argument(
        "-x", dest="export", action="append", default=[], metavar="VAR[=VALUE]",
        help="pass VAR (from this environment, or set to VALUE) to the workers; may repeat",
    )
    p.add_argument("command", nargs=argparse.REMAINDER, help="the command each rank runs")
    return p


def _host_list(args: argparse.Namespace) -> list[tuple[str, int]]:
    if args.hostfile:
        try:
            return hostlib.parse_hostfile(args.hostfile)
        except OSError as exc:
            raise _UsageError(f"cannot read hostfile: {exc}") from None
    return hostlib.parse_hosts(args.hosts or f"localhost:{args.np}")


def _exports(names: list[str]) -> dict[str, str]:
    env = {}
    for item in names:
        name, sep, value = item.partition("=")
        if not sep:
            if name not in os.environ:
                raise _UsageError(f"-x {name}: {name} is not set in roundelrun's environment")
            value = os.environ[name]
        env[name] = value
    return env


_VALUE_FLAGS = (
    ("--fusion-threshold-mb", "fusion_threshold_mb"),
    ("--cycle-time-ms", "cycle_time_ms"),
    ("--cache-capacity", "cache_capacity"),
    ("--timeline-filename", "timeline_filename"),
)


def _settings_env(args: argparse.Namespace) -> dict[str, str]:
    """The worker environment for the settings flags and ``-x``; raise _UsageError naming a bad flag."""
    env = {}
    for flag, field in _VALUE_FLAGS:
        value = getattr(args, field)
        if value is not None:
            try:
                env.update(env_for_flags(**{field: value}))
            except SettingsError as exc:
                raise _UsageError(str(exc) if flag in str(exc) else f"{flag} {value}: {exc}") from None
    if args.start_timeout is not None:
        env["ROUNDEL_START_TIMEOUT"] = repr(args.start_timeout)
        try:
            Settings.from_env({"ROUNDEL_START_TIMEOUT": env["ROUNDEL_START_TIMEOUT"]})
        except SettingsError as exc:
            raise _UsageError(f"--start-timeout {args.start_timeout:g}: {exc}") from None
    env.update(env_for_flags(disable_cache=args.disable_cache, verbose=args.verbose))
    env.update(_exports(args.export))
    Settings.from_env({**os.environ, **env})  # the workers' whole environment must be valid too
    return env


def _plan(args: argparse.Namespace) -> tuple[list[hostlib.SlotInfo], dict[str, str]]:
    """The slots to start and the settings environment; raise _UsageError, ValueError or SettingsError."""
    if args.np < 1:
        raise _UsageError(f"-np must be at least 1, not {args.np}")
    settings_env = _settings_env(args)
    slots = hostlib.assign_slots(_host_list(args), args.np)
    remote = sorted({s.hostname for s in slots if not hostlib.is_local_host(s.hostname)})
    if remote:
        raise _UsageError(
            f"{', '.join(remote)} {'is' if len(remote) == 1 else 'are'} not this machine: "
            "remote hosts need ssh support, which is not available yet"
        )
    return slots, settings_env


def _signal_name(signum: int) -> str:
    try:
        return signal.Signals(signum).name
    except ValueError:
        return f"signal {signum}"


def _describe_exit(worker: spawn.Worker) -> str:
    code = worker.returncode
    who = f"rank {worker.slot.rank} (host {worker.slot.hostname})"
    if code < 0:
        return f"{who} was killed by signal {_signal_name(-code)}"
    return f"{who} exited with code {code}"


def _exit_status(code: int) -> int:
    if code < 0:
        return 128 + (-code)
    return code if 1 <= code <= 255 else 1


class _Job:
    """The running workers and the queue of events (worker exits, signals) the launcher reacts to."""

    def __init__(self):
        self.workers: list[spawn.Worker] = []
        self.events: queue.SimpleQueue = queue.SimpleQueue()

    def on_signal(self, signum, frame) -> None:
        self.events.put(("signal", signum))

    def add(self, worker: spawn.Worker) -> None:
        self.workers.append(worker)
        threading.Thread(
            target=self._wait, args=(worker,), name=f"roundel-wait-{worker.slot.rank}", daemon=True
        ).start()

    def _wait(self, worker: spawn.Worker) -> None:
        worker.process.wait()
        self.events.put(("exit", worker))

    def watch(self) -> tuple[str, object] | None:
        """Wait until every worker exited 0 (None), one failed ("exit", worker), or a signal came ("signal", num)."""
        running = set(self.workers)
        while running:
            kind, item = self.events.get()
            if kind == "signal":
                return kind, item
            running.discard(item)
            if item.returncode != 0:
                return kind, item
        return None

    def stop(self) -> None:
        """SIGTERM every process group, wait up to GRACE_SECONDS (cut short by another signal), then SIGKILL."""
        for worker in self.workers:
            worker.signal_group(signal.SIGTERM)
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
            worker.process.wait()

    def drain_output(self) -> None:
        deadline = time.monotonic() + _OUTPUT_DRAIN_SECONDS
        for worker in self.workers:
            worker.join_output(max(0.0, deadline - time.monotonic()))


def _print_plan(slots: list[hostlib.SlotInfo], command: list[str], port: int) -> None:
    err = sys.stderr
    print(f"roundelrun: rendezvous server at 127.0.0.1:{port}", file=err)
    for s in slots:
        print(
            f"roundelrun: rank {s.rank} on {s.hostname} (local_rank {s.local_rank}/{s.local_size}, "
            f"cross_rank {s.cross_rank}/{s.cross_size}): {shlex.join(command)}",
            file=err,
        )
    err.flush()


def _launch(args: argparse.Namespace, slots: list[hostlib.SlotInfo], settings_env: dict[str, str]) -> int:
    job = _Job()
    handled = (signal.SIGINT, signal.SIGTERM)
    in_main = threading.current_thread() is threading.main_thread()
    previous = {s: signal.signal(s, job.on_signal) for s in handled} if in_main else {}
    secret = new_secret()
    server = RendezvousServer(secret, host="127.0.0.1")
    try:
        port = server.start()
        if args.verbose:
            _print_plan(slots, args.command, port)
        for slot in slots:
            env = spawn.worker_env(slot, "127.0.0.1", port, secret.hex(), settings_env)
            try:
                job.add(spawn.start_local(slot, args.command, env))
            except OSError as exc:
                job.stop()
                job.drain_output()
                print(f"roundelrun: cannot start rank {slot.rank}: {exc}", file=sys.stderr)
                return 127
        outcome = job.watch()
        if outcome is None:
            job.drain_output()
            return 0
        job.stop()
        job.drain_output()
        kind, item = outcome
        if kind == "signal":
            print(f"roundelrun: received {_signal_name(item)}; stopped all ranks", file=sys.stderr)
            return 128 + item
        others = "; stopped the other ranks" if len(job.workers) > 1 else ""
        print(f"roundelrun: {_describe_exit(item)}{others}", file=sys.stderr)
        return _exit_status(item.returncode)
    finally:
        server.stop()
        for signum, handler in previous.items():
            signal.signal(signum, handler)


def run(argv: list[str]) -> int:
    """Run ``roundelrun`` with command-line arguments ``argv``; return the exit status.

    2 for a usage or settings error (nothing is started), 0 when every rank
    exited 0, the failing rank's status (128+signal for a signal) when one
    failed, and 128+signal when the launcher itself was interrupted.
    """
    parser = _parser()
    try:
        args = parser.parse_args(argv)
    except SystemExit as exc:
        return exc.code if isinstance(exc.code, int) else 2
    if args.command and args.command[0] == "--":
        args.command = args.command[1:]
    if not args.command:
        parser.print_usage(sys.stderr)
        print("roundelrun: error: no command given; put the command to run after the options", file=sys.stderr)
        return 2
    try:
        slots, settings_env = _plan(args)
    except (_UsageError, ValueError, SettingsError) as exc:
        print(f"roundelrun: error: {exc}", file=sys.stderr)
        return 2
    return _launch(args, slots, settings_env)


def main() -> int:
    """Console entry point of ``roundelrun``."""
    return run(sys.argv[1:])


if __name__ == "__main__":
    sys.exit(main())
