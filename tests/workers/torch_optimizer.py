"""Checks of DistributedOptimizer and state broadcast, run under roundelrun.

Every check compares distributed training with one process stepping on the
whole (concatenated) batch, computed here in the same process.
"""

import sys
import warnings

import numpy as np
import torch

import roundel.torch as hvd

TOL = 1e-5
FP16_TOL = 2e-2


def make_model(seed=0):
    torch.manual_seed(seed)
    return torch.nn.Sequential(torch.nn.Linear(6, 16), torch.nn.Tanh(), torch.nn.Linear(16, 3))


def batches(steps, per_rank, n):
    gen = torch.Generator().manual_seed(1234)
    return [(torch.randn(per_rank * n, 6, generator=gen), torch.randn(per_rank * n, 3, generator=gen))
            for _ in range(steps)]


def mine(t, per_rank):
    r = hvd.rank()
    return t[r * per_rank:(r + 1) * per_rank]


def loss_fn(model, x, y):
    return ((model(x) - y) ** 2).mean()


def train_pair(make_opt, steps=4, per_rank=4, passes=1, set_to_none=True, on_backward=None, replace_grads=False,
               **dist_kwargs):
    """Train distributed and single-process; return both models' parameters.

    ``on_backward(opt, model, step)`` runs after each step's backward passes, before ``opt.step()``;
    ``replace_grads`` gives every parameter a new zero ``.grad`` after ``zero_grad()``.
    """
    n = hvd.size()
    data = batches(steps, per_rank * passes, n)
    ref = make_model()
    ref_opt = make_opt(ref.parameters())
    model = make_model()
    opt = hvd.DistributedOptimizer(make_opt(model.parameters()), named_parameters=model.named_parameters(),
                                   backward_passes_per_step=passes, **dist_kwargs)
    for step, (x, y) in enumerate(data):
        ref_opt.zero_grad()
        loss_fn(ref, x, y).backward()
        ref_opt.step()
        opt.zero_grad(set_to_none=set_to_none)
        if replace_grads:
            for p in model.parameters():
                p.grad = torch.zeros_like(p)
        xs, ys = mine(x, per_rank * passes), mine(y, per_rank * passes)
        for k in range(passes):
            sl = slice(k * per_rank, (k + 1) * per_rank)
            (loss_fn(model, xs[sl], ys[sl]) / passes).backward()
        if on_backward is not None:
            on_backward(opt, model, step)
        opt.step()
    return model, ref


def assert_close(model, ref, tol, what):
    for (name, p), q in zip(model.named_parameters(), ref.parameters()):
        diff = (p.detach() - q.detach()).abs().max().item()
        assert diff <= tol, f"{what}: parameter {name} differs from single-process training by {diff} > {tol}"


def assert_same_on_all_ranks(model, what):
    for name, p in model.named_parameters():
        spread = (hvd.allreduce(p.detach(), op=hvd.Max) - hvd.allreduce(p.detach(), op=hvd.Min)).abs().max()
        assert spread.item() == 0.0, f"{what}: parameter {name} differs across ranks by {spread.item()}"


def sgd(params):
    return torch.optim.SGD(params, lr=0.1, momentum=0.9)


def adam(params):
    return torch.optim.Adam(params, lr=0.01)


def adamw(params):
    return torch.optim.AdamW(params, lr=0.01, weight_decay=0.1)


def check_equivalence():
    for name, make_opt in (("sgd+momentum", sgd), ("adam", adam), ("adamw", adamw)):
        model, ref = train_pair(make_opt)
        assert_close(model, ref, TOL, name)
    model, ref = train_pair(sgd, passes=2)
    assert_close(model, ref, TOL, "backward_passes_per_step=2")
    model, ref = train_pair(adam, compression=hvd.Compression.fp16)
    assert_close(model, ref, FP16_TOL, "fp16 compression")
    assert_same_on_all_ranks(model, "fp16 compression")
    model, ref = train_pair(sgd, compression=hvd.Compression.bf16)
    assert_close(model, ref, FP16_TOL, "bf16 compression")
    model, ref = train_pair(sgd, num_groups=2)
    assert_close(model, ref, TOL, "num_groups=2")
    model, ref = train_pair(sgd, groups=1)
    assert_close(model, ref, TOL, "groups=1")
    model, ref = train_pair(sgd, gradient_predivide_factor=2.0)
    assert_close(model, ref, TOL, "gradient_predivide_factor=2")
    for cap in (0, 0.0001):  # each gradient on its own; two buckets of two parameters
        for passes in (1, 2):
            model, ref = train_pair(adam, passes=passes, bucket_cap_mb=cap)
            assert_close(model, ref, TOL, f"bucket_cap_mb={cap}, backward_passes_per_step={passes}")
    model, ref = train_pair(sgd, compression=hvd.Compression.fp16, bucket_cap_mb=0.0001)
    assert_close(model, ref, FP16_TOL, "fp16 compression in two buckets")


def assert_grads_are_bucket_views(opt, model, step):
    """From the second step on, every gradient lies in its bucket's flat buffer (after backward, before step)."""
    if step == 0:
        return
    for name, p in model.named_parameters():
        bucket = next(b for b in opt._buckets if any(q is p for q in b.params))
        if len(bucket.params) == 1:
            continue
        start = bucket.flat.data_ptr()
        end = start + bucket.flat.numel() * bucket.flat.element_size()
        assert start <= p.grad.data_ptr() < end, f"step {step}: {name}.grad is not a view into its bucket"


def check_bucket_views():
    """Gradients as bucket views: equivalence at 1 and 2 passes, zero_grad both ways; .grad lives in the bucket."""
    for cap in (25, 0.0001):  # one bucket of four parameters; two of two
        for passes in (1, 2):
            for set_to_none in (True, False):
                what = f"bucket views, bucket_cap_mb={cap}, passes={passes}, set_to_none={set_to_none}"
                model, ref = train_pair(sgd, steps=3, passes=passes, set_to_none=set_to_none,
                                        on_backward=assert_grads_are_bucket_views, bucket_cap_mb=cap)
                assert_close(model, ref, TOL, what)
    # user code that replaces .grad before backward: copied into the bucket, .grad points at the view again
    model, ref = train_pair(adam, steps=3, replace_grads=True)
    assert_close(model, ref, TOL, "bucket views with .grad replaced before every backward")


def check_rebuilt_order():
    """After step 1 the buckets follow the order gradients became ready, the same on every rank."""
    torch.manual_seed(0)
    model = torch.nn.ModuleDict({"head": torch.nn.Linear(8, 2), "body": torch.nn.Linear(4, 8)})  # run body first
    hvd.broadcast_parameters(model.state_dict(), 0)
    opt = hvd.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1),
                                   named_parameters=model.named_parameters(), bucket_cap_mb=0.00005)
    names = {p: n for n, p in model.named_parameters()}
    registration_reversed = [n.split(".")[0] for b in opt._buckets for n in map(names.get, b.params)]
    assert registration_reversed[0] == "body", registration_reversed
    for _ in range(2):
        opt.zero_grad()
        model["head"](model["body"](torch.randn(3, 4))).sum().backward()
        opt.step()
    rebuilt = [names[p] for b in opt._buckets for p in b.params]
    assert [n.split(".")[0] for n in rebuilt] == ["head", "head", "body", "body"], rebuilt
    bucket_names = [b.name for b in opt._buckets]
    assert any(".rebuilt." in n for n in bucket_names), bucket_names
    everyone = hvd.allgather_object(bucket_names)
    assert all(n == bucket_names for n in everyone), f"ranks rebuilt different buckets: {everyone}"


def check_cap_from_environment(expected_mb: float):
    """Without bucket_cap_mb the cap comes from ROUNDEL_BUCKET_CAP_MB (roundelrun --bucket-cap-mb); the keyword wins."""
    model = torch.nn.Sequential(torch.nn.Linear(512, 512), torch.nn.Linear(512, 512))  # 1 MiB weights
    default = hvd.DistributedOptimizer(sgd(model.parameters()), named_parameters=model.named_parameters())
    sizes = [len(b.params) for b in default._buckets]
    expected = [1, 1, 1, 1] if expected_mb == 0 else [2, 2]  # 0: each gradient alone; 25: 1 MiB then the rest
    assert sizes == expected, f"bucket sizes {sizes} with the cap from the environment, expected {expected}"
    keyword = hvd.DistributedOptimizer(sgd(model.parameters()), named_parameters=model.named_parameters(),
                                       bucket_cap_mb=25)
    assert [len(b.params) for b in keyword._buckets] == [2, 2], "bucket_cap_mb= did not win over the environment"


def check_sum_op():
    """op=Sum: the step equals single-process training on the sum of the ranks' losses."""
    n = hvd.size()
    (x, y), = batches(1, 4, n)
    ref = make_model()
    ref_opt = sgd(ref.parameters())
    sum(loss_fn(ref, x[r * 4:(r + 1) * 4], y[r * 4:(r + 1) * 4]) for r in range(n)).backward()
    ref_opt.step()
    model = make_model()
    opt = hvd.DistributedOptimizer(sgd(model.parameters()), named_parameters=model.named_parameters(), op=hvd.Sum)
    loss_fn(model, mine(x, 4), mine(y, 4)).backward()
    opt.step()
    assert_close(model, ref, TOL, "op=Sum")


def adasum_reference(vectors):
    level = [v.astype(np.float64) for v in vectors]
    while len(level) > 1:
        nxt = []
        for i in range(0, len(level) - 1, 2):
            a, b = level[i], level[i + 1]
            dot, aa, bb = a @ b, a @ a, b @ b
            nxt.append((1 - dot / (2 * aa)) * a + (1 - dot / (2 * bb)) * b)
        if len(level) % 2:
            nxt.append(level[-1])
        level = nxt
    return level[0]


def check_adasum():
    n = hvd.size()
    rng = np.random.default_rng(7)
    vectors = [rng.standard_normal(50).astype(np.float32) for _ in range(n)]
    got = hvd.allreduce(torch.from_numpy(vectors[hvd.rank()]), op=hvd.Adasum, name="adasum.vec")
    np.testing.assert_allclose(got.numpy(), adasum_reference(vectors), rtol=1e-5, atol=1e-6)
    # fused: several tensors in one batch must each get their own combination
    shapes = [(3,), (4, 5), (7,)]
    per_rank = [[rng.standard_normal(s).astype(np.float32) for s in shapes] for _ in range(n)]
    handles = [hvd.allreduce_async(torch.from_numpy(per_rank[hvd.rank()][i]), op=hvd.Adasum, name=f"adasum.f{i}")
               for i in range(len(shapes))]
    for i, handle in enumerate(handles):
        expected = adasum_reference([per_rank[r][i].ravel() for r in range(n)]).reshape(shapes[i])
        np.testing.assert_allclose(hvd.synchronize(handle).numpy(), expected, rtol=1e-5, atol=1e-6)
    # through the optimizer: the update is -lr * adasum(grads)
    (x, y), = batches(1, 4, n)
    grads = []
    for r in range(n):
        m = make_model()
        loss_fn(m, x[r * 4:(r + 1) * 4], y[r * 4:(r + 1) * 4]).backward()
        grads.append([p.grad.numpy().ravel() for p in m.parameters()])
    model = make_model()
    start = [p.detach().clone() for p in model.parameters()]
    opt = hvd.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.5),
                                   named_parameters=model.named_parameters(), op=hvd.Adasum)
    loss_fn(model, mine(x, 4), mine(y, 4)).backward()
    opt.step()
    for i, (p, p0) in enumerate(zip(model.parameters(), start)):
        expected = p0.numpy().ravel() - 0.5 * adasum_reference([g[i] for g in grads])
        np.testing.assert_allclose(p.detach().numpy().ravel(), expected, rtol=1e-5, atol=1e-6)


def check_broadcast_state():
    model = make_model(seed=100 + hvd.rank())  # deliberately different on every rank
    opt = torch.optim.Adam(model.parameters(), lr=0.01)
    if hvd.rank() == 0:  # only the root has stepped: its state is non-empty, the others' empty
        loss_fn(model, torch.randn(4, 6), torch.randn(4, 3)).backward()
        opt.step()
        opt.param_groups[0]["lr"] = 0.0042
    hvd.broadcast_parameters(model.state_dict(), root_rank=0)
    hvd.broadcast_optimizer_state(opt, root_rank=0)
    assert_same_on_all_ranks(model, "broadcast_parameters")
    assert opt.param_groups[0]["lr"] == 0.0042, opt.param_groups[0]["lr"]
    state = opt.state_dict()["state"]
    assert len(state) == 4, f"rank {hvd.rank()} has optimizer state for {len(state)} params, expected 4"
    for key in ("exp_avg", "exp_avg_sq"):
        t = state[0][key]
        assert torch.equal(hvd.broadcast(t, 0), t), f"optimizer state {key} differs from rank 0"
    # an optimizer whose state is empty everywhere, and named_parameters as the argument form
    fresh = make_model(seed=200 + hvd.rank())
    hvd.broadcast_parameters(fresh.named_parameters(), root_rank=0)
    assert_same_on_all_ranks(fresh, "broadcast_parameters(named_parameters)")
    empty = torch.optim.SGD(fresh.parameters(), lr=0.3, momentum=0.5)
    hvd.broadcast_optimizer_state(empty, root_rank=0)
    assert empty.param_groups[0]["momentum"] == 0.5


def check_training_loop_rules():
    model = make_model()
    opt = hvd.DistributedOptimizer(sgd(model.parameters()), named_parameters=model.named_parameters())
    loss_fn(model, torch.randn(4, 6), torch.randn(4, 3)).backward()
    try:
        opt.zero_grad()
    except AssertionError as exc:
        assert "zero_grad" in str(exc)
    else:
        raise AssertionError("zero_grad() with reductions in flight did not raise")
    opt.synchronize()  # clipping pattern
    torch.nn.utils.clip_grad_norm_(model.parameters(), 0.1)
    with opt.skip_synchronize():
        opt.step()
    loss_fn(model, torch.randn(4, 6), torch.randn(4, 3)).backward()
    opt.synchronize()
    with warnings.catch_warnings(record=True) as caught:  # Horovod's test_synchronize_step_warning
        warnings.simplefilter("always")
        opt.step()
    assert len(caught) == 1 and "optimizer.step() called without optimizer.skip_synchronize() context after " \
        "optimizer.synchronize(). This can cause training slowdown." in str(caught[0].message), caught
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        opt.zero_grad()
    for bad, needle in (([("a", p) for p in model.parameters()], "duplicate"),
                        (list(model.named_parameters())[:2], "missing"),
                        ([p for p in model.parameters()], "(name, parameter)")):
        try:
            hvd.DistributedOptimizer(sgd(model.parameters()), named_parameters=bad)
        except ValueError as exc:
            assert needle in str(exc), str(exc)
        else:
            raise AssertionError(f"bad named_parameters ({needle}) was accepted")


def check_unused_and_frozen():
    """A parameter unused on one rank and a frozen one: no hang, gradients agree (with and without buckets).

    The second step runs on the buckets rebuilt after the first (the unused parameter never became ready).
    """
    for cap in (25, 0):
        model = torch.nn.ModuleDict({"a": torch.nn.Linear(3, 3), "b": torch.nn.Linear(3, 3),
                                     "frozen": torch.nn.Linear(3, 3)})
        for p in model["frozen"].parameters():
            p.requires_grad_(False)
        hvd.broadcast_parameters(model.state_dict(), 0)
        opt = hvd.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1),
                                       named_parameters=model.named_parameters(), bucket_cap_mb=cap)
        x = torch.ones(2, 3)
        for step in range(2):
            opt.zero_grad()
            out = model["a"](x) if hvd.rank() == 0 else model["b"](model["a"](x))
            out.sum().backward()
            if hvd.rank() == 0 and step == 0:  # a bucket waits for the unused gradients: still part of this step
                try:
                    opt.zero_grad()
                except AssertionError as exc:
                    assert "zero_grad" in str(exc)
                else:
                    raise AssertionError(f"zero_grad() with a bucket partly ready did not raise (cap {cap})")
            opt.step()
            assert_same_on_all_ranks(model, f"unused parameter (bucket_cap_mb={cap}, step {step})")


def check_sparse():
    """A sparse gradient alone and in a bucket with a dense one (whose gradient is all ones on every rank).

    Two steps of the same constant gradients: the second on the rebuilt buckets (the sparse one alone).
    """
    for dense, cap in ((False, 0), (True, 0), (False, 25), (True, 25)):
        torch.manual_seed(0)
        emb = torch.nn.Embedding(10, 4, sparse=True)
        lin = torch.nn.Linear(4, 4)
        lin_start = [p.detach().clone() for p in lin.parameters()]
        named = list(emb.named_parameters(prefix="emb")) + list(lin.named_parameters(prefix="lin"))
        opt = hvd.DistributedOptimizer(torch.optim.SGD([p for _, p in named], lr=1.0), named_parameters=named,
                                       sparse_as_dense=dense, bucket_cap_mb=cap)
        idx = torch.tensor([hvd.rank(), 5])
        for _ in range(2):
            opt.zero_grad()
            (emb(idx).sum() + lin(torch.ones(1, 4)).sum()).backward()
            opt.step()
        for p, p0 in zip(lin.parameters(), lin_start):
            assert torch.allclose(p.detach(), p0 - 2.0), f"dense gradient beside a sparse one (cap {cap}) is off"
        expected = torch.zeros(10, 4)
        for r in range(hvd.size()):
            expected[r] += 1.0 / hvd.size()
        expected[5] += 1.0
        torch.manual_seed(0)
        start = torch.nn.Embedding(10, 4).weight.detach()
        diff = (start - emb.weight.detach() - 2 * expected).abs().max().item()
        assert diff < 1e-6, f"sparse gradient (sparse_as_dense={dense}) update off by {diff}"


def check_process_sets():
    """Horovod's test_optimizer_process_sets: an optimizer on the even ranks beside two disjoint sets.

    The even ranks average their gradients; an odd rank steps on its own gradient alone (no reduction, no
    error), and removing both sets afterwards completes.
    """
    evens = hvd.add_process_set(range(0, hvd.size(), 2))
    odds = hvd.add_process_set(range(1, hvd.size(), 2))
    mine_set = evens if hvd.rank() % 2 == 0 else odds
    model, ref = make_model(), make_model()
    torch.manual_seed(hvd.rank())
    x, y = torch.randn(8, 6), torch.randn(8, 3)
    opt = hvd.DistributedOptimizer(sgd(model.parameters()), named_parameters=model.named_parameters(),
                                   process_set=evens)
    for step in range(2):
        opt.zero_grad()
        loss_fn(model, x, y).backward()
        opt.step()
    gathered = hvd.allgather(model[2].weight.detach().reshape(1, -1), process_set=mine_set)
    if mine_set is evens:
        assert all(torch.equal(row, gathered[0]) for row in gathered), "even ranks' parameters differ"
    else:
        ref_opt = sgd(ref.parameters())
        for step in range(2):
            ref_opt.zero_grad()
            loss_fn(ref, x, y).backward()
            ref_opt.step()
        assert_close(model, ref, TOL, "a rank outside the optimizer's process set (local step)")
        assert all(not torch.equal(row, gathered[mine_set.rank()]) for i, row in enumerate(gathered)
                   if i != mine_set.rank()), "odd ranks' parameters agree though never reduced"
    assert hvd.remove_process_set(odds) and hvd.remove_process_set(evens)


def check_training():
    """Every check of distributed training against one process on the whole batch."""
    for check in (check_equivalence, check_bucket_views, check_rebuilt_order, check_sum_op, check_adasum,
                  check_broadcast_state, check_training_loop_rules, check_unused_and_frozen, check_sparse):
        check()


SCENARIOS = {
    "training": check_training,
    "process-sets": check_process_sets,
    "default-cap": lambda: check_cap_from_environment(25),  # no ROUNDEL_BUCKET_CAP_MB: 25 MB, as Horovod
}


if __name__ == "__main__":
    # torch_optimizer.py [SCENARIO[,SCENARIO...]] (default: training), each ending in
    # "CHECKS PASSED <scenario>"; or torch_optimizer.py cap-from-environment EXPECTED_MB
    hvd.init()
    if sys.argv[1:2] == ["cap-from-environment"]:
        check_cap_from_environment(float(sys.argv[2]))
        print("CHECKS PASSED torch_optimizer")
        sys.exit(0)
    for scenario in (sys.argv[1] if len(sys.argv) > 1 else "training").split(","):
        SCENARIOS[scenario]()
        print(f"CHECKS PASSED {scenario}", flush=True)
