"""``horovod.tensorflow.util`` where roundel has no ``roundel.tensorflow.util`` (older roundel): ``_executing_eagerly``."""

import tensorflow as tf


def _executing_eagerly():
    return tf.executing_eagerly()
