"""Test-only: the ``mock`` package Horovod's test utilities import, as the standard library's ``unittest.mock``."""

from unittest.mock import *  # noqa: F401,F403
from unittest.mock import __all__  # noqa: F401
