"""Gloo through ``torch.distributed``: a process group made for roundel alone.

The group is built directly (not with ``init_process_group``), so a script may
also use ``torch.distributed``'s default group without any clash.

Gloo's listening socket is bound to the address handed to ``create_device``
(the job's interface, never the wildcard address) on a port the kernel picks.
Gloo authenticates nothing: it accepts every connection to that port and keeps
each open, one file descriptor apiece, and aborts the process when it can
open no more; :func:`raise_open_file_limit` gives it all the room the system
allows.
"""

from __future__ import annotations

import functools
import logging
import resource
from datetime import timedelta
from typing import Any, Callable

import numpy as np
import torch
import torch.distributed as dist

from roundel.transport.backend import (COMBINE, SUM_OPS, TORCH_REDUCE_OPS, RootedBackend, flat_array, has_flat_array,
                                      narrow_back, shut_down, widened)
from roundel.transport.peer_links import MOST_LINKED, PeerLinks

log = logging.getLogger("roundel")

# Where an allreduce goes (measured on 2 cores, shared memory off, each path called directly, p50):
# - Over roundel's own links between the members, on the calling thread (see roundel.transport.peer_links),
#   unless they are turned off:
#   - while each member receives at most LINK_BYTES (the others' copies of 128 KiB, and room for a replay slot's
#     few agreement elements), as one exchange of whole copies, which every member combines in rank order (one
#     round trip: 2 ranks, 128 KiB 0.07 ms against 0.10-0.13 in two exchanges; 256 KiB 0.14 against 0.08-0.11).
#     A Sum or Average among a power of two members from 4 up is recursive doubling instead: log2(n) exchanges,
#     each of the whole partial sum with one partner, so each member sends log2(n) messages where the single
#     exchange sends n - 1 (the textbook short-message allreduce). With 4 ranks on 2 cores each send woke a
#     peer that took this member's core; a 4 B allreduce in benchmarks/latency.py, shared memory off: p50
#     0.77-1.15 ms against 1.09-1.34 in one exchange, p99 1.6-3.7 against 4.5-6.3;
#   - above that, in two exchanges: each member combines the part of the tensor it owns and sends it back. With
#     2 members at every size (256 KiB 0.08 ms against Gloo's 0.40, 1 MiB 0.64 against 0.85, 4 MiB 2.2 against
#     3.7, 16 MiB 11.4 against 15.6); from 3 members up to SCATTER_BYTES (4 ranks: 1 MiB 2.6 against 5.7, 4 MiB
#     7.9 against 9.6, 16 MiB 35 against 34), above which Gloo's pipelined ring keeps up better.
# - Without links, among 3 or more members, as one allgather and a local reduction while each member receives at
#   most GATHER_BYTES. Gloo's ring allreduce takes 2 (n - 1) steps and receives 2 (n - 1) / n of the tensor per
#   member; the allgather takes n - 1 steps and receives n - 1 tensors (4 ranks, 64 B to 64 KiB: 2.0-3.0 ms
#   against the ring's 4.3-5.5). With 2 members the ring is as fast or faster (benchmarks/gloo_small_allreduce.py).
#   A tensor with fewer elements than members (ring chunks left empty) is as fast on the ring.
# - Otherwise on Gloo's ring.
# Local copies and reductions go in slices of half torch's intra-op parallel grain (32,768 elements), so they stay
# on the calling thread: pool threads spin for milliseconds against the transport and the job's other ranks (a
# single 256 KiB copy on the pool made an exchange 20 to 40 times slower on 2 cores).
# Broadcasts and allgathers go over the links too, within SCATTER_BYTES sent by one member from 3 members on.
LINK_BYTES = 132 * 1024
GATHER_BYTES = 256 * 1024
SCATTER_BYTES = 4 << 20
_SERIAL_ELEMENTS = 16384
_ON_LINKS = frozenset({"allreduce", "broadcast", "allgather"})

# A sum of the whole copies exchanged on the links is taken with NumPy where the tensor has a NumPy view (not
# bfloat16, nor a conjugate or negative view): NumPy's element-wise functions never use threads, and cost well under
# a microsecond a call where a torch call on a small tensor costs one to three (this path's torch calls took about
# 30 us of a 4 B allreduce's 140-175 us of CPU on the calling thread). The same element-wise sum, in the same rank
# order. Min, Max and Product stay with torch (NumPy's minimum and maximum choose between -0.0 and 0.0 otherwise).
_KEPT_COPIES = 256  # the views kept for that many dtypes and sizes at most


def raise_open_file_limit() -> None:
    """Raise this process's soft limit on open files to its hard limit (best effort).

    Stray or hostile connections to Gloo's port each hold a descriptor; with
    the common soft limit of 1024 a thousand of them make Gloo abort the worker.
    """
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    target = hard
    if hard == resource.RLIM_INFINITY:
        try:
            with open("/proc/sys/fs/nr_open") as limit:
                target = int(limit.read())
        except (OSError, ValueError):
            target = 1 << 20
    if soft == resource.RLIM_INFINITY or soft >= target:
        return
    try:
        resource.setrlimit(resource.RLIMIT_NOFILE, (target, hard))
    except (OSError, ValueError) as exc:
        log.debug("roundel: could not raise the open file limit from %s to %s: %s", soft, target, exc)
        return
    log.debug("roundel: raised the open file limit (RLIMIT_NOFILE) from %s to %s", soft, target)


def _serial_copy(into: torch.Tensor, source: torch.Tensor) -> None:
    """``into.copy_(source)`` (both flat) in slices that stay on the calling thread (see above)."""
    for start in range(0, into.numel(), _SERIAL_ELEMENTS):
        into[start:start + _SERIAL_ELEMENTS].copy_(source[start:start + _SERIAL_ELEMENTS])


def _bytes_of(tensor: torch.Tensor) -> memoryview:
    """A contiguous CPU ``tensor``'s memory, as the links send and receive it (an empty one: no bytes)."""
    return tensor.reshape(-1).view(torch.uint8).numpy().data if tensor.numel() else memoryview(b"")


def _combine_rows(flat: torch.Tensor, rows: torch.Tensor, combine) -> None:
    """``flat`` = ``rows[0]``, then ``combine(flat, row)`` with each next row, in slices that stay on the calling
    thread (see above)."""
    for start in range(0, flat.numel(), _SERIAL_ELEMENTS):
        into = flat[start:start + _SERIAL_ELEMENTS]
        into.copy_(rows[0, start:start + _SERIAL_ELEMENTS])
        for row in rows[1:]:
            combine(into, row[start:start + _SERIAL_ELEMENTS])


class _CopiesOnLinks:
    """Every member's copy of a tensor of one dtype and size, as rows, with the NumPy views the links send from
    and receive into: made once, for every later allreduce of that dtype and size. A Sum or Average among a power
    of two members from 4 up goes round by round (``rounds``, one per partner), otherwise in one exchange with
    every peer."""

    def __init__(self, rows: torch.Tensor, rank: int, partners: list):
        self.rows = rows
        self.arrays = rows.numpy()
        raw = self.arrays.view(np.uint8)
        peers = [peer for peer in range(len(raw)) if peer != rank]
        self.mine = self.arrays[rank]
        self.sends = {peer: memoryview(raw[rank]) for peer in peers}
        self.receives = {peer: memoryview(raw[peer]) for peer in peers}
        # recursive doubling (see PeerLinks.partners): per round, what goes to the partner and what comes back,
        # the partner's partial sum, and whether this member's goes first (the lower rank's does)
        self.rounds = [({peer: self.sends[peer]}, {peer: self.receives[peer]}, self.arrays[peer], rank < peer)
                       for peer in partners]

    def reduce(self, links: PeerLinks, flat: torch.Tensor, op) -> None:
        """Reduce the flat ``flat`` in place: send it to every peer, then combine every member's copy in rank
        order; or, by recursive doubling, add the partner's partial sum each round (the lower ranks' first, so
        that every member gets the same bits)."""
        into = flat_array(flat)
        np.copyto(self.mine, into)
        if self.rounds and op in SUM_OPS:
            mine = self.mine
            with np.errstate(all="ignore"):
                for send, receive, theirs, first in self.rounds:
                    links.exchange(send, receive)
                    if first:
                        np.add(mine, theirs, out=mine)
                    else:
                        np.add(theirs, mine, out=mine)
            np.copyto(into, mine)
            return
        links.exchange(self.sends, self.receives)
        if op not in SUM_OPS:
            _combine_rows(flat, self.rows, COMBINE[op])
            return
        arrays = self.arrays
        with np.errstate(all="ignore"):  # an overflow to inf is the result, as in torch, not a warning
            if len(arrays) == 2:
                np.add(arrays[0], arrays[1], out=into)
                return
            np.copyto(into, arrays[0])
            for row in arrays[1:]:
                np.add(into, row, out=into)


class GlooBackend(RootedBackend):
    """Collectives over a private ``ProcessGroupGloo``."""

    name = "gloo"

    def __init__(self, store, rank: int, size: int, timeout_s: float, hostname: str = "", peer_links: bool = True):
        """``peer_links``: allreduces, broadcasts and allgathers go over ``PeerLinks`` (where ``hostname``, the
        address to listen on, is given) rather than through the process group, where the size allows."""
        super().__init__(rank, size)
        options = dist.ProcessGroupGloo._Options()  # type: ignore[attr-defined]  # torch's stub lacks _Options
        options._timeout = timedelta(seconds=timeout_s)
        options._devices = [dist.ProcessGroupGloo.create_device(hostname=hostname)]
        # Any: torch's stub of ProcessGroupGloo (a c10d Backend) lacks the collectives its pybind11 class has
        self._pg: Any = dist.ProcessGroupGloo(store, rank, size, options)
        self._native_reduce_scatter = True  # older torch (2.6 among them) has no reduce_scatter in Gloo
        self._allreduce_options: dict = {}  # op -> its AllreduceOptions, made once (a call costs microseconds)
        self._links: PeerLinks | None = None
        self._kept_rows: torch.Tensor | None = None  # bytes; see _rows
        self._copies: dict = {}  # (dtype, elements) -> _CopiesOnLinks, in _kept_rows
        if peer_links and 1 < size <= MOST_LINKED and hostname:
            try:
                self._links = PeerLinks(store, rank, size, hostname, timeout_s)
            except BaseException:
                self.close()
                raise

    def _allreduce_work(self, sent, op):
        options = self._allreduce_options.get(op)
        if options is None:
            options = self._allreduce_options[op] = dist.AllreduceOptions()
            options.reduceOp = TORCH_REDUCE_OPS[op]
        return self._pg.allreduce([sent], options)

    def carrier(self, op_label: str) -> str:
        return "gloo+links" if self._links is not None and op_label in _ON_LINKS else self.name

    def _links_for(self, nbytes: int) -> PeerLinks | None:
        """The links, where a broadcast or allgather of which one member sends ``nbytes`` to every other goes over
        them: with 2 members always, with more while the copies one member sends stay within SCATTER_BYTES."""
        return self._links if self.size == 2 or (self.size - 1) * nbytes <= SCATTER_BYTES else None

    def _allreduce_way(self, sent) -> Callable[[Any, Any], None] | None:
        """How an allreduce of ``sent`` runs (the way is handed a contiguous tensor), None for Gloo's ring. Decided
        from its size alone, so every member takes the same way, blocking or not, whichever thread calls."""
        links, nbytes = self._links, sent.numel() * sent.element_size()
        received = (self.size - 1) * nbytes
        if links is not None and received <= LINK_BYTES:
            return functools.partial(self._allreduce_on_links, links)
        if links is not None and (self.size == 2 or nbytes <= SCATTER_BYTES):
            return functools.partial(self._allreduce_scattered, links)
        if 2 < self.size <= sent.numel() and received <= GATHER_BYTES:
            return self._allreduce_by_allgather
        return None

    def allreduce(self, tensor, op):
        sent = widened(tensor)
        work = sent.contiguous()
        way = self._allreduce_way(work)
        if way is None:
            self._allreduce_work(work, op).wait()
        else:
            way(work, op)
        if work is not sent:
            sent.copy_(work)
        narrow_back(tensor, sent)

    def _allreduce_on_links(self, links: PeerLinks, tensor, op) -> None:
        """Reduce a small contiguous ``tensor`` in place over ``links``: every member's copy, combined in rank
        order."""
        flat = tensor if tensor.dim() == 1 else tensor.view(-1)
        if not has_flat_array(flat):  # bfloat16, a conjugate or negative view: no NumPy view
            rows = self._rows(flat)
            _serial_copy(rows[self.rank], flat)
            links.allgather(rows)
            _combine_rows(flat, rows, COMBINE[op])
            return
        key = (flat.dtype, flat.numel())
        copies = self._copies.get(key)
        if copies is None:
            if len(self._copies) >= _KEPT_COPIES:
                self._copies.clear()
            copies = self._copies[key] = _CopiesOnLinks(self._rows(flat), self.rank, links.partners)
        copies.reduce(links, flat, op)

    def _allreduce_scattered(self, links: PeerLinks, tensor, op) -> None:
        """Reduce a contiguous ``tensor`` in place over ``links`` in two exchanges: each member sends every other
        the part of its copy that member owns (one of ``size`` near-equal parts) and combines the others' copies
        of its own part into its own, in rank order; then each sends its combined part to every other."""
        parts = tensor.view(-1).tensor_split(self.size)
        views = [_bytes_of(part) for part in parts]
        mine = parts[self.rank]
        peers = [peer for peer in range(self.size) if peer != self.rank]
        rows = self._rows(mine, len(peers))  # row i: peers[i]'s copy of this member's part
        links.exchange({peer: views[peer] for peer in peers},
                       {peer: _bytes_of(row) for peer, row in zip(peers, rows)})
        combine = COMBINE[op]
        for start in range(0, mine.numel(), _SERIAL_ELEMENTS):
            into = mine[start:start + _SERIAL_ELEMENTS]
            for row in rows:
                combine(into, row[start:start + _SERIAL_ELEMENTS])
        links.exchange({peer: views[self.rank] for peer in peers}, {peer: views[peer] for peer in peers})

    def _rows(self, flat, count: int | None = None) -> torch.Tensor:
        """A (``count``, elements) buffer for copies of ``flat`` (one per member by default), in memory kept for
        later calls (as large as the largest asked for so far)."""
        count = self.size if count is None else count
        nbytes = count * flat.numel() * flat.element_size()
        kept = self._kept_rows
        if kept is None or kept.numel() < nbytes:
            self._copies.clear()  # they hold the buffer being replaced
            kept = self._kept_rows = torch.empty(nbytes, dtype=torch.uint8)
        return kept[:nbytes].view(flat.dtype).view(count, flat.numel())

    def _allreduce_by_allgather(self, tensor, op) -> None:
        """Reduce a small ``tensor`` in place by gathering every member's copy (the same result, combined in
        rank order, on every member)."""
        flat = tensor.view(-1)
        rows = torch.empty((self.size, flat.numel()), dtype=flat.dtype, device=flat.device)
        self._pg._allgather_base(rows.view(-1), flat).wait()
        _combine_rows(flat, rows, COMBINE[op])

    def allreduce_async(self, tensor, op):
        sent = widened(tensor)
        if self._allreduce_way(sent) is not None:  # the way a blocking call takes, alike everywhere
            self.allreduce(tensor, op)
            done: torch.futures.Future = torch.futures.Future()
            done.set_result(None)
            return done
        future = self._allreduce_work(sent, op).get_future()
        if sent is tensor:
            return future

        def narrow(done) -> None:
            done.value()  # raises the transport's error, if any
            narrow_back(tensor, sent)
        return future.then(narrow)

    def allgather(self, output, tensor):
        sent_out, sent_in = widened(output), widened(tensor)
        work = sent_out.contiguous()
        links = self._links_for(sent_in.numel() * sent_in.element_size())
        if links is None:
            self._pg._allgather_base(work, sent_in.contiguous()).wait()
        elif sent_in.numel() and has_flat_array(work) and has_flat_array(sent_in):  # NumPy: no torch views
            table = flat_array(work).view(np.uint8).reshape(self.size, -1)
            np.copyto(table[self.rank], flat_array(sent_in).view(np.uint8))
            links.allgather_bytes(table)
        elif sent_in.numel():  # nothing to move otherwise
            rows = work.view(self.size, -1)
            _serial_copy(rows[self.rank], sent_in.reshape(-1))
            links.allgather(rows)
        if work is not sent_out:
            sent_out.copy_(work)
        narrow_back(output, sent_out)

    def broadcast(self, tensor, root):
        sent = widened(tensor)
        work = sent.contiguous()
        links = self._links_for(work.numel() * work.element_size())
        if links is None:
            options = dist.BroadcastOptions()
            options.rootRank = root
            self._pg.broadcast([work], options).wait()
        else:
            data, nothing = _bytes_of(work), memoryview(b"")
            peers = [peer for peer in range(self.size) if peer != self.rank]
            links.exchange({peer: data if self.rank == root else nothing for peer in peers},
                           {peer: data if peer == root else nothing for peer in peers})
        if work is not sent:
            sent.copy_(work)
        narrow_back(tensor, sent)

    def reduce(self, tensor, root: int, op) -> None:
        """Reduce ``tensor`` into the root member's copy (the others' are left undefined)."""
        sent = widened(tensor)
        options = dist.ReduceOptions()
        options.reduceOp = TORCH_REDUCE_OPS[op]
        options.rootRank = root
        self._pg.reduce([sent], options).wait()
        narrow_back(tensor, sent)

    def gather(self, outputs: list, tensor, root: int) -> None:
        """Gather ``tensor`` from every member into the root's ``outputs`` (one tensor per member)."""
        sent_in = widened(tensor)
        sent_out = [widened(t) for t in outputs] if self.rank == root else []
        options = dist.GatherOptions()
        options.rootRank = root
        self._pg.gather([sent_out] if self.rank == root else [], [sent_in], options).wait()
        for original, sent in zip(outputs if self.rank == root else [], sent_out):
            narrow_back(original, sent)

    def alltoall(self, output, tensor, output_splits, input_splits):
        sent_out, sent_in = widened(output), widened(tensor)
        self._pg.alltoall_base(sent_out, sent_in, list(output_splits), list(input_splits),
                               dist.AllToAllOptions()).wait()
        narrow_back(output, sent_out)

    def reducescatter(self, output, tensor, op):
        sent_out, sent_in = widened(output), widened(tensor)
        if self._native_reduce_scatter:
            options = dist.ReduceScatterOptions()
            options.reduceOp = TORCH_REDUCE_OPS[op]
            try:
                self._pg.reduce_scatter([sent_out], [list(sent_in.chunk(self.size))], options).wait()
                narrow_back(output, sent_out)
                return
            except RuntimeError as exc:  # refused before anything was sent: the members all take the same turn
                if "does not support reduce_scatter" not in str(exc):
                    raise
                self._native_reduce_scatter = False
        whole = sent_in.clone()
        self._allreduce_work(whole, op).wait()
        sent_out.copy_(whole.chunk(self.size)[self.rank].reshape(sent_out.shape))
        narrow_back(output, sent_out)

    def barrier(self):
        self._pg.barrier().wait()

    def close(self):
        """Shut the process group down and drop it, its last reference: torch then destroys it at once
        (GIL released), joining its native threads while the interpreter still runs. A Gloo worker left
        to exit-time garbage collection aborts the process when it releases a tensor after Python has
        begun to finalize. The links close too."""
        if self._links is not None:
            self._links.close()
        pg, self._pg = self._pg, None
        shut_down(pg)
