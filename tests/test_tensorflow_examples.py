"""The Keras and TensorFlow 2 examples run to completion at 2 ranks on the bundled digits data (and the
Keras synthetic benchmark on random data).

Chance on the 10 digit classes is 0.10; each example must reach a test
accuracy of at least 0.60 (in practice about 0.9 on this small budget).
The Keras walkthrough is also resumed from its last rank-0 checkpoint.
"""

import re
from pathlib import Path

import pytest

from launch_util import describe, rank_lines, run_job

pytest.importorskip("tensorflow")
pytest.importorskip("sklearn")

EXAMPLES = Path(__file__).resolve().parent.parent / "examples"
MIN_ACCURACY = 0.60


def _accuracy(result) -> float:
    assert result.returncode == 0, describe(result)
    found = [m.group(1) for line in rank_lines(result.stdout, 0, "stdout")
             for m in [re.search(r"test accuracy: ([0-9.]+)", line)] if m]
    assert found, "no 'test accuracy' line from rank 0\n" + describe(result)
    return float(found[-1])


def test_tensorflow2_mnist():
    result = run_job(2, EXAMPLES / "tensorflow2_mnist.py", "--steps", "80", "--log-every", "40", timeout=180)
    accuracy = _accuracy(result)
    # rank 0's progress bar (stderr) shows the job's samples/s; rank 1 shows none
    assert any(line.startswith("training:") and re.search(r"\d+\.\d+ samples/s", line)
               for line in rank_lines(result.stderr, 0, "stderr")), describe(result)
    assert not any("samples/s" in line for line in rank_lines(result.stderr, 1)), describe(result)
    assert accuracy >= MIN_ACCURACY, f"test accuracy {accuracy} < {MIN_ACCURACY}\n" + describe(result)


def test_keras_fashion_mnist_with_resume(tmp_path):
    """With the walkthrough's step 10, NovoGrad (saved in the checkpoints, loaded again on --resume)."""
    first = run_job(2, EXAMPLES / "keras_fashion_mnist.py", "--epochs", "2", "--warmup-epochs", "1",
                    "--optimizer", "novograd", "--checkpoint-dir", tmp_path, timeout=180)
    accuracy = _accuracy(first)
    assert accuracy >= MIN_ACCURACY, f"test accuracy {accuracy} < {MIN_ACCURACY}\n" + describe(first)
    said = rank_lines(first.stdout, 0, "stdout")  # it names the data set it trained on: digits by default
    assert said[0].startswith("data set: digits (the default") and "(data set: digits)" in said[-1], said
    # Keras' epoch line on rank 0 carries the job's samples/s, once per epoch
    rates = [float(m.group(1)) for line in rank_lines(first.stdout, 0, "stdout")
             if (m := re.search(r"samples/s: (\d+\.\d+)", line))]
    assert len(rates) == 2 and min(rates) > 0, describe(first)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["checkpoint-1.keras", "checkpoint-2.keras"]
    resumed = run_job(2, EXAMPLES / "keras_fashion_mnist.py", "--epochs", "3", "--warmup-epochs", "1",
                      "--optimizer", "novograd", "--checkpoint-dir", tmp_path, "--resume", timeout=180)
    assert any("resumed from" in line and "(epoch 2, NovoGrad)" in line
               for line in rank_lines(resumed.stdout, 0, "stdout")), describe(resumed)
    assert _accuracy(resumed) >= MIN_ACCURACY
    assert (tmp_path / "checkpoint-3.keras").exists()


def test_keras_synthetic_benchmark():
    """Small CNN at 2 ranks, tiny settings: Horovod's output lines, total = 2 x per-CPU figure."""
    result = run_job(2, EXAMPLES / "keras_synthetic_benchmark.py", "--model", "small_cnn", "--batch-size", "8",
                     "--num-classes", "10", "--num-warmup-batches", "1", "--num-batches-per-iter", "2",
                     "--num-iters", "2", timeout=180)
    assert result.returncode == 0, describe(result)
    out = "\n".join(rank_lines(result.stdout, 0, "stdout"))
    assert not rank_lines(result.stdout, 1, "stdout"), "rank 1 printed\n" + describe(result)
    assert "Model: small_cnn" in out and "Number of CPUs: 2" in out, out
    assert len(re.findall(r"^Iter #\d+: [0-9.]+ img/sec per CPU$", out, re.M)) == 2, out
    per_cpu = re.search(r"^Img/sec per CPU: ([0-9.]+) \+-([0-9.]+)$", out, re.M)
    total = re.search(r"^Total img/sec on 2 CPU\(s\): ([0-9.]+) \+-([0-9.]+)$", out, re.M)
    assert per_cpu and total, out
    assert float(per_cpu.group(1)) > 0 and abs(float(total.group(1)) - 2 * float(per_cpu.group(1))) <= 0.15, out
