"""examples/models.py: parameter counts that match the published / torchvision models, and output shapes.

The expected counts are torchvision's (``torchvision.models.resnet50()`` has
25,557,032 parameters, ``resnet18()`` 11,689,512, ``alexnet()`` 61,100,840),
and each is also derived layer by layer below, so the test does not depend on
torchvision (there is no torchvision for this CPU build). Forward passes use
small batches so the file runs in a few seconds.
"""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path

import pytest
import torch

EXAMPLES = Path(__file__).resolve().parents[1] / "examples"
_spec = importlib.util.spec_from_file_location("roundel_examples_models", EXAMPLES / "models.py")
models = importlib.util.module_from_spec(_spec)
sys.modules[_spec.name] = models
_spec.loader.exec_module(models)


def conv(cin, cout, k, bias=False):
    return cin * cout * k * k + (cout if bias else 0)


def bn(c):
    return 2 * c  # weight and bias (running statistics are buffers)


def linear(i, o):
    return i * o + o


def resnet_params(block: str, layers: list[int], classes: int = 1000) -> int:
    """ResNet parameter count from the architecture (He et al. 2016; torchvision's layout)."""
    total = conv(3, 64, 7) + bn(64)
    inplanes = 64
    expansion = 4 if block == "bottleneck" else 1
    for stage, (planes, blocks) in enumerate(zip((64, 128, 256, 512), layers)):
        for b in range(blocks):
            stride = 2 if stage > 0 and b == 0 else 1
            out = planes * expansion
            if block == "bottleneck":
                total += conv(inplanes, planes, 1) + bn(planes) + conv(planes, planes, 3) + bn(planes) \
                    + conv(planes, out, 1) + bn(out)
            else:
                total += conv(inplanes, planes, 3) + bn(planes) + conv(planes, planes, 3) + bn(planes)
            if stride != 1 or inplanes != out:
                total += conv(inplanes, out, 1) + bn(out)
            inplanes = out
    return total + linear(512 * expansion, classes)


ALEXNET_OWT = (conv(3, 64, 11, True) + conv(64, 192, 5, True) + conv(192, 384, 3, True) + conv(384, 256, 3, True)
               + conv(256, 256, 3, True) + linear(256 * 6 * 6, 4096) + linear(4096, 4096) + linear(4096, 1000))
MNIST_NET = conv(1, 10, 5, True) + conv(10, 20, 5, True) + linear(320, 50) + linear(50, 10)


def test_derived_counts_are_torchvisions():
    # The layer-by-layer sums agree with the figures torchvision documents.
    assert resnet_params("bottleneck", [3, 4, 6, 3]) == 25_557_032
    assert resnet_params("basic", [2, 2, 2, 2]) == 11_689_512
    assert ALEXNET_OWT == 61_100_840
    assert MNIST_NET == 21_840  # the Horovod / PyTorch MNIST tutorial network


@pytest.mark.parametrize("name, expected", [
    ("resnet50", 25_557_032),
    ("resnet18", 11_689_512),
    ("alexnet_owt", 61_100_840),
])
def test_imagenet_model_parameter_counts(name, expected):
    assert models.count_parameters(models.build_model(name)) == expected


def test_resnet50_tensor_count_and_names():
    model = models.resnet50()
    names = [n for n, _ in model.named_parameters()]
    assert len(names) == 161  # as torchvision's resnet50: 53 convolutions + 53 batch norms x 2 + fc x 2
    assert names[:3] == ["conv1.weight", "bn1.weight", "bn1.bias"]
    assert "layer4.2.conv3.weight" in names and "layer2.0.downsample.0.weight" in names
    # v1.5: the stride sits on the 3x3 convolution of a downsampling bottleneck.
    assert model.layer2[0].conv2.stride == (2, 2) and model.layer2[0].conv1.stride == (1, 1)


def test_small_models_parameter_counts():
    assert models.count_parameters(models.MnistNet()) == MNIST_NET
    small = (conv(3, 32, 3, True) + bn(32) + conv(32, 64, 3, True) + bn(64) + conv(64, 128, 3, True) + bn(128)
             + linear(128 * 4, 256) + linear(256, 1000))
    assert models.count_parameters(models.SmallCNN()) == small == 482_024


def test_count_parameters_skips_frozen():
    model = models.MnistNet()
    model.conv1.weight.requires_grad_(False)
    assert models.count_parameters(model) == MNIST_NET - 250


@torch.no_grad()
def test_alexnet_owt_forward_224():
    model = models.build_model("alexnet_owt", num_classes=1000).eval()
    assert model(torch.randn(1, 3, 224, 224)).shape == (1, 1000)
    # The feature extractor yields 256 x 6 x 6 at 224x224 (no adaptive pooling needed).
    assert model.features(torch.randn(1, 3, 224, 224)).shape == (1, 256, 6, 6)


@torch.no_grad()
@pytest.mark.parametrize("name, size", [("resnet18", 64), ("resnet50", 64)])
def test_resnet_forward_shapes(name, size):
    model = models.build_model(name, num_classes=7).eval()
    assert model(torch.randn(2, 3, size, size)).shape == (2, 7)


def test_small_models_forward_and_backward():
    net = models.MnistNet()
    out = net(torch.randn(4, 1, 28, 28))
    assert out.shape == (4, 10)
    torch.testing.assert_close(out.exp().sum(dim=1), torch.ones(4))  # log-probabilities
    cnn = models.build_model("small_cnn", num_classes=10)
    loss = cnn(torch.randn(4, 3, 32, 32)).logsumexp(dim=1).mean()
    loss.backward()
    assert all(p.grad is not None for p in cnn.parameters())


def test_build_model_names_and_aliases():
    assert set(models.MODEL_NAMES) >= {"resnet50", "resnet18", "alexnet_owt", "small_cnn", "mnist_net"}
    assert isinstance(models.build_model("smallcnn"), models.SmallCNN)
    assert isinstance(models.build_model("Small-CNN"), models.SmallCNN)
    assert models.canonical_name("alexnet") == "alexnet_owt"
    for name in models.MODEL_NAMES:
        assert name in models.INPUT_SHAPES
    with pytest.raises(ValueError, match="unknown model 'vgg16'.*resnet50"):
        models.build_model("vgg16")
