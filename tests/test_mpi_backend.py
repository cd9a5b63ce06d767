"""Tensor data over MPI (``HOROVOD_CPU_OPERATIONS=mpi``) in jobs started by a real ``mpirun``.

Every collective is checked against NumPy by the same workers that check the
Gloo transport; a DistributedOptimizer run must end with the same weights as
over Gloo; asking for MPI without mpirun is a clear error at ``init()``.
"""

import json
import re
import sys

import pytest

from launch_util import LAUNCHER, WORKERS_DIR, describe, rank_lines, run_command, run_job
from test_external_launchers import BIN, MPI_ENV, checks_passed, require

COLLECTIVE_SCENARIOS = "allreduce,grouped,allgather,broadcast,alltoall,reducescatter,barrier,join,ordering,autograd"
PROCESS_SET_SCENARIOS = "static,concurrent,dynamic,many_sets"


def mpirun(np, script, *args, cpu_operations="mpi", extra=(), timeout=150):
    """``mpirun -np NP python WORKERS/SCRIPT ARGS`` with HOROVOD_CPU_OPERATIONS set for every rank."""
    require("mpirun", "mpi4py")
    command = [str(BIN / "mpirun"), "--oversubscribe", "-np", str(np), "-x", "HOROVOD_CPU_OPERATIONS", *extra,
               sys.executable, str(WORKERS_DIR / script), *args]
    return run_command(command, env={**MPI_ENV, "HOROVOD_CPU_OPERATIONS": cpu_operations,
                                     "HOROVOD_GLOO_TIMEOUT_SECONDS": "30"}, timeout=timeout)


def transports(stdout):
    return sorted(re.findall(r"TRANSPORT (\d+) (mpi_enabled=\w+ gloo_enabled=\w+ mpi_built=\w+)", stdout))


def over_mpi(np):
    return [(str(r), "mpi_enabled=True gloo_enabled=False mpi_built=True") for r in range(np)]


@pytest.mark.parametrize("np", [2, 3])
def test_every_collective_over_mpi(np):
    result = mpirun(np, "torch_mpi_backend.py", "collectives", COLLECTIVE_SCENARIOS)
    assert result.returncode == 0, describe(result)
    assert transports(result.stdout) == over_mpi(np), describe(result)
    for scenario in COLLECTIVE_SCENARIOS.split(","):
        assert checks_passed(result.stdout, np, scenario), f"{scenario}\n{describe(result)}"


def test_process_sets_and_sub_communicators_over_mpi():
    result = mpirun(3, "torch_process_sets.py", PROCESS_SET_SCENARIOS, extra=("-x", "ROUNDEL_SIZE=3"))
    assert result.returncode == 0, describe(result)
    for scenario in PROCESS_SET_SCENARIOS.split(","):
        assert checks_passed(result.stdout, 3, scenario), f"{scenario}\n{describe(result)}"
    result = mpirun(3, "torch_mpi_backend.py", "subcomm")  # init(comm=evens / odds): two jobs
    assert result.returncode == 0 and checks_passed(result.stdout, 3, "subcomm"), describe(result)
    assert transports(result.stdout) == sorted(over_mpi(2) + over_mpi(1)), describe(result)


def test_training_over_mpi_matches_gloo():
    result = mpirun(2, "torch_mpi_backend.py", "train")  # over MPI, then init() again over Gloo
    assert result.returncode == 0 and checks_passed(result.stdout, 2, "train"), describe(result)
    expected = [(str(r), f"mpi_enabled={mpi} gloo_enabled={not mpi} mpi_built=True")
                for r in range(2) for mpi in (True, False)]
    assert transports(result.stdout) == sorted(expected), describe(result)
    weights = {(transport, rank): json.loads(values)
               for transport, rank, values in re.findall(r"WEIGHTS (\w+) (\d+) (\[.*\])", result.stdout)}
    assert weights[("mpi", "0")] == weights[("mpi", "1")] and weights[("gloo", "0")] == weights[("gloo", "1")]
    assert weights[("mpi", "0")] == pytest.approx(weights[("gloo", "0")], rel=1e-6, abs=1e-7)


def test_hierarchical_collectives_over_mpi():
    result = mpirun(4, "torch_mpi_backend.py", "hierarchical",
                    extra=("-x", "HOROVOD_LOG_LEVEL=debug"))
    assert result.returncode == 0 and checks_passed(result.stdout, 4, "hierarchical"), describe(result)
    assert transports(result.stdout) == over_mpi(4), describe(result)
    assert result.stderr.count("stays flat: the job runs on one host") == 4, describe(result)


# Each rank in a UTS namespace of its own named host<rank % 2>, so that the ranks meet as 2 hosts x 2 (host names
# are what roundel groups ranks by); Open MPI's local ranks, which count the 4 on this one machine, unset.
AS_TWO_HOSTS = ('hostname "host$((OMPI_COMM_WORLD_RANK % 2))" && '
                'unset OMPI_COMM_WORLD_LOCAL_RANK OMPI_COMM_WORLD_LOCAL_SIZE && exec "$@"')


def test_process_sets_beside_hierarchical_allreduce_over_mpi():
    """Adding a process set to a job whose MPI communicator is hierarchical gives the set its own communicator."""
    require("mpirun", "mpi4py", "unshare")
    command = [*LAUNCHER, "--mpi", "--hierarchical-allreduce", "-np", "4", "unshare", "--uts", "sh", "-c",
               AS_TWO_HOSTS, "sh", sys.executable, str(WORKERS_DIR / "torch_mpi_backend.py"), "hierarchical_sets"]
    result = run_command(command, env={"PATH": MPI_ENV["PATH"]}, timeout=180)
    assert result.returncode == 0 and checks_passed(result.stdout, 4, "hierarchical_sets"), describe(result)
    assert transports(result.stdout) == over_mpi(4), describe(result)


def test_roundelrun_mpi_moves_data_over_mpi():
    require("mpirun", "mpi4py")
    result = run_job(2, "torch_mpi_backend.py", "transport", launcher_args=["--mpi"],
                     env={"PATH": MPI_ENV["PATH"]}, timeout=120)
    assert result.returncode == 0, describe(result)
    assert transports(result.stdout) == over_mpi(2), describe(result)
    chosen = run_job(2, "torch_mpi_backend.py", "transport", launcher_args=["--mpi"],
                     env={"PATH": MPI_ENV["PATH"], "HOROVOD_CPU_OPERATIONS": "gloo"}, timeout=120)
    assert chosen.returncode == 0, describe(chosen)
    assert transports(chosen.stdout) == [(str(r), "mpi_enabled=False gloo_enabled=True mpi_built=True")
                                         for r in range(2)], describe(chosen)


def test_mpi_without_mpirun_is_a_clear_error():
    require("mpi4py")
    result = run_job(2, "torch_mpi_backend.py", "transport", env={"HOROVOD_CPU_OPERATIONS": "mpi"}, timeout=60)
    assert result.returncode != 0, describe(result)
    errors = "\n".join(rank_lines(result.stderr, 0)) or result.stderr
    assert "SettingsError" in errors and "needs a job started by mpirun" in errors, describe(result)
    assert "HOROVOD_CPU_OPERATIONS=gloo" in errors, describe(result)


def test_unknown_cpu_operations_is_a_clear_error():
    result = run_job(1, "torch_mpi_backend.py", "transport", env={"HOROVOD_CPU_OPERATIONS": "ccl"}, timeout=60)
    assert result.returncode != 0, describe(result)
    assert "HOROVOD_CPU_OPERATIONS='ccl' is not a CPU transport roundel has; use gloo or mpi" in result.stderr, \
        describe(result)
