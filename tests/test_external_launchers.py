"""Scripts started by torchrun, mpirun or srun instead of roundelrun, and ``roundelrun --mpi``.

The collective worker runs unchanged; ``hvd.init()`` reads its identity from
the other launcher's variables and agrees on a rendezvous store through that
launcher's own means (torchrun's store, an MPI broadcast, Slurm's node list;
under torchrun and srun the secret, unless exported as ROUNDEL_SECRET, goes
through a private file: see tests/test_secrets.py).
"""

import os
import re
import shutil
import sys
from pathlib import Path

import pytest

from launch_util import WORKERS_DIR, describe, run_command, run_job
from roundel.errors import SettingsError
from roundel.rendezvous.identity import cross_ranks, detect_launcher

COLLECTIVES = str(WORKERS_DIR / "torch_collectives.py")
BIN = Path(sys.executable).parent
MPI_ENV = {"OMPI_ALLOW_RUN_AS_ROOT": "1", "OMPI_ALLOW_RUN_AS_ROOT_CONFIRM": "1",
           "PATH": f"{BIN}:{os.environ.get('PATH', '')}"}


def require(*what):
    """Skip when an optional launcher is missing on a developer's machine; fail on CI, where
    .ci/run installs it (pip install -e '.[mpi]'), so nothing is skipped silently there."""
    missing = [w for w in what if (shutil.which(w, path=str(BIN)) or shutil.which(w)) is None
               and not _importable(w)]
    if missing:
        message = f"needs {', '.join(missing)}: pip install -e '.[mpi]'"
        if os.environ.get("CI"):
            pytest.fail(message)
        pytest.skip(message)


def _importable(name):
    if name != "mpi4py":
        return False
    import importlib.util
    return importlib.util.find_spec("mpi4py") is not None


def checks_passed(text, np, scenario):
    return text.count(f"CHECKS PASSED {scenario}") == np


def test_torchrun_two_processes():
    result = run_command([str(BIN / "torchrun"), "--nproc-per-node", "2", COLLECTIVES, "allreduce,grouped"],
                         env={"OMP_NUM_THREADS": "1"}, timeout=180)
    assert result.returncode == 0, describe(result)
    assert checks_passed(result.stdout, 2, "allreduce") and checks_passed(result.stdout, 2, "grouped"), \
        describe(result)


def test_torchrun_identity_and_master_port_left_to_torch():
    # the script also uses torch.distributed on torchrun's MASTER_PORT: roundel must not take it
    code = ("import roundel.torch as hvd, torch, torch.distributed as dist; hvd.init(); "
            "dist.init_process_group('gloo'); t = torch.ones(1); dist.all_reduce(t); "
            "import os; values = [hvd.rank(), hvd.size(), hvd.local_rank(), hvd.local_size(), "
            "hvd.cross_rank(), hvd.cross_size(), hvd.allreduce(torch.ones(1), op=hvd.Sum).item(), t.item()]; "
            # one write(2) per line: the ranks share torchrun's stdout, and a pipe keeps small writes whole
            "os.write(1, ('ID ' + ' '.join(map(str, values)) + chr(10)).encode()); "
            "dist.destroy_process_group()")
    script = Path(os.environ.get("TMPDIR", "/tmp")) / f"roundel_torchrun_{os.getpid()}.py"
    script.write_text(code)
    try:
        result = run_command([str(BIN / "torchrun"), "--nproc-per-node", "3", str(script)], timeout=180)
    finally:
        script.unlink()
    assert result.returncode == 0, describe(result)
    ids = sorted(re.findall(r"ID (\d) (\d) (\d) (\d) (\d) (\d) ([\d.]+) ([\d.]+)", result.stdout))
    assert ids == [(str(r), "3", str(r), "3", "0", "1", "3.0", "3.0") for r in range(3)], describe(result)


def test_mpirun_three_processes():
    require("mpirun", "mpi4py")
    result = run_command([str(BIN / "mpirun"), "--oversubscribe", "-np", "3", sys.executable, COLLECTIVES, "allreduce,grouped"],
                         env=MPI_ENV, timeout=180)
    assert result.returncode == 0, describe(result)
    assert checks_passed(result.stdout, 3, "allreduce") and checks_passed(result.stdout, 3, "grouped"), \
        describe(result)


def test_mpirun_without_mpi4py_says_what_to_install(tmp_path):
    require("mpirun")
    (tmp_path / "mpi4py.py").write_text("raise ImportError('hidden by the test')\n")  # shadows the real one
    code = "import roundel.torch as hvd; hvd.init()"
    result = run_command([str(BIN / "mpirun"), "--oversubscribe", "-np", "2", sys.executable, "-c", code],
                         env={**MPI_ENV, "PYTHONPATH": str(tmp_path)}, timeout=120)
    assert result.returncode != 0
    assert "needs mpi4py for that: pip install mpi4py" in result.stderr + result.stdout, describe(result)


def test_roundelrun_mpi_hands_launch_to_mpirun():
    require("mpirun")
    result = run_job(3, "torch_collectives.py", "allreduce", launcher_args=["--mpi", "--verbose"],
                     env={"PATH": MPI_ENV["PATH"]}, timeout=180)
    assert result.returncode == 0, describe(result)
    assert checks_passed(result.stdout, 3, "allreduce"), describe(result)
    assert "--tag-output" in result.stderr and " -x ROUNDEL_SECRET" in result.stderr  # never its value


def test_detect_launcher_variables():
    assert detect_launcher({}) is None
    t = detect_launcher({"RANK": "3", "WORLD_SIZE": "4", "LOCAL_RANK": "1", "LOCAL_WORLD_SIZE": "2",
                         "MASTER_ADDR": "h", "MASTER_PORT": "29500"})
    assert (t.launcher, t.rank, t.size, t.local_rank, t.local_size) == ("torchrun", 3, 4, 1, 2)
    o = detect_launcher({"OMPI_COMM_WORLD_RANK": "1", "OMPI_COMM_WORLD_SIZE": "3",
                         "OMPI_COMM_WORLD_LOCAL_RANK": "2", "OMPI_COMM_WORLD_LOCAL_SIZE": "3"})
    assert (o.launcher, o.rank, o.size, o.local_rank, o.local_size) == ("openmpi", 1, 3, 2, 3)
    m = detect_launcher({"PMI_RANK": "0", "PMI_SIZE": "2", "MPI_LOCALRANKID": "0", "MPI_LOCALNRANKS": "1"})
    assert (m.launcher, m.rank, m.size, m.local_rank, m.local_size) == ("mpich", 0, 2, 0, 1)
    s = detect_launcher({"SLURM_PROCID": "5", "SLURM_STEP_NUM_TASKS": "8", "SLURM_LOCALID": "1"})
    assert (s.launcher, s.rank, s.size, s.local_rank, s.local_size) == ("srun", 5, 8, 1, None)
    # a batch script's own environment (no job step) is not a launch
    assert detect_launcher({"SLURM_PROCID": "0", "SLURM_NTASKS": "8"}) is None
    with pytest.raises(SettingsError, match="OMPI_COMM_WORLD_SIZE"):
        detect_launcher({"OMPI_COMM_WORLD_RANK": "1"})
    with pytest.raises(SettingsError, match="rank 4 outside a job of size 4"):
        detect_launcher({"PMI_RANK": "4", "PMI_SIZE": "4"})


def test_cross_ranks_as_horovod_defines_them():
    ids = cross_ranks([("a", 0), ("a", 1), ("a", 2), ("b", 0), ("c", 0), ("c", 1)])
    assert [(i.local_size, i.cross_rank, i.cross_size) for i in ids] == [
        (3, 0, 3), (3, 0, 2), (3, 0, 1), (1, 1, 3), (2, 2, 3), (2, 1, 2)]

