"""init/shutdown, this process's ranks, and process-set registration.

``init()`` reads the identity and rendezvous address the launcher put in the
environment (or, with no launcher, makes a job of one), connects the global
Gloo communicator and starts the engine. Every framework adapter re-exports
these functions.
"""

from __future__ import annotations

import atexit
import importlib.util
import json
import logging
import os
import sys
import threading
from datetime import timedelta

from roundel.common import communicator, failures
from roundel.common.engine.core import Engine
from roundel.common.engine.process_set_registry import ProcessSetRegistry
from roundel.common.process_sets import ProcessSet, global_process_set
from roundel.common.control.records import OpKind, Request
from roundel.common.engine.requests import ProcessSetChange
from roundel.common.settings import Settings
from roundel.common.engine.timeline import Timeline
from roundel.errors import NotInitializedError, RoundelInternalError
from roundel.rendezvous import bootstrap, elastic_join
from roundel.rendezvous.identity import Identity, detect_launcher
from roundel.rendezvous.store import RendezvousClient, RendezvousError
from roundel.transport import factory, nccl
from roundel.transport.gloo import raise_open_file_limit
from roundel.transport.store_adapter import RendezvousStore

log = logging.getLogger("roundel")


class _Runtime:
    """Everything one ``init()`` built; dropped by ``shutdown()``."""

    def __init__(self, ident: Identity, settings: Settings, engine, client, server, prefix: str,
                 advertise_host: str, process_sets: ProcessSetRegistry, secret: bytes):
        self.identity = ident
        self.settings = settings
        self.engine = engine
        self.client = client
        self.server = server
        self.prefix = prefix
        self.advertise_host = advertise_host
        self.process_sets = process_sets
        self.secret = secret
        self.next_process_set_id = 1
        self.barrier_count = 0
        self.elastic: bootstrap.Bootstrap | None = None  # an elastic worker's: its generation and hosts version
        self.unnamed_calls = 0
        self._unnamed_counts: dict[tuple[str, int], int] = {}
        self._unnamed_lock = threading.Lock()

    def next_unnamed(self) -> int:
        """A number for a collective the user left unnamed: the same on every rank for the n-th call."""
        self.unnamed_calls += 1
        return self.unnamed_calls

    def unnamed_name(self, label: str, process_set_id: int) -> str:
        """'<label>.noname.<n>' for the n-th unnamed ``label`` op on a process set since this ``init()``.

        Numbered per op kind and process set and restarted by every ``init()``, so
        every member agrees on the n-th name, including ranks that joined late
        (an elastic reset) or ran other collectives on other process sets.
        """
        return f"{label}.noname.{self._count((label, process_set_id))}"

    def next_barrier(self, process_set_id: int) -> int:
        """The number of this barrier on a process set since this ``init()`` (the same on every member)."""
        return self._count(("barrier", process_set_id))

    def next_object_call(self, process_set_id: int, name: str) -> int:
        """The number of this object collective ``name`` on a process set since this ``init()`` (its seals'
        sequence number; the same on every member)."""
        return self._count(("object", process_set_id, name))

    def _count(self, key: tuple) -> int:
        with self._unnamed_lock:
            count = self._unnamed_counts[key] = self._unnamed_counts.get(key, 0) + 1
        return count


# One runtime per process, at module level because the API is module level (hvd.rank(), hvd.allreduce()
# take no context object, as in Horovod); everything an init() builds hangs off it and goes with shutdown().
_runtime: _Runtime | None = None
_init_count = 0
_lock = threading.RLock()
_atexit_registered = False
_stuck: list = []  # runtimes whose executor was left inside a transfer with a lost rank


def _client():
    return _runtime.client if _runtime is not None else None


# an uncaught exception is recorded for roundelrun from the start: one before init() too (an operation before it)
failures.install(_client)


def _configure_logging(level: str) -> None:
    """roundel's log lines on stderr at ``level``, with the time unless HOROVOD_LOG_HIDE_TIME is set
    (Horovod's default and meaning); at debug level the settings in effect are logged first."""
    settings = Settings.from_env()
    if not log.handlers:
        log.addHandler(logging.StreamHandler(sys.stderr))
        log.propagate = False
    for handler in log.handlers:
        handler.setFormatter(logging.Formatter("%(message)s" if settings.log_hide_time else
                                               "[%(asctime)s.%(msecs)03d] %(message)s", "%Y-%m-%d %H:%M:%S"))
    log.setLevel({"trace": logging.DEBUG, "fatal": logging.CRITICAL}.get(level, level.upper()))
    log.debug("roundel: settings %s", settings)


def init(comm=None, process_sets=None) -> None:
    """Join the job: connect to the other ranks and start the background engine.

    ``comm`` (Horovod's sub-communicator): None for every launched rank, or a
    list of launched ranks or an mpi4py communicator; the job is then those
    ranks, renumbered in that order (disjoint lists make separate jobs).
    ``process_sets`` is a list of ``ProcessSet`` to register at once (the same
    list on every rank), or ``"dynamic"`` (accepted for Horovod; process sets
    can always be added later). Calling ``init()`` again while initialized does
    nothing; after ``shutdown()`` it starts afresh. Raises ``SettingsError`` for
    bad settings and ``RoundelInternalError`` when the other ranks cannot be reached.
    """
    global _runtime, _init_count, _atexit_registered
    with _lock:
        if _runtime is not None:
            return
        if isinstance(process_sets, str):
            if process_sets.lower() != "dynamic":
                raise ValueError(f"init(process_sets={process_sets!r}): pass a list of ProcessSet or 'dynamic'")
            process_sets = None
        settings = Settings.from_env()
        _configure_logging(settings.log_level)
        factory.check(_transport(settings), detect_launcher())
        prefix = f"init{_init_count}/"
        _init_count += 1
        raise_open_file_limit()  # stray connections to Gloo's port must not exhaust the descriptors
        # roundelrun's variables, or torchrun's / mpirun's / srun's (rank 0 then serves the store)
        boot = bootstrap.discover(prefix, settings.start_timeout_s, nics=settings.network_interface)
        host, port, secret, server = boot.host, boot.port, boot.secret, boot.server
        try:
            client = RendezvousClient(host, port, secret, connect_timeout=settings.start_timeout_s,
                                      served_by=boot.served_by)
        except BaseException:
            boot.forget_secret_file()
            if server is not None:
                server.stop()
            raise
        try:
            ident = boot.complete(client, prefix, settings.start_timeout_s, settings.elastic_timeout_s)
            if boot.elastic:  # scripts read HOROVOD_RANK, HOROVOD_HOSTNAME, ...: this generation's identity
                os.environ.update(ident.to_env())
            members = communicator.member_ranks(comm, ident.rank, ident.size)
            if members is not None:  # a job of some of the launched ranks: its own numbering and keys
                ident, prefix = communicator.sub_identity(client, prefix, ident, members, settings.start_timeout_s)
            # tells the launcher this rank has joined (roundelrun --verbose prints it)
            client.set(f"{prefix}joined/{ident.rank}", json.dumps([ident.hostname, os.getpid()]).encode())
        except BaseException:
            boot.forget_secret_file()
            client.close()
            if server is not None:
                server.stop()
            raise
        if boot.elastic:  # every member of this generation, old or new, uses the same keys
            prefix = f"gen{boot.generation}/"
        advertise = bootstrap.advertise_address(host, port, settings.network_interface)
        timeline = Timeline()  # started before the engine, so the first requests are recorded
        if settings.timeline_filename and settings.timeline_filename != "DYNAMIC":
            try:  # resumed after an elastic reset: the same file goes on
                _open_timeline(timeline, ident.rank, settings.timeline_filename, settings.timeline_mark_cycles,
                               resume=True)
            except ValueError as exc:  # as Horovod: the job runs on without a timeline
                log.error("roundel: %s; the job goes on without a timeline", exc)

        def connect() -> tuple[ProcessSetRegistry, Engine]:
            return _connect(settings, client, prefix, ident, members, advertise, secret, timeline)

        try:
            if boot.elastic:  # a peer failing meanwhile sends every member on to the next generation at once
                assert boot.generation is not None, "complete() numbers an elastic worker's generation"
                table, engine = elastic_join.connect_within(client, boot.generation, connect, _disconnect)
            else:
                table, engine = connect()
        except BaseException:
            timeline.stop()
            client.close()
            if server is not None:
                server.stop()
            raise
        _runtime = _Runtime(ident, settings, engine, client, server, prefix, advertise, table, secret)
        _runtime.elastic = boot if boot.elastic else None
        global_process_set._bind(0, range(ident.size), ident.rank)
        if not _atexit_registered:
            atexit.register(_shutdown_at_exit)
            failures.install(_client)  # an elastic worker has its ROUNDEL_RANK only now
            _atexit_registered = True
    for process_set in process_sets or ():
        add_process_set(process_set)


def _connect(settings: Settings, client: RendezvousClient, prefix: str, ident, members, advertise: str,
             secret: bytes, timeline: Timeline) -> tuple[ProcessSetRegistry, Engine]:
    """Connect this rank to the others: the job's transport, then the engine (the process set registry,
    holding the job's own set, and the engine). Raises RoundelInternalError when the others cannot be reached."""
    store = RendezvousStore(client, prefix + "ps0/", timedelta(seconds=settings.start_timeout_s))
    try:
        backend = factory.job_backend(_transport(settings), store, ident.rank, ident.size, advertise,
                                      members or tuple(range(ident.size)), placement=ident)
    except (RuntimeError, RendezvousError) as exc:
        raise RoundelInternalError(
            f"rank {ident.rank} could not connect to the other {ident.size - 1} rank(s) within "
            f"{settings.start_timeout_s:g} s: {exc}") from exc
    table = ProcessSetRegistry(tuple(range(ident.size)), backend)
    try:
        engine = Engine(ident.rank, ident.size, settings, secret, client, prefix, advertise, table, timeline,
                        placement=(ident.local_rank, ident.cross_rank, ident.hostname, ident.local_size))
    except RendezvousError as exc:
        factory.close(backend)
        raise RoundelInternalError(f"rank {ident.rank} could not join rank 0's coordinator: {exc}") from exc
    except BaseException:
        factory.close(backend)
        raise
    return table, engine


def _disconnect(connected: tuple[ProcessSetRegistry, Engine]) -> None:
    """Close what ``_connect`` made, for a generation given up while it connected."""
    table, engine = connected
    engine.shutdown()
    factory.close(table.job_backend)


def shutdown() -> None:
    """Leave the job and stop the engine; ``init()`` may be called again afterwards."""
    global _runtime
    with _lock:
        runtime, _runtime = _runtime, None
        if runtime is None:
            return
        stopped = runtime.engine.shutdown()
        runtime.engine.timeline.stop()
        # a transfer stuck on a lost rank ends once that rank is killed (the launcher does so at once);
        # a transport torn down with a thread inside it aborts the whole process
        stuck = not stopped and not runtime.engine.wait_stopped(runtime.settings.heartbeat_timeout_s)
        if stuck:
            log.warning("roundel: a transfer with a lost rank is still running; its transport is left open")
            _stuck.append(runtime)
        # dropping the last reference closes the transport's sockets, which frees peers still
        # blocked in a transfer with this rank after a failure
        for registered in runtime.process_sets.clear():
            if registered.backend is not None and not stuck:
                factory.close(registered.backend)
        runtime.client.close()
        if runtime.server is not None:
            runtime.server.stop()


def _shutdown_at_exit() -> None:
    """shutdown() at interpreter exit; if a transfer is still stuck on a lost rank, end the process
    now (status 1, output flushed): finalizing with a thread inside the transport would abort it."""
    shutdown()
    if any(not rt.engine.wait_stopped(0) for rt in _stuck):
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(1)


def _transport(settings: Settings) -> factory.Choice:
    return factory.Choice(settings.cpu_operations, settings.collective_timeout_s,
                          settings.hierarchical_allreduce, settings.hierarchical_allgather, settings.autotune,
                          settings.gpu_operations, settings.shared_memory, settings.peer_links)


def runtime(what: str = "this operation") -> _Runtime:
    """The live runtime; raises NotInitializedError before ``init()``."""
    current = _runtime
    if current is None:
        raise NotInitializedError(what)
    return current


def runtime_if_initialized() -> _Runtime | None:
    """The live runtime, or None before ``init()`` and while an elastic job re-forms."""
    return _runtime


def is_initialized() -> bool:
    """Whether ``init()`` has run and ``shutdown()`` has not."""
    return _runtime is not None


def rank() -> int:
    """This process's rank in the job."""
    return runtime("rank()").identity.rank


def size() -> int:
    """Number of processes in the job."""
    return runtime("size()").identity.size


def local_rank() -> int:
    """This process's rank among those on its host."""
    return runtime("local_rank()").identity.local_rank


def local_size() -> int:
    """Number of processes on this host."""
    return runtime("local_size()").identity.local_size


def cross_rank() -> int:
    """Index of this host among the hosts that have a process with this local rank."""
    return runtime("cross_rank()").identity.cross_rank


def cross_size() -> int:
    """Number of hosts that have a process with this local rank."""
    return runtime("cross_size()").identity.cross_size


def is_homogeneous() -> bool:
    """True when every host runs the same number of processes."""
    ident = runtime("is_homogeneous()").identity
    return ident.size % ident.local_size == 0 and ident.cross_size * ident.local_size == ident.size


def gloo_built() -> bool:
    return importlib.util.find_spec("torch") is not None


def gloo_enabled() -> bool:
    """Whether this job moves tensor data over Gloo (the default ``HOROVOD_CPU_OPERATIONS``)."""
    return _runtime is not None and _runtime.settings.cpu_operations == "gloo"


def mpi_built() -> bool:
    """Whether roundel can move tensor data over MPI: True when mpi4py is installed
    (the job must then be started by mpirun with ``HOROVOD_CPU_OPERATIONS=mpi``)."""
    return importlib.util.find_spec("mpi4py") is not None


def mpi_enabled() -> bool:
    """Whether this job moves tensor data over MPI (``HOROVOD_CPU_OPERATIONS=mpi``)."""
    return _runtime is not None and _runtime.settings.cpu_operations == "mpi"


def mpi_threads_supported() -> bool:
    """Whether this job moves data over MPI and MPI was started with MPI_THREAD_MULTIPLE."""
    if not mpi_enabled():
        return False
    from mpi4py import MPI  # already started by init() when MPI is enabled
    return MPI.Query_thread() == MPI.THREAD_MULTIPLE


def nccl_built() -> bool:
    """Whether roundel can move CUDA tensors over NCCL (torch built with NCCL, and a GPU visible)."""
    return nccl.usable()


def cuda_built() -> bool:
    if importlib.util.find_spec("torch") is None:
        return False
    import torch
    return torch.backends.cuda.is_built()


def rocm_built() -> bool:
    return False


def ddl_built() -> bool:
    return False


def ccl_built() -> bool:
    return False


def _process_set_barrier(rt: _Runtime, label: str, ranks: tuple) -> None:
    """A global barrier that also checks every rank passed the same ``ranks``."""
    rt.barrier_count += 1
    request = Request(f"__process_set.{label}.{rt.barrier_count}", OpKind.BARRIER, 0, shape=tuple(ranks),
                      cacheable=False)
    rt.engine.submit(request, None, None).wait()


def add_process_set(process_set) -> ProcessSet:
    """Register a process set on every rank (a collective: all ranks must call it, in the same order).

    Accepts a ``ProcessSet`` or a list of ranks; returns the registered ``ProcessSet``.
    Raises ValueError for ranks outside the job or a set that is already registered.
    """
    rt = runtime("add_process_set()")
    if not isinstance(process_set, ProcessSet):
        process_set = ProcessSet(process_set)
    ranks = tuple(process_set.ranks)
    size_ = rt.identity.size
    if not ranks or any(r < 0 or r >= size_ for r in ranks):
        raise ValueError(f"process set ranks {list(ranks)} must be a non-empty list of ranks in 0..{size_ - 1}")
    if process_set.process_set_id is not None:
        raise ValueError(f"{process_set!r} is already registered")
    if rt.process_sets.id_of(ranks) is not None:
        raise ValueError(f"a process set with ranks {list(ranks)} is already registered")
    with _lock:
        set_id = rt.next_process_set_id
        rt.next_process_set_id += 1
        _process_set_barrier(rt, f"add{set_id}", ranks)
        rt.engine.control(ProcessSetChange(set_id, tuple(ranks)))
        backend = None
        me = rt.identity.rank
        if me in ranks:
            store = RendezvousStore(rt.client, f"{rt.prefix}ps{set_id}/",
                                    timedelta(seconds=rt.settings.start_timeout_s))
            backend = factory.process_set_backend(_transport(rt.settings), rt.process_sets.job_backend, store, ranks,
                                                  rt.advertise_host)
        rt.process_sets.add(set_id, ranks, backend)
        _process_set_barrier(rt, f"added{set_id}", ())
    process_set._bind(set_id, ranks, me)
    return process_set


def remove_process_set(process_set: ProcessSet) -> bool:
    """Unregister a process set on every rank (a collective). Returns False if it was not registered."""
    rt = runtime("remove_process_set()")
    set_id = process_set.process_set_id
    if set_id is None or set_id == 0 or set_id not in rt.process_sets:
        return False
    with _lock:
        _process_set_barrier(rt, f"remove{set_id}", rt.process_sets[set_id].ranks)
        rt.engine.control(ProcessSetChange(set_id))
        backend = rt.process_sets.remove(set_id).backend
        if backend is not None:
            factory.close(backend)
        _process_set_barrier(rt, f"removed{set_id}", ())
    process_set._bind(None, None, None)
    return True


def _open_timeline(timeline: Timeline, rank_: int, file_path: str, mark_cycles: bool,
                   resume: bool = False) -> None:
    """Rank 0 starts writing the timeline; other ranks have nothing to record."""
    if rank_ != 0:
        return
    try:
        timeline.start(file_path, mark_cycles, resume)
    except OSError as exc:
        raise ValueError(f"cannot write the timeline file {file_path!r}: {exc}; pass a path in a writable "
                         "directory (HOROVOD_TIMELINE, --timeline-filename or start_timeline())") from exc


def start_timeline(file_path: str, mark_cycles: bool = False) -> None:
    """Start writing a timeline of every collective to ``file_path`` (written by rank 0; other ranks'
    calls are accepted and do nothing). A timeline already being written is closed first.

    Unlike Horovod, ``HOROVOD_TIMELINE=DYNAMIC`` is not needed. Raises ``ValueError`` before
    ``init()`` or when the file cannot be created.
    """
    rt = runtime("start_timeline()")
    _open_timeline(rt.engine.timeline, rt.identity.rank, file_path, mark_cycles)


def stop_timeline() -> None:
    """Finish and close the timeline file being written, if any. Raises ``ValueError`` before ``init()``."""
    runtime("stop_timeline()").engine.timeline.stop()
