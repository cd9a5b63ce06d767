"""``import roundel.tensorflow.keras as hvd``: the same module as ``roundel.keras`` (Keras 3)."""

import sys as _sys

from roundel.keras import *  # noqa: F401,F403
from roundel.keras import __all__, callbacks, elastic, optimizers  # noqa: F401

_sys.modules[__name__ + ".callbacks"] = callbacks
_sys.modules[__name__ + ".elastic"] = elastic
_sys.modules[__name__ + ".optimizers"] = optimizers
