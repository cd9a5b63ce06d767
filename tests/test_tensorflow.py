"""roundel.tensorflow collectives under the real launcher, checked against NumPy (eager and tf.function).

Each launch runs several scenarios of ``tests/workers/tf_collectives.py``;
importing TensorFlow costs seconds per rank, so scenarios share launches.
"""

import pytest

from launch_util import assert_checks_passed, run_job

pytest.importorskip("tensorflow")

WORKER = "tf_collectives.py"
ALL = ("allreduce", "sparse", "grouped", "allgather", "broadcast", "alltoall", "reducescatter", "ordering",
       "gradients", "tape", "tape_groups", "misc")


def test_tensorflow_collectives_two_ranks():
    result = run_job(2, WORKER, ",".join(ALL), timeout=240)
    assert_checks_passed(result, 2, *ALL)


def test_tensorflow_collectives_three_ranks():
    scenarios = ("allreduce", "allgather", "alltoall", "reducescatter", "ordering", "gradients", "tape", "tape_groups",
                 "misc")
    result = run_job(3, WORKER, ",".join(scenarios), timeout=240)
    assert_checks_passed(result, 3, *scenarios)
