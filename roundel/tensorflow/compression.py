"""Horovod's ``horovod.tensorflow.compression``: this name is the module :mod:`roundel.tfops.compression` itself."""

import sys

from roundel.tfops import compression

sys.modules[__name__] = compression
