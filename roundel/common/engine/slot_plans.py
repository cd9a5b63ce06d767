"""How a rank runs a replay slot on the transport, worked out once per slot (a steady step runs the same slots
again and again).

A slot's transfer carries its *agreement*: whether this rank gives the slot up, and its wait in its previous slot
(ms), for rank 0's straggler record (see :mod:`roundel.common.engine.replay`). Three shapes of transfer:

* a small allreduce slot (``ReducedPlan`` with a buffer): its tensors copied into one buffer with the agreement
  after them, one allreduce;
* a small broadcast or allgather slot (``RowsPlan``): one allgather of rows, each a rank's agreement followed by
  its data;
* a larger slot of any kind (``ReducedPlan`` without a buffer): the agreement reduced in a small allreduce of its
  own, then the tensors moved where they are, as a batch from the coordinator would be.

Every copy and scaling here goes in pieces that torch runs on the calling thread (see ``serial_copy``).
"""

from __future__ import annotations

import math
from typing import Callable, Sequence

import numpy as np
import torch

from roundel.common.control.records import OpKind
from roundel.common.engine.replay import Slot
from roundel.transport.backend import scale

# An allreduce slot of at least this many bytes agrees in a small transfer of its own, then reduces its tensors
# where they are; a smaller one copies them into one buffer with the agreement after them. On 2 cores, 2 ranks,
# shared memory off, a blocking 256 KiB allreduce (benchmarks/latency.py): roundel's own share 0.09 ms this way
# against 0.21 ms copied; shared memory on, 0.91 of raw Gloo this way against 0.83-1.05 copied.
SLOT_OWN_BYTES = 128 * 1024

# A broadcast or allgather slot runs as one allgather of rows while the rows a rank receives from the others stay
# within this many bytes (on the peer links, one exchange); a larger one agrees on its own first.
ROWS_BYTES = 128 * 1024

# A slot's copies and scaling go in pieces of at most this many elements, below torch's intra-op parallel grain:
# a rank that runs a slot on its own thread, with the job's other ranks on the same cores, must not wake
# torch's pool (its threads spin against the other processes' for milliseconds).
_SERIAL_ELEMENTS = 16384

# a row of a RowsPlan: the agreement (two float32) padded to this, then the data, padded to a multiple of it
# (so that every row, and the data in it, starts where any dtype's view may start)
_ROW_ALIGN = 16


def _pieces(tensor: torch.Tensor) -> list:
    flat = tensor.view(-1)
    return [flat] if flat.numel() <= _SERIAL_ELEMENTS else list(flat.split(_SERIAL_ELEMENTS))


class grad_off:
    """``with grad_off():`` is ``with torch.no_grad():`` at about a quarter of its cost (0.9 against 3.4 us
    here), for the slot a blocking call runs."""

    __slots__ = ("_was",)

    def __enter__(self) -> None:
        self._was = torch.is_grad_enabled()
        torch._C._set_grad_enabled(False)

    def __exit__(self, *exc_info) -> None:
        torch._C._set_grad_enabled(self._was)


def serial_copy(destinations: list, sources: list, cut: bool = True) -> None:
    """``destinations[i].copy_(sources[i])`` for each i (under ``grad_off()``), in pieces that torch runs on
    the calling thread (``cut`` False: every tensor is small enough already)."""
    if cut and all(t.is_contiguous() for t in (*destinations, *sources)):
        destinations = [piece for t in destinations for piece in _pieces(t)]
        sources = [piece for t in sources for piece in _pieces(t)]
    torch._foreach_copy_(destinations, sources)


def serial_scale(buffer: torch.Tensor, factor: float) -> None:
    """Multiply ``buffer`` by ``factor`` in pieces that torch runs on the calling thread."""
    if factor != 1.0:
        for piece in _pieces(buffer):
            scale(piece, factor)


class ReducedPlan:
    """An allreduce slot, or a large slot of any kind, whose agreement travels in an allreduce.

    The agreement is ``1 + members`` cells: whether some rank gave the slot up, then each rank's wait, this
    rank's at its place. A small allreduce slot's tensors are copied into ``buffer`` (``inputs`` and ``tensors``
    are its views) with the agreement after them, and take one transport call; a slot of at least
    SLOT_OWN_BYTES, and a broadcast or allgather slot too large for rows (``buffer`` None, ``inputs`` and
    ``tensors`` empty), agrees on its own, then moves the tensors without a copy. The agreement is read and
    written through a NumPy view where its dtype has one (touching a tensor's element costs microseconds).
    """

    def __init__(self, slot: Slot, rank: int, members: int, slot_buffer: Callable[[torch.dtype, int], torch.Tensor]):
        requests = slot.requests
        self._place = 1 + rank
        dtype = getattr(torch, requests[0].dtype)
        shapes = tuple(torch.Size(r.shape) for r in requests)
        sizes = [math.prod(shape) for shape in shapes]
        total = sum(sizes)
        self.cut = max(sizes) > _SERIAL_ELEMENTS
        self.prescale = requests[0].prescale
        self.result_scale = requests[0].result_scale(members)
        self.buffer: torch.Tensor | None = None
        self.inputs: list = []
        self.tensors = torch.empty(0)
        if slot.kind != OpKind.ALLREDUCE or total * dtype.itemsize >= SLOT_OWN_BYTES:
            self.agreement = torch.zeros(1 + members)
        else:
            self.buffer = slot_buffer(dtype, total + 1 + members)
            self.inputs = [piece.view(shape) for piece, shape in zip(self.buffer[:total].split(sizes), shapes)]
            self.tensors = self.buffer[:total]
            self.agreement = self.buffer[total:]
        self._integral = not self.agreement.is_floating_point()
        self._cells = self.agreement if self.agreement.dtype == torch.bfloat16 else self.agreement.numpy()

    def fill_agreement(self, giving_up: bool, wait_ms: float) -> None:
        """This rank's agreement: whether it gives the slot up, and its wait in its previous slot."""
        cells = self._cells
        cells[:] = 0
        cells[0] = 1 if giving_up else 0
        cells[self._place] = round(wait_ms) if self._integral else wait_ms

    def given_up(self) -> bool:
        """After the transfer: whether some rank gave the slot up."""
        return bool(self._cells[0] != 0)

    def waits(self) -> list:
        """After the transfer: every rank's wait in its previous slot (ms)."""
        return self._cells[1:].tolist()


def _row_shapes(slot: Slot, members: int) -> list:
    """Each rank's tensor shapes in a broadcast or allgather ``slot`` (a broadcast's: the root's, everywhere)."""
    if slot.kind == OpKind.BROADCAST:
        return [[tuple(r.shape) for r in slot.requests]] * members
    return [[(dims[rank],) + tuple(r.shape[1:]) for dims, r in zip(slot.first_dims, slot.requests)]
            for rank in range(members)]


def _row_width(shapes: list, itemsize: int) -> int:
    data = max(sum(math.prod(shape) for shape in per_rank) for per_rank in shapes) * itemsize
    return _ROW_ALIGN + -(-data // _ROW_ALIGN) * _ROW_ALIGN


class RowsPlan:
    """A broadcast or allgather slot that runs as one allgather of ``members`` rows of bytes (``rows``, this
    rank's sent from ``send``). Each row is a rank's agreement (whether it gives the slot up, its wait in its
    previous slot: two float32) followed by its data: a broadcast's tensors (only the root's row carries them),
    an allgather's tensors with the first dimensions every rank had last time. A rank that gives the slot up
    sends its agreement with whatever its row held."""

    def __init__(self, slot: Slot, rank: int, root: int | None, members: int):
        """``root``: a broadcast's root, as a member of the job (None for an allgather)."""
        self.root = root
        self.sends_data = root is None or root == rank
        dtype = getattr(torch, slot.requests[0].dtype)
        shapes = _row_shapes(slot, members)
        width = _row_width(shapes, dtype.itemsize)
        self.rows = torch.zeros(members * width, dtype=torch.uint8)
        self.send = torch.zeros(width, dtype=torch.uint8)
        self._heads = self.rows.numpy().view(np.float32).reshape(members, -1)[:, :2]
        self._head = self.send.numpy()[:8].view(np.float32)

        def data(row: torch.Tensor, r: int) -> list:
            counts = [math.prod(shape) for shape in shapes[r]]
            flat = row[_ROW_ALIGN:_ROW_ALIGN + sum(counts) * dtype.itemsize].view(dtype).split(counts)
            return [piece.view(shape) for piece, shape in zip(flat, shapes[r])]

        table = self.rows.view(members, width)
        self.inputs = data(self.send, rank)  # where this rank's tensors go
        self.received = [data(table[r], r) for r in range(members)]  # [rank][name], as that rank sent it
        self._dtype = dtype
        self._gathered = [(sum(per_rank[i][0] for per_rank in shapes),) + shape[1:]
                          for i, shape in enumerate(shapes[0])] if root is None else []
        # an allgather's output i, cut in rank order into each rank's part: the parts' sizes, and the parts as
        # received (flat views, made once: a view costs a microsecond)
        self._parts = [[math.prod(per_rank[i]) for per_rank in shapes] for i in range(len(shapes[0]))]
        self._received_parts = [received[i].view(-1) for i in range(len(shapes[0])) for received in self.received]
        self.cut = any(math.prod(shape) > _SERIAL_ELEMENTS for per_rank in shapes for shape in per_rank)

    @staticmethod
    def fits(slot: Slot, members: int) -> bool:
        """Whether ``slot`` runs in rows: a broadcast or allgather whose rows from the others stay within
        ROWS_BYTES."""
        if slot.kind not in (OpKind.BROADCAST, OpKind.ALLGATHER):
            return False
        itemsize = getattr(torch, slot.requests[0].dtype).itemsize
        return (members - 1) * _row_width(_row_shapes(slot, members), itemsize) <= ROWS_BYTES

    def fill_agreement(self, giving_up: bool, wait_ms: float) -> None:
        """This rank's agreement: whether it gives the slot up, and its wait in its previous slot."""
        self._head[0] = 1 if giving_up else 0
        self._head[1] = wait_ms

    def given_up(self) -> bool:
        """After the transfer: whether some rank gave the slot up."""
        return any(self._heads[:, 0].tolist())  # for a few rows, a quarter of NumPy's any()

    def waits(self) -> list:
        """After the transfer: every rank's wait in its previous slot (ms)."""
        return self._heads[:, 1].tolist()

    def results(self, tensors: list, outputs: list) -> list:
        """After the transfer: a broadcast's ``outputs`` (for this rank's ``tensors``) filled with the root's
        tensors, or each allgather's tensors from every rank's row, in rank order."""
        if self.root is None:
            gathered = [torch.empty(shape, dtype=self._dtype) for shape in self._gathered]
            into = [part for output, sizes in zip(gathered, self._parts) for part in output.view(-1).split(sizes)]
            serial_copy(into, self._received_parts, self.cut)
            return gathered
        into, sources = [], []
        for output, tensor, source in zip(outputs, tensors, self.received[self.root]):
            if not (self.sends_data and output is tensor):  # the root's own tensor holds its result already
                into.append(output)
                sources.append(source)
        if into:
            serial_copy(into, sources, self.cut)
        return outputs


def plan_slot(slot: Slot, ranks: Sequence[int], rank: int, slot_buffer: Callable[[torch.dtype, int], torch.Tensor]):
    """How this ``rank`` (its place among the job's ``ranks``) runs ``slot``: a RowsPlan where it fits, else a
    ReducedPlan (``slot_buffer(dtype, numel)``: reusable memory for a small allreduce slot)."""
    if RowsPlan.fits(slot, len(ranks)):
        root = ranks.index(slot.requests[0].root_rank) if slot.kind == OpKind.BROADCAST else None
        return RowsPlan(slot, rank, root, len(ranks))
    return ReducedPlan(slot, rank, len(ranks), slot_buffer)
