"""Horovod's timeline: a Chrome-trace JSON file of what each named collective went through.

Only rank 0 records (its coordinator sees every rank's requests arrive).
Each tensor name is a row (a trace "process" named, as in Horovod, after the
op kind and the tensor: ``allreduce.grad.w1``; a name that already starts
with its kind, such as ``allreduce.noname.3``, is kept) with two tracks: "negotiation" and "execution" (a tensor's next
negotiation may begin while rank 0 still executes its last one). Per
collective, in order:

* ``NEGOTIATE_<OP>`` (``NEGOTIATE_ALLREDUCE`` ...) from the first rank's
  request to the agreement, with an instant event named after each rank
  (``"0"``, ``"1"`` ...) when that rank's request arrived;
* the collective (``ALLREDUCE``, ``ALLGATHER``, ``BROADCAST``, ``ALLTOALL``,
  ``REDUCESCATTER``, ...) holding its activities: ``QUEUE`` (waiting for the
  executor), ``MEMCPY_IN_FUSION_BUFFER``, the transport call
  (``GLOO_ALLREDUCE`` ...), ``MEMCPY_OUT_FUSION_BUFFER``.

``CYCLE_START`` instant markers are added per engine cycle when asked.

Callers record events from the engine's threads; a writer thread turns them
into JSON every 50 ms. The queue between them is bounded: when it is full,
events are dropped and counted, never waited for. The file is written as ``[`` then one
event per line, each followed by ``,`` and flushed whenever the writer has
caught up, so a killed job leaves a file readable up to its last full line
(``roundel.timeline.load`` reads it); ``stop()`` closes the JSON array.
"""

from __future__ import annotations

import collections
import functools
import json
import logging
import os
import threading
import time

log = logging.getLogger("roundel")

QUEUE_LIMIT = 1 << 16
_TRANSPORT_OPS = {"allreduce": "ALLREDUCE", "allgather": "ALLGATHER", "broadcast": "BCAST",
                  "alltoall": "ALLTOALL", "reducescatter": "REDUCESCATTER"}
_TOP_LEVEL, _ACTIVITY = 1, 2
NEGOTIATION_TID, EXECUTION_TID = 1, 2  # a tensor's next negotiation may start before rank 0 ran its last one
_WRITE_EVERY_S = 0.05
_T0_NS = time.perf_counter_ns()  # one clock per process: a timeline resumed after init() again continues it
_ROWS_BY_PATH: dict[str, dict[str, int]] = {}  # the files this process wrote: tensor name -> row


def transport_activity(backend_name: str, op_label: str) -> str:
    """Horovod's name for a transport call, e.g. ``GLOO_ALLREDUCE`` or ``MPI_BCAST``."""
    return f"{backend_name.upper()}_{_TRANSPORT_OPS.get(op_label, op_label.upper())}"


def row_name(name: str, op_label: str) -> str:
    """Horovod's timeline row for tensor ``name`` of op kind ``op_label``: ``<kind>.<name>``."""
    return name if name.startswith(op_label + ".") else f"{op_label}.{name}"


@functools.lru_cache(maxsize=4096)
def _quoted(text: str) -> str:
    return json.dumps(text)


class _Writer:
    """The thread that owns one open timeline file (new, or one this process wrote, continued)."""

    def __init__(self, path: str, epoch_us: int, resume: bool):
        self.path = path
        self.dropped = 0
        key = os.path.abspath(path)
        resume = resume and key in _ROWS_BY_PATH and os.path.exists(path)
        self._file = open(path, "r+b" if resume else "wb")  # noqa: SIM115 - closed by the writer thread
        self._pending: collections.deque = collections.deque()  # appends are atomic: no lock to take
        self._closing = threading.Event()
        if resume:
            self._rows = _ROWS_BY_PATH[key]
            self._file.seek(0, os.SEEK_END)
            if self._file.tell() >= 3:
                self._file.seek(-3, os.SEEK_END)
                if self._file.read(3) == b"\n]\n":  # reopen the closed array
                    self._file.seek(-3, os.SEEK_END)
                    self._file.truncate()
                    self._file.write(b",\n")
        else:
            self._rows = _ROWS_BY_PATH[key] = {}
            self._write([{"name": "process_name", "ph": "M", "pid": 0,
                          "args": {"name": "roundel", "start_time_since_epoch_in_micros": epoch_us}},
                         {"name": "process_sort_index", "ph": "M", "pid": 0, "args": {"sort_index": 0}}],
                        head=b"[\n")
        self._file.flush()
        self._thread = threading.Thread(target=self._loop, name="roundel-timeline", daemon=True)
        self._thread.start()

    def put(self, record: tuple) -> None:
        if len(self._pending) < QUEUE_LIMIT:
            self._pending.append(record)
        else:
            self.dropped += 1

    def close(self, timeout: float = 10.0) -> None:
        """Write what is queued, close the JSON array and the file."""
        self._closing.set()
        self._thread.join(timeout)

    def _loop(self) -> None:
        pending = self._pending
        try:
            while True:
                closing = self._closing.wait(_WRITE_EVERY_S)
                events = []
                for _ in range(len(pending)):  # what is there now; later records wait for the next round
                    events.extend(self._events(pending.popleft()))
                if events:
                    self._write(events)
                    self._file.flush()
                if closing:
                    self._finish()
                    return
        except OSError as exc:
            log.error("roundel could not write the timeline %s: %s; no more events are written", self.path, exc)
            self._file.close()

    def _events(self, record: tuple) -> list:
        """The JSON lines of one record (with its row's metadata the first time a name is seen)."""
        name, tid, phase, label, ts, args = record
        if name is None:  # a marker
            return [f'{{"name": {_quoted(label)}, "ph": "i", "ts": {ts}, "s": "g"}}']
        events: list = []
        pid = self._rows.get(name)
        if pid is None:
            pid = self._rows[name] = len(self._rows) + 1
            events.append({"name": "process_name", "ph": "M", "pid": pid, "args": {"name": name}})
            events.append({"name": "process_sort_index", "ph": "M", "pid": pid, "args": {"sort_index": pid}})
            for row, row_name in ((NEGOTIATION_TID, "negotiation"), (EXECUTION_TID, "execution")):
                events.append({"name": "thread_name", "ph": "M", "pid": pid, "tid": row, "args": {"name": row_name}})
            events = [json.dumps(event) for event in events]
        event = f'{{"ph": "{phase}", "ts": {ts}, "pid": {pid}, "tid": {tid}'  # by hand: json.dumps is slower
        if label:
            event += f', "name": {_quoted(label)}'
        if phase == "X":
            event += ', "dur": 0'
        if args:
            event += f', "args": {json.dumps(args)}'
        events.append(event + "}")
        return events

    def _write(self, events: list, head: bytes = b"") -> None:
        """Write JSON lines (strings) or events (dicts), each followed by a comma."""
        text = "".join((e if isinstance(e, str) else json.dumps(e)) + ",\n" for e in events)
        self._file.write(head + text.encode())

    def _finish(self) -> None:
        if self.dropped:
            log.warning("roundel timeline %s: %d events were dropped (the writer could not keep up)",
                        self.path, self.dropped)
        self._write([{"name": "roundel_dropped_events", "ph": "M", "pid": 0, "args": {"count": self.dropped}}])
        self._file.seek(-2, 1)  # replace the last ",\n" by the closing bracket
        self._file.write(b"\n]\n")
        self._file.truncate()
        self._file.close()


class Timeline:
    """Rank 0's recorder. Every method is cheap and does nothing while no file is open."""

    def __init__(self):
        self.active = False
        self.mark_cycles = False
        self._writer: _Writer | None = None
        self._lock = threading.Lock()
        self._negotiating: dict[str, tuple[str, int]] = {}  # name -> (its row, µs it opened), while negotiated
        self._executing: dict[str, tuple[int, str | None]] = {}  # tensor name -> (_TOP_LEVEL or _ACTIVITY, its row)

    @property
    def dropped(self) -> int:
        """Events dropped so far by the open file's writer (0 with none open)."""
        writer = self._writer
        return writer.dropped if writer else 0

    def start(self, path: str, mark_cycles: bool = False, resume: bool = False) -> None:
        """Start writing the file at ``path`` (closing the current one). With ``resume``, a file this
        process wrote before (an earlier ``init()``) is continued, else it is started anew. Raises
        OSError if it cannot be written."""
        self.stop()
        epoch_us = time.time_ns() // 1000 - (time.perf_counter_ns() - _T0_NS) // 1000
        writer = _Writer(path, epoch_us, resume)
        with self._lock:
            self._writer = writer
            self.mark_cycles = mark_cycles
            self.active = True

    def stop(self) -> None:
        """Finish and close the current file, if any (the engine's threads never wait for it)."""
        with self._lock:
            writer, self._writer = self._writer, None
            self.active = False
            self._negotiating.clear()
            self._executing.clear()
        if writer is not None:
            writer.close()

    def _record(self, row, tid: int, phase: str, label: str = "", args=None, ts: int | None = None) -> None:
        if ts is None:
            ts = (time.perf_counter_ns() - _T0_NS) // 1000
        writer = self._writer
        if writer is not None:  # None once stopped: a record racing stop() is dropped
            writer.put((row, tid, phase, label, ts, args))

    # ----------------------------------------------------- negotiation (coordinator)
    def rank_ready(self, name: str, op_label: str, rank: int, ago_s: float = 0.0) -> None:
        """``rank``'s request for ``name`` arrived, sent ``ago_s`` seconds ago (the time a relay held it);
        the first one opens ``NEGOTIATE_<OP>``, and no mark goes before that opening."""
        with self._lock:
            if not self.active:
                return
            ts = (time.perf_counter_ns() - _T0_NS) // 1000 - int(ago_s * 1e6)
            row, opened = self._negotiating.get(name, (None, ts))
            if row is None:
                row = row_name(name, op_label)
                self._negotiating[name] = (row, ts)
                self._record(row, NEGOTIATION_TID, "B", "NEGOTIATE_" + op_label.upper(), ts=ts)
            self._record(row, NEGOTIATION_TID, "X", str(rank), ts=max(ts, opened))

    def negotiated(self, name: str) -> None:
        """Every rank agreed on ``name``: close its negotiation."""
        with self._lock:
            row, _ = self._negotiating.pop(name, (None, 0)) if self.active else (None, 0)
            if row is not None:
                self._record(row, NEGOTIATION_TID, "E")

    # ------------------------------------------------------------- execution
    def begin(self, names, op_label: str, activity: str = "") -> None:
        """The collective on ``names`` starts (optionally with its first activity)."""
        with self._lock:
            if not self.active:
                return
            for name in names:
                self._end_open(name)
                row = row_name(name, op_label)
                self._executing[name] = (_ACTIVITY if activity else _TOP_LEVEL, row)
                self._record(row, EXECUTION_TID, "B", op_label.upper())
                if activity:
                    self._record(row, EXECUTION_TID, "B", activity)

    def activity(self, names, activity: str) -> None:
        """``names`` move to ``activity`` inside their collective, ending the previous one ("" starts none)."""
        with self._lock:
            if not self.active:
                return
            for name in names:
                begun = self._executing.get(name)
                if begun is None:
                    continue  # began before this file was opened
                state, row = begun
                if state == _ACTIVITY:
                    self._record(row, EXECUTION_TID, "E")
                self._executing[name] = (_ACTIVITY if activity else _TOP_LEVEL, row)
                if activity:
                    self._record(row, EXECUTION_TID, "B", activity)

    def end(self, names, outputs=None) -> None:
        """The collective on ``names`` finished; ``outputs`` (tensors or None) give dtype and shape."""
        with self._lock:
            if not self.active:
                return
            for i, name in enumerate(names):
                state, row = self._executing.pop(name, (None, None))
                if state is None:
                    continue
                if state == _ACTIVITY:
                    self._record(row, EXECUTION_TID, "E")
                output = outputs[i] if outputs is not None and i < len(outputs) else None
                args = None
                if output is not None and hasattr(output, "dtype") and hasattr(output, "shape"):
                    args = {"dtype": str(output.dtype).replace("torch.", ""), "shape": str(list(output.shape))}
                self._record(row, EXECUTION_TID, "E", "", args)

    def cycle(self) -> None:
        """A ``CYCLE_START`` marker when cycles are marked."""
        if self.mark_cycles and self.active:
            with self._lock:
                if self.active:
                    self._record(None, 0, "i", "CYCLE_START")

    def _end_open(self, name: str) -> None:
        """Close spans left open for ``name`` (e.g. a collective that failed before it ended)."""
        state, row = self._executing.pop(name, (None, None))
        if state == _ACTIVITY:
            self._record(row, EXECUTION_TID, "E")
        if state is not None:
            self._record(row, EXECUTION_TID, "E")
