"""Rank numbers from where Spark placed a barrier stage's tasks.

Each task sees every task's executor address (``host:port``, in partition
order) through ``BarrierTaskContext.getTaskInfos()`` and works out the same
placement on its own: ranks are grouped by host (hosts ordered by their
lowest partition index, so partition 0 is on the first host and gets rank
0), and within a host they follow partition order. Tasks on the same host
(even in different executors) share a local size, as Horovod's host hash
groups them.
"""

from __future__ import annotations

from roundel.rendezvous.identity import Identity, cross_ranks

__all__ = ["host_of", "identities"]


def host_of(address: str) -> str:
    """The host part of an executor address ``host:port`` (``[v6]:port`` too)."""
    host = address.rsplit(":", 1)[0] if ":" in address else address
    return host[1:-1] if host.startswith("[") and host.endswith("]") else host


def identities(addresses: list[str]) -> list[Identity]:
    """The Identity of each task, indexed by partition, from the tasks' executor addresses."""
    if not addresses:
        raise ValueError("a barrier stage without tasks has no placement")
    hosts = [host_of(a) for a in addresses]
    host_order = {h: i for i, h in reversed(list(enumerate(hosts)))}
    by_rank = sorted(range(len(hosts)), key=lambda index: (host_order[hosts[index]], index))
    local: dict[str, int] = {}
    table = []
    for index in by_rank:
        table.append((hosts[index], local.get(hosts[index], 0)))
        local[hosts[index]] = local.get(hosts[index], 0) + 1
    ranked = cross_ranks(table)
    out: list[Identity | None] = [None] * len(hosts)
    for rank, index in enumerate(by_rank):
        out[index] = ranked[rank]
    return out
