"""Rank 0's tqdm progress bar for the PyTorch and TensorFlow examples, in samples and samples/s.

``sample_bar(total, desc, rank)`` is a tqdm bar on rank 0 and a silent one on
every other rank (Horovod's convention: one rank reports). The caller counts
the samples of the whole job, so the rate it shows, ``N samples/s``, is the
job's throughput. Under ``roundelrun`` a rank's stderr is a pipe; the bar is
redrawn in place when roundelrun's own output is a terminal (it then sets
``ROUNDEL_TERMINAL=1`` for the ranks and relays the redraws live), and is
otherwise written as a new line every couple of seconds.
"""

from __future__ import annotations

import os
import sys

from tqdm import tqdm


class _Lines:
    """A stream for tqdm that turns its carriage-return redraws into whole lines."""

    def __init__(self, stream):
        self.stream = stream

    def write(self, text: str) -> None:
        for part in text.replace("\r", "\n").split("\n"):
            if part.strip():
                self.stream.write(part.rstrip() + "\n")

    def flush(self) -> None:
        self.stream.flush()


def sample_bar(total: int | None, desc: str, rank: int) -> tqdm:
    """A progress bar counting ``total`` samples on rank 0 (``update(n)`` per batch); disabled on other ranks."""
    tty = sys.stderr.isatty()
    live = tty or os.environ.get("ROUNDEL_TERMINAL") == "1"
    return tqdm(total=total, desc=desc, unit=" samples", disable=rank != 0, dynamic_ncols=tty,
                ncols=None if tty else 100, file=sys.stderr if live else _Lines(sys.stderr),
                mininterval=0.1 if live else 2.0)
