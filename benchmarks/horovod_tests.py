"""Run one of Horovod's own test files against roundel, each test in its own ``roundelrun`` job.

    python benchmarks/horovod_tests.py PATH/TO/horovod/test/parallel/test_tensorflow.py [-np 2] [-k WORD]

Horovod's file is used as it is (fetch Horovod's repository yourself; it is
not part of roundel): ``tests/horovod_alias`` goes on the ranks' PYTHONPATH,
so its ``import horovod.tensorflow as hvd`` gives ``roundel.tensorflow``.
Each test runs as ``roundelrun -np N python -m pytest FILE::CLASS::TEST``;
a test passes when every rank's pytest passed it (skipped when every rank
skipped it), and fails otherwise, also on a timeout. Prints one line a test
and the counts; ``--log-dir`` keeps each failure's output, ``--json`` the
results. Not part of the test suite: a whole file takes tens of minutes.
"""

from __future__ import annotations

import argparse
import ast
import json
import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
ALIAS = REPO / "tests" / "horovod_alias"
_SUMMARY = re.compile(r"\b(\d+) (passed|failed|skipped|error|errors)\b")
_PREFIX = re.compile(r"^\[\d+\]<std(?:out|err)>:")
_FINAL = re.compile(r"^\d+ \w+.* in [\d.]+s")


def test_ids(path: Path, keyword: str | None) -> list[str]:
    """``CLASS::TEST`` for every test method of the file's test classes, in file order."""
    tree = ast.parse(path.read_text())
    ids = []
    for node in tree.body:
        if isinstance(node, ast.ClassDef):
            for item in node.body:
                if isinstance(item, ast.FunctionDef) and item.name.startswith("test"):
                    if keyword is None or keyword in item.name:
                        ids.append(f"{node.name}::{item.name}")
    return ids


def outcome(returncode: int, output: str, ranks: int) -> str:
    """passed, skipped or failed, from the ranks' pytest summary lines (one per rank)."""
    counts = {"passed": 0, "failed": 0, "skipped": 0, "error": 0}
    for line in output.splitlines():
        line = _PREFIX.sub("", line).strip(" =")
        if _FINAL.match(line):
            for number, word in _SUMMARY.findall(line):
                counts["error" if word.startswith("error") else word] += int(number)
    if returncode != 0 or counts["failed"] or counts["error"]:
        return "failed"
    if counts["skipped"] >= ranks and not counts["passed"]:
        return "skipped"
    return "passed" if counts["passed"] >= ranks else "failed"


def run_one(path: Path, test: str, ranks: int, timeout: float) -> tuple[str, str, float]:
    env = {k: v for k, v in os.environ.items() if not k.startswith(("ROUNDEL_", "HOROVOD_"))}
    env["PYTHONPATH"] = os.pathsep.join(p for p in (str(ALIAS), str(path.parent), env.get("PYTHONPATH")) if p)
    env.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
    command = [sys.executable, "-m", "roundel.runner.launch", "-np", str(ranks), sys.executable, "-m", "pytest",
               "-q", "-p", "no:cacheprovider", "-W", "ignore::DeprecationWarning", f"{path}::{test}"]
    start = time.monotonic()
    proc = subprocess.Popen(command, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=env,
                            cwd=str(path.parent))
    try:
        out, _ = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        proc.send_signal(signal.SIGTERM)
        try:
            out, _ = proc.communicate(timeout=20)
        except subprocess.TimeoutExpired:
            proc.kill()
            out, _ = proc.communicate()
        return "failed", f"TIMEOUT after {timeout} s\n{out}", time.monotonic() - start
    return outcome(proc.returncode, out, ranks), out, time.monotonic() - start


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("test_file", type=Path, help="Horovod's test file, e.g. test/parallel/test_tensorflow.py")
    parser.add_argument("-np", dest="ranks", type=int, default=2, help="ranks per job (default 2)")
    parser.add_argument("-k", dest="keyword", help="only tests whose name contains this")
    parser.add_argument("--first", action="append", default=[], metavar="WORD",
                        help="run tests whose name contains WORD before the others (repeatable)")
    parser.add_argument("--timeout", type=float, default=300, help="seconds per test (default 300)")
    parser.add_argument("--log-dir", type=Path, help="write each failing test's output here")
    parser.add_argument("--json", type=Path, help="write {test: outcome} here")
    args = parser.parse_args(argv)
    path = args.test_file.resolve()
    tests = test_ids(path, args.keyword)
    tests.sort(key=lambda t: not any(word in t for word in args.first))  # stable: file order otherwise
    if args.log_dir:
        args.log_dir.mkdir(parents=True, exist_ok=True)
    results = {}
    for i, test in enumerate(tests, 1):
        result, output, seconds = run_one(path, test, args.ranks, args.timeout)
        results[test] = result
        print(f"[{i}/{len(tests)}] {result:7s} {seconds:6.1f}s {test}", flush=True)
        if result == "failed" and args.log_dir:
            (args.log_dir / f"{test.split('::')[-1]}.log").write_text(output)
        if args.json:
            args.json.write_text(json.dumps(results, indent=1))
    counts = {k: sum(1 for r in results.values() if r == k) for k in ("passed", "failed", "skipped")}
    print(f"{counts['passed']} passed, {counts['failed']} failed, {counts['skipped']} skipped")
    return 0 if not counts["failed"] else 1


if __name__ == "__main__":
    sys.exit(main())
