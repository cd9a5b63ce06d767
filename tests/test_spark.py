"""``roundel.spark.run``: ranks in the tasks of a real Spark barrier stage on a local Spark cluster.

One SparkSession for the module: ``local-cluster[2,1,1024]`` (two executor
JVMs with one core each, as separate machines would have; Java 17 needed),
everything on loopback with the web UI off. Each test's job is real: Spark
starts the Python tasks, which start one process per rank, and the ranks
meet at the driver's rendezvous store.
"""

from __future__ import annotations

import importlib.util
import io
import os
import signal
import sys
import time
from pathlib import Path

import cloudpickle
import pytest

import roundel
import roundel.spark
from roundel.runner.run_api import RankFailedError
from roundel.spark import placement

# this test module is not importable in the ranks' processes: ship its functions by value
cloudpickle.register_pickle_by_value(sys.modules[__name__])

EXAMPLE = Path(__file__).resolve().parents[1] / "examples" / "spark_keras_mnist.py"
ROOT = str(Path(__file__).resolve().parents[1])


@pytest.fixture(scope="module")
def spark():
    from pyspark.sql import SparkSession

    saved = {k: os.environ.get(k) for k in ("SPARK_LOCAL_IP", "PYSPARK_PYTHON")}
    os.environ["SPARK_LOCAL_IP"] = "127.0.0.1"
    os.environ["PYSPARK_PYTHON"] = sys.executable
    session = (SparkSession.builder.master("local-cluster[2,1,1024]").appName("roundel-tests")
               .config("spark.driver.host", "127.0.0.1").config("spark.driver.bindAddress", "127.0.0.1")
               .config("spark.ui.enabled", "false").config("spark.ui.showConsoleProgress", "false")
               .config("spark.executorEnv.PYTHONPATH", os.pathsep.join(filter(None, [ROOT, os.environ.get("PYTHONPATH")])))
               .getOrCreate())
    session.sparkContext.setLogLevel("ERROR")
    yield session
    session.stop()
    for key, value in saved.items():
        if value is None:
            os.environ.pop(key, None)
        else:
            os.environ[key] = value


def train_regression(steps):
    """A linear model trained with DistributedOptimizer on each rank's half of a fixed data set."""
    import torch

    import roundel.torch as hvd

    torch.set_num_threads(1)
    hvd.init()
    generator = torch.Generator().manual_seed(42)
    x = torch.randn(64, 4, generator=generator)
    y = x @ torch.tensor([[1.0], [-2.0], [3.0], [0.5]]) + 0.1 * torch.randn(64, 1, generator=generator)
    xs, ys = x[hvd.rank()::hvd.size()], y[hvd.rank()::hvd.size()]
    torch.manual_seed(hvd.rank())  # different starting weights on each rank: the broadcast makes them equal
    model = torch.nn.Linear(4, 1)
    hvd.broadcast_parameters(model.state_dict(), root_rank=0)
    first = torch.nn.functional.mse_loss(model(x), y).item()
    optimizer = hvd.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1),
                                         named_parameters=model.named_parameters())
    for _ in range(steps):
        optimizer.zero_grad()
        torch.nn.functional.mse_loss(model(xs), ys).backward()
        optimizer.step()
    return {"rank": hvd.rank(), "size": hvd.size(), "local": (hvd.local_rank(), hvd.local_size()),
            "cross": (hvd.cross_rank(), hvd.cross_size()), "first_loss": first,
            "loss": torch.nn.functional.mse_loss(model(x), y).item(),
            "weights": model.weight.detach().flatten().tolist() + model.bias.detach().tolist()}


def raises_on_rank_one():
    import torch

    import roundel.torch as hvd

    hvd.init()
    if hvd.rank() == 1:
        raise KeyError("rank one lost its key")
    hvd.allreduce(torch.ones(2), name="never_completes")  # rank 0 waits here for a peer that failed
    return "unreachable"


def greet():
    print(f"hello from rank {os.environ['ROUNDEL_RANK']}", flush=True)
    print(f"a warning from rank {os.environ['ROUNDEL_RANK']}", file=sys.stderr, flush=True)
    return os.environ["ROUNDEL_RANK"], os.environ["ROUNDEL_SIZE"], os.environ.get("FROM_ENV")


def test_torch_training_matches_roundel_run(spark):
    on_spark = roundel.spark.run(train_regression, args=(20,), num_proc=2)
    under_launcher = roundel.run(train_regression, args=(20,), np=2)
    assert [r["rank"] for r in on_spark] == [0, 1]
    assert all(r["size"] == 2 for r in on_spark)
    # both executors are on 127.0.0.1: one host with two local ranks, as roundelrun -np 2 places them
    assert [r["local"] for r in on_spark] == [(0, 2), (1, 2)] == [r["local"] for r in under_launcher]
    assert [r["cross"] for r in on_spark] == [(0, 1), (0, 1)]
    assert on_spark[0]["weights"] == on_spark[1]["weights"]
    assert on_spark[0]["loss"] < on_spark[0]["first_loss"] / 10
    for spark_rank, launcher_rank in zip(on_spark, under_launcher):
        assert spark_rank["weights"] == pytest.approx(launcher_rank["weights"], rel=1e-6, abs=1e-7)
        assert spark_rank["loss"] == pytest.approx(launcher_rank["loss"], rel=1e-6)


def test_a_raising_rank_ends_the_run_with_its_traceback(spark):
    with pytest.raises(RankFailedError) as info:
        roundel.spark.run(raises_on_rank_one, num_proc=2, start_timeout=120)
    assert info.value.rank == 1
    assert "rank 1 raised" in str(info.value)
    assert "KeyError: 'rank one lost its key'" in info.value.traceback_text
    assert "in raises_on_rank_one" in info.value.traceback_text


def test_a_dying_rank_is_an_error(spark):
    def dies():
        if os.environ["ROUNDEL_RANK"] == "0":
            print("rank 0 is about to exit", file=sys.stderr, flush=True)
            os._exit(3)
        return "fine"

    with pytest.raises(RankFailedError) as info:
        roundel.spark.run(dies, num_proc=2)
    assert info.value.rank == 0
    assert "exited with code 3 before returning a result" in info.value.traceback_text
    assert "rank 0 is about to exit" in info.value.traceback_text


def test_too_few_task_slots_is_a_clear_timeout_and_then_a_default_run_works(spark):
    # a barrier stage of 3 tasks never starts on 2 slots: the timeout is all it waits for
    with pytest.raises(TimeoutError, match=r"only 0 of 3 Spark tasks started within the start timeout of 1 s.*"
                                           r"needs 3 free task slots"):
        roundel.spark.run(greet, num_proc=3, start_timeout=1)
    out, err = io.StringIO(), io.StringIO()
    assert spark.sparkContext.defaultParallelism == 2  # num_proc's default
    results = roundel.spark.run(greet, env={"FROM_ENV": "yes"}, stdout=out, stderr=err)
    assert results == [("0", "2", "yes"), ("1", "2", "yes")]
    assert sorted(out.getvalue().splitlines()) == ["[0]<stdout>:hello from rank 0", "[1]<stdout>:hello from rank 1"]
    assert sorted(err.getvalue().splitlines()) == ["[0]<stderr>:a warning from rank 0",
                                                   "[1]<stderr>:a warning from rank 1"]


def test_bad_arguments_are_refused_before_spark_runs_anything(spark):
    with pytest.raises(ValueError, match="num_proc must be a whole number >= 1, not 0"):
        roundel.spark.run(greet, num_proc=0)
    with pytest.raises(ValueError, match="not through mpirun: drop use_mpi"):
        roundel.spark.run(greet, num_proc=2, use_mpi=True)
    with pytest.raises(ValueError, match="start_timeout must be a positive number"):
        roundel.spark.run(greet, num_proc=2, start_timeout=0)
    with pytest.raises(ValueError, match="network interface 'no-such-nic0' does not exist"):
        roundel.spark.run(greet, num_proc=2, nics=["no-such-nic0"])


def test_the_keras_example_trains_and_prints_its_accuracy(spark, capsys):
    spec = importlib.util.spec_from_file_location("spark_keras_mnist", EXAMPLE)
    example = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = example
    spec.loader.exec_module(example)
    cloudpickle.register_pickle_by_value(example)
    accuracy = example.main(["--epochs", "4", "--num-proc", "2"], spark=spark)
    assert accuracy > 0.8  # ten classes: chance is 0.1
    assert f"test accuracy: {accuracy:.4f}" in capsys.readouterr().out


def test_placement_groups_ranks_by_host_in_partition_order():
    ids = placement.identities(["b:7001", "a:7002", "b:7003", "a:7004", "[::1]:7005"])
    assert [(i.rank, i.local_rank, i.local_size, i.cross_rank, i.cross_size, i.hostname) for i in ids] == [
        (0, 0, 2, 0, 3, "b"), (2, 0, 2, 1, 3, "a"), (1, 1, 2, 0, 2, "b"), (3, 1, 2, 1, 2, "a"),
        (4, 0, 1, 2, 3, "::1")]


# ------------------------------------------------------------------ run_elastic

def _regression_data():
    import torch

    generator = torch.Generator().manual_seed(42)
    x = torch.randn(64, 4, generator=generator)
    return x, x @ torch.tensor([[1.0], [-2.0], [3.0], [0.5]]) + 0.1 * torch.randn(64, 1, generator=generator)


def elastic_regression(steps, die_at=None, marker=None, kill_task=False):
    """Elastic training (TorchState, a commit per step) on each rank's share of a fixed data set; rank 1
    exits abruptly at step ``die_at`` the first time (``marker`` remembers that it did), or with
    ``kill_task`` SIGKILLs the Spark task (Python worker) that runs it, and dies with it."""
    import torch

    import roundel.torch as hvd

    torch.set_num_threads(1)
    hvd.init()
    x, y = _regression_data()
    torch.manual_seed(0)
    model = torch.nn.Linear(4, 1)
    optimizer = hvd.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1),
                                         named_parameters=model.named_parameters())
    state = hvd.elastic.TorchState(model, optimizer, step=0, sizes=[])

    @hvd.elastic.run
    def train(state):
        while state.step < steps:
            if state.step == die_at and hvd.rank() == 1 and not os.path.exists(marker):
                open(marker, "w").close()
                if kill_task:
                    os.kill(os.getppid(), signal.SIGKILL)
                    time.sleep(60)  # this process gets SIGTERM when its task dies
                os._exit(7)
            optimizer.zero_grad()
            torch.nn.functional.mse_loss(model(x[hvd.rank()::hvd.size()]), y[hvd.rank()::hvd.size()]).backward()
            optimizer.step()
            state.step += 1
            state.sizes.append(hvd.size())
            state.commit()

    train(state)
    return {"rank": hvd.rank(), "size": hvd.size(), "step": state.step, "sizes": state.sizes,
            "weights": model.weight.detach().flatten().tolist() + model.bias.detach().tolist()}


def _expected_weights(sizes):
    """The weights elastic_regression reaches when step i runs on sizes[i] ranks, computed in one process."""
    import torch

    x, y = _regression_data()
    torch.manual_seed(0)
    model = torch.nn.Linear(4, 1)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    for size in sizes:
        grads = []
        for rank in range(size):
            model.zero_grad()
            torch.nn.functional.mse_loss(model(x[rank::size]), y[rank::size]).backward()
            grads.append([p.grad.clone() for p in model.parameters()])
        for p, *per_rank in zip(model.parameters(), *grads):
            p.grad = sum(per_rank) / size
        optimizer.step()
    return model.weight.detach().flatten().tolist() + model.bias.detach().tolist()


def test_elastic_torch_training_completes_with_identical_weights(spark):
    out = io.StringIO()
    results = roundel.spark.run_elastic(elastic_regression, args=(12,), num_proc=2, elastic_timeout=60,
                                        start_timeout=120, stdout=out)
    assert [(r["rank"], r["size"], r["step"]) for r in results] == [(0, 2, 12), (1, 2, 12)]
    assert results[0]["sizes"] == [2] * 12
    assert results[0]["weights"] == results[1]["weights"]
    assert results[0]["weights"] == pytest.approx(_expected_weights([2] * 12), rel=1e-5, abs=1e-6)


@pytest.mark.parametrize("kill_task", [False, True], ids=["worker-exits", "task-killed"])
def test_elastic_job_survives_a_worker_that_dies_mid_training(spark, tmp_path, capfd, kill_task):
    marker = str(tmp_path / "died-once")
    results = roundel.spark.run_elastic(elastic_regression, args=(12, 5, marker, kill_task), num_proc=2,
                                        min_num_proc=1, elastic_timeout=60, start_timeout=120)
    assert os.path.exists(marker)  # rank 1 did die
    # the task's machine is blacklisted (as Horovod does), so the survivor goes on alone from its last commit
    assert [(r["rank"], r["size"], r["step"]) for r in results] == [(0, 1, 12)]
    assert results[0]["sizes"] == [2] * 5 + [1] * 7
    assert results[0]["weights"] == pytest.approx(_expected_weights(results[0]["sizes"]), rel=1e-5, abs=1e-6)
    err = capfd.readouterr().err
    if kill_task:
        assert "Spark task 1 (attempt 0) is gone; its worker counts as killed" in err
    else:
        assert "exited with code 7" in err


def elastic_raises():
    import roundel.torch as hvd

    hvd.init()
    state = hvd.elastic.ObjectState(step=0)

    @hvd.elastic.run
    def train(state):
        raise ValueError(f"rank {hvd.rank()} has bad data")

    train(state)


def test_elastic_workers_that_raise_end_the_job_with_their_traceback(spark):
    with pytest.raises(RankFailedError) as info:
        roundel.spark.run_elastic(elastic_raises, num_proc=2, min_num_proc=1, elastic_timeout=30, start_timeout=120)
    assert info.value.rank in (0, 1)
    assert f"rank {info.value.rank} raised" in str(info.value)
    assert f"ValueError: rank {info.value.rank} has bad data" in info.value.traceback_text
    assert "in train" in info.value.traceback_text


def test_elastic_bad_arguments_and_too_few_task_slots_are_clear_errors(spark):
    with pytest.raises(ValueError, match=r"need min_num_proc <= num_proc <= max_num_proc, got 3 <= 2 <= 2"):
        roundel.spark.run_elastic(greet, num_proc=2, min_num_proc=3)
    with pytest.raises(ValueError, match="reset_limit must be a whole number >= 0, not -1"):
        roundel.spark.run_elastic(greet, num_proc=2, reset_limit=-1)
    with pytest.raises(ValueError, match="elastic_timeout must be a positive number of seconds"):
        roundel.spark.run_elastic(greet, num_proc=2, elastic_timeout=0)
    with pytest.raises(TimeoutError, match=r"only 2 of 3 Spark tasks started within the start timeout of 3 s"):
        roundel.spark.run_elastic(greet, num_proc=3, start_timeout=3)
