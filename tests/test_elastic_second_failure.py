"""A second worker failure while the survivors of a first one form the next generation.

Real clusters lose nodes in bursts (a switch, a rack, a preemption wave).
Each test kills a worker, then kills a worker on another host the moment
the launcher prints the next ``generation N`` line: the survivors are then
inside that generation's setup (the store, Gloo's connections, rank 0's
coordinator), waiting for a peer that will never come. Every survivor must
leave that generation at once and join the next, which forms within 2 s of
the second kill; training ends with nothing lost (``check_training``).
"""

from __future__ import annotations

import os
import signal
import time

from elastic_util import ElasticJob, check_training
from launch_util import WORKERS_DIR

WORKER = str(WORKERS_DIR / "torch_elastic.py")
SAMPLES, BATCH = 96, 4
RECOVERY_S = 2.0


def _job(tmp_path, hosts, *launcher_args, **env):
    env = {"EPOCHS": 1000, "SAMPLES": SAMPLES, "BATCH": BATCH, "STEP_SLEEP": 0.1, "STOP_FILE": tmp_path / "stop",
           "FAST_FILE": tmp_path / "fast", **env}
    return ElasticJob(tmp_path, hosts, WORKER, ["--elastic-timeout", "60", *launcher_args], env)


def _kill_on(job: ElasticJob, line: str, label: str) -> dict:
    """SIGKILL worker ``label`` as soon as the launcher prints ``line``; the dict gets the time of the kill."""
    pid = job.pid(label)
    killed: dict = {}

    def kill():
        os.kill(pid, signal.SIGKILL)
        killed["at"] = time.monotonic()

    job.when(line, kill)
    return killed


def _commits_after(job: ElasticJob, after: float) -> int:
    return sum(1 for t, line in list(job.lines) if t > after and "COMMIT" in line)


def _recovers_and_finishes(tmp_path, job: ElasticJob, killed: dict, generation: str, generations: int) -> str:
    """Assert that ``generation`` (the launcher's line for the generation after the second kill) formed
    within RECOVERY_S of that kill, that training went on and ended with nothing lost; return the output."""
    job.wait_count(generation, 1, timeout=90)
    assert "at" in killed, f"the second kill never happened\n{job.describe()}"
    seconds = job.time_of(generation) - killed["at"]
    print(f"the generation after the second kill formed {seconds:.2f} s after it")
    job.wait_for(lambda lines: _commits_after(job, killed["at"]) >= 3, timeout=60, what="training after the kills")
    (tmp_path / "stop").touch()  # ends after this epoch, which need not pause between steps
    (tmp_path / "fast").touch()
    assert job.finish(timeout=120) == 0, job.describe()
    assert seconds < RECOVERY_S, f"the next generation formed {seconds:.2f} s after the second kill\n{job.describe()}"
    text = job.text()
    check_training(text, None, SAMPLES, BATCH, 2 * 2 * BATCH * 3 + generations * 3)
    return text


def test_second_failure_on_another_host_while_the_next_generation_forms(tmp_path):
    job = _job(tmp_path, "127.0.0.2:2\n127.0.0.3:2\n127.0.0.4:2\n", "-np", "6", "--min-np", "2")
    job.wait_count("COMMIT", 3, timeout=120)
    killed = _kill_on(job, "generation 1:", "127.0.0.3:0")
    job.kill("127.0.0.2:0")
    text = _recovers_and_finishes(tmp_path, job, killed,
                                  "generation 2: 2 worker(s), ranks 127.0.0.4:0=0, 127.0.0.4:1=1", generations=3)
    assert "generation 1: 4 worker(s)" in text, job.describe()
    assert "worker 127.0.0.3:0 was killed by signal SIGKILL; host 127.0.0.3 blacklisted" in text, job.describe()


def test_second_failure_among_workers_of_a_host_that_came_back(tmp_path):
    # 2 hosts: the first kill blacklists host .2 for a second; when it comes back, one of its new workers dies
    # as the generation that takes them in forms: the workers of host .3 must go on alone
    job = _job(tmp_path, "127.0.0.2:2\n127.0.0.3:2\n", "-np", "4", "--min-np", "2",
               "--blacklist-cooldown-range", "1", "1")
    job.wait_count("COMMIT", 3, timeout=120)
    job.kill("127.0.0.2:0")
    job.wait_count("generation 1: 2 worker(s)", 1, timeout=60)
    job.wait_count("started worker 127.0.0.2:0", 2, timeout=60)  # host .2 is back after its cooldown
    killed = _kill_on(job, "generation 2:", "127.0.0.2:0")
    text = _recovers_and_finishes(tmp_path, job, killed,
                                  "generation 3: 2 worker(s), ranks 127.0.0.3:0=0, 127.0.0.3:1=1", generations=6)
    assert "generation 2: 4 worker(s)" in text, job.describe()
