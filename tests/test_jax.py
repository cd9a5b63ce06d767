"""The JAX adapter (roundel.jax) under the real launcher.

- ``tests/workers/jax_collectives.py`` at 2 and 3 ranks: every collective,
  eagerly and inside ``jax.jit``, on arrays and pytrees, against NumPy;
  the async forms; gradients through ``jax.custom_vjp`` (eager and jitted);
  the clear errors for ragged allgather or alltoall splits inside jit and
  for ``vmap``; ``DistributedOptimizer`` against one process on the whole
  batch (also with two backward passes per step and fp16 compression);
  ``broadcast_parameters`` and ``broadcast_optimizer_state``.
- An elastic job (``tests/workers/jax_elastic.py``, a jitted step) whose
  second worker is SIGKILLed mid-epoch: the survivor rolls back, trains on
  alone and finishes every epoch. And in one process: a failure inside
  compiled code makes ``hvd.elastic.run`` restore ``JaxState`` and retry.
- ``examples/jax_mnist.py`` at 2 ranks learns the digits; the synthetic
  benchmark prints its figures.
"""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from elastic_util import ElasticJob, records, worker_lines
from launch_util import WORKERS_DIR, assert_checks_passed, describe, rank_lines, run_job, run_python

EXAMPLES = Path(__file__).resolve().parents[1] / "examples"
SCENARIOS = ("eager", "async", "jit", "grads", "optimizer")


@pytest.mark.parametrize("np", [2, 3])
def test_collectives_gradients_and_optimizer(np):
    result = run_job(np, "jax_collectives.py", ",".join(SCENARIOS), timeout=240)
    assert_checks_passed(result, np, *SCENARIOS)


def test_elastic_training_survives_a_killed_worker(tmp_path):
    job = ElasticJob(tmp_path, "localhost:1\n127.0.0.2:1\n", str(WORKERS_DIR / "jax_elastic.py"),
                     ("--elastic-timeout", "60", "--min-np", "1"),
                     {"EPOCHS": 2, "STEP_SLEEP": 0.05, "FAST_FILE": tmp_path / "fast"})
    job.wait_count("COMMIT", 4, timeout=180)
    job.kill("127.0.0.2:0")  # a failure takes its whole host out (as Horovod): one slot per host
    job.wait_count("generation 1: 1 worker(s)", 1)
    (tmp_path / "fast").touch()  # the survivor need not pause between its steps any more
    assert job.finish(timeout=180) == 0, job.describe()
    text = job.text()
    assert "rolling back to the last commit" in text and "RESET 1" in text, job.describe()
    finals = [record for _, record in records(text, "FINAL")]
    assert [(r["rank"], r["size"], r["epoch"]) for r in finals] == [(0, 1, 2)], job.describe()
    committed = [int(payload.split()[1]) for _, stream, payload in worker_lines(text)
                 if stream == "stdout" and payload.startswith("COMMIT ")]
    assert all(b > a for a, b in zip(committed, committed[1:])), f"committed steps went backwards: {committed}"
    # epochs of 12 steps at 2 ranks and 24 at 1: the survivor went on beyond what 2 ranks alone reach
    assert committed[-1] > 24, committed


JAX_STATE_SCRIPT = '''
import jax, jax.numpy as jnp, numpy as np
from jax.experimental import io_callback
import roundel.jax as hvd
from roundel.errors import RoundelInternalError

hvd.init()
state = hvd.elastic.JaxState(params={"w": jnp.array([1.0, 2.0])}, opt_state=(jnp.zeros(2),), epoch=0)
state.register_reset_callbacks([lambda: print("RESET", flush=True)])
calls, failed = [], []

def fail_once(x):
    if not failed:
        failed.append(True)
        raise RoundelInternalError("peer died")
    return np.asarray(x)

@jax.jit
def step(w):
    return io_callback(fail_once, jax.ShapeDtypeStruct(w.shape, w.dtype), hvd.allreduce(w) + 1, ordered=True)

@hvd.elastic.run
def train(state):
    calls.append((state.epoch, state.params["w"].tolist()))
    state.epoch = 5
    state.params = {"w": state.params["w"] * 0}  # changed, then the step fails: restore() must undo this
    state.params = {"w": step(state.params["w"])}
    return state.params["w"].tolist()

print("RESULT", train(state), calls, state.epoch)
'''


def test_jax_state_rolls_back_after_a_failure_inside_jit(tmp_path):
    """One process: the first call fails inside compiled code (a JaxRuntimeError carrying RoundelInternalError);
    ``run`` treats it as HorovodInternalError, restores JaxState (params and epoch), resets and calls again."""
    script = tmp_path / "jax_state.py"
    script.write_text(JAX_STATE_SCRIPT)
    result = run_python(script, timeout=120)
    assert result.returncode == 0, describe(result)
    assert "rolling back to the last commit" in result.stderr and "RESET" in result.stdout, describe(result)
    # both calls started from the synced state (epoch 0, w = [1, 2]); the second's step ran: 0 + 1
    assert "RESULT [1.0, 1.0] [(0, [1.0, 2.0]), (0, [1.0, 2.0])] 5" in result.stdout, describe(result)


def test_mnist_example_learns_and_benchmark_reports():
    result = run_job(2, EXAMPLES / "jax_mnist.py", "--epochs", "3", timeout=240)
    assert result.returncode == 0, describe(result)
    found = [float(m.group(1)) for line in rank_lines(result.stdout, 0, "stdout")
             if (m := re.match(r"^final test accuracy: ([\d.]+)$", line))]
    assert found and found[0] >= 0.75, describe(result)  # chance is 0.10 on the ten digits
    bench = run_job(2, EXAMPLES / "jax_synthetic_benchmark.py", "--model", "mlp", "--batch-size", "16",
                    "--num-warmup-batches", "1", "--num-iters", "2", "--num-batches-per-iter", "2", timeout=240)
    assert bench.returncode == 0, describe(bench)
    lines = rank_lines(bench.stdout, 0, "stdout")
    assert any(re.match(r"^Img/sec per CPU: [\d.]+ \+-[\d.]+$", line) for line in lines), describe(bench)
    assert any(re.match(r"^Total img/sec on 2 CPU\(s\): [\d.]+ \+-[\d.]+$", line) for line in lines), describe(bench)
    assert rank_lines(bench.stdout, 1, "stdout") == [], "only rank 0 prints the figures"
