"""What a timeline says: time per tensor and phase, per step, and which ranks were late to submit."""

from __future__ import annotations

import statistics
from collections import defaultdict
from dataclasses import dataclass, field


@dataclass
class RankLateness:
    """How far one rank's requests arrived behind the first rank's, over every negotiation it was in."""

    rank: int
    negotiations: int = 0
    times_last: int = 0
    total_lag_us: int = 0
    lags_when_last_us: list = field(default_factory=list)  # behind the median rank, each time it was last

    @property
    def mean_lag_us(self) -> float:
        return self.total_lag_us / self.negotiations if self.negotiations else 0.0


@dataclass
class Summary:
    """Totals read from a timeline's events (times in microseconds).

    ``phases`` maps (tensor, phase) to a list of durations (a collective's
    time includes its nested activities); ``steps`` maps (step, phase) to the
    time spent in that phase and not in a nested one, where step n is each
    tensor's n-th collective; ``ranks`` holds each rank's lateness in
    negotiations.
    """

    phases: dict = field(default_factory=lambda: defaultdict(list))
    steps: dict = field(default_factory=lambda: defaultdict(int))
    ranks: dict = field(default_factory=dict)
    phase_order: list = field(default_factory=list)
    cycles: int = 0

    def text(self) -> str:
        """The summary as tables for a terminal."""
        # names are never cut (two may differ only at their end): the column is as wide as the longest
        width = max([40, *(len(tensor) for tensor, _ in self.phases)])
        phase_width = max([28, *(len(phase) for phase in self.phase_order)])
        head = f"{'phase':<{phase_width}} {'count':>6} {'total ms':>10} {'mean ms':>9}"
        lines = [f"{'tensor':<{width}} {head}"]
        order = {phase: i for i, phase in enumerate(self.phase_order)}
        for (tensor, phase), durations in sorted(self.phases.items(), key=lambda kv: (kv[0][0], order[kv[0][1]])):
            total = sum(durations)
            lines.append(f"{tensor:<{width}} {phase:<{phase_width}} {len(durations):>6} {total / 1000:>10.3f} "
                         f"{total / len(durations) / 1000:>9.3f}")
        lines.append("")
        lines.append(f"{'all tensors':<{width}} {head}")
        totals = defaultdict(list)
        for (_, phase), durations in self.phases.items():
            totals[phase].extend(durations)
        for phase in self.phase_order:
            durations = totals[phase]
            lines.append(f"{'':<{width}} {phase:<{phase_width}} {len(durations):>6} {sum(durations) / 1000:>10.3f} "
                         f"{sum(durations) / len(durations) / 1000:>9.3f}")
        lines.append("")
        if self.ranks:
            lines.append("slowest ranks to submit (lag behind the first rank to submit the same collective; "
                         "last in: share of negotiations it completed, and its median lag behind the median "
                         "rank then, as the straggler report counts them):")
            lines.append(f"{'rank':>6} {'times last':>11} {'negotiations':>13} {'mean lag ms':>12} "
                         f"{'total lag ms':>13} {'last in':>8} {'lag when last ms':>17}")
            for late in sorted(self.ranks.values(), key=lambda r: (-r.total_lag_us, r.rank)):
                when_last = (f"{statistics.median(late.lags_when_last_us) / 1000:>17.3f}"
                             if late.lags_when_last_us else f"{'-':>17}")
                lines.append(f"{late.rank:>6} {late.times_last:>11} {late.negotiations:>13} "
                             f"{late.mean_lag_us / 1000:>12.3f} {late.total_lag_us / 1000:>13.3f} "
                             f"{late.times_last / late.negotiations:>8.0%} {when_last}")
        else:
            lines.append("no negotiation with more than one rank in this timeline")
        if self.cycles:
            lines.append(f"engine cycles marked: {self.cycles}")
        return "\n".join(lines)


def summarize(events: list[dict]) -> Summary:
    """Read ``events`` (from ``load``); spans left open by a killed job are ignored."""
    summary = Summary()
    names: dict = {}
    stacks: dict = defaultdict(list)  # (pid, tid) -> [[phase, start ts, step, time in nested spans]]
    counts: dict = defaultdict(int)  # (pid, tid) -> collectives begun
    arrivals: dict = defaultdict(list)  # (pid, tid) -> [(ts, rank)] in the open negotiation
    for event in events:
        phase_type = event.get("ph")
        pid, tid = event.get("pid", 0), event.get("tid", 0)
        row = (pid, tid)
        if phase_type == "M":
            if event.get("name") == "process_name" and pid:
                names[pid] = event.get("args", {}).get("name", str(pid))
        elif phase_type == "B":
            stack = stacks[row]
            if event.get("name", "") not in summary.phase_order:
                summary.phase_order.append(event.get("name", ""))
            if not stack:
                counts[row] += 1
            stack.append([event.get("name", ""), event.get("ts", 0), counts[row] - 1, 0])
        elif phase_type == "E" and stacks[row]:
            phase, start, step, nested = stacks[row].pop()
            duration = event.get("ts", 0) - start
            if stacks[row]:
                stacks[row][-1][3] += duration
            tensor = names.get(pid, str(pid))
            summary.phases[(tensor, phase)].append(duration)
            summary.steps[(step, phase)] += duration - nested
            if phase.startswith("NEGOTIATE_"):
                _count_lateness(summary.ranks, arrivals.pop(row, []))
        elif phase_type == "X" and stacks[row] and stacks[row][-1][0].startswith("NEGOTIATE_"):
            try:
                arrivals[row].append((event.get("ts", 0), int(event.get("name", ""))))
            except ValueError:
                pass
        elif phase_type == "i" and event.get("name") == "CYCLE_START":
            summary.cycles += 1
    return summary


def _count_lateness(ranks: dict, arrived: list) -> None:
    if len(arrived) < 2:
        return
    arrived.sort()
    first = arrived[0][0]
    for ts, rank in arrived:
        late = ranks.setdefault(rank, RankLateness(rank))
        late.negotiations += 1
        late.total_lag_us += ts - first
    last_ts, last = arrived[-1]
    ranks[last].times_last += 1
    ranks[last].lags_when_last_us.append(last_ts - arrived[(len(arrived) - 1) // 2][0])
