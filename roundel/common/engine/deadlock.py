"""Deadlock detection: which blocked ranks wait on collectives that can never complete.

Pure logic, no I/O: the coordinator gives each rank's current waits and a way
to ask which ranks a pending collective still misses. A rank that is not
blocked in roundel is *free*: it may still submit anything. A waited
collective can still complete when every rank it misses is free, or is
blocked on something that can itself still complete; what is left after that
fixpoint is deadlocked. A rank that waits for a name it has not sent itself
is on its way, not stuck: its request is still in flight, or its replayed
schedule holds it, which gives it up, or runs it, by itself.
"""

from __future__ import annotations

from typing import Callable, Iterable, Mapping


def deadlocked_ranks(waits: Mapping[int, tuple], live: Iterable[int],
                     missing: Callable[[int, str], tuple | None]) -> dict[int, tuple]:
    """The live ranks that wait only on collectives that cannot complete, with their waits.

    ``waits[rank]`` holds (process set id, name, kind label) triples;
    ``missing(set_id, name)`` returns the ranks that have not yet submitted a
    pending name, or None when the name is not pending (dispatched, running,
    or not yet heard of), which counts as able to complete, as does a name the
    waiting rank itself has not submitted yet.
    """
    live = set(live)
    blocked = {rank: what for rank, what in waits.items() if what and rank in live}
    free = live - set(blocked)
    changed = True
    while changed:
        changed = False
        for rank, what in blocked.items():
            if rank in free:
                continue
            for set_id, name, _ in what:
                lacking = missing(set_id, name)
                if lacking is None or rank in lacking or all(r in free for r in lacking):
                    free.add(rank)
                    changed = True
                    break
    return {rank: what for rank, what in blocked.items() if rank not in free}


def describe(stuck: Mapping[int, tuple], missing: Callable[[int, str], tuple | None]) -> str:
    """'rank 0 waits for barrier '__barrier__.1' (not yet submitted by rank 1); ...'."""
    parts = []
    for rank in sorted(stuck):
        names = []
        for set_id, name, label in stuck[rank]:
            lacking = missing(set_id, name) or ()
            where = f" in process set {set_id}" if set_id else ""
            label_ranks = "rank" if len(lacking) == 1 else "ranks"
            by = f" (not submitted by {label_ranks} {', '.join(map(str, lacking))})" if lacking else ""
            names.append(f"{label} '{name}'{where}{by}")
        parts.append(f"rank {rank} waits for {' and '.join(names)}")
    return "; ".join(parts)
