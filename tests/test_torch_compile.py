"""``torch.compile``d models under DistributedOptimizer, in a real two-rank job (see docs/gpus.md).

torch.compile's CPU backend (Inductor) builds C++ kernels: it needs a C compiler and Python's headers, and
the test skips, naming what is missing, on a machine without them.
"""

import os
import shutil
import sysconfig

import pytest

from launch_util import assert_checks_passed, run_job

_MISSING = [what for what, present in (
    ("a C compiler (cc, gcc or clang)", any(shutil.which(name) for name in ("cc", "gcc", "clang"))),
    ("Python's headers (Python.h)", os.path.exists(os.path.join(sysconfig.get_paths()["include"], "Python.h"))),
) if not present]


@pytest.mark.skipif(bool(_MISSING), reason=f"torch.compile's CPU backend needs {' and '.join(_MISSING)}, "
                                           "which this machine lacks")
def test_a_compiled_model_trains_as_its_eager_twin_under_distributed_optimizer():
    result = run_job(2, "torch_compile.py", "compiled_training", timeout=600)
    assert_checks_passed(result, 2, "compiled_training")
