"""The Prometheus endpoint: scraped from rank 0 in the middle of a real 2-rank job.

The job (``tests/workers/torch_metrics.py``) runs allreduces, allgathers and
one mismatched allreduce; the test scrapes ``--metrics-port`` while it runs
and parses the text with ``prometheus_client``'s own parser.
"""

import http.server
import socket
import subprocess
import sys
import time
import urllib.request

from prometheus_client.parser import text_string_to_metric_families

from launch_util import LAUNCHER, clean_env, _script_path
from roundel.common.engine.metrics import Metrics, MetricsServer


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def _scrape_a_job(tmp_path, metrics_port: str, url_host: str) -> tuple[str, str]:
    """Run tests/workers/torch_metrics.py at 2 ranks with ``--metrics-port metrics_port``, scrape it at
    ``url_host`` while it runs; return (the scrape, the launcher's stderr), asserting the job ended with 0."""
    flag, port = tmp_path / "scrape-now", metrics_port.rsplit(":", 1)[-1]
    command = [*LAUNCHER, "--metrics-port", metrics_port, "-np", "2", sys.executable,
               _script_path("torch_metrics.py"), str(flag)]
    job = subprocess.Popen(command, env=clean_env(), stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        deadline = time.monotonic() + 120
        while not flag.exists():
            assert job.poll() is None and time.monotonic() < deadline, job.communicate()
            time.sleep(0.1)
        text = urllib.request.urlopen(f"http://{url_host}:{port}/metrics", timeout=10).read().decode()
    finally:
        (tmp_path / "scrape-now.done").touch()
        out, err = job.communicate(timeout=120)
    assert job.returncode == 0, out + err
    return text, err


def test_rank_zero_serves_the_jobs_counters_in_prometheus_text_format(tmp_path):
    port = _free_port()
    text, err = _scrape_a_job(tmp_path, f"127.0.0.1:{port}", "127.0.0.1")
    families = {family.name: family for family in text_string_to_metric_families(text)}
    samples = {(s.name, tuple(sorted(s.labels.items()))): s.value for f in families.values() for s in f.samples}
    assert samples[("roundel_collectives_total", (("kind", "allreduce"), ("outcome", "ok")))] >= 20
    assert samples[("roundel_collectives_total", (("kind", "allgather"), ("outcome", "ok")))] == 20
    assert samples[("roundel_collectives_total", (("kind", "allreduce"), ("outcome", "error")))] == 1
    assert samples[("roundel_collective_bytes_total", (("kind", "allgather"),))] == 20 * 2 * 3 * 4  # its input
    assert families["roundel_collective_seconds"].type == "histogram"
    assert samples[("roundel_collective_seconds_count", (("kind", "allgather"),))] == 20
    assert families["roundel_negotiation_seconds"].type == "histogram"
    assert samples[("roundel_ranks", ())] == 2
    assert families["roundel_collectives"].type == "counter"  # the parser drops the _total suffix
    for counter in ("roundel_stall_warnings_total", "roundel_deadlocks_total", "roundel_elastic_resets_total"):
        assert samples[(counter, ())] == 0, text  # present before their first increment, as Prometheus expects
    announced = [line for line in err.splitlines() if "Prometheus metrics at" in line]
    assert announced == [f"[0]<stderr>:roundel: Prometheus metrics at http://127.0.0.1:{port}/metrics"], err


def test_a_port_alone_serves_on_every_interface_and_says_where(tmp_path):
    port = _free_port()
    text, err = _scrape_a_job(tmp_path, str(port), "localhost")
    line = f"[0]<stderr>:roundel: Prometheus metrics at http://localhost:{port}/metrics (listening on every interface)"
    assert line in err.splitlines(), err
    assert "roundel_deadlocks_total 0" in text.splitlines(), text


def test_the_text_format_of_counters_histograms_and_gauges():
    metrics = Metrics()
    assert "roundel_elastic_resets_total 0" in metrics.exposition().splitlines()
    metrics.count("roundel_deadlocks_total")
    for seconds in (0.0001, 0.003, 100.0):
        metrics.observe("roundel_collective_seconds", seconds, kind="allreduce")
    metrics.collectors.append(lambda: [("roundel_rank_lag_seconds", (("rank", "1"),), 0.05)])
    families = {f.name: f for f in text_string_to_metric_families(metrics.exposition())}
    buckets = {s.labels["le"]: s.value for s in families["roundel_collective_seconds"].samples
               if s.name.endswith("_bucket")}
    assert buckets["0.0005"] == 1 and buckets["0.005"] == 2 and buckets["30"] == 2 and buckets["+Inf"] == 3
    assert families["roundel_deadlocks"].samples[0].value == 1
    assert families["roundel_rank_lag_seconds"].samples[0].labels == {"rank": "1"}


def test_label_values_are_escaped_and_the_standard_library_server_class_is_left_alone():
    """A label value with a backslash, a double quote and a newline scrapes back unchanged; serving sets
    allow_reuse_address on roundel's own server class, not on the standard library's."""
    stdlib = {cls: dict(vars(cls)) for cls in (http.server.HTTPServer, http.server.ThreadingHTTPServer)}
    value = 'C:\\jobs\\"nightly"\nsecond line'
    metrics = Metrics()
    metrics.count("roundel_collectives_total", kind=value, outcome="ok")
    server = MetricsServer("127.0.0.1:0", metrics)
    try:
        text = urllib.request.urlopen(f"http://127.0.0.1:{server.port}/metrics", timeout=10).read().decode()
        reuse = server._server.socket.getsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR)
    finally:
        server.close()
    assert 'kind="C:\\\\jobs\\\\\\"nightly\\"\\nsecond line"' in text, text
    samples = {f.name: f.samples for f in text_string_to_metric_families(text)}["roundel_collectives"]
    assert [s.labels for s in samples] == [{"kind": value, "outcome": "ok"}], samples
    assert reuse != 0, "the metrics server's socket is not SO_REUSEADDR"
    for cls, before in stdlib.items():
        assert dict(vars(cls)) == before, f"starting the metrics server changed http.server.{cls.__name__}"
