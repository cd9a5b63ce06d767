"""roundel.ray: ranks as Ray actors on a real local Ray cluster of single-CPU nodes, all on 127.0.0.1.

One cluster for the module (a head and one more node; the elastic test removes
that node and adds another). Training results are compared with the same
function run by ``roundel.run`` (the real launcher) on the same data split.
"""

from __future__ import annotations

import os
import signal
import sys
import threading
import time

# Ray would otherwise replace 127.0.0.1 by this machine's outward address when connecting
os.environ["RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER"] = "0"

import cloudpickle  # noqa: E402
import numpy as np  # noqa: E402
import pytest  # noqa: E402
import ray  # noqa: E402
from ray.cluster_utils import Cluster  # noqa: E402

import roundel  # noqa: E402
from roundel.ray import ElasticRayExecutor, RayExecutor  # noqa: E402
from roundel.runner.run_api import RankFailedError  # noqa: E402

# this test module is not importable in the workers: ship its functions by value
cloudpickle.register_pickle_by_value(sys.modules[__name__])
ray.cloudpickle.register_pickle_by_value(sys.modules[__name__])  # Ray's own copy of cloudpickle

NODE = {"num_cpus": 1, "node_ip_address": "127.0.0.1", "object_store_memory": 80 * 1024 * 1024}


@pytest.fixture(scope="module")
def cluster():
    cluster = Cluster(initialize_head=True, head_node_args={**NODE, "include_dashboard": False})
    cluster.add_node(**NODE)
    ray.init(address=cluster.address, _node_ip_address="127.0.0.1", log_to_driver=False)
    try:
        yield cluster
    finally:
        ray.shutdown()
        cluster.shutdown()


@pytest.fixture(scope="module")
def executor(cluster):
    executor = RayExecutor(RayExecutor.create_settings(timeout_s=60), num_workers=2)
    executor.start(executable_cls=Counter, executable_args=[100])
    yield executor
    executor.shutdown()


class Counter:
    """The object ``start(executable_cls=...)`` creates in every actor."""

    def __init__(self, start):
        self.value = start

    def bump(self):
        self.value += 1
        return self.value


# ------------------------------------------------------------------ functions run on the ranks

def torch_training(steps=6):
    """A small model trained with DistributedOptimizer on this rank's share of a fixed data set."""
    import torch
    import roundel.torch as hvd

    hvd.init()
    torch.set_num_threads(1)
    torch.manual_seed(0)
    x = torch.randn(64, 5)
    y = x @ torch.arange(1.0, 6.0)[:, None] + 0.1 * torch.randn(64, 1)
    model = torch.nn.Sequential(torch.nn.Linear(5, 8), torch.nn.Tanh(), torch.nn.Linear(8, 1))
    optimizer = hvd.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.05),
                                         named_parameters=model.named_parameters())
    hvd.broadcast_parameters(model.state_dict(), root_rank=0)
    mine = slice(hvd.rank(), None, hvd.size())
    for _ in range(steps):
        optimizer.zero_grad()
        loss = torch.nn.functional.mse_loss(model(x[mine]), y[mine])
        loss.backward()
        optimizer.step()
    average = hvd.allreduce(loss.detach(), name="final_loss").item()
    return {"rank": hvd.rank(), "loss": average,
            "weights": np.concatenate([p.detach().numpy().ravel() for p in model.parameters()])}


def keras_training():
    """A small Keras model (TensorFlow backend) fitted with DistributedOptimizer on this rank's share."""
    os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "3")
    os.environ["KERAS_BACKEND"] = "tensorflow"
    import keras
    import roundel.keras as hvd

    hvd.init()
    rng = np.random.default_rng(0)
    x = rng.standard_normal((64, 5)).astype(np.float32)
    y = (x @ np.arange(1, 6, dtype=np.float32)[:, None]).astype(np.float32)
    keras.utils.set_random_seed(0)
    model = keras.Sequential([keras.Input((5,)), keras.layers.Dense(4, activation="tanh"), keras.layers.Dense(1)])
    model.compile(optimizer=hvd.DistributedOptimizer(keras.optimizers.SGD(0.05)), loss="mse")
    mine = slice(hvd.rank(), None, hvd.size())
    history = model.fit(x[mine], y[mine], batch_size=8, epochs=2, shuffle=False, verbose=0,
                        callbacks=[hvd.callbacks.BroadcastGlobalVariablesCallback(0)])
    return {"rank": hvd.rank(), "loss": history.history["loss"][-1],
            "weights": np.concatenate([w.ravel() for w in model.get_weights()])}


def rank_info(offset):
    import torch
    import roundel.torch as hvd

    hvd.init()
    total = hvd.allreduce(torch.tensor([float(hvd.rank() + offset)]), op=hvd.Sum, name="info").item()
    return {"rank": hvd.rank(), "size": hvd.size(), "local_rank": hvd.local_rank(),
            "cross_rank": hvd.cross_rank(), "sum": total, "pid": os.getpid()}


def raises_on_rank_one():
    import torch
    import roundel.torch as hvd

    hvd.init()
    if hvd.rank() == 1:
        raise KeyError("rank one cannot find its key")
    return hvd.allreduce(torch.ones(1), name="never_complete").item()


def dies_on_rank_one():
    import torch
    import roundel.torch as hvd

    hvd.init()
    if hvd.rank() == 1:
        os.kill(os.getpid(), signal.SIGKILL)
    return hvd.allreduce(torch.ones(1), name="peer_dies").item()


# ------------------------------------------------------------------ static jobs

def assert_same_training(on_ray, under_roundelrun, tolerance):
    assert [r["rank"] for r in on_ray] == [0, 1]
    for ray_rank, launcher_rank in zip(on_ray, under_roundelrun):
        np.testing.assert_allclose(ray_rank["weights"], launcher_rank["weights"], rtol=tolerance, atol=tolerance)
        assert ray_rank["loss"] == pytest.approx(launcher_rank["loss"], rel=tolerance, abs=tolerance)
    np.testing.assert_array_equal(on_ray[0]["weights"], on_ray[1]["weights"])


def test_torch_training_matches_roundelrun(executor):
    on_ray = executor.run(torch_training)
    under_roundelrun = roundel.run(torch_training, np=2)
    assert_same_training(on_ray, under_roundelrun, 1e-6)


def test_keras_training_matches_roundelrun(executor):
    on_ray = executor.run(keras_training)
    under_roundelrun = roundel.run(keras_training, np=2)
    assert_same_training(on_ray, under_roundelrun, 1e-5)


def test_results_in_rank_order_and_identities_from_the_nodes(executor):
    results = executor.run(rank_info, args=[10])
    assert [(r["rank"], r["size"], r["local_rank"], r["cross_rank"], r["sum"]) for r in results] == \
        [(0, 2, 0, 0, 21.0), (1, 2, 0, 1, 21.0)]  # one CPU per node: one rank on each node
    assert results[0]["pid"] != results[1]["pid"] != os.getpid()
    refs = executor.run_remote(rank_info, kwargs={"offset": 1})
    assert [r["rank"] for r in ray.get(refs)] == [0, 1]


def test_execute_and_execute_single_call_the_executable(executor):
    first = executor.execute(lambda counter: counter.bump())
    assert first[0] == first[1] and first[0] > 100
    assert executor.execute_single(lambda counter: counter.bump()) == first[0] + 1
    assert executor.execute(lambda counter: counter.value) == [first[0] + 1, first[0]]


def test_a_raising_rank_reaches_run_with_its_rank_and_traceback(executor):
    with pytest.raises(RankFailedError) as info:
        executor.run(raises_on_rank_one)
    assert info.value.rank == 1
    assert "rank 1 raised" in str(info.value)
    assert "KeyError: 'rank one cannot find its key'" in info.value.traceback_text
    assert "in raises_on_rank_one" in info.value.traceback_text
    assert [r["sum"] for r in executor.run(rank_info, args=[0])] == [1.0, 1.0]  # the job is usable again


def test_bad_arguments_are_clear_errors(cluster):
    with pytest.raises(ValueError, match="either num_workers, or num_hosts"):
        RayExecutor(num_workers=2, num_hosts=2)
    with pytest.raises(ValueError, match="use_gpu is False"):
        RayExecutor(num_workers=2, gpus_per_worker=1)
    with pytest.raises(RuntimeError, match="call start"):
        RayExecutor(num_workers=2).run(rank_info, args=[0])
    too_many = RayExecutor(RayExecutor.create_settings(placement_group_timeout_s=2), num_workers=5)
    with pytest.raises(TimeoutError, match="could not place 5 bundle"):
        too_many.start()


def test_a_killed_actor_ends_run_with_an_error(executor):
    executor.shutdown()  # the shared actors make room for this job's
    doomed = RayExecutor(RayExecutor.create_settings(timeout_s=60), num_hosts=2, num_workers_per_host=1)
    doomed.start()
    try:
        with pytest.raises(RankFailedError) as info:
            doomed.run(dies_on_rank_one)
        assert info.value.rank == 1
        assert "the actor of rank 1 died" in str(info.value)
    finally:
        doomed.shutdown()


# ------------------------------------------------------------------ elastic

def elastic_training(progress_file, steps):
    """Elastic training that records, on rank 0, the step and job size after every commit; slowed down by
    a pause per step until the job, having shrunk to one rank, has grown again."""
    import torch
    import roundel.torch as hvd

    hvd.init()
    torch.set_num_threads(1)
    torch.manual_seed(0)
    model = torch.nn.Linear(4, 1)
    optimizer = hvd.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.01),
                                         named_parameters=model.named_parameters())
    state = hvd.elastic.TorchState(model, optimizer, step=0, sizes=[])

    @hvd.elastic.run
    def train(state):
        while state.step < steps:
            data = torch.full((4, 4), float(state.step % 7 + hvd.rank()))
            optimizer.zero_grad()
            model(data).pow(2).mean().backward()
            optimizer.step()
            state.step += 1
            state.sizes.append(hvd.size())
            state.commit()
            if hvd.rank() == 0:
                with open(progress_file, "a") as f:
                    f.write(f"{state.step} {hvd.size()}\n")
            if 1 not in state.sizes or hvd.size() == 1:  # slow until grown back: time for the test to act
                time.sleep(0.2)

    train(state)
    return {"rank": hvd.rank(), "size": hvd.size(), "step": state.step, "sizes": state.sizes,
            "weights": np.concatenate([p.detach().numpy().ravel() for p in model.parameters()])}


def _wait_for(progress_file, check, timeout=120):
    """Block until a line ``step size`` of the progress file satisfies ``check(step, size)``."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if os.path.exists(progress_file):
            with open(progress_file) as f:
                if any(check(*map(int, line.split())) for line in f if line.strip()):
                    return True
        time.sleep(0.2)
    return False


def test_elastic_job_survives_a_lost_node_and_grows_onto_a_new_one(cluster, executor, tmp_path):
    executor.shutdown()  # both nodes' CPUs for this job
    progress = str(tmp_path / "progress")
    elastic = ElasticRayExecutor(ElasticRayExecutor.create_settings(elastic_timeout=60, timeout_s=60),
                                 min_workers=1, max_workers=2)
    elastic.start()
    outcome = {}

    def train():  # Ray adds and removes nodes only from the main thread, so the job runs in this one
        try:
            outcome["results"] = elastic.run(elastic_training, args=[progress, 40])
        except BaseException as exc:  # noqa: BLE001 - reported by the assertions below
            outcome["error"] = exc

    job = threading.Thread(target=train, daemon=True)
    job.start()
    try:
        assert _wait_for(progress, lambda step, size: size == 2 and step >= 3), "the job never ran on 2 nodes"
        cluster.remove_node(next(iter(cluster.worker_nodes)))  # its actor dies with it
        assert _wait_for(progress, lambda step, size: size == 1), "the survivor never went on alone"
        cluster.add_node(**NODE)
        job.join(180)
    finally:
        elastic.shutdown()
    assert "error" not in outcome, outcome.get("error")
    results = outcome["results"]
    assert [(r["rank"], r["size"], r["step"]) for r in results] == [(0, 2, 40), (1, 2, 40)]
    sizes = results[0]["sizes"]
    assert sizes == results[1]["sizes"] and len(sizes) == 40
    assert sizes[0] == 2 and 1 in sizes and sizes[-1] == 2, sizes
    np.testing.assert_array_equal(results[0]["weights"], results[1]["weights"])


def elastic_raises():
    import roundel.torch as hvd

    hvd.init()
    state = hvd.elastic.ObjectState(step=0)

    @hvd.elastic.run
    def train(state):
        raise ValueError(f"rank {hvd.rank()} has bad data")

    train(state)


def test_an_elastic_job_whose_workers_raise_ends_with_their_traceback(cluster, executor):
    executor.shutdown()
    elastic = ElasticRayExecutor(ElasticRayExecutor.create_settings(elastic_timeout=20, timeout_s=30),
                                 min_workers=1, max_workers=2)
    elastic.start()
    try:
        with pytest.raises(RankFailedError) as info:
            elastic.run(elastic_raises)
    finally:
        elastic.shutdown()
    assert "ElasticRayExecutor: the job failed" in str(info.value)
    assert "ValueError: rank" in info.value.traceback_text and "has bad data" in info.value.traceback_text
