"""examples/datasets.py: the IDX reader and the MNIST / Fashion-MNIST / digits loaders.

Every IDX file here is written by the test itself (a few bytes), gzipped or
not; nothing is downloaded.
"""

from __future__ import annotations

import gzip
import importlib.util
import struct
import sys
from pathlib import Path

import numpy as np
import pytest
import torch

EXAMPLES = Path(__file__).resolve().parents[1] / "examples"


def _load_example_module(name: str):
    """examples/NAME.py under a private module name (a plain ``import datasets`` could find another package)."""
    spec = importlib.util.spec_from_file_location(f"roundel_examples_{name}", EXAMPLES / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module
    spec.loader.exec_module(module)
    return module


datasets = _load_example_module("datasets")
IMAGES_MAGIC, LABELS_MAGIC, IdxFormatError = datasets.IMAGES_MAGIC, datasets.LABELS_MAGIC, datasets.IdxFormatError
load_dataset, load_idx_dataset, read_idx = datasets.load_dataset, datasets.load_idx_dataset, datasets.read_idx

IDX_TYPE = {np.dtype("uint8"): 0x08, np.dtype("int8"): 0x09, np.dtype(">i2"): 0x0B, np.dtype(">i4"): 0x0C,
            np.dtype(">f4"): 0x0D, np.dtype(">f8"): 0x0E}


def idx_bytes(array: np.ndarray) -> bytes:
    """``array`` encoded as an IDX file: 0, 0, type code, ndim, big-endian dimensions, big-endian data."""
    big = array.astype(array.dtype.newbyteorder(">")) if array.dtype.itemsize > 1 else array
    header = bytes([0, 0, IDX_TYPE[big.dtype], array.ndim]) + struct.pack(f">{array.ndim}I", *array.shape)
    return header + big.tobytes()


def write_idx(path: Path, array: np.ndarray, gz: bool = False) -> Path:
    data = idx_bytes(array)
    path.write_bytes(gzip.compress(data) if gz else data)
    return path


# ---------------------------------------------------------------- read_idx

@pytest.mark.parametrize("gz", [False, True], ids=["plain", "gzip"])
def test_read_idx_images_and_labels(tmp_path, gz):
    rng = np.random.default_rng(0)
    images = rng.integers(0, 256, size=(5, 28, 28), dtype=np.uint8)
    labels = np.array([3, 1, 4, 1, 5], dtype=np.uint8)
    suffix = ".gz" if gz else ""
    got_images = read_idx(write_idx(tmp_path / f"img{suffix}", images, gz), IMAGES_MAGIC)
    got_labels = read_idx(write_idx(tmp_path / f"lab{suffix}", labels, gz), LABELS_MAGIC)
    np.testing.assert_array_equal(got_images, images)
    np.testing.assert_array_equal(got_labels, labels)
    assert got_images.dtype == np.uint8 and got_images.shape == (5, 28, 28)


@pytest.mark.parametrize("dtype", ["int8", ">i2", ">i4", ">f4", ">f8"])
def test_read_idx_other_types_in_native_order(tmp_path, dtype):
    array = (np.arange(24).reshape(2, 3, 4) - 7).astype(dtype)
    got = read_idx(write_idx(tmp_path / "x", array))
    np.testing.assert_array_equal(got, array)
    assert got.dtype.isnative and got.shape == (2, 3, 4)


def test_read_idx_gzip_detected_by_content_not_name(tmp_path):
    labels = np.arange(10, dtype=np.uint8)
    path = tmp_path / "labels-no-gz-suffix"
    path.write_bytes(gzip.compress(idx_bytes(labels)))
    np.testing.assert_array_equal(read_idx(path), labels)


def test_read_idx_bad_magic(tmp_path):
    path = tmp_path / "bad"
    path.write_bytes(b"\x12\x34\x08\x01" + struct.pack(">I", 2) + b"\x00\x01")
    with pytest.raises(IdxFormatError, match=r"bad IDX magic number 0x12340801") as info:
        read_idx(path)
    assert str(path) in str(info.value)


def test_read_idx_unknown_type_code(tmp_path):
    path = tmp_path / "bad-type"
    path.write_bytes(b"\x00\x00\x07\x01" + struct.pack(">I", 1) + b"\x00")
    with pytest.raises(IdxFormatError, match="bad IDX magic number"):
        read_idx(path)


def test_read_idx_truncated_data(tmp_path):
    data = idx_bytes(np.zeros((4, 28, 28), dtype=np.uint8))
    path = tmp_path / "short"
    path.write_bytes(data[:-100])
    with pytest.raises(IdxFormatError, match=r"truncated.*4 x 28 x 28.*3136 bytes of data, the file holds 3036"):
        read_idx(path)


def test_read_idx_truncated_header(tmp_path):
    path = tmp_path / "header"
    path.write_bytes(b"\x00\x00\x08\x03" + struct.pack(">I", 4))  # 3 dimensions declared, only 1 present
    with pytest.raises(IdxFormatError, match="header declares 3 dimension"):
        read_idx(path)


def test_read_idx_too_short_for_magic(tmp_path):
    path = tmp_path / "tiny"
    path.write_bytes(b"\x00\x00")
    with pytest.raises(IdxFormatError, match="too short"):
        read_idx(path)


def test_read_idx_extra_bytes(tmp_path):
    path = tmp_path / "long"
    path.write_bytes(idx_bytes(np.arange(3, dtype=np.uint8)) + b"\x00")
    with pytest.raises(IdxFormatError, match="extra bytes"):
        read_idx(path)


def test_read_idx_truncated_gzip(tmp_path):
    path = tmp_path / "cut.gz"
    path.write_bytes(gzip.compress(idx_bytes(np.arange(1000, dtype=np.uint8)))[:-20])
    with pytest.raises(IdxFormatError, match="gzip data is damaged or cut short"):
        read_idx(path)


def test_read_idx_gz_name_but_not_gzip(tmp_path):
    path = write_idx(tmp_path / "labels.gz", np.arange(3, dtype=np.uint8))
    with pytest.raises(IdxFormatError, match="not gzip data"):
        read_idx(path)


def test_read_idx_html_page(tmp_path):
    path = tmp_path / "page"
    path.write_bytes(b"<!DOCTYPE html><html>Not Found</html>")
    with pytest.raises(IdxFormatError, match="HTML page"):
        read_idx(path)


def test_read_idx_swapped_images_and_labels(tmp_path):
    path = write_idx(tmp_path / "labels", np.arange(3, dtype=np.uint8))
    with pytest.raises(IdxFormatError, match="swapped"):
        read_idx(path, IMAGES_MAGIC)


def test_read_idx_missing_file(tmp_path):
    with pytest.raises(FileNotFoundError, match="no such IDX file"):
        read_idx(tmp_path / "nothing-here")


# ---------------------------------------------------------- load_idx_dataset

def write_set(directory: Path, n_train: int = 6, n_test: int = 4, gz: bool = True, seed: int = 0) -> dict:
    """The four MNIST-named IDX files in ``directory``; returns the arrays written."""
    directory.mkdir(parents=True, exist_ok=True)
    rng = np.random.default_rng(seed)
    arrays = {
        "train-images-idx3-ubyte": rng.integers(0, 256, size=(n_train, 28, 28), dtype=np.uint8),
        "train-labels-idx1-ubyte": rng.integers(0, 10, size=n_train, dtype=np.uint8),
        "t10k-images-idx3-ubyte": rng.integers(0, 256, size=(n_test, 28, 28), dtype=np.uint8),
        "t10k-labels-idx1-ubyte": rng.integers(0, 10, size=n_test, dtype=np.uint8),
    }
    for stem, array in arrays.items():
        write_idx(directory / (stem + (".gz" if gz else "")), array, gz)
    return arrays


@pytest.mark.parametrize("name", ["mnist", "fashion-mnist"])
@pytest.mark.parametrize("gz", [True, False], ids=["gzip", "plain"])
def test_load_idx_dataset_flat_dir(tmp_path, name, gz):
    arrays = write_set(tmp_path, gz=gz)
    train, test = load_idx_dataset(name, tmp_path)
    assert len(train) == 6 and len(test) == 4
    x, y = train.tensors
    assert x.shape == (6, 1, 28, 28) and x.dtype == torch.float32
    assert y.dtype == torch.int64
    np.testing.assert_array_equal(y.numpy(), arrays["train-labels-idx1-ubyte"])
    np.testing.assert_array_equal(test.tensors[1].numpy(), arrays["t10k-labels-idx1-ubyte"])
    mean, std = datasets.NORMALIZATION[name]
    expected = (torch.from_numpy(arrays["train-images-idx3-ubyte"]).float() / 255.0 - mean) / std
    torch.testing.assert_close(x[:, 0], expected)


@pytest.mark.parametrize("name, sub", [("mnist", "MNIST/raw"), ("fashion-mnist", "FashionMNIST/raw")])
def test_load_idx_dataset_torchvision_layout(tmp_path, name, sub):
    write_set(tmp_path / sub, n_train=3, n_test=2)
    train, test = load_idx_dataset(name, tmp_path)
    assert (len(train), len(test)) == (3, 2)


def test_load_idx_dataset_mixed_gzip_and_plain(tmp_path):
    arrays = write_set(tmp_path, gz=True)
    # Replace one file by its plain (unzipped) form: each file is found either way.
    (tmp_path / "t10k-labels-idx1-ubyte.gz").unlink()
    write_idx(tmp_path / "t10k-labels-idx1-ubyte", arrays["t10k-labels-idx1-ubyte"])
    _, test = load_idx_dataset("mnist", tmp_path)
    np.testing.assert_array_equal(test.tensors[1].numpy(), arrays["t10k-labels-idx1-ubyte"])


def test_load_idx_dataset_missing_files_named(tmp_path):
    write_set(tmp_path)
    (tmp_path / "t10k-images-idx3-ubyte.gz").unlink()
    with pytest.raises(FileNotFoundError, match=r"t10k-images-idx3-ubyte \(or \.gz\) not found") as info:
        load_idx_dataset("fashion-mnist", tmp_path)
    assert "Fashion-MNIST" in str(info.value) and "train-images" not in str(info.value).split("not found")[0]


def test_load_idx_dataset_needs_a_directory(tmp_path):
    with pytest.raises(FileNotFoundError, match="needs --data-dir"):
        load_idx_dataset("mnist", None)
    with pytest.raises(FileNotFoundError, match="is not a directory"):
        load_idx_dataset("mnist", tmp_path / "absent")


def test_load_idx_dataset_count_mismatch(tmp_path):
    write_set(tmp_path)
    write_idx(tmp_path / "train-labels-idx1-ubyte.gz", np.zeros(5, dtype=np.uint8), gz=True)
    with pytest.raises(IdxFormatError, match="holds 6 images but .* holds 5 labels"):
        load_idx_dataset("mnist", tmp_path)


def test_load_idx_dataset_wrong_image_size(tmp_path):
    write_set(tmp_path)
    write_idx(tmp_path / "train-images-idx3-ubyte.gz", np.zeros((6, 32, 32), dtype=np.uint8), gz=True)
    with pytest.raises(IdxFormatError, match="32x32 pixels"):
        load_idx_dataset("mnist", tmp_path)


def test_load_idx_dataset_label_out_of_range(tmp_path):
    write_set(tmp_path)
    write_idx(tmp_path / "train-labels-idx1-ubyte.gz", np.full(6, 12, dtype=np.uint8), gz=True)
    with pytest.raises(IdxFormatError, match="label 12 is out of range"):
        load_idx_dataset("mnist", tmp_path)


def test_load_dataset_unknown_name():
    with pytest.raises(ValueError, match="unknown dataset"):
        load_dataset("cifar10")
    with pytest.raises(ValueError, match="unknown IDX data set"):
        load_idx_dataset("digits", ".")


# ------------------------------------------------------------------- digits

def test_load_digits_mnist_shaped_and_stable():
    pytest.importorskip("sklearn")
    train, test = load_dataset("digits")
    assert (len(train), len(test)) == (1437, 360)
    x, y = train.tensors
    assert x.shape == (1437, 1, 28, 28) and x.dtype == torch.float32 and y.dtype == torch.int64
    assert set(y.tolist()) == set(range(10)) and set(test.tensors[1].tolist()) == set(range(10))
    # The 4-pixel border is background (0 before normalization), like MNIST's.
    mean, std = datasets.NORMALIZATION["mnist"]
    torch.testing.assert_close(x[:, :, :4, :], torch.full_like(x[:, :, :4, :], -mean / std))
    again, _ = load_dataset("digits")
    assert torch.equal(again.tensors[0], x)  # the same split on every call (every rank)
