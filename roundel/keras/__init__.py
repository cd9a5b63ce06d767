"""roundel for Keras 3: ``import roundel.keras as hvd`` in place of ``import horovod.keras as hvd``.

Works with Keras 3's TensorFlow backend and its PyTorch backend
(``DistributedOptimizer``, the callbacks and ``load_model`` on both).
``roundel.tensorflow.keras`` is the same module. ``optimizers.NovoGrad`` is
the walkthrough's NovoGrad (Keras 3 has LAMB but no NovoGrad).

Not supported: XLA-compiled train steps (``model.compile(jit_compile=True)``)
with ``DistributedOptimizer``; the collectives run as Python ops, which XLA
cannot compile. Keras's default ``jit_compile="auto"`` is off on CPU-only
machines; elsewhere pass ``jit_compile=False`` (a clear error says so).
"""

from __future__ import annotations

try:
    import keras
except ImportError as _exc:
    raise ImportError(
        f"roundel.keras needs Keras 3, which cannot be imported here ({_exc}): pip install \"roundel[tensorflow]\" "
        "(TensorFlow with its Keras 3; \"roundel[tensorflow-cpu]\" for the CPU-only build), or for Keras on "
        "PyTorch pip install keras and set KERAS_BACKEND=torch", name="keras") from _exc

from roundel.common.basics import (
    cross_rank, cross_size, cuda_built, gloo_built, gloo_enabled, is_homogeneous, is_initialized,
    local_rank, local_size, mpi_built, mpi_enabled, mpi_threads_supported, nccl_built, rank, rocm_built,
    shutdown, size,
)
from roundel.common.basics import add_process_set, remove_process_set
from roundel.common.basics import start_timeline, stop_timeline
from roundel.errors import (
    CollectiveMismatchError, HorovodInternalError, HostsUpdatedInterrupt, NotInitializedError, RoundelError,
    RoundelInternalError,
)
from roundel.ops import Adasum, Average, Max, Min, Product, ReduceOp, Sum
from roundel.common.process_sets import ProcessSet, global_process_set
from roundel.keras import callbacks, elastic, optimizers
from roundel.keras.core import (
    Compression, DistributedOptimizer, PartialDistributedOptimizer, allgather, allgather_object, allreduce,
    broadcast, broadcast_global_variables, broadcast_object, broadcast_variables, init, load_model, reducescatter,
)

__all__ = [
    "Adasum", "Average", "CollectiveMismatchError", "Compression", "DistributedOptimizer", "HorovodInternalError",
    "HostsUpdatedInterrupt", "Max", "Min", "NotInitializedError", "PartialDistributedOptimizer", "ProcessSet",
    "Product", "ReduceOp",
    "RoundelError", "RoundelInternalError", "Sum", "add_process_set", "allgather", "allgather_object",
    "allreduce", "broadcast", "broadcast_global_variables", "broadcast_object", "broadcast_variables",
    "callbacks", "cross_rank", "cross_size", "cuda_built", "elastic", "gloo_built", "gloo_enabled",
    "global_process_set", "init", "is_homogeneous", "is_initialized", "keras", "load_model", "local_rank",
    "local_size", "mpi_built", "mpi_enabled", "mpi_threads_supported", "nccl_built", "optimizers", "rank",
    "reducescatter", "remove_process_set", "rocm_built", "shutdown", "size", "start_timeline", "stop_timeline",
]
