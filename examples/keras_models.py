"""Keras 3 models for the Keras synthetic benchmark and ``benchmarks/keras_training.py`` (any Keras backend).

- ``resnet50``: ``keras.applications.ResNet50(weights=None)``, randomly
  initialized, so nothing is downloaded (25,636,712 parameters at 1000
  classes and 224x224; square inputs of 32 pixels or more).
- ``small_cnn``: the Keras twin of ``models.py``'s ``SmallCNN``: three 3x3
  convolutions with batch norm, global average pooling, 256 -> classes (for
  CPU runs at 32x32; 4 pixels or more).

``build_model(name, image_size, num_classes)`` returns one by the name the
scripts take on the command line (``MODEL_NAMES``, or ``smallcnn``); images
are channels last. The models return logits.
"""

from __future__ import annotations

import keras

MODEL_NAMES = ("resnet50", "small_cnn")
DEFAULT_IMAGE_SIZE = {"resnet50": 224, "small_cnn": 32}
MIN_IMAGE_SIZE = {"resnet50": 32, "small_cnn": 4}


def canonical_name(name: str) -> str:
    """The ``MODEL_NAMES`` entry for ``name`` (``smallcnn`` and ``small-cnn`` too); ValueError for others."""
    key = name.strip().lower().replace("-", "_")
    key = {"smallcnn": "small_cnn"}.get(key, key)
    if key not in MODEL_NAMES:
        raise ValueError(f"unknown model {name!r}; choose one of {', '.join(MODEL_NAMES)}")
    return key


def small_cnn(image_size: int, num_classes: int) -> keras.Model:
    """Three conv-BN-ReLU blocks (32, 64, 128 channels; max-pooled twice), then 256 -> ``num_classes`` logits."""
    layers = keras.layers
    blocks = []
    for channels, pool in ((32, True), (64, True), (128, False)):
        blocks += [layers.Conv2D(channels, 3, padding="same"), layers.BatchNormalization(), layers.ReLU()]
        if pool:
            blocks.append(layers.MaxPooling2D(2))
    return keras.Sequential([keras.Input((image_size, image_size, 3)), *blocks, layers.GlobalAveragePooling2D(),
                             layers.Dense(256, activation="relu"), layers.Dense(num_classes)], name="small_cnn")


def build_model(name: str, image_size: int | None = None, num_classes: int = 1000) -> keras.Model:
    """A freshly initialized model ``name`` for square RGB images of ``image_size`` (default: the model's own).

    Raises ValueError for an unknown name or too small an image size.
    """
    name = canonical_name(name)
    image_size = image_size or DEFAULT_IMAGE_SIZE[name]
    if image_size < MIN_IMAGE_SIZE[name]:
        raise ValueError(f"{name} needs images of at least {MIN_IMAGE_SIZE[name]} pixels square, not {image_size}")
    if name == "resnet50":
        return keras.applications.ResNet50(weights=None, input_shape=(image_size, image_size, 3),
                                           classes=num_classes, classifier_activation=None)
    return small_cnn(image_size, num_classes)
