"""Elastic state for PyTorch: models, optimizers and samplers saved, restored and synced by rank 0."""

from __future__ import annotations

import copy

import torch

from roundel.common.elastic import ObjectState, State
from roundel.torch.elastic.sampler import ElasticSampler
from roundel.torch.functions import (broadcast_object, broadcast_optimizer_state, broadcast_parameters,
                                     broadcast_state_dict)

__all__ = ["ObjectState", "State", "StateHandler", "TorchState", "get_handler_registry", "set_handler_registry"]


class StateHandler:
    """How ``TorchState`` saves, restores and syncs one kind of attribute (Horovod's interface).

    Register a subclass for a type with ``set_handler_registry``; assigning a
    new object to the attribute (``state.model = new_model``) calls ``set_value``.
    """

    def __init__(self, value):
        self.value = value

    def save(self) -> None:
        raise NotImplementedError()

    def restore(self) -> None:
        raise NotImplementedError()

    def sync(self) -> None:
        raise NotImplementedError()

    def set_value(self, value) -> None:
        """Handle ``value`` from now on, its current state being the point to roll back to."""
        self.value = value
        self.save()


class _StateDictHandler(StateHandler):
    """Saves a deep copy of ``value.state_dict()`` and loads it back; subclasses say how to sync."""

    def __init__(self, value):
        super().__init__(value)
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
    """An optimizer; one with ``shard_optimizer_state=True`` is saved as its full state (gathered at
    ``commit()``, so that a lost rank's slice survives) and re-sharded for the new ranks at ``sync()``."""

    def _sharded(self) -> bool:
        return getattr(self.value, "_roundel_sharded", False)

    def save(self) -> None:
        if self._sharded():
            self._saved = self.value.state_dict()  # a collective; new tensors, no copy needed
        else:
            super().save()

    def sync(self) -> None:
        if self._sharded():
            # rank 0's saved state is its current one here (just restored, or committed before a planned
            # change, or taken at start); the survivors' slices were laid out for the old ranks
            self._saved = broadcast_state_dict(self._saved, root_rank=0)
            self.value.load_state_dict(self._saved)
        else:
            broadcast_optimizer_state(self.value, root_rank=0)


class _SamplerHandler(_StateDictHandler):
    def sync(self) -> None:
        # the processed indices are the same on every rank; rank 0's also re-shard for the new size
        self.value.load_state_dict(broadcast_object(self.value.state_dict(), root_rank=0,
                                                    name="elastic.sampler_state"))


ModelStateHandler, OptimizerStateHandler, SamplerStateHandler = _ModelHandler, _OptimizerHandler, _SamplerHandler

_handler_registry = [
    (torch.nn.Module, ModelStateHandler),
    (torch.optim.Optimizer, OptimizerStateHandler),
    (ElasticSampler, SamplerStateHandler),
]


def get_handler_registry() -> list:
    """The ``(type, StateHandler subclass)`` pairs ``TorchState`` consults, first match wins."""
    return _handler_registry


def set_handler_registry(registry) -> None:
    """Replace the registry (for states created afterwards), e.g. to add a handler for your own type."""
    global _handler_registry
    _handler_registry = registry


def _handler(value):
    for handled_type, handler_cls in _handler_registry:
        if isinstance(value, handled_type):
            return handler_cls(value)
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

    def __setattr__(self, name, value):
        if hasattr(self, name) and name in self._handlers:  # a new model/optimizer: its handler takes it
            self._handlers[name].set_value(value)
        super().__setattr__(name, value)

    def save(self) -> None:
        for handler in self._handlers.values():
            handler.save()
        super().save()

    def restore(self) -> None:
        for handler in self._handlers.values():
            handler.restore()
        super().restore()

    def sync(self) -> None:
        """Take rank 0's state; it becomes the point to roll back to (a new rank has no commit of its own)."""
        for handler in self._handlers.values():
            handler.sync()
            handler.save()
        super().sync()
