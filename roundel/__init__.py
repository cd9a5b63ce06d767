"""roundel: distributed data-parallel training with Horovod's programming model, in pure Python.

Import a framework adapter (``roundel.torch``); this top-level package stays
free of framework imports so the launcher starts fast.
"""

__version__ = "0.1.0"

__all__ = ["run"]


def __getattr__(name: str):
    """``roundel.run`` (see :func:`roundel.runner.run_api.run`), loaded on first use so that
    ``import roundel`` stays light."""
    if name == "run":
        from roundel.runner.run_api import run

        return run
    raise AttributeError(f"module 'roundel' has no attribute {name!r}")
