"""Training throughput: roundel's DistributedOptimizer against PyTorch DDP (Gloo; NCCL on GPUs), and scaling efficiency.

Run it with plain ``python``; it starts every job itself, on this machine only::

    python benchmarks/torch_training.py --quick                 # small CNN, one round, < 60 s
    python benchmarks/torch_training.py                         # ResNet-18 at 64x64, batch 32, 3 rounds
    python benchmarks/torch_training.py --model smallcnn --batch-size 32 --image-size 32 --rounds 5
    python benchmarks/torch_training.py --model mlp --interleaved  # communication-bound: 3 x 2048-wide Linear
    python benchmarks/torch_training.py --interleaved ...       # all of them in the same processes (below)
    python benchmarks/torch_training.py --device cuda --np 1 --model resnet50 --image-size 224
                                                                # on GPUs: roundel over NCCL, DDP over NCCL

Five runs of the same training:

    roundel  roundelrun -np 2 python torch_training.py --worker roundel ...   hvd.DistributedOptimizer
    ddp      python -m torch.distributed.run --standalone --nproc-per-node 2
                        torch_training.py --worker ddp ...                   DistributedDataParallel, Gloo
    single   python torch_training.py --worker single ...                   1 process, plain optimizer
    ceiling  roundelrun -np 2 python torch_training.py --worker ceiling ...  2 processes training at once,
                        each alone (plain optimizer, no communication): the no-communication ceiling
    lockstep python -m torch.distributed.run ... --worker lockstep ...       the ceiling's training, plus one
                        4-byte torch.distributed allreduce after each backward pass: processes in lockstep
                        without gradient traffic, the most any synchronous data-parallel job gets here

By default each is a separate job, and the jobs alternate: one round runs
each once, the next round starts with the next one (roundel, ddp, single,
ceiling, lockstep; ddp, single, ceiling, lockstep, roundel; ...), so no
implementation always goes first on a noisy machine. With ``--interleaved``
one ``roundelrun -np 2`` job holds all
of them in the same processes (a ``torch.distributed`` Gloo group for DDP beside
roundel's own, as ``benchmarks/allreduce.py`` does; rank 0 alone trains the
baseline while the others wait in a barrier) and alternates them span by
span, seconds apart: on a machine shared with other work this pairs the
measurements much more closely than separate jobs can.

Every run trains the same model (``examples/models.py``, or ``mlp``: 2048
features through three 2048-wide Linear layers with ReLU between them, the
last one to ``--num-classes`` outputs; about 10.5 M parameters for so little
compute that it is communication-bound) with SGD (momentum
0.9, learning rate scaled by the rank count) and cross-entropy on one fixed
random batch of ``--batch-size`` images per rank (no data loading is timed),
with ``--threads`` PyTorch threads per process (default: usable cores / 2, so
a 2-rank job and the 1-rank baseline get the same CPU per rank and the
baseline measures the work without communication). The 2-rank jobs talk over
loopback (``GLOO_SOCKET_IFNAME=lo`` unless already set); both run with their
defaults, as a user gets them: DDP with 25 MiB buckets and
``broadcast_buffers=True``, ``DistributedOptimizer`` with 25 MiB buckets too.

In a job: ``--warmup`` untimed steps, then ``--measurements`` timed spans of
``--steps`` steps each (``--rounds`` x ``--measurements`` spans per run with
``--interleaved``), each span started and ended with a barrier across ranks;
samples/sec of a span = ranks x batch x steps / span seconds. On rank 0 each
step's forward, backward and optimizer step are also timed (wall clock; on
the CPU an op has finished when it returns), and the CPU time of the process
and of the training thread is counted: with DDP the gradient reduction ends
inside ``backward()``, with roundel ``step()`` waits for what is still in
flight; process CPU minus training-thread CPU is what the communication
machinery (roundel's engine threads, Gloo's threads) costs per step, which on
a machine whose cores are all busy training comes straight out of throughput.

Output: a Markdown table, ready for docs/performance.md: samples/sec of each (median
over every span, with the range), ms per step and its split, CPU per step,
then roundel / DDP (the ratio of the medians, and of each round's or span
pair's figures, which ran close together in time), each against the
no-communication ceiling (the most a job of independent processes gets from
this machine's cores) and the lockstep bound (what waiting for the slowest
process each step leaves of that), and scaling efficiency, 2-rank
throughput / (2 x 1-rank throughput), for both. The same figures go into a PNG, ``--plot PATH``
(default ``torch_training.png`` in the current directory): samples/sec of each
run with its range, and the scaling efficiencies; its path is printed last.

With ``--device cuda`` each rank trains on GPU ``local_rank`` (one rank per
GPU, ``--np`` at most the GPUs there are, 1 allowed: then there is no
ceiling or lockstep run), roundel moves its gradients over NCCL and DDP runs
on its NCCL backend; spans end once the GPU has finished (``torch.cuda.synchronize``),
and the forward/backward/step split then only times the launching of GPU
work. Separate jobs only.

Exit status: 0 on success, 1 if a job failed (its output is shown).
"""

from __future__ import annotations

import argparse
import json
import os
import re
import statistics
import subprocess
import sys
import time
from pathlib import Path

from peer_group import start_gloo_group  # benchmarks/peer_group.py, beside this script

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "examples"))  # models.py

IMPLEMENTATIONS = ("roundel", "ddp", "single", "ceiling", "lockstep")
RUN_LABELS = {"roundel": "roundel DistributedOptimizer", "ddp": "PyTorch DDP",
              "single": "1 process, no communication",
              "ceiling": "independent processes at once, no communication",
              "lockstep": "processes in lockstep (4-byte allreduce per step), no gradient traffic"}
MLP_WIDTH = 2048
RESULT = re.compile(r"BENCH_RESULT (\[.*\])\s*$")


def usable_cores() -> int:
    try:
        return len(os.sched_getaffinity(0))
    except AttributeError:
        return os.cpu_count() or 1


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0],
                                formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    p.add_argument("--model", default="resnet18", help="mlp, or a model name from examples/models.py (e.g. "
                                                        "resnet18, resnet50, alexnet_owt, smallcnn)")
    p.add_argument("--batch-size", type=int, default=32, help="images per rank per step")
    p.add_argument("--image-size", type=int, default=64, help="height and width of the random images")
    p.add_argument("--num-classes", type=int, default=1000)
    p.add_argument("--np", type=int, default=2, help="ranks of the distributed jobs")
    p.add_argument("--device", choices=("cpu", "cuda"), default="cpu",
                   help="train on the CPU, or each rank on its own GPU (see above)")
    p.add_argument("--threads", type=int, default=None,
                   help="PyTorch threads per process (default: usable cores / np, at least 1)")
    p.add_argument("--rounds", type=int, default=3,
                   help="rounds of (roundel, ddp, single, ceiling, lockstep) jobs")
    p.add_argument("--warmup", type=int, default=3, help="untimed steps at the start of each job")
    p.add_argument("--steps", type=int, default=5, help="steps per timed span")
    p.add_argument("--measurements", type=int, default=3, help="timed spans per job")
    p.add_argument("--only", default=",".join(IMPLEMENTATIONS),
                   help="comma-separated subset of roundel,ddp,single,ceiling,lockstep to run")
    p.add_argument("--quick", action="store_true",
                   help="defaults for a run of < 60 s: small CNN at 32x32, batch 32, one round of 10-step spans")
    p.add_argument("--timeout", type=float, default=600, help="seconds one job may take")
    p.add_argument("--interleaved", action="store_true",
                   help="run roundel, DDP and the baseline in the same processes under roundelrun, alternating "
                        "span by span (fairer on a busy machine) instead of as separate jobs")
    p.add_argument("--json", metavar="PATH", help="also write each run's samples/sec (median, spans) as JSON")
    p.add_argument("--plot", default="torch_training.png", metavar="PATH",
                   help="PNG of samples/sec per run and scaling efficiency")
    p.add_argument("--worker", choices=IMPLEMENTATIONS + ("interleaved",), help=argparse.SUPPRESS)  # by the driver
    if p.parse_known_args(argv)[0].quick:  # --quick changes the defaults; options given still win
        p.set_defaults(model="small_cnn", batch_size=32, image_size=32, rounds=1, warmup=3, steps=10,
                       measurements=3)
    args = p.parse_args(argv)
    if args.threads is None:
        args.threads = max(1, usable_cores() // args.np)
    args.only = [s.strip() for s in args.only.split(",") if s.strip()]
    unknown = set(args.only) - set(IMPLEMENTATIONS)
    if unknown:
        p.error(f"--only: unknown {', '.join(sorted(unknown))}; choose from {', '.join(IMPLEMENTATIONS)}")
    if args.device == "cuda":
        import torch
        if not torch.cuda.is_available():
            p.error("--device cuda: torch sees no CUDA GPU on this machine")
        if args.interleaved:
            p.error("--device cuda runs separate jobs only; leave out --interleaved")
        if args.np == 1:
            args.only = [kind for kind in args.only if kind not in ("ceiling", "lockstep")]  # one process
    if args.np < (1 if args.device == "cuda" else 2):
        p.error("--np must be >= 2 (>= 1 with --device cuda)")
    return args


# ================================================================ worker side
def build(model_name: str, num_classes: int):
    """(model, shape of one input sample) for ``--model``."""
    import torch

    from models import INPUT_SHAPES, build_model, canonical_name

    if model_name == "mlp":
        model = torch.nn.Sequential(torch.nn.Linear(MLP_WIDTH, MLP_WIDTH), torch.nn.ReLU(),
                                    torch.nn.Linear(MLP_WIDTH, MLP_WIDTH), torch.nn.ReLU(),
                                    torch.nn.Linear(MLP_WIDTH, num_classes))
        return model, (MLP_WIDTH,)
    name = canonical_name(model_name)
    return build_model(name, num_classes=num_classes), (INPUT_SHAPES[name][0], None, None)


class Trainer:
    """One model, its optimizer and its fixed batch; ``step()`` trains once and times the phases."""

    def __init__(self, kind: str, args, rank: int, size: int, device="cpu"):
        import torch
        import torch.distributed as dist
        import torch.nn.functional as F

        from models import count_parameters

        self.kind, self.size, self.device = kind, size, torch.device(device)
        torch.manual_seed(0)
        model, sample_shape = build(args.model, args.num_classes)
        self.params = count_parameters(model)
        model.to(self.device)
        optimizer = torch.optim.SGD(model.parameters(), lr=0.01 * size, momentum=0.9)
        if kind == "roundel":
            import roundel.torch as hvd
            optimizer = hvd.DistributedOptimizer(optimizer, named_parameters=model.named_parameters())
            hvd.broadcast_parameters(model.state_dict(), root_rank=0)
            hvd.broadcast_optimizer_state(optimizer, root_rank=0)
        elif kind == "ddp":
            from torch.nn.parallel import DistributedDataParallel
            gpu = [self.device.index] if self.device.type == "cuda" else None
            model = DistributedDataParallel(model, device_ids=gpu)  # broadcasts rank 0's parameters and buffers
        self.model, self.optimizer = model, optimizer
        generator = torch.Generator().manual_seed(1 + rank)
        sample_shape = tuple(args.image_size if d is None else d for d in sample_shape)
        self.data = torch.randn(args.batch_size, *sample_shape, generator=generator).to(self.device)
        self.flag = torch.zeros(1, device=self.device)  # what the lockstep run allreduces each step
        self.lockstep = dist.all_reduce if kind == "lockstep" else None
        self.loss = F.cross_entropy
        self.target = torch.randint(0, args.num_classes, (args.batch_size,), generator=generator).to(self.device)
        self.phases = {"forward": [], "backward": [], "step": []}
        self.rates: list[float] = []
        self.cpu_ms: list[float] = []       # CPU time of the whole process per step (every thread)
        self.main_cpu_ms: list[float] = []  # CPU time of the training thread per step

    def step(self, record: bool) -> None:
        t0 = time.perf_counter()
        self.optimizer.zero_grad()
        loss = self.loss(self.model(self.data), self.target)
        t1 = time.perf_counter()
        loss.backward()
        if self.lockstep is not None:
            self.lockstep(self.flag)
        t2 = time.perf_counter()
        self.optimizer.step()
        t3 = time.perf_counter()
        if record:
            self.phases["forward"].append(t1 - t0)
            self.phases["backward"].append(t2 - t1)
            self.phases["step"].append(t3 - t2)

    def span(self, args, barrier) -> float:
        """Samples/sec over ``args.steps`` steps, between two barriers of the ranks taking part."""
        self._finish_device_work()
        barrier()
        start, cpu, main = time.perf_counter(), time.process_time(), time.thread_time()
        for _ in range(args.steps):
            self.step(True)
        self._finish_device_work()
        main, cpu = time.thread_time() - main, time.process_time() - cpu
        barrier()
        rate = self.size * args.batch_size * args.steps / (time.perf_counter() - start)
        self.rates.append(rate)
        self.cpu_ms.append(1000 * cpu / args.steps)
        self.main_cpu_ms.append(1000 * main / args.steps)
        return rate

    def _finish_device_work(self) -> None:
        if self.device.type == "cuda":
            import torch
            torch.cuda.synchronize(self.device)

    def result(self) -> dict:
        import torch
        return {"kind": self.kind, "size": self.size, "rates": self.rates, "params": self.params,
                "torch": torch.__version__,
                "device": torch.cuda.get_device_name(self.device) if self.device.type == "cuda" else "CPU",
                "phases_ms": {k: 1000 * statistics.median(v) for k, v in self.phases.items()},
                "cpu_ms": statistics.median(self.cpu_ms), "main_cpu_ms": statistics.median(self.main_cpu_ms)}


def emit(results: list[dict]) -> None:
    print("BENCH_RESULT " + json.dumps(results), flush=True)


def worker(args) -> None:
    """One job of the separate-jobs mode: one implementation, its own processes."""
    import torch
    torch.set_num_threads(args.threads)
    rank, size, local_rank, barrier = 0, 1, 0, (lambda: None)
    if args.worker in ("roundel", "ceiling"):
        import roundel.torch as hvd
        hvd.init()
        rank, size, local_rank, barrier = hvd.rank(), hvd.size(), hvd.local_rank(), hvd.barrier
    elif args.worker in ("ddp", "lockstep"):
        import torch.distributed as dist
        # torchrun's environment: rank, world size, store address
        dist.init_process_group("nccl" if args.device == "cuda" else "gloo")
        rank, size, barrier = dist.get_rank(), dist.get_world_size(), dist.barrier
        local_rank = int(os.environ["LOCAL_RANK"])
    device = "cpu"
    if args.device == "cuda":
        torch.cuda.set_device(local_rank)
        device = f"cuda:{local_rank}"
    trainer = Trainer(args.worker, args, rank, size, device)
    for _ in range(args.warmup):
        trainer.step(False)
    for _ in range(args.measurements):
        trainer.span(args, barrier)
    if rank == 0:
        emit([trainer.result()])
    if args.worker in ("roundel", "ceiling"):
        hvd.shutdown()
    elif args.worker in ("ddp", "lockstep"):
        dist.destroy_process_group()


def interleaved_worker(args) -> None:
    """The interleaved mode: roundel, DDP and the 1-process baseline in the same processes, span by span.

    Started under ``roundelrun``; a ``torch.distributed`` Gloo group of the
    same ranks (store on 127.0.0.1, its port chosen by rank 0 and shared with
    ``hvd.broadcast_object``) carries DDP and every barrier. During a
    baseline span rank 0 trains alone while the other ranks wait in a
    barrier (blocked in a socket read, using no CPU).
    """
    
    import torch
    import torch.distributed as dist

    import roundel.torch as hvd

    torch.set_num_threads(args.threads)
    hvd.init()
    rank, size = hvd.rank(), hvd.size()
    start_gloo_group(hvd)
    kinds = [k for k in IMPLEMENTATIONS if k in args.only]
    trainers = {k: Trainer(k, args, rank, 1 if k == "single" else size) for k in kinds}
    for kind, trainer in trainers.items():
        if kind != "single" or rank == 0:
            for _ in range(args.warmup):
                trainer.step(False)
    dist.barrier()
    total = args.rounds * args.measurements
    for i in range(total):
        order = kinds[i % len(kinds):] + kinds[:i % len(kinds)]  # rotate: nobody always goes first
        for kind in order:
            if kind == "single":
                if rank == 0:
                    trainers[kind].span(args, lambda: None)
                dist.barrier()
            else:
                trainers[kind].span(args, dist.barrier)
        if rank == 0:
            print("span {}/{}: {}".format(i + 1, total, ", ".join(
                f"{k} {trainers[k].rates[-1]:.1f}" for k in order)), flush=True)
    if rank == 0:
        emit([trainers[k].result() for k in kinds])
    dist.destroy_process_group()
    hvd.shutdown()


# ================================================================ driver side
def worker_args(args) -> list[str]:
    return ["--model", args.model, "--batch-size", str(args.batch_size), "--image-size", str(args.image_size),
            "--num-classes", str(args.num_classes), "--threads", str(args.threads), "--warmup", str(args.warmup),
            "--steps", str(args.steps), "--measurements", str(args.measurements), "--rounds", str(args.rounds),
            "--only", ",".join(args.only), "--device", args.device]


def command(kind: str, args) -> list[str]:
    me = [str(Path(__file__).resolve()), "--worker", kind, *worker_args(args)]
    if kind in ("roundel", "ceiling", "interleaved"):
        return [sys.executable, "-m", "roundel.runner.launch", "-np", str(args.np), sys.executable, *me]
    if kind in ("ddp", "lockstep"):
        return [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nnodes", "1",
                "--nproc-per-node", str(args.np), *me]
    return [sys.executable, *me]


def run_job(kind: str, args, echo: bool = False) -> tuple[list[dict], float]:
    """Run one job; return (its results, wall seconds). Exits with the job's output if it fails."""
    env = dict(os.environ)
    env.setdefault("GLOO_SOCKET_IFNAME", "lo")
    env["OMP_NUM_THREADS"] = str(args.threads)  # torchrun would otherwise set 1 and warn
    started = time.perf_counter()
    proc = subprocess.Popen(command(kind, args), stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            env=env)
    lines, deadline = [], started + args.timeout
    for line in proc.stdout:  # echo progress lines as they come (interleaved mode)
        lines.append(line)
        if echo and "span " in line:
            print(line.split(":", 1)[1].strip() if line.startswith("[") else line.rstrip(), flush=True)
        if time.perf_counter() > deadline:
            break
    try:
        proc.wait(timeout=max(1.0, deadline - time.perf_counter()))
    except subprocess.TimeoutExpired:
        proc.terminate()
        proc.wait()
        sys.exit(f"{kind} job did not finish within {args.timeout:.0f} s\n{''.join(lines)[-6000:]}")
    stderr = proc.stderr.read()
    results = [json.loads(m.group(1)) for line in lines if (m := RESULT.search(line))]
    if proc.returncode != 0 or len(results) != 1:
        print(f"{kind} job failed (exit status {proc.returncode}): {' '.join(command(kind, args))}\n"
              f"--- stdout ---\n{''.join(lines)[-6000:]}\n--- stderr ---\n{stderr[-6000:]}", file=sys.stderr)
        sys.exit(1)
    return results[0], time.perf_counter() - started


def spread(values: list[float]) -> str:
    return f"{min(values):,.1f} – {max(values):,.1f}"


def report(args, results: dict, pairs: list[float], pair_label: str) -> str:
    """The Markdown summary; ``results[kind]`` is a list of worker results, ``pairs`` roundel/DDP ratios."""
    any_result = next(r[0] for r in results.values() if r)
    how = (f"interleaved in the same {args.np} processes, {args.rounds * args.measurements} span(s) each"
           if args.interleaved else f"separate jobs, {args.rounds} round(s) x {args.measurements} span(s)")
    lines = [f"Model {args.model} ({any_result['params']:,} parameters), batch {args.batch_size} per rank, "
             f"{args.image_size}x{args.image_size} images, {args.threads} thread(s) per process, "
             f"{usable_cores()} usable core(s), torch {any_result['torch']}, {any_result['device']}; {how} of "
             f"{args.steps} steps", ""]
    lines += ["| run | ranks | samples/sec (median) | range | ms/step | forward / backward / step ms "
              "| CPU ms/step: process / training thread |",
              "| --- | --- | --- | --- | --- | --- | --- |"]
    medians = {}
    for kind in IMPLEMENTATIONS:
        if not results.get(kind):
            continue
        rates = [rate for r in results[kind] for rate in r["rates"]]
        medians[kind] = statistics.median(rates)
        size = results[kind][0]["size"]
        ms = 1000 * size * args.batch_size / medians[kind]
        phase = {k: statistics.median(r["phases_ms"][k] for r in results[kind])
                 for k in ("forward", "backward", "step")}
        label = RUN_LABELS[kind]
        lines.append(f"| {label} | {size} | {medians[kind]:,.1f} | {spread(rates)} | {ms:,.1f} | "
                     f"{phase['forward']:,.1f} / {phase['backward']:,.1f} / {phase['step']:,.1f} | "
                     f"{statistics.median(r['cpu_ms'] for r in results[kind]):,.1f} / "
                     f"{statistics.median(r['main_cpu_ms'] for r in results[kind]):,.1f} |")
    lines.append("")
    if "roundel" in medians and "ddp" in medians:
        lines.append(f"roundel / DDP throughput: **{medians['roundel'] / medians['ddp']:.3f}** (ratio of medians; "
                     f"{pair_label}: median {statistics.median(pairs):.3f}, "
                     f"{', '.join(f'{x:.3f}' for x in pairs)})")
    for bound, label in (("ceiling", "no-communication ceiling"), ("lockstep", "lockstep bound")):
        if bound in medians:
            for kind in ("roundel", "ddp"):
                if kind in medians:
                    lines.append(f"{kind} / {label}: **{medians[kind] / medians[bound]:.3f}**")
    if "single" in medians:
        for kind in ("roundel", "ddp"):
            if kind in medians:
                size = results[kind][0]["size"]
                eff = medians[kind] / (size * medians["single"])
                lines.append(f"scaling efficiency, {kind}: **{eff:.3f}** "
                             f"({size}-rank {medians[kind]:,.1f} / ({size} x {medians['single']:,.1f}))")
    return "\n".join(lines)


def plot(args, results: dict):
    """Draw samples/sec per run (median, range) and scaling efficiency into ``args.plot``; returns its path."""
    from plots import throughput_plot  # benchmarks/plots.py, beside this script

    rates, medians = {}, {}
    for kind in IMPLEMENTATIONS:
        if results.get(kind):
            spans = [rate for r in results[kind] for rate in r["rates"]]
            medians[kind] = statistics.median(spans)
            rates[f"{RUN_LABELS[kind]}, {results[kind][0]['size']} rank(s)"] = (medians[kind], min(spans), max(spans))
    efficiency = {}
    if "single" in medians:
        for kind in ("roundel", "ddp"):
            if kind in medians:
                efficiency[RUN_LABELS[kind]] = medians[kind] / (results[kind][0]["size"] * medians["single"])
    return throughput_plot(args.plot, rates, efficiency,
                           f"training throughput: model {args.model}, batch {args.batch_size} per rank, "
                           f"{args.image_size}x{args.image_size}, {args.np} ranks, "
                           f"{'interleaved' if args.interleaved else 'separate jobs'}")


def driver(args) -> None:
    results = {kind: [] for kind in args.only}
    pairs = []
    if args.interleaved:
        job, wall = run_job("interleaved", args, echo=True)
        for result in job:
            results[result["kind"]].append(result)
        if "roundel" in results and "ddp" in results:
            pairs = [a / b for a, b in zip(results["roundel"][0]["rates"], results["ddp"][0]["rates"])]
        print(f"job {wall:.1f} s")
        label = "per span pair"
    else:
        for r in range(args.rounds):
            order = args.only[r % len(args.only):] + args.only[:r % len(args.only)]  # rotate the order
            this_round = {}
            for kind in order:
                job, wall = run_job(kind, args)
                results[kind].append(job[0])
                this_round[kind] = statistics.median(job[0]["rates"])
                print(f"round {r + 1}/{args.rounds} {kind:7s}: {this_round[kind]:9.1f} samples/sec "
                      f"(spans: {', '.join(f'{x:.1f}' for x in job[0]['rates'])}; job {wall:.1f} s)", flush=True)
            if "roundel" in this_round and "ddp" in this_round:
                pairs.append(this_round["roundel"] / this_round["ddp"])
        label = "per round"
    print()
    print(report(args, results, pairs, label))
    print(f"\nplot: {plot(args, results)}")
    if args.json:
        with open(args.json, "w") as out:
            json.dump({"model": args.model, "np": args.np, "batch_size": args.batch_size,
                       "threads": args.threads, "interleaved": args.interleaved, "pairs": pairs,
                       "runs": {kind: {"ranks": runs[0]["size"],
                                       "samples_per_s": statistics.median(x for r in runs for x in r["rates"]),
                                       "spans": [x for r in runs for x in r["rates"]]}
                                for kind, runs in results.items() if runs}}, out, indent=1)


def main(argv=None) -> None:
    args = parse_args(argv)
    if args.worker == "interleaved":
        interleaved_worker(args)
    elif args.worker:
        worker(args)
    else:
        driver(args)


if __name__ == "__main__":
    main()
