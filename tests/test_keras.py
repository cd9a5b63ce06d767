"""roundel.keras (Keras 3, TensorFlow and PyTorch backends) under the real launcher.

``fit_equivalence``: 2-rank ``model.fit`` with ``DistributedOptimizer`` ends
with the same weights as one process trained on the concatenated batches
(SGD, Adam with ``steps_per_execution=2``, SGD+momentum run eagerly, a
wrapped ``LossScaleOptimizer``; within 1e-5). The callbacks are checked by
their effect: weights equal to the root's after
``BroadcastGlobalVariablesCallback``, averaged metrics equal on every rank and
equal to the mean of the local ones, warm-up and schedule learning rates per
batch as specified. ``novograd``: roundel's NovoGrad against a NumPy reference
of the paper's update, and NovoGrad and Keras's Lamb in 2-rank ``fit``.
``accumulation``: ``backward_passes_per_step=2`` equals one process on
batches of 2 steps of every rank (summed and averaged gradients, clipping
after the reduction) with one reduction per update. ``groups``: the allreduce
groups of ``groups=``/``num_groups`` and bad ``groups=``. ``load_model``
re-wraps Adam and NovoGrad with their state. Both Keras backends run every
scenario but the XLA one.
"""

import pytest

from launch_util import assert_checks_passed, run_job

pytest.importorskip("tensorflow")

WORKER = "keras_training.py"
ALL = ("fit_equivalence", "compression", "broadcast", "metric_average", "lr_callbacks", "jit_error", "load_model",
       "novograd", "accumulation", "groups")


def test_keras_two_ranks():
    result = run_job(2, WORKER, ",".join(ALL), env={"KERAS_BACKEND": "tensorflow"}, timeout=240)
    assert_checks_passed(result, 2, *ALL)


def test_keras_torch_backend_two_ranks():
    """Keras 3 on its PyTorch backend: gradients are torch tensors, reduced by roundel.torch."""
    pytest.importorskip("torch")
    scenarios = tuple(s for s in ALL if s != "jit_error")  # XLA is TensorFlow's
    result = run_job(2, WORKER, ",".join(scenarios), env={"KERAS_BACKEND": "torch"}, timeout=240)
    assert_checks_passed(result, 2, *scenarios)
