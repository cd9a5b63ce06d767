"""The PyTorch examples run to completion under ``roundelrun -np 2`` and learn.

``examples/pytorch_mnist.py`` trains on scikit-learn's bundled digits (no
download). The runs are deterministic (fixed seed, one thread per rank); on
the development machine they reach these test accuracies:

| run | epochs | test accuracy seen | asserted |
| --- | --- | --- | --- |
| plain averaging | 3 | 0.883 | >= 0.75 |
| resumed from epoch 3 to 5 | 5 | 0.917 | >= 0.85 |
| `--fp16-allreduce` | 3 | 0.897 | >= 0.75 |
| `--use-adasum` | 3 | 0.889 | >= 0.75 |

Chance is 0.10 (ten balanced classes), so every bound is far above it while
leaving room for a different PyTorch build's arithmetic.

The synthetic benchmark runs with the small CNN and a tiny batch; the test
checks its output format, not its speed. The whole file takes about a
minute (each job spends most of its time starting Python and PyTorch).
"""

from __future__ import annotations

import gzip
import re
import struct
from pathlib import Path

import numpy as np
import pytest

from launch_util import describe, rank_lines, run_job

EXAMPLES = Path(__file__).resolve().parents[1] / "examples"
MNIST = EXAMPLES / "pytorch_mnist.py"
BENCHMARK = EXAMPLES / "pytorch_synthetic_benchmark.py"

EPOCH_LINE = re.compile(r"^epoch (\d+): train loss ([\d.]+) accuracy ([\d.]+) \| "
                        r"test loss ([\d.]+) accuracy ([\d.]+) \| [\d.]+ s$")
FINAL_LINE = re.compile(r"^final test accuracy: ([\d.]+)$")
RATE = re.compile(r"(\d+\.\d+) samples/s")  # a figure in rank 0's progress bar (tqdm's rate)
CHANCE = 0.10


def run_mnist(*args, timeout=120):
    result = run_job(2, MNIST, "--dataset", "digits", *args, timeout=timeout)
    assert result.returncode == 0, describe(result)
    return result


def epochs_of(result) -> dict[int, tuple[float, float, float, float]]:
    """epoch -> (train loss, train accuracy, test loss, test accuracy) from rank 0's epoch lines."""
    found = {}
    for line in rank_lines(result.stdout, 0, "stdout"):
        match = EPOCH_LINE.match(line)
        if match:
            epoch = int(match.group(1))
            assert epoch not in found, f"epoch {epoch} reported twice\n" + describe(result)
            found[epoch] = tuple(float(g) for g in match.groups()[1:])
    return found


def final_accuracy(result) -> float:
    values = [float(m.group(1)) for line in rank_lines(result.stdout, 0, "stdout")
              if (m := FINAL_LINE.match(line))]
    assert len(values) == 1, describe(result)
    return values[0]


def assert_rank0_only(result) -> None:
    """Rank 1 prints nothing on stdout (metrics, checkpoints) and shows no progress bar."""
    assert rank_lines(result.stdout, 1) == [], describe(result)
    assert not any("samples/s" in line for line in rank_lines(result.stdout + result.stderr, 1)), describe(result)


@pytest.fixture(scope="module")
def first_run(tmp_path_factory):
    """Three epochs at 2 ranks with checkpoints; shared by the tests that read it."""
    ckpt = tmp_path_factory.mktemp("mnist-ckpt")
    return ckpt, run_mnist("--epochs", "3", "--checkpoint-dir", ckpt)


def test_mnist_trains_and_prints_on_rank0_only(first_run):
    ckpt, result = first_run
    epochs = epochs_of(result)
    assert sorted(epochs) == [1, 2, 3], describe(result)
    assert_rank0_only(result)
    # Averaged over both ranks: 1,437 training and 360 test images.
    assert any("1437 train / 360 test images, 2 rank(s)" in line for line in rank_lines(result.stdout, 0))
    train_loss_1, test_accuracy_3 = epochs[1][0], epochs[3][3]
    assert epochs[3][0] < train_loss_1, describe(result)  # the loss goes down
    assert test_accuracy_3 >= 0.75 > CHANCE, describe(result)
    assert final_accuracy(result) == test_accuracy_3
    # The progress bar is on rank 0's stderr and shows the job's samples/s.
    rates = [float(m.group(1)) for line in rank_lines(result.stderr, 0, "stderr")
             if line.startswith("epoch 1:") and (m := RATE.search(line))]
    assert rates and rates[-1] > 0, describe(result)


def test_mnist_writes_checkpoints_on_rank0(first_run):
    ckpt, result = first_run
    assert sorted(p.name for p in ckpt.iterdir()) == [f"checkpoint-{e}.pt" for e in (1, 2, 3)]
    saved = [line for line in rank_lines(result.stdout, 0) if line.startswith("saved ")]
    assert saved == [f"saved {ckpt / f'checkpoint-{e}.pt'}" for e in (1, 2, 3)], describe(result)
    import torch
    state = torch.load(ckpt / "checkpoint-3.pt", weights_only=True)
    assert state["epoch"] == 3 and "conv1.weight" in state["model"] and "state" in state["optimizer"]


def test_mnist_resume_continues_from_last_epoch(first_run, tmp_path):
    ckpt, first = first_run
    # A copy, so this test does not change what the others read.
    for path in ckpt.iterdir():
        (tmp_path / path.name).write_bytes(path.read_bytes())
    result = run_mnist("--epochs", "5", "--checkpoint-dir", tmp_path, "--resume", "--progress", "none")
    out = rank_lines(result.stdout, 0)
    assert f"resumed from {tmp_path / 'checkpoint-3.pt'}: epoch 3 done, continuing at epoch 4" in out, \
        describe(result)
    epochs = epochs_of(result)
    assert sorted(epochs) == [4, 5], describe(result)
    # It starts from the trained weights: already better than the first run's first epochs.
    assert epochs[4][3] >= epochs_of(first)[2][3], describe(result)
    assert final_accuracy(result) >= 0.85, describe(result)
    assert (tmp_path / "checkpoint-5.pt").is_file()
    assert rank_lines(result.stdout, 1) == [], describe(result)


@pytest.mark.parametrize("flag", ["--fp16-allreduce", "--use-adasum"])
def test_mnist_fp16_and_adasum(flag):
    result = run_mnist("--epochs", "3", "--progress", "none", flag)
    header = [line for line in rank_lines(result.stdout, 0) if line.startswith("training on digits")]
    assert header and ("fp16 allreduce" if flag == "--fp16-allreduce" else "Adasum") in header[0], describe(result)
    assert sorted(epochs_of(result)) == [1, 2, 3]
    assert final_accuracy(result) >= 0.75, describe(result)
    assert_rank0_only(result)


def _idx(array: np.ndarray) -> bytes:
    code = 0x08  # unsigned bytes
    return bytes([0, 0, code, array.ndim]) + struct.pack(f">{array.ndim}I", *array.shape) + array.tobytes()


def test_mnist_reads_idx_files(tmp_path):
    """--dataset fashion-mnist on a tiny IDX set written here (gzipped, torchvision's directory layout)."""
    raw = tmp_path / "FashionMNIST" / "raw"
    raw.mkdir(parents=True)
    rng = np.random.default_rng(0)
    for prefix, n in (("train", 64), ("t10k", 32)):
        (raw / f"{prefix}-images-idx3-ubyte.gz").write_bytes(
            gzip.compress(_idx(rng.integers(0, 256, (n, 28, 28), dtype=np.uint8))))
        (raw / f"{prefix}-labels-idx1-ubyte.gz").write_bytes(
            gzip.compress(_idx(rng.integers(0, 10, n, dtype=np.uint8))))
    result = run_job(2, MNIST, "--dataset", "fashion-mnist", "--data-dir", tmp_path, "--epochs", "1",
                     "--progress", "none", timeout=120)
    assert result.returncode == 0, describe(result)
    assert any("training on fashion-mnist: 64 train / 32 test images" in line
               for line in rank_lines(result.stdout, 0)), describe(result)
    assert sorted(epochs_of(result)) == [1]


def test_mnist_missing_files_clear_error(tmp_path):
    result = run_job(2, MNIST, "--dataset", "mnist", "--data-dir", tmp_path, timeout=120)
    assert result.returncode != 0
    assert "train-images-idx3-ubyte" in result.stdout + result.stderr
    assert "Traceback" not in result.stdout + result.stderr, describe(result)


def test_synthetic_benchmark_small_cnn():
    result = run_job(2, BENCHMARK, "--model", "smallcnn", "--batch-size", "4", "--num-warmup-batches", "1",
                     "--num-batches-per-iter", "2", "--num-iters", "3", timeout=120)
    assert result.returncode == 0, describe(result)
    out = rank_lines(result.stdout, 0)
    assert out[0].startswith("Model: small_cnn (482,024 parameters)"), describe(result)
    iters = [line for line in out if re.match(r"^Iter #\d+: [\d.]+ img/sec per CPU$", line)]
    assert len(iters) == 3, describe(result)
    per_cpu = [m for line in out if (m := re.match(r"^Img/sec per CPU: ([\d.]+) \+-([\d.]+)$", line))]
    total = [m for line in out if (m := re.match(r"^Total img/sec on 2 CPU\(s\): ([\d.]+) \+-([\d.]+)$", line))]
    assert len(per_cpu) == 1 and len(total) == 1, describe(result)
    assert float(total[0].group(1)) > 0
    assert float(total[0].group(1)) == pytest.approx(2 * float(per_cpu[0].group(1)), abs=0.2)
    assert any(line.startswith("benchmark:") and RATE.search(line) for line in rank_lines(result.stderr, 0, "stderr")), \
        describe(result)
    assert rank_lines(result.stdout, 1) == [], describe(result)
    assert not any("samples/s" in line for line in rank_lines(result.stderr, 1)), describe(result)
