"""NumPy arrays for the Keras/TensorFlow examples, from the loaders in ``datasets.py``.

``load_numpy(name, data_dir)`` returns ``(x_train, y_train), (x_test, y_test)``:
float32 images ``N x 28 x 28 x 1`` (channels last, normalized as in
``datasets.py``) and int64 labels ``N``.
"""

from __future__ import annotations

import numpy as np

from datasets import DATASETS, load_dataset  # noqa: F401  (re-exported for the examples' --dataset choices)


def load_numpy(name: str, data_dir=None):
    """The data set ``name`` ("digits", "mnist", "fashion-mnist") as NumPy arrays, channels last."""
    train, test = load_dataset(name, data_dir)

    def convert(ds):
        images, labels = ds.tensors
        return np.ascontiguousarray(images.numpy().transpose(0, 2, 3, 1)), labels.numpy().astype(np.int64)

    return convert(train), convert(test)
