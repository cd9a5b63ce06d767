"""The straggler report: rank 0 names the rank that holds the others back, and nobody in a balanced job.

Real 3-rank jobs under ``roundelrun``: in one, rank 2 sleeps 50 ms before each
step's allreduce; it must be named, live and in the end-of-job table, with a
lag within 20 % of 50 ms. In a balanced job nobody is named. The tracker's
arithmetic is also checked on its own.
"""

import re
import subprocess
import sys

from launch_util import LAUNCHER, clean_env, describe, run_job
from roundel.common.engine.stragglers import WINDOW, StragglerTracker

WORKER = "torch_stragglers.py"


def test_a_rank_sleeping_50_ms_a_step_is_named_with_its_lag_live_and_at_the_end():
    result = run_job(3, WORKER, WINDOW + 40, 2, launcher_args=["--straggler-report"], timeout=240)
    assert result.returncode == 0, describe(result)
    report = re.search(r"straggler report \((\d+) cycles\): rank 2 \(host [^)]+\) was last in (\d+)% of them, "
                       r"([\d.]+) ms behind the median", result.stderr)
    assert report, describe(result)
    assert int(report.group(2)) >= 80 and 40.0 <= float(report.group(3)) <= 60.0, report.group(0)
    live = re.search(r"roundel straggler: rank 2 \(host [^)]+\) submitted last in (\d+)% of the last "
                     rf"{WINDOW} cycles, (\d+) ms behind the median", result.stderr)
    assert live and 40 <= int(live.group(2)) <= 60, describe(result)


def test_a_balanced_job_names_nobody():
    result = run_job(3, WORKER, 60, -1, launcher_args=["--straggler-report"], timeout=240)
    assert result.returncode == 0, describe(result)
    assert "no rank held the others back" in result.stderr and "roundel straggler:" not in result.stderr, \
        describe(result)


def test_a_short_job_prints_no_table_unless_asked():
    result = run_job(2, WORKER, 5, 1, timeout=120)
    assert result.returncode == 0 and "straggler report" not in result.stderr, describe(result)


LAST_LINES = """
import sys
import torch
import roundel.torch as hvd
hvd.init()
rank = hvd.rank()
for step in range(5):
    hvd.allreduce(torch.ones(4), name="grad")
hvd.shutdown()  # rank 0 makes the report here
print("LAST LINE of rank", rank, flush=True)
print("LAST STDERR LINE", file=sys.stderr, flush=True)
"""


def test_the_report_comes_after_every_ranks_last_lines_in_a_piped_log(tmp_path):
    script = tmp_path / "last_lines.py"
    script.write_text(LAST_LINES)
    command = [*LAUNCHER, "--straggler-report", "-np", "2", sys.executable, str(script)]
    for _ in range(2):
        job = subprocess.run(command, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, timeout=120,
                             env=clean_env())  # one pipe, as `roundelrun ... 2>&1 | cat`
        log = job.stdout.splitlines()
        assert job.returncode == 0, job.stdout
        report = [i for i, line in enumerate(log) if "straggler report (" in line]
        last = [i for i, line in enumerate(log) if "LAST LINE" in line or "LAST STDERR LINE" in line]
        assert len(report) == 1 and len(last) == 4 and report[0] > max(last), job.stdout


def test_the_tracker_takes_the_last_rank_and_its_lag_behind_the_median():
    tracker = StragglerTracker(4)
    for step in range(10):
        for rank, at in ((0, 0.0), (1, 0.001), (2, 0.002), (3, 0.030 + step * 0.001)):
            tracker.arrived(rank, step + at)
        tracker.cycle(range(4))
    [(rank, share, lag)] = tracker.stragglers()
    assert rank == 3 and share == 1.0 and abs(lag - 0.0335) < 1e-9  # behind rank 1, the lower middle of 4
    assert tracker.stragglers(recent=True) == []  # the live warning needs a full window
    assert tracker.report({3: "h3"})[0].startswith("roundel straggler report (10 cycles): rank 3 (host h3)")
