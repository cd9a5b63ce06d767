"""Reading roundel (and Horovod) timeline files: ``load`` them, ``summarize`` them.

Command line: ``python -m roundel.timeline summarize FILE [--png OUT.png]``.
"""

from roundel.timeline.reader import load
from roundel.timeline.summary import Summary, summarize

__all__ = ["Summary", "load", "summarize"]
