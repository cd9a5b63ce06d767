"""Rank 0's control plane at hundreds and thousands of ranks, by simulation.

Rank 0 is real: this process starts roundel's engine as rank 0 of an
N-rank job, with its coordinator, listener, authenticated control channel,
codec and negotiator. The other N - 1 ranks are simulated by a few worker
processes, each holding many ranks' connections: each simulated rank connects
and authenticates as a rank does, sends heartbeats, submits its requests as a
rank's engine does (in full the first time, then as one mask of cache bits)
and reads the batches the coordinator sends back, recording the cache bits as
a rank's mirror does. No tensor data moves: rank 0's transport does nothing
(the data plane has benchmarks of its own), so what is timed is the control
plane alone.

For each N it reports:

* connect: from the moment the simulated ranks start connecting until every
  one has joined (rank 0's ``hvd.init()`` returns);
* first step: the full negotiation of ResNet-50's 161 gradient names, from
  the last submission to every rank holding every batch;
* steady cycle: the same with every name cached (bits both ways), median of
  ``--steps`` steps;
* rank 0's CPU per steady step (this process: engine threads and the
  submitting thread), and its peak memory.

It then fits ``t(N) = a + b N`` by least squares to the steady cycle and to
rank 0's CPU per step (the work per cycle grows linearly once every name is
cached: a frame in, a frame out and a mask merge per rank), prints each fit
with its largest relative error over the measured sizes, and what it predicts
at the ``--predict`` sizes.

With ``--store`` it also times the rendezvous store (the real server, served
from this process as ``roundelrun`` serves it) against N simulated joiners,
each with its own authenticated client on a thread of the worker processes:
until every one has registered (a key and a counter increment), and until
every one has read the job's layout the launcher publishes then.

    python benchmarks/control_scale.py --ranks 16,64,256,1024 [--workers 4] [--json out.json] [--plot out.png]

The output ends with one line per size that other tools can read:
``control_scale: ranks=N connect_s=.. first_step_s=.. steady_cpu_ms=.. steady_latency_ms=..``.

On a machine with fewer cores than worker processes + 1, rank 0 shares its
cores with the simulated ranks: the figures are then an upper bound.
"""

from __future__ import annotations

import argparse
import dataclasses
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
from roundel.common.control import channel as control_channel
from roundel.common.control.messages import Dispatch, Heartbeat, Submit
from roundel.common.engine.core import Engine
from roundel.common.engine.requests import CachedBatch, OpKind, Request
from roundel.common.settings import Settings
from roundel.rendezvous.store import RendezvousClient, RendezvousServer
from roundel.transport.backend import Backend

NAMES = 161  # ResNet-50's gradient tensors
SHAPE = (16,)


def _requests() -> list:
    return [Request(f"allreduce.grad.{i}", OpKind.ALLREDUCE, 0, "float32", SHAPE) for i in range(NAMES)]


class _Store:
    """The engine's view of the rendezvous store, in this process (rank 0 publishes its address here)."""

    def __init__(self):
        self._values: dict = {}
        self._changed = threading.Condition()

    def set(self, key: str, value: bytes) -> None:
        with self._changed:
            self._values[key] = value
            self._changed.notify_all()

    def get(self, key: str, timeout: float = 300.0) -> bytes:
        with self._changed:
            self._changed.wait_for(lambda: key in self._values, timeout)
            return self._values[key]

    def check(self, keys) -> bool:
        return all(key in self._values for key in keys)


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


# ------------------------------------------------------------------ simulated ranks
class _SimulatedRanks:
    """Many ranks' control connections, driven from one process."""

    def __init__(self, host: str, port: int, secret: bytes, ranks: list):
        self.connections = {}
        for rank in ranks:
            connection = control_channel.connect(host, port, secret, rank, 300.0, send_timeout_s=300.0)
            self.connections[rank] = connection
            connection.send(Heartbeat("simulated"))
        self.readers = {r: control_channel.FrameReader(c) for r, c in self.connections.items()}
        self.selector = selectors.DefaultSelector()
        for rank, connection in self.connections.items():
            self.selector.register(connection, selectors.EVENT_READ, rank)
        self.version = 0
        self.bits: dict = {}  # name -> cache bit (every simulated rank agrees)
        self.last_heartbeat = time.monotonic()

    def step(self, cached: bool) -> tuple[float, float]:
        """Submit the 161 names on every rank; return (last submission, last rank's last batch) times."""
        requests = _requests()
        if cached:
            mask = sum(1 << self.bits[r.name] for r in requests)
            message = Submit(self.version, mask, [], {}, [])
        else:
            message = Submit(self.version, 0, requests, {}, [])
        for connection in self.connections.values():
            connection.send(message)
        sent = time.monotonic()
        waiting = {rank: NAMES for rank in self.connections}
        done = sent
        while waiting:
            self._heartbeat()
            for connection in self.connections.values():
                if connection.pending:
                    connection.flush()
            for key, _ in self.selector.select(timeout=1.0):
                rank = key.data
                for reply in self.readers[rank].feed(key.fileobj.recv(control_channel.RECV_BYTES)):
                    if type(reply) is not Dispatch:
                        continue
                    if reply.resend:
                        raise RuntimeError(f"rank {rank} was asked to resend {reply.resend}")
                    self.version = reply.version
                    for batch in reply.batches:
                        if isinstance(batch, CachedBatch):
                            count = bin(batch.bits).count("1")
                        else:
                            count = len(batch.entries)
                            for entry in batch.entries:
                                if entry.cache_bit >= 0:
                                    self.bits[entry.name] = entry.cache_bit
                        waiting[rank] -= count
                    if waiting[rank] <= 0:
                        del waiting[rank]
                        done = time.monotonic()
        return sent, done

    def _heartbeat(self) -> None:
        now = time.monotonic()
        if now - self.last_heartbeat >= 1.0:
            self.last_heartbeat = now
            for connection in self.connections.values():
                connection.send(Heartbeat("simulated"))


def _worker(host: str, port: int, secret: bytes, ranks: list, pipe) -> None:
    try:
        pipe.send(("ready", time.monotonic()))
        pipe.recv()  # every worker is up: connect
        ranks_here = _SimulatedRanks(host, port, secret, ranks)
        pipe.send(("connected", time.monotonic()))
        while True:
            command = pipe.recv()
            if command == "stop":
                break
            pipe.send(("step", ranks_here.step(cached=command == "cached")))
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
def measure(size: int, workers: int, steps: int) -> dict:
    """Run one simulated job of ``size`` ranks; return its figures."""
    secret = os.urandom(32)
    store = _Store()
    settings = dataclasses.replace(Settings.from_env({}), start_timeout_s=600.0, heartbeat_timeout_s=600.0,
                                   coordinator_reduce_bytes=0)
    backend = _NoData(0, size)
    ranks = list(range(1, size))
    shares = [ranks[i::workers] for i in range(workers) if ranks[i::workers]]
    context = multiprocessing.get_context("spawn")
    pipes, processes = [], []
    rss_before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss

    engine_box: dict = {}
    starter = threading.Thread(target=lambda: engine_box.update(engine=Engine(
        0, size, settings, secret, store, "", "127.0.0.1", {0: (tuple(range(size)), backend)})))
    starter.start()
    host, port = store.get("coordinator").decode().rsplit(":", 1)
    for share in shares:
        parent, child = context.Pipe()
        process = context.Process(target=_worker, args=(host, int(port), secret, share, child), daemon=True)
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
    tensors = [torch.zeros(SHAPE) for _ in range(NAMES)]
    try:
        first = _step(engine, pipes, tensors, cached=False)
        cycles, cpu = [], []
        for _ in range(steps):
            before = time.process_time()
            cycles.append(_step(engine, pipes, tensors, cached=True))
            cpu.append(time.process_time() - before)
    finally:
        for pipe in pipes:
            pipe.send("stop")
        for process in processes:
            process.join(30)
        engine.shutdown()
    return {"ranks": size, "workers": len(shares), "connect_s": connected, "first_step_ms": first * 1e3,
            "cycle_ms": statistics.median(cycles) * 1e3, "cycle_ms_min": min(cycles) * 1e3,
            "rank0_cpu_ms_per_step": statistics.median(cpu) * 1e3,
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


def _step(engine: Engine, pipes: list, tensors: list, cached: bool) -> float:
    """One step of 161 names on every rank; seconds from the last submission to the last rank's reply."""
    for pipe in pipes:
        pipe.send("cached" if cached else "full")
    submitted = time.monotonic()
    handles = engine.submit_group([(request, tensor, tensor) for request, tensor in zip(_requests(), tensors)])
    for handle in handles:
        handle.wait()
    finished = time.monotonic()
    for pipe in pipes:
        sent, done = _expect(pipe, "step")
        submitted, finished = max(submitted, sent), max(finished, done)
    return finished - submitted


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--ranks", default="16,64,256,1024", help="job sizes (default 16,64,256,1024)")
    parser.add_argument("--workers", type=int, default=4, help="processes simulating the ranks (default 4)")
    parser.add_argument("--steps", type=int, default=20, help="steady steps per size (default 20)")
    parser.add_argument("--predict", default="4096,16384", help="sizes the fitted model is asked about")
    parser.add_argument("--store", action="store_true", help="also time the rendezvous store's joiners")
    parser.add_argument("--json", metavar="PATH", help="also write the figures as JSON")
    parser.add_argument("--plot", default="control_scale.png", metavar="PATH",
                        help="PNG of the times against the ranks (default control_scale.png)")
    args = parser.parse_args()
    results = []
    print(f"rank 0 real, the other ranks simulated by {args.workers} processes; {os.cpu_count()} cores; "
          f"{NAMES} names per step\n")
    print("| ranks | connect (s) | first step (ms) | steady cycle (ms) | rank 0 CPU per step (ms) "
          "| rank 0 peak RSS (MiB) |\n| ---: | ---: | ---: | ---: | ---: | ---: |")
    for size in (int(n) for n in args.ranks.split(",")):
        row = measure(size, args.workers, args.steps)
        results.append(row)
        print(f"| {size:,} | {row['connect_s']:.2f} | {row['first_step_ms']:.1f} | {row['cycle_ms']:.2f} "
              f"| {row['rank0_cpu_ms_per_step']:.2f} | {row['rank0_peak_rss_mib']:.0f} |", flush=True)
    ranks = [row["ranks"] for row in results]
    fits = {}
    if len(ranks) >= 2:
        predict = [int(n) for n in args.predict.split(",") if n]
        print("\n| fitted t(N) = a + b N | a (ms) | b (µs per rank) | largest error | "
              + " | ".join(f"N = {n:,}" for n in predict) + " |\n| --- | ---: | ---: | ---: |"
              + " ---: |" * len(predict))
        for label, field in (("steady cycle", "cycle_ms"), ("rank 0 CPU per step", "rank0_cpu_ms_per_step")):
            a, b, error = linear_fit(ranks, [row[field] for row in results])
            fits[field] = {"a_ms": a, "b_ms_per_rank": b, "largest_relative_error": error,
                           "predicted_ms": {str(n): a + b * n for n in predict}}
            print(f"| {label} | {a:.2f} | {b * 1e3:.1f} | {error:.0%} | "
                  + " | ".join(f"{a + b * n:.0f} ms" for n in predict) + " |")
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
              f"steady_latency_ms={row['cycle_ms']:.3f}")


if __name__ == "__main__":
    sys.exit(main())
