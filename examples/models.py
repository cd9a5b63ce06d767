"""Models for the roundel PyTorch examples and benchmarks, in plain PyTorch (no torchvision needed).

- ``MnistNet``: the classic Horovod/PyTorch MNIST tutorial network
  (two 5x5 convolutions, dropout, 320 -> 50 -> 10, log-softmax) for
  1x28x28 inputs.
- ``SmallCNN``: a small convolutional classifier for benchmarks on CPU;
  any square input of 8 pixels or more.
- ``resnet18()``, ``resnet50()``: ResNet v1.5 (stride on the 3x3 convolution of
  bottleneck blocks), with torchvision's module names and shapes, so a
  torchvision ``state_dict`` loads into them unchanged. ResNet-50 has
  25,557,032 parameters, ResNet-18 11,689,512 (1000 classes).
- ``alexnet_owt()``: AlexNet as in Krizhevsky's "One weird trick" paper
  (single tower: 64, 192, 384, 256, 256 channels; 4096, 4096, 1000), the
  variant Horovod's benchmarks time; input 3x224x224; torchvision's layout.

``build_model(name, num_classes)`` returns one of them by the name the
benchmarks take on the command line (``MODEL_NAMES``, or an alias such as
``smallcnn``); ``INPUT_SHAPES`` gives the input each one expects.
"""

from __future__ import annotations

import torch
import torch.nn as nn
import torch.nn.functional as F


class MnistNet(nn.Module):
    """The MNIST tutorial CNN; returns log-probabilities (use with ``F.nll_loss``)."""

    def __init__(self, num_classes: int = 10):
        super().__init__()
        self.conv1 = nn.Conv2d(1, 10, kernel_size=5)
        self.conv2 = nn.Conv2d(10, 20, kernel_size=5)
        self.conv2_drop = nn.Dropout2d()
        self.fc1 = nn.Linear(320, 50)
        self.fc2 = nn.Linear(50, num_classes)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = F.relu(F.max_pool2d(self.conv1(x), 2))                   # 10 x 12 x 12
        x = F.relu(F.max_pool2d(self.conv2_drop(self.conv2(x)), 2))  # 20 x 4 x 4
        x = torch.flatten(x, 1)                                      # 320
        x = F.relu(self.fc1(x))
        x = F.dropout(x, training=self.training)
        return F.log_softmax(self.fc2(x), dim=1)


class SmallCNN(nn.Module):
    """Three 3x3 convolutions and two fully connected layers (482,024 parameters at 1000 classes).

    Big enough that a training step has real gradient traffic, small enough
    to train on one CPU thread at 32x32 pixels. Returns logits.
    """

    def __init__(self, num_classes: int = 1000, in_channels: int = 3):
        super().__init__()
        self.features = nn.Sequential(
            nn.Conv2d(in_channels, 32, kernel_size=3, padding=1), nn.BatchNorm2d(32), nn.ReLU(inplace=True),
            nn.MaxPool2d(2),
            nn.Conv2d(32, 64, kernel_size=3, padding=1), nn.BatchNorm2d(64), nn.ReLU(inplace=True),
            nn.MaxPool2d(2),
            nn.Conv2d(64, 128, kernel_size=3, padding=1), nn.BatchNorm2d(128), nn.ReLU(inplace=True),
            nn.AdaptiveAvgPool2d((2, 2)),
        )
        self.classifier = nn.Sequential(
            nn.Flatten(), nn.Linear(128 * 2 * 2, 256), nn.ReLU(inplace=True), nn.Linear(256, num_classes),
        )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.classifier(self.features(x))


# ------------------------------------------------------------------ ResNet

def _conv3x3(in_planes: int, out_planes: int, stride: int = 1) -> nn.Conv2d:
    return nn.Conv2d(in_planes, out_planes, kernel_size=3, stride=stride, padding=1, bias=False)


def _conv1x1(in_planes: int, out_planes: int, stride: int = 1) -> nn.Conv2d:
    return nn.Conv2d(in_planes, out_planes, kernel_size=1, stride=stride, bias=False)


class BasicBlock(nn.Module):
    """Two 3x3 convolutions with a shortcut (ResNet-18/34)."""

    expansion = 1

    def __init__(self, inplanes: int, planes: int, stride: int = 1, downsample: nn.Module | None = None):
        super().__init__()
        self.conv1 = _conv3x3(inplanes, planes, stride)
        self.bn1 = nn.BatchNorm2d(planes)
        self.relu = nn.ReLU(inplace=True)
        self.conv2 = _conv3x3(planes, planes)
        self.bn2 = nn.BatchNorm2d(planes)
        self.downsample = downsample

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        identity = x if self.downsample is None else self.downsample(x)
        out = self.relu(self.bn1(self.conv1(x)))
        out = self.bn2(self.conv2(out))
        return self.relu(out + identity)


class Bottleneck(nn.Module):
    """1x1 reduce, 3x3 (carrying the stride, as in ResNet v1.5), 1x1 expand by 4, with a shortcut."""

    expansion = 4

    def __init__(self, inplanes: int, planes: int, stride: int = 1, downsample: nn.Module | None = None):
        super().__init__()
        self.conv1 = _conv1x1(inplanes, planes)
        self.bn1 = nn.BatchNorm2d(planes)
        self.conv2 = _conv3x3(planes, planes, stride)
        self.bn2 = nn.BatchNorm2d(planes)
        self.conv3 = _conv1x1(planes, planes * self.expansion)
        self.bn3 = nn.BatchNorm2d(planes * self.expansion)
        self.relu = nn.ReLU(inplace=True)
        self.downsample = downsample

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        identity = x if self.downsample is None else self.downsample(x)
        out = self.relu(self.bn1(self.conv1(x)))
        out = self.relu(self.bn2(self.conv2(out)))
        out = self.bn3(self.conv3(out))
        return self.relu(out + identity)


class ResNet(nn.Module):
    """ResNet for ImageNet-shaped inputs (3xHxW, H and W >= 32), returning logits."""

    def __init__(self, block, layers: list[int], num_classes: int = 1000):
        super().__init__()
        self.inplanes = 64
        self.conv1 = nn.Conv2d(3, 64, kernel_size=7, stride=2, padding=3, bias=False)
        self.bn1 = nn.BatchNorm2d(64)
        self.relu = nn.ReLU(inplace=True)
        self.maxpool = nn.MaxPool2d(kernel_size=3, stride=2, padding=1)
        self.layer1 = self._make_layer(block, 64, layers[0])
        self.layer2 = self._make_layer(block, 128, layers[1], stride=2)
        self.layer3 = self._make_layer(block, 256, layers[2], stride=2)
        self.layer4 = self._make_layer(block, 512, layers[3], stride=2)
        self.avgpool = nn.AdaptiveAvgPool2d((1, 1))
        self.fc = nn.Linear(512 * block.expansion, num_classes)
        for m in self.modules():
            if isinstance(m, nn.Conv2d):
                nn.init.kaiming_normal_(m.weight, mode="fan_out", nonlinearity="relu")
            elif isinstance(m, nn.BatchNorm2d):
                nn.init.ones_(m.weight)
                nn.init.zeros_(m.bias)

    def _make_layer(self, block, planes: int, blocks: int, stride: int = 1) -> nn.Sequential:
        downsample = None
        if stride != 1 or self.inplanes != planes * block.expansion:
            downsample = nn.Sequential(_conv1x1(self.inplanes, planes * block.expansion, stride),
                                       nn.BatchNorm2d(planes * block.expansion))
        layers = [block(self.inplanes, planes, stride, downsample)]
        self.inplanes = planes * block.expansion
        layers += [block(self.inplanes, planes) for _ in range(1, blocks)]
        return nn.Sequential(*layers)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.maxpool(self.relu(self.bn1(self.conv1(x))))
        x = self.layer4(self.layer3(self.layer2(self.layer1(x))))
        return self.fc(torch.flatten(self.avgpool(x), 1))


def resnet18(num_classes: int = 1000) -> ResNet:
    """ResNet-18: basic blocks, [2, 2, 2, 2]."""
    return ResNet(BasicBlock, [2, 2, 2, 2], num_classes)


def resnet50(num_classes: int = 1000) -> ResNet:
    """ResNet-50: bottleneck blocks, [3, 4, 6, 3] (25,557,032 parameters at 1000 classes)."""
    return ResNet(Bottleneck, [3, 4, 6, 3], num_classes)


# ----------------------------------------------------------------- AlexNet

class AlexNetOWT(nn.Module):
    """AlexNet, "one weird trick" variant (Krizhevsky 2014), for 3x224x224 inputs; returns logits."""

    def __init__(self, num_classes: int = 1000, dropout: float = 0.5):
        super().__init__()
        self.features = nn.Sequential(
            nn.Conv2d(3, 64, kernel_size=11, stride=4, padding=2), nn.ReLU(inplace=True),
            nn.MaxPool2d(kernel_size=3, stride=2),
            nn.Conv2d(64, 192, kernel_size=5, padding=2), nn.ReLU(inplace=True),
            nn.MaxPool2d(kernel_size=3, stride=2),
            nn.Conv2d(192, 384, kernel_size=3, padding=1), nn.ReLU(inplace=True),
            nn.Conv2d(384, 256, kernel_size=3, padding=1), nn.ReLU(inplace=True),
            nn.Conv2d(256, 256, kernel_size=3, padding=1), nn.ReLU(inplace=True),
            nn.MaxPool2d(kernel_size=3, stride=2),
        )
        self.avgpool = nn.AdaptiveAvgPool2d((6, 6))
        self.classifier = nn.Sequential(
            nn.Dropout(p=dropout), nn.Linear(256 * 6 * 6, 4096), nn.ReLU(inplace=True),
            nn.Dropout(p=dropout), nn.Linear(4096, 4096), nn.ReLU(inplace=True),
            nn.Linear(4096, num_classes),
        )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.avgpool(self.features(x))
        return self.classifier(torch.flatten(x, 1))


def alexnet_owt(num_classes: int = 1000) -> AlexNetOWT:
    """AlexNet-OWT (61,100,840 parameters at 1000 classes)."""
    return AlexNetOWT(num_classes)


_BUILDERS = {
    "resnet50": resnet50,
    "resnet18": resnet18,
    "alexnet_owt": alexnet_owt,
    "small_cnn": SmallCNN,
    "mnist_net": MnistNet,
}
MODEL_NAMES = tuple(_BUILDERS)
# Other spellings accepted on the command line (after lower-casing and turning '-' into '_').
ALIASES = {"smallcnn": "small_cnn", "mnistnet": "mnist_net", "mnist": "mnist_net", "alexnet": "alexnet_owt"}


def canonical_name(name: str) -> str:
    """The ``MODEL_NAMES`` entry for ``name`` or an alias of it (``smallcnn``, ``alexnet``...).

    Raises ValueError naming the choices when there is none.
    """
    key = name.strip().lower().replace("-", "_")
    key = ALIASES.get(key, key)
    if key not in _BUILDERS:
        raise ValueError(f"unknown model {name!r}; choose one of {', '.join(MODEL_NAMES)} "
                         f"(or {', '.join(ALIASES)})")
    return key

# The input each model expects, as (channels, default height/width).
INPUT_SHAPES = {"resnet50": (3, 224), "resnet18": (3, 224), "alexnet_owt": (3, 224), "small_cnn": (3, 32),
                "mnist_net": (1, 28)}


def build_model(name: str, num_classes: int = 1000) -> nn.Module:
    """Return a freshly initialized model by name (one of ``MODEL_NAMES`` or ``ALIASES``); ValueError for others."""
    return _BUILDERS[canonical_name(name)](num_classes=num_classes)


def count_parameters(model: nn.Module) -> int:
    """Number of trainable parameter values in ``model``."""
    return sum(p.numel() for p in model.parameters() if p.requires_grad)
