"""Small helpers under Horovod's names (``horovod.tensorflow.util``)."""

from __future__ import annotations

import tensorflow as tf


def _executing_eagerly() -> bool:
    """Whether TensorFlow runs eagerly here (False while building a ``tf.function`` or a ``tf.compat.v1`` graph)."""
    return tf.executing_eagerly()
