"""A PNG of the time per phase per step (needs matplotlib)."""

from __future__ import annotations

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402  (after choosing the file-only backend)

from roundel.timeline.summary import Summary  # noqa: E402


def plot_steps(summary: Summary, path: str) -> None:
    """Stacked bars, one per step (each tensor's n-th collective), one colour per phase; writes ``path``."""
    steps = sorted({step for step, _ in summary.steps})
    figure, axes = plt.subplots(figsize=(max(9.0, min(27.0, 0.25 * len(steps) + 7)), 4.5))
    bottom = [0.0] * len(steps)
    for phase in summary.phase_order:
        heights = [summary.steps.get((step, phase), 0) / 1000 for step in steps]
        axes.bar(steps, heights, bottom=bottom, label=phase)
        bottom = [b + h for b, h in zip(bottom, heights)]
    axes.set_xlabel("step (each tensor's n-th collective)")
    axes.set_ylabel("time (ms, summed over tensors)")
    axes.set_title("roundel timeline: time per phase per step")
    axes.legend(fontsize="small", loc="upper left", bbox_to_anchor=(1.01, 1.0))
    axes.xaxis.get_major_locator().set_params(integer=True)
    figure.tight_layout()
    figure.savefig(path, dpi=100)
    plt.close(figure)
