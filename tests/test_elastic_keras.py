"""Elastic Keras 3 training under the real launcher: a host added, a worker SIGKILLed, and the elastic example.

The runs train tests/workers/keras_elastic.py (``model.fit`` with
``hvd.elastic.KerasState`` and the commit/update callbacks, a commit after
every batch; once the test has added the host or killed the worker, without
its pause between steps) and check: the job exits 0 having completed the requested
epochs, every rank of the last generation ends with the same weights, and
rank 0's committed step only goes forward. Sample coverage is not checked:
``model.fit`` on in-memory shards has no ElasticSampler to record it.
Also: the elastic Keras example at 2 workers, and ``TensorFlowState``
rolled back after a collective fails inside a ``tf.function``.
"""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from elastic_util import ElasticJob, records, worker_lines
from launch_util import WORKERS_DIR, describe, run_job, run_python

pytest.importorskip("tensorflow")

WORKER = str(WORKERS_DIR / "keras_elastic.py")
EXAMPLE = str(Path(__file__).resolve().parent.parent / "examples" / "keras_mnist_elastic.py")


def _job(tmp_path, hosts, *launcher_args, epochs=3, step_sleep=0.05):
    env = {"EPOCHS": epochs, "STEP_SLEEP": step_sleep, "FAST_FILE": tmp_path / "fast"}
    return ElasticJob(tmp_path, hosts, WORKER, ("--elastic-timeout", "60", *launcher_args), env)


def _full_speed(tmp_path) -> None:
    """The test has done what needed training slowed down: the rest need not pause between steps."""
    (tmp_path / "fast").touch()


def _check(job, epochs: int, size: int) -> list[int]:
    """The checks every run must pass; returns rank 0's committed steps."""
    assert job.finish(timeout=150) == 0, job.describe()
    text = job.text()
    finals = [record for _, record in records(text, "FINAL")]
    assert sorted(r["rank"] for r in finals) == list(range(size)), job.describe()
    for record in finals:
        assert record["size"] == size and record["epoch"] == epochs, record
        assert record["params"] == finals[0]["params"], "ranks finished with different weights"
    committed = [int(payload.split()[1]) for _, stream, payload in worker_lines(text)
                 if stream == "stdout" and payload.startswith("COMMIT ")]
    assert committed, "rank 0 never committed"
    assert all(b > a for a, b in zip(committed, committed[1:])), f"committed steps went backwards: {committed}"
    return committed


def test_host_added_mid_training_retraces_the_step(tmp_path):
    """One rank, then two: a train step traced at one rank skips the gradient averaging, so without the
    retrace after the reset the two ranks (training on different shards) would end with different weights."""
    job = _job(tmp_path, "localhost:1\n", "-np", "1", "--min-np", "1")
    job.wait_count("COMMIT", 5)
    job.set_hosts("localhost:2\n")
    job.wait_count("generation 1: 2 worker(s)", 1)
    _full_speed(tmp_path)
    _check(job, 3, 2)
    resets = [payload for _, _, payload in worker_lines(job.text()) if payload.startswith("RESET")]
    assert resets == ["RESET 2"], resets  # only the old worker resets; the new one starts from the sync


def test_worker_killed_mid_epoch(tmp_path):
    # one slot per host: a failure takes its whole host out (as Horovod)
    job = _job(tmp_path, "localhost:1\n127.0.0.2:1\n", "--min-np", "1")
    job.wait_count("COMMIT", 6)
    job.kill("127.0.0.2:0")
    job.wait_count("generation 1: 1 worker(s)", 1)
    _full_speed(tmp_path)
    committed = _check(job, 3, 1)
    text = job.text()
    assert "rolling back to the last commit" in text, job.describe()
    assert "RESET 1" in text, job.describe()
    # epochs of 12 steps at 2 ranks and 24 at 1: rank 0 committed beyond what two ranks alone would reach
    assert committed[-1] > 36, committed


def test_keras_mnist_elastic_example(tmp_path):
    """The example at 2 elastic workers on the digits: chance is 0.10 on the 10 classes; it must reach 0.60."""
    discover = tmp_path / "discover.sh"
    discover.write_text("#!/bin/sh\necho localhost:2\n")
    discover.chmod(0o755)
    result = run_job(2, EXAMPLE, "--epochs", "3", "--batches-per-commit", "5", "--checkpoint-dir", tmp_path / "ck",
                     launcher_args=["--host-discovery-script", discover, "--elastic-timeout", "60"], timeout=180)
    assert result.returncode == 0, describe(result)
    found = [float(m.group(1)) for who, stream, payload in worker_lines(result.stdout)
             for m in [re.search(r"test accuracy: ([0-9.]+)", payload)] if m]
    assert found, "no 'test accuracy' line from rank 0\n" + describe(result)
    assert found[-1] >= 0.60, describe(result)
    assert any(re.search(r"samples/s: \d+\.\d+", payload) for _, _, payload in worker_lines(result.stdout)), \
        "no samples/s in rank 0's epoch lines\n" + describe(result)
    assert sorted(p.name for p in (tmp_path / "ck").iterdir()) == [f"checkpoint-{e}.keras" for e in (1, 2, 3)]


TF_STATE_SCRIPT = '''
import numpy as np, tensorflow as tf
import roundel.tensorflow as hvd
from roundel.errors import RoundelInternalError

hvd.init()
v = tf.Variable([1.0, 2.0])
state = hvd.elastic.TensorFlowState([v], epoch=0)
state.register_reset_callbacks([lambda: print("RESET", flush=True)])
calls, failed = [], []

def fail_once(x):
    if not failed:
        failed.append(True)
        raise RoundelInternalError("peer died")
    return x

@tf.function
def step():
    return tf.numpy_function(fail_once, [v], tf.float32)

@hvd.elastic.run
def train(state):
    calls.append(state.epoch)
    state.epoch = 5
    v.assign([7.0, 7.0])
    return step().numpy().tolist()

state.commit()  # epoch 0, v = [1, 2]: what the failure rolls back to
print("RESULT", train(state), calls, state.epoch, v.numpy().tolist())
'''


def test_tensorflow_state_rolls_back_after_a_failure_inside_a_tf_function(tmp_path):
    """One process: the first call's collective fails inside a tf.function (an OpError); ``run`` treats it as
    HorovodInternalError, restores the TensorFlowState (variables and epoch), resets and calls again."""
    script = tmp_path / "tf_state.py"
    script.write_text(TF_STATE_SCRIPT)
    result = run_python(script, env={"TF_CPP_MIN_LOG_LEVEL": "2"}, timeout=120)
    assert result.returncode == 0, describe(result)
    assert "rolling back to the last commit" in result.stderr, describe(result)
    assert "RESET" in result.stdout, describe(result)
    # the second call started from the commit (epoch 0) and ran the step: v as assigned, epoch as set
    assert "RESULT [7.0, 7.0] [0, 0] 5 [7.0, 7.0]" in result.stdout, describe(result)
