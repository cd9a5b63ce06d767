"""Rank 0's control plane at hundreds and thousands of ranks, by simulation.

Rank 0 is real: this process starts roundel's engine as rank 0 of an
N-rank job, with its coordinator, listener, authenticated control channel,
codec and negotiator. The other N - 1 ranks are simulated by a few worker
processes, each holding many ranks' connections: each simulated rank connects
and authenticates as a rank does, sends heartbeats, submits its requests as a
rank's engine does (in full the first time, then as one mask of cache bits)
and reads the batches the coordinator sends back, recording the cache bits as
a rank's mirror does. The ranks sit on simulated hosts of ``--per-host``; in
jobs of at least ``--relay-from-ranks`` ranks (the setting's default), each
host's first rank (the second on rank 0's host) runs roundel's real relay,
as it would in a job of that size: the host's other ranks connect to it,
and the relays form the same tree under rank 0. No tensor data moves: rank
0's transport does nothing (the data plane has benchmarks of its own), so
what is timed is the control plane alone.

For each N it reports:

* connect: from the moment the simulated ranks start connecting until every
  one has joined (rank 0's ``hvd.init()`` returns);
* first step: the full negotiation of ResNet-50's 161 gradient names, from
  the last submission to every rank holding every batch;
* steady cycle: the same with every name cached (bits both ways), median of
  ``--steps`` steps;
* rank 0's CPU per steady step (this process's own threads: engine,
  executor, listeners, the store it serves; and the main thread while it
  builds, submits and waits for the step's collectives, not while it talks
  to the simulating processes, which a real rank 0 does not do), the part of
  it its coordinator thread spent, and its peak memory;
* the CPU the simulating processes spent per steady step, all together: when
  it exceeds what the cores left to them can give in one cycle, the steady
  cycle measures the simulation more than rank 0.

The simulated ranks negotiate every step (they do not replay a schedule), so
rank 0 runs with ``steady_replay`` off. With ``--replayed``, each size is
instead run until rank 0's schedule is armed, and then the steady steps are
replayed: the simulated ranks only keep their connections (heartbeats), as
ranks that replay do, and rank 0 submits, runs and completes each step's
batches without its coordinator; the figures are then those of the replayed
steady state.

It then fits ``t(N) = a + b N`` by least squares to the steady cycle and to
rank 0's CPU per step, over the sizes run the same way as the largest (with
relays or without: without, the work per cycle grows linearly once every
name is cached, a frame in, a frame out and a mask merge per rank), prints
each fit with its largest relative error over those sizes, and what it
predicts at the ``--predict`` sizes.

With ``--store`` it also times the rendezvous store (the real server, served
from this process as ``roundelrun`` serves it) against N simulated joiners,
each with its own authenticated client on a thread of the worker processes:
until every one has registered (a key and a counter increment), and until
every one has read the job's layout the launcher publishes then.

    python benchmarks/control_scale.py --ranks 16,64,256,1024 [--workers 4] [--json out.json] [--plot out.png]

The output ends with one line per size that other tools can read:
``control_scale: ranks=N connect_s=.. first_step_s=.. steady_cpu_ms=.. steady_latency_ms=..``
(then the coordinator thread's CPU, and whether relays ran).

On a machine with fewer cores than worker processes + 1, rank 0 shares its
cores with the simulated ranks: the figures are then an upper bound.
"""

from __future__ import annotations

import argparse
import dataclasses
import functools
import json
import multiprocessing
import os
import resource
import selectors
import statistics
import sys
import threading
import time

import torch

import plots
from roundel.common.control import channel as control_channel, codec as control_codec
from roundel.common.control.messages import Deliver, Dispatch, Heartbeat, Submit
from roundel.common.engine import relay as relays
from roundel.common.engine.core import Engine
from roundel.common.engine.process_set_registry import ProcessSetRegistry
from roundel.common.control.records import CachedBatch, OpKind, Request
from roundel.common.settings import Settings
from roundel.rendezvous.store import RendezvousClient, RendezvousServer
from roundel.transport.backend import Backend

NAMES = 161  # ResNet-50's gradient tensors
SHAPE = (16,)
PREFIX = "sim/"
HOLD_S = Settings().cycle_time_ms / 1000  # a relay holds submissions for the cycle time, as in a job


def _requests() -> list:
    return [Request(f"allreduce.grad.{i}", OpKind.ALLREDUCE, 0, "float32", SHAPE) for i in range(NAMES)]


class _NoData(Backend):
    """Rank 0's transport in the simulation: every collective completes at once and moves nothing."""

    name = "none"

    def allreduce(self, tensor, op):
        pass

    def allgather(self, output, tensor):
        pass

    def broadcast(self, tensor, root):
        pass

    def alltoall(self, output, tensor, output_splits, input_splits):
        pass

    def reducescatter(self, output, tensor, op):
        pass

    def barrier(self):
        pass

    def close(self):
        pass


# ------------------------------------------------------------------ simulated hosts
def _hosts(size: int, per_host: int) -> list[tuple[int, list]]:
    """(cross rank, ranks) of each simulated host: ``per_host`` consecutive ranks each, rank 0's first."""
    return [(h, list(range(first, min(first + per_host, size)))) for h, first in enumerate(range(0, size, per_host))]


def _host_name(cross_rank: int) -> str:
    return f"sim-host-{cross_rank}"


class _SimulatedHosts:
    """Many hosts' ranks, driven from one process.

    Without relays every simulated rank connects to rank 0. With relays each
    host's relaying rank runs roundel's real ``Relay`` (listener, children,
    merging, fan-out) and connects to the rank above it, and the host's other
    ranks connect to it, as in a real job; a simulated rank submits what a
    rank's engine would (in full the first time, then one mask of cache
    bits), and reads the batches sent back, recording the cache bits as a
    rank's mirror does.
    """

    def __init__(self, client, secret: bytes, prefix: str, size: int, hosts: list, per_host: int, relayed: bool,
                 fanout: int):
        self._secret = secret
        self.selector = selectors.DefaultSelector()
        self._wake_r, self._wake_w = os.pipe()
        os.set_blocking(self._wake_r, False)
        self.selector.register(self._wake_r, selectors.EVENT_READ, ("wake", 0))
        self.leaves: dict = {}  # rank -> connection to its relay (or rank 0)
        self.relays: dict = {}  # a host's relaying rank -> its Relay
        self.parents: dict = {}  # a host's relaying rank -> its connection to the rank above
        self.readers: dict = {}  # ("leaf" or "parent", rank) -> FrameReader
        self.relay_of: dict = {}  # rank -> the relay here it is a child of
        self.version = 0
        self.bits: dict = {}  # name -> cache bit (every simulated rank agrees)
        self.waiting: dict = {}
        self.done = 0.0
        self.last_heartbeat = time.monotonic()
        coordinator = client.get(prefix + "coordinator", timeout=300.0).decode()
        leaders = {h: ranks[relays.relay_local_rank(h)] for h, ranks in hosts
                   if relayed and len(ranks) > relays.relay_local_rank(h)}
        for h, ranks in hosts:  # the relays first, so that ranks in other processes find them
            leader = leaders.get(h)
            if leader is not None:
                above = relays.parent_key(prefix, _host_name(h), relays.relay_local_rank(h), h, fanout)
                relay = relays.Relay(leader, size, secret, "127.0.0.1", self.selector,
                                     functools.partial(self._up, leader), self._wake, HOLD_S, 600.0, _host_name(h),
                                     global_bits=lambda: -1,  # every name global
                                     above_is_relay=above is not None and ((h - 1) // fanout > 0 or per_host > 1))
                record = relays.address_record(leader, f"127.0.0.1:{relay.listener.port}", _host_name(h),
                                               relay.listener.local_name)
                client.set(relays.host_key(prefix, _host_name(h)), record)
                client.set(relays.leader_key(prefix, h), record)
                self.relays[leader] = relay
                for rank in ranks:
                    if rank not in (0, leader):
                        self.relay_of[rank] = relay
        for h, ranks in hosts:
            leader = leaders.get(h)
            if leader is None:
                continue
            key = relays.parent_key(prefix, _host_name(h), relays.relay_local_rank(h), h, fanout)
            address = coordinator if key is None else json.loads(client.get(key, timeout=300.0))["address"]
            connection = self._connect(address, None, leader, ("parent", leader))
            self.parents[leader] = connection
            connection.send(Heartbeat(_host_name(h)))
            for child_host in range(h * fanout + 1, h * fanout + fanout + 1):  # relays reporting here
                if child_host * per_host < size:
                    self.relay_of[child_host * per_host] = self.relays[leader]
        for h, ranks in hosts:
            for rank in ranks:
                if rank == 0 or rank in self.relays:
                    continue
                address, local = coordinator, None
                if relayed:
                    record = json.loads(client.get(relays.host_key(prefix, _host_name(h)), timeout=300.0))
                    address, local = record["address"], record["local"]
                connection = self._connect(address, local, rank, ("leaf", rank))
                self.leaves[rank] = connection
                connection.send(Heartbeat(_host_name(h)))

    def _connect(self, address: str, local: str | None, rank: int, data: tuple):
        host, port = address.rsplit(":", 1)
        connection = control_channel.connect(host, int(port), self._secret, rank, 300.0,
                                             send_timeout_s=300.0, local_name=local)
        self.readers[data] = control_channel.FrameReader(connection)
        self.selector.register(connection, selectors.EVENT_READ, data)
        return connection

    def _wake(self) -> None:
        os.write(self._wake_w, b"w")

    def _up(self, leader: int, message) -> None:
        connection = self.parents[leader]
        connection.send(message)
        control_channel.watch_writes(self.selector, connection, ("parent", leader))

    def serve(self, timeout: float) -> bool:
        """One round of select over every connection here; True when the parent's pipe has a command."""
        now = time.monotonic()
        for relay in self.relays.values():
            held = relay.deadline()
            if held is not None:
                timeout = min(timeout, max(0.0, held - now))
        command = False
        for key, events in self.selector.select(timeout):
            kind, rank = key.data
            if kind == "wake":
                os.read(self._wake_r, 4096)
            elif kind == "pipe":
                command = True
            elif kind == "child":
                self.relay_of[rank].serve(rank, events)
            else:
                connection = key.fileobj
                if events & selectors.EVENT_WRITE:
                    connection.flush()
                    control_channel.watch_writes(self.selector, connection, key.data)
                if events & selectors.EVENT_READ:
                    for message in self.readers[key.data].feed(connection.recv(control_channel.RECV_BYTES)):
                        self._received(kind, rank, message)
        now = time.monotonic()
        for relay in self.relays.values():
            relay.poll(now)
        if now - self.last_heartbeat >= 1.0:
            self.last_heartbeat = now
            for connection in self.leaves.values():
                connection.send(Heartbeat("simulated"))
            for leader, relay in self.relays.items():
                relay.tick(now)
                relay.send_up(Heartbeat("simulated"))
        for connection in self.leaves.values():
            if connection.pending:
                connection.flush()
        return command

    def _received(self, kind: str, rank: int, message) -> None:
        if type(message) is Deliver:
            if kind != "parent" or not self.relays[rank].deliver(message.ranks, message.payload):
                return
            message = control_codec.decode(message.payload)
        if type(message) is not Dispatch:
            return
        if message.resend:
            raise RuntimeError(f"rank {rank} was asked to resend {message.resend}")
        self.version = message.version
        count = 0
        for batch in message.batches:
            if isinstance(batch, CachedBatch):
                count += bin(batch.bits).count("1")
            else:
                count += len(batch.entries)
                for entry in batch.entries:
                    if entry.cache_bit >= 0:
                        self.bits[entry.name] = entry.cache_bit
        if rank in self.waiting:
            self.waiting[rank] -= count
            if self.waiting[rank] <= 0:
                del self.waiting[rank]
                self.done = time.monotonic()

    def step(self, cached: bool) -> tuple[float, float]:
        """Submit the 161 names on every rank here; return (last submission, last rank's last batch) times."""
        requests = _requests()
        if cached:
            mask = sum(1 << self.bits[r.name] for r in requests)
            message = Submit(self.version, mask, [], {}, [])
        else:
            message = Submit(self.version, 0, requests, {}, [])
        self.waiting = {rank: NAMES for rank in [*self.leaves, *self.relays]}
        for connection in self.leaves.values():
            connection.send(message)
        now = time.monotonic()
        for leader, relay in self.relays.items():
            if cached:
                relay.hold(message.version, leader, message.bits, 0.0, now)
            else:
                relay.note_sent(leader, message)
                relay.send_up(message)
        sent = self.done = time.monotonic()
        while self.waiting:
            self.serve(1.0)
        return sent, self.done


def _worker(store_port: int, secret: bytes, prefix: str, size: int, hosts: list, per_host: int, relayed: bool,
            fanout: int, pipe) -> None:
    try:
        pipe.send(("ready", time.monotonic()))
        pipe.recv()  # every worker is up: connect
        client = RendezvousClient("127.0.0.1", store_port, secret, connect_timeout=300.0)
        simulated = _SimulatedHosts(client, secret, prefix, size, hosts, per_host, relayed, fanout)
        simulated.selector.register(pipe, selectors.EVENT_READ, ("pipe", 0))
        pipe.send(("connected", time.monotonic()))
        while True:
            if not simulated.serve(1.0):
                continue
            command = pipe.recv()
            if command == "stop":
                break
            before = time.process_time()
            sent, done = simulated.step(cached=command == "cached")
            pipe.send(("step", (sent, done, time.process_time() - before)))
    except BaseException as exc:  # noqa: BLE001 - reported to the parent
        pipe.send(("error", repr(exc)))


def _joiners(port: int, secret: bytes, ranks: list, pipe) -> None:
    """Simulated workers joining through the rendezvous store, one thread and client each."""
    times, errors = [], []

    def join(rank: int) -> None:
        try:
            client = RendezvousClient("127.0.0.1", port, secret, connect_timeout=300.0)
            client.set(f"joined/{rank}", f"host-{rank // 8}:{rank % 8}".encode())
            client.add("joined", 1)
            client.get("layout", timeout=300.0)
            times.append(time.monotonic())
            client.close()
        except BaseException as exc:  # noqa: BLE001 - reported to the parent
            errors.append(repr(exc))

    threads = [threading.Thread(target=join, args=(rank,), daemon=True) for rank in ranks]
    pipe.send(("ready", time.monotonic()))
    pipe.recv()
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    pipe.send(("joined", max(times)) if not errors else ("error", errors[0]))


def measure_store(size: int, workers: int) -> dict:
    """Time ``size`` simulated joiners registering with the store and reading the layout."""
    secret = os.urandom(32)
    server = RendezvousServer(secret)
    port = server.start()
    context = multiprocessing.get_context("spawn")
    ranks = list(range(size))
    pipes, processes = [], []
    for share in (ranks[i::workers] for i in range(workers)):
        parent, child = context.Pipe()
        process = context.Process(target=_joiners, args=(port, secret, share, child), daemon=True)
        process.start()
        pipes.append(parent)
        processes.append(process)
    try:
        for pipe in pipes:
            _expect(pipe, "ready")
        started = time.monotonic()
        for pipe in pipes:
            pipe.send("go")
        while int(server.get("joined") or b"0") < size:
            if any(pipe.poll() for pipe in pipes):  # only a failure answers this early
                _expect(next(pipe for pipe in pipes if pipe.poll()), "joined")
            time.sleep(0.002)
        registered = time.monotonic() - started
        server.set("layout", json.dumps({str(r): f"host-{r // 8}" for r in ranks}).encode())
        layout = max(_expect(pipe, "joined") for pipe in pipes) - started
    finally:
        for process in processes:
            process.join(30)
        server.stop()
    return {"ranks": size, "register_s": registered, "layout_s": layout}


# ------------------------------------------------------------------ one job size
def measure(size: int, workers: int, steps: int, per_host: int = 8, relay_from_ranks: int = Settings().relay_from_ranks,
            fanout: int = Settings().relay_fanout, replayed: bool = False) -> dict:
    """Run one simulated job of ``size`` ranks on hosts of ``per_host``; return its figures (``replayed``: of the
    steady steps once rank 0 replays them)."""
    secret = os.urandom(32)
    server = RendezvousServer(secret)
    store_port = server.start()
    store = RendezvousClient("127.0.0.1", store_port, secret)
    settings = dataclasses.replace(Settings.from_env({}), start_timeout_s=600.0, heartbeat_timeout_s=600.0,
                                   coordinator_reduce_bytes=0, relay_from_ranks=relay_from_ranks,
                                   relay_fanout=fanout, steady_replay=replayed)
    relayed = 0 < relay_from_ranks <= size
    backend = _NoData(0, size)
    hosts = _hosts(size, per_host)
    shares = [hosts[i::workers] for i in range(workers) if hosts[i::workers]]
    context = multiprocessing.get_context("spawn")
    pipes, processes = [], []
    rss_before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss

    engine_box: dict = {}
    starter = threading.Thread(target=lambda: engine_box.update(engine=Engine(
        0, size, settings, secret, store, PREFIX, "127.0.0.1", ProcessSetRegistry(tuple(range(size)), backend),
        placement=(0, 0, _host_name(0), min(per_host, size)))))
    starter.start()
    for share in shares:
        parent, child = context.Pipe()
        process = context.Process(target=_worker, args=(store_port, secret, PREFIX, size, share, per_host, relayed,
                                                        fanout, child), daemon=True)
        process.start()
        pipes.append(parent)
        processes.append(process)
    for pipe in pipes:
        _expect(pipe, "ready")
    started = time.monotonic()
    for pipe in pipes:
        pipe.send("connect")
    for pipe in pipes:
        _expect(pipe, "connected")
    starter.join()
    connected = time.monotonic() - started
    engine = engine_box["engine"]
    coordinator_clock = time.pthread_getcpuclockid(
        next(thread for thread in threading.enumerate() if thread.name == "roundel-engine").ident)
    # rank 0's own threads (engine, executor, listeners, the store it serves); the main thread counts only
    # while it builds, submits and waits for the step's collectives (its pipe talk with the simulating
    # processes is the harness's, which a real rank 0 does not do)
    clocks = [time.pthread_getcpuclockid(thread.ident) for thread in threading.enumerate()
              if thread is not threading.main_thread() and thread.ident is not None]
    tensors = [torch.zeros(SHAPE) for _ in range(NAMES)]
    try:
        first, _, _ = _step(engine, pipes, tensors, cached=False)
        if replayed:
            for _ in range(8):
                if engine.replaying:
                    break
                _step(engine, pipes, tensors, cached=True)
            if not engine.replaying:
                raise RuntimeError("rank 0 did not arm the schedule within 8 steady steps")
        cycles, cpu, coordinator_cpu, simulation_cpu = [], [], [], []
        for _ in range(steps):
            before, coordinator_before = _cpu_of(clocks), time.clock_gettime(coordinator_clock)
            if replayed:
                cycle, simulating, submitting = _replayed_step(engine, tensors)
            else:
                cycle, simulating, submitting = _step(engine, pipes, tensors, cached=True)
            cycles.append(cycle)
            simulation_cpu.append(simulating)
            cpu.append(_cpu_of(clocks) - before + submitting)
            coordinator_cpu.append(time.clock_gettime(coordinator_clock) - coordinator_before)
    finally:
        for pipe in pipes:
            pipe.send("stop")
        for process in processes:
            process.join(30)
        engine.shutdown()
        store.close()
        server.stop()
    return {"ranks": size, "workers": len(shares), "relays": relayed, "per_host": per_host, "fanout": fanout,
            "replayed": replayed, "replayed_slots": engine.replay_counts[0],
            "connect_s": connected, "first_step_ms": first * 1e3,
            "cycle_ms": statistics.median(cycles) * 1e3, "cycle_ms_min": min(cycles) * 1e3,
            "rank0_cpu_ms_per_step": statistics.median(cpu) * 1e3,
            "coordinator_cpu_ms_per_step": statistics.median(coordinator_cpu) * 1e3,
            "simulation_cpu_ms_per_step": statistics.median(simulation_cpu) * 1e3,
            "rank0_peak_rss_mib": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024,
            "rank0_rss_growth_mib": (resource.getrusage(resource.RUSAGE_SELF).ru_maxrss - rss_before) / 1024}


def linear_fit(sizes: list, values: list) -> tuple[float, float, float]:
    """(a, b, largest relative error) of the least-squares fit ``value = a + b * size``."""
    count = len(sizes)
    mean_x, mean_y = sum(sizes) / count, sum(values) / count
    spread = sum((x - mean_x) ** 2 for x in sizes)
    slope = sum((x - mean_x) * (y - mean_y) for x, y in zip(sizes, values)) / spread if spread else 0.0
    intercept = mean_y - slope * mean_x
    error = max(abs(intercept + slope * x - y) / y for x, y in zip(sizes, values) if y > 0)
    return intercept, slope, error


def _expect(pipe, what: str):
    kind, value = pipe.recv()
    if kind != what:
        raise RuntimeError(f"a simulated-rank worker failed: {value}")
    return value


def _cpu_of(clocks: list) -> float:
    """CPU seconds the threads of ``clocks`` have used so far (a thread that has ended counts no more)."""
    total = 0.0
    for clock in clocks:
        try:
            total += time.clock_gettime(clock)
        except OSError:
            pass
    return total


def _step(engine: Engine, pipes: list, tensors: list, cached: bool) -> tuple[float, float, float]:
    """One step of 161 names on every rank; (seconds from the last submission to the last rank's reply,
    CPU seconds the simulating processes spent on it, CPU seconds this thread spent submitting and waiting)."""
    for pipe in pipes:
        pipe.send("cached" if cached else "full")
    submitted = finished = time.monotonic()
    simulation_cpu = 0.0
    before = time.thread_time()
    handles = engine.submit_group([(request, tensor, tensor) for request, tensor in zip(_requests(), tensors)])
    submitting = time.thread_time() - before
    for pipe in pipes:  # a simulating process that fails says so here, rather than leaving rank 0 waiting
        sent, done, cpu = _expect(pipe, "step")
        submitted, finished = max(submitted, sent), max(finished, done)
        simulation_cpu += cpu
    before = time.thread_time()
    if not all(handle.done() for handle in handles):
        for handle in handles:
            handle.wait()
        finished = time.monotonic()
    submitting += time.thread_time() - before
    return finished - submitted, simulation_cpu, submitting


def _replayed_step(engine: Engine, tensors: list) -> tuple[float, float, float]:
    """One replayed step of 161 names on rank 0 (the simulated ranks only keep their connections); (seconds from
    the submission to the last result, 0, CPU seconds this thread spent submitting and waiting)."""
    started, before = time.monotonic(), time.thread_time()
    handles = engine.submit_group([(request, tensor, tensor) for request, tensor in zip(_requests(), tensors)])
    for handle in handles:
        handle.wait()
    return time.monotonic() - started, 0.0, time.thread_time() - before


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--ranks", default="16,64,256,1024", help="job sizes (default 16,64,256,1024)")
    parser.add_argument("--workers", type=int, default=4, help="processes simulating the ranks (default 4)")
    parser.add_argument("--steps", type=int, default=20, help="steady steps per size (default 20)")
    parser.add_argument("--predict", default="4096,16384", help="sizes the fitted model is asked about")
    parser.add_argument("--per-host", type=int, default=8, help="ranks per simulated host (default 8)")
    parser.add_argument("--relay-from-ranks", type=int, default=Settings().relay_from_ranks,
                        help="relays in jobs of at least this many ranks, as the setting "
                             f"(default {Settings().relay_from_ranks}; 0: never)")
    parser.add_argument("--fanout", type=int, default=Settings().relay_fanout,
                        help=f"hosts' relays under rank 0 and each relay (default {Settings().relay_fanout})")
    parser.add_argument("--replayed", action="store_true",
                        help="time the steady steps once rank 0 replays them (see above)")
    parser.add_argument("--store", action="store_true", help="also time the rendezvous store's joiners")
    parser.add_argument("--json", metavar="PATH", help="also write the figures as JSON")
    parser.add_argument("--plot", default="control_scale.png", metavar="PATH",
                        help="PNG of the times against the ranks (default control_scale.png)")
    args = parser.parse_args()
    results = []
    print(f"rank 0 real, the other ranks simulated by {args.workers} processes; {os.cpu_count()} cores; "
          f"{NAMES} names per step; hosts of {args.per_host} ranks; relays from {args.relay_from_ranks} ranks, "
          f"{args.fanout} under each; steady steps {'replayed' if args.replayed else 'negotiated'}\n")
    print("| ranks | relays | connect (s) | first step (ms) | steady cycle (ms) | rank 0 CPU per step (ms) "
          "| of it, the coordinator thread (ms) | rank 0 peak RSS (MiB) | simulating processes' CPU per step (ms) |\n"
          "| ---: | --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: |")
    for size in (int(n) for n in args.ranks.split(",")):
        row = measure(size, args.workers, args.steps, args.per_host, args.relay_from_ranks, args.fanout,
                      args.replayed)
        results.append(row)
        print(f"| {size:,} | {'yes' if row['relays'] else 'no'} | {row['connect_s']:.2f} | {row['first_step_ms']:.1f} "
              f"| {row['cycle_ms']:.2f} | {row['rank0_cpu_ms_per_step']:.2f} | {row['coordinator_cpu_ms_per_step']:.2f} "
              f"| {row['rank0_peak_rss_mib']:.0f} | {row['simulation_cpu_ms_per_step']:.1f} |", flush=True)
    ranks = [row["ranks"] for row in results]
    fits = {}
    alike = [row for row in results if row["relays"] == results[-1]["relays"]]  # a line fits one way of running
    if len(alike) >= 2:
        ranks = [row["ranks"] for row in alike]
        predict = [int(n) for n in args.predict.split(",") if n]
        print("\n| fitted t(N) = a + b N | a (ms) | b (µs per rank) | largest error | "
              + " | ".join(f"N = {n:,}" for n in predict) + " |\n| --- | ---: | ---: | ---: |"
              + " ---: |" * len(predict))
        for label, field in (("steady cycle", "cycle_ms"), ("rank 0 CPU per step", "rank0_cpu_ms_per_step")):
            a, b, error = linear_fit(ranks, [row[field] for row in alike])
            fits[field] = {"a_ms": a, "b_ms_per_rank": b, "largest_relative_error": error,
                           "predicted_ms": {str(n): a + b * n for n in predict}}
            print(f"| {label} | {a:.2f} | {b * 1e3:.1f} | {error:.0%} | "
                  + " | ".join(f"{a + b * n:.0f} ms" for n in predict) + " |")
    ranks = [row["ranks"] for row in results]
    plot = plots.control_scale_plot(args.plot, ranks, {
        "first step (161 names, in full)": [row["first_step_ms"] for row in results],
        "steady cycle (161 names as bits)": [row["cycle_ms"] for row in results],
        "rank 0 CPU per steady step": [row["rank0_cpu_ms_per_step"] for row in results]},
        f"rank 0's control plane, other ranks simulated ({os.cpu_count()} cores)")
    print(f"\nplot: {plot}")
    store = []
    if args.store:
        print("\n| joiners | all registered (s) | all read the layout (s) |\n| ---: | ---: | ---: |")
        for size in (int(n) for n in args.ranks.split(",")):
            row = measure_store(size, args.workers)
            store.append(row)
            print(f"| {size:,} | {row['register_s']:.2f} | {row['layout_s']:.2f} |", flush=True)
    if args.json:
        with open(args.json, "w") as out:
            json.dump({"cores": os.cpu_count(), "names": NAMES, "results": results, "fits": fits,
                       "store": store}, out, indent=2)
        print(f"\nwrote {args.json}")
    print()
    for row in results:  # one line per size, for other tools to read
        print(f"control_scale: ranks={row['ranks']} connect_s={row['connect_s']:.3f} "
              f"first_step_s={row['first_step_ms'] / 1e3:.4f} steady_cpu_ms={row['rank0_cpu_ms_per_step']:.3f} "
              f"steady_latency_ms={row['cycle_ms']:.3f} coordinator_cpu_ms={row['coordinator_cpu_ms_per_step']:.3f} "
              f"relays={'yes' if row['relays'] else 'no'} replayed={'yes' if row['replayed'] else 'no'}")


if __name__ == "__main__":
    sys.exit(main())
