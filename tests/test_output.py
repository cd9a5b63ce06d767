"""What people read from ``roundelrun``: progress bars, one-line errors, ``--verbose`` and ``--help``.

A Keras progress bar reaches a terminal live with its rank prefix and
reaches pipes and ``--output-filename`` files as finished lines; a tqdm bar
through a pipe gives one finished line; an operation before ``init()`` gives
one line per rank (the whole traceback with ``--verbose``).
"""

from __future__ import annotations

import importlib.util
import io
import os
import re
import select
import signal
import subprocess
import sys
import termios
import time
from pathlib import Path

import pytest

from launch_util import LAUNCHER, WORKERS_DIR, clean_env, rank_lines, run_command, run_job
from roundel.runner import spawn
from roundel.runner.hosts import SlotInfo
from roundel.runner.redraw import LineAssembler, LivePrefixer

WORKER = WORKERS_DIR / "output_worker.py"
EXAMPLES_DIR = Path(__file__).resolve().parent.parent / "examples"
REDRAW_DEBRIS = (b"\r", b"\x1b", b"\x08")


def _run_in_terminal(command: list, timeout: float) -> tuple[int, list[tuple[float, bytes]]]:
    """Run ``command`` with stdout and stderr on a pseudo-terminal (no newline translation);
    return its exit status and the chunks read, each with the time it arrived."""
    master, slave = os.openpty()
    attrs = termios.tcgetattr(slave)
    attrs[1] &= ~termios.OPOST  # the terminal passes "\n" as it is, not as "\r\n"
    termios.tcsetattr(slave, termios.TCSANOW, attrs)
    proc = subprocess.Popen(command, stdin=subprocess.DEVNULL, stdout=slave, stderr=slave, env=clean_env())
    os.close(slave)
    chunks = []
    deadline = time.monotonic() + timeout
    try:
        while time.monotonic() < deadline:
            ready, _, _ = select.select([master], [], [], 0.5)
            if not ready:
                if proc.poll() is not None:
                    break
                continue
            try:
                data = os.read(master, 65536)
            except OSError:  # EIO: every writer closed the terminal
                break
            if not data:
                break
            chunks.append((time.monotonic(), data))
    finally:
        os.close(master)
        if proc.poll() is None:
            proc.send_signal(signal.SIGTERM)  # roundelrun stops every rank on SIGTERM
        try:
            proc.wait(timeout=20)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
    assert time.monotonic() < deadline, f"timed out after {timeout} s:\n{b''.join(c for _, c in chunks)!r}"
    return proc.returncode, chunks


def _arrival(chunks: list[tuple[float, bytes]], offset: int) -> float:
    """When the byte at ``offset`` of the joined chunks arrived."""
    seen = 0
    for when, data in chunks:
        seen += len(data)
        if offset < seen:
            return when
    raise IndexError(offset)


def test_line_assembler_keeps_the_last_state_of_a_redrawn_line():
    lines = LineAssembler()
    assert lines.feed(b"Epoch 1/2\n\x1b[1m1/5\x1b[0m \xe2\x94\x81 loss: 1.0") == [b"Epoch 1/2\n"]
    assert lines.feed(b"\x08" * 14 + b"\r\x1b[1m5/5\x1b") == []  # an escape code cut in two
    assert lines.feed(b"[0m \xe2\x94\x81 loss: 0.5\n") == ["5/5 ━ loss: 0.5\n".encode()]
    assert lines.feed(b"10%|#   |\r") == [] and lines.feed(b"\n") == [b"10%|#   |\n"]  # "\r\n" split in two
    assert lines.feed(b"half") == [] and lines.flush() == [b"half\n"]


def test_live_prefixer_puts_the_prefix_back_after_each_carriage_return():
    live = LivePrefixer(b"[0]<stdout>:")
    assert live.feed(b"a\n\n\r1/5") == b"[0]<stdout>:a\n[0]<stdout>:\n[0]<stdout>:1/5"
    assert live.feed(b"\r2/5") == b"\r[0]<stdout>:2/5"
    assert live.finish() == b"\n"


@pytest.mark.skipif(importlib.util.find_spec("keras") is None, reason="needs keras (pip install keras)")
def test_keras_progress_bar_is_live_on_a_terminal_and_finished_lines_in_files(tmp_path):
    logs = tmp_path / "logs"
    command = [*LAUNCHER, "-np", "2", "--output-filename", str(logs), sys.executable, str(WORKER), "keras_progress"]
    code, chunks = _run_in_terminal(command, timeout=120)
    shown = b"".join(data for _, data in chunks)
    assert code == 0, shown.decode(errors="replace")
    for epoch in (1, 2):
        start = shown.index(f"[0]<stdout>:Epoch {epoch}/2\n".encode())
        bar_start = shown.index(b"\n", start) + 1
        bar_end = shown.index(b"\n", bar_start)  # the bar's last state ends the epoch's line
        bar = shown[bar_start:bar_end]
        redraws = [i for i in range(len(bar)) if bar.startswith(b"\r[0]<stdout>:", i)]
        assert len(redraws) >= 2, f"epoch {epoch}: {bar!r}"
        early = _arrival(chunks, bar_start + redraws[0])
        finished = _arrival(chunks, bar_end)
        assert finished - early > 0.4, f"epoch {epoch}: the updates arrived together at its end: {bar!r}"
    written = (logs / "rank.0" / "stdout").read_bytes()
    assert not any(debris in written for debris in REDRAW_DEBRIS), written
    bars = [line for line in written.decode().splitlines() if "5/5" in line]
    assert len(bars) == 2 and all("loss" in line for line in bars), written
    assert b"FIT DONE" in (logs / "rank.1" / "stdout").read_bytes()


@pytest.mark.skipif(importlib.util.find_spec("tqdm") is None, reason="needs tqdm (pip install tqdm)")
def test_tqdm_bar_through_a_pipe_gives_finished_lines_only(tmp_path):
    logs = tmp_path / "logs"
    command = [*LAUNCHER, "-np", "2", "--output-filename", str(logs), sys.executable, str(WORKER), "tqdm"]
    result = subprocess.run(command, stdin=subprocess.DEVNULL, capture_output=True, env=clean_env(), timeout=60)
    assert result.returncode == 0, result.stderr.decode(errors="replace")
    assert not any(debris in result.stderr for debris in REDRAW_DEBRIS), result.stderr
    for rank in (0, 1):
        bars = rank_lines(result.stderr.decode(), rank, "stderr")
        assert len(bars) == 1 and f"rank {rank}" in bars[0] and "100%" in bars[0] and "20/20" in bars[0], bars
        written = (logs / f"rank.{rank}" / "stderr").read_bytes()
        assert written.decode() == bars[0] + "\n"


@pytest.mark.skipif(importlib.util.find_spec("tqdm") is None, reason="needs tqdm (pip install tqdm)")
def test_ranks_are_told_of_a_terminal_and_the_examples_bar_draws_live():
    code = ("import os, sys, time; sys.path.insert(0, %r); from progress_bar import sample_bar; "
            "print('terminal', os.environ.get('ROUNDEL_TERMINAL'), flush=True); bar = sample_bar(3, 'x', 0)\n"
            "for _ in range(3): time.sleep(0.3); bar.update(1)\nbar.close()" % str(EXAMPLES_DIR))
    status, chunks = _run_in_terminal([*LAUNCHER, "-np", "1", sys.executable, "-c", code], timeout=60)
    shown = b"".join(data for _, data in chunks)
    assert status == 0 and b"[0]<stdout>:terminal 1\n" in shown, shown
    assert shown.count(b"\r[0]<stderr>:") >= 2, shown  # redrawn in place, live
    piped = run_command([*LAUNCHER, "-np", "1", sys.executable, "-c", code], timeout=60)
    assert piped.returncode == 0 and "[0]<stdout>:terminal None" in piped.stdout, piped.stderr
    assert "\r" not in piped.stderr and "100%" in rank_lines(piped.stderr, 0, "stderr")[-1], piped.stderr


def test_ranks_filter_shows_some_ranks_and_the_hidden_failing_ranks_last_lines(tmp_path):
    # rank 1 gives up once the others have printed (each marks it with a file), so that their lines are
    # out before the launcher stops them
    code = ("import os, sys, time; r = os.environ['ROUNDEL_RANK']; print('out', r, flush=True)\n"
            "open(os.path.join(sys.argv[1], r), 'w').close()\n"
            "if r == '1':\n"
            "    while not all(os.path.exists(os.path.join(sys.argv[1], x)) for x in '02'): time.sleep(0.01)\n"
            "    time.sleep(0.5)\n"
            "    sys.exit('rank 1 gives up')\n"
            "time.sleep(60)")
    result = run_command([*LAUNCHER, "-np", "3", "--ranks-filter", "0,2", sys.executable, "-c", code, tmp_path],
                         timeout=90)
    assert result.returncode == 1
    assert sorted(result.stdout.splitlines()) == ["[0]<stdout>:out 0", "[2]<stdout>:out 2"], result.stdout
    assert result.stderr.splitlines()[-3:] == [
        "roundelrun: the last lines of rank 1's stderr (hidden by --ranks-filter):",
        "[1]<stderr>:rank 1 gives up",
        "roundelrun: rank 1 (host localhost) exited with code 1; stopped the other ranks"], result.stderr
    bad = run_command([*LAUNCHER, "-np", "2", "--ranks-filter", "0,2", "true"], timeout=30)
    assert bad.returncode == 2 and "--ranks-filter names rank 2, but -np 2 has ranks 0 to 1" in bad.stderr


def test_op_before_init_prints_one_line_per_rank(tmp_path):
    result = run_job(2, WORKER, "before_init", env={"BEFORE_INIT_MEETING": str(tmp_path)}, timeout=60)
    assert result.returncode != 0
    for rank in (0, 1):
        lines = rank_lines(result.stdout + result.stderr, rank)
        assert len(lines) == 1, result.stderr
        assert lines[0].startswith("roundel: NotInitializedError: roundel has not been initialized"), lines
        assert "output_worker.py" in lines[0] and "train_step" in lines[0], lines


def test_verbose_shows_the_traceback_and_each_start(tmp_path):
    result = run_job(2, WORKER, "before_init", launcher_args=["--verbose"], env={"BEFORE_INIT_MEETING": str(tmp_path)},
                     timeout=60)
    assert result.returncode != 0
    for rank in (0, 1):
        assert f"roundelrun: started rank {rank} on localhost (watchdog pid " in result.stderr
        lines = rank_lines(result.stderr, rank, "stderr")
        assert "Traceback (most recent call last):" in lines, result.stderr
        assert any("roundel/common/basics.py" in line for line in lines), result.stderr
        assert lines[-1].startswith("roundel.errors.NotInitializedError: "), result.stderr


INIT_AND_SHUTDOWN = "import roundel.torch as hvd; hvd.init(); hvd.shutdown()"


def _launcher_lines(stderr: str) -> list[str]:
    return [line for line in stderr.splitlines() if line.startswith("roundelrun: ")]


def test_verbose_reports_rendezvous_starts_and_joins_in_order():
    code = "import os; print(os.getppid(), flush=True); " + INIT_AND_SHUTDOWN
    result = run_command([*LAUNCHER, "--verbose", "-np", "2", sys.executable, "-c", code], timeout=60)
    assert result.returncode == 0, result.stderr
    lines = _launcher_lines(result.stderr)

    def where(prefix: str) -> int:
        found = [i for i, line in enumerate(lines) if line.startswith(prefix)]
        assert len(found) == 1, f"{prefix!r} found {len(found)} times in:\n" + "\n".join(lines)
        return found[0]

    listening = where("roundelrun: rendezvous server at 127.0.0.1:")
    assert "secret" not in lines[listening].lower() and lines[listening].rsplit(":", 1)[1].isdigit(), lines[listening]
    for rank in (0, 1):
        started = where(f"roundelrun: started rank {rank} on localhost (watchdog pid ")
        watchdog = lines[started].rsplit("pid ", 1)[1].rstrip(")")
        assert rank_lines(result.stdout, rank, "stdout") == [watchdog], result.stdout  # the rank's parent
        joined = where(f"roundelrun: rank {rank} joined the rendezvous from ")
        assert re.search(r"\(pid \d+\)$", lines[joined]) and not lines[joined].endswith(f"(pid {watchdog})"), \
            (lines[started], lines[joined])
        assert listening < started < joined, lines
    assert where("roundelrun: all 2 rank(s) joined") == len(lines) - 1, lines


def test_verbose_shows_the_rendezvous_servers_own_log():
    # a connection that does not speak the store's protocol is dropped, which the server logs at debug
    # level; --verbose used to attach its handler to a logger the server does not log to
    code = ("import os, socket, time; s = socket.create_connection((os.environ['ROUNDEL_RENDEZVOUS_ADDR'], "
            "int(os.environ['ROUNDEL_RENDEZVOUS_PORT']))); s.sendall(b'not the protocol' * 64); s.close(); "
            "time.sleep(1)")
    result = run_command([*LAUNCHER, "--verbose", "-np", "1", sys.executable, "-c", code], timeout=60)
    assert result.returncode == 0, result.stderr
    assert any(line.startswith("roundelrun: rendezvous: dropped 127.0.0.1:") for line in _launcher_lines(
        result.stderr)), result.stderr


def test_the_launchers_own_lines_never_land_inside_a_ranks_line(tmp_path, monkeypatch):
    """They come from other threads than the one relaying a rank's stderr (``--verbose``'s joins: the store's)."""
    unbuffered = open(tmp_path / "stderr", "wb", buffering=0)  # the launcher's stderr under PYTHONUNBUFFERED
    monkeypatch.setattr(sys, "stderr", io.TextIOWrapper(unbuffered, write_through=True))
    chatter = "import sys\nfor i in range(20000): sys.stderr.write(f'rank line {i}\\n'); sys.stderr.flush()"
    worker = spawn.start_local(SlotInfo("localhost", 0, 1, 0, 1, 0, 1), [sys.executable, "-c", chatter], {})
    said = 0
    while worker.process.poll() is None or said < 2000:
        spawn.say(f"roundelrun: launcher line {said}")
        said += 1
    assert worker.wait() == 0
    worker.join_output(10)
    monkeypatch.undo()  # the real stderr back before its stand-in's file closes
    unbuffered.close()
    lines = (tmp_path / "stderr").read_text().splitlines()
    mixed = [line for line in lines
             if not re.fullmatch(r"roundelrun: launcher line \d+|\[0\]<stderr>:rank line \d+", line)]
    assert not mixed, mixed[:5]
    assert len(lines) == said + 20000


def test_without_verbose_the_launcher_reports_nothing():
    result = run_command([*LAUNCHER, "-np", "2", sys.executable, "-c", INIT_AND_SHUTDOWN], timeout=60)
    assert result.returncode == 0, result.stderr
    assert _launcher_lines(result.stderr) == [], result.stderr
    assert "joined" not in result.stderr and "rendezvous server" not in result.stderr, result.stderr


def test_help_ends_with_usage_examples():
    result = run_command([*LAUNCHER, "--help"], timeout=30)
    assert result.returncode == 0
    examples = result.stdout[result.stdout.rindex("examples:"):]
    assert "roundelrun -np 4 python train.py" in examples and "--verbose" in examples
