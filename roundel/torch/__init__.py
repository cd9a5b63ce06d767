"""roundel for PyTorch: ``import roundel.torch as hvd`` in place of ``import horovod.torch as hvd``."""

from roundel.common.basics import (
    ccl_built, cross_rank, cross_size, cuda_built, ddl_built, gloo_built, gloo_enabled, init,
    is_homogeneous, is_initialized, local_rank, local_size, mpi_built, mpi_enabled, mpi_threads_supported,
    nccl_built, rank, rocm_built, shutdown, size,
)
from roundel.common.basics import add_process_set, remove_process_set
from roundel.common.basics import start_timeline, stop_timeline
from roundel.errors import (
    CollectiveDeadlockError, CollectiveMismatchError, HorovodInternalError, HostsUpdatedInterrupt, NotInitializedError,
    RoundelError, RoundelInternalError,
)
from roundel.ops import Adasum, Average, Max, Min, Product, ReduceOp, Sum
from roundel.common.process_sets import ProcessSet, global_process_set
from roundel.torch import elastic
from roundel.torch.compression import Compression
from roundel.torch.functions import (
    allgather_object, broadcast_object, broadcast_optimizer_state, broadcast_parameters,
)
from roundel.torch.mpi_ops import (
    allgather, allgather_async, allreduce, allreduce_, allreduce_async, allreduce_async_, alltoall,
    alltoall_async, barrier, broadcast, broadcast_, broadcast_async, broadcast_async_, grouped_allgather,
    grouped_allgather_async, grouped_allreduce, grouped_allreduce_, grouped_allreduce_async,
    grouped_allreduce_async_, grouped_reducescatter, grouped_reducescatter_async, join, poll, reducescatter,
    reducescatter_async, sparse_allreduce_async, synchronize,
)
from roundel.torch.optimizer import DistributedOptimizer
from roundel.torch.powersgd import PowerSGD
from roundel.torch.sync_batch_norm import SyncBatchNorm

__all__ = [
    "Adasum", "Average", "CollectiveDeadlockError", "CollectiveMismatchError", "Compression", "DistributedOptimizer",
    "HorovodInternalError", "HostsUpdatedInterrupt", "Max", "Min", "NotInitializedError", "PowerSGD", "ProcessSet",
    "Product", "ReduceOp", "RoundelError", "RoundelInternalError", "Sum", "SyncBatchNorm", "add_process_set",
    "allgather", "allgather_async", "allgather_object", "allreduce", "allreduce_", "allreduce_async",
    "allreduce_async_", "alltoall", "alltoall_async", "barrier", "broadcast", "broadcast_", "broadcast_async",
    "broadcast_async_", "broadcast_object", "broadcast_optimizer_state", "broadcast_parameters", "ccl_built",
    "cross_rank", "cross_size", "cuda_built", "ddl_built", "elastic", "global_process_set", "gloo_built",
    "gloo_enabled", "grouped_allgather", "grouped_allgather_async", "grouped_allreduce", "grouped_allreduce_",
    "grouped_allreduce_async", "grouped_allreduce_async_", "grouped_reducescatter", "grouped_reducescatter_async",
    "init", "is_homogeneous", "is_initialized", "join", "local_rank", "local_size", "mpi_built", "mpi_enabled",
    "mpi_threads_supported", "nccl_built", "poll", "rank", "reducescatter", "reducescatter_async",
    "remove_process_set", "rocm_built", "shutdown", "size", "sparse_allreduce_async", "start_timeline",
    "stop_timeline", "synchronize"
]
