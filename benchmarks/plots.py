"""PNG plots of the benchmarks' results (matplotlib, Agg backend: no display needed).

``benchmarks/allreduce.py``, ``benchmarks/torch_training.py`` and the other benchmarks call these
after printing their tables; each function writes one PNG and returns its path.
"""

from __future__ import annotations

from pathlib import Path

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402  (after the backend is chosen)


def _save(fig, path) -> Path:
    path = Path(path)
    if path.parent != Path(""):
        path.parent.mkdir(parents=True, exist_ok=True)
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)
    return path.resolve()


def _size_label(nbytes: float) -> str:
    for unit, scale in (("GiB", 1 << 30), ("MiB", 1 << 20), ("KiB", 1 << 10)):
        if nbytes >= scale:
            return f"{nbytes / scale:g} {unit}"
    return f"{nbytes:g} B"


def bus_bandwidth_plot(path, sizes: list[int], lines: dict[str, list[float]], title: str) -> Path:
    """Bus bandwidth (GB/s) against message size (bytes), log-log, one line per implementation.

    ``lines`` maps a label (e.g. "roundel", "raw Gloo") to one bandwidth per size.
    """
    return _log_log(path, sizes, [_size_label(s) for s in sizes], lines, "message size", "bus bandwidth (GB/s)",
                    title, rotate=True)


def _log_log(path, xs: list, tick_labels: list[str], lines: dict[str, list[float]], xlabel: str, ylabel: str,
             title: str, rotate: bool = False) -> Path:
    """One line per label of ``lines`` (a value per x; values <= 0 left out), log-log, ticks at ``xs``."""
    fig, ax = plt.subplots(figsize=(7, 4.5))
    for label, values in lines.items():
        points = [(x, v) for x, v in zip(xs, values) if v > 0]  # a log axis cannot show 0
        ax.plot([x for x, _ in points], [v for _, v in points], marker="o", label=label)
    ax.set_xscale("log", base=2)
    ax.set_yscale("log")
    ax.set_xticks(xs)
    ax.set_xticklabels(tick_labels, **({"rotation": 45, "ha": "right"} if rotate else {}))
    ax.minorticks_off()
    ax.set_xlabel(xlabel)
    ax.set_ylabel(ylabel)
    ax.set_title(title, fontsize=10)
    ax.grid(True, which="major", alpha=0.3)
    ax.legend()
    return _save(fig, path)


def throughput_plot(path, rates: dict[str, tuple[float, float, float]], efficiency: dict[str, float],
                    title: str) -> Path:
    """Two panels: samples/sec per implementation (median, bar; min-max range, error bar) and scaling efficiency.

    ``rates`` maps a label to (median, min, max) samples/sec; ``efficiency``
    maps a label to its scaling efficiency (empty when there is no
    1-process baseline: that panel then says so).
    """
    fig, (left, right) = plt.subplots(1, 2, figsize=(10, 4.5), gridspec_kw={"width_ratios": [3, 2]})
    labels = list(rates)
    medians = [rates[k][0] for k in labels]
    below = [rates[k][0] - rates[k][1] for k in labels]
    above = [rates[k][2] - rates[k][0] for k in labels]
    bars = left.bar(range(len(labels)), medians, yerr=[below, above], capsize=4, color="tab:blue")
    left.bar_label(bars, labels=[f"{m:,.1f}" for m in medians], padding=2, fontsize=8)
    left.set_xticks(range(len(labels)))
    left.set_xticklabels(labels, rotation=20, ha="right", fontsize=8)
    left.set_ylabel("samples/sec (median, min-max)")
    left.set_title("throughput", fontsize=10)
    if efficiency:
        names = list(efficiency)
        bars = right.bar(range(len(names)), [efficiency[k] for k in names], color="tab:green")
        right.bar_label(bars, labels=[f"{efficiency[k]:.3f}" for k in names], padding=2, fontsize=8)
        right.axhline(1.0, color="grey", linestyle="--", linewidth=1)
        right.set_xticks(range(len(names)))
        right.set_xticklabels(names, rotation=20, ha="right", fontsize=8)
        right.set_ylim(0, max(1.1, max(efficiency.values()) * 1.15))
    else:
        right.text(0.5, 0.5, "no 1-process baseline run\n(add 'single' to --only)", ha="center", va="center",
                   transform=right.transAxes)
        right.set_xticks([])
    right.set_ylabel("scaling efficiency")
    right.set_title("N-rank samples/sec / (N x 1-process)", fontsize=10)
    fig.suptitle(title, fontsize=10)
    return _save(fig, path)


def control_scale_plot(path, ranks: list[int], lines: dict[str, list[float]], title: str) -> Path:
    """Milliseconds against the number of ranks, log-log, one line per measure (``control_scale.py``)."""
    return _log_log(path, ranks, [f"{n:,}" for n in ranks], lines, "ranks", "milliseconds", title)


def scaling_plot(path, ranks: list[int], bandwidth: dict[str, tuple[list, list]],
                 efficiency: dict[str, tuple[list, list]], title: str, marked: tuple = ()) -> Path:
    """Two panels against the number of ranks (``scaling.py``): bus bandwidth, and scaling efficiency.

    ``bandwidth`` maps a message-size label to (roundel GB/s, raw Gloo GB/s),
    one value per entry of ``ranks`` (None where not measured): drawn solid
    and dashed (open markers) in the same colour, on a log scale. ``efficiency`` maps a model name to
    (roundel, DDP) scaling efficiencies the same way. Rank counts in
    ``marked`` (oversubscribed: more ranks than cores) get a ``*`` on the axis.
    """
    fig, (left, right) = plt.subplots(1, 2, figsize=(11, 4.5))
    for ax, series, names, ylabel, heading in (
            (left, bandwidth, ("roundel", "raw Gloo"), "bus bandwidth (GB/s)", "allreduce bus bandwidth"),
            (right, efficiency, ("roundel", "DDP"), "scaling efficiency", "N-rank samples/sec / (N x 1-process)")):
        for i, (label, pair) in enumerate(series.items()):
            color = f"C{i % 10}"
            for values, name, style, fill in zip(pair, names, ("-", "--"), (color, "none")):
                points = [(n, v) for n, v in zip(ranks, values) if v is not None and v > 0]
                if points:
                    ax.plot([n for n, _ in points], [v for _, v in points], linestyle=style, marker="o",
                            color=color, markerfacecolor=fill, label=f"{name}, {label}")
        if not series:
            ax.text(0.5, 0.5, "not measured", ha="center", va="center", transform=ax.transAxes)
        ax.set_xscale("log", base=2)
        ax.set_xticks(ranks)
        ax.set_xticklabels([f"{n}*" if n in marked else str(n) for n in ranks])
        ax.minorticks_off()
        ax.set_xlabel("ranks" + (" (* oversubscribed: more ranks than cores)" if marked else ""))
        ax.set_ylabel(ylabel)
        ax.set_title(heading, fontsize=10)
        ax.grid(True, which="major", alpha=0.3)
        if series:
            ax.legend(fontsize=7, ncol=2 if len(series) > 3 else 1)
    if bandwidth:
        left.set_yscale("log")  # the sizes' bandwidths lie orders of magnitude apart
    if efficiency:
        right.axhline(1.0, color="grey", linestyle=":", linewidth=1)
        right.set_ylim(bottom=0)
    fig.suptitle(title, fontsize=10)
    return _save(fig, path)


def scaling_model_plot(path, ranks: list[int], lines: dict[str, list[float]], reference: dict, title: str) -> Path:
    """Predicted scaling efficiency against ranks (log x), one line per label, and a published point.

    ``lines`` maps a label (model and network) to one efficiency (0-1) per rank count; ``reference``
    holds ``ranks``, ``efficiency`` and ``label`` of the published figure marked beside them.
    """
    fig, ax = plt.subplots(figsize=(7, 4.5))
    for label, values in lines.items():
        ax.plot(ranks, values, marker="o", label=label)
    ax.plot([reference["ranks"]], [reference["efficiency"]], marker="*", markersize=14, color="black",
            linestyle="none", label=reference["label"])
    ax.set_xscale("log", base=2)
    ax.set_xticks(ranks)
    ax.set_xticklabels([f"{n:,}" for n in ranks])
    ax.minorticks_off()
    ax.axhline(1.0, color="grey", linestyle="--", linewidth=1)
    ax.set_ylim(0, 1.05)
    ax.set_xlabel("ranks")
    ax.set_ylabel("scaling efficiency (compute / step)")
    ax.set_title(title, fontsize=9)
    ax.grid(True, alpha=0.3)
    ax.legend(fontsize=7)
    return _save(fig, path)
