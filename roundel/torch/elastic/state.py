"""Elastic state for PyTorch: models, optimizers and samplers saved, restored and synced by rank 0."""

from __future__ import annotations

import copy

import torch

from roundel.common import elastic as common
from roundel.torch.elastic.sampler import ElasticSampler
from roundel.torch.functions import broadcast_object, broadcast_optimizer_state, broadcast_parameters

__all__ = ["ObjectState", "State", "TorchState"]


class State(common.State):
    """Base class for custom elastic state objects (implement save, restore and sync)."""

    def __init__(self):
        super().__init__(broadcast_object)


class ObjectState(common.ObjectState):
    """Picklable attributes (``epoch=0, batch=0``) saved, restored and synced from rank 0."""

    def __init__(self, **kwargs):
        super().__init__(broadcast_object, **kwargs)


class _StateDictHandler:
    """Saves a deep copy of ``value.state_dict()`` and loads it back; subclasses say how to sync."""

    def __init__(self, value):
        self.value = value
        self.save()

    def save(self) -> None:
        self._saved = copy.deepcopy(self.value.state_dict())

    def restore(self) -> None:
        self.value.load_state_dict(self._saved)


class _ModelHandler(_StateDictHandler):
    def save(self) -> None:
        self._saved = {k: v.detach().clone() for k, v in self.value.state_dict().items()}

    def sync(self) -> None:
        broadcast_parameters(self.value.state_dict(), root_rank=0)


class _OptimizerHandler(_StateDictHandler):
    def sync(self) -> None:
        broadcast_optimizer_state(self.value, root_rank=0)


class _SamplerHandler(_StateDictHandler):
    def sync(self) -> None:
        # the processed indices are the same on every rank; rank 0's also re-shard for the new size
        self.value.load_state_dict(broadcast_object(self.value.state_dict(), root_rank=0,
                                                    name="elastic.sampler_state"))


def _handler(value):
    if isinstance(value, torch.nn.Module):
        return _ModelHandler(value)
    if isinstance(value, torch.optim.Optimizer):
        return _OptimizerHandler(value)
    if isinstance(value, ElasticSampler):
        return _SamplerHandler(value)
    return None


class TorchState(ObjectState):
    """Elastic state of a PyTorch job: ``TorchState(model, optimizer, epoch=0, batch=0, ...)``.

    Models, optimizers and ``ElasticSampler``s (as ``model``/``optimizer`` or
    any keyword) are saved in memory at ``commit()``, restored after a
    failure and broadcast from rank 0 after every reset; other keywords are
    picklable values handled as by ``ObjectState``. All are attributes.
    """

    def __init__(self, model=None, optimizer=None, **kwargs):
        if model is not None:
            kwargs["model"] = model
        if optimizer is not None:
            kwargs["optimizer"] = optimizer
        self._handlers = {}
        for name in list(kwargs):
            handler = _handler(kwargs[name])
            if handler is not None:
                self._handlers[name] = handler
                setattr(self, name, kwargs.pop(name))
        super().__init__(**kwargs)

    def save(self) -> None:
        for handler in self._handlers.values():
            handler.save()
        super().save()

    def restore(self) -> None:
        for handler in self._handlers.values():
            handler.restore()
        super().restore()

    def sync(self) -> None:
        for handler in self._handlers.values():
            handler.sync()
        super().sync()
