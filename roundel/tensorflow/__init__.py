"""roundel for TensorFlow 2: ``import roundel.tensorflow as hvd`` in place of ``import horovod.tensorflow as hvd``.

Tensors travel through roundel's engine as NumPy views of CPU torch tensors,
so ``torch`` must be installed alongside TensorFlow; ``roundel.torch`` is not
imported.
"""

try:
    import tensorflow as _tensorflow  # noqa: F401 - first, so that a missing TensorFlow says what to install
except ImportError as _exc:
    raise ImportError(
        f"roundel.tensorflow needs TensorFlow 2.21 or later, which cannot be imported here ({_exc}): "
        "pip install \"roundel[tensorflow]\" (or \"roundel[tensorflow-cpu]\" for the CPU-only build)",
        name="tensorflow") from _exc
del _tensorflow

from roundel.common.basics import (
    ccl_built, cross_rank, cross_size, cuda_built, ddl_built, gloo_built, gloo_enabled,
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
from roundel.tfops.compression import Compression
from roundel.tensorflow.functions import (
    allgather_object, broadcast_global_variables, broadcast_object, broadcast_object_fn, broadcast_variables,
)
from roundel.tensorflow import compression, elastic, mpi_ops, util  # mpi_ops, compression: Horovod's names
from roundel.tensorflow.util import _executing_eagerly
from roundel.tensorflow.gradient_tape import DistributedGradientTape, PartialDistributedGradientTape
from roundel.tfops.mpi_ops import (
    _allreduce, allgather, allreduce, alltoall, barrier, broadcast, broadcast_, grouped_allgather,
    grouped_allreduce, grouped_reducescatter, init, join, local_rank_op, local_size_op, process_set_included_op,
    rank_op, reducescatter, size_op,
)
from roundel.tensorflow.optimizer import DistributedOptimizer
from roundel.tensorflow.sync_batch_norm import SyncBatchNormalization

__all__ = [
    "Adasum", "Average", "CollectiveDeadlockError", "CollectiveMismatchError", "Compression",
    "DistributedGradientTape", "DistributedOptimizer", "HorovodInternalError", "HostsUpdatedInterrupt", "Max", "Min",
    "NotInitializedError", "PartialDistributedGradientTape", "ProcessSet", "Product", "ReduceOp", "RoundelError",
    "RoundelInternalError", "Sum", "SyncBatchNormalization", "add_process_set", "allgather", "allgather_object",
    "allreduce", "alltoall", "barrier", "broadcast", "broadcast_", "broadcast_global_variables", "broadcast_object",
    "broadcast_object_fn", "broadcast_variables", "ccl_built", "cross_rank", "cross_size", "cuda_built", "ddl_built",
    "elastic", "global_process_set", "gloo_built", "gloo_enabled", "grouped_allgather", "grouped_allreduce",
    "grouped_reducescatter", "init", "is_homogeneous", "is_initialized", "join", "local_rank", "local_rank_op",
    "local_size", "local_size_op", "mpi_built", "mpi_enabled", "mpi_threads_supported", "nccl_built",
    "process_set_included_op", "rank", "rank_op", "reducescatter", "remove_process_set", "rocm_built", "shutdown",
    "size", "size_op", "start_timeline", "stop_timeline", "util"
]
# Private names where Horovod has them (hvd._allreduce: tests/workers/tf_fidelity.py), listed as re-exported
__all__ += ["_allreduce", "_executing_eagerly"]
# Horovod's module names, the roundel.tfops modules themselves (hvd.mpi_ops._allreduce in Horovod-era code)
__all__ += ["compression", "mpi_ops"]
