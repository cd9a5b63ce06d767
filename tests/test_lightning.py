"""``roundel.lightning.RoundelStrategy`` under the real launcher: Lightning 2.x trains on roundel's ranks.

This file is also the worker: ``roundelrun -np 2 python tests/test_lightning.py SCENARIO ...`` runs one
of the scenarios at the bottom on every rank, ``... sequence NAME[=ARGUMENT] ...`` several in turn
(``python tests/test_lightning.py reference OUT``, without the launcher, is the single-process run to
compare with). Each job runs several ``Trainer.fit`` calls in one
process: teardown shuts roundel down and the next fit joins the job again, so that path is exercised too.

The data are fixed (64 samples of 8 features, 3 classes); each rank takes batches of 8. For training,
Lightning always puts a shuffling DistributedSampler (seed 0) in the loader: in epoch e it draws one
permutation P of the samples from seed 0 + e and hands rank r the samples P[r], P[r+2], P[r+4], ...; the
k-th batches of both ranks together are P[16k..16k+15]. The single-process reference reads the same
permutation in order (a DistributedSampler of one replica with that seed), in batches of 16, so with
averaged gradients (each loss a mean) both take the same SGD steps.
"""

from __future__ import annotations

import json
import os
import re
import sys
import time
import warnings
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
EXAMPLE = ROOT / "examples" / "lightning_mnist.py"
N, FEATURES, CLASSES, BATCH = 64, 8, 3, 8
STEPS_PER_EPOCH = N // (2 * BATCH)  # per rank, at 2 ranks


# ---------------------------------------------------------------------------------------------- the worker

def _quiet():
    """Lightning's banner and hints off (they are logged at INFO once lightning is imported)."""
    import logging
    import lightning.pytorch  # noqa: F401  (sets its loggers' levels on import)
    warnings.filterwarnings("ignore", ".*does not have many workers.*")
    warnings.filterwarnings("ignore", ".*srun.*")
    warnings.filterwarnings("ignore", ".*LeafSpec.*")
    for name in ("lightning.pytorch", "lightning.fabric"):
        logging.getLogger(name).setLevel(logging.WARNING)


def _data():
    import torch
    g = torch.Generator().manual_seed(0)
    x = torch.randn(N, FEATURES, generator=g)
    y = torch.randint(0, CLASSES, (N,), generator=g)
    return torch.utils.data.TensorDataset(x, y)


def _module_class():
    import lightning.pytorch as pl
    import torch

    class Tiny(pl.LightningModule):
        """An MLP trained with plain SGD (momentum optional); logs what the scenarios check."""

        def __init__(self, seed: int, lr: float = 0.1, momentum: float = 0.0, batch_norm: bool = False,
                     log_ranks: bool = False, manual: bool = False):
            super().__init__()
            self.automatic_optimization = not manual
            torch.manual_seed(seed)
            layers = [torch.nn.Linear(FEATURES, 16)]
            if batch_norm:
                layers.append(torch.nn.BatchNorm1d(16))
            layers += [torch.nn.Tanh(), torch.nn.Linear(16, CLASSES)]
            self.net = torch.nn.Sequential(*layers)
            self.lr, self.momentum, self.log_ranks = lr, momentum, log_ranks

        def training_step(self, batch, batch_idx):
            x, y = batch
            loss = torch.nn.functional.cross_entropy(self.net(x), y)
            if not self.automatic_optimization:
                opt = self.optimizers()
                opt.zero_grad()
                self.manual_backward(loss)
                opt.step()
            if self.log_ranks:
                rank = float(self.global_rank)
                self.log("rank_mean", rank, sync_dist=True, on_step=False, on_epoch=True)
                self.log("rank_plain", rank, on_step=False, on_epoch=True)
                self.log("rank_max", rank, sync_dist=True, reduce_fx="max", on_step=False, on_epoch=True)
                self.log("rank_sum", rank + 1, sync_dist=True, reduce_fx="sum", on_step=False, on_epoch=True)
            return loss

        def configure_optimizers(self):
            return torch.optim.SGD(self.parameters(), lr=self.lr, momentum=self.momentum)

    return Tiny


def _loader(batch_size: int, single_process: bool = False):
    """Batches in dataset order; the single-process reference's in the order of Lightning's training sampler."""
    import torch
    from torch.utils.data.distributed import DistributedSampler
    data = _data()
    sampler = DistributedSampler(data, num_replicas=1, rank=0, shuffle=True, seed=0) if single_process else None
    return torch.utils.data.DataLoader(data, batch_size=batch_size, shuffle=False, sampler=sampler)


def _trainer(strategy, **kwargs):
    import lightning.pytorch as pl
    options = dict(accelerator="cpu", devices=1, max_epochs=2, enable_progress_bar=False,
                   enable_model_summary=False, logger=False, enable_checkpointing=False,
                   num_sanity_val_steps=0)
    options.update(kwargs)
    return pl.Trainer(strategy=strategy, **options)


# the runs compared with the single-process reference: Trainer, module and strategy options, and an
# accumulation schedule (GradientAccumulationScheduler: epoch -> batches per step)
CASES = {
    "plain": {},
    "accumulate_and_clip": {"trainer": {"accumulate_grad_batches": 2, "gradient_clip_val": 0.05}},
    "scheduled_accumulation": {"schedule": {0: 1, 1: 2}},
    "sharded_momentum": {"module": {"momentum": 0.9}, "strategy": {"shard_optimizer_state": True}},
    "manual_optimization": {"module": {"manual": True, "momentum": 0.5}},
}


def _case_trainer(strategy, case: dict, callbacks=()):
    from lightning.pytorch.callbacks import GradientAccumulationScheduler
    callbacks = list(callbacks)
    if "schedule" in case:
        callbacks.append(GradientAccumulationScheduler(case["schedule"]))
    return _trainer(strategy, callbacks=callbacks, **case.get("trainer", {}))


def _case_steps(case: dict) -> tuple[int, int]:
    """(optimizer steps in 2 epochs, batches per step in the last epoch)."""
    per_epoch = [case.get("trainer", {}).get("accumulate_grad_batches", 1)] * 2
    if "schedule" in case:
        per_epoch = [max(v for k, v in case["schedule"].items() if k <= e) for e in range(2)]
    return sum(STEPS_PER_EPOCH // n for n in per_epoch), per_epoch[-1]


def _flat(module):
    import torch
    return torch.cat([p.detach().reshape(-1) for p in module.parameters()])


def scenario_fidelity(out: str) -> None:
    """Each case at 2 ranks (per-rank seeds differ: rank 0's parameters must be broadcast); rank 0 saves the
    parameters, every rank checks that both ranks hold the same ones."""
    import lightning.pytorch as pl
    import torch
    import roundel.torch as hvd
    from roundel.lightning import RoundelStrategy
    Tiny = _module_class()
    rank = int(os.environ["ROUNDEL_RANK"])
    results = {}
    for name, case in CASES.items():
        model = Tiny(seed=100 + rank, **case.get("module", {}))
        seen = {}

        class Check(pl.Callback):
            def on_train_start(self, trainer, module):
                opt = trainer.optimizers[0]
                seen["wrapped"] = hasattr(opt, "synchronize") and hasattr(opt, "skip_synchronize")
                seen["sharded"] = bool(getattr(opt, "_roundel_sharded", False))

            def on_train_end(self, trainer, module):
                seen["passes"] = trainer.optimizers[0].backward_passes_per_step
                both = trainer.strategy.all_gather(_flat(module))
                seen["agree"] = bool(torch.equal(both[0], both[1]))

        strategy_options = case.get("strategy", {})
        trainer = _case_trainer(RoundelStrategy(**strategy_options), case, [Check()])
        trainer.fit(model, _loader(BATCH))
        steps, passes = _case_steps(case)
        assert seen["wrapped"] and seen["agree"], (name, seen)
        assert seen["sharded"] == bool(strategy_options.get("shard_optimizer_state")), (name, seen)
        assert seen["passes"] == passes and trainer.global_step == steps, (name, seen, trainer.global_step)
        assert not hvd.is_initialized(), "teardown left roundel running"
        results[name] = _flat(model).tolist()
    # PowerSGD through the strategy's pass-through: trains, and both ranks agree
    model = Tiny(seed=100 + rank)
    strategy = RoundelStrategy(compression=hvd.PowerSGD(rank=1, start_iter=2))
    trainer = _trainer(strategy)
    trainer.fit(model, _loader(BATCH))
    assert isinstance(trainer.strategy.optimizers[0]._compression, hvd.PowerSGD)
    results["powersgd"] = _flat(model).tolist()
    if rank == 0:
        Path(out).write_text(json.dumps(results))
    print("CHECKS PASSED fidelity", flush=True)


def scenario_reference(out: str) -> None:
    """One process, Lightning's own single-device strategy, batches of 16: what the 2-rank runs must match."""
    Tiny = _module_class()
    results = {}
    for name, case in CASES.items():
        model = Tiny(seed=100, **case.get("module", {}))
        _case_trainer("auto", case).fit(model, _loader(2 * BATCH, single_process=True))
        results[name] = _flat(model).tolist()
    Path(out).write_text(json.dumps(results))


def scenario_collectives() -> None:
    """strategy="roundel" (the registry), sync_dist logging, sync_batchnorm, and the strategy's collectives."""
    import lightning.pytorch as pl
    import torch
    import torch.distributed as dist
    import roundel.lightning  # noqa: F401  (registers "roundel")
    import roundel.torch as hvd
    from roundel.lightning import RoundelStrategy
    from torch.utils.data.distributed import DistributedSampler
    Tiny = _module_class()
    rank = int(os.environ["ROUNDEL_RANK"])
    checks = []

    class Check(pl.Callback):
        def on_train_start(self, trainer, module):
            s = trainer.strategy
            assert isinstance(s, RoundelStrategy) and hvd.is_initialized()
            assert (s.global_rank, s.world_size, s.local_rank, s.node_rank) == (rank, 2, rank, 0)
            assert trainer.is_global_zero == (rank == 0) and trainer.world_size == 2
            sampler = trainer.train_dataloader.sampler
            assert isinstance(sampler, DistributedSampler), type(sampler)
            assert (sampler.num_replicas, sampler.rank) == (2, rank)
            assert len(trainer.train_dataloader) == STEPS_PER_EPOCH
            assert isinstance(module.net[1], hvd.SyncBatchNorm), module.net
            checks.append("setup")

        def on_train_end(self, trainer, module):
            s = trainer.strategy
            gathered = s.all_gather(torch.tensor([rank, 10 * rank]))
            assert gathered.tolist() == [[0, 0], [1, 10]], gathered
            assert s.all_gather(torch.tensor(float(rank))).tolist() == [0.0, 1.0]
            # sync_grads: each rank's input gets the sum over the ranks' losses of its gradient
            x = torch.tensor(float(rank + 1), requires_grad=True)
            weights = torch.tensor([1.0, 2.0])
            (s.all_gather(x * 1, sync_grads=True) * weights).sum().backward()
            assert x.grad.item() == 2 * weights[rank].item(), x.grad
            assert s.broadcast({"from": rank}, src=1) == {"from": 1}
            assert s.reduce(torch.tensor(float(rank))).item() == 0.5
            assert s.reduce(torch.tensor(rank), reduce_op="mean").item() == 0.5  # an integer mean is a float
            assert s.reduce(torch.tensor(float(rank)), reduce_op=dist.ReduceOp.SUM).item() == 1.0
            assert s.reduce(torch.tensor(float(rank)), reduce_op="max").item() == 1.0
            assert s.reduce(torch.tensor(float(rank + 2)), reduce_op=hvd.Product).item() == 6.0
            assert s.reduce("not a tensor") == "not a tensor"
            assert s.reduce_boolean_decision(rank == 0) is False
            assert s.reduce_boolean_decision(rank == 0, all=False) is True
            try:
                s.reduce(torch.tensor(1.0), reduce_op="median")
            except ValueError as exc:
                assert "median" in str(exc)
            else:
                raise AssertionError("reduce_op='median' was accepted")
            s.barrier("checks")
            means = s.all_gather(module.net[1].running_mean)
            assert torch.allclose(means[0], means[1]), means  # batch statistics over both ranks' batches
            checks.append("collectives")

    model = Tiny(seed=100 + rank, batch_norm=True, log_ranks=True)
    data = _data()
    if rank == 1:  # different inputs per rank, so that only synchronized batch norm keeps the ranks' stats equal
        data = torch.utils.data.TensorDataset(data.tensors[0] * 3 + 1, data.tensors[1])
    trainer = _trainer("roundel", max_epochs=1, callbacks=[Check()], sync_batchnorm=True)
    trainer.fit(model, torch.utils.data.DataLoader(data, batch_size=BATCH, shuffle=False))
    assert checks == ["setup", "collectives"], checks
    metrics = {k: float(v) for k, v in trainer.callback_metrics.items()}
    assert metrics["rank_mean"] == 0.5, metrics
    assert metrics["rank_plain"] == float(rank), metrics
    assert metrics["rank_max"] == 1.0, metrics
    assert metrics["rank_sum"] == STEPS_PER_EPOCH * (1 + 2), metrics
    assert not isinstance(model.net[1], hvd.SyncBatchNorm)  # reverted after fit, as Lightning's own does
    assert not hvd.is_initialized() and trainer.global_rank == rank and trainer.is_global_zero == (rank == 0)
    print("METRICS " + json.dumps(metrics), flush=True)
    print("CHECKS PASSED collectives", flush=True)


def scenario_checkpoint(directory: str) -> None:
    """Two epochs with a checkpoint after each (rank 0 writes them), then a new model and Trainer resume
    from the second and train to epoch 4; then a validate() stage in a roundel the script started itself."""
    import lightning.pytorch as pl
    import torch
    from lightning.pytorch.callbacks import ModelCheckpoint
    from lightning.pytorch.plugins import TorchCheckpointIO
    import roundel.torch as hvd
    from roundel.lightning import RoundelStrategy
    Tiny = _module_class()
    rank = int(os.environ["ROUNDEL_RANK"])

    class ReportingIO(TorchCheckpointIO):
        def save_checkpoint(self, checkpoint, path, storage_options=None):
            print(f"WROTE rank {rank} {os.path.basename(path)}", flush=True)
            super().save_checkpoint(checkpoint, path, storage_options)

    def trainer(epochs, callbacks=()):
        every_epoch = ModelCheckpoint(dirpath=directory, filename="{epoch}", save_top_k=-1, every_n_epochs=1)
        return _trainer(RoundelStrategy(checkpoint_io=ReportingIO()), max_epochs=epochs,
                        enable_checkpointing=True, callbacks=[every_epoch, *callbacks])

    model = Tiny(seed=100 + rank, momentum=0.9)
    trainer(2).fit(model, _loader(BATCH))
    path = os.path.join(directory, "epoch=1.ckpt")
    saved = torch.load(path, weights_only=False)
    assert saved["epoch"] == 1 and saved["global_step"] == 2 * STEPS_PER_EPOCH, (saved["epoch"], saved["global_step"])
    seen = {}

    class AtStart(pl.Callback):
        def on_train_start(self, trainer, module):
            seen["epoch"], seen["step"] = trainer.current_epoch, trainer.global_step
            seen["weights"] = all(torch.equal(module.state_dict()[k], v) for k, v in saved["state_dict"].items())
            state = trainer.optimizers[0].state_dict()["state"]
            seen["momentum"] = all(torch.equal(state[i]["momentum_buffer"], s["momentum_buffer"])
                                   for i, s in saved["optimizer_states"][0]["state"].items())

        def on_train_epoch_start(self, trainer, module):
            seen.setdefault("epochs", []).append(trainer.current_epoch)

    resumed = Tiny(seed=7 + rank, momentum=0.9)  # other weights: the checkpoint must replace them
    second = trainer(4, [AtStart()])
    second.fit(resumed, _loader(BATCH), ckpt_path=path)
    assert seen["epoch"] == 2 and seen["step"] == 2 * STEPS_PER_EPOCH, seen
    assert seen["weights"] and seen["momentum"] and seen["epochs"] == [2, 3], seen
    assert second.current_epoch == 4 and second.global_step == 4 * STEPS_PER_EPOCH
    print(f"RESUMED at epoch {seen['epoch']} step {seen['step']}, ended at epoch {second.current_epoch} "
          f"step {second.global_step}", flush=True)

    class WithValidation(Tiny):
        def validation_step(self, batch, batch_idx):
            x, y = batch
            self.log("val_loss", torch.nn.functional.cross_entropy(self.net(x), y), sync_dist=True)

    validating = WithValidation(seed=3)
    validating.load_state_dict(resumed.state_dict())
    hvd.init()  # the script's own: the strategy uses it and leaves it running
    result = second.validate(validating, _loader(BATCH), verbose=False)
    assert result and "val_loss" in result[0], result
    assert hvd.is_initialized()
    hvd.shutdown()
    print("CHECKS PASSED checkpoint", flush=True)


def scenario_failure() -> None:
    """Rank 1 raises in its fourth training step; rank 0 waits in that step's gradient allreduce."""
    from roundel.lightning import RoundelStrategy
    Tiny = _module_class()
    rank = int(os.environ["ROUNDEL_RANK"])

    class Failing(Tiny):
        def training_step(self, batch, batch_idx):
            if rank == 1 and self.global_step == 3:
                raise RuntimeError("deliberate failure in training_step on rank 1")
            return super().training_step(batch, batch_idx)

    print(f"STARTED {time.time()}", flush=True)
    _trainer(RoundelStrategy(), max_epochs=50).fit(Failing(seed=1), _loader(BATCH))
    print("FINISHED (should not happen)", flush=True)


def scenario_sequence(*steps: str) -> None:
    """Several scenarios in one job, in order: each step ``NAME`` or ``NAME=ARGUMENT`` (Lightning's import is
    paid once); a failing one says so on stderr before its traceback."""
    for step in steps:
        name, _, argument = step.partition("=")
        try:
            globals()[f"scenario_{name}"](*([argument] if argument else []))
        except BaseException:
            print(f"rank {os.environ.get('ROUNDEL_RANK')}: scenario {name} FAILED", file=sys.stderr, flush=True)
            raise


def _worker(argv: list[str]) -> None:
    os.environ.pop("PL_GLOBAL_SEED", None)  # the training sampler's seed must be 0, as the reference's
    _quiet()
    import torch
    torch.set_num_threads(1)
    scenario, *args = argv
    globals()[f"scenario_{scenario}"](*args)


if __name__ == "__main__":
    _worker(sys.argv[1:])
    sys.exit(0)


# ---------------------------------------------------------------------------------------------- the tests

pytest.importorskip("lightning", reason="the Lightning tests need the lightning package (pip install -e .[lightning])")

from launch_util import (assert_checks_passed, describe, rank_lines, run_command, run_job,  # noqa: E402
                         run_python)

TOLERANCE = 1e-5  # float32 sums in a different order (two half-batch means against one full-batch mean)


def test_importing_without_lightning_says_what_to_install():
    code = "import sys; sys.modules['lightning'] = None; import roundel.lightning"
    result = run_command([sys.executable, "-c", code], timeout=60)
    assert result.returncode == 1, describe(result)
    last = result.stderr.strip().splitlines()[-1]
    assert last.startswith("ImportError: ") and 'pip install "roundel[lightning]"' in last, describe(result)


@pytest.fixture(scope="module")
def shared_run(tmp_path_factory):
    """One 2-rank job for the fidelity, collectives and checkpoint scenarios, in that order (each fit tears
    roundel down and the next joins the job again); returns (result, the fidelity output, the checkpoints)."""
    directory = tmp_path_factory.mktemp("lightning")
    distributed, checkpoints = directory / "distributed.json", directory / "checkpoints"
    checkpoints.mkdir()
    result = run_job(2, __file__, "sequence", f"fidelity={distributed}", "collectives",
                     f"checkpoint={checkpoints}", timeout=360)
    return result, distributed, checkpoints


def test_parameters_match_a_single_process_run_on_the_combined_batches(shared_run, tmp_path):
    """2 ranks x batch 8 with averaged gradients == 1 process x batch 16 on the same samples, for plain SGD,
    for gradient accumulation with norm clipping (clipping must see the averaged gradients), for an
    accumulation schedule that changes between epochs, for sharded optimizer state with momentum, and for
    manual optimization (manual_backward, then step); PowerSGD runs and the ranks agree."""
    result, distributed, _ = shared_run
    reference = tmp_path / "reference.json"
    assert_checks_passed(result, 2, "fidelity")
    single = run_python(__file__, "reference", reference, timeout=90)
    assert single.returncode == 0, describe(single)
    got, want = json.loads(distributed.read_text()), json.loads(reference.read_text())
    import torch
    for name in CASES:
        a, b = torch.tensor(got[name]), torch.tensor(want[name])
        assert torch.allclose(a, b, atol=TOLERANCE, rtol=0), \
            f"{name}: largest difference {float((a - b).abs().max()):.3g}"
    # the cases train differently, so agreeing with each one's reference means something
    for other in ("accumulate_and_clip", "scheduled_accumulation"):
        assert not torch.allclose(torch.tensor(want["plain"]), torch.tensor(want[other]), atol=1e-3), other
    assert torch.isfinite(torch.tensor(got["powersgd"])).all()


@pytest.fixture(scope="module")
def collectives_run(shared_run):
    return shared_run[0]


def test_sync_dist_metrics_are_averaged_over_the_ranks(collectives_run):
    assert_checks_passed(collectives_run, 2, "collectives")
    for rank in (0, 1):
        (line,) = [x for x in rank_lines(collectives_run.stdout, rank, "stdout") if x.startswith("METRICS ")]
        metrics = json.loads(line[len("METRICS "):])
        assert metrics["rank_mean"] == 0.5 and metrics["rank_plain"] == rank, describe(collectives_run)


def test_strategy_string_roundel_and_the_collectives(collectives_run):
    # the worker asserts the strategy's type, ranks, sampler, sync batch norm, all_gather (with gradients),
    # broadcast, reduce with each kind of op, barrier; its Trainer was built with strategy="roundel"
    assert_checks_passed(collectives_run, 2, "collectives")


def test_checkpoint_written_by_rank_0_only_and_training_resumes_from_it(shared_run):
    result, _, checkpoints = shared_run
    assert_checks_passed(result, 2, "checkpoint")
    assert sorted(p.name for p in checkpoints.iterdir()) == [f"epoch={e}.ckpt" for e in range(4)]
    assert rank_lines(result.stdout, 0, "stdout").count("WROTE rank 0 epoch=1.ckpt") == 1, describe(result)
    assert not any(line.startswith("WROTE") for line in rank_lines(result.stdout, 1)), describe(result)
    resumed = f"RESUMED at epoch 2 step {2 * STEPS_PER_EPOCH}, ended at epoch 4 step {4 * STEPS_PER_EPOCH}"
    assert resumed in rank_lines(result.stdout, 0, "stdout"), describe(result)


def test_an_exception_on_one_rank_ends_the_job_with_roundels_error():
    """Rank 1 raises in training_step while rank 0 waits for its gradients: rank 0 gets roundel's error
    naming rank 1 (no hang), the job exits non-zero, and the launcher's last line names rank 1's error."""
    started = time.monotonic()
    result = run_job(2, __file__, "failure", timeout=90)
    elapsed = time.monotonic() - started
    assert result.returncode != 0, describe(result)
    assert not any("FINISHED" in line for line in rank_lines(result.stdout)), describe(result)
    assert any("RuntimeError: deliberate failure in training_step on rank 1" in line
               for line in rank_lines(result.stderr, 1, "stderr")), describe(result)
    rank0 = [line for line in rank_lines(result.stderr, 0, "stderr") if "RoundelInternalError" in line]
    assert rank0 and "rank 1" in rank0[-1], describe(result)
    last = result.stderr.rstrip().splitlines()[-1]
    assert last.startswith("roundelrun: rank 1 ") and "deliberate failure in training_step" in last, \
        describe(result)
    assert elapsed < 60, f"the job took {elapsed:.0f} s to end\n" + describe(result)


FINAL = re.compile(r"^final validation accuracy: ([\d.]+)$")


def _final_accuracy(lines: list[str], result) -> float:
    values = [float(m.group(1)) for line in lines if (m := FINAL.match(line))]
    assert len(values) == 1, describe(result)
    return values[0]


@pytest.fixture(scope="module")
def example_run():
    result = run_job(2, EXAMPLE, "--epochs", "3", timeout=120)
    assert result.returncode == 0, describe(result)
    return result


def test_example_reaches_a_good_accuracy(example_run):
    out = rank_lines(example_run.stdout, 0, "stdout")
    assert "training on digits: 1437 train / 360 validation images, 2 rank(s), batch 16 per rank" in out, \
        describe(example_run)
    assert [line.split(":")[0] for line in out if line.startswith("epoch ")] == ["epoch 1", "epoch 2", "epoch 3"]
    assert _final_accuracy(out, example_run) >= 0.8, describe(example_run)  # chance: 0.10
    assert rank_lines(example_run.stdout, 1, "stdout") == [], describe(example_run)  # rank 0 alone prints


def test_example_under_torchrun_trains_the_same(example_run):
    """torchrun starts the ranks instead of roundelrun: the same run, to the same accuracy."""
    command = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2", "--master-port",
               str(_free_port()), str(EXAMPLE), "--epochs", "3"]
    result = run_command(command, timeout=120)
    assert result.returncode == 0, describe(result)
    lines = result.stdout.splitlines()  # unprefixed: a line from rank 1 too would make two final lines
    assert _final_accuracy(lines, result) == _final_accuracy(rank_lines(example_run.stdout, 0, "stdout"),
                                                              example_run), describe(result)


def _free_port() -> int:
    import socket
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]
