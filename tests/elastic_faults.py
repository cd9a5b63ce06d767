"""Fault injection for elastic training on network-namespace hosts, run many times with random victims.

    python tests/elastic_faults.py --runs 10 --fault kill --fault stop --fault hosts [--seed N]

Each run builds fresh simulated hosts (tests/netns_util.py: network
namespaces with sshd, as root), trains tests/workers/torch_elastic.py there
under the real ``roundelrun`` with a discovery script, and injects one fault
after a random number of commits (a random batch):

* ``kill``: a random worker of the current generation gets SIGKILL;
* ``stop``: a random worker gets SIGSTOP (its peers must declare it lost by
  heartbeat, and the driver must SIGKILL it);
* ``hosts``: a third host is added through discovery, then a random one of
  the three is removed.

Training pauses 0.2 s a step until the fault has been handled, then runs
the rest of its epochs at full speed.

A run passes when the job ends with status 0 having trained every epoch,
rank 0's committed step never went back, every sample of every epoch was
seen (repeating only the work since the last commit and shard padding),
every restart resumed from committed weights, all ranks ended with the same
parameters and an unnamed allgather after training agreed, and nothing is
left running on the simulated hosts. Prints one line per run with its time
and a summary line per fault ("kill: 10/10 passed"); exits 1 if any run
failed, 77 when the machine cannot build the hosts.
"""

from __future__ import annotations

import argparse
import random
import signal
import statistics
import sys
import tempfile
import time
from pathlib import Path

import psutil

sys.path.insert(0, str(Path(__file__).resolve().parent))

from elastic_util import ElasticJob, check_training  # noqa: E402
from launch_util import WORKERS_DIR  # noqa: E402
from netns_util import SSH_PORT, NetnsHosts, missing_tools  # noqa: E402

FAULTS = ("kill", "stop", "hosts")
WORKER = str(WORKERS_DIR / "torch_elastic.py")
EPOCHS, SAMPLES, BATCH = 4, 96, 4
HEARTBEAT_TIMEOUT_S = 4  # how long a stopped worker may stay silent before its peers declare it lost
SKIPPED = 77
FORWARD = ("-x", "EPOCHS", "-x", "SAMPLES", "-x", "BATCH", "-x", "STEP_SLEEP", "-x", "FAST_FILE")  # over ssh


def _generations(lines: list[str]) -> list[list[str]]:
    """Member labels, in rank order, of every generation the driver announced."""
    return [[item.split("=")[0] for item in line.split("ranks ", 1)[1].split(", ")]
            for line in lines if "worker(s), ranks " in line]


def _worker_process(net: NetnsHosts, label: str) -> psutil.Process:
    """The training process of worker ``label`` (``addr:slot``) inside its host's namespace."""
    name = net.names[net.addrs.index(label.split(":")[0])]
    found = []
    for pid in net.pids(name):
        try:
            process = psutil.Process(pid)
            if WORKER in process.cmdline():
                found.append(process)
        except psutil.NoSuchProcess:
            continue
    assert len(found) == 1, f"worker {label}: expected one training process in {name}, found {found}"
    return found[0]


def _commits(job: ElasticJob) -> int:
    return job.count("<stdout>:COMMIT ")


def _save_log(job: ElasticJob | None, path: Path | None) -> None:
    if job is not None and path is not None:
        path.write_text("".join(f"{t - job.started:8.2f} {line}\n" for t, line in list(job.lines)))


def run_once(fault: str, rng: random.Random, workdir: Path, log: Path | None = None) -> str:
    """One job with one ``fault``; return what was done; raise AssertionError when a check fails.

    ``log``: a file to write the launcher's output to, each line with its time since the start.
    """
    (workdir / "netns").mkdir()
    began = time.monotonic()
    net = NetnsHosts(3, workdir / "netns")
    built = time.monotonic()
    job = None
    try:
        first = net.addrs if fault != "hosts" else net.addrs[:2]
        fast = workdir / "fast"  # once the fault is handled, the rest of the training need not be slowed down
        env = {"EPOCHS": EPOCHS, "SAMPLES": SAMPLES, "BATCH": BATCH, "STEP_SLEEP": 0.2, "FAST_FILE": fast,
               "ROUNDEL_HEARTBEAT_TIMEOUT_SECONDS": HEARTBEAT_TIMEOUT_S, **net.ssh_env()}
        job = ElasticJob(workdir, "".join(f"{a}:1\n" for a in first), WORKER,
                         ["-np", len(first), "--min-np", "1", "-p", SSH_PORT, "-i", net.key,
                          "--elastic-timeout", "60", *FORWARD], env)
        at = rng.randint(2, 14)
        job.wait_count("<stdout>:COMMIT ", at, timeout=120)
        if fault == "hosts":
            job.set_hosts("".join(f"{a}:1\n" for a in net.addrs))
            job.wait_count("generation 1: 3 worker(s)", 1, timeout=120)
            more = rng.randint(1, 6)
            job.wait_count("<stdout>:COMMIT ", _commits(job) + more, timeout=120)
            gone = rng.choice(net.addrs)
            job.set_hosts("".join(f"{a}:1\n" for a in net.addrs if a != gone))
            job.wait_count("generation 2: 2 worker(s)", 1, timeout=120)
            done = f"host added after {at} commits, {gone} removed {more} commits later"
            failures = 0
        else:
            victim = rng.choice(_generations(job.output())[-1])
            _worker_process(net, victim).send_signal(signal.SIGKILL if fault == "kill" else signal.SIGSTOP)
            job.wait_count(f"worker {victim} was killed by signal SIGKILL", 1, timeout=120)
            done = f"{victim} {'killed' if fault == 'kill' else 'stopped'} after {at} commits"
            failures = 1
        fast.touch()
        code = job.finish(timeout=180)
        ended = time.monotonic()
        assert code == 0, f"exit status {code}\n{job.describe()}"
        text = job.text()
        if fault == "stop":
            assert f"worker {victim}: rank" in text and "was lost" in text, job.describe()
        try:
            check_training(text, EPOCHS, SAMPLES, BATCH, failures * 2 * BATCH * 3 + 3 * 3)
        except AssertionError as exc:
            raise AssertionError(f"{exc}\n{job.describe()}") from None
        left = net.leftovers()
        assert not left, f"processes left on the simulated hosts: {left}"
        return f"{done}; hosts built in {built - began:.1f} s, job {ended - built:.1f} s"
    finally:
        if job is not None:
            job.stop()
        _save_log(job, log)
        net.close()


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--runs", type=int, default=10, help="runs of each fault (default 10)")
    parser.add_argument("--fault", action="append", choices=FAULTS,
                        help="a fault to inject (repeatable; default: all of them)")
    parser.add_argument("--seed", type=int, default=None, help="random seed (default: from the clock)")
    parser.add_argument("--logs", type=Path, default=None, help="a directory to keep each run's output in")
    args = parser.parse_args(argv)
    missing = missing_tools()
    if missing:
        print(f"elastic_faults: needs {', '.join(missing)} to build network-namespace hosts", file=sys.stderr)
        return SKIPPED
    if args.logs:
        args.logs.mkdir(parents=True, exist_ok=True)
    seed = args.seed if args.seed is not None else int(time.time())
    rng = random.Random(seed)
    print(f"seed {seed}", flush=True)
    summary, all_passed = [], True
    for fault in args.fault or FAULTS:
        passed, times = 0, []
        for run in range(1, args.runs + 1):
            start = time.monotonic()
            with tempfile.TemporaryDirectory(prefix=f"roundel-fault-{fault}-") as tmp:
                try:
                    log = args.logs / f"{fault}-{run}.log" if args.logs else None
                    done = run_once(fault, rng, Path(tmp), log)
                    outcome = "passed"
                    passed += 1
                except Exception as exc:  # a failed check, or hosts that could not be built
                    done, outcome = f"{type(exc).__name__}: {exc}", "FAILED"
            seconds = time.monotonic() - start
            times.append(seconds)
            print(f"{fault} run {run}: {outcome} in {seconds:.1f} s ({done})", flush=True)
        summary.append(f"{fault}: {passed}/{args.runs} passed (mean {statistics.mean(times):.1f} s, "
                       f"max {max(times):.1f} s)")
        all_passed = all_passed and passed == args.runs
    print("\n".join(summary), flush=True)
    return 0 if all_passed else 1


if __name__ == "__main__":
    sys.exit(main())
