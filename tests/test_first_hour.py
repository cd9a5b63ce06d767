"""What a new user meets in the first hour: whom the launcher blames, what a missing framework says, what
``-np`` larger than the slots says, the timeline summary's names, and a PyTorch script free of TensorFlow.

Real ``roundelrun`` jobs of 2 or 3 ranks (small scripts), real subprocesses.
"""

from __future__ import annotations

import importlib.util
import re
import subprocess
import sys
from pathlib import Path

import pytest

from launch_util import LAUNCHER, clean_env, describe, run_command
from roundel.runner.hosts import assign_slots

ROOT = Path(__file__).resolve().parents[1]


def roundelrun(*args, env: dict | None = None, timeout: float = 60) -> subprocess.CompletedProcess:
    return run_command([*LAUNCHER, *map(str, args)], env=env, timeout=timeout)


def launcher_lines(result: subprocess.CompletedProcess) -> list[str]:
    return [line for line in result.stderr.splitlines() if line.startswith("roundelrun: ")]


# --- 1. a rank that ends by SystemExit / sys.exit / os._exit is blamed, not the rank that saw it leave ---

RANK_1_LEAVES = """
import atexit, os, sys, time
import torch
import roundel.torch as hvd
# registered before init(), so it runs after roundel has told the others this rank left: the teardown of a
# real script (CUDA, data loader workers) takes that long, and the others exit first
atexit.register(time.sleep, 0.5)
hvd.init()
hvd.allreduce(torch.ones(1), name="before")
if hvd.rank() == 1:
    {how}
hvd.allreduce(torch.ones(1), name="after")  # the others fail here: rank 1 has left
"""


@pytest.mark.parametrize("np, how, code", [
    (2, "raise SystemExit('boom on rank 1')", 1),
    (2, "sys.exit(1)", 1),
    (2, "os._exit(3)", 3),
    (3, "raise SystemExit('boom on rank 1')", 1),
])
def test_a_rank_that_exits_by_itself_is_blamed_not_the_ranks_that_lost_it(tmp_path, np, how, code):
    script = tmp_path / "leave.py"
    script.write_text(RANK_1_LEAVES.format(how=how))
    result = roundelrun("-np", np, sys.executable, script)
    assert result.returncode == code, describe(result)
    assert launcher_lines(result)[-1] == \
        f"roundelrun: rank 1 (host localhost) exited with code {code}; stopped the other ranks", describe(result)


# --- 2. roundel's own errors are named as a user's exception is ---

ROUNDEL_ERROR_ON_RANK_1 = """
import torch
import roundel.torch as hvd
hvd.init()
hvd.allreduce(torch.ones(1), name="before")
if hvd.rank() == 1:
    raise hvd.HorovodInternalError("rank 1 gave up on the job")
hvd.allreduce(torch.ones(1), name="after")
"""


def test_a_roundel_error_raised_out_of_a_script_is_named_with_its_message(tmp_path):
    script = tmp_path / "internal.py"
    script.write_text(ROUNDEL_ERROR_ON_RANK_1)
    for _ in range(3):  # whichever rank's exit reaches the launcher first
        result = roundelrun("-np", 2, sys.executable, script)
        assert result.returncode == 1, describe(result)
        assert launcher_lines(result)[-1] == (
            "roundelrun: rank 1 (host localhost) failed first: RoundelInternalError: rank 1 gave up on the job; "
            "stopped the other ranks"), describe(result)


def test_a_collective_mismatch_and_an_operation_before_init_are_named():
    mismatch = ("import torch, roundel.torch as hvd; hvd.init(); "
                "hvd.allreduce(torch.ones(2 + hvd.rank()), name='mismatched')")
    result = roundelrun("-np", 2, sys.executable, "-c", mismatch)
    assert result.returncode == 1, describe(result)
    assert re.match(r"roundelrun: rank [01] \(host localhost\) failed first: CollectiveMismatchError: ",
                    launcher_lines(result)[-1]), describe(result)
    before_init = "import torch, roundel.torch as hvd; hvd.allreduce(torch.ones(2))"
    result = roundelrun("-np", 2, sys.executable, "-c", before_init)
    assert result.returncode == 1, describe(result)
    assert re.match(r"roundelrun: rank [01] \(host localhost\) failed first: NotInitializedError: roundel has not "
                    r"been initialized; call hvd.init\(\) before ", launcher_lines(result)[-1]), describe(result)


def test_a_job_of_one_rank_names_its_exception():
    result = roundelrun("-np", 1, sys.executable, "-c",
                        "import roundel.torch as hvd; hvd.init(); raise ValueError('bad input')")
    assert result.returncode == 1, describe(result)
    assert launcher_lines(result)[-1] == "roundelrun: rank 0 (host localhost) failed: ValueError: bad input", \
        describe(result)


# --- 3. roundel.keras / roundel.tensorflow without TensorFlow say what to install ---

@pytest.mark.parametrize("module", ["roundel.keras", "roundel.tensorflow"])
def test_importing_the_tensorflow_adapters_without_tensorflow_says_what_to_install(module):
    code = f"import sys; sys.modules['tensorflow'] = None; sys.modules['keras'] = None; import {module}"
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60,
                            env=clean_env())
    assert result.returncode == 1, describe(result)
    last = result.stderr.strip().splitlines()[-1]
    assert last.startswith("ImportError: ") and 'pip install "roundel[tensorflow]"' in last \
        and '"roundel[tensorflow-cpu]"' in last, result.stderr


def test_the_readme_says_how_to_install_tensorflow_next_to_its_examples():
    readme = (ROOT / "README.md").read_text()
    keras = readme.index("**Keras 3**")
    assert 'pip install "roundel[tensorflow]"' in readme[keras:readme.index("**JAX**")]


# --- 7. -np larger than the slots says what to do ---

def test_too_many_ranks_for_the_slots_says_how_to_fix_it():
    result = roundelrun("-np", 3, "-H", "localhost:2", sys.executable, "-c", "pass")
    assert result.returncode == 2, describe(result)
    assert result.stderr.strip() == (
        "roundelrun: error: requested -np 3 but the hosts offer only 2 slots (localhost:2): give the hosts "
        "3 slots in all (-H localhost:3) or add hosts, or lower -np to 2"), describe(result)
    with pytest.raises(ValueError, match=r"\(a:2,b:2\): give the hosts 5 slots in all \(-H a:2,b:3\) or add "
                                         r"hosts, or lower -np to 4$"):
        assign_slots([("a", 2), ("b", 2)], 5)


# --- 5. the timeline summary never cuts a name ---

LONG_NAMES = """
import torch
import roundel.torch as hvd
hvd.init()
for step in range(2):
    hvd.allreduce(torch.ones(4), name="model.encoder.layers.11.attention.self.query.weight")
    hvd.allreduce(torch.ones(4), name="model.encoder.layers.11.attention.self.query.bias")
"""


def test_the_timeline_summary_prints_names_that_share_their_first_40_characters_in_full(tmp_path):
    script, timeline = tmp_path / "long_names.py", tmp_path / "timeline.json"
    script.write_text(LONG_NAMES)
    result = roundelrun("--timeline-filename", timeline, "-np", 2, sys.executable, script)
    assert result.returncode == 0, describe(result)
    summary = subprocess.run([sys.executable, "-m", "roundel.timeline", "summarize", str(timeline)],
                             capture_output=True, text=True, timeout=60)
    assert summary.returncode == 0, describe(summary)
    rows = summary.stdout.split("\n\n")[0].splitlines()
    for name in ("allreduce.model.encoder.layers.11.attention.self.query.weight",
                 "allreduce.model.encoder.layers.11.attention.self.query.bias"):
        assert any(row.split()[0] == name for row in rows), summary.stdout
    columns = {row.index(" ALLREDUCE ") for row in rows if " ALLREDUCE " in row}
    assert len(columns) == 1, summary.stdout  # the phase column lines up under the longest name


# --- 8. a PyTorch script does not import TensorFlow behind the user's back ---

@pytest.mark.skipif(importlib.util.find_spec("tensorboard") is None,
                    reason="tensorboard is not installed (pip install roundel[examples])")
def test_the_pytorch_example_writing_tensorboard_logs_does_not_import_tensorflow(tmp_path):
    logs = tmp_path / "tb"
    result = roundelrun("-np", 2, sys.executable, ROOT / "examples" / "pytorch_mnist.py", "--dataset", "digits",
                        "--epochs", 1, "--log-dir", logs, "--checkpoint-dir", tmp_path / "ckpt", timeout=120)
    assert result.returncode == 0, describe(result)
    assert "oneDNN" not in result.stdout + result.stderr, describe(result)
    assert "absl::InitializeLog" not in result.stderr, describe(result)
    assert list(logs.rglob("events.out.tfevents.*")), describe(result)
