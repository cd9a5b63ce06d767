"""Data for the roundel PyTorch examples, with no download step and no torchvision.

- ``load_digits()``: scikit-learn's bundled handwritten digits (1,797 8x8
  images, shipped inside the scikit-learn package), scaled and centred into
  28x28 like MNIST so the MNIST network trains on it unchanged. Works offline.
- ``load_idx_dataset("mnist" | "fashion-mnist", data_dir)``: the real MNIST or
  Fashion-MNIST files in their IDX format (``train-images-idx3-ubyte``,
  ``train-labels-idx1-ubyte``, ``t10k-images-idx3-ubyte``,
  ``t10k-labels-idx1-ubyte``, each gzipped or not), read and validated here.
- ``read_idx(path)``: the IDX reader itself, returning a NumPy array.

Every loader returns ``(train, test)`` as ``torch.utils.data.TensorDataset``
of float32 images ``N x 1 x 28 x 28`` (normalized by the data set's mean and
standard deviation) and int64 labels ``N``.

A file that is missing, truncated, not IDX, or of the wrong shape raises
``IdxFormatError`` / ``FileNotFoundError`` naming the file, what is wrong with
it, and where to get good copies.
"""

from __future__ import annotations

import gzip
import os
import struct
import zlib
from pathlib import Path

import numpy as np
import torch
from torch.utils.data import TensorDataset

DATASETS = ("digits", "mnist", "fashion-mnist")

# IDX type codes (third byte of the magic number) -> big-endian NumPy dtype.
IDX_DTYPES = {0x08: ">u1", 0x09: ">i1", 0x0B: ">i2", 0x0C: ">i4", 0x0D: ">f4", 0x0E: ">f8"}
IMAGES_MAGIC = 0x00000803  # unsigned bytes, 3 dimensions (count, rows, columns)
LABELS_MAGIC = 0x00000801  # unsigned bytes, 1 dimension (count)

# Per-pixel mean and standard deviation of the training images, on a 0..1 scale.
NORMALIZATION = {"mnist": (0.1307, 0.3081), "fashion-mnist": (0.2860, 0.3530)}

_IDX_SETS = {
    "mnist": {
        "title": "MNIST",
        "subdirs": ("MNIST/raw", "mnist"),
        "where": "https://ossci-datasets.s3.amazonaws.com/mnist/ (PyTorch's mirror of "
                 "http://yann.lecun.com/exdb/mnist/)",
    },
    "fashion-mnist": {
        "title": "Fashion-MNIST",
        "subdirs": ("FashionMNIST/raw", "fashion-mnist", "fashion_mnist"),
        "where": "http://fashion-mnist.s3-website.eu-central-1.amazonaws.com/ (see "
                 "https://github.com/zalando-research/fashionmnist)",
    },
}
_SPLITS = {"train": ("train-images-idx3-ubyte", "train-labels-idx1-ubyte"),
           "test": ("t10k-images-idx3-ubyte", "t10k-labels-idx1-ubyte")}
FILE_STEMS = tuple(stem for pair in _SPLITS.values() for stem in pair)


class IdxFormatError(ValueError):
    """An IDX file that cannot be read or does not hold what it should; the message names the file."""


# ------------------------------------------------------------------ IDX reader

def _read_bytes(path: Path) -> bytes:
    """The file's content, gunzipped if it is gzip data (whatever its name says)."""
    raw = path.read_bytes()
    if raw[:2] != b"\x1f\x8b":
        if path.suffix == ".gz":
            raise IdxFormatError(f"{path}: the name ends in .gz but the file is not gzip data")
        return raw
    try:
        return gzip.decompress(raw)
    except (EOFError, gzip.BadGzipFile, zlib.error, OSError) as exc:
        raise IdxFormatError(f"{path}: the gzip data is damaged or cut short ({exc}); "
                             "download the file again") from None


def read_idx(path, expected_magic: int | None = None) -> np.ndarray:
    """Read one IDX file (gzipped or not) and return its array, in native byte order.

    ``expected_magic`` (for example ``IMAGES_MAGIC``) also checks the element
    type and number of dimensions. Raises FileNotFoundError if the file does
    not exist and ``IdxFormatError`` if it is not a complete, well-formed IDX
    file (or not the expected kind).
    """
    path = Path(path)
    if not path.is_file():
        raise FileNotFoundError(f"{path}: no such IDX file")
    data = _read_bytes(path)
    if len(data) < 4:
        raise IdxFormatError(f"{path}: {len(data)} byte(s) long, too short for the 4-byte IDX magic number")
    if data.lstrip()[:1] == b"<":
        raise IdxFormatError(f"{path}: holds an HTML page, not IDX data (a failed download?)")
    zero, type_code, ndim = data[0:2], data[2], data[3]
    magic = int.from_bytes(data[:4], "big")
    if zero != b"\x00\x00" or type_code not in IDX_DTYPES:
        raise IdxFormatError(f"{path}: bad IDX magic number 0x{magic:08x}; an IDX file starts with two zero "
                             f"bytes, a type code (one of {', '.join(f'0x{c:02x}' for c in IDX_DTYPES)}) and "
                             "the number of dimensions")
    if expected_magic is not None and magic != expected_magic:
        kind = {IMAGES_MAGIC: "an image file (3 dimensions of unsigned bytes)",
                LABELS_MAGIC: "a label file (1 dimension of unsigned bytes)"}.get(expected_magic, "")
        swapped = "; are the image and label files swapped?" if {magic, expected_magic} == {
            IMAGES_MAGIC, LABELS_MAGIC} else ""
        raise IdxFormatError(f"{path}: magic number is 0x{magic:08x} ({ndim} dimension(s) of type code "
                             f"0x{type_code:02x}), expected 0x{expected_magic:08x} {kind}".rstrip() + swapped)
    header_size = 4 + 4 * ndim
    if len(data) < header_size:
        raise IdxFormatError(f"{path}: the header declares {ndim} dimension(s), which needs {header_size} "
                             f"bytes, but the file is only {len(data)} bytes long")
    shape = struct.unpack(f">{ndim}I", data[4:header_size])
    dtype = np.dtype(IDX_DTYPES[type_code])
    expected = int(np.prod(shape, dtype=np.int64)) * dtype.itemsize
    found = len(data) - header_size
    if found != expected:
        dims = " x ".join(map(str, shape))
        problem = "truncated" if found < expected else "has extra bytes at the end"
        raise IdxFormatError(f"{path}: {problem}: the header declares {dims} values of {dtype.itemsize} byte(s) "
                             f"= {expected} bytes of data, the file holds {found}")
    array = np.frombuffer(data, dtype=dtype, offset=header_size).reshape(shape)
    return array.astype(dtype.newbyteorder("="), copy=False)


def _find_file(directories: list[Path], stem: str) -> Path | None:
    for directory in directories:
        for name in (stem, stem + ".gz"):
            candidate = directory / name
            if candidate.is_file():
                return candidate
    return None


def _normalize(images_0_1: torch.Tensor, name: str) -> torch.Tensor:
    mean, std = NORMALIZATION[name]
    return (images_0_1 - mean) / std


def load_idx_dataset(name: str, data_dir) -> tuple[TensorDataset, TensorDataset]:
    """Load MNIST or Fashion-MNIST (``name``) from the four IDX files in ``data_dir``.

    Files are looked for in ``data_dir`` itself and in torchvision's layout
    under it (``MNIST/raw``, ``FashionMNIST/raw``). Returns ``(train, test)``.
    Raises FileNotFoundError naming any missing file and where to get it,
    ``IdxFormatError`` for a malformed file, ValueError for an unknown name.
    """
    if name not in _IDX_SETS:
        raise ValueError(f"unknown IDX data set {name!r}; choose one of {', '.join(_IDX_SETS)}")
    info = _IDX_SETS[name]
    title = info["title"]
    how = (f"download the four {title} files ({', '.join(s + '.gz' for s in FILE_STEMS)}) from "
           f"{info['where']} into --data-dir")
    if data_dir is None:
        raise FileNotFoundError(f"--dataset {name} reads local files and needs --data-dir: {how}")
    root = Path(os.path.expanduser(str(data_dir)))
    if not root.is_dir():
        raise FileNotFoundError(f"--data-dir {root} is not a directory; {how} ({root})")
    directories = [root] + [root / sub for sub in info["subdirs"]]
    found = {stem: _find_file(directories, stem) for stem in FILE_STEMS}
    missing = [stem for stem, path in found.items() if path is None]
    if missing:
        raise FileNotFoundError(f"{title}: {', '.join(missing)} (or .gz) not found in {root}; {how} ({root})")

    result = []
    for split, (images_stem, labels_stem) in _SPLITS.items():
        images = read_idx(found[images_stem], IMAGES_MAGIC)
        labels = read_idx(found[labels_stem], LABELS_MAGIC)
        if images.shape[1:] != (28, 28):
            raise IdxFormatError(f"{found[images_stem]}: images are {images.shape[1]}x{images.shape[2]} pixels; "
                                 f"{title} images are 28x28")
        if images.shape[0] != labels.shape[0]:
            raise IdxFormatError(f"{title} {split} split: {found[images_stem]} holds {images.shape[0]} images but "
                                 f"{found[labels_stem]} holds {labels.shape[0]} labels; the files are from "
                                 "different downloads or cut short")
        if labels.size and labels.max() > 9:
            raise IdxFormatError(f"{found[labels_stem]}: label {int(labels.max())} is out of range; {title} "
                                 "labels are 0..9")
        x = torch.from_numpy(images.astype(np.float32) / 255.0).unsqueeze(1)
        y = torch.from_numpy(labels.astype(np.int64))
        result.append(TensorDataset(_normalize(x, name), y))
    return result[0], result[1]


# ------------------------------------------------------------- scikit-learn digits

def digits_to_mnist_format(images_0_16: np.ndarray) -> torch.Tensor:
    """8x8 digit images (values 0..16) as ``N x 1 x 28 x 28`` float32 in MNIST's layout and scale.

    MNIST digits fill a 20x20 box centred in 28x28, so each image is resized
    to 20x20 (bilinear) and padded by 4 pixels, then normalized with MNIST's
    mean and standard deviation.
    """
    x = torch.as_tensor(np.asarray(images_0_16, dtype=np.float32) / 16.0).reshape(-1, 1, 8, 8)
    x = torch.nn.functional.interpolate(x, size=(20, 20), mode="bilinear", align_corners=False).clamp_(0.0, 1.0)
    x = torch.nn.functional.pad(x, (4, 4, 4, 4))
    return _normalize(x, "mnist")


def load_digits(test_fraction: float = 0.2, seed: int = 0) -> tuple[TensorDataset, TensorDataset]:
    """scikit-learn's digits as MNIST-shaped ``(train, test)``: a stratified split, the same on every call.

    With the defaults: 1,437 training and 360 test images. Raises ImportError
    with the install command when scikit-learn is missing.
    """
    if not 0.0 < test_fraction < 1.0:
        raise ValueError(f"test_fraction={test_fraction} must be between 0 and 1")
    try:
        from sklearn.datasets import load_digits as sklearn_digits
        from sklearn.model_selection import train_test_split
    except ImportError:
        raise ImportError("--dataset digits needs scikit-learn: pip install 'scikit-learn>=1.3' "
                          "(or pip install 'roundel[examples]')") from None
    bunch = sklearn_digits()
    train_idx, test_idx = train_test_split(np.arange(len(bunch.target)), test_size=test_fraction,
                                           random_state=seed, stratify=bunch.target)
    x = digits_to_mnist_format(bunch.images)
    y = torch.as_tensor(bunch.target, dtype=torch.int64)
    train_idx, test_idx = torch.as_tensor(train_idx), torch.as_tensor(test_idx)
    return TensorDataset(x[train_idx], y[train_idx]), TensorDataset(x[test_idx], y[test_idx])


def load_dataset(name: str, data_dir=None) -> tuple[TensorDataset, TensorDataset]:
    """``(train, test)`` for ``name`` in ``DATASETS``; see ``load_digits`` and ``load_idx_dataset``."""
    if name == "digits":
        return load_digits()
    if name in _IDX_SETS:
        return load_idx_dataset(name, data_dir)
    raise ValueError(f"unknown dataset {name!r}; choose one of {', '.join(DATASETS)}")
