"""The timeline (HOROVOD_TIMELINE, --timeline-filename, start_timeline/stop_timeline) and its reader.

Real 2-rank jobs under roundelrun write the file; the checks read it as
Chrome-trace JSON: a row per tensor name, Horovod's phase names in order per
step, each rank's arrival inside the negotiation, CYCLE_START markers when
asked, a readable file after SIGKILL, and ``python -m roundel.timeline
summarize`` printing its tables and a PNG.
"""

from __future__ import annotations

import importlib.util
import json
import shutil
import subprocess
import sys
from collections import defaultdict

import pytest

from launch_util import assert_checks_passed, describe, run_job
from roundel.timeline import load

ENV = {"HOROVOD_STALL_CHECK_DISABLE": "1"}
# the job runs on one host: allgather, broadcast and allreduce go through shared memory
# rows are named as in Horovod: the op kind, a dot, the tensor's name
KINDS = {"allgather.gather": ("NEGOTIATE_ALLGATHER", "ALLGATHER", "SHM_ALLGATHER"),
         "broadcast.bcast": ("NEGOTIATE_BROADCAST", "BROADCAST", "SHM_BCAST"),
         "alltoall.a2a": ("NEGOTIATE_ALLTOALL", "ALLTOALL", "GLOO_ALLTOALL"),
         "reducescatter.rs": ("NEGOTIATE_REDUCESCATTER", "REDUCESCATTER", "SHM_REDUCESCATTER")}
GRADS = ("allreduce.grad.a", "allreduce.grad.b", "allreduce.grad.late")
STEPS = 3


def _rows(events: list) -> dict:
    """tensor name -> its events, from the process_name metadata."""
    names = {e["pid"]: e["args"]["name"] for e in events
             if e.get("ph") == "M" and e.get("name") == "process_name" and e["pid"]}
    rows = defaultdict(list)
    for event in events:
        if event.get("ph") != "M" and event.get("pid") in names:
            rows[names[event["pid"]]].append(event)
    return rows


def _spans(row: list, tid: int) -> list:
    """The top-level spans of one track: [(name, begin ts, end ts, [(child name, begin ts)], [arrival events])]."""
    spans, stack = [], []
    for event in row:
        if event.get("tid") != tid:
            continue
        if event["ph"] == "B":
            if stack:
                stack[0][3].append((event["name"], event["ts"]))
            else:
                stack.append([event["name"], event["ts"], None, [], []])
                continue
            stack.append(None)
        elif event["ph"] == "E":
            top = stack.pop()
            if top is not None:
                top[2] = event["ts"]
                spans.append(tuple(top))
        elif event["ph"] == "X":
            stack[0][4].append(event)
    assert not stack, f"unbalanced B/E events on track {tid}: {stack}"
    return spans


@pytest.fixture(scope="module")
def steps_timeline(tmp_path_factory):
    directory = tmp_path_factory.mktemp("timeline")
    path = directory / "timeline.json"
    result = run_job(2, "torch_timeline.py", "steps", directory, env=ENV, timeout=90,
                     launcher_args=["--timeline-filename", path, "--timeline-mark-cycles"])
    assert_checks_passed(result, 2, "steps")
    return path


def test_timeline_file_has_a_row_per_name_and_horovods_phases_in_order(steps_timeline):
    events = json.loads(steps_timeline.read_text())  # complete JSON: the array was closed at shutdown
    rows = _rows(events)
    expected = {*GRADS, *KINDS, "allreduce.noname.1", "allreduce.noname.2", "allreduce.noname.3"}
    assert expected <= set(rows), sorted(rows)
    for name in (*GRADS, *KINDS):
        # grad.a and the small grad.b (an Average) go through shared memory; grad.late (a Max) is reduced by the
        # coordinator
        reduced_by = "COORDINATOR_ALLREDUCE" if name == "allreduce.grad.late" else "SHM_ALLREDUCE"
        negotiate_op, op, transport = KINDS.get(name, ("NEGOTIATE_ALLREDUCE", "ALLREDUCE", reduced_by))
        negotiations, executions = _spans(rows[name], 1), _spans(rows[name], 2)
        # from the third step on, the replayed schedule may run an allreduce (sum or average), a broadcast or an
        # allgather without negotiating it: those come last, after every negotiated one
        replayable = name in ("allreduce.grad.a", "allreduce.grad.b", "broadcast.bcast", "allgather.gather")
        assert len(executions) == STEPS, (name, executions)
        assert STEPS - 1 <= len(negotiations) <= STEPS if replayable else len(negotiations) == STEPS, negotiations
        for index, execution in enumerate(executions):
            assert execution[0] == op, (name, execution)
            if index < len(negotiations):
                negotiation = negotiations[index]
                assert negotiation[0] == negotiate_op, (name, negotiation)
                assert negotiation[1] <= negotiation[2] <= execution[1] <= execution[2], (name, negotiation, execution)
                assert sorted(e["name"] for e in negotiation[4]) == ["0", "1"], negotiation
                assert all(negotiation[1] <= e["ts"] <= negotiation[2] for e in negotiation[4]), negotiation
            else:
                assert negotiations[-1][2] <= execution[1] <= execution[2], (name, negotiations, execution)
                if name == "broadcast.bcast":  # a small replayed broadcast travels in the slot's allgather of rows
                    transport = "SHM_ALLGATHER"
            activities = [child for child, _ in execution[3]]
            assert activities[0] == "QUEUE" and transport in activities, (name, activities)
            assert [a for a in activities if a in ("QUEUE", "MEMCPY_IN_FUSION_BUFFER", transport,
                                                   "MEMCPY_OUT_FUSION_BUFFER")] == activities, activities
            order = {a: i for i, a in enumerate(activities)}
            assert order.get("MEMCPY_IN_FUSION_BUFFER", 0) < order[transport] < \
                order.get("MEMCPY_OUT_FUSION_BUFFER", len(activities)), activities
    for negotiation in _spans(rows["allreduce.grad.late"], 1):  # rank 1 sleeps 50 ms before submitting it
        arrival = {e["name"]: e["ts"] for e in negotiation[4]}
        assert arrival["1"] - arrival["0"] >= 20_000, negotiation
    assert any(e.get("ph") == "i" and e.get("name") == "CYCLE_START" for e in events)


@pytest.mark.skipif(importlib.util.find_spec("matplotlib") is None,
                    reason="matplotlib is not installed (pip install roundel[test]); the PNG needs it")
def test_summarize_prints_phases_and_slowest_ranks_and_writes_a_png(steps_timeline, tmp_path):
    png = tmp_path / "steps.png"
    result = subprocess.run([sys.executable, "-m", "roundel.timeline", "summarize", str(steps_timeline),
                             "--png", str(png)], capture_output=True, text=True, timeout=60)
    assert result.returncode == 0, describe(result)
    out = result.stdout
    for text in ("allreduce.grad.late", "NEGOTIATE_ALLREDUCE", "SHM_ALLREDUCE", "GLOO_ALLTOALL", "QUEUE", "total ms", "mean ms",
                 "slowest ranks to submit", "last in", "lag when last ms"):
        assert text in out, out
    ranks_table = out.split("slowest ranks to submit")[1].splitlines()[2:]
    assert ranks_table[0].split()[0] == "1", out  # rank 1 is late every step on 'grad.late'
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_horovods_timeline_test(tmp_path):
    # Horovod's test_timeline: HOROVOD_TIMELINE set in the script before init(); 0.1 s after an allreduce
    # named 'test_allreduce', rank 0 finds its row 'allreduce.test_allreduce' and the phases in the file
    result = run_job(2, "torch_timeline.py", "horovod", tmp_path, env=ENV, timeout=60)
    assert_checks_passed(result, 2, "horovod")


def test_start_and_stop_timeline_at_run_time(tmp_path):
    result = run_job(2, "torch_timeline.py", "dynamic", tmp_path, env=ENV, timeout=90)
    assert_checks_passed(result, 2, "dynamic")
    assert not (tmp_path / "early.json").exists()
    events = json.loads((tmp_path / "dynamic.json").read_text())
    rows = _rows(events)
    for name in ("allreduce.grad.a", "allreduce.grad.late", *KINDS):  # step 1 only: started after step 0, stopped before step 2
        assert len(_spans(rows[name], 2)) == 1, (name, rows[name])
    assert any(e.get("name") == "CYCLE_START" for e in events)


def test_init_after_shutdown_continues_the_same_file(tmp_path):
    path = tmp_path / "reinit.json"
    result = run_job(2, "torch_timeline.py", "reinit", tmp_path, env={**ENV, "HOROVOD_TIMELINE": path},
                     timeout=90)
    assert_checks_passed(result, 2, "reinit")
    rows = _rows(json.loads(path.read_text()))
    for name in ("allreduce.grad.a", "allreduce.grad.late", *KINDS):
        executions = _spans(rows[name], 2)
        assert len(executions) == 2 and executions[0][2] < executions[1][1], (name, executions)


def test_a_killed_job_leaves_a_timeline_that_load_reads(tmp_path):
    path = tmp_path / "killed.json"
    result = run_job(2, "torch_timeline.py", "kill", tmp_path, env={**ENV, "HOROVOD_TIMELINE": path},
                     timeout=90)
    assert result.returncode != 0, describe(result)
    text = path.read_text()
    assert not text.rstrip().endswith("]")
    with pytest.raises(json.JSONDecodeError):
        json.loads(text)
    events = load(str(path))
    rows = _rows(events)
    assert len(_spans(rows["allreduce.grad.a"], 2)) >= 5, rows["allreduce.grad.a"][-6:]
    cut = tmp_path / "cut.json"  # a writer killed in the middle of a line
    shutil.copy(path, cut)
    with open(cut, "a") as f:
        f.write('{"ph": "B", "ts": 12')
    assert load(str(cut)) == events
