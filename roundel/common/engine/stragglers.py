"""Which rank holds the others back: rank 0's record of who submitted last, cycle after cycle.

The coordinator notes when each rank's latest submission arrived. At each
dispatch of ready names it takes the rank whose latest submission came last,
and how far behind the median rank it was (its lag). A rank that is last in
most of the recent cycles, by more than a few milliseconds, is a straggler:
the coordinator warns about it while the job runs (at most once a minute per
rank), and prints a per-rank table when the job ends (``--straggler-report``;
by default when the job ran longer than a minute).
"""

from __future__ import annotations

import collections
import statistics
import time

import numpy as np

WINDOW = 200  # recent cycles the live warning looks at
STRAGGLER_SHARE = 0.5  # last in at least this share of the cycles ...
STRAGGLER_LAG_S = 0.010  # ... by at least this much (median), to be named
_WARN_EVERY_S = 60.0
_LAGS_KEPT = 1000  # per rank, for the median in the final table


class StragglerTracker:
    """Per-rank 'submitted last' counts and lags, from the arrival times of the ranks' submissions."""

    def __init__(self, size: int):
        self.size = size
        self.started = time.monotonic()
        self.cycles = 0
        self._arrived = np.full(size, np.nan)  # by rank: when its latest submission arrived (NaN: none yet)
        self._recent: collections.deque = collections.deque(maxlen=WINDOW)  # (last rank, lag s)
        self._last_counts = [0] * size
        self._lags: list[collections.deque] = [collections.deque(maxlen=_LAGS_KEPT) for _ in range(size)]
        self._warned_at: dict[int, float] = {}

    def arrived(self, rank: int, now: float) -> None:
        """``rank``'s submission arrived at ``now``."""
        self._arrived[rank] = now

    def arrived_many(self, ranks, now: float, waited) -> None:
        """``ranks``' submissions (arrays of uint32, or sequences) arrived at ``now`` less the seconds at the
        same place in ``waited`` (float32)."""
        self._arrived[np.asarray(ranks, dtype=np.intp)] = now - np.asarray(waited, dtype=np.float64)

    def cycle(self, ranks) -> None:
        """Names of ``ranks`` were dispatched: record who of them submitted last, and by how much."""
        if isinstance(ranks, range) and len(ranks) == self.size:
            ranks, times = None, self._arrived
        else:
            ranks = np.asarray(ranks, dtype=np.intp)
            times = self._arrived[ranks]
        present = ~np.isnan(times)
        if not present.all():  # some have not submitted yet
            ranks = present.nonzero()[0] if ranks is None else ranks[present]
            times = times[present]
        if len(times) < 2:
            return
        index = int(times.argmax())
        last_at = float(times[index])
        last = index if ranks is None else int(ranks[index])
        middle = (len(times) - 1) // 2
        lag = last_at - float(np.partition(times, middle)[middle])
        self.cycles += 1
        self._recent.append((last, lag))
        self._last_counts[last] += 1
        self._lags[last].append(lag)

    def stragglers(self, recent: bool = False) -> list[tuple[int, float, float]]:
        """(rank, share of cycles it was last in, its median lag then) of each straggler, worst first;
        ``recent``: over the last ``WINDOW`` cycles only (needs a full window)."""
        if recent:
            if len(self._recent) < WINDOW:
                return []
            by_rank: dict[int, list] = {}
            for rank, lag in self._recent:
                by_rank.setdefault(rank, []).append(lag)
            rows = [(rank, len(lags) / len(self._recent), statistics.median(lags)) for rank, lags in by_rank.items()]
        else:
            rows = self.shares()
        return sorted(((r, share, lag) for r, share, lag in rows
                       if share >= STRAGGLER_SHARE and lag >= STRAGGLER_LAG_S), key=lambda row: -row[1] * row[2])

    def shares(self) -> list[tuple[int, float, float]]:
        """(rank, share of the cycles it was last in, its median lag then) of each rank ever last."""
        if not self.cycles:
            return []
        return [(rank, self._last_counts[rank] / self.cycles, statistics.median(self._lags[rank]))
                for rank in range(self.size) if self._last_counts[rank]]

    def warnings(self, now: float, hosts: dict) -> list[str]:
        """A line for each straggler of the recent cycles not warned about in the last minute."""
        lines = []
        for rank, share, lag in self.stragglers(recent=True):
            if now - self._warned_at.get(rank, -_WARN_EVERY_S) < _WARN_EVERY_S:
                continue
            self._warned_at[rank] = now
            lines.append(f"roundel straggler: rank {rank} (host {hosts.get(rank, 'unknown')}) submitted last in "
                         f"{share:.0%} of the last {WINDOW} cycles, {lag * 1e3:.0f} ms behind the median rank; "
                         "the others wait for it (a slower device, more data, or other work on its host)")
        return lines

    def report(self, hosts: dict) -> list[str]:
        """The end-of-job table: each rank's share of cycles it was last in and its median lag then."""
        if not self.cycles:
            return []
        named = self.stragglers()
        lines = [f"roundel straggler report ({self.cycles} cycles): "
                 + ("; ".join(f"rank {r} (host {hosts.get(r, 'unknown')}) was last in {share:.0%} of them, "
                              f"{lag * 1e3:.1f} ms behind the median" for r, share, lag in named)
                    if named else "no rank held the others back"),
                 "  rank  host                  last in  median lag when last (ms)"]
        for rank in range(self.size):
            count = self._last_counts[rank]
            lag = f"{statistics.median(self._lags[rank]) * 1e3:.1f}" if count else "-"
            lines.append(f"  {rank:>4}  {hosts.get(rank, 'unknown')[:20]:<20}  {count / self.cycles:>7.0%}  {lag:>8}")
        return lines
