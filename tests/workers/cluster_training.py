"""A short training run under whatever launcher started it (srun, an Indexed Job's pods, roundelrun).

Prints this rank's identity as one line, ``IDENTITY rank size local_rank
local_size cross_rank cross_size hostname``, then trains a small MLP with
``DistributedOptimizer`` on data that every rank can build, checks that its
parameters equal those of one process stepping on the combined batch and
those of every other rank, and prints ``CHECKS PASSED cluster_training``.

``--kill-rank R`` makes rank R kill itself (SIGKILL) after the first step: the
others must then fail with roundel's error, never hang.
"""

import argparse
import os
import signal
import socket

import torch

import roundel.torch as hvd

STEPS = 6
PER_RANK = 8


def make_model():
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(10, 32), torch.nn.Tanh(), torch.nn.Linear(32, 4))


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--kill-rank", type=int, default=-1)
    args = parser.parse_args()
    hvd.init()
    rank, size = hvd.rank(), hvd.size()
    print("IDENTITY", rank, size, hvd.local_rank(), hvd.local_size(), hvd.cross_rank(), hvd.cross_size(),
          socket.gethostname(), flush=True)
    gen = torch.Generator().manual_seed(7)
    data = [(torch.randn(PER_RANK * size, 10, generator=gen), torch.randn(PER_RANK * size, 4, generator=gen))
            for _ in range(STEPS)]
    reference, model = make_model(), make_model()
    ref_opt = torch.optim.SGD(reference.parameters(), lr=0.1, momentum=0.9)
    opt = hvd.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9),
                                   named_parameters=model.named_parameters())
    hvd.broadcast_parameters(model.state_dict(), root_rank=0)
    mine = slice(rank * PER_RANK, (rank + 1) * PER_RANK)
    for step, (x, y) in enumerate(data):
        ref_opt.zero_grad()
        ((reference(x) - y) ** 2).mean().backward()
        ref_opt.step()
        opt.zero_grad()
        ((model(x[mine]) - y[mine]) ** 2).mean().backward()
        opt.step()
        if step == 0 and rank == args.kill_rank:
            os.kill(os.getpid(), signal.SIGKILL)
    flat = torch.cat([p.detach().reshape(-1) for p in model.parameters()])
    expected = torch.cat([p.detach().reshape(-1) for p in reference.parameters()])
    assert torch.allclose(flat, expected, atol=1e-5), f"rank {rank}: parameters differ from one process's"
    everyone = hvd.allgather(flat.unsqueeze(0))
    assert all(torch.equal(everyone[r], flat) for r in range(size)), f"rank {rank}: ranks' parameters differ"
    print("CHECKS PASSED cluster_training", flush=True)
    hvd.shutdown()


if __name__ == "__main__":
    main()
