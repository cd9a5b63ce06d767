"""Horovod's eight elastic scenarios, driven through the real ``roundelrun`` with ``horovodrun``'s flags.

    python tests/horovod_elastic_scenarios.py PATH/TO/horovod/test/integration/data/elastic_torch_main.py
    python tests/horovod_elastic_scenarios.py PATH/TO/.../elastic_tensorflow2_main.py --only single_rank_failure

Horovod 0.28.1 tests its elastic driver (``test/integration/elastic_common.py``)
with a training script that takes ``--logfile``, ``--discovery-schedule``,
``--exit-schedule``, ``--exit-mode``, ``--epochs`` and ``--epoch-wait``, and
on rank 0 writes one JSON line per epoch (``start_rank``, ``size``,
``rendezvous``, ``hostname``...). A discovery script prints the hosts the
schedule gives for the epoch the log file has reached. Each scenario here
starts the same job under ``roundelrun`` and checks what Horovod's test
checks: the lines written, or that the launcher failed. Horovod's own
scripts run unchanged (``tests/horovod_alias`` on the workers' PYTHONPATH
makes ``import horovod.torch`` give ``roundel.torch``; fetch Horovod's
repository yourself); the test suite runs roundel's own script with the same
arguments (tests/workers/horovod_style_elastic.py). Prints one line per
scenario and exits 1 when one failed.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Callable

sys.path.insert(0, str(Path(__file__).resolve().parent))

from launch_util import LAUNCHER, TESTS_DIR, clean_env  # noqa: E402

ALIAS = TESTS_DIR / "horovod_alias"
TWO_HOSTS = ["localhost:2", "127.0.0.1:2"]


@dataclasses.dataclass
class Scenario:
    """One job of Horovod's elastic tests and what must come of it."""

    name: str
    schedule: list | None = None  # [(epoch or None, [host:slots, ...]), ...] for the discovery script
    hosts: str | None = None  # fixed hosts (-H) instead of a discovery script
    exits: dict | None = None  # {"(epoch, batch)": [start ranks]} that fail there
    exit_mode: str = "exception"
    np: int = 2
    min_np: int = 2
    max_np: int = 4
    reset_limit: int | None = None
    cooldown: tuple[float, float] | None = None
    elastic_timeout: float | None = None
    epochs: int | None = None
    epoch_wait: float | None = None
    expect: Callable[[list[dict]], None] | None = None  # checks the log lines; None: the job must fail
    failure: str | None = None  # text the launcher's output must hold when the job fails


def _fields(line: dict, **expected) -> None:
    for key, value in expected.items():
        assert line[key] == value, f"{key} is {line[key]!r}, Horovod's test expects {value!r}: {line}"


def _hosts_added_and_removed(slots: int) -> Callable[[list[dict]], None]:
    def check(lines):
        assert len(lines) == 3, f"{len(lines)} epochs logged, Horovod's test expects 3"
        _fields(lines[0], start_rank=0, size=slots, hostname="localhost")
        _fields(lines[1], start_rank=0, size=slots * 2, hostname="localhost")
        _fields(lines[2], start_rank=slots, size=slots, hostname="127.0.0.1", rendezvous=3)
    return check


def _one_failure(lines):
    assert len(lines) == 3, f"{len(lines)} epochs logged, Horovod's test expects 3"
    _fields(lines[0], start_rank=0, size=4, rendezvous=1)
    _fields(lines[1], start_rank=2, size=2, rendezvous=2)
    _fields(lines[2], start_rank=2, size=2, rendezvous=2)


def _three_epochs(lines):
    assert len(lines) == 3, f"{len(lines)} epochs logged, Horovod's test expects 3"


def _backoff(lines):
    assert len(lines) == 5, f"{len(lines)} epochs logged, Horovod's test expects 5"
    _fields(lines[0], start_rank=0, size=4, rendezvous=1)
    for line in (lines[1], lines[2], lines[4]):
        _fields(line, start_rank=0, size=2, rendezvous=2)


def _scenarios() -> list[Scenario]:
    shrink = lambda slots: [(0, [f"localhost:{slots}"]), (1, [f"localhost:{slots}", f"127.0.0.1:{slots}"]),  # noqa
                            (None, [f"127.0.0.1:{slots}"])]
    out = [
        Scenario("hosts_added_and_removed[2 slots]", schedule=shrink(2), expect=_hosts_added_and_removed(2)),
        Scenario("hosts_added_and_removed[1 slot]", schedule=shrink(1), np=1, min_np=1, max_np=2,
                 expect=_hosts_added_and_removed(1)),
    ]
    for mode in ("exception", "kill"):
        out.append(Scenario(f"single_rank_failure[{mode}]", schedule=[(None, TWO_HOSTS)], exits={"(1, 0)": [0]},
                            exit_mode=mode, expect=_one_failure))
    for mode in ("exception", "kill"):
        out.append(Scenario(f"fault_tolerance_without_scaling[{mode}]", hosts=",".join(TWO_HOSTS),
                            exits={"(1, 0)": [0]}, exit_mode=mode, expect=_one_failure))
    out += [
        Scenario("all_ranks_failure", schedule=[(None, TWO_HOSTS)], exits={"(1, 0)": [0, 1, 2, 3]},
                 failure="every host of the job is blacklisted"),
        Scenario("all_hosts_blacklisted", schedule=[(None, TWO_HOSTS)], exits={"(1, 0)": [0, 2]},
                 failure="every host of the job is blacklisted"),
        Scenario("min_hosts_timeout", schedule=[(None, TWO_HOSTS)], exits={"(1, 0)": [0]}, np=4, min_np=4,
                 elastic_timeout=1, failure="only 2 worker slot(s) for 1 s (--elastic-timeout), fewer than --min-np 4"),
        Scenario("reset_limit[1]", schedule=shrink(2), reset_limit=1,
                 failure="the job needed reset number 2, more than --reset-limit 1"),
        Scenario("reset_limit[2]", schedule=shrink(2), reset_limit=2, expect=_three_epochs),
        Scenario("resurrecting_blacklisted_hosts_exponential_backoff", schedule=[(None, TWO_HOSTS)],
                 exits={"(1, 0)": [3], "(3, 0)": [3]}, epochs=5, epoch_wait=0.25, cooldown=(1, 2),
                 expect=_backoff),
    ]
    return out


SCENARIOS = _scenarios()


def discovery_script(schedule: list, logfile: Path) -> str:
    """A shell script printing the hosts of ``schedule`` for the epoch that ``logfile`` (one line an
    epoch) has reached: the entry for that epoch, else the last entry's."""
    lines = ["#!/bin/sh", "epoch=0", f'[ -f "{logfile}" ] && epoch=$(wc -l < "{logfile}" | tr -d " ")',
             'case "$epoch" in']
    for epoch, hosts in schedule:
        pattern = "*" if epoch is None else str(epoch)
        lines.append(f"  {pattern}) printf '%s\\n' {' '.join(hosts)} ;;")
    lines.append("esac")
    return "\n".join(lines) + "\n"


def command(scenario: Scenario, script: str, workdir: Path, script_args=()) -> tuple[list, Path]:
    """``roundelrun`` with ``horovodrun``'s flags for ``scenario``, and the log file it writes."""
    logfile = workdir / "epochs.log"
    args = [*LAUNCHER, "-np", str(scenario.np), "--min-num-proc", str(scenario.min_np)]
    if scenario.hosts is not None:
        args += ["-H", scenario.hosts]
    else:
        discover = workdir / "discover.sh"
        discover.write_text(discovery_script(scenario.schedule, logfile))
        discover.chmod(0o755)
        args += ["--host-discovery-script", str(discover), "--max-num-proc", str(scenario.max_np)]
    if scenario.reset_limit is not None:
        args += ["--reset-limit", str(scenario.reset_limit)]
    if scenario.cooldown is not None:
        args += ["--blacklist-cooldown-range", *map(str, scenario.cooldown)]
    if scenario.elastic_timeout is not None:
        args += ["--elastic-timeout", str(scenario.elastic_timeout)]
    args += [sys.executable, script, *script_args, "--logfile", str(logfile)]
    if scenario.schedule is not None:
        args += ["--discovery-schedule", json.dumps(scenario.schedule)]
    if scenario.epoch_wait is not None:
        args += ["--epoch-wait", json.dumps(scenario.epoch_wait)]
    if scenario.epochs is not None:
        args += ["--epochs", json.dumps(scenario.epochs)]
    if scenario.exits is not None:
        args += ["--exit-schedule", json.dumps(scenario.exits), "--exit-mode", scenario.exit_mode]
    return args, logfile


def run(scenario: Scenario, script: str, workdir: Path, script_args=(), alias: bool = False,
        timeout: float = 240.0) -> str:
    """Run ``scenario`` with ``script``; return the launcher's output. Raises AssertionError (with that
    output) when the outcome is not what Horovod's test expects. ``alias``: ``import horovod.X`` is
    ``roundel.X`` on the workers."""
    args, logfile = command(scenario, script, workdir, script_args)
    env = clean_env({"PYTHONPATH": os.pathsep.join(filter(None, [str(ALIAS), os.environ.get("PYTHONPATH")]))}
                    if alias else None)
    result = subprocess.run(args, env=env, capture_output=True, text=True, timeout=timeout, cwd=workdir)
    output = f"$ {' '.join(map(str, args))}\nexit status {result.returncode}\n{result.stdout}{result.stderr}"
    lines = [json.loads(line) for line in logfile.read_text().splitlines()] if logfile.exists() else []
    output += "\nlog file:\n" + "\n".join(map(json.dumps, lines))
    try:
        if scenario.expect is None:
            assert result.returncode != 0, "the job succeeded; Horovod's test expects it to fail"
            assert scenario.failure in output, f"the launcher did not say {scenario.failure!r}"
        else:
            assert result.returncode == 0, f"the job failed with status {result.returncode}"
            scenario.expect(lines)
    except AssertionError as exc:
        raise AssertionError(f"{scenario.name}: {exc}\n{output}") from None
    return output


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("script", help="Horovod's data/elastic_torch_main.py or elastic_tensorflow2_main.py")
    parser.add_argument("--only", action="append", help="run the scenarios whose name holds this (repeatable)")
    parser.add_argument("--logs", type=Path, help="a directory to keep each failure's output in")
    args = parser.parse_args(argv)
    chosen = [s for s in SCENARIOS if not args.only or any(word in s.name for word in args.only)]
    failed = 0
    for scenario in chosen:
        start = time.monotonic()
        with tempfile.TemporaryDirectory(prefix="roundel-horovod-elastic-") as tmp:
            try:
                run(scenario, str(Path(args.script).resolve()), Path(tmp), alias=True)
                outcome = "passed"
            except (AssertionError, subprocess.TimeoutExpired) as exc:
                failed += 1
                outcome = "FAILED: " + str(exc).splitlines()[0]
                if args.logs:
                    args.logs.mkdir(parents=True, exist_ok=True)
                    (args.logs / f"{scenario.name}.log").write_text(str(exc))
        print(f"{scenario.name}: {outcome} ({time.monotonic() - start:.1f} s)", flush=True)
    print(f"{len(chosen) - failed} of {len(chosen)} passed", flush=True)
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
