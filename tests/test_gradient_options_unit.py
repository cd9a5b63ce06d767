"""``GradientOptions``: the one checked, frozen set of gradient-reduction options every adapter's optimizer uses.

Pure logic, no framework and no job. That the object a ``DistributedOptimizer``
or ``DistributedGradientTape`` builds is the one its reduction receives is
checked under the launcher: ``tests/workers/keras_training.py`` (scenario
``groups``, both Keras backends) and ``tests/workers/tf_collectives.py``
(scenario ``tape_groups``).
"""

from __future__ import annotations

import dataclasses

import pytest

from roundel.common.compression import NoneCompressor
from roundel.common.gradient_options import GradientOptions
from roundel.common.process_sets import ProcessSet, global_process_set
from roundel.ops import ReduceOp


class Variable:
    """A stand-in for a framework variable."""

    def __init__(self, path):
        self.path = path


def variable_key(value):
    return id(value) if isinstance(value, Variable) else None


def test_defaults_are_horovods():
    options = GradientOptions()
    assert options.op is ReduceOp.Average and options.compression is NoneCompressor
    assert options.gradient_predivide_factor == 1.0 and options.num_groups == 0 and options.groups is None
    assert options.backward_passes_per_step == 1 and not options.average_aggregated_gradients
    assert not options.sparse_as_dense and options.scale_local_gradients
    assert options.process_set is global_process_set


def test_arguments_are_normalized_once():
    a, b = Variable("a"), Variable("b")
    options = GradientOptions(op=1, compression=None, gradient_predivide_factor=1, sparse_as_dense=1,
                              groups=[[a, b], [Variable("c")]], average_aggregated_gradients="yes",
                              scale_local_gradients=0, variable_key=variable_key)
    assert options.op is ReduceOp.Sum and options.compression is NoneCompressor
    assert isinstance(options.gradient_predivide_factor, float)
    assert options.sparse_as_dense is True and options.average_aggregated_gradients is True
    assert options.scale_local_gradients is False
    assert isinstance(options.groups, tuple) and options.groups[0] == (a, b) and options.num_groups == 0
    assert GradientOptions(groups=3).num_groups == 3 and GradientOptions(groups=3).groups is None
    assert GradientOptions(num_groups=None).num_groups == 0


def test_frozen():
    options = GradientOptions(num_groups=2)
    with pytest.raises(dataclasses.FrozenInstanceError):
        options.num_groups = 3
    with pytest.raises(dataclasses.FrozenInstanceError):
        options.op = ReduceOp.Sum
    assert options.num_groups == 2


def test_replace_checks_again():
    options = GradientOptions(gradient_predivide_factor=2.0)
    assert dataclasses.replace(options, num_groups=4).num_groups == 4
    with pytest.raises(ValueError, match="op=Average only"):
        dataclasses.replace(options, op=ReduceOp.Sum)


class _NotACompressor:
    compress = None


@pytest.mark.parametrize("kwargs, error, needle", [
    ({"op": "mean"}, ValueError, "is not a reduction operator"),
    ({"op": ReduceOp.Sum, "gradient_predivide_factor": 2.0}, ValueError, "op=Average only"),
    ({"gradient_predivide_factor": 0}, ValueError, "must be positive"),
    ({"gradient_predivide_factor": -2.0}, ValueError, "must be positive"),
    ({"gradient_predivide_factor": "x"}, TypeError, "must be a number"),
    ({"num_groups": -1}, ValueError, "num_groups=-1 must be an int >= 0"),
    ({"num_groups": "two"}, TypeError, "num_groups='two'"),
    ({"groups": -1}, ValueError, ">= 0"),
    ({"groups": [[Variable("a")]], "num_groups": 2}, ValueError, "not both"),
    ({"groups": [Variable("a")]}, ValueError, "list of lists"),
    ({"groups": "ab"}, ValueError, "list of lists"),
    ({"backward_passes_per_step": 0}, ValueError, "backward_passes_per_step=0 must be an int >= 1"),
    ({"backward_passes_per_step": 2.0}, ValueError, "backward_passes_per_step"),
    ({"compression": "fp16"}, TypeError, "not a compressor"),
    ({"compression": _NotACompressor}, TypeError, "not a compressor"),
    ({"process_set": [0, 1]}, TypeError, "must be a ProcessSet"),
])
def test_bad_arguments_are_refused_with_a_clear_message(kwargs, error, needle):
    with pytest.raises(error) as info:
        GradientOptions(**kwargs)
    assert needle in str(info.value)


def test_groups_entries_are_checked_with_the_frameworks_key():
    a = Variable("dense/kernel")
    with pytest.raises(ValueError, match="list of lists of variables; got a str"):
        GradientOptions(groups=[[a, "bias"]], variable_key=variable_key)
    with pytest.raises(ValueError, match="'dense/kernel' is in more than one group"):
        GradientOptions(groups=[[a], [a]], variable_key=variable_key)
    with pytest.raises(ValueError, match="more than one group"):  # without a key: by identity
        GradientOptions(groups=[[a, a]])
    assert GradientOptions(groups=[[a, "bias"]]).groups == ((a, "bias"),)


def test_a_registered_process_set_is_accepted():
    subset = ProcessSet([0, 1])
    assert GradientOptions(process_set=subset).process_set is subset


def test_reduction_scaling_splits_average_around_the_sum():
    assert GradientOptions().reduction_scaling(4) == (ReduceOp.Average, 1.0, 1.0)
    assert GradientOptions(op=ReduceOp.Adasum).reduction_scaling(4) == (ReduceOp.Adasum, 1.0, 1.0)
    assert GradientOptions(gradient_predivide_factor=2.0).reduction_scaling(4) == (ReduceOp.Sum, 0.5, 0.5)
