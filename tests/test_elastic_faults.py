"""Elastic jobs that meet the faults that used to lose state or hang them.

Local "hosts" are loopback aliases (127.0.0.2, 127.0.0.3, ...: each its own
host to the driver, so a failure blacklists only that one). Every training
run is checked with ``check_training`` (epochs completed, identical
parameters, committed step only forward, every sample covered, every
restart resumed from committed weights, an unnamed allgather after
training agreeing on every rank); once a fault has been handled, training
runs on without its pause between steps. The last test runs tests/elastic_faults.py
in short: one run of each fault on network-namespace hosts (a worker
SIGKILLed, a worker SIGSTOPped, a host added then one removed), with a
random victim each time.
"""

from __future__ import annotations

import sys

from elastic_util import ElasticJob, check_training, records
from launch_util import LAUNCHER, TESTS_DIR, WORKERS_DIR, describe, run_command
from netns_util import require_tools

WORKER = str(WORKERS_DIR / "torch_elastic.py")
SAMPLES, BATCH = 96, 4


def _job(tmp_path, hosts, *launcher_args, epochs=2, step_sleep=0.1, **env):
    env = {"EPOCHS": epochs, "SAMPLES": SAMPLES, "BATCH": BATCH, "STEP_SLEEP": step_sleep,
           "FAST_FILE": tmp_path / "fast", **env}
    return ElasticJob(tmp_path, hosts, WORKER, launcher_args, env)


def _full_speed(tmp_path) -> None:
    """The fault has been handled: the rest of the training need not pause between steps."""
    (tmp_path / "fast").touch()


def _repeats_allowed(failures: int, generations: int, largest: int = 3) -> int:
    return failures * 2 * BATCH * largest + generations * largest


def test_newcomer_keeps_the_committed_weights_when_every_old_worker_dies(tmp_path):
    # two old workers on 127.0.0.2; a newcomer on 127.0.0.3 joins, and one old worker is killed after it
    # synced and before it ever committed, which takes its host, so both old workers, out (as Horovod):
    # the newcomer must go on from the committed weights, not its random ones
    job = _job(tmp_path, "127.0.0.2:2\n", "-np", "2", "--min-np", "1", "--elastic-timeout", "60",
               step_sleep=0.4, COMMIT_EVERY=5)
    job.wait_count("COMMIT", 2)
    job.set_hosts("127.0.0.2:2\n127.0.0.3:1\n")
    job.wait_for(lambda lines: any(line.startswith("[127.0.0.3:0]<stdout>:START") for line in lines),
                 what="the newcomer's first start")
    job.kill("127.0.0.2:0")
    job.wait_count("generation 2: 1 worker(s)", 1)
    _full_speed(tmp_path)
    assert job.finish(timeout=120) == 0, job.describe()
    text = job.text()
    newcomer_starts = [r for who, r in records(text, "START") if who == "127.0.0.3:0"]
    assert [r["size"] for r in newcomer_starts] == [3, 1], newcomer_starts
    assert newcomer_starts[0]["step"] == newcomer_starts[1]["step"], "the newcomer committed before the kill"
    assert newcomer_starts[1]["params"] == newcomer_starts[0]["params"], "the newcomer lost the committed weights"
    assert "worker 127.0.0.2:1 stopped: its host 127.0.0.2 is blacklisted" in text, job.describe()
    finals = check_training(text, 2, SAMPLES, BATCH, _repeats_allowed(2, 3))
    assert len(finals) == 1


def test_workers_that_never_call_init_end_the_job(tmp_path):
    script = tmp_path / "discover.sh"
    script.write_text("#!/bin/sh\necho localhost:2\n")
    script.chmod(0o755)
    result = run_command([*LAUNCHER, "-np", "1", "--min-np", "1", "--max-np", "2", "--host-discovery-script",
                          script, "python", "-c", "print('ok')"], timeout=30)
    assert result.returncode == 0, describe(result)
    assert result.stdout.count("ok") == 2, describe(result)


def test_unnamed_allgather_after_a_kill_and_a_join(tmp_path):
    # a rank is killed in epoch 1, then a host joins; after training, an unnamed allgather on survivors
    # and newcomers alike must agree (the unnamed counter restarts at every init)
    job = _job(tmp_path, "127.0.0.2:1\n127.0.0.3:1\n127.0.0.4:1\n", "-np", "3", "--min-np", "2",
               "--elastic-timeout", "60", epochs=3)
    job.wait_for(lambda lines: any('"epoch": 1' in line and line.split("<")[0] == "[127.0.0.3:0]"
                                   for line in lines), what="epoch 1")
    job.kill("127.0.0.3:0")
    job.wait_count("generation 1: 2 worker(s)", 1)
    job.wait_count("COMMIT", sum("COMMIT" in line for line in job.output()) + 2)
    job.set_hosts("127.0.0.2:1\n127.0.0.3:1\n127.0.0.4:1\n127.0.0.5:1\n")
    job.wait_count("generation 2: 3 worker(s)", 1)
    _full_speed(tmp_path)
    assert job.finish(timeout=120) == 0, job.describe()
    finals = check_training(job.text(), 3, SAMPLES, BATCH, _repeats_allowed(1, 3))
    assert len(finals) == 3 and all(r["gathered"] == [0, 1, 2] for r in finals), finals


def test_a_worker_reported_lost_that_exits_by_itself_reports_its_own_status(tmp_path):
    # as test_a_worker_reported_lost_is_killed_and_the_job_goes_on, but the last rank exits with status 1
    # 0.3 s after rank 0 reported it lost: within the grace, so it is not killed and its own status is named
    job = _job(tmp_path, "127.0.0.2:1\n127.0.0.3:1\n", "-np", "2", "--min-np", "1", "--elastic-timeout", "60",
               LOST_AT_STEP=4, LOST_EXITS=1)
    job.wait_count("generation 1: 1 worker(s)", 1, timeout=60)
    _full_speed(tmp_path)
    assert job.finish(timeout=120) == 0, job.describe()
    text = job.text()
    assert "EXITING 1" in text and "killing it" not in text, job.describe()
    assert "worker 127.0.0.3:0 exited with code 1; host 127.0.0.3 blacklisted" in text, job.describe()


def test_a_worker_reported_lost_is_killed_and_the_job_goes_on(tmp_path):
    # the last rank SIGSTOPs itself and rank 0 writes gen0/lost/<rank>, as a heartbeat check does;
    # the driver must SIGKILL it (a stopped process ignores SIGTERM), blacklist its host and go on
    job = _job(tmp_path, "127.0.0.2:1\n127.0.0.3:1\n", "-np", "2", "--min-np", "1", "--elastic-timeout", "60",
               LOST_AT_STEP=4)
    job.wait_count("STOPPING 1", 1)
    job.wait_count("generation 1: 1 worker(s)", 1, timeout=60)
    _full_speed(tmp_path)
    assert job.finish(timeout=120) == 0, job.describe()
    text = job.text()
    assert "worker 127.0.0.3:0: rank 1 (host test) was lost: no heartbeat for 0 s (faked by the test); " \
           "killing it" in text, job.describe()
    assert "worker 127.0.0.3:0 was killed by signal SIGKILL; host 127.0.0.3 blacklisted" in text, job.describe()
    finals = check_training(text, 2, SAMPLES, BATCH, _repeats_allowed(1, 2))
    assert len(finals) == 1


def test_fault_injection_script_one_run_of_each_fault():
    require_tools()
    result = run_command([sys.executable, str(TESTS_DIR / "elastic_faults.py"), "--runs", "1"], timeout=600)
    assert result.returncode == 0, describe(result)
    for fault in ("kill", "stop", "hosts"):
        assert f"{fault}: 1/1 passed" in result.stdout, describe(result)
