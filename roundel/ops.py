"""Reduction operators, with the values and names Horovod exposes."""

import enum


class ReduceOp(enum.IntEnum):
    """How allreduce and reducescatter combine the ranks' tensors."""

    Average = 0
    Sum = 1
    Adasum = 2
    Min = 3
    Max = 4
    Product = 5


Average = ReduceOp.Average
Sum = ReduceOp.Sum
Adasum = ReduceOp.Adasum
Min = ReduceOp.Min
Max = ReduceOp.Max
Product = ReduceOp.Product


def resolve_op(op, average=None, default=ReduceOp.Average) -> ReduceOp:
    """Combine the ``op=`` argument with Horovod's legacy ``average=`` flag.

    Raises ValueError when both are given or ``op`` is not a known operator.
    """
    if average is not None:
        if op is not None:
            raise ValueError("pass either op= or the legacy average= argument, not both")
        return ReduceOp.Average if average else ReduceOp.Sum
    if op is None:
        return default
    if type(op) is ReduceOp:  # hvd.Sum and the like: skip the enum lookup, on every collective
        return op
    try:
        return ReduceOp(int(op))
    except (ValueError, TypeError):
        raise ValueError(
            f"op={op!r} is not a reduction operator; use hvd.Average, hvd.Sum, hvd.Min, "
            "hvd.Max, hvd.Product or hvd.Adasum"
        ) from None
