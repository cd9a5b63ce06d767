"""TensorFlow tensors' collectives, beneath both ``roundel.tensorflow`` and ``roundel.keras``.

``mpi_ops`` turns the engine's collectives into TensorFlow ops (eagerly and
inside ``tf.function``), ``tf_errors`` gives their failures Horovod's
TensorFlow error types, ``compression`` casts tensors for the wire, and
``gradients`` reduces a list of gradients as a ``GradientOptions`` says.
``roundel.tensorflow`` (TensorFlow's API, and Horovod's names for the Keras
adapter) and ``roundel.keras`` (on Keras's TensorFlow backend) build on them;
this package imports neither. Users import ``roundel.tensorflow``, where
``mpi_ops`` and ``compression`` keep Horovod's names.
"""

__all__: list[str] = []
