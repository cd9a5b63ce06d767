"""Checks of DistributedOptimizer(shard_optimizer_state=True), run under roundelrun.

Each check trains the same model twice in this job, with the sharded and the
unsharded DistributedOptimizer on the same per-rank batches, and compares the
parameters; it also checks the per-rank state bytes, the state_dict round
trip, broadcast_optimizer_state and elastic TorchState save/restore/sync.
"""

import copy
import math

import torch

import roundel.torch as hvd

STEPS = 20
RTOL, ATOL = 1e-5, 1e-6


def make_model(seed=0):
    torch.manual_seed(seed)
    # 7*13+13 + 13*5+5 = 174 elements: not a multiple of 2 or 3, so the last slice is padded
    return torch.nn.Sequential(torch.nn.Linear(7, 13), torch.nn.Tanh(), torch.nn.Linear(13, 5))


def batch(step):
    gen = torch.Generator().manual_seed(1000 * step + hvd.rank())
    return torch.randn(8, 7, generator=gen), torch.randn(8, 5, generator=gen)


def train(model, opt, steps, first=0):
    for step in range(first, first + steps):
        x, y = batch(step)
        opt.zero_grad()
        ((model(x) - y) ** 2).mean().backward()
        opt.step()


def pair(make_opt):
    """A sharded and an unsharded optimizer over two copies of the model (two parameter groups)."""
    out = []
    for shard in (True, False):
        model = make_model()
        groups = [{"params": model[0].parameters()}, {"params": model[2].parameters(), "lr": 0.003}]
        opt = hvd.DistributedOptimizer(make_opt(groups), named_parameters=model.named_parameters(),
                                       shard_optimizer_state=shard)
        out.append((model, opt))
    return out


def assert_close(a, b, what):
    for (name, p), q in zip(a.named_parameters(), b.parameters()):
        assert torch.allclose(p, q, rtol=RTOL, atol=ATOL), (
            f"{what}: {name} differs from the unsharded optimizer by {(p - q).abs().max().item()}")


def state_bytes(opt):
    return sum(v.numel() * v.element_size() for s in opt.state.values() for v in s.values()
               if isinstance(v, torch.Tensor) and v.dim() > 0)


def adam(groups):
    return torch.optim.Adam(groups, lr=0.01, weight_decay=0.01)


def sgd(groups):
    return torch.optim.SGD(groups, lr=0.05, momentum=0.9, nesterov=True)


def check_equivalence_and_bytes():
    n = hvd.size()
    for name, make_opt in (("adam", adam), ("sgd+momentum", sgd)):
        (model, opt), (ref, ref_opt) = pair(make_opt)
        train(model, opt, STEPS)
        train(ref, ref_opt, STEPS)
        assert_close(model, ref, f"{name}, {STEPS} steps at {n} ranks")
        sharded = sum(v.numel() * v.element_size() for s in opt._inner.state.values() for v in s.values()
                      if isinstance(v, torch.Tensor) and v.dim() > 0)
        full = state_bytes(ref_opt)
        keys = 2 if name == "adam" else 1  # exp_avg and exp_avg_sq; momentum_buffer
        # two segments (one per group), each padded to a multiple of n elements
        bound = sum(keys * 4 * math.ceil(t / n) for t in (7 * 13 + 13, 13 * 5 + 5))
        assert sharded == bound, f"{name}: {sharded} bytes of state on this rank, expected {bound}"
        assert sharded <= full / n + keys * 4 * 2 * (n - 1), (sharded, full)
        print(f"STATE BYTES {name} rank {hvd.rank()} sharded {sharded} unsharded {full} ratio {full / sharded:.3f}")


def check_state_dict_round_trip():
    (model, opt), (ref, ref_opt) = pair(adam)
    train(model, opt, 5)
    train(ref, ref_opt, 5)
    full, ref_full = opt.state_dict(), ref_opt.state_dict()
    assert sorted(full["state"]) == sorted(ref_full["state"]), (sorted(full["state"]), sorted(ref_full["state"]))
    for k, state in ref_full["state"].items():
        for key, value in state.items():
            assert torch.allclose(full["state"][k][key], value, rtol=RTOL, atol=ATOL), (k, key)
    assert [{k: v for k, v in g.items()} for g in full["param_groups"]] == ref_full["param_groups"]
    # the sharded dict loads into a new sharded optimizer, the unsharded one's too; both continue as the reference
    for source in (full, ref_full):
        copy_model = make_model(seed=1)
        copy_model.load_state_dict(model.state_dict())
        groups = [{"params": copy_model[0].parameters()}, {"params": copy_model[2].parameters(), "lr": 0.5}]
        copy_opt = hvd.DistributedOptimizer(adam(groups), named_parameters=copy_model.named_parameters(),
                                            shard_optimizer_state=True)
        copy_opt.load_state_dict(source)
        assert copy_opt.param_groups[1]["lr"] == 0.003
        train(copy_model, copy_opt, 5, first=5)
        ref_copy = make_model()
        ref_copy.load_state_dict(ref.state_dict())
        ref_copy_opt = hvd.DistributedOptimizer(adam([{"params": ref_copy[0].parameters()},
                                                      {"params": ref_copy[2].parameters(), "lr": 0.003}]),
                                                named_parameters=ref_copy.named_parameters())
        ref_copy_opt.load_state_dict(ref_full)
        train(ref_copy, ref_copy_opt, 5, first=5)
        assert_close(copy_model, ref_copy, "after load_state_dict and 5 more steps")


def check_broadcast_and_elastic_state():
    (model, opt), (ref, ref_opt) = pair(sgd)
    if hvd.rank() == 1:
        opt.param_groups[0]["lr"] = 123.0
    hvd.broadcast_parameters(model.state_dict(), root_rank=0)
    hvd.broadcast_optimizer_state(opt, root_rank=0)
    assert opt.param_groups[0]["lr"] == 0.05, opt.param_groups[0]["lr"]
    train(model, opt, 3)
    train(ref, ref_opt, 3)
    hvd.broadcast_optimizer_state(opt, root_rank=0)  # with state: gathered, broadcast, re-sharded
    state = hvd.elastic.TorchState(model=model, optimizer=opt, batch=3)
    state.save()
    ref_state = {k: v.clone() for k, v in ref.state_dict().items()}
    ref_opt_state = copy.deepcopy(ref_opt.state_dict())
    train(model, opt, 4, first=3)  # lost on restore
    state.restore()
    state.sync()
    train(model, opt, 4, first=3)
    ref.load_state_dict(ref_state)
    ref_opt.load_state_dict(ref_opt_state)
    train(ref, ref_opt, 4, first=3)
    assert_close(model, ref, "elastic TorchState restore + sync")


def check_clip_grad_norm():
    (model, opt), (ref, ref_opt) = pair(adam)
    for step in range(5):
        for m, o in ((model, opt), (ref, ref_opt)):
            x, y = batch(step)
            o.zero_grad()
            (10 * ((m(x) - y) ** 2).mean()).backward()
            if o is opt:
                norm = o.clip_grad_norm_(0.5)
                o.step()
            else:
                o.synchronize()
                ref_norm = torch.nn.utils.clip_grad_norm_(m.parameters(), 0.5)
                with o.skip_synchronize():
                    o.step()
        assert abs(norm.item() - ref_norm.item()) <= 1e-4 * ref_norm.item(), (norm, ref_norm)
        assert norm.item() > 0.5  # the clipping took effect
    assert_close(model, ref, "clip_grad_norm_")


def check_two_backward_passes():
    models = []
    for shard in (True, False):
        model = make_model()
        opt = hvd.DistributedOptimizer(sgd(model.parameters()), named_parameters=model.named_parameters(),
                                       backward_passes_per_step=2, shard_optimizer_state=shard)
        for step in range(4):
            opt.zero_grad()
            for k in range(2):
                x, y = batch(10 * step + k)
                (((model(x) - y) ** 2).mean() / 2).backward()
            opt.step()
        models.append(model)
    assert_close(models[0], models[1], "backward_passes_per_step=2")


def check_errors():
    model = make_model()
    for kwargs, expect in ((dict(compression=hvd.Compression.fp16), "compression"),
                           (dict(op=hvd.Adasum), "Adasum"),
                           (dict(process_set=hvd.ProcessSet([0])), "process set"),
                           (dict(sparse_as_dense=True), "sparse")):
        try:
            hvd.DistributedOptimizer(sgd(model.parameters()), named_parameters=model.named_parameters(),
                                     shard_optimizer_state=True, **kwargs)
        except ValueError as exc:
            assert expect in str(exc), (expect, str(exc))
        else:
            raise AssertionError(f"no ValueError for shard_optimizer_state=True with {kwargs}")


if __name__ == "__main__":
    hvd.init()
    check_equivalence_and_bytes()
    check_state_dict_round_trip()
    check_broadcast_and_elastic_state()
    check_clip_grad_norm()
    check_two_backward_passes()
    check_errors()
    print("CHECKS PASSED torch_zero")
