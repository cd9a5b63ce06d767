"""Hierarchical allreduce and allgather on 2 simulated hosts x 2 slots, and flat on one host.

Hosts are network namespaces running sshd (see ``netns_util``); the job is
launched over ssh as users do, with ``--hierarchical-allreduce
--hierarchical-allgather``. The worker checks results against NumPy and
prints which communicator the job got; ``--verbose`` shows each rank's log
line saying why it went hierarchical or stayed flat.
"""

import csv
import json
import sys

from launch_util import LAUNCHER, WORKERS_DIR, assert_checks_passed, describe, rank_lines, run_command
from netns_util import SSH_PORT
from netns_util import two_hosts as hosts  # noqa: F401 (a fixture)

WORKER = str(WORKERS_DIR / "torch_hierarchical.py")
AUTOTUNE_WORKER = str(WORKERS_DIR / "torch_autotune.py")
SCENARIOS = "allreduce,fused,allgather"
FLAGS = ("--hierarchical-allreduce", "--hierarchical-allgather", "--verbose")


def backends(result, np):
    return [[line for line in rank_lines(result.stdout, rank, "stdout") if line.startswith("BACKEND")]
            for rank in range(np)]


def test_two_hosts_hierarchical_is_used_and_correct(hosts):
    h1, h2 = hosts.addrs
    result = run_command([*LAUNCHER, "-p", str(SSH_PORT), "-i", hosts.key, "-np", "4", "-H", f"{h1}:2,{h2}:2",
                          *FLAGS, sys.executable, WORKER, SCENARIOS], env=hosts.ssh_env(), timeout=300)
    assert_checks_passed(result, 4, *SCENARIOS.split(","))
    assert backends(result, 4) == [["BACKEND HierarchicalBackend True True"]] * 4, describe(result)
    for rank in range(4):  # the two ranks of each host reduce, gather and broadcast in shared memory
        assert "LOCAL SharedMemoryBackend" in rank_lines(result.stdout, rank, "stdout"), describe(result)
        said = [line for line in rank_lines(result.stderr, rank, "stderr") if "hierarchical allreduce" in line]
        assert len(said) == 1 and said[0].endswith(
            f"hierarchical allreduce and allgather over 2 hosts x 2 ranks (local rank {rank % 2}, "
            f"cross rank {rank // 2})"), describe(result)
    assert "no effect yet" not in result.stderr
    assert not hosts.leftovers()


def test_two_hosts_allreduce_only(hosts):
    h1, h2 = hosts.addrs
    result = run_command([*LAUNCHER, "-p", str(SSH_PORT), "-i", hosts.key, "-np", "4", "-H", f"{h1}:2,{h2}:2",
                          "--hierarchical-allreduce", sys.executable, WORKER, "fused,allgather"],
                         env=hosts.ssh_env(), timeout=300)
    assert_checks_passed(result, 4, "fused", "allgather")
    assert backends(result, 4) == [["BACKEND HierarchicalBackend True False"]] * 4, describe(result)


def test_autotune_switches_hierarchical_collectives_on_every_rank_alike(hosts, tmp_path):
    h1, h2 = hosts.addrs
    log = tmp_path / "autotune.csv"
    result = run_command([*LAUNCHER, "-p", str(SSH_PORT), "-i", hosts.key, "-np", "4", "-H", f"{h1}:2,{h2}:2",
                          "--autotune", "--autotune-log-file", str(log), "--autotune-warmup-samples", "0",
                          "--autotune-steps-per-sample", "1", "--autotune-bayes-opt-max-samples", "2",
                          "--cache-capacity", "0", sys.executable, AUTOTUNE_WORKER],
                         env=hosts.ssh_env(), timeout=300)
    assert_checks_passed(result, 4, "autotune")  # every step's sums exact, through every switch
    with open(log, newline="") as f:
        rows = [(row["hierarchical_allreduce"], row["hierarchical_allgather"], float(row["score"]))
                for row in csv.DictReader(f)]
    kept = max(rows[:3], key=lambda row: row[2])[0]  # hierarchical allreduce tried at the best point, kept if better
    assert [row[:2] for row in rows] == [("0", "0"), ("0", "0"), ("1", "0"), (kept, "1")], rows
    tuned = [json.loads(next(line for line in rank_lines(result.stdout, rank, "stdout")
                             if line.startswith("TUNED "))[6:]) for rank in range(4)]
    assert [t["params"] for t in tuned[1:]] == [tuned[0]["params"]] * 3, describe(result)
    assert [t["backend"] for t in tuned] == [tuned[0]["params"][4:6]] * 4, describe(result)  # applied everywhere
    assert not hosts.leftovers()


def test_uneven_hosts_stay_flat(hosts):
    h1, h2 = hosts.addrs
    result = run_command([*LAUNCHER, "-p", str(SSH_PORT), "-i", hosts.key, "-np", "3", "-H", f"{h1}:2,{h2}:1",
                          *FLAGS, sys.executable, WORKER, "fused,allgather"], env=hosts.ssh_env(), timeout=300)
    assert_checks_passed(result, 3, "fused", "allgather")
    assert backends(result, 3) == [["BACKEND GlooBackend False False"]] * 3, describe(result)
    assert "the job stays flat: hosts run different numbers of ranks (local sizes [1, 2])" in result.stderr


def test_one_host_stays_flat_and_correct():
    result = run_command([*LAUNCHER, "-np", "2", *FLAGS, sys.executable, WORKER, SCENARIOS], timeout=300)
    assert_checks_passed(result, 2, *SCENARIOS.split(","))
    # flat, and on one host through shared memory
    assert backends(result, 2) == [["BACKEND SharedMemoryBackend False False"]] * 2, describe(result)
    for rank in range(2):
        assert any(line.endswith("the job stays flat: the job runs on one host")
                   for line in rank_lines(result.stderr, rank, "stderr")), describe(result)
