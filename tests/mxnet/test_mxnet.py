"""roundel.mxnet under the real launcher, at 2 ranks: collectives against NumPy, training against one
process on the whole batch, broadcast_parameters, errors, and the example.

Run with the MXNet environment's Python (.ci/run makes it): mxnet 1.9.1 needs
a NumPy older than the main environment's TensorFlow allows.
"""

import re
import subprocess
import sys
from pathlib import Path

from launch_util import assert_checks_passed, describe, rank_lines, run_job

WORKERS = Path(__file__).resolve().parent / "workers"
EXAMPLE = Path(__file__).resolve().parents[2] / "examples" / "mxnet_mnist.py"


def test_collectives_and_errors():
    scenarios = ("allreduce", "grouped", "gather_bcast", "alltoall_reducescatter", "process_set", "errors")
    result = run_job(2, WORKERS / "mxnet_collectives.py", ",".join(scenarios))
    assert_checks_passed(result, 2, *scenarios)


def test_trainer_optimizer_and_broadcast_parameters():
    scenarios = ("trainer", "optimizer", "broadcast_parameters")
    result = run_job(2, WORKERS / "mxnet_training.py", ",".join(scenarios))
    assert_checks_passed(result, 2, *scenarios)


def test_example_learns_digits():
    result = run_job(2, EXAMPLE, "--epochs", "3", timeout=180)
    assert result.returncode == 0, describe(result)
    lines = rank_lines(result.stdout, 0, "stdout")
    assert len([line for line in lines if line.startswith("epoch ")]) == 3, describe(result)
    final = [float(m.group(1)) for line in lines if (m := re.match(r"final test accuracy: ([0-9.]+)$", line))]
    assert final and final[0] >= 0.85, f"accuracy {final} below 0.85 (chance: 0.10)\n" + describe(result)
    assert not rank_lines(result.stdout, 1, "stdout"), "only rank 0 prints"


def test_import_loads_no_other_adapter_and_leaves_torch_threads_alone():
    # importing mxnet itself sets OpenMP's thread count (torch's too): measured after it
    code = ("import sys, mxnet, torch\nthreads = torch.get_num_threads()\nimport roundel.mxnet\n"
            "print(sorted(m for m in sys.modules if m.startswith(('roundel.torch', 'roundel.tensorflow', "
            "'roundel.keras', 'roundel.runner', 'tensorflow'))), torch.get_num_threads() == threads)")
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, result.stderr
    assert result.stdout.split() == ["[]", "True"], result.stdout
