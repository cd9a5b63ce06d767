"""How a wrapped optimizer or gradient tape reduces gradients: one frozen, checked set of options.

Every adapter's ``DistributedOptimizer`` (and TensorFlow's
``DistributedGradientTape``) turns its Horovod keyword arguments into one
:class:`GradientOptions` when it is created, and hands that object to the
code that reduces the gradients at each step. The arguments are checked
once, here, with the same messages for every framework.
"""

from __future__ import annotations

from dataclasses import InitVar, dataclass
from typing import Any, Callable

from roundel.common.compression import NoneCompressor
from roundel.common.process_sets import ProcessSet, global_process_set
from roundel.ops import ReduceOp, resolve_op

__all__ = ["GradientOptions"]

_GROUPS = "groups= must be an int >= 0 or a list of lists of variables"


@dataclass(frozen=True, eq=False)
class GradientOptions:
    """The gradient-reduction options of one ``DistributedOptimizer`` or ``DistributedGradientTape``.

    Fields, with Horovod's meaning:

    - ``op``: the reduction (a ``ReduceOp`` or its int value; None is Average).
    - ``compression``: a compressor (``compress(t) -> (t, ctx)``,
      ``decompress(t, ctx)``); None is ``NoneCompressor``.
    - ``gradient_predivide_factor``: f > 0 splits Average into 1/f before the
      sum and f/size after it (see ``reduction_scaling``).
    - ``sparse_as_dense``: reduce sparse gradients as dense tensors.
    - ``num_groups``: the number of fused allreduce groups (0: one group).
    - ``groups``: Horovod's ``groups=``: an int (stored as ``num_groups``) or
      lists of variables whose gradients are reduced together (stored as a
      tuple of tuples; every other gradient alone).
    - ``backward_passes_per_step``: local passes accumulated per reduction.
    - ``average_aggregated_gradients``: average (not sum) those passes.
    - ``process_set``: the ``ProcessSet`` the gradients are reduced over.
    - ``scale_local_gradients``: divide local (unreduced) gradients by its size.

    ``variable_key`` (not stored) tells the framework's variables apart for
    checking ``groups``: it returns a hashable key for a variable and None
    for anything else; without it every entry is accepted and keyed by
    identity.

    Raises ValueError for a value out of range (a bad ``op``, a
    ``gradient_predivide_factor`` that is not positive or is used with an op
    other than Average, negative groups, both ``groups`` and ``num_groups``,
    a variable in two groups, ``backward_passes_per_step`` < 1) and TypeError
    for a value of the wrong kind (a compressor without ``compress`` and
    ``decompress``, a ``process_set`` that is not a ``ProcessSet``).
    """

    op: ReduceOp = ReduceOp.Average
    compression: Any = NoneCompressor
    gradient_predivide_factor: float = 1.0
    sparse_as_dense: bool = False
    num_groups: int = 0
    groups: Any = None
    backward_passes_per_step: int = 1
    average_aggregated_gradients: bool = False
    process_set: ProcessSet = global_process_set
    scale_local_gradients: bool = True
    variable_key: InitVar[Callable[[Any], Any] | None] = None

    def __post_init__(self, variable_key) -> None:
        op = resolve_op(self.op)
        self._set("op", op)
        compression = NoneCompressor if self.compression is None else self.compression
        if not (callable(getattr(compression, "compress", None)) and callable(getattr(compression, "decompress", None))):
            raise TypeError(f"compression={compression!r} is not a compressor (it needs compress() and "
                            "decompress()); use hvd.Compression.none, fp16 or bf16")
        self._set("compression", compression)
        factor = self.gradient_predivide_factor
        try:
            factor = float(factor)
        except (TypeError, ValueError):
            raise TypeError(f"gradient_predivide_factor={self.gradient_predivide_factor!r} must be a number") from None
        if not factor > 0.0:
            raise ValueError(f"gradient_predivide_factor={self.gradient_predivide_factor!r} must be positive")
        if factor != 1.0 and op != ReduceOp.Average:
            raise ValueError(f"gradient_predivide_factor applies to op=Average only (got op={op.name})")
        self._set("gradient_predivide_factor", factor)
        num_groups, groups = self._check_groups(variable_key)
        self._set("num_groups", num_groups)
        self._set("groups", groups)
        steps = self.backward_passes_per_step
        if not isinstance(steps, int) or isinstance(steps, bool) or steps < 1:
            raise ValueError(f"backward_passes_per_step={steps!r} must be an int >= 1")
        if not isinstance(self.process_set, ProcessSet):
            raise TypeError(f"process_set must be a ProcessSet, got a {type(self.process_set).__name__}")
        for name in ("sparse_as_dense", "average_aggregated_gradients", "scale_local_gradients"):
            self._set(name, bool(getattr(self, name)))

    def _set(self, name: str, value) -> None:
        object.__setattr__(self, name, value)  # the checked value, before the object is handed out

    def _check_groups(self, variable_key) -> tuple[int, tuple | None]:
        """(num_groups, groups as a tuple of tuples or None) from Horovod's two arguments."""
        try:
            num_groups = int(self.num_groups or 0)
        except (TypeError, ValueError):
            raise TypeError(f"num_groups={self.num_groups!r} must be an int >= 0") from None
        if num_groups < 0:
            raise ValueError(f"num_groups={num_groups} must be an int >= 0")
        groups = self.groups
        if groups is None:
            return num_groups, None
        if num_groups:
            raise ValueError("pass either groups= or num_groups=, not both")
        if isinstance(groups, int) and not isinstance(groups, bool):
            if groups < 0:
                raise ValueError(f"groups={groups}: {_GROUPS}")
            return groups, None
        if not isinstance(groups, (list, tuple)) or not all(isinstance(g, (list, tuple)) for g in groups):
            raise ValueError(_GROUPS)
        seen = set()
        for group in groups:
            for v in group:
                key = id(v) if variable_key is None else variable_key(v)
                if key is None:
                    raise ValueError(f"{_GROUPS}; got a {type(v).__name__}")
                if key in seen:
                    name = getattr(v, "path", None) or getattr(v, "name", None) or repr(v)
                    raise ValueError(f"groups=: variable {name!r} is in more than one group")
                seen.add(key)
        return 0, tuple(tuple(g) for g in groups)

    def reduction_scaling(self, size: int) -> tuple[ReduceOp, float, float]:
        """(op, prescale factor, postscale factor) that reduce as ``op`` with ``gradient_predivide_factor``
        over ``size`` ranks: Average with f != 1 becomes Sum scaled by 1/f before and f/size after it."""
        factor = self.gradient_predivide_factor
        if factor == 1.0:
            return self.op, 1.0, 1.0
        return ReduceOp.Sum, 1.0 / factor, factor / size
