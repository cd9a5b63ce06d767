"""The benchmarks, at their smallest settings, write a readable PNG beside their table.

``benchmarks/allreduce.py`` runs under ``roundelrun -np 2`` with three small
sizes and one short round; ``benchmarks/torch_training.py`` runs interleaved
(one ``roundelrun -np 2`` job) with the small CNN on a tiny batch for one
step per span; ``benchmarks/control_scale.py`` simulates jobs of 4 and 9
ranks (the second through relays). The figures themselves are not checked, only that each run succeeds,
names its plot, and the plot is a PNG matplotlib reads back.
``benchmarks/elastic_reset.py`` kills a rank of a 3-rank elastic job and must
time the survivors' reset; ``benchmarks/relay_hops.py`` times a 2- and a 3-rank
job with their relays chained and without; ``benchmarks/gloo_small_allreduce.py`` times both forms of
a small Gloo allreduce at 2 ranks; ``benchmarks/latency.py`` times each collective at 2 ranks, shared
memory on and off, against raw Gloo, with roundel's own share of each call. ``benchmarks/scaling.py`` runs its copy, allreduce
and training comparisons at 2 ranks, and skips a rank count above the cores.
``benchmarks/scaling_model.py`` fits the committed measurements, and recovers
the parameters of synthetic ones made by its laws; its GPU-host form (``--gpu``)
adds NCCL's published bandwidth to roundel's measured costs as its laws say.
"""

from __future__ import annotations

import json
import math
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
    # 9 ranks on hosts of 2 with relays, one under each: a chain of 4 relays under rank 0 (and rank 1, the relay
    # of rank 0's host, with no rank to relay for)
    result = run_command([sys.executable, BENCHMARKS / "control_scale.py", "--ranks", "4,9", "--workers", "2",
                          "--steps", "2", "--relay-from-ranks", "8", "--per-host", "2", "--fanout", "1",
                          "--json", figures, "--plot", png], timeout=180)
    assert result.returncode == 0, describe(result)
    assert_valid_png(png, result)
    rows = json.loads(figures.read_text())["results"]
    assert [row["ranks"] for row in rows] == [4, 9] and all(row["cycle_ms"] > 0 for row in rows), rows
    summary = [line for line in result.stdout.splitlines() if line.startswith("control_scale: ")]
    assert [line.split()[1] for line in summary] == ["ranks=4", "ranks=9"], describe(result)
    assert [row["relays"] for row in rows] == [False, True], rows
    assert all(key in summary[0] for key in ("connect_s=", "first_step_s=", "steady_cpu_ms=",
                                              "steady_latency_ms=")), summary


def test_control_scale_replayed_steps_run_on_rank_zero_alone(tmp_path):
    """With --replayed, rank 0 arms the schedule against the simulated ranks, then replays the steady steps."""
    figures = tmp_path / "control.json"
    result = run_command([sys.executable, BENCHMARKS / "control_scale.py", "--ranks", "4", "--workers", "1",
                          "--steps", "3", "--replayed", "--json", figures, "--plot", tmp_path / "c.png"], timeout=120)
    assert result.returncode == 0, describe(result)
    row = json.loads(figures.read_text())["results"][0]
    assert row["replayed"] and row["replayed_slots"] >= 3 and row["rank0_cpu_ms_per_step"] > 0, row
    assert "replayed=yes" in result.stdout, describe(result)


def test_relay_hops_benchmark_times_chains_of_relays_beside_direct_jobs(tmp_path):
    figures = tmp_path / "hops.json"
    result = run_command([sys.executable, BENCHMARKS / "relay_hops.py", "--np", "2,3", "--steps", "50",
                          "--json", figures], timeout=180)
    assert result.returncode == 0, describe(result)
    output = json.loads(figures.read_text())
    assert [(r["np"], r["depth"]) for r in output["rows"]] == [(2, 1), (3, 2)], output
    assert all(r["chain_ms"] > 0 and r["direct_ms"] > 0 for r in output["rows"]), output
    assert output["fit"] is not None and "per hop" in result.stdout, describe(result)
    bad = run_command([sys.executable, BENCHMARKS / "relay_hops.py", "--np", "1"], timeout=60)
    assert bad.returncode == 2 and "at least 2" in bad.stderr, describe(bad)


def test_gloo_small_allreduce_benchmark_times_both_forms_at_every_size():
    result = run_command([sys.executable, BENCHMARKS / "gloo_small_allreduce.py", "--ranks", "2", "--blocks", "1"],
                         timeout=120)
    assert result.returncode == 0, describe(result)
    rows = [line.split("|")[1:-1] for line in result.stdout.splitlines() if line.startswith("| 2 |")]
    assert len(rows) == 7, describe(result)
    assert all(float(ring.split()[0]) > 0 and float(gather.split()[0]) > 0 for _, _, ring, gather, _ in rows), rows


def test_latency_benchmark_times_each_collective_against_raw_gloo_and_roundels_own_share(tmp_path):
    png = tmp_path / "latency.png"
    result = run_command([sys.executable, BENCHMARKS / "latency.py", "--ranks", "2", "--calls", "10", "--png", png],
                         timeout=300)
    assert result.returncode == 0, describe(result)
    assert_valid_png(png, result)
    rows = [[cell.strip() for cell in line.split("|")[1:-1]] for line in result.stdout.splitlines()
            if line.startswith(("| allreduce |", "| broadcast |", "| allgather |"))]
    assert len(rows) == 2 * 3 * 6, describe(result)  # shared memory on and off, 3 collectives, 6 sizes
    for op, size, p50, _, raw, _, ratio, own, cpu in rows:
        ms = [float(cell.split()[0]) for cell in (p50, raw, own)]
        assert ms[0] > 0 and ms[1] > 0 and 0 <= ms[2] <= ms[0] + 0.001, (op, size, p50, raw, own)
        mine_us, raw_us = (float(part) for part in cpu.removesuffix(" µs").split(" / "))
        assert 0 < mine_us <= ms[0] * 1e3 * 3 and 0 <= raw_us, (op, size, p50, cpu)  # a thread's CPU within its time


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


def _shm(law: dict, n: int, size: int) -> float:
    """The shared-memory law on 16 cores (no rank waits for a core): whole up to 1 MiB, in 4 MiB pieces above."""
    waits, moved = (1, (n + 3) * size) if size <= 1 << 20 else (math.ceil(size / (4 << 20)) + 1, (5 + 1 / n) * size)
    return law["a0"] + law["w"] * waits * math.log2(n) + moved * (law["b0"] + law["b1"] * n)


def _synthetic_measurements(path: Path, law: dict) -> None:
    """Measurements of a 16-core machine made exactly by the model's laws with the parameters ``law``."""
    sizes = [4096, 256 * 1024, 1 << 20, 4 << 20, 16 << 20]

    def gloo(n, size, steps, chunk):  # two Gloo threads per rank: from 8 ranks on 16 cores they wait for cores
        return max(1, 2 * n / 16) * steps * (law["alpha"] + chunk * law["beta"])

    def coordinator(n):
        return law["k0"] + law["k1"] * n

    def roundel_gloo(n, size):  # one allgather while each member receives at most 256 KiB, else the ring
        call = gloo(n, size, n - 1, size) if (n - 1) * size <= 256 * 1024 else gloo(n, size, 2 * (n - 1), size / n)
        return coordinator(n) if size <= 4096 else law["e"] + call

    records = [{"np": n, "bytes": size, "roundel_s": coordinator(n) if size <= 4096 else _shm(law, n, size),
                "raw_s": gloo(n, size, 2 * (n - 1), size / n)} for n in (2, 4, 8, 16) for size in sizes]
    path.write_text(json.dumps({
        "cores": 16, "machine": "synthetic", "date": "none", "allreduce": records,
        "gloo_allreduce": [dict(r, roundel_s=roundel_gloo(r["np"], r["bytes"])) for r in records],
        "training": [{"np": 2, "model": "mlp", "batch_size": 32, "roundel_sps": 500.0, "ddp_sps": 400.0,
                      "single_sps": 800.0}],
        "control": [{"np": n, "cycle_ms": 1e3 * (law["c0"] + law["c1"] * n), "rank0_cpu_ms_per_step": 1.0 + n / 100}
                    for n in (16, 64, 256)]
                   + [{"np": n, "relays": True, "cycle_ms": 50.0, "rank0_cpu_ms_per_step": 9.0,
                       "coordinator_cpu_ms_per_step": 1e3 * (law["r0"] + law["r1"] * n)} for n in (64, 256, 1024)],
        "relay_chain": [{"np": d + 1, "depth": d, "chain_ms": 1e3 * (law["k"] + 2 * d * law["h"]), "direct_ms": 1.0}
                        for d in (1, 2, 3, 4)]}))


def test_scaling_model_recovers_a_synthetic_law_and_fits_the_committed_measurements(tmp_path):
    law = {"a0": 200e-6, "w": 50e-6, "b0": 1 / 30e9, "b1": 8e-12, "alpha": 80e-6, "beta": 1 / 2.5e9,
           "e": 500e-6, "k0": 150e-6, "k1": 60e-6, "c0": 2e-3, "c1": 30e-6, "r0": 0.8e-3, "r1": 1.5e-6,
           "k": 0.1e-3, "h": 150e-6}
    measurements, png, figures = tmp_path / "synthetic.json", tmp_path / "model.png", tmp_path / "model.json"
    _synthetic_measurements(measurements, law)
    result = run_command([sys.executable, BENCHMARKS / "scaling_model.py", "--measurements", measurements,
                          "--resnet-step-ms", "250", "--overlap", "0.5", "--plot", png, "--json", figures], timeout=60)
    assert result.returncode == 0, describe(result)
    assert_valid_png(png, result)
    output = json.loads(figures.read_text())
    fits = output["machines"]["16"]["fits"]
    for fitted, true in ((fits["shm"]["a0_s"], law["a0"]), (fits["shm"]["wait_s"], law["w"]),
                         (fits["shm"]["b0_s_per_byte"], law["b0"]), (fits["shm"]["b1_s_per_byte_per_rank"], law["b1"]),
                         (fits["ring"]["alpha_s"], law["alpha"]), (fits["ring"]["beta_s_per_byte"], law["beta"]),
                         (fits["roundel_gloo"]["e_s"], law["e"]), (fits["coordinator"]["k0_s"], law["k0"]),
                         (fits["coordinator"]["k1_s_per_rank"], law["k1"]), (fits["control"]["c0_s"], law["c0"]),
                         (fits["control"]["c1_s_per_rank"], law["c1"]), (fits["control_relayed"]["c0_s"], law["r0"]),
                         (fits["control_relayed"]["c1_s_per_rank"], law["r1"]), (fits["relay_hop"]["c_s"], law["k"]),
                         (fits["relay_hop"]["hop_s"], law["h"])):
        assert math.isclose(fitted, true, rel_tol=0.01), (fitted, true, fits)
    assert all(fit["error"] < 1e-6 for fit in fits.values()), fits
    fit_rows = [line for line in result.stdout.splitlines() if line.startswith("| ") and "t = " in line]
    assert len(fit_rows) == 8 and all("| 0.0% at N = " in row and "| within 20 % |" in row for row in fit_rows), describe(result)

    # ResNet-50 at 8 ranks is one host: 4 buckets of a quarter of its gradients in shared memory, half hidden,
    # and one copy of the gradients into their buckets (read and written)
    nbytes = 25_557_032 * 4
    comm = 4 * _shm(law, 8, nbytes / 4)
    copy = 2 * nbytes * (law["b0"] + 8 * law["b1"])
    step = 0.250 + law["c0"] + 8 * law["c1"] + comm + copy - min(0.5 * comm, 2 / 3 * 0.250)
    predictions = output["predictions"]
    [resnet8] = [p for p in predictions if p["model"] == "ResNet-50" and p["ranks"] == 8 and p["gbit"] == 25]
    assert math.isclose(resnet8["step"], step, rel_tol=1e-6) and math.isclose(resnet8["efficiency"], 0.250 / step)
    # from 64 ranks through relays: rank 0's part, and a hop each way per level (1,024 on hosts of 8: 6 hops),
    # each a relay's handling, those between hosts (all but the first and the last) the wire's too
    wire = law["alpha"] + 5e-6
    for ranks, hops in ((64, 4), (512, 5), (1024, 6)):
        [row] = [p for p in predictions if p["model"] == "ResNet-50" and p["ranks"] == ranks and p["gbit"] == 25]
        relayed = law["r0"] + law["r1"] * ranks + 2 * (hops * law["h"] + (hops - 2) * wire)
        assert math.isclose(row["control"], relayed, rel_tol=1e-6), row
    assert output["control_relayed_from"] == 16 and output["relay_hop_from"] == 16
    assert "through relays from 64 ranks" in result.stdout
    assert sorted((p["model"], p["gbit"], p["ranks"]) for p in predictions) == sorted(
        (model, gbit, n) for model in ("ResNet-50", "mlp") for gbit in (25.0, 100.0) for n in (8, 64, 512, 1024))
    for model in ("ResNet-50", "mlp"):
        slow, fast = ([p["efficiency"] for p in predictions if p["model"] == model and p["gbit"] == gbit]
                      for gbit in (25.0, 100.0))
        assert all(s <= f for s, f in zip(slow, fast)) and slow == sorted(slow, reverse=True), (model, slow, fast)
    table = [line for line in result.stdout.splitlines() if line.startswith(("| ResNet-50 |", "| mlp |"))]
    assert len(table) == 16 and "90% at 512 ranks" in result.stdout, describe(result)

    committed = run_command([sys.executable, BENCHMARKS / "scaling_model.py", "--plot", tmp_path / "committed.png",
                             "--json", tmp_path / "committed.json"], timeout=60)
    assert committed.returncode == 0, describe(committed)
    assert_valid_png(tmp_path / "committed.png", committed)
    output = json.loads((tmp_path / "committed.json").read_text())
    assert set(output["machines"]) == {"2", "16"} and output["predicted_from"] == 16, output["machines"].keys()
    for machine in output["machines"].values():
        assert {"shm", "ring", "roundel_gloo", "coordinator", "control"} <= set(machine["fits"]), machine["fits"]
        assert machine["fits"]["shm"]["b0_s_per_byte"] > 0 and machine["training"], machine
    assert "control_relayed" in output["machines"]["2"]["fits"] and output["control_relayed_from"] == 2
    assert "relay_hop" in output["machines"]["2"]["fits"] and output["relay_hop_from"] == 2
    assert all(f"measurements/{name}.json" in committed.stdout for name in ("2core", "2core-relays", "16core"))


def test_scaling_model_gpu_form_adds_nccl_to_roundels_measured_costs(tmp_path):
    sys.path.insert(0, str(BENCHMARKS))
    import scaling_model as model  # noqa: E402 (beside the benchmarks, not a package)

    # NCCL: one host at the host's bus bandwidth; 8 hosts at 8 NICs x 400 Gbit/s x 0.96 = 384 GB/s, with a tree's
    # latency over log2(8) = 3 levels, up and down; the host's own figure where it is the smaller; nothing for one
    gb = 1e9
    assert math.isclose(model.nccl_allreduce(8, gb, 8, 400e9, 8, 400, 20.0, 10.0, 0.96),
                        20e-6 + 2 * 7 / 8 * gb / 400e9)
    assert math.isclose(model.nccl_allreduce(64, gb, 8, 400e9, 8, 400, 20.0, 10.0, 0.96),
                        20e-6 + 6 * 10e-6 + 2 * 63 / 64 * gb / 384e9)
    assert math.isclose(model.nccl_allreduce(64, gb, 8, 400e9, 8, 800, 20.0, 10.0, 0.96),
                        20e-6 + 6 * 10e-6 + 2 * 63 / 64 * gb / 400e9)
    assert model.nccl_allreduce(1, gb, 8, 400e9, 8, 400, 20.0, 10.0) == 0.0
    assert model.parse_nics("8x400,1X100") == [(8, 400.0), (1, 100.0)]

    # a step of 4 buckets of 2 ms: no overlap pays them all; full overlap hides all but the last, as far as
    # backward (2/3 of the compute) reaches; the control round trip and the engine are paid either way
    parts = model.gpu_step(100.0, 0.090, 25.0, lambda size: 0.002 * size / 25.0, 0.004, 0.0025)
    assert math.isclose(parts["step_no_overlap"], 0.090 + 0.0025 + 0.004 + 0.008)
    assert math.isclose(parts["step_full_overlap"], 0.090 + 0.0025 + 0.004 + 0.002)
    assert math.isclose(parts["efficiency_full_overlap"], 0.090 / parts["step_full_overlap"])
    short = model.gpu_step(100.0, 0.003, 25.0, lambda size: 0.002 * size / 25.0, 0.0, 0.0)
    assert math.isclose(short["hidden"], 0.002)  # 2/3 of 3 ms of compute, not the 6 ms of three buckets

    # the built-in hosts at 64-1,024 GPUs: more control per step, lower efficiency; the single-host rows once
    figures = tmp_path / "gpu.json"
    result = run_command([sys.executable, BENCHMARKS / "scaling_model.py", "--gpu", "--ranks", "8,64,512",
                          "--gpu-networks", "8x400,1x100", "--plot", tmp_path / "gpu.png", "--json", figures],
                         timeout=60)
    assert result.returncode == 0, describe(result)
    assert_valid_png(tmp_path / "gpu.png", result)
    rows = json.loads(figures.read_text())["gpu_predictions"]
    assert len(rows) == 2 * 2 * 3 and all(r["efficiency_no_overlap"] <= r["efficiency_full_overlap"] < 1
                                         for r in rows), rows
    table = [line for line in result.stdout.splitlines() if line.startswith(("| A100 host |", "| H100 host |"))]
    assert len(table) == 2 * 5 and sum("none (one host)" in line for line in table) == 2, describe(result)
    assert "90% at 512 GPUs" in result.stdout and "not measured on a GPU" in result.stdout, describe(result)
    bad = run_command([sys.executable, BENCHMARKS / "scaling_model.py", "--gpu", "--gpu-networks", "400"],
                      timeout=60)
    assert bad.returncode == 2 and "NICSxGBIT" in bad.stderr, describe(bad)
