"""Jobs on a real Slurm cluster: slurmctld, and a slurmd per network-namespace node (tests/slurm_cluster.py).

``srun`` and ``sbatch`` start the tasks; each task finds its identity and
rank 0's rendezvous store from what Slurm gave it, with no roundelrun.
"""

import re
import subprocess
import sys
import time

import pytest

from launch_util import WORKERS_DIR, clean_env
from slurm_cluster import slurm_cluster  # noqa: F401 (the fixture)
from roundel.rendezvous import slurm

TRAINING = str(WORKERS_DIR / "cluster_training.py")
IDENTITY = re.compile(r"^(\d+): IDENTITY (\d+) (\d+) (\d+) (\d+) (\d+) (\d+) (\S+)$", re.M)


def run(cluster, command, env=None, timeout=120):
    """``command`` on the login host (here) with the cluster's SLURM_CONF; output as text."""
    full_env = clean_env({**cluster.env(), "OMP_NUM_THREADS": "1", **(env or {})})
    try:
        return subprocess.run(command, env=full_env, capture_output=True, text=True, timeout=timeout)
    except subprocess.TimeoutExpired as exc:
        subprocess.run(["scancel", "--full", "--user", "root"], env=full_env, capture_output=True)
        pytest.fail(f"{' '.join(command)} did not finish within {timeout} s (hang?)\n{exc.stdout}\n{exc.stderr}")


def describe(result, cluster):
    return (f"exit status {result.returncode}\n--- stdout ---\n{result.stdout[-8000:]}\n"
            f"--- stderr ---\n{result.stderr[-8000:]}\n--- daemons ---\n{cluster.logs()[-6000:]}")


def identities(text):
    """{rank: (size, local_rank, local_size, cross_rank, cross_size, host)} from every IDENTITY line."""
    found = {}
    for match in IDENTITY.finditer(text):
        task, rank, *numbers, host = match.groups()
        assert task == rank, f"srun task {task} says it is rank {rank}"
        found[int(rank)] = (*map(int, numbers), host)
    return found


def assert_trained(result, cluster, np):
    assert result.returncode == 0, describe(result, cluster)
    passed = re.findall(r"^(\d+): CHECKS PASSED cluster_training$", result.stdout, re.M)
    assert sorted(map(int, passed)) == list(range(np)), describe(result, cluster)


def test_srun_on_two_nodes_trains_with_the_same_parameters_on_every_rank(slurm_cluster):
    result = run(slurm_cluster, ["srun", "-N", "2", "-n", "4", "--ntasks-per-node", "2", "--label",
                                 sys.executable, TRAINING])
    assert_trained(result, slurm_cluster, 4)
    # Slurm's block distribution: tasks 0-1 on the first node, 2-3 on the second; Horovod's numbering
    assert identities(result.stdout) == {0: (4, 0, 2, 0, 2, "rdlnode1"), 1: (4, 1, 2, 0, 2, "rdlnode1"),
                                         2: (4, 0, 2, 1, 2, "rdlnode2"), 3: (4, 1, 2, 1, 2, "rdlnode2")}


def test_rank0_on_a_node_other_than_the_first(slurm_cluster, tmp_path):
    """Task 0 on the second node of the sorted node list (srun -m arbitrary): rank 0's store is where it is."""
    hostfile = tmp_path / "hostfile"
    hostfile.write_text("rdlnode2\nrdlnode1\nrdlnode1\n")
    result = run(slurm_cluster, ["srun", "-N", "2", "-n", "3", "-m", "arbitrary", "--label",
                                 sys.executable, TRAINING], env={"SLURM_HOSTFILE": str(hostfile)})
    assert_trained(result, slurm_cluster, 3)
    assert identities(result.stdout) == {0: (3, 0, 1, 0, 2, "rdlnode2"), 1: (3, 0, 2, 1, 2, "rdlnode1"),
                                         2: (3, 1, 2, 0, 1, "rdlnode1")}


def test_sbatch_job_script_with_srun_inside(slurm_cluster, tmp_path):
    output = tmp_path / "job.out"
    script = tmp_path / "job.sh"
    script.write_text(f"""#!/bin/bash
#SBATCH --job-name=roundel-test
#SBATCH --nodes=2
#SBATCH --ntasks-per-node=2
#SBATCH --output={output}
echo "batch script on $(hostname), nodes $SLURM_JOB_NODELIST"
srun --label {sys.executable} {TRAINING}
""")
    result = run(slurm_cluster, ["sbatch", "--wait", str(script)], timeout=180)
    text = output.read_text() if output.exists() else ""
    assert result.returncode == 0, describe(result, slurm_cluster) + "\n--- job output ---\n" + text
    assert "batch script on rdlnode1, nodes rdlnode[1-2]" in text, text
    assert sorted(map(int, re.findall(r"^(\d+): CHECKS PASSED cluster_training$", text, re.M))) == [0, 1, 2, 3], text
    assert {host for *_, host in identities(text).values()} == {"rdlnode1", "rdlnode2"}, text


def test_a_rank_killed_under_srun_ends_the_step_with_roundels_error_on_every_rank(slurm_cluster):
    started = time.monotonic()
    result = run(slurm_cluster, ["srun", "-N", "2", "-n", "4", "--ntasks-per-node", "2", "--label",
                                 sys.executable, TRAINING, "--kill-rank", "1"])
    elapsed = time.monotonic() - started
    assert result.returncode != 0, describe(result, slurm_cluster)
    assert re.search(r"task 1: Killed", result.stderr), describe(result, slurm_cluster)
    for rank in (0, 2, 3):
        assert re.search(rf"^{rank}: roundel: RoundelInternalError: rank 1 died", result.stderr, re.M), \
            describe(result, slurm_cluster)
    assert "CHECKS PASSED" not in result.stdout
    assert elapsed < 60, f"the step took {elapsed:.0f} s to end after rank 1 died"
    assert slurm_cluster.processes_left(TRAINING) == []


def test_node_list_expansion_agrees_with_scontrol(slurm_cluster):
    """Slurm's own expansion (scontrol show hostnames) of node lists that Slurm 22.05 accepts."""
    for hostlist in ("rdlnode[1-2]", "tux[2,1-2]", "lx[0-5,7,10-13]", "n[08-10],gpu1", "rack[1-2]-node[01-04]",
                     "a[1,3],b,c[009-011]", "n[01-3]", "n[9-11]"):
        result = run(slurm_cluster, ["scontrol", "show", "hostnames", hostlist])
        assert result.returncode == 0, describe(result, slurm_cluster)
        assert slurm.expand_hostlist(hostlist) == result.stdout.split(), hostlist


def test_exported_secret_and_port_need_no_secret_file(slurm_cluster, tmp_path):
    """With ROUNDEL_SECRET and ROUNDEL_RENDEZVOUS_PORT exported, the ranks meet on the step's first node."""
    empty = tmp_path / "secrets"  # a secret directory no file is ever written to
    result = run(slurm_cluster, ["srun", "-N", "2", "-n", "3", "--label", sys.executable, TRAINING],
                 env={"ROUNDEL_SECRET": "5e" * 32, "ROUNDEL_RENDEZVOUS_PORT": "29777",
                      "ROUNDEL_SECRET_DIR": str(empty)})
    assert_trained(result, slurm_cluster, 3)
    assert identities(result.stdout)[0][-1] == "rdlnode1"
    assert not empty.exists() or not any(empty.iterdir())
