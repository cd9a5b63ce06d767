"""The benchmarks, at their smallest settings, write a readable PNG beside their table.

``benchmarks/allreduce.py`` runs under ``roundelrun -np 2`` with three small
sizes and one short round; ``benchmarks/torch_training.py`` runs interleaved
(one ``roundelrun -np 2`` job) with the small CNN on a tiny batch for one
step per span; ``benchmarks/control_scale.py`` simulates jobs of 4 and 9
ranks. The figures themselves are not checked, only that each run succeeds,
names its plot, and the plot is a PNG matplotlib reads back.
``benchmarks/elastic_reset.py`` kills a rank of a 3-rank elastic job and must
time the survivors' reset. ``benchmarks/scaling.py`` runs its copy, allreduce
and training comparisons at 2 ranks, and skips a rank count above the cores.
"""

from __future__ import annotations

import json
import os
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


def test_scaling_benchmark_runs_every_comparison_at_two_ranks(tmp_path):
    png, figures = tmp_path / "scaling.png", tmp_path / "scaling.json"
    result = run_command([sys.executable, BENCHMARKS / "scaling.py", "--np", "2", "--sizes", "4K,1M",
                          "--models", "mlp", "--quick", "--copy-mib", "16", "--json", figures, "--plot", png],
                         timeout=150)
    assert result.returncode == 0, describe(result)
    assert_valid_png(png, result)
    out = result.stdout
    assert "| 2 | 4 KiB |" in out and "| 2 | 1 MiB |" in out and "| 2 | mlp |" in out, describe(result)
    record = json.loads(figures.read_text())
    assert record["cores"] == len(os.sched_getaffinity(0)) and record["oversubscribed"] == [], record
    assert record["copy_bandwidth_bytes_per_s"]["2"] > 0, record
    assert [(row["np"], row["bytes"]) for row in record["allreduce"]] == [(2, 4096), (2, 1 << 20)], record
    for row in record["allreduce"]:
        assert row["roundel_s"] > 0 and row["raw_s"] > 0 and row["floor_s"] > 0, row
        assert row["raw_s"] / row["roundel_s"] > 0, row
    [training] = record["training"]
    assert training["np"] == 2 and training["model"] == "mlp", training
    assert all(training[key] > 0 for key in ("roundel_sps", "ddp_sps", "single_sps")), training


def test_scaling_benchmark_skips_more_ranks_than_cores():
    result = run_command([sys.executable, BENCHMARKS / "scaling.py", "--np", "2,4096", "--skip-allreduce",
                          "--skip-training", "--copy-mib", "4", "--copy-s", "0.1"],
                         timeout=60)
    assert result.returncode == 0, describe(result)
    assert "4096 ranks: skipped, this machine has" in result.stdout, describe(result)
    assert "| 2 |" in result.stdout, describe(result)
    alone = run_command([sys.executable, BENCHMARKS / "scaling.py", "--np", "4096", "--skip-training"], timeout=60)
    assert alone.returncode == 2, describe(alone)
    assert "4096 ranks: skipped" in alone.stdout and "nothing ran" in alone.stdout, describe(alone)
