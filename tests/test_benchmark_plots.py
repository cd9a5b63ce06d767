"""The benchmarks, at their smallest settings, write a readable PNG beside their table.

``benchmarks/allreduce.py`` runs under ``roundelrun -np 2`` with three small
sizes and one short round; ``benchmarks/torch_training.py`` runs interleaved
(one ``roundelrun -np 2`` job) with the small CNN on a tiny batch for one
step per span; ``benchmarks/control_scale.py`` simulates jobs of 4 and 9
ranks. The figures themselves are not checked, only that each run succeeds,
names its plot, and the plot is a PNG matplotlib reads back.
``benchmarks/elastic_reset.py`` kills a rank of a 3-rank elastic job and must
time the survivors' reset.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import matplotlib

matplotlib.use("Agg")
import matplotlib.image  # noqa: E402

from launch_util import describe, run_command, run_job  # noqa: E402

BENCHMARKS = Path(__file__).resolve().parents[1] / "benchmarks"
PNG_SIGNATURE = b"\x89PNG\r\n\x1a\n"


def assert_valid_png(path: Path, result) -> None:
    assert path.is_file(), f"no plot at {path}\n" + describe(result)
    assert path.read_bytes()[:8] == PNG_SIGNATURE, f"{path} does not start with the PNG signature"
    pixels = matplotlib.image.imread(path)
    assert pixels.ndim == 3 and pixels.shape[0] > 100 and pixels.shape[1] > 100, pixels.shape
    assert pixels.min() < pixels.max(), f"{path} is a blank image"
    assert f"plot: {path}" in result.stdout, "the plot's path is not printed\n" + describe(result)


def test_allreduce_benchmark_writes_bandwidth_plot(tmp_path):
    png = tmp_path / "bandwidth.png"
    result = run_job(2, BENCHMARKS / "allreduce.py", "--sizes", "4,4K,64K", "--rounds", "1", "--target-s", "0.01",
                     "--min-iters", "1", "--skip-many", "--plot", png, timeout=90)
    assert result.returncode == 0, describe(result)
    assert_valid_png(png, result)


def test_training_benchmark_writes_throughput_plot(tmp_path):
    png = tmp_path / "training.png"
    result = run_command([sys.executable, str(BENCHMARKS / "torch_training.py"), "--interleaved",
                          "--model", "small_cnn", "--batch-size", "4", "--image-size", "16", "--rounds", "1",
                          "--measurements", "1", "--steps", "1", "--warmup", "1",
                          "--only", "roundel,ddp,single,lockstep",
                          "--plot", str(png)], timeout=90)
    assert result.returncode == 0, describe(result)
    assert "scaling efficiency, roundel" in result.stdout, describe(result)
    assert "roundel / lockstep bound" in result.stdout, describe(result)
    assert_valid_png(png, result)


def test_control_scale_simulation_runs_rank_zero_against_simulated_ranks(tmp_path):
    png, figures = tmp_path / "control.png", tmp_path / "control.json"
    result = run_command([sys.executable, BENCHMARKS / "control_scale.py", "--ranks", "4,9", "--workers", "2",
                          "--steps", "2", "--json", figures, "--plot", png], timeout=180)
    assert result.returncode == 0, describe(result)
    assert_valid_png(png, result)
    rows = json.loads(figures.read_text())["results"]
    assert [row["ranks"] for row in rows] == [4, 9] and all(row["cycle_ms"] > 0 for row in rows), rows
    summary = [line for line in result.stdout.splitlines() if line.startswith("control_scale: ")]
    assert [line.split()[1] for line in summary] == ["ranks=4", "ranks=9"], describe(result)
    assert all(key in summary[0] for key in ("connect_s=", "first_step_s=", "steady_cpu_ms=",
                                              "steady_latency_ms=")), summary


def test_elastic_reset_benchmark_times_a_reset_after_a_kill(tmp_path):
    figures = tmp_path / "reset.json"
    result = run_command([sys.executable, BENCHMARKS / "elastic_reset.py", "--np", "3", "--kill-at-step", "5",
                          "--json", figures], timeout=240)
    assert result.returncode == 0, describe(result)
    [row] = json.loads(figures.read_text())["results"]
    assert row["ranks"] == 3 and 0 < row["reset_s"] < 60, row
