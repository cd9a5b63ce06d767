"""Slurm's hostlist grammar and the identities PBS/PALS and PMIx launchers give (pure logic)."""

import pytest

from roundel.errors import RoundelInternalError, SettingsError
from roundel.rendezvous import bootstrap, slurm
from roundel.rendezvous.identity import detect_launcher


@pytest.mark.parametrize("hostlist, expected", [
    # the examples of Slurm's documentation (sbatch/srun --nodelist, scontrol show hostnames)
    ("lx[10-20]", [f"lx{n}" for n in range(10, 21)]),
    ("tux[2,1-2]", ["tux2", "tux1", "tux2"]),
    ("lx[0-5,7,10-13]", ["lx0", "lx1", "lx2", "lx3", "lx4", "lx5", "lx7", "lx10", "lx11", "lx12", "lx13"]),
    ("linux[00-02]", ["linux00", "linux01", "linux02"]),
    ("rack[0-1]_blade[0-2]", ["rack0_blade0", "rack0_blade1", "rack0_blade2",
                              "rack1_blade0", "rack1_blade1", "rack1_blade2"]),
    # text after a group, several groups, commas inside and outside brackets, padding
    ("gpu[1-2]-ib", ["gpu1-ib", "gpu2-ib"]),
    ("rack[1-2]-node[01-02]", ["rack1-node01", "rack1-node02", "rack2-node01", "rack2-node02"]),
    ("node[03-05,9],gpu1", ["node03", "node04", "node05", "node9", "gpu1"]),
    ("n[08-10]", ["n08", "n09", "n10"]),
    ("n[01-3]", ["n01", "n02", "n03"]),
    ("n[1-03]", ["n1", "n2", "n3"]),
    ("a,,b", ["a", "b"]),
    ("gpu1", ["gpu1"]),
    (" x[1-2] , y ", ["x1", "x2", "y"]),
])
def test_expand_hostlist(hostlist, expected):
    assert slurm.expand_hostlist(hostlist) == expected


@pytest.mark.parametrize("hostlist, problem", [
    ("n[1-3", "never closed"), ("n1-3]", "without '\\['"), ("n[3-1]", "backwards"), ("n[a-b]", "neither"),
    ("n[[1]]", "nested"), ("", "names no host"), ("n[1,]", "neither"),
])
def test_malformed_hostlists_say_what_is_wrong(hostlist, problem):
    with pytest.raises(ValueError, match=problem):
        slurm.expand_hostlist(hostlist)


def test_first_host_of_the_step():
    assert bootstrap.slurm_first_host({"SLURM_JOB_NODELIST": "node[03-05,9],gpu1"}) == "node03"
    assert bootstrap.slurm_first_host({"SLURM_STEP_NODELIST": "gpu1,gpu2", "SLURM_JOB_NODELIST": "x"}) == "gpu1"
    assert bootstrap.slurm_first_host({"SLURM_STEP_NODELIST": "gpu[1-2]-ib"}) == "gpu1-ib"
    assert bootstrap.slurm_first_host({"SLURM_STEP_NODELIST": "rack[1-2]-node[01-04]"}) == "rack1-node01"
    with pytest.raises(RoundelInternalError, match="never closed.*ROUNDEL_RENDEZVOUS_ADDR"):
        bootstrap.slurm_first_host({"SLURM_STEP_NODELIST": "gpu[1-2"})
    with pytest.raises(RoundelInternalError, match="SLURM_STEP_NODELIST"):
        bootstrap.slurm_first_host({})


def test_step_facts():
    assert slurm.single_node({"SLURM_STEP_NUM_NODES": "1", "SLURM_STEP_NODELIST": "n[1-2]"})
    assert not slurm.single_node({"SLURM_STEP_NODELIST": "n[1-2]"})
    assert slurm.single_node({"SLURM_STEP_NODELIST": "n[1,1]"})
    assert slurm.rank0_on_first_node({"SLURM_DISTRIBUTION": "block"})
    assert slurm.rank0_on_first_node({})
    assert not slurm.rank0_on_first_node({"SLURM_DISTRIBUTION": "arbitrary"})
    assert slurm.this_node({"SLURMD_NODENAME": "gpu7"}) == "gpu7" and slurm.this_node({}) is None


def test_pals_identity_as_polaris_mpiexec_sets_it():
    # HPE Cray PALS under PBS Pro (mpiexec -n 8 --ppn 4): PALS_* with Cray PMI's PMI_* beside them
    env = {"PALS_RANKID": "5", "PALS_LOCAL_RANKID": "1", "PALS_LOCAL_SIZE": "4", "PALS_NODEID": "1",
           "PMI_RANK": "5", "PMI_SIZE": "8", "PMI_LOCAL_RANK": "1", "PMI_LOCAL_SIZE": "4"}
    found = detect_launcher(env)
    assert (found.launcher, found.rank, found.size, found.local_rank, found.local_size) == ("pals", 5, 8, 1, 4)
    assert found.by_mpi
    only_pals = {"PALS_RANKID": "2", "PALS_NRANKS": "3", "PALS_LOCAL_RANKID": "0"}
    found = detect_launcher(only_pals)
    assert (found.rank, found.size, found.local_rank, found.local_size) == (2, 3, 0, None)
    with pytest.raises(SettingsError, match="PALS_NRANKS"):
        detect_launcher({"PALS_RANKID": "2"})
    with pytest.raises(SettingsError, match="rank 9 outside a job of size 8"):
        detect_launcher({**env, "PALS_RANKID": "9"})
    with pytest.raises(SettingsError, match="PALS_LOCAL_RANKID='x'"):
        detect_launcher({**env, "PALS_LOCAL_RANKID": "x"})


def test_pmix_identity():
    found = detect_launcher({"PMIX_RANK": "3", "PMIX_NAMESPACE": "prterun-h-1@1"})
    assert (found.launcher, found.rank, found.size, found.local_rank, found.local_size) == ("pmix", 3, None,
                                                                                            None, None)
    assert found.by_mpi  # the size comes from MPI.COMM_WORLD at init
    found = detect_launcher({"PMIX_RANK": "1", "PMIX_SIZE": "2", "PMIX_LOCAL_RANK": "1", "PMIX_LOCAL_SIZE": "2"})
    assert (found.rank, found.size, found.local_rank, found.local_size) == (1, 2, 1, 2)
    # Open MPI's variables, and srun's, win over the PMIx server's beneath them
    assert detect_launcher({"PMIX_RANK": "1", "OMPI_COMM_WORLD_RANK": "1", "OMPI_COMM_WORLD_SIZE": "2"}).launcher \
        == "openmpi"
    assert detect_launcher({"PMIX_RANK": "1", "SLURM_PROCID": "1", "SLURM_STEP_NUM_TASKS": "2"}).launcher == "srun"
    with pytest.raises(SettingsError, match="PMIX_RANK='-1'|rank -1"):
        detect_launcher({"PMIX_RANK": "-1"})


def test_indexed_job_identity():
    env = {"JOB_COMPLETION_INDEX": "2", "ROUNDEL_NUM_PROC": "3", "ROUNDEL_RENDEZVOUS_ADDR": "train-0.train"}
    found = detect_launcher(env)
    assert (found.launcher, found.rank, found.size, found.local_rank, found.local_size) == ("kubernetes", 2, 3,
                                                                                            None, None)
    assert not found.by_mpi
    # an Indexed Job that is not a roundel job (no size, no store named) is no launch
    assert detect_launcher({"JOB_COMPLETION_INDEX": "2"}) is None
    with pytest.raises(SettingsError, match="ROUNDEL_NUM_PROC=<the Job's completions>"):
        detect_launcher({"JOB_COMPLETION_INDEX": "2", "ROUNDEL_RENDEZVOUS_ADDR": "train-0.train"})
    with pytest.raises(SettingsError, match="rank 3 outside a job of size 3"):
        detect_launcher({**env, "JOB_COMPLETION_INDEX": "3"})
    # torchrun's variables (a PyTorchJob's or TrainJob's pods, which are Indexed Jobs too) win
    torchrun = {**env, "RANK": "1", "WORLD_SIZE": "3", "MASTER_ADDR": "m", "MASTER_PORT": "29400"}
    assert detect_launcher(torchrun).launcher == "torchrun"


def test_indexed_job_without_a_secret_says_what_to_set():
    env = {"JOB_COMPLETION_INDEX": "1", "ROUNDEL_NUM_PROC": "3", "ROUNDEL_RENDEZVOUS_ADDR": "train-0.train"}
    with pytest.raises(SettingsError, match="ROUNDEL_RENDEZVOUS_PORT, ROUNDEL_SECRET.*from a Secret"):
        bootstrap.discover("init0/", 5.0, env)
