"""Horovod's ``horovod.tensorflow.mpi_ops``: this name is the module :mod:`roundel.tfops.mpi_ops` itself."""

import sys

from roundel.tfops import mpi_ops

sys.modules[__name__] = mpi_ops
