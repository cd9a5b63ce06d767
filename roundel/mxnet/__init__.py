"""roundel for MXNet: ``import roundel.mxnet as hvd`` in place of ``import horovod.mxnet as hvd``.

NDArrays travel through roundel's engine as host copies wrapped as CPU torch
tensors (see ``roundel.mxnet.mpi_ops``), so ``torch`` must be installed
alongside MXNet; ``roundel.torch`` is not imported.
"""

from roundel.common.basics import (
    ccl_built, cross_rank, cross_size, cuda_built, ddl_built, gloo_built, gloo_enabled,
    is_homogeneous, is_initialized, local_rank, local_size, mpi_built, mpi_enabled, mpi_threads_supported,
    nccl_built, rank, rocm_built, shutdown, size,
)
from roundel.common.basics import add_process_set, remove_process_set
from roundel.common.basics import start_timeline, stop_timeline
from roundel.errors import (
    CollectiveDeadlockError, CollectiveMismatchError, HorovodInternalError, NotInitializedError, RoundelError,
    RoundelInternalError,
)
from roundel.ops import Adasum, Average, Max, Min, Product, ReduceOp, Sum
from roundel.common.process_sets import ProcessSet, global_process_set
from roundel.mxnet.compression import Compression
from roundel.mxnet.functions import allgather_object, broadcast_object, broadcast_parameters
from roundel.mxnet.mpi_ops import (
    allgather, allreduce, allreduce_, alltoall, broadcast, broadcast_, grouped_allgather, grouped_allreduce,
    grouped_allreduce_, grouped_reducescatter, init, reducescatter,
)
from roundel.mxnet.optimizer import DistributedOptimizer, DistributedTrainer

__all__ = [
    "Adasum", "Average", "CollectiveDeadlockError", "CollectiveMismatchError", "Compression", "DistributedOptimizer",
    "DistributedTrainer", "HorovodInternalError", "Max", "Min", "NotInitializedError", "ProcessSet", "Product",
    "ReduceOp", "RoundelError", "RoundelInternalError", "Sum", "add_process_set", "allgather", "allgather_object",
    "allreduce", "allreduce_", "alltoall", "broadcast", "broadcast_", "broadcast_object", "broadcast_parameters",
    "ccl_built", "cross_rank", "cross_size", "cuda_built", "ddl_built", "global_process_set", "gloo_built",
    "gloo_enabled", "grouped_allgather", "grouped_allreduce", "grouped_allreduce_", "grouped_reducescatter", "init",
    "is_homogeneous", "is_initialized", "local_rank", "local_size", "mpi_built", "mpi_enabled",
    "mpi_threads_supported", "nccl_built", "rank", "reducescatter", "remove_process_set", "rocm_built", "shutdown",
    "size", "start_timeline", "stop_timeline"
]
