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

import logging
import resource
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist

from roundel.transport.backend import COMBINE, TORCH_REDUCE_OPS, RootedBackend, narrow_back, shut_down, widened
from roundel.transport.peer_links import LINK_BYTES, MOST_LINKED, PeerLinks

log = logging.getLogger("roundel")

# A small allreduce (each member receiving at most LINK_BYTES) goes over roundel's own links between the
# members, on the calling thread (see roundel.transport.peer_links), unless they are turned off. Otherwise, one
# among 3 or more members runs as one allgather and a local reduction. Gloo's ring allreduce
# takes 2 (n - 1) steps and receives 2 (n - 1) / n of the tensor per member; the allgather takes n - 1 steps
# and receives n - 1 tensors, so it is used while what each member receives stays small, at most
# GATHER_BYTES (4 ranks on 2 cores, 64 B to 64 KiB: 2.0-3.0 ms against the ring's 4.3-5.5). With 2 members
# the ring is as fast or faster (two runs of benchmarks/gloo_small_allreduce.py, 4 B to 64 KiB: 0.18-0.34 ms
# against 0.23-0.45, the gather ahead only once, at 4 KiB; 256 KiB: 0.42-0.51 against 0.78-0.81). A tensor
# with fewer elements than members (ring chunks left empty) is as fast on the ring.
# The local reduction goes in slices of half torch's intra-op parallel grain (32,768 elements), so it stays
# on the calling thread: pool threads would contend with the transport's.
GATHER_BYTES = 256 * 1024
_SERIAL_ELEMENTS = 16384


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


def _combine_rows(flat: torch.Tensor, rows: torch.Tensor, combine) -> None:
    """``flat`` = ``rows[0]``, then ``combine(flat, row)`` with each next row, in slices that stay on the calling
    thread (see above)."""
    for start in range(0, flat.numel(), _SERIAL_ELEMENTS):
        into = flat[start:start + _SERIAL_ELEMENTS]
        into.copy_(rows[0, start:start + _SERIAL_ELEMENTS])
        for row in rows[1:]:
            combine(into, row[start:start + _SERIAL_ELEMENTS])


class GlooBackend(RootedBackend):
    """Collectives over a private ``ProcessGroupGloo``."""

    name = "gloo"

    def __init__(self, store, rank: int, size: int, timeout_s: float, hostname: str = "", peer_links: bool = True):
        """``peer_links``: small allreduces go over ``PeerLinks`` (where ``hostname``, the address to listen on,
        is given) rather than through the process group."""
        super().__init__(rank, size)
        options = dist.ProcessGroupGloo._Options()  # type: ignore[attr-defined]  # torch's stub lacks _Options
        options._timeout = timedelta(seconds=timeout_s)
        options._devices = [dist.ProcessGroupGloo.create_device(hostname=hostname)]
        # Any: torch's stub of ProcessGroupGloo (a c10d Backend) lacks the collectives its pybind11 class has
        self._pg: Any = dist.ProcessGroupGloo(store, rank, size, options)
        self._native_reduce_scatter = True  # older torch (2.6 among them) has no reduce_scatter in Gloo
        self._allreduce_options: dict = {}  # op -> its AllreduceOptions, made once (a call costs microseconds)
        self._links: PeerLinks | None = None
        self._kept_rows: torch.Tensor | None = None  # see _rows
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
        return "gloo+links" if self._links is not None and op_label == "allreduce" else self.name

    def allreduce(self, tensor, op):
        sent = widened(tensor)
        links, received = self._links, (self.size - 1) * sent.numel() * sent.element_size()
        if links is not None and received <= LINK_BYTES:
            self._allreduce_on_links(links, sent, op)
        elif 2 < self.size <= sent.numel() and received <= GATHER_BYTES:
            self._allreduce_by_allgather(sent, op)
        else:
            self._allreduce_work(sent, op).wait()
        narrow_back(tensor, sent)

    def _allreduce_on_links(self, links: PeerLinks, tensor, op) -> None:
        """Reduce a small ``tensor`` in place over ``links``: every member's copy, combined in rank order."""
        flat = tensor.reshape(-1)  # a copy only where the tensor is not contiguous
        rows = self._rows(flat)
        rows[self.rank].copy_(flat)
        links.allgather(rows)
        _combine_rows(flat, rows, COMBINE[op])
        if not tensor.is_contiguous():
            tensor.copy_(flat.view(tensor.shape))

    def _rows(self, flat) -> torch.Tensor:
        """A (members, elements) buffer for every member's copy of ``flat``, kept for the next call alike."""
        rows = self._kept_rows
        if rows is None or rows.dtype != flat.dtype or rows.shape[1] != flat.numel():
            rows = self._kept_rows = torch.empty((self.size, flat.numel()), dtype=flat.dtype)
        return rows

    def _allreduce_by_allgather(self, tensor, op) -> None:
        """Reduce a small ``tensor`` in place by gathering every member's copy (the same result, combined in
        rank order, on every member)."""
        flat = tensor.view(-1)
        rows = torch.empty((self.size, flat.numel()), dtype=flat.dtype, device=flat.device)
        self._pg._allgather_base(rows.view(-1), flat).wait()
        _combine_rows(flat, rows, COMBINE[op])

    def allreduce_async(self, tensor, op):
        sent = widened(tensor)
        future = self._allreduce_work(sent, op).get_future()
        if sent is tensor:
            return future

        def narrow(done) -> None:
            done.value()  # raises the transport's error, if any
            narrow_back(tensor, sent)
        return future.then(narrow)

    def allgather(self, output, tensor):
        sent_out, sent_in = widened(output), widened(tensor)
        self._pg._allgather_base(sent_out, sent_in).wait()
        narrow_back(output, sent_out)

    def broadcast(self, tensor, root):
        sent = widened(tensor)
        options = dist.BroadcastOptions()
        options.rootRank = root
        self._pg.broadcast([sent], options).wait()
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
