"""Adasum (Maleki et al., "Scaling Distributed Training with Adaptive Summation", MLSys 2021).

Two gradients combine as
    adasum(a, b) = (1 - a.b / (2 |a|^2)) a + (1 - a.b / (2 |b|^2)) b,
which adds orthogonal gradients and averages parallel ones. More ranks
combine pairwise up a binary tree: ranks (0,1), (2,3), ... first, then the
results of neighbouring pairs, and so on; with a rank count that is not a
power of two, the odd one out at a level moves up unchanged.
"""

from __future__ import annotations

import torch


def adasum_pair(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """Combine two flat float64 gradients; a zero gradient leaves the other unchanged."""
    dot = torch.dot(a, b)
    norm_a = torch.dot(a, a)
    norm_b = torch.dot(b, b)
    coef_a = 1.0 - dot / (2.0 * norm_a) if norm_a > 0 else torch.tensor(1.0, dtype=a.dtype)
    coef_b = 1.0 - dot / (2.0 * norm_b) if norm_b > 0 else torch.tensor(1.0, dtype=a.dtype)
    return coef_a * a + coef_b * b


def adasum_tree(gradients: list[torch.Tensor]) -> torch.Tensor:
    """Combine one flat gradient per rank, in rank order, up the pairwise tree."""
    level = [g.to(torch.float64) for g in gradients]
    while len(level) > 1:
        paired = [adasum_pair(level[i], level[i + 1]) for i in range(0, len(level) - 1, 2)]
        if len(level) % 2:
            paired.append(level[-1])
        level = paired
    return level[0]
