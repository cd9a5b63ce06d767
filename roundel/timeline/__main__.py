"""``python -m roundel.timeline summarize FILE [--png OUT.png]``."""

from __future__ import annotations

import argparse
import sys

from roundel.timeline.reader import load
from roundel.timeline.summary import summarize


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(prog="python -m roundel.timeline",
                                     description="Read a roundel/Horovod timeline file.")
    commands = parser.add_subparsers(dest="command", required=True)
    summary = commands.add_parser("summarize", help="time per tensor and phase, and the ranks others wait for")
    summary.add_argument("file", help="the timeline JSON (HOROVOD_TIMELINE / --timeline-filename)")
    summary.add_argument("--png", help="also plot the time per phase per step to this PNG file")
    args = parser.parse_args(argv)
    try:
        events = load(args.file)
    except (OSError, ValueError) as exc:
        print(f"cannot read the timeline: {exc}", file=sys.stderr)
        return 2
    result = summarize(events)
    print(result.text())
    if args.png:
        from roundel.timeline.plot import plot_steps  # matplotlib only when a plot is asked for
        plot_steps(result, args.png)
        print(f"wrote {args.png}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
