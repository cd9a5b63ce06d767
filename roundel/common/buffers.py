"""Converting between NumPy arrays and the engine's buffers (CPU torch tensors), without copying.

Adapters whose framework hands out NumPy views (TensorFlow, Keras, JAX) go
through these; bfloat16 arrays (``ml_dtypes.bfloat16``, which NumPy itself
lacks) travel as a bfloat16 view of their 16-bit words.
"""

from __future__ import annotations

import numpy as np
import torch

__all__ = ["from_numpy", "to_numpy", "use_one_packing_thread"]


def from_numpy(array) -> torch.Tensor:
    """A CPU buffer sharing memory with ``array`` (copied first only when not C-contiguous or read-only)."""
    array = np.asarray(array)
    if not array.flags.c_contiguous or not array.flags.writeable:
        array = np.array(array, order="C")
    if array.dtype.name == "bfloat16":
        return torch.from_numpy(array.view(np.int16)).view(torch.bfloat16)
    return torch.from_numpy(array)


def to_numpy(buffer: torch.Tensor, bfloat16=None) -> np.ndarray:
    """The NumPy view of a CPU buffer.

    A bfloat16 buffer becomes a view with the NumPy dtype ``bfloat16`` (such as
    ``ml_dtypes.bfloat16``), or a float32 copy when that is None.
    """
    buffer = buffer.detach()
    if buffer.dtype == torch.bfloat16:
        if bfloat16 is None:
            return buffer.float().numpy()
        return buffer.contiguous().view(torch.int16).numpy().view(bfloat16)
    return buffer.numpy()


def use_one_packing_thread() -> None:
    """Give torch one intra-op thread: for processes whose own framework is not torch.

    There torch only packs and unpacks the engine's buffers, and its OpenMP
    workers would otherwise spin on the cores the framework computes on
    (measured on 2 cores: a small TensorFlow CNN's step took about 40% longer).
    It must run before the engine first uses torch; ``roundel.tensorflow.init``
    and, on Keras' TensorFlow backend, ``roundel.keras.init`` call it.
    """
    torch.set_num_threads(1)
