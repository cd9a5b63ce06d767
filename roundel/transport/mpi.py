"""MPI through ``mpi4py``: collectives on host tensors' own memory.

Used with ``HOROVOD_CPU_OPERATIONS=mpi`` (or ``roundelrun --mpi``) in a job
started by ``mpirun``/``mpiexec``. Each backend owns a private communicator
(a duplicate of, or a group made from, its parent's), so the script's own
``MPI.COMM_WORLD`` traffic never mixes with roundel's.

Buffers go to MPI without a copy (``Tensor.numpy()`` shares the memory),
except where MPI has no matching type: float16 and bfloat16 are *reduced* as a
float32 copy and bool as an int32 copy (the result is narrowed back); for
moving data (gather, broadcast, all-to-all) they travel as raw 16-bit or
8-bit words, without a copy. MPI has no timeouts: a rank that stops blocks
its peers, and a rank that dies makes ``mpirun`` end the job.
"""

from __future__ import annotations

import math

import torch
from mpi4py import MPI

from roundel.ops import ReduceOp
from roundel.transport.backend import RootedBackend

_MPI_OPS = {
    ReduceOp.Sum: MPI.SUM,
    ReduceOp.Average: MPI.SUM,  # the executor divides afterwards
    ReduceOp.Min: MPI.MIN,
    ReduceOp.Max: MPI.MAX,
    ReduceOp.Product: MPI.PROD,
}

# Reduced in a wider type: MPI has no bfloat16, float16 reductions are optional, and
# MPI defines only logical ops on C_BOOL.
_REDUCE_AS = {torch.float16: torch.float32, torch.bfloat16: torch.float32, torch.bool: torch.int32}
# Moved as same-sized words NumPy and MPI both know.
_MOVE_AS = {torch.float16: torch.int16, torch.bfloat16: torch.int16, torch.bool: torch.uint8}


def _words(tensor):
    """A NumPy view of ``tensor``'s memory for moving data (never a copy)."""
    flat = tensor.detach().reshape(-1)
    alias = _MOVE_AS.get(tensor.dtype)
    return (flat if alias is None else flat.view(alias)).numpy()


def _values(tensor):
    """A NumPy view of ``tensor``'s memory for reducing (a type MPI can reduce)."""
    return tensor.detach().reshape(-1).numpy()


def _row_size(tensor) -> int:
    return math.prod(tensor.shape[1:])


class MPIBackend(RootedBackend):
    """Collectives over a private MPI communicator of ``members`` (ranks of ``parent``)."""

    name = "mpi"

    def __init__(self, parent, members):
        members = [int(m) for m in members]
        me = parent.Get_rank()
        if me not in members:
            raise ValueError(f"MPI rank {me} is not one of the members {members}")
        super().__init__(members.index(me), len(members))
        if members == list(range(parent.Get_size())):
            self.comm = parent.Dup()
        else:
            group = parent.Get_group().Incl(members)
            try:
                self.comm = parent.Create_group(group)
            finally:
                group.Free()

    def subset(self, members) -> "MPIBackend":
        """A backend for some of this communicator's members (called by those members only)."""
        return MPIBackend(self.comm, members)

    def allreduce(self, tensor, op):
        wide = _REDUCE_AS.get(tensor.dtype)
        sent = tensor if wide is None else tensor.to(wide)
        self.comm.Allreduce(MPI.IN_PLACE, _values(sent), op=_MPI_OPS[op])
        if sent is not tensor:
            tensor.copy_(sent)

    def allgather(self, output, tensor):
        self.comm.Allgather(_words(tensor), _words(output))

    def broadcast(self, tensor, root):
        self.comm.Bcast(_words(tensor), root=root)

    def reduce(self, tensor, root: int, op) -> None:
        """Reduce ``tensor`` into the root member's copy (the others' are left as they were)."""
        wide = _REDUCE_AS.get(tensor.dtype)
        sent = tensor if wide is None else tensor.to(wide)
        values = _values(sent)
        if self.rank == root:
            self.comm.Reduce(MPI.IN_PLACE, values, op=_MPI_OPS[op], root=root)
            if sent is not tensor:
                tensor.copy_(sent)
        else:
            self.comm.Reduce(values, None, op=_MPI_OPS[op], root=root)

    def gather(self, outputs: list, tensor, root: int) -> None:
        """Gather ``tensor`` from every member into the root's ``outputs`` (one tensor per member)."""
        if self.rank != root:
            self.comm.Gather(_words(tensor), None, root=root)
            return
        received = torch.empty((self.size,) + tuple(tensor.reshape(-1).shape), dtype=tensor.dtype)
        self.comm.Gather(_words(tensor), _words(received), root=root)
        for output, row in zip(outputs, received):
            output.copy_(row.view(output.shape))

    def alltoall(self, output, tensor, output_splits, input_splits):
        send_row, recv_row = _row_size(tensor), _row_size(output)
        send_counts = [n * send_row for n in input_splits]
        recv_counts = [n * recv_row for n in output_splits]
        self.comm.Alltoallv([_words(tensor), (send_counts, _offsets(send_counts))],
                            [_words(output), (recv_counts, _offsets(recv_counts))])

    def reducescatter(self, output, tensor, op):
        wide = _REDUCE_AS.get(tensor.dtype)
        sent_in = tensor if wide is None else tensor.to(wide)
        sent_out = output if wide is None else torch.empty(output.shape, dtype=wide)
        self.comm.Reduce_scatter_block(_values(sent_in), _values(sent_out),
                                       op=_MPI_OPS[op])
        if sent_out is not output:
            output.copy_(sent_out)

    def barrier(self):
        self.comm.Barrier()

    def close(self):
        if self.comm != MPI.COMM_NULL:
            self.comm.Free()


def _offsets(counts):
    offsets, total = [], 0
    for count in counts:
        offsets.append(total)
        total += count
    return offsets
