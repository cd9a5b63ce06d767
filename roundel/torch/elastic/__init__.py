"""Elastic training for PyTorch: ``hvd.elastic.run``, ``TorchState`` and ``ElasticSampler``."""

from roundel.common.elastic import run_fn
from roundel.errors import HorovodInternalError, HostsUpdatedInterrupt
from roundel.torch.elastic.sampler import ElasticSampler
from roundel.torch.elastic.state import ObjectState, State, TorchState

__all__ = ["ElasticSampler", "HorovodInternalError", "HostsUpdatedInterrupt", "ObjectState", "State",
           "TorchState", "run"]


def run(func):
    """Decorate a training function ``func(state, ...)`` to survive failures and membership changes.

    On HorovodInternalError the state is restored to its last commit; on
    HostsUpdatedInterrupt it is kept. Either way the job is re-formed, the
    state's reset callbacks run, every rank takes rank 0's state, and
    ``func`` is called again with the same state.
    """
    return run_fn(func)
