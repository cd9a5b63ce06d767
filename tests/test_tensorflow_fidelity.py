"""Horovod 0.28.1 TensorFlow/Keras API fidelity under the real launcher (``tests/workers/tf_fidelity.py``).

``api``: Horovod's positional argument order and ``ignore_name_scope`` on
every collective, ``alltoall`` returning the pair only with ``splits``, the
``*_op`` functions (values read when the op runs, ``process_set_included_op``
codes), in-place ``broadcast_`` and ``broadcast_object_fn``. ``errors``:
mismatched collectives raise ``tf.errors.FailedPreconditionError`` (bad
alltoall splits ``InvalidArgumentError``) eagerly and in ``tf.function``, and
the next collective works. ``v1graph``: a TF1-style ``tf.compat.v1`` graph run
by a ``Session`` as Horovod's tests do (each run submits exactly the
collectives it evaluates, 24 in one run, ``uint16``,
``broadcast_global_variables``, ``FailedPreconditionError`` for mismatches,
allgather's gradient).
``tape``: ``DistributedGradientTape(groups=[[...]])`` and
``PartialDistributedGradientTape`` against per-rank gradients.
``sync_bn``: ``SyncBatchNormalization`` equals ``BatchNormalization`` over the
concatenated batch (unequal batch sizes; output and moving statistics).
``optimizer``: ``roundel.tensorflow.DistributedOptimizer`` with a Keras
optimizer equals one process on the concatenated batch. ``keras``:
``PartialDistributedOptimizer``, ``BroadcastGlobalVariablesCallback(local_variables=)``,
``BestModelCheckpoint`` (rank 0, best epoch), ``load_model(legacy_opts=)``, ``TensorFlowKerasState``.
"""

import pytest

from launch_util import assert_checks_passed, run_job

pytest.importorskip("tensorflow")

WORKER = "tf_fidelity.py"
ALL = ("api", "errors", "v1graph", "tape", "sync_bn", "optimizer", "keras")


def test_tensorflow_fidelity_two_ranks(tmp_path):
    result = run_job(2, WORKER, ",".join(ALL), env={"FIDELITY_TMP": str(tmp_path), "KERAS_BACKEND": "tensorflow"},
                     timeout=240)
    assert_checks_passed(result, 2, *ALL)


def test_tensorflow_fidelity_three_ranks(tmp_path):
    scenarios = ("api", "tape", "sync_bn")
    result = run_job(3, WORKER, ",".join(scenarios), env={"FIDELITY_TMP": str(tmp_path)}, timeout=240)
    assert_checks_passed(result, 3, *scenarios)
