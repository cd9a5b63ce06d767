"""The job's counters in Prometheus' text format, served over HTTP by rank 0.

``roundelrun --metrics-port [HOST:]PORT`` (``ROUNDEL_METRICS_PORT``) makes rank
0 serve ``GET /metrics`` (any path answers the same; rank 0 says where on
its stderr: ``roundel: Prometheus metrics at http://HOST:PORT/metrics``) with:

* ``roundel_collectives_total{kind,outcome}`` and
  ``roundel_collective_bytes_total{kind}``: rank 0's collectives and the
  bytes of its input tensors, by kind;
* ``roundel_collective_seconds{kind}``: a histogram of each one's time from
  submission to completion on rank 0 (negotiation, waiting for the other
  ranks, and the transfer);
* ``roundel_negotiation_seconds``: a histogram of the time rank 0's names
  waited for the other ranks and the coordinator before being dispatched;
* ``roundel_stall_warnings_total``, ``roundel_deadlocks_total``,
  ``roundel_elastic_resets_total`` (at 0 from the start);
* ``roundel_ranks`` and, per rank, ``roundel_rank_last_ratio`` (the share of
  cycles it submitted last) and ``roundel_rank_lag_seconds`` (its median lag
  behind the median rank then; see :mod:`roundel.common.engine.stragglers`).

Counting is a few dictionary operations per collective, and only on rank 0
with the port set. The counts live in the process, so they survive an
elastic reset of the job in the process that is rank 0.
"""

from __future__ import annotations

import bisect
import http.server
import math
import sys
import threading

BUCKETS_S = (0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0)

_HELP = {
    "roundel_collectives_total": ("counter", "Collectives completed on rank 0, by kind and outcome."),
    "roundel_collective_bytes_total": ("counter", "Bytes of rank 0's input tensors of its collectives, by kind."),
    "roundel_collective_seconds": ("histogram", "Rank 0's collectives, submission to completion."),
    "roundel_negotiation_seconds": ("histogram", "Rank 0's names, submission to dispatch by the coordinator."),
    "roundel_stall_warnings_total": ("counter", "Stall warnings: a name waited past the stall-check time."),
    "roundel_deadlocks_total": ("counter", "Deadlocks detected and failed."),
    "roundel_elastic_resets_total": ("counter", "Elastic resets this process went through."),
    "roundel_ranks": ("gauge", "Ranks in the job."),
    "roundel_rank_last_ratio": ("gauge", "Share of the cycles in which the rank submitted last."),
    "roundel_rank_lag_seconds": ("gauge", "The rank's median lag behind the median rank when it was last."),
}


_UNLABELED_COUNTERS = ("roundel_stall_warnings_total", "roundel_deadlocks_total", "roundel_elastic_resets_total")


def _escaped(value) -> str:
    """A label value as the text format writes it: backslash, double quote and newline escaped."""
    return str(value).replace("\\", "\\\\").replace('"', '\\"').replace("\n", "\\n")


def _labels(labels: tuple) -> str:
    return "{" + ",".join(f'{key}="{_escaped(value)}"' for key, value in labels) + "}" if labels else ""


class Metrics:
    """Counters and histograms, and gauges read at scrape time from ``collectors``."""

    def __init__(self):
        self._lock = threading.Lock()
        # the counters without labels are there at 0 from the start, as Prometheus expects of a counter
        self._counters: dict[tuple, float] = {(name, ()): 0.0 for name in _UNLABELED_COUNTERS}
        self._histograms: dict[tuple, list] = {}  # (name, labels) -> [bucket counts..., count, sum]
        self.collectors: list = []  # callables returning (name, labels tuple, value) gauges

    def count(self, name: str, amount: float = 1.0, **labels) -> None:
        key = (name, tuple(sorted(labels.items())))
        with self._lock:
            self._counters[key] = self._counters.get(key, 0.0) + amount

    def observe(self, name: str, seconds: float, **labels) -> None:
        key = (name, tuple(sorted(labels.items())))
        with self._lock:
            row = self._histograms.get(key)
            if row is None:
                row = self._histograms[key] = [0] * (len(BUCKETS_S) + 2) + [0.0]
            row[bisect.bisect_left(BUCKETS_S, seconds)] += 1
            row[-2] += 1
            row[-1] += seconds

    def exposition(self) -> str:
        """Everything, in Prometheus' text exposition format (version 0.0.4)."""
        samples: dict[str, list] = {}
        with self._lock:
            for (name, labels), value in self._counters.items():
                samples.setdefault(name, []).append(f"{name}{_labels(labels)} {value:g}")
            for (name, labels), row in self._histograms.items():
                lines, running = samples.setdefault(name, []), 0
                for bound, hits in zip(BUCKETS_S, row):
                    running += hits
                    lines.append(f"{name}_bucket{_labels(labels + (('le', f'{bound:g}'),))} {running}")
                lines.append(f"{name}_bucket{_labels(labels + (('le', '+Inf'),))} {row[-2]}")
                lines.append(f"{name}_count{_labels(labels)} {row[-2]}")
                lines.append(f"{name}_sum{_labels(labels)} {row[-1]:g}")
        for collect in list(self.collectors):
            for name, labels, value in collect():
                if math.isfinite(value):
                    samples.setdefault(name, []).append(f"{name}{_labels(labels)} {value:g}")
        out = []
        for name in sorted(samples):
            kind, text = _HELP.get(name, ("untyped", name))
            out += [f"# HELP {name} {text}", f"# TYPE {name} {kind}", *samples[name]]
        return "\n".join(out) + "\n"


# One table per process, at module level: its counters are the job's totals on this rank, so they outlive
# an elastic reset's shutdown() and init() (a new engine, the same endpoint and counts).
METRICS = Metrics()
_announced: set[str] = set()


class _Server(http.server.ThreadingHTTPServer):
    """The metrics' own HTTP server class: serving again after an elastic reset binds the port at once
    (the old server's connections may still be in TIME_WAIT); a scrape's thread never holds the process."""

    allow_reuse_address = True
    daemon_threads = True


class MetricsServer:
    """Serves ``metrics.exposition()`` over HTTP on ``address`` ("[HOST:]PORT") from a daemon thread."""

    def __init__(self, address: str, metrics: Metrics = METRICS):
        host, _, port = address.rpartition(":")
        registry = metrics

        class Handler(http.server.BaseHTTPRequestHandler):
            def do_GET(self):  # noqa: N802 - the http.server name
                body = registry.exposition().encode()
                self.send_response(200)
                self.send_header("Content-Type", "text/plain; version=0.0.4; charset=utf-8")
                self.send_header("Content-Length", str(len(body)))
                self.end_headers()
                self.wfile.write(body)

            def log_message(self, format, *args):  # noqa: A002 - quiet: no line per scrape
                pass

        self._server = _Server((host or "0.0.0.0", int(port)), Handler)
        self.port = self._server.server_address[1]
        self.host = host
        self._thread = threading.Thread(target=self._server.serve_forever, name="roundel-metrics", daemon=True)
        self._thread.start()

    def where(self, this_host: str) -> str:
        """``http://HOST:PORT/metrics``, HOST being ``this_host`` where every interface is served."""
        if self.host in ("", "0.0.0.0", "::"):
            return f"http://{this_host}:{self.port}/metrics (listening on every interface)"
        host = f"[{self.host}]" if ":" in self.host else self.host
        return f"http://{host}:{self.port}/metrics"

    def announce(self, this_host: str) -> None:
        """Say on stderr where the metrics are, once per address in this process (an elastic reset serves
        them again)."""
        line = f"roundel: Prometheus metrics at {self.where(this_host)}"
        if line not in _announced:
            _announced.add(line)
            print(line, file=sys.stderr, flush=True)

    def close(self) -> None:
        self._server.shutdown()
        self._server.server_close()
