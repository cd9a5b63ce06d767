"""Gloo through ``torch.distributed``: a process group made for roundel alone.

The group is built directly (not with ``init_process_group``), so a script may
also use ``torch.distributed``'s default group without any clash.
"""

from __future__ import annotations

from datetime import timedelta

import torch
import torch.distributed as dist

from roundel.common.ops import ReduceOp
from roundel.transport.backend import Backend

_TORCH_OPS = {
    ReduceOp.Sum: dist.ReduceOp.SUM,
    ReduceOp.Average: dist.ReduceOp.SUM,
    ReduceOp.Min: dist.ReduceOp.MIN,
    ReduceOp.Max: dist.ReduceOp.MAX,
    ReduceOp.Product: dist.ReduceOp.PRODUCT,
}

# Gloo has no kernels for these; they travel widened and come back narrowed.
_WIDENED = {torch.int16: torch.int32, torch.uint16: torch.int32, torch.uint32: torch.int64}


def _wire(tensor):
    wide = _WIDENED.get(tensor.dtype)
    return tensor if wide is None else tensor.to(wide)


def _back(original, sent) -> None:
    if sent is not original:
        original.copy_(sent)


class GlooBackend(Backend):
    """Collectives over a private ``ProcessGroupGloo``."""

    name = "gloo"

    def __init__(self, store, rank: int, size: int, timeout_s: float, hostname: str = ""):
        super().__init__(rank, size)
        options = dist.ProcessGroupGloo._Options()
        options._timeout = timedelta(seconds=timeout_s)
        options._devices = [dist.ProcessGroupGloo.create_device(hostname=hostname)]
        self._pg = dist.ProcessGroupGloo(store, rank, size, options)

    def allreduce(self, tensor, op):
        sent = _wire(tensor)
        options = dist.AllreduceOptions()
        options.reduceOp = _TORCH_OPS[op]
        self._pg.allreduce([sent], options).wait()
        _back(tensor, sent)

    def allgather(self, output, tensor):
        sent_out, sent_in = _wire(output), _wire(tensor)
        self._pg._allgather_base(sent_out, sent_in).wait()
        _back(output, sent_out)

    def broadcast(self, tensor, root):
        sent = _wire(tensor)
        options = dist.BroadcastOptions()
        options.rootRank = root
        self._pg.broadcast([sent], options).wait()
        _back(tensor, sent)

    def alltoall(self, output, tensor, output_splits, input_splits):
        sent_out, sent_in = _wire(output), _wire(tensor)
        self._pg.alltoall_base(sent_out, sent_in, list(output_splits), list(input_splits),
                               dist.AllToAllOptions()).wait()
        _back(output, sent_out)

    def reducescatter(self, output, tensor, op):
        sent_out, sent_in = _wire(output), _wire(tensor)
        options = dist.ReduceScatterOptions()
        options.reduceOp = _TORCH_OPS[op]
        self._pg.reduce_scatter([sent_out], [list(sent_in.chunk(self.size))], options).wait()
        _back(output, sent_out)

    def barrier(self):
        self._pg.barrier().wait()

    def close(self):
        try:
            self._pg.shutdown()
        except RuntimeError:
            pass
