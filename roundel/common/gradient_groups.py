"""How gradients are split into fused allreduce groups (``num_groups=``, ``groups=``); pure Python.

Shared by ``roundel.tensorflow`` and ``roundel.keras`` (on every Keras
backend), so that neither has to import the other's framework for it.
"""

from __future__ import annotations


def split(indices: list, num_groups: int) -> list[list]:
    """``indices`` cut into ``num_groups`` consecutive groups (one group when ``num_groups`` is 0).

    Raises ValueError for a negative ``num_groups``.
    """
    if num_groups < 0:
        raise ValueError(f"num_groups={num_groups} must be >= 0")
    if not indices:
        return []
    count = min(num_groups, len(indices)) if num_groups else 1
    size, extra = divmod(len(indices), count)
    groups, start = [], 0
    for i in range(count):
        end = start + size + (1 if i < extra else 0)
        groups.append(indices[start:end])
        start = end
    return groups


def group_indices(indices: list, num_groups: int = 0, groups=None) -> list[list]:
    """The allreduce groups of ``indices``: ``groups`` when given (lists of indices; each of the other
    ``indices`` alone, as in Horovod), else ``num_groups`` consecutive groups (see ``split``)."""
    if groups is None:
        return split(indices, num_groups)
    wanted = set(indices)
    chosen = [[i for i in group if i in wanted] for group in groups]
    chosen = [group for group in chosen if group]
    taken = {i for group in chosen for i in group}
    return chosen + [[i] for i in indices if i not in taken]
