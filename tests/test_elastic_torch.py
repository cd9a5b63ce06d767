"""Elastic PyTorch training under the real launcher: hosts added and removed, workers SIGKILLed.

Every run trains tests/workers/torch_elastic.py (a linear model on 96
synthetic samples, batches of 4, a commit after every step) while the test
rewrites the discovery script's output or kills workers (once it is done,
training runs on without its pause between steps), then checks with
``check_training``: the requested epochs were completed, every rank ended
with the same parameters, rank 0's committed step only went forward, and
each epoch covered every sample, repeating at most the work since the last
commit and the padding of the shards, and every (re)start of the training
function found its identity for that generation in ``os.environ``
(``HOROVOD_RANK``, ``HOROVOD_HOSTNAME``, ... and the ``ROUNDEL_*`` names).
"""

from __future__ import annotations

import re
import time

import psutil
import pytest

from elastic_util import ElasticJob, check_training, records, worker_lines
from launch_util import LAUNCHER, WORKERS_DIR, describe, run_command
from netns_util import LAUNCHER_ADDR, SSH_PORT, NetnsHosts, require_tools

WORKER = str(WORKERS_DIR / "torch_elastic.py")
SAMPLES, BATCH = 96, 4


def _job(tmp_path, hosts, *launcher_args, epochs=3, step_sleep=0.05, **env):
    """An elastic job of the training worker; ``hosts`` None: no discovery script (``-H`` in the args)."""
    env = {"EPOCHS": epochs, "SAMPLES": SAMPLES, "BATCH": BATCH, "STEP_SLEEP": step_sleep,
           "FAST_FILE": tmp_path / "fast", **env}
    return ElasticJob(tmp_path, hosts, WORKER, launcher_args, env)


def _full_speed(tmp_path) -> None:
    """The test has done what needed training slowed down: the rest need not pause between steps."""
    (tmp_path / "fast").touch()


def _repeats_allowed(failures: int, generations: int, largest: int = 3) -> int:
    # a failure redoes at most the step in flight and the one since the last commit on every rank;
    # each re-sharding pads with fewer than `largest` samples
    return failures * 2 * BATCH * largest + generations * largest


def test_hosts_added_then_removed(tmp_path):
    job = _job(tmp_path, "localhost:2\n", "-np", "2", "--elastic-timeout", "60", epochs=4, step_sleep=0.1)
    job.wait_count("COMMIT", 5)
    job.set_hosts("localhost:3\n")
    job.wait_count("generation 1: 3 worker(s)", 1)
    job.wait_for(lambda lines: sum("COMMIT" in line for line in lines) >= 20, what="training at 3 ranks")
    job.set_hosts("localhost:2\n")
    job.wait_count("generation 2: 2 worker(s)", 1)
    _full_speed(tmp_path)
    assert job.finish() == 0, job.describe()
    text = job.text()
    assert "worker localhost:2 will leave" in text, job.describe()
    assert "elastic worker localhost:2#3 leaves the job" in text, job.describe()
    sizes = {r["size"] for _, r in records(text, "SEEN")}
    assert sizes == {2, 3}, sizes
    # a planned change loses nothing: no rollback, so only padding repeats samples
    finals = check_training(text, 4, SAMPLES, BATCH, _repeats_allowed(0, 3))
    assert len(finals) == 2
    resets = [payload for _, _, payload in worker_lines(text) if payload.startswith("RESET")]
    assert resets.count("RESET 3") == 2 and resets.count("RESET 2") == 2, resets


def _generations(lines) -> list[tuple[int, list[str]]]:
    """(line index, member labels in rank order) of every generation the driver announced."""
    out = []
    for i, line in enumerate(lines):
        if "worker(s), ranks " in line:
            out.append((i, [item.split("=")[0] for item in line.split("ranks ")[1].split(", ")]))
    return out


def test_worker_killed_mid_epoch_ten_times(tmp_path):
    kills = 10
    stop = tmp_path / "stop"
    # one slot per host: a failure takes its whole host out
    job = _job(tmp_path, "127.0.0.2:1\n127.0.0.3:1\n127.0.0.4:1\n", "-np", "2", "--blacklist-cooldown-range", "0.25",
               "0.5", "--elastic-timeout", "60", epochs=1000, step_sleep=0.1, STOP_FILE=stop)

    def full_and_training(lines, after):
        generations = _generations(lines)
        if len(generations) <= after or len(generations[-1][1]) != 3:
            return False
        return sum("COMMIT" in line for line in lines[generations[-1][0]:]) >= 2

    seen = 0
    for kill in range(kills):
        # the replacement started after the cooldown has joined and training goes on at 3 ranks
        job.wait_for(lambda lines: full_and_training(lines, seen), timeout=90,
                     what=f"3 ranks training before kill {kill + 1}")
        seen = len(_generations(job.output()))
        members = _generations(job.output())[-1][1]
        job.kill(members[0] if kill % 2 == 0 else members[-1])  # rank 0's worker, then another one
        job.wait_count("was killed by signal SIGKILL", kill + 1, timeout=60)
    stop.touch()
    _full_speed(tmp_path)
    assert job.finish(timeout=120) == 0, job.describe()
    text = job.text()
    assert text.count("blacklisted for") == kills and "for the rest of the job" not in text, job.describe()
    # Horovod's cooldown: 0.25 * 2**k plus a fraction of 0.25 after the k-th listing, kept within [0.25, 0.5]
    assert text.count("blacklisted for 0.5 s") == kills, job.describe()
    check_training(text, None, SAMPLES, BATCH, _repeats_allowed(kills, 2 * kills + 1))


def test_permanent_blacklist_trains_on_with_the_survivor(tmp_path):
    job = _job(tmp_path, "localhost:1\n127.0.0.2:1\n", "--min-np", "1", "--elastic-timeout", "60", epochs=2,
               step_sleep=0.1)
    job.wait_count("COMMIT", 4)
    job.kill("127.0.0.2:0")
    job.wait_count("generation 1: 1 worker(s)", 1)
    _full_speed(tmp_path)
    assert job.finish() == 0, job.describe()
    text = job.text()
    assert "host 127.0.0.2 blacklisted for the rest of the job" in text, job.describe()
    assert text.count("started worker") == 2, "a worker was started on the blacklisted host"
    finals = check_training(text, 2, SAMPLES, BATCH, _repeats_allowed(1, 2))
    assert finals[0]["size"] == 1


FIXED = ("-np", "4", "-H", "127.0.0.2:2,127.0.0.3:2", "--min-np", "2", "--max-np", "4", "--elastic-timeout", "60")
"""horovodrun's fixed-host elastic job (Horovod's test_fault_tolerance_without_scaling): -H with --min-np."""


def test_a_failure_takes_its_whole_host_out_on_fixed_hosts(tmp_path):
    # rank 0 fails in the first generation: its host is blacklisted and its other worker stopped (Horovod ends
    # at size 2, not 3); the identity variables follow every generation
    job = _job(tmp_path, None, *FIXED, epochs=2, EXIT_SCHEDULE='{"0": [0]}')
    assert job.finish(timeout=120) == 0, job.describe()
    text = job.text()
    assert "generation 0: 4 worker(s), ranks 127.0.0.2:0=0, 127.0.0.2:1=1, 127.0.0.3:0=2, 127.0.0.3:1=3" in text, \
        job.describe()
    assert "worker 127.0.0.2:0 exited with code 1; host 127.0.0.2 blacklisted for the rest of the job" in text
    assert "worker 127.0.0.2:1 stopped: its host 127.0.0.2 is blacklisted" in text, job.describe()
    assert "generation 1: 2 worker(s), ranks 127.0.0.3:0=0, 127.0.0.3:1=1" in text, job.describe()
    assert text.count("started worker") == 4, job.describe()
    starts = records(text, "START")  # check_training below checks every start's identity variables
    moved = [(r["rank"], r["size"], r["env"]["HOROVOD_RANK"]) for label, r in starts if label == "127.0.0.3:1"]
    assert moved == [(3, 4, "3"), (1, 2, "1")], moved
    finals = check_training(text, 2, SAMPLES, BATCH, _repeats_allowed(1, 2, 4))
    assert len(finals) == 2


def test_every_host_blacklisted_ends_the_job(tmp_path):
    # Horovod's test_all_hosts_blacklisted: after a failure on each host no host is left to train on
    job = _job(tmp_path, None, *FIXED, epochs=5, EXIT_SCHEDULE='{"0": [0], "1": [0]}')
    start = time.monotonic()
    assert job.finish(timeout=120) == 1, job.describe()
    assert time.monotonic() - start < 60
    text = job.text()
    assert "worker 127.0.0.3:1 stopped: its host 127.0.0.3 is blacklisted" in text, job.describe()
    assert "error: every host of the job is blacklisted (127.0.0.2, 127.0.0.3)" in text, job.describe()
    assert "FINAL" not in text


def test_fixed_hosts_with_fewer_slots_than_min_np_fail_at_once(tmp_path):
    job = _job(tmp_path, None, "-H", "127.0.0.2:1,127.0.0.3:1", "--min-np", "3")
    assert job.finish(timeout=60) == 1, job.describe()
    assert "the fixed hosts not blacklisted offer 2 slot(s), fewer than --min-np 3" in job.text(), job.describe()


def test_min_np_not_reached_before_the_elastic_timeout(tmp_path):
    job = _job(tmp_path, "localhost:1\n", "-np", "2", "--elastic-timeout", "3")
    assert job.finish(timeout=60) == 1, job.describe()
    assert ("only 1 worker slot(s) for 3 s (--elastic-timeout), fewer than --min-np 2") in job.text(), job.describe()
    assert "FINAL" not in job.text()


def test_reset_limit_exceeded(tmp_path):
    job = _job(tmp_path, "localhost:2\n", "-np", "2", "--reset-limit", "1", "--elastic-timeout", "60",
               epochs=5, step_sleep=0.1)
    job.wait_count("COMMIT", 3)
    job.set_hosts("localhost:3\n")
    job.wait_count("generation 1: 3 worker(s)", 1)
    job.wait_count("RESET 3", 2)
    job.set_hosts("localhost:2\n")
    assert job.finish(timeout=90) == 1, job.describe()
    assert "the job needed reset number 2, more than --reset-limit 1" in job.text(), job.describe()


@pytest.mark.parametrize("hosts, args, message", [
    ("localhost:2\n", ["--min-np", "3", "--max-np", "2"], "--max-np 2 is below -np/--min-np 3"),
    ("localhost:2\n", ["-np", "2", "-H", "localhost:2"], "-H/--hosts: not allowed with argument --host-discovery-script"),
    ("localhost:2\n", ["-np", "2", "--blacklist-cooldown-range", "5", "1"], "need 0 <= LO <= HI"),
    ("localhost:2\n", ["--max-np", "2"], "elastic training needs -np or --min-np"),
    # horovodrun: --min-np makes the job elastic, and fixed hosts must be at least two
    (None, ["-np", "2", "--min-np", "1"], "on fixed hosts (--min-np with -H/--hostfile) needs at least 2 hosts"),
])
def test_bad_elastic_flags_are_refused(tmp_path, hosts, args, message):
    job = ElasticJob(tmp_path, hosts, WORKER, args)
    assert job.finish(timeout=60) == 2, job.describe()
    assert message in job.text(), job.describe()


def test_elastic_mnist_example_survives_a_killed_worker(tmp_path):
    example = str(WORKERS_DIR.parent.parent / "examples" / "pytorch_mnist_elastic.py")
    # one slot per host: a failure takes its whole host out
    job = ElasticJob(tmp_path, "localhost:1\n127.0.0.2:1\n", example,
                     ["-np", "2", "--min-np", "1", "--elastic-timeout", "60"],
                     script_args=["--epochs", "3", "--checkpoint-dir", tmp_path / "ckpt"])
    job.wait_for(lambda lines: any("epoch 1: train loss" in line for line in lines), timeout=120,
                 what="epoch 1")
    job.kill("127.0.0.2:0")
    assert job.finish(timeout=240) == 0, job.describe()
    text = job.text()
    assert "reset: now 1 rank(s), lr 0.05" in text, job.describe()
    assert re.search(r"epoch 3: .*\d+\.\d+ samples/s", text), "no samples/s bar for epoch 3\n" + job.describe()
    final = [line for line in text.splitlines() if "final test accuracy" in line]
    assert len(final) == 1, job.describe()
    # chance is 0.10 on the ten digit classes
    assert float(final[0].rsplit(" ", 1)[1]) >= 0.75, job.describe()
    assert sorted(p.name for p in (tmp_path / "ckpt").iterdir()) == [f"checkpoint-{e}.pt" for e in (1, 2, 3)]


def test_network_namespace_hosts_join_leave_and_fail(tmp_path):
    require_tools()
    (tmp_path / "netns").mkdir()
    net = NetnsHosts(2, tmp_path / "netns")
    try:
        h1, h2 = net.addrs
        job = _job(tmp_path, f"{LAUNCHER_ADDR}:1\n{h1}:1\n", "-np", "2", "--min-np", "1", "-p", SSH_PORT,
                   "-i", net.key, "--elastic-timeout", "90", "-x", "EPOCHS", "-x", "SAMPLES", "-x", "BATCH",
                   "-x", "STEP_SLEEP", "-x", "FAST_FILE", epochs=3, step_sleep=0.1, **net.ssh_env())
        job.wait_count("COMMIT", 5, timeout=120)
        job.set_hosts(f"{LAUNCHER_ADDR}:1\n{h1}:1\n{h2}:1\n")  # a host joins
        job.wait_count("generation 1: 3 worker(s)", 1, timeout=120)
        job.wait_for(lambda lines: sum("COMMIT" in line for line in lines) >= 15, what="training at 3 ranks")
        job.set_hosts(f"{LAUNCHER_ADDR}:1\n{h2}:1\n")  # a host leaves
        job.wait_count("generation 2: 2 worker(s)", 1, timeout=120)
        job.wait_for(lambda lines: sum("COMMIT" in line for line in lines) >= 25, what="training at 2 ranks")
        # the worker on the remote host is killed there
        workers = [p for p in map(psutil.Process, net.pids(net.names[1])) if "torch_elastic.py" in " ".join(p.cmdline())]
        assert len(workers) == 1, workers
        workers[0].kill()
        job.wait_count("generation 3: 1 worker(s)", 1, timeout=120)
        _full_speed(tmp_path)
        assert job.finish(timeout=180) == 0, job.describe()
        text = job.text()
        assert f"host {h1} no longer offers slot 0" in text, job.describe()
        assert f"worker {h2}:0 was killed by signal SIGKILL; host {h2} blacklisted" in text, job.describe()
        finals = check_training(text, 3, SAMPLES, BATCH, _repeats_allowed(1, 4))
        assert len(finals) == 1
        assert not net.leftovers(), "a worker outlived the job on a simulated host"
    finally:
        net.close()


def test_command_not_found(tmp_path):
    script = tmp_path / "discover.sh"
    script.write_text("#!/bin/sh\necho localhost:1\n")
    script.chmod(0o755)
    result = run_command([*LAUNCHER, "-np", "1", "--host-discovery-script", script, "no-such-command-xyz"],
                         timeout=60)
    assert result.returncode == 127, describe(result)
    assert "roundelrun: error: cannot run no-such-command-xyz: no such file or command" in result.stderr, \
        describe(result)
