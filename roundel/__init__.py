"""roundel: distributed data-parallel training with Horovod's programming model, in pure Python.

Import a framework adapter (``roundel.torch``); this top-level package stays
free of framework imports so the launcher starts fast.
"""

__version__ = "0.1.0"
