"""roundel for JAX: ``import roundel.jax as hvd``; collectives on ``jax.Array``s and pytrees, eager or jitted.

Arrays travel through roundel's engine (shared with CPU torch tensors through
DLPack), so ``torch`` must be installed alongside JAX; ``roundel.torch`` is
not imported. Horovod 0.28.1 has no JAX adapter: the API is roundel.torch's,
on pytrees, plus an optax ``DistributedOptimizer``.
"""

from roundel.common.basics import (
    ccl_built, cross_rank, cross_size, cuda_built, ddl_built, gloo_built, gloo_enabled, is_homogeneous,
    is_initialized, local_rank, local_size, mpi_built, mpi_enabled, mpi_threads_supported, nccl_built, rank,
    rocm_built, shutdown, size,
)
from roundel.common.basics import add_process_set, remove_process_set
from roundel.common.basics import start_timeline, stop_timeline
from roundel.common.process_sets import ProcessSet, global_process_set
from roundel.errors import (
    CollectiveDeadlockError, CollectiveMismatchError, HorovodInternalError, HostsUpdatedInterrupt, NotInitializedError,
    RoundelError, RoundelInternalError,
)
from roundel.jax import elastic
from roundel.jax.compression import Compression
from roundel.jax.functions import (
    allgather_object, broadcast_object, broadcast_optimizer_state, broadcast_parameters,
)
from roundel.jax.mpi_ops import (
    allgather, allgather_async, allreduce, allreduce_async, alltoall, alltoall_async, barrier, broadcast,
    broadcast_async, grouped_allgather, grouped_allgather_async, grouped_allreduce, grouped_allreduce_async,
    grouped_reducescatter, grouped_reducescatter_async, init, join, poll, reducescatter, reducescatter_async, synchronize,
)
from roundel.jax.optimizer import DistributedOptimizer
from roundel.ops import Adasum, Average, Max, Min, Product, ReduceOp, Sum

__all__ = [
    "Adasum", "Average", "CollectiveDeadlockError", "CollectiveMismatchError", "Compression", "DistributedOptimizer",
    "HorovodInternalError", "HostsUpdatedInterrupt", "Max", "Min", "NotInitializedError", "ProcessSet", "Product",
    "ReduceOp", "RoundelError", "RoundelInternalError", "Sum", "add_process_set", "allgather", "allgather_async",
    "allgather_object", "allreduce", "allreduce_async", "alltoall", "alltoall_async", "barrier", "broadcast",
    "broadcast_async", "broadcast_object", "broadcast_optimizer_state", "broadcast_parameters", "ccl_built",
    "cross_rank", "cross_size", "cuda_built", "ddl_built", "elastic", "global_process_set", "gloo_built",
    "gloo_enabled", "grouped_allgather", "grouped_allgather_async", "grouped_allreduce", "grouped_allreduce_async",
    "grouped_reducescatter", "grouped_reducescatter_async", "init", "is_homogeneous", "is_initialized", "join",
    "local_rank", "local_size", "mpi_built", "mpi_enabled", "mpi_threads_supported", "nccl_built", "poll", "rank",
    "reducescatter", "reducescatter_async", "remove_process_set", "rocm_built", "shutdown", "size", "start_timeline",
    "stop_timeline", "synchronize"
]
