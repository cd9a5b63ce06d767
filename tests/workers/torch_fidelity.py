"""Horovod PyTorch API fidelity worker: ``torch_fidelity.py SCENARIO[,SCENARIO...]``.

Run under roundelrun at 2 or 3 ranks. Each scenario checks one group of
Horovod 0.28.1 behaviours (signatures, return shapes, gradients as Horovod
defines them, optimizer-state broadcast, sparse and Adasum optimizers,
``init(comm=...)``, the elastic handler registry) against NumPy or
single-process torch references, and prints ``CHECKS PASSED <scenario>``.
"""

from __future__ import annotations

import copy
import importlib.util
import inspect
import os
import sys

import numpy as np
import torch

import roundel.torch as hvd
from roundel.common import basics
from roundel.torch.elastic import state as elastic_state
from _checks import check, expect_raises, make_float, run_scenarios, to_np

torch.randn(1 << 20).sum()  # torch's own worker threads start here, before the baseline below


def os_threads() -> set:
    """The ids of this process's threads, Python's and native ones alike."""
    return set(os.listdir("/proc/self/task"))


THREADS_BEFORE_INIT = os_threads()
hvd.init()
RANK, SIZE = hvd.rank(), hvd.size()


def w(rank, tag, shape):
    return make_float(rank, "w." + tag, shape)


# ------------------------------------------------------------------- api
def scenario_api():
    assert list(inspect.signature(hvd.init).parameters)[:2] == ["comm", "process_sets"]
    assert list(inspect.signature(hvd.reducescatter).parameters) == [
        "tensor", "name", "compression", "op", "process_set", "prescale_factor", "postscale_factor"]
    assert list(inspect.signature(hvd.reducescatter_async).parameters) == [
        "tensor", "name", "op", "process_set", "prescale_factor", "postscale_factor"]
    assert list(inspect.signature(hvd.broadcast_optimizer_state).parameters)[:3] == [
        "optimizer", "root_rank", "model"]
    # this job moves data over Gloo: MPI is built when mpi4py is installed but not enabled; NCCL moves
    # CUDA tensors where torch has it and a GPU is visible
    assert hvd.mpi_built() == (importlib.util.find_spec("mpi4py") is not None)
    assert (hvd.mpi_enabled(), hvd.mpi_threads_supported()) == (False, False)
    assert hvd.nccl_built() == (torch.distributed.is_nccl_available() and torch.cuda.is_available())
    assert hvd.gloo_built() and hvd.gloo_enabled()
    # alltoall: the tensor alone without splits, the pair with them; synchronize always gives the pair
    x = torch.arange(2 * SIZE, dtype=torch.float64) + 100 * RANK
    out = hvd.alltoall(x, name="fid.a2a")
    assert isinstance(out, torch.Tensor)
    check(out, np.concatenate([np.arange(2 * RANK, 2 * RANK + 2) + 100 * j for j in range(SIZE)]), "alltoall")
    out2, received = hvd.alltoall(x, splits=[2] * SIZE, name="fid.a2a.splits")
    check(out2, to_np(out), "alltoall with splits")
    check(received, np.full(SIZE, 2), "alltoall received splits")
    pair = hvd.synchronize(hvd.alltoall_async(x, name="fid.a2a.async"))
    assert isinstance(pair, tuple) and len(pair) == 2
    # reducescatter with Horovod's positional order: (tensor, name, compression, op, process_set, pre, post)
    t = make_float(RANK, "fid.rs", (SIZE * 2, 3))
    full = np.sum([to_np(make_float(r, "fid.rs", (SIZE * 2, 3))) for r in range(SIZE)], axis=0)
    got = hvd.reducescatter(t, "fid.rs", hvd.Compression.none, hvd.Sum, hvd.global_process_set, 2.0, 0.5)
    check(got, full[2 * RANK:2 * RANK + 2], "reducescatter positional")
    got = hvd.synchronize(hvd.reducescatter_async(t, "fid.rs.async", hvd.Sum, hvd.global_process_set, 3.0))
    check(got, 3 * full[2 * RANK:2 * RANK + 2], "reducescatter_async positional")
    got = hvd.grouped_reducescatter([t, 2 * t], "fid.grs", hvd.Compression.none, hvd.Sum, hvd.global_process_set)
    check(got[1], 2 * full[2 * RANK:2 * RANK + 2], "grouped_reducescatter positional")
    # sparse_allreduce_async: a function that returns the reduced sparse tensor
    for op, divisor in ((hvd.Average, SIZE), (hvd.Sum, 1)):
        dense = [np.zeros((5, 2)) for _ in range(SIZE)]
        for r in range(SIZE):
            dense[r][[r % 5, (r + 2) % 5]] = to_np(make_float(r, "fid.sparse", (2, 2)))
        mine = torch.from_numpy(dense[RANK]).to_sparse()
        wait = hvd.sparse_allreduce_async(mine, name=f"fid.sparse.{int(op)}", op=op)
        result = wait()
        assert result.is_sparse
        check(result.to_dense(), np.sum(dense, axis=0) / divisor, f"sparse_allreduce_async op={op}")
    expect_raises(TypeError, lambda: hvd.sparse_allreduce_async(torch.ones(2), "fid.dense", hvd.Sum), "sparse")


# ------------------------------------------------------------------ grads
def scenario_grads():
    # grouped_allgather: each input gets the average of every rank's output gradient, its rows
    tag = "fid.gag"
    xs = [make_float(RANK, tag + ".a", (RANK + 1, 2)).requires_grad_(),
          make_float(RANK, tag + ".b", (2 * RANK + 1,)).requires_grad_()]
    ys = hvd.grouped_allgather(xs, name=tag)
    totals = [sum(r + 1 for r in range(SIZE)), sum(2 * r + 1 for r in range(SIZE))]
    ((ys[0] * w(RANK, tag + ".a", (totals[0], 2))).sum() + (ys[1] * w(RANK, tag + ".b", (totals[1],))).sum()).backward()
    mean_a = np.mean([to_np(w(r, tag + ".a", (totals[0], 2))) for r in range(SIZE)], axis=0)
    mean_b = np.mean([to_np(w(r, tag + ".b", (totals[1],))) for r in range(SIZE)], axis=0)
    off_a, off_b = sum(r + 1 for r in range(RANK)), sum(2 * r + 1 for r in range(RANK))
    check(xs[0].grad, mean_a[off_a:off_a + RANK + 1], tag + "[0]")
    check(xs[1].grad, mean_b[off_b:off_b + 2 * RANK + 1], tag + "[1]")
    # allgather of a 0-d tensor: its gradient is 0-d too
    s = torch.tensor(float(RANK), dtype=torch.float64, requires_grad=True)
    (hvd.allgather(s, name="fid.ag0") * torch.arange(1.0, SIZE + 1, dtype=torch.float64)).sum().backward()
    check(s.grad, np.array(RANK + 1.0), "allgather 0-d gradient")
    # broadcast from a non-zero root: the root gets the average, the others zeros
    root = SIZE - 1
    x = make_float(RANK, "fid.bc", (3,)).requires_grad_()
    (hvd.broadcast(x, root, name="fid.bc") * w(RANK, "fid.bc", (3,))).sum().backward()
    expected = np.mean([to_np(w(r, "fid.bc", (3,))) for r in range(SIZE)], axis=0) if RANK == root else np.zeros(3)
    check(x.grad, expected, "broadcast gradient")
    # grouped_reducescatter: allgather of the output gradients, times size for Sum, times the scale factors
    for op_name, op, pre, post in (("Sum", hvd.Sum, 2.0, 0.25), ("Average", hvd.Average, 1.0, 1.0)):
        tag = f"fid.grs.{op_name}"
        xs = [make_float(RANK, tag + ".a", (SIZE, 2)).requires_grad_(),
              make_float(RANK, tag + ".b", (2 * SIZE,)).requires_grad_()]
        ys = hvd.grouped_reducescatter(xs, name=tag, op=op, prescale_factor=pre, postscale_factor=post)
        ((ys[0] * w(RANK, tag + ".a", (1, 2))).sum() + (ys[1] * w(RANK, tag + ".b", (2,))).sum()).backward()
        scale = pre * post * (SIZE if op_name == "Sum" else 1)
        check(xs[0].grad, np.concatenate([to_np(w(r, tag + ".a", (1, 2))) for r in range(SIZE)]) * scale,
              tag + "[0]")
        check(xs[1].grad, np.concatenate([to_np(w(r, tag + ".b", (2,))) for r in range(SIZE)]) * scale,
              tag + "[1]")
    # alltoall without splits is differentiable too
    x = make_float(RANK, "fid.a2a.grad", (SIZE,)).requires_grad_()
    (hvd.alltoall(x, name="fid.a2a.grad") * w(RANK, "fid.a2a.grad", (SIZE,))).sum().backward()
    check(x.grad, np.array([to_np(w(j, "fid.a2a.grad", (SIZE,)))[RANK] for j in range(SIZE)]), "alltoall gradient")


# ----------------------------------------------------------------- broadcast of state
def _model(seed):
    torch.manual_seed(seed)
    return torch.nn.Sequential(torch.nn.Linear(3, 4), torch.nn.ReLU(), torch.nn.Linear(4, 2)).double()


def scenario_broadcast_state():
    root = SIZE - 1
    root_model = _model(root)
    # a list of parameters (model.parameters()), a generator, and bare tensors mixed with pairs
    model = _model(RANK)
    hvd.broadcast_parameters(list(model.parameters()), root_rank=root)
    for p, q in zip(model.parameters(), root_model.parameters()):
        check(p, to_np(q), "broadcast_parameters(list of parameters)")
    model = _model(RANK)
    hvd.broadcast_parameters(model.parameters(), root_rank=root)
    for p, q in zip(model.parameters(), root_model.parameters()):
        check(p, to_np(q), "broadcast_parameters(generator)")
    # Adam with empty state: Horovod creates it with a zero-gradient step; every rank then holds the root's
    model = _model(root)  # same parameters everywhere, as after broadcast_parameters
    opt = torch.optim.Adam(model.parameters(), lr=0.01 * (RANK + 1))
    hvd.broadcast_optimizer_state(opt, root_rank=root)
    assert len(opt.state) == len(list(model.parameters())), "Adam state was not created"
    assert opt.param_groups[0]["lr"] == 0.01 * (root + 1)
    for p in model.parameters():
        check(opt.state[p]["exp_avg"], np.zeros(p.shape), "created exp_avg")
        assert float(opt.state[p]["step"]) == 1.0
        check(p.grad, np.zeros(p.shape), "zero gradient left by the state-creating step")
    # Adam with state on the root only (a checkpoint loaded there): every rank gets it
    opt = torch.optim.Adam(model.parameters(), lr=0.01)
    if RANK == root:
        for p in model.parameters():
            opt.state[p] = {"step": torch.tensor(7.0), "exp_avg": torch.full_like(p, 3.0),
                            "exp_avg_sq": torch.full_like(p, 4.0)}
    hvd.broadcast_optimizer_state(opt, root, model)
    for p in model.parameters():
        check(opt.state[p]["exp_avg"], np.full(p.shape, 3.0), "root's exp_avg")
        assert float(opt.state[p]["step"]) == 7.0
    # the state-creating step leaves the parameters as they were, even with weight decay (Horovod moves them)
    before = [to_np(p).copy() for p in model.parameters()]
    hvd.broadcast_optimizer_state(torch.optim.SGD(model.parameters(), lr=0.5, momentum=0.9, weight_decay=0.1), root)
    for p, b in zip(model.parameters(), before):
        check(p, b, "parameters after creating SGD momentum state with weight decay")
    # plain SGD has no state: hyper-parameters still come from the root
    opt = torch.optim.SGD(model.parameters(), lr=0.1 * (RANK + 1))
    hvd.broadcast_optimizer_state(opt, root_rank=root)
    assert opt.param_groups[0]["lr"] == 0.1 * (root + 1)
    # SGD with momentum over a sparse embedding: the state-creating step uses a sparse gradient
    emb = torch.nn.Embedding(5, 2, sparse=True).double()
    opt = torch.optim.SGD(emb.parameters(), lr=0.1, momentum=0.9)
    hvd.broadcast_optimizer_state(opt, root_rank=root, model=emb)
    assert emb.weight.grad.is_sparse
    # a DistributedOptimizer: the state-creating step does not reduce
    opt = hvd.DistributedOptimizer(torch.optim.Adam(model.parameters(), lr=0.01),
                                   named_parameters=model.named_parameters())
    hvd.broadcast_optimizer_state(opt, root_rank=0)
    assert len(opt.state) == len(list(model.parameters()))
    expect_raises(ValueError, lambda: hvd.broadcast_optimizer_state(
        torch.optim.LBFGS(model.parameters()), 0), "LBFGS")


# ------------------------------------------------------------------ optimizer
def scenario_sparse_optimizer():
    # SparseAdam on a sparse embedding: sparse gradients are allgathered and averaged; with
    # sparse_as_dense they are averaged dense and handed to the optimizer sparse again (as Horovod)
    for sparse_as_dense in (False, True):
        torch.manual_seed(1)
        emb = torch.nn.Embedding(6, 3, sparse=True).double()
        reference = copy.deepcopy(emb)
        opt = hvd.DistributedOptimizer(torch.optim.SparseAdam(emb.parameters(), lr=0.1),
                                       named_parameters=emb.named_parameters(), sparse_as_dense=sparse_as_dense)
        ref_opt = torch.optim.SparseAdam(reference.parameters(), lr=0.1)
        for step in range(2):
            idx = [torch.tensor([(r + step) % 6, (2 * r + 1) % 6]) for r in range(SIZE)]
            weights = [w(r, f"fid.emb.{step}", (2, 3)) for r in range(SIZE)]
            opt.zero_grad()
            (emb(idx[RANK]) * weights[RANK]).sum().backward()
            opt.step()
            assert emb.weight.grad.is_sparse, "the optimizer was not handed a sparse gradient"
            ref_opt.zero_grad()
            total = sum((reference(i) * wt).sum() for i, wt in zip(idx, weights)) / SIZE
            total.backward()
            ref_opt.step()
            check(emb.weight, to_np(reference.weight), f"SparseAdam sparse_as_dense={sparse_as_dense} step {step}")
    # names without named_parameters: Horovod's allreduce.noname.<group>.<index>
    model = _model(0)
    groups = [{"params": list(model[0].parameters())}, {"params": list(model[2].parameters()), "lr": 0.5}]
    opt = hvd.DistributedOptimizer(torch.optim.SGD(groups, lr=0.1))
    params = [list(model[0].parameters()), list(model[2].parameters())]
    for g, group in enumerate(params):
        for i, p in enumerate(group):
            assert opt._parameter_names[p] == f"allreduce.noname.{g}.{i}", opt._parameter_names[p]


# -------------------------------------------------------------------- adasum
def _adasum_pair(a, b):
    dot, na, nb = a @ b, a @ a, b @ b
    return (1 - dot / (2 * na) if na > 0 else 1.0) * a + (1 - dot / (2 * nb) if nb > 0 else 1.0) * b


def _adasum_tree(vectors):
    level = list(vectors)
    while len(level) > 1:
        paired = [_adasum_pair(level[i], level[i + 1]) for i in range(0, len(level) - 1, 2)]
        level = paired + ([level[-1]] if len(level) % 2 else [])
    return level[0]


def scenario_adasum():
    """Linear least squares; every rank's SGD-with-momentum change is combined by Adasum (NumPy reference)."""
    lr, momentum = 0.1, 0.9
    torch.manual_seed(3)
    model = torch.nn.Linear(4, 2).double()
    start = {name: to_np(p).copy() for name, p in model.named_parameters()}
    opt = hvd.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=lr, momentum=momentum),
                                   named_parameters=model.named_parameters(), op=hvd.Adasum)
    params = {name: start[name].copy() for name in start}
    buffers = [{name: None for name in start} for _ in range(SIZE)]
    for step in range(3):
        xs = [to_np(make_float(r, f"fid.ada.x.{step}", (5, 4))) for r in range(SIZE)]
        ys = [to_np(make_float(r, f"fid.ada.y.{step}", (5, 2))) for r in range(SIZE)]
        opt.zero_grad()
        loss = ((model(torch.from_numpy(xs[RANK])) - torch.from_numpy(ys[RANK])) ** 2).mean()
        loss.backward()
        opt.step()
        deltas = {name: [] for name in start}
        for r in range(SIZE):
            residual = xs[r] @ params["weight"].T + params["bias"] - ys[r]
            grads = {"weight": 2 * residual.T @ xs[r] / residual.size, "bias": 2 * residual.sum(0) / residual.size}
            for name in start:
                buf = grads[name] if buffers[r][name] is None else momentum * buffers[r][name] + grads[name]
                buffers[r][name] = buf
                deltas[name].append((-lr * buf).ravel())
        for name in start:
            params[name] = params[name] + _adasum_tree(deltas[name]).reshape(params[name].shape)
        for name, p in model.named_parameters():
            check(p, params[name], f"Adasum optimizer {name} after step {step}")
    expect_raises(AssertionError, lambda: opt.skip_synchronize(), "Adasum")  # as Horovod


# ---------------------------------------------------------------- elastic registry
class _Counter:
    def __init__(self, value):
        self.value = value


def scenario_registry():
    class _CounterHandler(elastic_state.StateHandler):
        def __init__(self, counter):
            super().__init__(counter)
            self.save()

        def save(self):
            self.saved = self.value.value

        def restore(self):
            self.value.value = self.saved

        def sync(self):
            self.value.value = hvd.broadcast_object(self.value.value, root_rank=0, name="fid.counter")

    registry = elastic_state.get_handler_registry()
    assert [t for t, _ in registry][:2] == [torch.nn.Module, torch.optim.Optimizer]
    try:
        elastic_state.set_handler_registry(registry + [(_Counter, _CounterHandler)])
        model = _model(0)
        state = hvd.elastic.TorchState(model, torch.optim.SGD(model.parameters(), lr=0.1),
                                       counter=_Counter(RANK), epoch=1)
        assert isinstance(state._handlers["counter"], _CounterHandler)
        state.counter.value = 10
        state.restore()
        assert state.counter.value == RANK
        state.sync()
        assert state.counter.value == 0
        # rebinding the model: its handler takes the new model, whose state is the new roll-back point
        new_model = _model(5)
        state.model = new_model
        assert state._handlers["model"].value is new_model
        with torch.no_grad():
            for p in new_model.parameters():
                p.add_(1.0)
        state.restore()
        for p, q in zip(new_model.parameters(), _model(5).parameters()):
            check(p, to_np(q), "restored rebound model")
    finally:
        elastic_state.set_handler_registry(registry)


# ------------------------------------------------------------- init(comm=...)
def scenario_comm():
    hvd.allgather(torch.ones(3), name="fid.comm.before_shutdown")
    job = basics.runtime().process_sets[0][1]  # a reference that outlives shutdown() must not matter
    hvd.shutdown()
    # shutdown() joins every thread init() started, Gloo's native workers included: one left to the
    # garbage collector at interpreter exit may abort the process when it releases a tensor
    left = os_threads() - THREADS_BEFORE_INIT
    assert not left, f"threads still running after shutdown() of {type(job).__name__}: {sorted(left)}"
    del job
    from mpi4py import MPI  # starts MPI's own threads: after the check
    # without mpirun every process is its own MPI world: a clear error, nothing started
    if SIZE > 1:
        expect_raises(ValueError, lambda: hvd.init(comm=MPI.COMM_WORLD), "COMM_WORLD", "mpirun")
        assert not hvd.is_initialized()
    expect_raises(ValueError, lambda: hvd.init(comm=[(RANK + 1) % SIZE] if SIZE > 1 else [5]), "init(comm=")
    assert not hvd.is_initialized()
    # 2 ranks: one job of both, numbered in reverse; 3 ranks: ranks 2 and 0 form a job, rank 1 its own
    members = list(reversed(range(SIZE))) if SIZE == 2 else ([2, 0] if RANK != 1 else [1])
    hvd.init(comm=members, process_sets="dynamic")
    assert (hvd.rank(), hvd.size()) == (members.index(RANK), len(members)), (hvd.rank(), hvd.size())
    assert (hvd.local_rank(), hvd.local_size()) == (hvd.rank(), hvd.size())
    got = hvd.allreduce(torch.tensor([float(RANK)]), op=hvd.Sum, name="fid.comm")
    check(got, np.array([float(sum(members))]), "allreduce within init(comm=...)")
    if hvd.size() > 1:
        ps = hvd.add_process_set([0])  # "dynamic": sets can be added after init
        assert ps.included() == (hvd.rank() == 0)
    hvd.shutdown()
    hvd.init()
    hvd.barrier()  # every rank has joined before any shuts down


SCENARIOS = {
    "api": scenario_api,
    "grads": scenario_grads,
    "broadcast_state": scenario_broadcast_state,
    "sparse_optimizer": scenario_sparse_optimizer,
    "adasum": scenario_adasum,
    "registry": scenario_registry,
    "comm": scenario_comm,
}

if __name__ == "__main__":
    run_scenarios(SCENARIOS, sys.argv, RANK)
    hvd.shutdown()
