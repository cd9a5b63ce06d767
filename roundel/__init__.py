"""roundel: distributed data-parallel training with Horovod's programming model, in pure Python.

Import a framework adapter (``roundel.torch``); this top-level package stays
free of framework imports so the launcher starts fast.
"""

__version__ = "0.1.0"

__all__ = ["RankFailedError", "run"]


def __getattr__(name: str):
    """``roundel.run`` and ``roundel.RankFailedError`` (see :mod:`roundel.runner.run_api`), loaded on
    first use so that ``import roundel`` stays light."""
    if name in __all__:
        from roundel.runner import run_api

        return getattr(run_api, name)
    raise AttributeError(f"module 'roundel' has no attribute {name!r}")
