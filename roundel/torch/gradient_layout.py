"""What the torch adapter's distributed optimizers share: names, size-capped buckets, the out-of-order error.

``DistributedOptimizer`` (``roundel.torch.optimizer``) and its sharded form
(``roundel.torch.sharded_optimizer``) both name the parameters as Horovod
does, both split them into buckets of about a cap in bytes in backward order
as PyTorch DDP does, and both raise ``GradientSyncError`` when the training
loop calls them in an order that would race with the reduction. They import
these from here, and the optimizer module builds on the sharded one, never
the other way.
"""

from __future__ import annotations

from roundel.errors import RoundelError

__all__ = ["FIRST_BUCKET_BYTES", "GradientSyncError", "MIB", "check_bucket_cap", "parameter_names",
           "split_by_size"]

MIB = 1024 * 1024
FIRST_BUCKET_BYTES = MIB  # the first bucket closes early, so that communication starts early, as in DDP


class GradientSyncError(RoundelError, AssertionError):
    """The training loop called the optimizer in an order that would race with gradient reduction."""


def parameter_names(optimizer_groups, named) -> dict:
    """Map each parameter to its name; raise ValueError for bad, duplicate or missing names.

    Without ``named`` (``model.named_parameters()``) the names are Horovod's:
    ``allreduce.noname.<group>.<index>``.
    """
    if named is None:
        return {p: f"allreduce.noname.{g}.{i}" for g, group in enumerate(optimizer_groups)
                for i, p in enumerate(group["params"])}
    pairs = list(named)
    if any(not (isinstance(pair, tuple) and len(pair) == 2) for pair in pairs):
        raise ValueError("named_parameters must be a sequence of (name, parameter) tuples, as "
                         "model.named_parameters() gives")
    seen, duplicates = set(), set()
    for name, _ in pairs:
        (duplicates if name in seen else seen).add(name)
    if duplicates:
        raise ValueError(f"named_parameters has duplicate names: {', '.join(sorted(duplicates))}; "
                         "each parameter needs a unique name")
    names = {p: name for name, p in pairs}
    unnamed = [p for group in optimizer_groups for p in group["params"] if p not in names]
    if unnamed:
        shapes = ", ".join(str(tuple(p.shape)) for p in unnamed[:5])
        raise ValueError(f"{len(unnamed)} parameter(s) of the optimizer are missing from named_parameters "
                         f"(shapes {shapes}); pass model.named_parameters() of the model being optimized")
    return names


def check_bucket_cap(bucket_cap_mb) -> None:
    """Raise ValueError unless ``bucket_cap_mb`` is a number >= 0."""
    if isinstance(bucket_cap_mb, bool) or not (isinstance(bucket_cap_mb, (int, float)) and bucket_cap_mb >= 0):
        raise ValueError(f"bucket_cap_mb={bucket_cap_mb!r} must be a number >= 0 (megabytes per bucket; "
                         "0 reduces each gradient on its own)")


def split_by_size(params: list, cap_bytes: float) -> list[tuple]:
    """Consecutive parameters (in backward order) in buckets, each closed once it reaches the cap.

    The first bucket closes at 1 MiB, so that communication starts early, as
    in DDP. A bucket holds one dtype on one device, so that it fits one flat
    buffer.
    """
    buckets, current, size, limit = [], [], 0, min(cap_bytes, FIRST_BUCKET_BYTES)
    for p in params:
        if current and (p.dtype, p.device) != (current[0].dtype, current[0].device):
            buckets.append(tuple(current))
            current, size = [], 0
        current.append(p)
        size += p.numel() * p.element_size()
        if size >= limit:
            buckets.append(tuple(current))
            current, size, limit = [], 0, cap_bytes
    return buckets + [tuple(current)] if current else buckets
