"""Elastic training on the worker side: training state that survives resets, and the retry loop.

A training function decorated with a framework's ``elastic.run`` gets a
``State``. The loop ``commit()``s it now and then. When a peer fails, every
survivor sees ``HorovodInternalError`` on its main thread; the loop rolls its
state back to the last commit, leaves the broken communicator, joins the
next generation (see :mod:`roundel.rendezvous.elastic_join`), runs the
reset callbacks, takes rank 0's state (which also becomes the point to roll
back to) and calls the training function again.
When the driver plans a membership change, rank 0 notices it at a
``commit()`` and tells every rank in the same collective, so all ranks raise
``HostsUpdatedInterrupt`` at the same commit and reset together (keeping
their state: nothing was lost). As in Horovod, the driver's notices of
those changes also arrive, as ``(timestamp, HostUpdate)``, in a state's
``_host_messages`` queue, which scripts written for Horovod poll.
"""

from __future__ import annotations

import copy
import functools
import logging
import queue
import re
import threading
import time
import weakref

import numpy as np

from roundel.common import basics, objects
from roundel.common.engine.metrics import METRICS
from roundel.errors import HostsUpdatedInterrupt, RoundelInternalError
from roundel.rendezvous import elastic_join
from roundel.rendezvous.store import RendezvousError, RendezvousTimeout

__all__ = ["ModelState", "ObjectState", "State", "VariablesState", "raising_internal_errors", "reset",
           "run_fn"]

log = logging.getLogger("roundel")


class State:
    """Training state that ``elastic.run`` can save, roll back and share from rank 0 (``hvd.elastic.State``).

    The base class of every adapter's states; subclass it for custom state
    and implement ``save()``, ``restore()`` and ``sync()``. Objects travel
    with :func:`roundel.common.objects.broadcast_object`, which every
    adapter's ``broadcast_object`` is.
    """

    _last_updated_timestamp = 0.0  # of the latest host notice taken from _host_messages (Horovod's name)

    def __init__(self):
        self._reset_callbacks: list = []

    @property
    def _host_messages(self) -> queue.Queue:
        """The driver's notices of membership changes not yet taken by ``check_host_updates()``, as
        ``(timestamp, HostUpdate)``: Horovod's queue, which its elastic scripts poll with ``empty()``.

        Filled from the first time it is read (a thread then watches the driver's notices); empty
        outside an elastic job.
        """
        messages = self.__dict__.get("_roundel_host_messages")
        if messages is None:
            messages = self.__dict__["_roundel_host_messages"] = queue.Queue()
        _HOST_NOTICES.deliver_to(self)
        return messages

    def _take_host_messages(self) -> None:
        """Empty ``_host_messages`` (the store's hosts version, not the queue, decides whether to reset)."""
        messages = self.__dict__.get("_roundel_host_messages")
        while messages is not None and not messages.empty():
            timestamp, _ = messages.get()
            self._last_updated_timestamp = max(self._last_updated_timestamp, timestamp)

    def register_reset_callbacks(self, callbacks) -> None:
        """Call each of ``callbacks`` (no arguments) after every reset, e.g. to rescale the learning rate."""
        self._reset_callbacks.extend(callbacks)

    def on_reset(self) -> None:
        """Run the reset callbacks (``elastic.run`` calls this after each reset, before ``sync()``)."""
        self._take_host_messages()  # notices of the change this reset made are no longer news
        for callback in self._reset_callbacks:
            callback()

    def commit(self) -> None:
        """Save the state as the point to roll back to, then ``check_host_updates()``."""
        self.save()
        self.check_host_updates()

    def check_host_updates(self) -> None:
        """Raise HostsUpdatedInterrupt on every rank when the driver has planned a membership change.

        Rank 0 decides and broadcasts the answer, so all ranks raise at the
        same call. Outside an elastic job this does nothing.
        """
        runtime = basics.runtime("check_host_updates()")
        if runtime.elastic is None:
            return
        self._take_host_messages()
        latest = elastic_join.hosts_version(runtime.client) if basics.rank() == 0 else None
        latest = objects.broadcast_object(latest, root_rank=0, name="elastic.hosts_version")
        if latest > runtime.elastic.hosts_version:
            raise HostsUpdatedInterrupt()

    def save(self) -> None:
        """Keep a copy of the current state in memory."""
        raise NotImplementedError

    def restore(self) -> None:
        """Go back to the last saved copy."""
        raise NotImplementedError

    def sync(self) -> None:
        """Make every rank's state equal to rank 0's; that is also each rank's new point to roll back to."""
        raise NotImplementedError


class ObjectState(State):
    """State made of picklable attributes given as keyword arguments (``hvd.elastic.ObjectState(epoch=0)``).

    Each keyword becomes an attribute; ``save()`` copies them, ``restore()``
    puts the copy back, and ``sync()`` takes rank 0's saved values (as this
    rank's saved values too).
    """

    def __init__(self, **kwargs):
        super().__init__()
        self._saved = copy.deepcopy(kwargs)
        self._apply_saved()

    def _apply_saved(self) -> None:
        for name, value in copy.deepcopy(self._saved).items():
            setattr(self, name, value)

    def save(self) -> None:
        self._saved = {name: copy.deepcopy(getattr(self, name)) for name in self._saved}

    def restore(self) -> None:
        self._apply_saved()

    def sync(self) -> None:
        if self._saved:
            self._saved = objects.broadcast_object(self._saved, root_rank=0, name="elastic.object_state")
            self._apply_saved()


class VariablesState(ObjectState):
    """ObjectState plus a list of variables, saved as NumPy copies and broadcast from rank 0 by ``sync()``.

    A variable is anything NumPy can read that has ``assign(value)`` (a
    ``tf.Variable``, a Keras variable); ``bcast_variables(variables, root_rank)``
    is the framework's ``broadcast_variables``.
    """

    def __init__(self, bcast_variables, variables, **kwargs):
        self._variables = list(variables)
        self._bcast_variables = bcast_variables
        self._saved_values = self._values()
        super().__init__(**kwargs)

    def _values(self) -> list:
        return [np.array(v, copy=True) for v in self._variables]

    def save(self) -> None:
        self._saved_values = self._values()
        super().save()

    def restore(self) -> None:
        for v, value in zip(self._variables, self._saved_values):
            v.assign(value)
        super().restore()

    def sync(self) -> None:
        if self._variables:
            self._bcast_variables(self._variables, root_rank=0)
            self._saved_values = self._values()
        super().sync()


class ModelState(VariablesState):
    """The state of a Keras 3 model and optimizer (and picklable keywords), for any Keras backend.

    Holds the built ``model``'s weights and the variables of ``optimizer``
    (default ``model.optimizer``), which is built for the model's trainable
    variables here if it is not yet, so its slots exist before the first
    step. The optimizer's learning rate is left out: a reset callback rescales
    it on the ranks that reset, while ranks that just joined set it
    themselves (as Horovod leaves hyper-parameters to each rank). After every
    reset the model's traced functions are dropped, so the next
    ``fit``/``evaluate``/``predict`` traces them again for the new size.
    """

    def __init__(self, bcast_variables, model, optimizer=None, **kwargs):
        self.model = model
        self.optimizer = optimizer if optimizer is not None else getattr(model, "optimizer", None)
        variables = list(model.weights)
        if self.optimizer is not None:
            if not self.optimizer.built:
                self.optimizer.build(model.trainable_variables)
            variables += [v for v in self.optimizer.variables if v is not self.optimizer.learning_rate]
        super().__init__(bcast_variables, variables, **kwargs)

    def on_reset(self) -> None:
        self.model.train_function = self.model.test_function = self.model.predict_function = None
        super().on_reset()


class _HostNoticeWatcher:
    """Puts the driver's notices of membership changes into the ``_host_messages`` of the States that read
    it, from one daemon thread started at the first such read in an elastic job."""

    def __init__(self):
        self._states: weakref.WeakSet = weakref.WeakSet()
        self._lock = threading.Lock()
        self._thread: threading.Thread | None = None

    def deliver_to(self, state: State) -> None:
        with self._lock:
            self._states.add(state)
            if self._thread is None and elastic_join.worker_id() is not None:
                self._thread = threading.Thread(target=self._watch, name="roundel-host-notices", daemon=True)
                self._thread.start()

    def _watch(self) -> None:
        seen = 0  # the last membership change delivered
        while True:
            runtime = basics.runtime_if_initialized()  # None while the job re-forms
            if runtime is None or runtime.elastic is None:
                time.sleep(0.1)
                continue
            seen = max(seen, runtime.elastic.hosts_version)
            try:
                raw = runtime.client.get(elastic_join.hosts_update_key(seen + 1), elastic_join.WATCH_POLL_S)
            except RendezvousTimeout:
                continue
            except RendezvousError:  # this generation's client closed by a reset; the next one's comes
                time.sleep(0.1)
                continue
            seen += 1
            now = basics.runtime_if_initialized()
            if now is None or now.elastic is None or now.elastic.hosts_version >= seen:
                continue  # the generation it announced has formed meanwhile: no longer news
            notice = elastic_join.read_host_update_notice(raw)
            with self._lock:
                states = list(self._states)
            for state in states:
                state.__dict__["_roundel_host_messages"].put(notice)


_HOST_NOTICES = _HostNoticeWatcher()


def reset() -> None:
    """Leave the current communicator and join the next generation of the job."""
    METRICS.count("roundel_elastic_resets_total")
    basics.shutdown()
    basics.init()


_WRAPPED_INTERNAL_ERROR = re.compile(r"(?:Roundel|Horovod)InternalError: ([^\n]*)")


def raising_internal_errors(func, wrapper_type: type[BaseException], text_of=str):
    """``func`` with a roundel internal error that compiled code reported as a ``wrapper_type`` (whose
    text, ``text_of(error)``, names it) raised as RoundelInternalError again, so that ``run_fn`` rolls
    back as for an eager one."""

    @functools.wraps(func)
    def wrapper(*args, **kwargs):
        try:
            return func(*args, **kwargs)
        except wrapper_type as exc:
            match = _WRAPPED_INTERNAL_ERROR.search(text_of(exc) or "")
            if match is None:
                raise
            raise RoundelInternalError(match.group(1)) from exc

    return wrapper


def run_fn(func):
    """Wrap ``func(state, ...)`` so that failures and membership changes reset and retry it.

    The wrapped function returns ``func``'s result once it
    returns normally; it raises what ``func`` raises other than
    HorovodInternalError and HostsUpdatedInterrupt, and re-raises the error
    of a reset that cannot join a new generation.
    """

    @functools.wraps(func)
    def wrapper(state, *args, **kwargs):
        needs_reset = False
        while True:
            try:
                if needs_reset:
                    reset()
                    # before sync, as in Horovod: what the callbacks set on rank 0 (a learning rate
                    # rescaled for the new size) reaches the ranks that just joined
                    state.on_reset()
                state.sync()
                return func(state, *args, **kwargs)
            except elastic_join.JoinError:
                raise
            except RoundelInternalError as exc:
                log.warning("roundel elastic: %s; rolling back to the last commit and re-forming the job", exc)
                state.restore()
            except HostsUpdatedInterrupt:
                log.info("roundel elastic: the job's hosts changed; re-forming the job")
            needs_reset = True

    return wrapper
