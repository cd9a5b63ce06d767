"""Test-only alias: ``import horovod.X`` gives ``roundel.X`` (never installed; put its folder on PYTHONPATH).

Used to run Horovod's own test files against roundel unchanged
(``benchmarks/horovod_tests.py``). Every ``horovod.<sub>`` module is the very
``roundel.<sub>`` module object, so state set through one name is seen
through the other.
"""

import importlib
import importlib.abc
import importlib.util
import sys

import roundel


class _AliasLoader(importlib.abc.Loader):
    def __init__(self, target: str):
        self.target = target

    def create_module(self, spec):
        module = importlib.import_module(self.target)
        self.real_spec = module.__spec__
        return module

    def exec_module(self, module):
        module.__spec__ = self.real_spec  # the import system gave it the alias's spec


# Horovod internals that Horovod's test utilities import, served by test-only stand-ins.
_SHIMS = {"horovod.runner.util": "horovod._shims", "horovod.runner.util.threads": "horovod._shims.threads",
          "horovod.common.util": "horovod._shims.common_util"}
# Served only where roundel lacks the module (to measure an older roundel the same way).
_FALLBACKS = {"horovod.tensorflow.util": "horovod._shims.tf_util"}


class _AliasFinder(importlib.abc.MetaPathFinder):
    def find_spec(self, fullname, path=None, target=None):
        if not fullname.startswith("horovod.") or fullname.startswith("horovod._shims"):
            return None
        real = _SHIMS.get(fullname) or "roundel." + fullname[len("horovod."):]
        if importlib.util.find_spec(real) is None:
            real = _FALLBACKS.get(fullname)
            if real is None:
                return None
        return importlib.util.spec_from_loader(fullname, _AliasLoader(real), is_package=True)


sys.meta_path.insert(0, _AliasFinder())
# ``horovod`` itself: roundel's top-level names (__version__ etc.).
for _name in dir(roundel):
    if not _name.startswith("__") or _name == "__version__":
        globals().setdefault(_name, getattr(roundel, _name))
