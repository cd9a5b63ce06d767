"""NCCL through ``torch.distributed``: CUDA tensors moved GPU to GPU.

Like the Gloo backend, the process group is made for roundel alone over the
job's rendezvous store. It binds no device when made: each call runs on the
device of the tensors it is given, so a script may call
``torch.cuda.set_device(hvd.local_rank())`` after ``hvd.init()``, as Horovod
scripts do. NCCL allows one rank per GPU: two ranks of a job on one GPU fail
at their first CUDA collective, with an error that says so.

Calls return once the collective is queued on the GPU, without waiting for
it: torch's process group runs it on NCCL's stream after what the calling
thread's current stream has queued, and makes that stream wait for it. The
executor calls them on a stream of roundel's own (``torch.cuda.stream``), so
packing, NCCL and unpacking are ordered there and the training's streams go
on (see ``roundel.common.engine.executor``).

Failures stay bounded and are reported by roundel. The process group's
timeout is roundel's collective timeout (``HOROVOD_GLOO_TIMEOUT_SECONDS``),
not torch's. Unless the user set ``TORCH_NCCL_ASYNC_ERROR_HANDLING`` (or its
older name ``NCCL_ASYNC_ERROR_HANDLING``), it is set to 2 before the first
process group is made: torch's watchdog then aborts the communicators of a
collective that failed or timed out and leaves the process running, where
torch's default (3) would end it with SIGABRT before roundel reports
anything. When the job breaks (a peer is lost), the executor aborts the
communicators (:meth:`NcclBackend.abort`), so no kernel is left waiting on
the dead peer; a call on an aborted communicator raises at once.
"""

from __future__ import annotations

import os
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist

from roundel.errors import RoundelInternalError
from roundel.ops import ReduceOp
from roundel.transport.backend import TORCH_REDUCE_OPS, Backend, narrow_back, shut_down, widened

SHARED_GPU_HINT = ("two ranks of this job use the same GPU, and NCCL allows one rank per GPU: call "
                   "torch.cuda.set_device(hvd.local_rank()) before making CUDA tensors, start at most one rank per "
                   "GPU on each host, or set HOROVOD_GPU_OPERATIONS=gloo to move CUDA tensors through host memory")


#: torch's variable for what its watchdog does on an NCCL error or timeout, under its current and older names.
ASYNC_ERROR_HANDLING_VARS = ("TORCH_NCCL_ASYNC_ERROR_HANDLING", "NCCL_ASYNC_ERROR_HANDLING")


def abort_without_ending_the_process() -> None:
    """Where the user set neither of ``ASYNC_ERROR_HANDLING_VARS``, set the first to 2 (abort the communicators,
    keep the process), so that a rank survives an NCCL failure long enough for roundel to report it. torch reads
    it when a process group is made."""
    if not any(name in os.environ for name in ASYNC_ERROR_HANDLING_VARS):
        os.environ[ASYNC_ERROR_HANDLING_VARS[0]] = "2"


def usable() -> bool:
    """Whether this process can move CUDA tensors over NCCL (torch built with it, and a GPU visible)."""
    return dist.is_nccl_available() and torch.cuda.is_available()


class NcclBackend(Backend):
    """Collectives on CUDA tensors over a private ``ProcessGroupNCCL``."""

    name = "nccl"
    queues_on_device = True

    def __init__(self, store, rank: int, size: int, timeout_s: float):
        """Members ``rank`` of ``size`` meet through ``store`` (shared with the CPU transport); a collective
        that has not finished after ``timeout_s`` (roundel's collective timeout) is aborted by torch's watchdog."""
        super().__init__(rank, size)
        abort_without_ending_the_process()
        options = dist.ProcessGroupNCCL.Options()
        options._timeout = timedelta(seconds=timeout_s)
        # NCCL reads the store (under keys of its own) at each device's first collective, long after this:
        # a store written in Python must stay alive on the Python side until then
        self._stores = (store, dist.PrefixStore("nccl/", store))
        # Any: torch's stub of ProcessGroupNCCL (a c10d Backend) lacks the collectives its pybind11 class has
        self._pg: Any = dist.ProcessGroupNCCL(self._stores[1], rank, size, options)

    @staticmethod
    def _wait(start) -> None:
        """Start a collective (``start()`` returns its work) and make the current stream wait for it (on the
        GPU: the thread does not wait).

        NCCL sets up its communicator at a device's first collective; ranks sharing a GPU fail there, and
        that is raised as a RoundelInternalError that says what to change."""
        try:
            start().wait()
        except RuntimeError as exc:
            if "Duplicate GPU" in str(exc):
                raise RoundelInternalError(f"{SHARED_GPU_HINT} ({exc})") from exc
            raise

    def allreduce(self, tensor, op):
        sent = widened(tensor)
        options = dist.AllreduceOptions()
        options.reduceOp = TORCH_REDUCE_OPS[op]
        self._wait(lambda: self._pg.allreduce([sent], options))
        narrow_back(tensor, sent)

    def allgather(self, output, tensor):
        sent_out, sent_in = widened(output), widened(tensor)
        self._wait(lambda: self._pg._allgather_base(sent_out, sent_in))
        narrow_back(output, sent_out)

    def broadcast(self, tensor, root):
        sent = widened(tensor)
        options = dist.BroadcastOptions()
        options.rootRank = root
        self._wait(lambda: self._pg.broadcast([sent], options))
        narrow_back(tensor, sent)

    def alltoall(self, output, tensor, output_splits, input_splits):
        sent_out, sent_in = widened(output), widened(tensor)
        self._wait(lambda: self._pg.alltoall_base(sent_out, sent_in, list(output_splits), list(input_splits),
                                                  dist.AllToAllOptions()))
        narrow_back(output, sent_out)

    def reducescatter(self, output, tensor, op):
        sent_out, sent_in = widened(output), widened(tensor)
        options = dist.ReduceScatterOptions()
        options.reduceOp = TORCH_REDUCE_OPS[op]
        self._wait(lambda: self._pg._reduce_scatter_base(sent_out, sent_in, options))
        narrow_back(output, sent_out)

    def barrier(self):
        """Reduce one element on the current CUDA device and wait for it."""
        flag = torch.zeros(1, device="cuda")
        self.allreduce(flag, ReduceOp.Sum)
        torch.cuda.synchronize(flag.device)

    def abort(self):
        """Abort the NCCL communicators: a kernel or stream wait stuck on a lost peer ends now, and later calls
        raise, instead of waiting for NCCL's timeout."""
        pg = self._pg
        if pg is None:  # closed
            return
        try:
            pg.abort()
        except RuntimeError:
            pass  # aborted already, by torch's watchdog or an earlier break

    def close(self):
        """Shut the process group down (its NCCL communicators with it) and drop it."""
        pg, self._pg = self._pg, None
        shut_down(pg)
