"""PyTorch Lightning 2.x on roundel: a LightningModule trained with ``RoundelStrategy``.

Run it on 2 processes (scikit-learn's bundled 8x8 handwritten digits; nothing to download)::

    roundelrun -np 2 python examples/lightning_mnist.py --epochs 3

The launcher starts the processes; Lightning starts none of its own. The
script is an ordinary Lightning script except for the strategy: a Lightning
1.x script that used ``Trainer(strategy="horovod")`` under ``horovodrun``
changes that one argument (``strategy="roundel"`` after ``import
roundel.lightning`` does the same with the defaults). ``mpirun -np 2``,
``srun`` and ``torchrun --nproc-per-node 2`` start it as well.

The strategy averages the gradients across ranks, gives each rank its share
of every epoch (Lightning adds a DistributedSampler), averages the metrics
logged with ``sync_dist=True`` and lets rank 0 alone write checkpoints and
print. ``--checkpoint-dir DIR`` keeps the last epoch's checkpoint there and
``--resume`` continues from it.
"""

from __future__ import annotations

import argparse
import logging
import os
import time
import warnings

import torch
import torch.nn.functional as F
from torch.utils.data import DataLoader, TensorDataset

import lightning.pytorch as pl

import roundel.torch as hvd
from roundel.lightning import RoundelStrategy


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description="roundel + PyTorch Lightning digits example",
                                formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    p.add_argument("--epochs", type=int, default=5, help="number of epochs to train")
    p.add_argument("--batch-size", type=int, default=16,
                   help="training batch size per rank (small: the 1,437 training images then give 45 steps an "
                        "epoch at 2 ranks)")
    p.add_argument("--lr", type=float, default=0.05, help="SGD learning rate")
    p.add_argument("--momentum", type=float, default=0.9, help="SGD momentum")
    p.add_argument("--seed", type=int, default=42, help="random seed (the model's start; rank 0's is broadcast)")
    p.add_argument("--accelerator", choices=("cpu", "gpu", "auto"), default="cpu",
                   help="cpu, or gpu: each rank uses the GPU of its local rank")
    p.add_argument("--num-threads", type=int, default=1, help="PyTorch CPU threads per rank")
    p.add_argument("--fp16-allreduce", action="store_true", help="compress gradients to float16 for the allreduce")
    p.add_argument("--accumulate-grad-batches", type=int, default=1,
                   help="batches whose gradients add up before each step (reduced across ranks once per step)")
    p.add_argument("--checkpoint-dir", help="rank 0 keeps the last epoch's checkpoint here (last.ckpt)")
    p.add_argument("--resume", action="store_true", help="continue from --checkpoint-dir/last.ckpt if it exists")
    p.add_argument("--progress-bar", action="store_true", help="show Lightning's progress bar (rank 0)")
    args = p.parse_args(argv)
    if args.resume and not args.checkpoint_dir:
        p.error("--resume needs --checkpoint-dir")
    return args


# ------------------------------------------------------------------ data

def load_digits(test_fraction: float = 0.2, seed: int = 0) -> tuple[TensorDataset, TensorDataset]:
    """scikit-learn's digits as ``(train, validation)``: 1 x 8 x 8 images scaled to 0..1, a stratified split
    (1,437 / 360 images), the same on every rank."""
    try:
        from sklearn.datasets import load_digits as sklearn_digits
        from sklearn.model_selection import train_test_split
    except ImportError:
        raise SystemExit("this example needs scikit-learn: pip install 'scikit-learn>=1.3'") from None
    bunch = sklearn_digits()
    x = torch.as_tensor(bunch.images, dtype=torch.float32).unsqueeze(1) / 16.0
    y = torch.as_tensor(bunch.target, dtype=torch.int64)
    train_idx, val_idx = train_test_split(range(len(y)), test_size=test_fraction, random_state=seed,
                                          stratify=bunch.target)
    train_idx, val_idx = torch.as_tensor(train_idx), torch.as_tensor(val_idx)
    return TensorDataset(x[train_idx], y[train_idx]), TensorDataset(x[val_idx], y[val_idx])


# ------------------------------------------------------------------ the model

class DigitsNet(pl.LightningModule):
    """A small CNN for 8x8 digits: two 3x3 convolutions with pooling, then a linear classifier."""

    def __init__(self, lr: float = 0.05, momentum: float = 0.9):
        super().__init__()
        self.save_hyperparameters()
        self.conv1 = torch.nn.Conv2d(1, 16, 3, padding=1)
        self.conv2 = torch.nn.Conv2d(16, 32, 3, padding=1)
        self.fc = torch.nn.Linear(32 * 2 * 2, 10)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = F.max_pool2d(F.relu(self.conv1(x)), 2)  # 16 x 4 x 4
        x = F.max_pool2d(F.relu(self.conv2(x)), 2)  # 32 x 2 x 2
        return self.fc(x.flatten(1))

    def training_step(self, batch, batch_idx):
        x, y = batch
        logits = self(x)
        loss = F.cross_entropy(logits, y)
        # sync_dist=True: the epoch's value is averaged over the ranks (each trains on its own share)
        self.log("train_loss", loss, on_step=False, on_epoch=True, sync_dist=True)
        self.log("train_acc", (logits.argmax(1) == y).float().mean(), on_step=False, on_epoch=True, sync_dist=True)
        return loss

    def validation_step(self, batch, batch_idx):
        x, y = batch
        logits = self(x)
        self.log("val_loss", F.cross_entropy(logits, y), sync_dist=True)
        self.log("val_acc", (logits.argmax(1) == y).float().mean(), sync_dist=True)

    def configure_optimizers(self):
        # No learning-rate scaling by the rank count here; RoundelStrategy(scale_lr=True) does it as Lightning
        # 1.x's HorovodStrategy did.
        return torch.optim.SGD(self.parameters(), lr=self.hparams.lr, momentum=self.hparams.momentum)


class EpochReport(pl.Callback):
    """One line per epoch on rank 0 with the averaged metrics (every rank holds the same values)."""

    def on_train_epoch_start(self, trainer, module):
        self.started = time.perf_counter()

    def on_train_epoch_end(self, trainer, module):
        m = trainer.callback_metrics
        if trainer.is_global_zero and "val_acc" in m:
            print(f"epoch {trainer.current_epoch + 1}: train loss {float(m['train_loss']):.4f} accuracy "
                  f"{float(m['train_acc']):.4f} | validation loss {float(m['val_loss']):.4f} accuracy "
                  f"{float(m['val_acc']):.4f} | {time.perf_counter() - self.started:.1f} s", flush=True)


def main(argv=None) -> None:
    args = parse_args(argv)
    torch.set_num_threads(args.num_threads)
    warnings.filterwarnings("ignore", ".*does not have many workers.*")
    warnings.filterwarnings("ignore", ".*srun.*")
    warnings.filterwarnings("ignore", ".*LeafSpec.*")  # Lightning's own use of a deprecated torch name
    if not args.progress_bar:
        logging.getLogger("lightning.pytorch").setLevel(logging.WARNING)  # the "GPU available" banner
    torch.manual_seed(args.seed)

    train_set, val_set = load_digits()
    train_loader = DataLoader(train_set, batch_size=args.batch_size, shuffle=True)
    val_loader = DataLoader(val_set, batch_size=len(val_set))

    compression = hvd.Compression.fp16 if args.fp16_allreduce else hvd.Compression.none
    callbacks = [EpochReport()]
    ckpt_path = None
    if args.checkpoint_dir:
        callbacks.append(pl.callbacks.ModelCheckpoint(dirpath=args.checkpoint_dir, save_last=True, save_top_k=0))
        last = os.path.join(args.checkpoint_dir, "last.ckpt")
        if args.resume and os.path.isfile(last):
            ckpt_path = last
    trainer = pl.Trainer(
        strategy=RoundelStrategy(compression=compression),
        accelerator=args.accelerator, devices=1,
        max_epochs=args.epochs, accumulate_grad_batches=args.accumulate_grad_batches,
        callbacks=callbacks, logger=False, enable_checkpointing=bool(args.checkpoint_dir),
        enable_progress_bar=args.progress_bar, enable_model_summary=False, num_sanity_val_steps=0,
    )
    if trainer.is_global_zero:
        print(f"training on digits: {len(train_set)} train / {len(val_set)} validation images, "
              f"{trainer.world_size} rank(s), batch {args.batch_size} per rank"
              f"{', fp16 allreduce' if args.fp16_allreduce else ''}"
              f"{f', resuming from {ckpt_path}' if ckpt_path else ''}", flush=True)
    started = time.perf_counter()
    trainer.fit(DigitsNet(args.lr, args.momentum), train_loader, val_loader, ckpt_path=ckpt_path)
    if trainer.is_global_zero:
        print(f"total time: {time.perf_counter() - started:.1f} s", flush=True)
        print(f"final validation accuracy: {float(trainer.callback_metrics['val_acc']):.4f}", flush=True)


if __name__ == "__main__":
    main()
