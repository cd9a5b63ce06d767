"""Where the Keras and TensorFlow adapters' names lead, checked in fresh interpreters.

``roundel.keras`` and Horovod's ``roundel.tensorflow.keras`` give the very same
objects; ``roundel.tensorflow.mpi_ops`` and ``.compression`` are the
``roundel.tfops`` modules; and Keras on its PyTorch backend loads no
TensorFlow, nor the packages that need it.
"""

import subprocess
import sys

import pytest

pytest.importorskip("tensorflow")


def _run(code: str, backend: str) -> str:
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300,
                            env={"KERAS_BACKEND": backend, "TF_CPP_MIN_LOG_LEVEL": "3", "PATH": "/usr/bin:/bin"})
    assert result.returncode == 0, result.stderr
    return result.stdout.strip().splitlines()[-1]


def test_both_keras_names_give_the_same_objects_and_horovods_tensorflow_module_names_are_tfops_modules():
    code = """
import roundel.keras as hvd
import roundel.tensorflow.keras as tf_hvd
import roundel.tensorflow, roundel.tensorflow.mpi_ops, roundel.tensorflow.compression, roundel.tfops.mpi_ops
import roundel.tensorflow.keras.callbacks, roundel.keras.callbacks
differ = [n for n in hvd.__all__ if getattr(hvd, n) is not getattr(tf_hvd, n)]
same_modules = (roundel.tensorflow.keras.callbacks is roundel.keras.callbacks and
                roundel.tensorflow.mpi_ops is roundel.tfops.mpi_ops and
                roundel.tensorflow.compression.Compression is roundel.tensorflow.Compression)
print(len(hvd.__all__), differ, same_modules, tf_hvd.__all__ == hvd.__all__)
"""
    count, rest = _run(code, "tensorflow").split(" ", 1)
    assert int(count) > 40 and rest == "[] True True", rest


def test_keras_on_pytorch_loads_no_tensorflow():
    code = """
import sys
import roundel.keras as hvd
import keras
hvd.elastic.run(lambda state: None)
hvd.DistributedOptimizer(keras.optimizers.SGD(0.1))
print(sorted(m for m in sys.modules if m.split('.')[0] == 'tensorflow' or m.startswith(('roundel.tfops',
      'roundel.tensorflow'))))
"""
    assert _run(code, "torch") == "[]"
