"""``roundelrun``'s elastic mode: keep a job running while hosts come, go and fail.

The driver polls the host discovery script, starts one worker per usable
slot (up to ``--max-np``), and forms *generations* of the job through the
rendezvous store (see :mod:`roundel.rendezvous.elastic_join`):

* at the start, once at least ``--min-np`` slots exist;
* after a worker fails, or a peer reports it lost (silent, e.g. SIGSTOPped:
  the driver SIGKILLs it): its host is blacklisted (no workers there, for
  good or for a cooldown), and, as in Horovod, the other workers on that host
  are taken out of the job too (SIGTERM; their exits are not failures); a
  replacement is started on a free slot of another host if there is one,
  and the survivors, which see the failure as an error in their training
  loop (or, still connecting to the generation, see it abandoned), roll
  back to their last commit and join again;
* after discovery adds or removes hosts: new workers are started, workers on
  removed hosts are told to leave, and ``hosts_version`` is bumped so that
  every rank stops at the same ``commit()`` and joins again.

A generation is formed only when every live worker the driver keeps has
joined; survivors keep their relative order, so rank 0 always holds current
state. The job ends with status 0 once the workers of the last generation
have all exited 0 (or every worker exited 0 without ever joining one; once
a worker has exited 0 no new one is started), and with an error (never a hang) when the workers of a
generation fail or every host they ran on is blacklisted, fewer than ``--min-np`` slots remain for
``--elastic-timeout`` seconds, workers do not rejoin within that time (or join the first generation
within ``--start-timeout``), or more resets than ``--reset-limit`` are needed.
"""

from __future__ import annotations

import dataclasses
import enum
import os
import queue
import signal
import threading
import time
from typing import Callable

from roundel.common.settings import setting
from roundel.rendezvous.identity import cross_ranks, rendezvous_env
from roundel.rendezvous import elastic_join as protocol
from roundel.runner import spawn
from roundel.runner.discovery import Blacklist, FixedHosts, HostSource
from roundel.runner.hosts import SlotInfo, is_local_host
from roundel.runner.lost_ranks import EXIT_GRACE_S, describe_lost, lost_ranks
from roundel.runner.worker import Worker
from roundel.rendezvous.store import RendezvousServer

__all__ = ["ElasticSettings", "IllegalTransition", "MemberEvent", "MemberState", "run"]

_ELASTIC_TIMEOUT_VAR = setting("elastic_timeout_s").var

_TICK_S = 0.1
DISCOVERY_INTERVAL_S = 1.0


@dataclasses.dataclass
class ElasticSettings:
    """The elastic flags of ``roundelrun``, checked by the launcher."""

    command: list[str]
    min_np: int
    max_np: int | None
    discovery: HostSource
    blacklist: Blacklist
    elastic_timeout_s: float
    reset_limit: int | None
    settings_env: dict[str, str]
    start_timeout_s: float
    output_dir: str | None = None
    ssh_port: int | None = None
    ssh_identity_file: str | None = None
    ssh_args: str = ""
    # starts a worker some other way than as a process (roundel.ray's actors): (slot, env, label) -> Worker
    start_worker: Callable[[SlotInfo, dict[str, str], str], Worker] | None = None
    # as Horovod: a failure takes every worker on its host out of the job (the host gets no slots)
    evict_host_on_failure: bool = True


class IllegalTransition(RuntimeError):
    """A member was asked to change state in a way its state machine (:class:`MemberState`) does not allow."""


class MemberEvent(enum.Enum):
    """What can happen to a started worker, as far as the driver is concerned."""

    LEAVE = "leave"
    """Discovery no longer offers its slot: it is told to leave at its next join."""
    EVICT = "evict"
    """Its host was blacklisted after another worker there failed: it is stopped (SIGTERM)."""
    LOSE = "lose"
    """A peer reported it silent (stopped, hung, cut off): the driver SIGKILLs it."""


class MemberState(enum.Enum):
    """The life of one worker the elastic driver started (a member), and what its exit then means.

    Every member starts RUNNING. Three things can happen to it before it
    exits, each at most once: it is told to leave (LEAVE), its host is
    blacklisted (EVICT, which includes leaving), it is reported lost and killed
    (LOSE). A state is which of them have happened::

        event   RUNNING  LEAVING       EVICTED       LOST          LOST_LEAVING  LOST_EVICTED
        LEAVE   LEAVING  -             -             LOST_LEAVING  -             -
        EVICT   EVICTED  EVICTED       -             LOST_EVICTED  LOST_EVICTED  -
        LOSE    LOST     LOST_LEAVING  LOST_EVICTED  -             -             -

    ("-": not allowed; :meth:`after` raises IllegalTransition). A member can
    exit in any state; the driver then drops it from its live members and
    reads its last state to know what the exit means:

    * RUNNING, LOST: *kept*: holds its slot, counts toward ``--min-np``, and a
      new generation waits for it to join. Its exit status 0 means the job is
      finishing; any other status is a failure (blacklist, replacement, reset).
    * LEAVING, LOST_LEAVING: answered "removed" when it joins; exit status 0 is
      no event, any other status a failure.
    * EVICTED, LOST_EVICTED: answered "removed" when it joins; its exit is no event.
    * LOST, LOST_LEAVING, LOST_EVICTED: already SIGKILLed; never killed again.
    """

    RUNNING = "running"
    LEAVING = "leaving"
    EVICTED = "evicted"
    LOST = "lost"
    LOST_LEAVING = "lost, leaving"
    LOST_EVICTED = "lost, evicted"

    @property
    def kept(self) -> bool:
        """Whether the member holds its slot and belongs in the next generation."""
        return self in (MemberState.RUNNING, MemberState.LOST)

    @property
    def leaving(self) -> bool:
        """Whether the member is told "removed" at its next join (and not counted as kept)."""
        return self in (MemberState.LEAVING, MemberState.LOST_LEAVING, MemberState.EVICTED, MemberState.LOST_EVICTED)

    @property
    def evicted(self) -> bool:
        """Whether the member was stopped because its host was blacklisted: its exit is no event."""
        return self in (MemberState.EVICTED, MemberState.LOST_EVICTED)

    @property
    def lost(self) -> bool:
        """Whether the member was reported lost and SIGKILLed already."""
        return self in (MemberState.LOST, MemberState.LOST_LEAVING, MemberState.LOST_EVICTED)

    def after(self, event: MemberEvent) -> "MemberState":
        """The state after ``event``; raises IllegalTransition when ``event`` cannot happen in this state."""
        following = _TRANSITIONS[event].get(self)
        if following is None:
            raise IllegalTransition(f"a member that is {self.value} cannot {event.value}")
        return following


_S = MemberState
_TRANSITIONS = {
    MemberEvent.LEAVE: {_S.RUNNING: _S.LEAVING, _S.LOST: _S.LOST_LEAVING},
    MemberEvent.EVICT: {_S.RUNNING: _S.EVICTED, _S.LEAVING: _S.EVICTED, _S.LOST: _S.LOST_EVICTED,
                        _S.LOST_LEAVING: _S.LOST_EVICTED},
    MemberEvent.LOSE: {_S.RUNNING: _S.LOST, _S.LEAVING: _S.LOST_LEAVING, _S.EVICTED: _S.LOST_EVICTED},
}


@dataclasses.dataclass(eq=False)
class _Member:
    """One started worker and where it is in its life (:class:`MemberState`)."""

    serial: int
    host: str
    index: int  # slot on its host
    worker: Worker
    last_rank: int | None = None  # rank in the latest generation it belonged to
    answered: int = 0  # join count already answered
    state: MemberState = MemberState.RUNNING

    def on(self, event: MemberEvent) -> None:
        """Move to the state after ``event``; raises IllegalTransition."""
        self.state = self.state.after(event)

    @property
    def label(self) -> str:
        return f"{self.host}:{self.index}"

    @property
    def worker_id(self) -> str:
        return _worker_id(self.label, self.serial)


def _worker_id(label: str, serial: int) -> str:
    return f"{label}#{serial}"


class _JobFailed(Exception):
    """The job cannot go on; the message says why."""


class _Driver:
    def __init__(self, settings: ElasticSettings, server: RendezvousServer, secret: bytes,
                 address_for: Callable[[str], str]):
        self.s = settings
        self.server = server
        self.secret = secret
        self.address_for = address_for
        self.group = spawn.WorkerGroup()  # every worker started; its events queue drives the loop
        self.members: dict[int, _Member] = {}  # live workers by serial
        self._reported_lost: dict[int, float] = {}  # serial -> when a peer's record of it was first seen
        self.member_of: dict[Worker, _Member] = {}
        self.serial = 0
        self.hosts: dict[str, int] = {}
        self.generation = -1
        self.current: list[_Member] = []  # the latest generation, in rank order
        self.finished: list[_Member] = []  # members of the latest generation that exited 0
        self.succeeded = False  # a worker exited 0: the job is ending, no new worker is started
        self.hosts_version = 0
        self.forming_since: float | None = time.monotonic()  # a generation is wanted since then
        self.short_since: float | None = None  # fewer than min_np slots since then

    # ------------------------------------------------------------ processes
    def _start(self, host: str, index: int) -> None:
        self.serial += 1
        serial = self.serial
        slot = SlotInfo(host, serial, serial + 1, index, 1, 0, 1)  # rank here only keys the launch records
        label = f"{host}:{index}"
        address = self.address_for(host)
        env = dict(os.environ)  # no rank variables: an elastic worker learns its identity when it joins
        env.update(rendezvous_env(address, self.server.port, self.secret.hex()))
        env.update(self.s.settings_env)
        env["PYTHONUNBUFFERED"] = "1"
        env[protocol.WORKER_ID] = _worker_id(label, serial)
        # the worker's own bound on its join (its elastic timeout) outlasts the driver's, whose decision
        # (with its reason) comes first
        env[_ELASTIC_TIMEOUT_VAR] = repr(max(self.s.elastic_timeout_s, self.s.start_timeout_s) + protocol.JOIN_GRACE_S)
        if self.s.start_worker is not None:
            worker = self.s.start_worker(slot, env, label)
        elif is_local_host(host):
            worker = spawn.start_local(slot, self.s.command, env, self.s.output_dir, label)
        else:
            worker = spawn.start_remote(slot, self.s.command, env, (address, self.server.port),
                                        self.s.start_timeout_s, self.s.ssh_port, self.s.ssh_identity_file,
                                        self.s.output_dir, extra_ssh_args=self.s.ssh_args, label=label)
        member = _Member(serial, host, index, worker)
        self.members[serial] = member
        self.member_of[worker] = member
        self.group.add(worker)
        self._say(f"started worker {label} (#{serial}, {worker.where})")

    def _say(self, message: str) -> None:
        spawn.say(f"roundelrun: {message}")

    def _on_exit(self, member: _Member) -> None:
        self.members.pop(member.serial, None)
        self._reported_lost.pop(member.serial, None)
        code = spawn.own_exit_code(member.worker, self.server)
        if member.state.evicted or (member.state.leaving and code == 0):
            return
        if code == 0:
            self.succeeded = True
            if member in self.current:
                self.finished.append(member)
            return
        who = f"worker {member.label}"
        cooldown = self.s.blacklist.add(member.host)
        until = "for the rest of the job" if cooldown == float("inf") else f"for {cooldown:.1f} s"
        self._say(f"{spawn.describe_exit(member.worker, self.server, who)}; host {member.host} "
                  f"blacklisted {until}")
        evicted = self._evict(member.host) if self.s.evict_host_on_failure else []
        if self.generation < 0:
            if not [m for m in self.members.values() if m.state.kept]:
                raise _JobFailed("every worker failed before the job could start; see their output above")
            return
        if member in self.current or any(m in self.current for m in evicted):
            if self.finished:
                raise _JobFailed(f"{who} failed after other workers had finished")
            survivors = [m for m in self.current if m.serial in self.members and m.state.kept]
            if not survivors:
                if any(m.state.evicted for m in self.current):
                    hosts = ", ".join(sorted(h for h in {*self.hosts, *(m.host for m in self.current)}
                                             if self.s.blacklist.contains(h)))
                    raise _JobFailed(f"every host of the job is blacklisted ({hosts}) after worker failures "
                                     "there, so no worker with committed state is left")
                raise _JobFailed("every worker of the job failed, so no committed state survives")
            # survivors still connecting to this generation wait for a peer that will not come: send them on
            self.server.set(protocol.abandoned_key(self.generation), f"worker {member.label} failed".encode())
            self._want_generation(protocol.HostUpdate.REMOVED)

    def _evict(self, host: str) -> list[_Member]:
        """Take every other live worker on ``host`` (just blacklisted) out of the job, as Horovod does:
        SIGTERM its process group; it is answered 'removed' if it joins first; its exit is no failure."""
        evicted = [m for m in self.members.values() if m.host == host and not m.state.evicted]
        for m in evicted:
            m.on(MemberEvent.EVICT)
            self._say(f"worker {m.label} stopped: its host {host} is blacklisted")
            m.worker.signal_group(signal.SIGTERM)
            m.worker.signal_group(signal.SIGCONT)
        return evicted

    def _kill_lost(self) -> None:
        """SIGKILL every worker of the current generation that a peer reported lost (it stopped answering)
        and that has not exited by itself within ``EXIT_GRACE_S`` of the report.

        Its exit then counts as a failure like any other (blacklist, replacement, reset).
        """
        live = {m.last_rank: m for m in self.current if not m.state.lost and m.serial in self.members}
        now = time.monotonic()
        for record in lost_ranks(self.server, list(live), protocol.key_prefix(self.generation)):
            member = live.get(record.get("rank"))
            if member is None or now - self._reported_lost.setdefault(member.serial, now) < EXIT_GRACE_S:
                continue
            member.on(MemberEvent.LOSE)
            self._say(f"worker {member.label}: {describe_lost(record)}; killing it")
            member.worker.signal_group(signal.SIGKILL)

    # ------------------------------------------------------------ membership
    def _usable_hosts(self) -> dict[str, int]:
        return {h: n for h, n in self.hosts.items() if not self.s.blacklist.contains(h)}

    def _plan(self) -> None:
        """Start workers on free slots, mark workers of removed hosts as leaving; want a new
        generation when membership changes."""
        kept = [m for m in self.members.values() if m.state.kept]
        changed = protocol.HostUpdate.NO_UPDATE
        for m in kept:
            if m.index >= self.hosts.get(m.host, 0):  # host gone or shrunk
                m.on(MemberEvent.LEAVE)
                changed |= protocol.HostUpdate.REMOVED
                self._say(f"host {m.host} no longer offers slot {m.index}; worker {m.label} will leave")
        kept = [m for m in kept if m.state.kept]
        used = {(m.host, m.index) for m in kept}
        limit = self.s.max_np if self.s.max_np is not None else float("inf")
        free = [(h, i) for h, n in self._usable_hosts().items() for i in range(n) if (h, i) not in used]
        for host, index in free:
            if len(kept) >= limit or self.succeeded:
                break
            self._start(host, index)
            kept.append(self.members[self.serial])
            changed |= protocol.HostUpdate.ADDED
        if changed and self.generation >= 0:
            self._want_generation(changed)

    def _want_generation(self, update: protocol.HostUpdate) -> None:
        """Plan a new generation (once until it forms): bump ``hosts_version`` and post a notice of ``update``
        for the workers' ``State._host_messages``."""
        if self.forming_since is None:
            self.forming_since = time.monotonic()
            self.hosts_version += 1
            self.server.set(protocol.hosts_update_key(self.hosts_version), protocol.host_update_notice(update))
            self.server.set(protocol.HOSTS_VERSION_KEY, str(self.hosts_version).encode())

    def _joined(self, member: _Member) -> int:
        raw = self.server.get(protocol.join_key(member.worker_id))
        return int(raw) if raw is not None else 0

    def _form(self) -> None:
        """Answer the joins: a new generation once every kept live worker is waiting."""
        for m in self.members.values():
            count = self._joined(m)
            if m.state.leaving and count > m.answered:
                why = "is blacklisted" if m.state.evicted else "left the job"
                self.server.set(protocol.assign_key(m.worker_id, count),
                                protocol.removal(f"host {m.host} {why}"))
                m.answered = count
        kept = [m for m in self.members.values() if m.state.kept]
        now = time.monotonic()
        if len(kept) < self.s.min_np:
            usable = sum(self._usable_hosts().values())
            if isinstance(self.s.discovery, FixedHosts) and self.s.blacklist.cooldown_range is None \
                    and usable < self.s.min_np:  # no host comes back and no other is ever discovered
                raise _JobFailed(f"the fixed hosts not blacklisted offer {usable} slot(s), fewer than --min-np "
                                 f"{self.s.min_np}, and none can come back (no --blacklist-cooldown-range)")
            self.short_since = self.short_since or now
            if now - self.short_since > self.s.elastic_timeout_s:
                raise _JobFailed(f"only {len(kept)} worker slot(s) for {self.s.elastic_timeout_s:g} s "
                                 f"(--elastic-timeout), fewer than --min-np {self.s.min_np}")
            return
        self.short_since = None
        waiting = [m for m in kept if self._joined(m) <= m.answered]
        if waiting:
            # as in horovodrun: starting the processes is bounded by --start-timeout, re-forming by --elastic-timeout
            bound, flag = ((self.s.start_timeout_s, "--start-timeout") if self.generation < 0 else
                           (self.s.elastic_timeout_s, "--elastic-timeout"))
            if now - self.forming_since > bound:
                names = ", ".join(m.label for m in waiting)
                first = "the job's first" if self.generation < 0 else "a new"
                raise _JobFailed(f"worker(s) {names} did not join {first} generation within {bound:g} s ({flag})")
            return
        if self.generation >= 0 and self.s.reset_limit is not None and self.generation + 1 > self.s.reset_limit:
            raise _JobFailed(f"the job needed reset number {self.generation + 1}, more than --reset-limit "
                             f"{self.s.reset_limit}")
        order = sorted(kept, key=lambda m: (m.last_rank is None, m.last_rank or 0, m.serial))
        local: dict[str, int] = {}
        table = []
        for m in order:
            table.append((m.host, local.get(m.host, 0)))
            local[m.host] = local.get(m.host, 0) + 1
        self.generation += 1
        for m, identity in zip(order, cross_ranks(table)):
            count = self._joined(m)
            assignment = protocol.Assignment(self.generation, identity, self.hosts_version)
            self.server.set(protocol.assign_key(m.worker_id, count), assignment.encode())
            m.answered, m.last_rank = count, identity.rank
        self.current = order
        self.finished = []
        self.forming_since = None
        ranks = ", ".join(f"{m.label}={m.last_rank}" for m in order)
        self._say(f"generation {self.generation}: {len(order)} worker(s), ranks {ranks}")

    # ------------------------------------------------------------ main loop
    def run(self) -> int:
        next_poll = 0.0
        while True:
            now = time.monotonic()
            if now >= next_poll:
                self.hosts = self.s.discovery.poll()
                for host in self.hosts:
                    if not is_local_host(host):
                        self.address_for(host)  # raises _JobFailed-worthy ValueError early
                self._plan()
                next_poll = now + DISCOVERY_INTERVAL_S
            try:
                kind, item = self.group.events.get(timeout=_TICK_S)
            except queue.Empty:
                kind = None
            if kind == "signal":
                self._say(f"received {spawn.signal_name(item)}; stopping all workers")
                return 128 + item
            if kind == "exit":
                self._on_exit(self.member_of[item])
            self._kill_lost()
            if self.current and all(m in self.finished for m in self.current):
                return 0
            if self.succeeded and not self.members:  # e.g. workers that finished without joining the job
                return 0
            if self.forming_since is not None:
                self._form()


def run(settings: ElasticSettings, server: RendezvousServer, secret: bytes,
        address_for: Callable[[str], str]) -> int:
    """Run an elastic job to its end; return the launcher's exit status (0 when training finished)."""
    driver = _Driver(settings, server, secret, address_for)
    handled = (signal.SIGINT, signal.SIGTERM)
    in_main = threading.current_thread() is threading.main_thread()
    previous = {s: signal.signal(s, driver.group.on_signal) for s in handled} if in_main else {}
    try:
        return driver.run()
    except _JobFailed as exc:
        driver._say(f"error: {exc}; stopping all workers")
        return 1
    except ValueError as exc:
        driver._say(f"error: {exc}; stopping all workers")
        return 2
    except OSError as exc:
        driver._say(f"cannot start a worker: {exc}; stopping all workers")
        return 127
    finally:
        driver.group.stop()
        driver.group.drain_output()
        for signum, handler in previous.items():
            signal.signal(signum, handler)
