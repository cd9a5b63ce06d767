"""Allreduce, reducescatter, allgather, broadcast, reduce, gather and barrier among one host's ranks, in shared memory.

Loopback TCP is far slower than copying memory; so when every member of a
communicator runs on one host, this backend wraps its Gloo one and takes these
collectives off the network:

* Every member maps one segment of ``/dev/shm`` (made by member 0 with mode
  0600, and unlinked as soon as every member has mapped it, so nothing is
  left behind however the job ends). It holds two banks, each of one slot per
  member and a result area, ``SLOT_BYTES`` each.
* A collective copies each member's data into its slot, then waits until
  every member has done so, at a :class:`~roundel.transport.host_barrier.HostBarrier`
  over Unix sockets (each member listens in a private 0700 directory of its
  own; a wait costs ``log2 N`` messages per member). Tensors larger than a
  slot go in slot-sized pieces.
* An allreduce of more than ``DIRECT_BYTES`` is a reduce-scatter and an
  allgather inside the segment: member ``m`` combines the ``m``-th share of
  each piece over every slot, in member order (so every member gets the same
  bits), into the result area, and every member copies the result out after
  the next wait, which is also the wait after the next piece's copy in. A
  member's own share of its slot is read by no one else, so it is combined
  straight from the member's input and not copied in (when the copy would
  not scale it). Each member reads about twice the data whatever the member
  count. Smaller ones are combined whole by every member after a single wait;
  a fused batch of many small tensors goes in, as one range, and out in one
  call each (``MANY_SMALL_BYTES``), not a few calls per tensor.
* Calls alternate between the two banks: a member that runs ahead into the
  next piece writes the other bank, and it can only come back to this one
  after every member has passed the next wait, so no slot or result is
  overwritten while someone still reads it.
* A peer that dies closes its sockets and the wait raises ``RuntimeError``,
  as a transport failure does; a wait longer than the collective timeout
  raises it too, and a failed wait fails every member's (see the barrier).

Reduce (to one member, for the hierarchical collectives) is the allreduce
with only the root copying the result out; gather has only the root reading
the slots; reducescatter has each member combine only its own chunk.
Alltoall, and dtypes outside ``ARITHMETIC_DTYPES`` (bool, complex), go to
the wrapped backend.
:func:`attach` sets the segment up, or returns the wrapped backend unchanged
on every member when any member cannot (no ``/dev/shm``, no room).
"""

from __future__ import annotations

import logging
import math
import mmap
import os
import shutil
import socket
import struct
import tempfile
import uuid
from typing import Callable

import numpy as np
import torch

from roundel.ops import ReduceOp
from roundel.transport.backend import (ARITHMETIC_DTYPES, COMBINE, SUM_OPS, RootedBackend, ShapedViews, flat_array,
                                      has_flat_array, narrow_back, scale, widened, widens)
from roundel.transport.host_barrier import HostBarrier

log = logging.getLogger("roundel")

SLOT_BYTES = 4 << 20
DIRECT_BYTES = 1 << 20  # a reduction up to this size is combined whole by every member, after one wait
MANY_SMALL_BYTES = 64 << 10  # a direct fused allreduce of tensors this small on average goes as one range
SMALL_BYTES = 64 << 10  # a Sum or Average allreduce, or an allgather, up to this size goes through NumPy views
_VIEWS_KEPT = 8192  # views of the segment kept: four per tensor (two banks, slot and result) of 2,000 tensors
_SHARE_ALIGNMENT = 16  # elements: members' shares of a piece start 64 bytes apart or more (float32)
_PAIRWISE: dict[ReduceOp, Callable[..., torch.Tensor]] = {
    ReduceOp.Sum: torch.add, ReduceOp.Average: torch.add, ReduceOp.Min: torch.minimum, ReduceOp.Max: torch.maximum,
    ReduceOp.Product: torch.mul}
_ARRAYS_KEPT = 256  # the NumPy views of small collectives kept for that many dtypes and sizes at most
# the dtypes whose small collectives go through NumPy (not bfloat16, which has no NumPy dtype, nor the widened ones)
_NUMPY_DTYPES = frozenset({torch.float16, torch.float32, torch.float64, torch.int8, torch.uint8, torch.int32,
                           torch.int64})
_RANK = struct.Struct("!i")
_OWN = ("allreduce", "allgather", "broadcast", "barrier", "reduce", "gather", "reducescatter")  # moved here


def attach(inner: RootedBackend, store, timeout_s: float) -> RootedBackend:
    """``inner`` wrapped in a :class:`SharedMemoryBackend` of the same members (all on this host), or
    ``inner`` itself on every member when the segment cannot be set up on some member."""
    if inner.size == 1:
        return inner
    try:
        return SharedMemoryBackend(inner, store, timeout_s)
    except _NotShared as exc:
        log.info("roundel: collectives stay on %s (no shared memory: %s)", inner.name, exc)
        return inner


def _small(tensor: torch.Tensor) -> bool:
    """Whether a collective of ``tensor`` goes through NumPy views: small but not empty (an empty one waits for no
    one), contiguous, of a dtype NumPy has, and neither a conjugate nor a negative view (which have no NumPy view).
    Either way it takes one bank and one wait, with the same data at the start of every member's slot, so members
    may differ in the way they take."""
    return (tensor.dtype in _NUMPY_DTYPES and 0 < tensor.numel() * tensor.element_size() <= SMALL_BYTES
            and has_flat_array(tensor))


def _combine(out, rows: list, op) -> None:
    """Combine ``rows`` (one per member, in member order) into ``out`` with ``op``."""
    pairwise, combine = _PAIRWISE[ReduceOp(op)], COMBINE[ReduceOp(op)]
    pairwise(rows[0], rows[1], out=out)
    for row in rows[2:]:
        combine(out, row)


def _pieces(sizes: list[int], per_slot: int) -> list[tuple[int, list]]:
    """The slot-sized pieces of the concatenation of tensors of ``sizes`` elements: for each, its element
    count and its spans ``(where in the slot, which tensor, where in the tensor, elements)``."""
    pieces, spans, filled = [], [], 0
    for which, size in enumerate(sizes):
        where = 0
        while where < size:
            take = min(size - where, per_slot - filled)
            spans.append((filled, which, where, take))
            filled, where = filled + take, where + take
            if filled == per_slot:
                pieces.append((filled, spans))
                spans, filled = [], 0
    if filled:
        pieces.append((filled, spans))
    return pieces


def _span_pairs(tensors: list, spans: list, area, views: ShapedViews) -> tuple[list, list]:
    """For a piece's ``spans``: the parts of ``tensors`` and the matching parts of ``area`` (a slot or
    result), in span order. A whole tensor is paired, as it is, with a kept view of ``area`` shaped as it
    (``views``: where the views are kept); a tensor's part, flat, with a slice."""
    own, shared = [], []
    for at, which, where, take in spans:
        tensor = tensors[which]
        if where == 0 and take == tensor.numel():
            own.append(tensor)
            shared.append(views.at(area, at, tensor.shape))
        else:
            own.append(tensor.view(-1)[where:where + take])
            shared.append(area[at:at + take])
    return own, shared


def _many_small(spans: list, itemsize: int) -> bool:
    """Whether a piece's ``spans`` are of many tensors of at most ``MANY_SMALL_BYTES`` on average, which
    take fewer calls as one range than one by one."""
    at, _, _, take = spans[-1]
    return 1 < len(spans) and (at + take) * itemsize <= len(spans) * MANY_SMALL_BYTES


def _copy_in(sources: list, spans: list, slot, on_copy: float, prescale: float, views: ShapedViews) -> None:
    """Copy a piece's ``spans`` of ``sources`` into ``slot``, times ``on_copy``, then apply ``prescale``;
    in one call, then one scaling of the range for many small tensors."""
    if not spans:
        return
    parts, into = _span_pairs(sources, spans, slot, views)
    at, _, _, take = spans[-1]
    if on_copy == 1.0 or _many_small(spans, slot.element_size()):
        torch._foreach_copy_(into, parts)
        scale(slot[:at + take], on_copy)  # a scaled copy covers the whole piece: the same products
    else:
        for target, part in zip(into, parts):
            torch.mul(part, on_copy, out=target)
    scale(slot[:at + take], prescale)


def _outside(spans: list, low: int, high: int) -> list:
    """``spans`` less the elements ``[low, high)`` of their piece."""
    kept = []
    for at, which, where, take in spans:
        for start, end in ((at, min(at + take, low)), (max(at, high), at + take)):
            if start < end:
                kept.append((start, which, where + start - at, end - start))
    return kept


def _within_one(sources: list, spans: list, low: int, high: int):
    """The elements ``[low, high)`` of a piece as a view of the one source they lie in, or None when they
    run across sources."""
    for at, which, where, take in spans:
        if at <= low and high <= at + take:
            return sources[which].view(-1)[where + low - at:where + high - at]
    return None


def _copy_out(targets: list, spans: list, result, views: ShapedViews) -> None:
    """Copy a piece's reduced ``result`` into its ``spans`` of ``targets``, in one call."""
    if spans:
        outs, parts = _span_pairs(targets, spans, result, views)
        torch._foreach_copy_(outs, parts)


def _scaling(dtype: torch.dtype, op, prescale: float, postscale: float) -> tuple[float, float, float]:
    """(factor applied while copying an input into its slot, prescale and postscale left to apply).

    In float32 and float64 the prescale rides on the copy; so does the
    postscale of a sum or average when it is a power of two (an average over
    2, 4, 8... members), as halving every input is then exactly halving
    their sum (subnormals aside), and the results need no pass of their own.
    Integers, float16 and bfloat16 keep the separate passes.
    """
    if dtype not in (torch.float32, torch.float64):
        return 1.0, prescale, postscale
    exact = ReduceOp(op) in (ReduceOp.Sum, ReduceOp.Average) and postscale > 0 and math.frexp(postscale)[0] == 0.5
    return (prescale * postscale, 1.0, 1.0) if exact else (prescale, 1.0, postscale)


class _NotShared(Exception):
    """Some member could not set the segment up (every member raises it alike)."""


class SharedMemoryBackend(RootedBackend):
    """Collectives through a segment of shared memory; the others by ``inner``."""

    def __init__(self, inner: RootedBackend, store, timeout_s: float):
        super().__init__(inner.rank, inner.size)
        self.inner = inner
        self.name = "shm"
        self._timeout_s = timeout_s
        self._calls = 0
        self._path: str | None = None
        self._mapping: mmap.mmap | None = None
        self._memory: torch.Tensor | None = None
        self._peers: dict[int, socket.socket] = {}
        self._barrier: HostBarrier | None = None
        self._views: dict = {}
        self._arrays: dict = {}  # (dtype, elements) -> per bank, each member's slot as NumPy (see _next_arrays)
        # slots, result and scratch areas cut as the tensors of fused batches (a few views per tensor)
        self._shaped = ShapedViews(kept=_VIEWS_KEPT)
        self._scratch: dict = {}  # dtype -> this member's own DIRECT_BYTES, for results of many small tensors
        directory = tempfile.mkdtemp(prefix="roundel-shm-")
        try:
            self._connect(store, directory)
        except BaseException:
            self._release()
            raise
        finally:
            shutil.rmtree(directory, ignore_errors=True)

    # ------------------------------------------------------------------ setup
    def _connect(self, store, directory: str) -> None:
        listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        try:
            path = os.path.join(directory, "wait")
            try:
                listener.bind(path)
                listener.listen(self.size)
                listener.settimeout(self._timeout_s)
                problem = ""
            except OSError as exc:
                problem = f"cannot listen on {path}: {exc}"
            store.set(f"socket/{self.rank}", path.encode())
            problem = self._map(store) or problem  # member 0 always answers: the others wait for it
            store.set(f"mapped/{self.rank}", problem.encode())
            problems = [store.get(f"mapped/{m}").decode() for m in range(self.size)]
            if any(problems):
                raise _NotShared("; ".join(f"rank {m}: {p}" for m, p in enumerate(problems) if p))
            for peer in range(self.size):  # connect to the lower members, then accept the higher ones
                if peer < self.rank:
                    sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
                    self._peers[peer] = sock
                    sock.settimeout(self._timeout_s)
                    sock.connect(store.get(f"socket/{peer}").decode())
                    sock.sendall(_RANK.pack(self.rank))
            accepted: set[int] = set()
            while len(accepted) < self.size - 1 - self.rank:
                sock, _ = listener.accept()
                sock.settimeout(self._timeout_s)
                try:
                    (peer,) = _RANK.unpack(_receive_exactly(sock, _RANK.size))
                except BaseException:
                    sock.close()
                    raise
                if not self.rank < peer < self.size or peer in accepted:
                    sock.close()
                    raise RuntimeError(f"shared-memory setup: a connection claimed to be member {peer}")
                self._peers[peer] = sock
                accepted.add(peer)
        except (OSError, EOFError) as exc:
            raise RuntimeError(f"shared-memory setup failed: {exc}") from exc
        finally:
            listener.close()
        self._barrier = HostBarrier(self.rank, self.size, self._peers)
        self._barrier.wait()
        if self.rank == 0 and self._path is not None:  # member 0 made the segment
            os.unlink(self._path)  # every member has it mapped
        self._path = None

    def _map(self, store) -> str:
        """Map the segment (member 0 makes it); returns what went wrong here, "" if nothing."""
        size = 2 * (self.size + 1) * SLOT_BYTES
        try:
            if self.rank == 0:
                self._path = f"/dev/shm/roundel-{uuid.uuid4().hex}"
                descriptor = os.open(self._path, os.O_RDWR | os.O_CREAT | os.O_EXCL, 0o600)
                try:
                    os.posix_fallocate(descriptor, 0, size)  # no room fails here, not as SIGBUS later
                except OSError:
                    os.unlink(self._path)
                    raise
                store.set("segment", self._path.encode())
            else:
                self._path = store.get("segment").decode()
                if not self._path:
                    return "member 0 could not make the segment"
                descriptor = os.open(self._path, os.O_RDWR)
            try:
                if os.fstat(descriptor).st_size != size:
                    return f"{self._path} is not the segment this job made"
                self._mapping = mmap.mmap(descriptor, size)
            finally:
                os.close(descriptor)
        except OSError as exc:
            if self.rank == 0:
                store.set("segment", b"")
            return str(exc)
        self._memory = torch.frombuffer(self._mapping, dtype=torch.uint8)
        return ""

    # ------------------------------------------------------------------ slots
    def _wait(self) -> None:
        """Wait at the host barrier until every member has reached the same point."""
        assert self._barrier is not None  # set up before any collective
        self._barrier.wait()

    def _next_bank(self) -> int:
        """Which bank the next call uses: they alternate (see the module's docstring)."""
        bank = self._calls % 2
        self._calls += 1
        return bank

    def _bank(self, dtype: torch.dtype) -> tuple[list, torch.Tensor]:
        """The next bank's slots (one per member) and its result area, as whole ``dtype`` views."""
        return self._banks(dtype)[self._next_bank()]

    def _next_arrays(self, dtype: torch.dtype, count: int) -> list:
        """The next bank's slots (one per member) as NumPy arrays of ``count`` ``dtype`` elements, made once per
        dtype and count."""
        bank = self._next_bank()
        arrays = self._arrays.get((dtype, count))
        if arrays is None:
            if len(self._arrays) >= _ARRAYS_KEPT:
                self._arrays.clear()
            arrays = self._arrays[(dtype, count)] = [
                [slot[:count].numpy() for slot in slots] for slots, _ in self._banks(dtype)]
        return arrays[bank]

    def _banks(self, dtype: torch.dtype) -> list:
        """Both banks' slots (one per member) and result areas, as whole ``dtype`` views."""
        views = self._views.get(dtype)
        if views is None:
            per_slot = SLOT_BYTES // dtype.itemsize
            assert self._memory is not None  # mapped during setup
            typed = self._memory.view(dtype)
            views = self._views[dtype] = [
                ([typed[(b * (self.size + 1) + m) * per_slot:(b * (self.size + 1) + m + 1) * per_slot]
                  for m in range(self.size)],
                 typed[(b * (self.size + 1) + self.size) * per_slot:(b + 1) * (self.size + 1) * per_slot])
                for b in range(2)]
        return views

    def _share(self, count: int) -> tuple[int, int]:
        """The elements ``[low, high)`` of a ``count``-element piece that this member reduces."""
        per_member = -(-count // self.size)
        per_member += -per_member % _SHARE_ALIGNMENT
        low = min(count, self.rank * per_member)
        return low, min(count, low + per_member)

    def _plan(self, count: int, spans: list, sources: list, unscaled: bool) -> tuple:
        """For a piece reduce-scattered in the segment: this member's share ``[low, high)``, the spans it
        copies into its slot, and the row it combines for itself (None: its slot's).

        No other member reads this member's share of its slot, so when the
        share lies within one input and the copy would not scale it
        (``unscaled``), the share is combined straight from that input and
        not copied in: each member moves 1/N of the piece less.
        """
        low, high = self._share(count)
        own = _within_one(sources, spans, low, high) if unscaled and low < high else None
        return low, high, (spans if own is None else _outside(spans, low, high)), own

    # ------------------------------------------------------------ collectives
    def carrier(self, op_label: str) -> str:
        return self.name if op_label in _OWN else self.inner.carrier(op_label)

    def allreduce(self, tensor, op):
        if op in SUM_OPS and _small(tensor):  # NumPy only: no torch.no_grad() (3 us a call) needed
            return self._sum_small(flat_array(tensor), tensor.dtype)
        self._allreduce_in_torch(tensor, op)

    @torch.no_grad()  # a transport moves data; autograd is the adapters' business
    def _allreduce_in_torch(self, tensor, op) -> None:
        if tensor.dtype not in ARITHMETIC_DTYPES:
            return self.inner.allreduce(tensor, op)
        self._reduce_whole(tensor, op, None)

    def _sum_small(self, into, dtype: torch.dtype) -> None:
        """Sum the NumPy array ``into`` (of ``dtype``) over every member, in place: copied into this member's slot,
        then every slot added in member order (the same bits as ``_combine``'s, in a few NumPy calls rather than a
        dozen torch calls on tiny tensors)."""
        rows = self._next_arrays(dtype, into.size)
        np.copyto(rows[self.rank], into)
        self._wait()
        with np.errstate(all="ignore"):  # an overflow to inf is the result, as in torch, not a warning
            np.add(rows[0], rows[1], out=into)
            for row in rows[2:]:
                np.add(into, row, out=into)

    fused_dtypes = frozenset(dtype for dtype in ARITHMETIC_DTYPES if not widens(dtype))

    @torch.no_grad()  # a transport moves data; autograd is the adapters' business
    def allreduce_fused(self, inputs: list, outputs: list, op, prescale: float, postscale: float) -> None:
        """Allreduce ``inputs`` as the executor's fusion buffer of them would be (see ``Backend``).

        Each slot-sized piece of their concatenation is copied from the inputs
        straight into this member's slot and from the result straight into
        the outputs, so the pieces, and the results, are those of a fusion
        buffer without its two copies; in float32/float64 the scaling rides on
        the copy in where it can (see ``_scaling``).
        """
        on_copy, prescale, postscale = _scaling(inputs[0].dtype, op, prescale, postscale)
        self._reduce_pieces(inputs, outputs, op, on_copy, prescale, postscale)

    def _reduce_many_small(self, targets: list, spans: list, slots: list, op, postscale: float) -> None:
        """The results of a direct piece of many small tensors (``spans`` of ``targets``, in ``slots``):
        every slot combined as one range, in member order, into a scratch area of this member's own, then
        one copy out, rather than a few calls per tensor."""
        at, _, _, take = spans[-1]
        count, dtype = at + take, slots[0].dtype
        scratch = self._scratch.get(dtype)
        if scratch is None:
            scratch = self._scratch[dtype] = torch.empty(DIRECT_BYTES // dtype.itemsize, dtype=dtype)
        result = scratch[:count]
        _combine(result, [slot[:count] for slot in slots], op)
        scale(result, postscale)
        _copy_out(targets, spans, scratch, self._shaped)

    @torch.no_grad()  # a transport moves data; autograd is the adapters' business
    def reduce(self, tensor, root: int, op) -> None:
        """Reduce ``tensor`` into the root member's copy (the others' are left as they were)."""
        if tensor.dtype not in ARITHMETIC_DTYPES:
            return self.inner.reduce(tensor, root, op)
        self._reduce_whole(tensor, op, root)

    def _reduce_whole(self, tensor, op, root: int | None) -> None:
        """Combine every member's ``tensor`` in member order into the root's (every member's: None)."""
        sent = widened(tensor)
        flat = sent.view(-1)
        self._reduce_pieces([flat], [flat] if root is None or root == self.rank else None, op, 1.0, 1.0, 1.0)
        narrow_back(tensor, sent)

    def _reduce_pieces(self, sources: list, targets: list | None, op, on_copy: float, prescale: float,
                       postscale: float) -> None:
        """Reduce the concatenation of ``sources`` over every member into ``targets`` (None: this member
        takes no result), piece by piece.

        A piece of at most ``DIRECT_BYTES`` is combined whole by every member
        after one wait (as one range when it holds many small tensors). Larger
        ones are reduce-scattered and then gathered in the segment: member
        ``m`` combines the ``m``-th share of the piece over every slot (in
        member order, so every member gets the same bits) into the bank's
        result area, and after the next wait every member copies the result
        out. That wait is also the one after the next piece's copy
        in, so ``P`` pieces cost ``P + 1`` waits, and each member reads about
        twice the data rather than ``N`` times it.
        """
        dtype = sources[0].dtype
        pieces = _pieces([source.numel() for source in sources], SLOT_BYTES // dtype.itemsize)
        if len(pieces) == 1 and pieces[0][0] * dtype.itemsize <= DIRECT_BYTES:
            count, spans = pieces[0]
            slots, _ = self._bank(dtype)
            _copy_in(sources, spans, slots[self.rank], on_copy, prescale, self._shaped)
            self._wait()
            if targets is not None and _many_small(spans, dtype.itemsize):
                self._reduce_many_small(targets, spans, slots, op, postscale)
            elif targets is not None:
                for at, which, where, take in spans:
                    out = targets[which].view(-1)[where:where + take]
                    _combine(out, [slot[at:at + take] for slot in slots], op)
                    scale(out, postscale)
            return
        banks = [self._bank(dtype) for _ in pieces]
        plans = [self._plan(count, spans, sources, on_copy == prescale == 1.0) for count, spans in pieces]
        if pieces:
            _copy_in(sources, plans[0][2], banks[0][0][self.rank], on_copy, prescale, self._shaped)
        for k in range(len(pieces)):
            self._wait()
            if k and targets is not None:
                _copy_out(targets, pieces[k - 1][1], banks[k - 1][1], self._shaped)
            slots, result = banks[k]
            low, high, _, own = plans[k]
            if low < high:
                out, rows = result[low:high], [slot[low:high] for slot in slots]
                if own is not None:
                    rows[self.rank] = own
                _combine(out, rows, op)
                scale(out, postscale)
            if k + 1 < len(pieces):
                _copy_in(sources, plans[k + 1][2], banks[k + 1][0][self.rank], on_copy, prescale,
                         self._shaped)
        if pieces:
            self._wait()
            if targets is not None:
                _copy_out(targets, pieces[-1][1], banks[-1][1], self._shaped)

    def allgather(self, output, tensor):
        if _small(tensor) and output.is_contiguous():  # NumPy only, as allreduce's
            return self._gather_small(flat_array(output).reshape(self.size, -1), flat_array(tensor), tensor.dtype)
        self._allgather_in_torch(output, tensor)

    @torch.no_grad()  # a transport moves data; autograd is the adapters' business
    def _allgather_in_torch(self, output, tensor) -> None:
        if tensor.dtype not in ARITHMETIC_DTYPES:
            return self.inner.allgather(output, tensor)
        rows = output.view(self.size, -1)
        self._gather(tensor, [rows[member] for member in range(self.size)])

    @torch.no_grad()  # a transport moves data; autograd is the adapters' business
    def gather(self, outputs: list, tensor, root: int) -> None:
        """Gather ``tensor`` from every member into the root's ``outputs`` (one tensor per member)."""
        if tensor.dtype not in ARITHMETIC_DTYPES:
            return self.inner.gather(outputs, tensor, root)
        self._gather(tensor, outputs if self.rank == root else None)

    @torch.no_grad()  # a transport moves data; autograd is the adapters' business
    def broadcast(self, tensor, root):
        if tensor.dtype not in ARITHMETIC_DTYPES:
            return self.inner.broadcast(tensor, root)
        flat = tensor.view(-1)
        per_slot = SLOT_BYTES // flat.element_size()
        for start in range(0, flat.numel(), per_slot):
            part = flat[start:start + per_slot]
            slot = self._bank(part.dtype)[0][root][:part.numel()]
            if self.rank == root:
                slot.copy_(part)
            self._wait()
            if self.rank != root:
                part.copy_(slot)

    def _gather_small(self, rows, mine, dtype: torch.dtype) -> None:
        """Gather the NumPy array ``mine`` (of ``dtype``) from every member into ``rows`` (one per member) through
        NumPy views."""
        slots = self._next_arrays(dtype, mine.size)
        np.copyto(slots[self.rank], mine)
        self._wait()
        for row, slot in zip(rows, slots):
            np.copyto(row, slot)

    def _gather(self, tensor, outputs: list | None) -> None:
        """Copy every member's ``tensor`` into ``outputs`` (one per member; None: this member takes none)."""
        flat = tensor.reshape(-1)
        per_slot = SLOT_BYTES // max(1, flat.element_size())
        for start in range(0, flat.numel(), per_slot):
            part = flat[start:start + per_slot]
            slots = [slot[:part.numel()] for slot in self._bank(part.dtype)[0]]
            slots[self.rank].copy_(part)
            self._wait()
            if outputs is not None:
                for output, slot in zip(outputs, slots):
                    output.view(-1)[start:start + part.numel()].copy_(slot)

    def alltoall(self, output, tensor, output_splits, input_splits):
        self.inner.alltoall(output, tensor, output_splits, input_splits)

    @torch.no_grad()  # a transport moves data; autograd is the adapters' business
    def reducescatter(self, output, tensor, op):
        """Reduce every member's ``tensor`` and leave this member's chunk of the result in ``output``.

        Piece by piece, every member copies the piece of its input into its
        slot and, after the wait, combines over every slot (in member order)
        only the part of the piece that falls in its own chunk, straight into
        ``output``: each member reads its chunk N times, never the whole.
        """
        if tensor.dtype not in ARITHMETIC_DTYPES or output.numel() * self.size != tensor.numel():
            return self.inner.reducescatter(output, tensor, op)
        sent_out, sent_in = widened(output), widened(tensor)
        flat, out = sent_in.reshape(-1), sent_out.view(-1)
        chunk, per_slot = out.numel(), SLOT_BYTES // flat.element_size()
        own = self.rank * chunk
        for start in range(0, flat.numel(), per_slot):
            part = flat[start:start + per_slot]
            slots = [slot[:part.numel()] for slot in self._bank(part.dtype)[0]]
            slots[self.rank].copy_(part)
            self._wait()
            low, high = max(start, own), min(start + part.numel(), own + chunk)
            if low < high:
                _combine(out[low - own:high - own], [slot[low - start:high - start] for slot in slots], op)
        narrow_back(output, sent_out)

    def barrier(self):
        self._wait()

    def close(self):
        """Unmap the segment, close the sockets and the wrapped backend."""
        self._release()
        self.inner.close()

    def _release(self) -> None:
        if self._barrier is not None:
            self._barrier.close()
        for peer in self._peers.values():
            peer.close()
        self._peers = {}
        self._views = {}
        self._arrays = {}
        self._shaped.clear()
        if self.rank == 0 and self._path:
            try:  # still there when setup failed part way
                os.unlink(self._path)
            except FileNotFoundError:
                pass
        self._path = None
        self._memory = None
        if self._mapping is not None:
            try:
                self._mapping.close()
            except BufferError:  # a view is still alive somewhere: the mapping goes with it
                pass
            self._mapping = None


def _receive_exactly(sock: socket.socket, count: int) -> bytes:
    data = b""
    while len(data) < count:
        chunk = sock.recv(count - len(data))
        if not chunk:
            raise EOFError("the peer closed its connection")
        data += chunk
    return data
