"""Keras training throughput: roundel at 2 ranks against 1 process and against MultiWorkerMirroredStrategy.

Run it with plain ``python``; it starts every job itself, on this machine only::

    python benchmarks/keras_training.py                  # small CNN at 32x32, batch 32, 3 rounds (~3 min, 2 cores)
    python benchmarks/keras_training.py --model resnet50 --image-size 64 --batch-size 16 --rounds 2

Four runs of the same Keras 3 training (TensorFlow backend, XLA off, SGD with
momentum 0.9, cross-entropy on logits), each on one fixed random batch of
``--batch-size`` images per process, so no data loading is timed:

    roundel      roundelrun -np 2 ... --worker roundel       a tf.function step: forward, GradientTape,
                                                             hvd.DistributedOptimizer(SGD).apply
    roundel_fit  roundelrun -np 2 ... --worker roundel_fit   model.fit with hvd.DistributedOptimizer and
                                                             BroadcastGlobalVariablesCallback (the walkthrough)
    mwms         2 processes with TF_CONFIG (two localhost   the same step under
                 ports) ... --worker mwms                    tf.distribute.MultiWorkerMirroredStrategy
                                                             (strategy.run; CPU collectives: RING)
    single       python ... --worker single                  the same step, 1 process, no communication

MultiWorkerMirroredStrategy gets the custom step, not ``model.fit``: Keras 3's
``fit`` fails under it (keras-team/keras#20585; here too, with Keras 3.15),
so ``roundel`` runs exactly the same step for the comparison and
``roundel_fit`` shows what ``fit`` costs on top.

The jobs run one after another in rounds; each round starts with the next
kind (roundel, roundel_fit, mwms, single; then roundel_fit, mwms, single,
roundel; ...) so that no kind always runs first on a noisy machine. Each
process uses ``--threads`` TensorFlow intra-op threads (default: usable cores
/ 2, so a 2-process job and the 1-process baseline get the same CPU per
process and the baseline measures the work without communication).

In a job: ``--warmup`` untimed steps (``model.fit``: one untimed epoch), then
``--measurements`` timed spans of ``--steps`` steps (``fit``: epochs),
timed on the first process, which waits for each span's last step; every
step allreduces, so the processes keep in step. Samples/sec of a span =
processes x batch x steps / seconds.

Output: a Markdown table (samples/sec, the median over every span of every
round, with the range, and ms per step), roundel / MWMS (ratio of medians and
per round) and scaling efficiency, 2-process throughput / (2 x 1-process
throughput), of each 2-process kind. Exit status 1 if a job failed (its
output is shown).
"""

from __future__ import annotations

import argparse
import json
import os
import re
import socket
import statistics
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "examples"))  # keras_models.py

KINDS = ("roundel", "roundel_fit", "mwms", "single")
LABELS = {"roundel": "roundel DistributedOptimizer, custom step",
          "roundel_fit": "roundel DistributedOptimizer, model.fit",
          "mwms": "MultiWorkerMirroredStrategy (RING), custom step", "single": "1 process, no communication"}
RESULT = re.compile(r"BENCH_RESULT (\{.*\})\s*$")


def usable_cores() -> int:
    try:
        return len(os.sched_getaffinity(0))
    except AttributeError:
        return os.cpu_count() or 1


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0],
                                formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    p.add_argument("--model", default="small_cnn", help="small_cnn or resnet50 (examples/keras_models.py)")
    p.add_argument("--batch-size", type=int, default=32, help="images per process per step")
    p.add_argument("--image-size", type=int, default=32, help="height and width of the random images")
    p.add_argument("--num-classes", type=int, default=1000)
    p.add_argument("--threads", type=int, default=None,
                   help="TensorFlow intra-op threads per process (default: usable cores / 2, at least 1)")
    p.add_argument("--rounds", type=int, default=3, help="rounds of one job of each kind")
    p.add_argument("--warmup", type=int, default=5, help="untimed steps at the start of each job")
    p.add_argument("--steps", type=int, default=20, help="steps per timed span")
    p.add_argument("--measurements", type=int, default=3, help="timed spans per job")
    p.add_argument("--only", default=",".join(KINDS), help=f"comma-separated subset of {','.join(KINDS)}")
    p.add_argument("--timeout", type=float, default=600, help="seconds one job may take")
    p.add_argument("--worker", choices=KINDS, help=argparse.SUPPRESS)  # set by the driver
    p.add_argument("--task-index", type=int, default=0, help=argparse.SUPPRESS)  # mwms workers
    args = p.parse_args(argv)
    if args.threads is None:
        args.threads = max(1, usable_cores() // 2)
    args.only = [k.strip() for k in args.only.split(",") if k.strip()]
    if not args.only or set(args.only) - set(KINDS):
        p.error(f"--only: choose from {', '.join(KINDS)}")
    for name in ("batch_size", "image_size", "num_classes", "threads", "rounds", "steps", "measurements"):
        if getattr(args, name) < 1:
            p.error(f"--{name.replace('_', '-')} must be >= 1")
    if args.warmup < 0:
        p.error("--warmup must be >= 0")
    return args


# ================================================================ worker side
def worker(args) -> None:
    """One process of a job of kind ``args.worker``; the first process prints the BENCH_RESULT line."""
    os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
    os.environ["KERAS_BACKEND"] = "tensorflow"
    import contextlib

    import numpy as np
    import tensorflow as tf
    tf.config.threading.set_intra_op_parallelism_threads(args.threads)
    import keras

    from keras_models import build_model

    kind, strategy, hvd = args.worker, None, None
    if kind == "mwms":
        ring = tf.distribute.experimental.CommunicationImplementation.RING
        strategy = tf.distribute.MultiWorkerMirroredStrategy(
            communication_options=tf.distribute.experimental.CommunicationOptions(implementation=ring))
        rank, size = args.task_index, strategy.num_replicas_in_sync
    elif kind.startswith("roundel"):
        import roundel.keras as hvd
        hvd.init()
        rank, size = hvd.rank(), hvd.size()
    else:
        rank, size = 0, 1
    with strategy.scope() if strategy else contextlib.nullcontext():
        keras.utils.set_random_seed(0)
        model = build_model(args.model, args.image_size, args.num_classes)
        opt = keras.optimizers.SGD(0.01 * size, momentum=0.9)
        if hvd:
            opt = hvd.DistributedOptimizer(opt)
        opt.build(model.trainable_variables)
    loss_fn = keras.losses.SparseCategoricalCrossentropy(from_logits=True)
    rng = np.random.default_rng(1 + rank)
    x = tf.constant(rng.standard_normal((args.batch_size, args.image_size, args.image_size, 3), dtype=np.float32))
    y = tf.constant(rng.integers(0, args.num_classes, args.batch_size))
    rates = []

    if kind == "roundel_fit":
        class Timer(keras.callbacks.Callback):
            def on_epoch_begin(self, epoch, logs=None):
                self.start = time.perf_counter()

            def on_epoch_end(self, epoch, logs=None):
                if epoch > 0:  # epoch 0 is the warm-up
                    rates.append(size * args.batch_size * args.steps / (time.perf_counter() - self.start))

        model.compile(optimizer=opt, loss=loss_fn, jit_compile=False)
        data = tf.data.Dataset.from_tensors((x, y)).repeat()
        model.fit(data, steps_per_epoch=args.steps, epochs=1 + args.measurements, verbose=0,
                  callbacks=[hvd.callbacks.BroadcastGlobalVariablesCallback(0), Timer()])
    else:
        if hvd:
            hvd.broadcast_global_variables(0, model=model)

        def replica_step(x, y):
            with tf.GradientTape() as tape:
                loss = loss_fn(y, model(x, training=True))
                scaled = loss / size if strategy else loss  # MWMS sums the replicas' gradients
            grads = tape.gradient(scaled, model.trainable_variables)
            opt.apply(grads, model.trainable_variables)
            return loss

        @tf.function(jit_compile=False)
        def step():
            if strategy:
                return strategy.experimental_local_results(strategy.run(replica_step, args=(x, y)))[0]
            return replica_step(x, y)

        for _ in range(args.warmup):
            step()
        for _ in range(args.measurements):
            start = time.perf_counter()
            for _ in range(args.steps):
                loss = step()
            float(loss)  # the span's last step has finished
            rates.append(size * args.batch_size * args.steps / (time.perf_counter() - start))
    if rank == 0:
        print("BENCH_RESULT " + json.dumps({"kind": kind, "size": size, "rates": rates,
                                            "params": model.count_params(), "tf": tf.__version__,
                                            "keras": keras.__version__}), flush=True)


# ================================================================ driver side
def free_ports(count: int) -> list[int]:
    sockets = [socket.socket() for _ in range(count)]
    for s in sockets:
        s.bind(("127.0.0.1", 0))
    ports = [s.getsockname()[1] for s in sockets]
    for s in sockets:
        s.close()
    return ports


def commands(kind: str, args) -> list[tuple[list[str], dict]]:
    """The processes of one job: (command, extra environment) each; the first one reports."""
    me = [sys.executable, str(Path(__file__).resolve()), "--worker", kind, "--model", args.model,
          "--batch-size", str(args.batch_size), "--image-size", str(args.image_size),
          "--num-classes", str(args.num_classes), "--threads", str(args.threads), "--warmup", str(args.warmup),
          "--steps", str(args.steps), "--measurements", str(args.measurements)]
    if kind.startswith("roundel"):
        return [([sys.executable, "-m", "roundel.runner.launch", "-np", "2", *me], {})]
    if kind == "mwms":
        workers = [f"localhost:{port}" for port in free_ports(2)]
        return [([*me, "--task-index", str(i)],
                 {"TF_CONFIG": json.dumps({"cluster": {"worker": workers}, "task": {"type": "worker", "index": i}})})
                for i in range(2)]
    return [(me, {})]


def run_job(kind: str, args) -> dict:
    """Run one job to the end; returns its result. Exits with the job's output if it fails or hangs."""
    procs = []
    for command, extra in commands(kind, args):
        env = {**os.environ, "GLOO_SOCKET_IFNAME": os.environ.get("GLOO_SOCKET_IFNAME", "lo"), **extra}
        procs.append(subprocess.Popen(command, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                                      env=env))
    outputs, deadline, failed = [], time.monotonic() + args.timeout, False
    for proc in procs:
        try:
            outputs.append(proc.communicate(timeout=max(1.0, deadline - time.monotonic()))[0])
        except subprocess.TimeoutExpired:
            for p in procs:
                p.kill()
            outputs.append(proc.communicate()[0] + f"\n(no result within {args.timeout:.0f} s)")
        failed = failed or proc.returncode != 0
    found = [json.loads(m.group(1)) for line in outputs[0].splitlines() if (m := RESULT.search(line))]
    if failed or len(found) != 1:
        print(f"{kind} job failed:\n" + "\n".join(o[-6000:] for o in outputs), file=sys.stderr)
        sys.exit(1)
    return found[0]


def report(args, results: dict, rounds: list[dict]) -> str:
    """The Markdown summary; ``results[kind]`` lists that kind's job results, ``rounds`` each round's medians."""
    first = next(r[0] for r in results.values() if r)
    lines = [f"Model {args.model} ({first['params']:,} parameters), batch {args.batch_size} per process, "
             f"{args.image_size}x{args.image_size} images, {args.threads} intra-op thread(s) per process, "
             f"{usable_cores()} usable core(s), TensorFlow {first['tf']}, Keras {first['keras']}; "
             f"{args.rounds} round(s) x {args.measurements} span(s) of {args.steps} steps", "",
             "| run | processes | samples/sec (median) | range | ms/step |", "| --- | --- | ---: | ---: | ---: |"]
    medians = {}
    for kind in KINDS:
        if not results.get(kind):
            continue
        rates = [rate for r in results[kind] for rate in r["rates"]]
        medians[kind] = statistics.median(rates)
        size = results[kind][0]["size"]
        lines.append(f"| {LABELS[kind]} | {size} | {medians[kind]:,.1f} | {min(rates):,.1f} – {max(rates):,.1f} | "
                     f"{1000 * size * args.batch_size / medians[kind]:,.1f} |")
    lines.append("")
    if "roundel" in medians and "mwms" in medians:
        per_round = [r["roundel"] / r["mwms"] for r in rounds]
        lines.append(f"roundel / MultiWorkerMirroredStrategy throughput: "
                     f"**{medians['roundel'] / medians['mwms']:.3f}** (ratio of medians; per round: "
                     f"{', '.join(f'{x:.3f}' for x in per_round)}, median {statistics.median(per_round):.3f})")
    if "single" in medians:
        for kind in ("roundel", "roundel_fit", "mwms"):
            if kind in medians:
                lines.append(f"scaling efficiency, {kind}: **{medians[kind] / (2 * medians['single']):.3f}** "
                             f"(2-process {medians[kind]:,.1f} / (2 x {medians['single']:,.1f}))")
    return "\n".join(lines)


def driver(args) -> None:
    results = {kind: [] for kind in args.only}
    rounds = []
    for r in range(args.rounds):
        order = args.only[r % len(args.only):] + args.only[:r % len(args.only)]
        this_round = {}
        for kind in order:
            started = time.perf_counter()
            result = run_job(kind, args)
            results[kind].append(result)
            this_round[kind] = statistics.median(result["rates"])
            print(f"round {r + 1}/{args.rounds} {kind:11s}: {this_round[kind]:9.1f} samples/sec (spans: "
                  f"{', '.join(f'{x:.1f}' for x in result['rates'])}; job {time.perf_counter() - started:.1f} s)",
                  flush=True)
        rounds.append(this_round)
    print()
    print(report(args, results, rounds))


def main(argv=None) -> None:
    args = parse_args(argv)
    if args.worker:
        worker(args)
    else:
        driver(args)


if __name__ == "__main__":
    main()
