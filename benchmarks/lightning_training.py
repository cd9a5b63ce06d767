"""PyTorch Lightning training throughput: RoundelStrategy against Lightning's own DDPStrategy (Gloo), side by side.

Run it with plain ``python``; it starts every job itself, on this machine only::

    python benchmarks/lightning_training.py                      # 3 rounds, batch 16 per rank, 11 epochs a job
    python benchmarks/lightning_training.py --batch-size 128 --rounds 5

Both jobs train the LightningModule of ``examples/lightning_mnist.py`` (a
small CNN on scikit-learn's 8x8 digits, SGD with momentum) at 2 ranks on the
CPU, the same script and Trainer settings but for the strategy:

    roundel  roundelrun -np 2 python lightning_training.py --worker roundel ...
             Trainer(strategy=RoundelStrategy(), devices=1): roundelrun starts the processes
    ddp      python lightning_training.py --worker ddp ...
             Trainer(strategy=DDPStrategy(process_group_backend="gloo"), devices=2): Lightning starts
             the second process itself (its subprocess launcher), DistributedDataParallel over Gloo

The jobs alternate (roundel first in even rounds, ddp first in odd ones), so
neither always runs first on a noisy machine. In each job the first
``--warmup-epochs`` epochs are not timed; the timed span starts and ends with
a barrier across the ranks; samples/sec = the samples both ranks trained in
it / its seconds (validation off, no checkpoints, no logger, one PyTorch
thread per rank, Gloo over loopback).

Output: a Markdown table of samples/sec per round for each, the medians, and
roundel / DDP (the ratio of the medians and of each round's pair). Exit
status: 0 on success, 1 if a job failed (its output is shown).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
KINDS = ("roundel", "ddp")


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    p.add_argument("--rounds", type=int, default=3, help="jobs of each kind, alternating")
    p.add_argument("--epochs", type=int, default=11, help="epochs per job, warm-up included")
    p.add_argument("--warmup-epochs", type=int, default=1, help="epochs not timed at the start of each job")
    p.add_argument("--batch-size", type=int, default=16, help="training batch size per rank")
    p.add_argument("--timeout", type=float, default=300, help="seconds a job may take")
    p.add_argument("--worker", choices=KINDS, help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    if not 0 <= args.warmup_epochs < args.epochs:
        p.error("--warmup-epochs must be at least 0 and less than --epochs")
    return args


# ------------------------------------------------------------------ the jobs

def worker(args) -> None:
    import logging
    import warnings

    import torch
    import lightning.pytorch as pl

    sys.path.insert(0, str(ROOT / "examples"))
    from lightning_mnist import DigitsNet, load_digits

    torch.set_num_threads(1)
    warnings.filterwarnings("ignore")
    logging.getLogger("lightning.pytorch").setLevel(logging.WARNING)
    logging.getLogger("lightning.fabric").setLevel(logging.WARNING)
    torch.manual_seed(42)

    if args.worker == "roundel":
        from roundel.lightning import RoundelStrategy
        strategy, devices = RoundelStrategy(), 1
    else:
        from lightning.pytorch.strategies import DDPStrategy
        strategy, devices = DDPStrategy(process_group_backend="gloo"), 2

    class Timer(pl.Callback):
        """Counts the samples of the timed epochs; the span starts and ends with a barrier."""

        samples = 0
        started = ended = 0.0

        def on_train_epoch_start(self, trainer, module):
            if trainer.current_epoch == args.warmup_epochs:
                trainer.strategy.barrier("timed span")
                self.started = time.perf_counter()

        def on_train_batch_end(self, trainer, module, outputs, batch, batch_idx):
            if trainer.current_epoch >= args.warmup_epochs:
                self.samples += len(batch[0])

        def on_train_end(self, trainer, module):
            trainer.strategy.barrier("timed span")
            self.ended = time.perf_counter()
            total = trainer.strategy.reduce(torch.tensor(float(self.samples)), reduce_op="sum")
            if trainer.is_global_zero:
                seconds = self.ended - self.started
                print("RESULT " + json.dumps({"kind": args.worker, "ranks": trainer.world_size,
                                              "samples": int(total), "seconds": seconds,
                                              "samples_per_sec": float(total) / seconds}), flush=True)

    train_set, _ = load_digits()
    loader = torch.utils.data.DataLoader(train_set, batch_size=args.batch_size, shuffle=True)
    trainer = pl.Trainer(strategy=strategy, accelerator="cpu", devices=devices, max_epochs=args.epochs,
                         callbacks=[Timer()], logger=False, enable_checkpointing=False,
                         enable_progress_bar=False, enable_model_summary=False, limit_val_batches=0)
    trainer.fit(DigitsNet(), loader)


def command(kind: str, args) -> list[str]:
    own = [sys.executable, str(Path(__file__).resolve()), "--worker", kind, "--epochs", str(args.epochs),
           "--warmup-epochs", str(args.warmup_epochs), "--batch-size", str(args.batch_size)]
    if kind == "roundel":
        return [sys.executable, "-m", "roundel.runner.launch", "-np", "2", *own]
    return own  # Lightning's DDPStrategy starts the second rank itself


def run_job(kind: str, args) -> dict:
    env = {k: v for k, v in os.environ.items() if not k.startswith(("ROUNDEL_", "HOROVOD_"))}
    env.setdefault("GLOO_SOCKET_IFNAME", "lo")
    proc = subprocess.Popen(command(kind, args), stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            env=env, cwd=ROOT, start_new_session=True)
    try:
        out, err = proc.communicate(timeout=args.timeout)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, 9)
        out, err = proc.communicate()
        sys.exit(f"the {kind} job did not finish within {args.timeout:g} s\n{out}\n{err}")
    results = [json.loads(line.split("RESULT ", 1)[1]) for line in out.splitlines() if "RESULT " in line]
    if proc.returncode != 0 or len(results) != 1:
        print(f"the {kind} job failed (exit status {proc.returncode})\n--- stdout ---\n{out}\n--- stderr ---\n{err}",
              file=sys.stderr)
        sys.exit(1)
    return results[0]


def main(argv=None) -> None:
    args = parse_args(argv)
    if args.worker:
        worker(args)
        return
    figures: dict[str, list[float]] = {kind: [] for kind in KINDS}
    print(f"LightningModule of examples/lightning_mnist.py, 2 ranks on the CPU, batch {args.batch_size} per rank, "
          f"{args.epochs} epochs per job ({args.warmup_epochs} untimed), {args.rounds} round(s)", flush=True)
    for r in range(args.rounds):
        for kind in (KINDS if r % 2 == 0 else KINDS[::-1]):
            result = run_job(kind, args)
            figures[kind].append(result["samples_per_sec"])
            print(f"round {r + 1}: {kind:8s} {result['samples_per_sec']:9.1f} samples/sec "
                  f"({result['samples']} samples in {result['seconds']:.2f} s)", flush=True)
    print()
    print("| strategy | samples/sec per round | median |")
    print("| --- | --- | --- |")
    labels = {"roundel": "RoundelStrategy (roundelrun -np 2)", "ddp": "DDPStrategy, Gloo (Lightning's launcher)"}
    for kind in KINDS:
        print(f"| {labels[kind]} | {', '.join(f'{v:.0f}' for v in figures[kind])} | "
              f"{statistics.median(figures[kind]):.0f} |")
    ratios = [a / b for a, b in zip(figures["roundel"], figures["ddp"])]
    print(f"\nroundel / DDP: {statistics.median(figures['roundel']) / statistics.median(figures['ddp']):.2f} "
          f"(medians); per round: {', '.join(f'{x:.2f}' for x in ratios)}")


if __name__ == "__main__":
    main()
