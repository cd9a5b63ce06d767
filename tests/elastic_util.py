"""Running an elastic job under the real ``roundelrun`` while a test changes its hosts and kills workers.

``ElasticJob`` writes a discovery script that prints a hosts file the test
rewrites, starts the launcher, collects its output as it comes, and lets the
test wait for lines, kill a worker by its label (``host:slot``, found by the
pid the launcher prints when it starts one) and check
what the training worker (tests/workers/torch_elastic.py or
keras_elastic.py) printed.
"""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import psutil

from launch_util import LAUNCHER, clean_env

_LINE = re.compile(r"^\[([^\]]+)\]<(stdout|stderr)>:(.*)$")


class ElasticJob:
    """One elastic ``roundelrun`` job; see the module docstring."""

    def __init__(self, tmp_path: Path, hosts: str | None, script: str, launcher_args=(), env: dict | None = None,
                 script_args=()):
        """``hosts``: what the discovery script prints first; None for a job without one (``-H`` hosts
        with ``--min-np`` in ``launcher_args``)."""
        self.hosts_file = tmp_path / "hosts.txt"
        hosts_args = []
        if hosts is not None:
            self.set_hosts(hosts)
            discover = tmp_path / "discover.sh"
            discover.write_text(f"#!/bin/sh\ncat {self.hosts_file}\n")
            discover.chmod(0o755)
            hosts_args = ["--host-discovery-script", str(discover)]
        command = [*LAUNCHER, *hosts_args, *map(str, launcher_args),
                   sys.executable, script, *map(str, script_args)]
        self.lines: list[tuple[float, str]] = []  # (time, line) from stdout and stderr, in arrival order
        self._cond = threading.Condition()
        self._triggers: list[tuple[str, object]] = []  # (text, action) run once, on the line that holds text
        self.started = time.monotonic()
        self.process = subprocess.Popen(command, env=clean_env(env), stdout=subprocess.PIPE,
                                        stderr=subprocess.PIPE, text=True, start_new_session=True)
        self._readers = [threading.Thread(target=self._read, args=(pipe,), daemon=True)
                         for pipe in (self.process.stdout, self.process.stderr)]
        for reader in self._readers:
            reader.start()

    def _read(self, pipe) -> None:
        for line in pipe:
            with self._cond:
                fired = [t for t in self._triggers if t[0] in line]
                for trigger in fired:
                    self._triggers.remove(trigger)
                self.lines.append((time.monotonic(), line.rstrip("\n")))
                self._cond.notify_all()
            for _, action in fired:
                action()

    def when(self, text: str, action) -> None:
        """Call ``action()`` (on the reader's thread, as soon as it reads it) for the first later line
        that contains ``text``."""
        with self._cond:
            self._triggers.append((text, action))

    def time_of(self, text: str, after: float = 0.0) -> float | None:
        """When the first line containing ``text`` arrived at or after ``after`` (monotonic), or None."""
        with self._cond:
            return next((t for t, line in self.lines if t >= after and text in line), None)

    def set_hosts(self, text: str) -> None:
        """Replace what the discovery script prints (atomically)."""
        tmp = self.hosts_file.with_suffix(".tmp")
        tmp.write_text(text)
        os.replace(tmp, self.hosts_file)

    def output(self) -> list[str]:
        """The lines so far."""
        with self._cond:
            return [line for _, line in self.lines]

    def text(self) -> str:
        return "\n".join(self.output())

    def wait_for(self, predicate, timeout: float = 120.0, what: str = "") -> None:
        """Wait until ``predicate(lines)`` is true; fail with the output so far after ``timeout`` s."""
        deadline = time.monotonic() + timeout
        with self._cond:
            while not predicate([line for _, line in self.lines]):
                left = deadline - time.monotonic()
                if left <= 0 or (self.process.poll() is not None and not any(r.is_alive() for r in self._readers)):
                    self.stop()  # a failed test leaves nothing running
                    raise AssertionError(f"timed out waiting for {what or predicate}\n{self.describe()}")
                self._cond.wait(min(left, 0.5))

    def count(self, text: str) -> int:
        with self._cond:
            return sum(text in line for _, line in self.lines)

    def wait_count(self, text: str, count: int, timeout: float = 120.0) -> None:
        """Wait until ``count`` lines contain ``text``."""
        self.wait_for(lambda lines: sum(text in line for line in lines) >= count, timeout,
                      f"{count} line(s) containing {text!r}")

    def pid(self, label: str) -> int:
        """The process id of the latest worker started with ``label`` on this machine (the command itself,
        the child of the watchdog the launcher names)."""
        started = re.compile(rf"^roundelrun: started worker {re.escape(label)} \(#\d+, watchdog pid (\d+)\)$")
        pids = [int(m.group(1)) for line in self.output() if (m := started.match(line))]
        assert pids, f"no worker {label} was started\n{self.describe()}"
        deadline = time.monotonic() + 10
        while True:
            try:
                children = psutil.Process(pids[-1]).children()
            except psutil.NoSuchProcess:
                children = []
            if children or time.monotonic() > deadline:
                break
            time.sleep(0.05)
        assert children, f"worker {label} (watchdog pid {pids[-1]}) is not running\n{self.describe()}"
        return children[0].pid

    def kill(self, label: str) -> None:
        """SIGKILL the worker with ``label``."""
        pid = self.pid(label)
        try:
            os.kill(pid, signal.SIGKILL)
        except ProcessLookupError:
            raise AssertionError(f"worker {label} (pid {pid}) is not running\n{self.describe()}") from None

    def stop(self) -> None:
        """SIGTERM the launcher (it stops its workers); SIGKILL its process group after 20 s."""
        if self.process.poll() is not None:
            return
        self.process.terminate()
        try:
            self.process.wait(20)
        except subprocess.TimeoutExpired:
            os.killpg(self.process.pid, signal.SIGKILL)
            self.process.wait()

    def finish(self, timeout: float = 240.0) -> int:
        """Wait for the launcher to exit; return its status (kill it and fail after ``timeout`` s)."""
        try:
            self.process.wait(timeout)
        except subprocess.TimeoutExpired:
            os.killpg(self.process.pid, signal.SIGKILL)
            self.process.wait()
            raise AssertionError(f"the elastic job did not end within {timeout:g} s\n{self.describe()}")
        for reader in self._readers:
            reader.join(10)
        return self.process.returncode

    def describe(self) -> str:
        tail = "\n".join(line for _, line in self.lines[-150:])
        return f"exit status {self.process.poll()}\n--- last output ---\n{tail}"


def worker_lines(text: str) -> list[tuple[str, str, str]]:
    """``(label, stream, payload)`` of every worker line of the launcher's output."""
    out = []
    for line in text.splitlines():
        match = _LINE.match(line)
        if match:
            out.append(match.groups())
    return out


def records(text: str, kind: str) -> list[tuple[str, dict]]:
    """``(label, record)`` of every ``KIND {json}`` line the training worker printed."""
    return [(who, json.loads(payload[len(kind) + 1:])) for who, stream, payload in worker_lines(text)
            if stream == "stdout" and payload.startswith(kind + " ")]


def check_training(text: str, epochs: int | None, samples: int, batch: int, max_repeats: int) -> list[dict]:
    """Assert what every elastic run must show; return the FINAL records.

    Training reached ``epochs`` (None: the same epoch) on every rank of the last generation with
    identical parameters; rank 0's committed step never went backwards; each
    epoch's batches covered every sample, and at most ``max_repeats`` samples
    per epoch were processed more than once (work redone after a rollback,
    and the padding that evens out shards).
    """
    finals = [record for _, record in records(text, "FINAL")]
    assert finals, "no worker finished"
    size = finals[0]["size"]
    assert len(finals) == size, f"{len(finals)} FINAL lines for a last generation of {size}"
    assert sorted(r["rank"] for r in finals) == list(range(size))
    epochs = finals[0]["epoch"] if epochs is None else epochs
    for record in finals:
        assert record["epoch"] == epochs, record
        assert record["params"] == finals[0]["params"], "ranks finished with different parameters"
        if "gathered" in record:
            assert record["gathered"] == list(range(size)), f"unnamed allgather after training: {record}"
    committed = [int(payload.split()[1]) for _, stream, payload in worker_lines(text)
                 if stream == "stdout" and payload.startswith("COMMIT ")]
    assert committed, "rank 0 never committed"
    assert all(b > a for a, b in zip(committed, committed[1:])), f"committed steps went backwards: {committed}"
    check_resumed_from_commits(text)
    check_identity_variables(text)
    for epoch in range(epochs):
        seen = [i for _, r in records(text, "SEEN") if r["epoch"] == epoch for i in r["indices"]]
        assert set(seen) == set(range(samples)), f"epoch {epoch} missed samples {set(range(samples)) - set(seen)}"
        repeats = len(seen) - samples
        assert repeats <= max_repeats, f"epoch {epoch}: {repeats} samples processed again (allowed {max_repeats})"
    return finals


def check_identity_variables(text: str) -> None:
    """Assert that at every (re)start the worker's ``os.environ`` held its identity in that generation:
    ``HOROVOD_*`` and ``ROUNDEL_*`` rank, size, local and cross rank and size, and the host it was
    started on (for ``START`` records that carry ``env``)."""
    for label, r in records(text, "START"):
        if "env" not in r:
            continue
        expected = {"RANK": r["rank"], "SIZE": r["size"], "LOCAL_RANK": r["local_rank"],
                    "LOCAL_SIZE": r["local_size"], "CROSS_RANK": r["cross_rank"], "CROSS_SIZE": r["cross_size"],
                    "HOSTNAME": label.rsplit(":", 1)[0]}
        for name, value in expected.items():
            for prefix in ("HOROVOD_", "ROUNDEL_"):
                assert r["env"][prefix + name] == str(value), f"{label}: {prefix}{name} in {r['env']}, wanted {value}"


def check_resumed_from_commits(text: str) -> None:
    """Assert that every (re)start of the training function continued from a known state.

    A ``START`` record (step and parameters after the sync) must show the
    parameters that a ``COMMIT`` or an earlier ``START`` showed at the same
    step: a rank never resumes a committed step with other weights (e.g. the
    random ones of a worker that joined and never committed itself).
    """
    known: dict[int, list] = {}
    for _, stream, payload in worker_lines(text):
        if stream != "stdout":
            continue
        if payload.startswith("COMMIT "):
            _, step, params = payload.split(" ", 2)
            known[int(step)] = json.loads(params)
        elif payload.startswith("START "):
            record = json.loads(payload[len("START "):])
            step = record["step"]
            if step in known:
                assert record["params"] == known[step], (
                    f"rank {record['rank']} resumed step {step} with parameters {record['params'][:3]}..., "
                    f"not the ones committed at that step {known[step][:3]}...")
            known[step] = record["params"]
