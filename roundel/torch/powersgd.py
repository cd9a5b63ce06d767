"""PowerSGD gradient compression (Vogels et al., 2019) for ``DistributedOptimizer``.

``compression=hvd.PowerSGD(rank=4, start_iter=10)`` sends each large enough
gradient of two or more dimensions (viewed as an n x m matrix M, its first
dimension by the rest) as two thin matrices, as PyTorch DDP's
``powerSGD_hook`` does:

1. M += the error left over from the last step (error feedback);
2. P = M Q, with Q (m x rank) kept from the last step (warm start; random and
   orthogonalized the first time, the same on every rank); allreduce P
   (average) and orthonormalize its columns;
3. Q = M^T P; allreduce Q (average);
4. the gradient becomes P Q^T, and the error M - P Q^T is kept for the next step.

So (n + m) * rank numbers travel instead of n * m. A gradient with fewer
than two dimensions, or one that the rank would not shrink at least
``min_compression_rate`` times, travels uncompressed (all of a bucket's such
gradients in one allreduce). The first ``start_iter`` steps are plain
allreduces of every gradient, as in DDP (a low-rank start hurts accuracy).

State (Q and the error, one per compressed gradient) lives in the PowerSGD
object: use one object per optimizer. The error doubles the memory of the
compressed gradients, as in DDP. After an elastic reset the optimizer
resets it on every surviving rank, so that survivors and new ranks start
over alike (``start_iter`` plain steps, the same first Q, no error).
"""

from __future__ import annotations

import zlib

import torch

from roundel.common.compression import NoneCompressor
from roundel.ops import ReduceOp
from roundel.torch.mpi_ops import synchronize

__all__ = ["PowerSGD"]


class PowerSGD(NoneCompressor):
    """Low-rank gradient compression with error feedback and warm start; pass it as ``compression=``.

    ``rank``: the rank of the approximation (DDP's ``matrix_approximation_rank``);
    ``start_iter``: steps of plain allreduce first (DDP's ``start_powerSGD_iter``);
    ``min_compression_rate``: compress a gradient only when that shrinks it this many times;
    ``warm_start``: reuse last step's Q (else a new random one each step);
    ``seed``: of the random initial Q (the same on every rank).
    Raises ValueError for a rank below 1, a negative ``start_iter`` or a rate below 1.

    Of the ``Compressor`` interface it reduces buckets itself (``reduce_bucket``),
    keeps state from step to step (``end_step`` counts steps, ``reset`` starts
    over) and reduces with op=Average or op=Sum.
    """

    reduce_ops = frozenset({ReduceOp.Average, ReduceOp.Sum})
    stateful = True
    reduces_buckets = True

    def __init__(self, rank: int = 1, start_iter: int = 10, min_compression_rate: float = 2.0,
                 warm_start: bool = True, seed: int = 0):
        if not isinstance(rank, int) or rank < 1:
            raise ValueError(f"PowerSGD rank={rank!r} must be an integer >= 1")
        if not isinstance(start_iter, int) or start_iter < 0:
            raise ValueError(f"PowerSGD start_iter={start_iter!r} must be an integer >= 0")
        if min_compression_rate < 1:
            raise ValueError(f"PowerSGD min_compression_rate={min_compression_rate!r} must be >= 1")
        self.rank = rank
        self.start_iter = start_iter
        self.min_compression_rate = min_compression_rate
        self.warm_start = warm_start
        self.seed = seed
        self.step = 0  # optimizer steps so far (``DistributedOptimizer`` calls ``end_step()``)
        self._q: dict = {}  # per gradient name: Q of the last step
        self._error: dict = {}  # per gradient name: the error to feed back

    def __repr__(self) -> str:
        return f"PowerSGD(rank={self.rank}, start_iter={self.start_iter})"

    def _shape(self, grad: torch.Tensor):
        """(n, m, r) when ``grad`` is compressed, else None."""
        if grad.dim() < 2 or not grad.dtype.is_floating_point:
            return None
        n = grad.shape[0]
        m = grad.numel() // n
        r = min(self.rank, n, m)
        if (n + m) * r * self.min_compression_rate >= n * m:
            return None
        return n, m, r

    def _initial_q(self, key, m: int, r: int, like: torch.Tensor) -> torch.Tensor:
        gen = torch.Generator().manual_seed(self.seed * 1000003 + _stable_hash(key))
        q = torch.randn(m, r, generator=gen, dtype=torch.float32).to(device=like.device)
        return torch.linalg.qr(q).Q

    def end_step(self) -> None:
        """Count one optimizer step (the first ``start_iter`` are plain allreduces)."""
        self.step += 1

    def reduce_bucket(self, key: str, names: list, grads: list, allreduce) -> callable:
        """Start reducing ``grads`` (a bucket's dense gradients, named ``names``, ``key`` the bucket's name);
        returns a function that waits and returns the reduced gradients, one per input, flat.
        ``allreduce(tensor, name)`` starts an in-place allreduce and returns its handle."""
        step = self.step
        if step < self.start_iter:
            flat = torch.cat([g.reshape(-1) for g in grads])
            handle = allreduce(flat, f"{key}.powersgd_warmup")
            sizes = [g.numel() for g in grads]
            return lambda: synchronize(handle).split(sizes)
        plain = [i for i, g in enumerate(grads) if self._shape(g) is None]
        low = [i for i, g in enumerate(grads) if self._shape(g) is not None]
        plain_handle = None
        if plain:
            plain_flat = torch.cat([grads[i].reshape(-1) for i in plain])
            plain_handle = allreduce(plain_flat, f"{key}.powersgd_plain")
        matrices, ps, qs = [], [], []
        with torch.no_grad():
            for i in low:
                g = grads[i]
                n, m, r = self._shape(g)
                mat = g.reshape(n, m).to(torch.float32)
                error = self._error.get(names[i])
                if error is not None:
                    mat = mat + error
                q = self._q.get(names[i]) if self.warm_start else None
                if q is None or q.shape != (m, r):
                    q = self._initial_q((names[i], step if not self.warm_start else 0), m, r, mat)
                matrices.append(mat)
                qs.append(q)
                ps.append(mat @ q)
            p_flat = torch.cat([p.reshape(-1) for p in ps]) if ps else None
        p_handle = allreduce(p_flat, f"{key}.powersgd_p") if ps else None

        def finish():
            results = [None] * len(grads)
            if plain_handle is not None:
                for i, part in zip(plain, synchronize(plain_handle).split([grads[i].numel() for i in plain])):
                    results[i] = part
            if p_handle is None:
                return results
            with torch.no_grad():
                reduced = synchronize(p_handle).split([p.numel() for p in ps])
                ps_orth = [torch.linalg.qr(p.view(mat.shape[0], -1)).Q for p, mat in zip(reduced, matrices)]
                new_qs = [mat.t() @ p for mat, p in zip(matrices, ps_orth)]
                q_flat = torch.cat([q.reshape(-1) for q in new_qs])
            q_reduced = synchronize(allreduce(q_flat, f"{key}.powersgd_q")).split([q.numel() for q in new_qs])
            with torch.no_grad():
                for i, mat, p, q in zip(low, matrices, ps_orth, q_reduced):
                    q = q.view(mat.shape[1], -1)
                    approx = p @ q.t()
                    self._error[names[i]] = mat - approx
                    self._q[names[i]] = q.clone()
                    results[i] = approx.to(grads[i].dtype).reshape(-1)
            return results

        return finish

    def reset(self) -> None:
        """Forget the step count, warm-start Q and errors (start over with plain allreduce)."""
        self.step = 0
        self._q.clear()
        self._error.clear()


def _stable_hash(key) -> int:
    """A hash of ``key`` that is the same in every process (unlike ``hash`` of a str)."""
    return zlib.crc32(repr(key).encode()) % 1000003
