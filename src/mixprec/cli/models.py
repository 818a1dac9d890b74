"""The models the command line trains and benchmarks.

Each public function here is a model factory (no arguments, returns a fresh float32
``nn.Module``), so it can also be named on the command line, e.g.
``mixprec plan mixprec.cli.models:lenet5 --input 1,1,32,32``.
"""

from __future__ import annotations

import itertools

import torch
import torch.nn.functional as F
from torch import nn

__all__ = [
    "MLP",
    "ConvNet",
    "EncoderBlock",
    "LeNet5",
    "SmallCNN",
    "TinyMLP",
    "TinyTransformer",
    "TransformerEncoder",
    "cnn",
    "lenet5",
    "mlp",
    "transformer",
]


class LeNet5(nn.Module):
    """LeNet-5 for 1x32x32 images: conv-pool-conv-pool-fc-fc-fc (ReLU, max pooling)."""

    def __init__(self, num_classes: int = 10) -> None:
        super().__init__()
        self.conv1 = nn.Conv2d(1, 6, 5)
        self.conv2 = nn.Conv2d(6, 16, 5)
        self.fc1 = nn.Linear(16 * 5 * 5, 120)
        self.fc2 = nn.Linear(120, 84)
        self.fc3 = nn.Linear(84, num_classes)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = F.max_pool2d(F.relu(self.conv1(x)), 2)
        x = F.max_pool2d(F.relu(self.conv2(x)), 2)
        x = torch.flatten(x, 1)
        x = F.relu(self.fc1(x))
        x = F.relu(self.fc2(x))
        return self.fc3(x)


class MLP(nn.Module):
    """Linear layers with ReLU between them, e.g. ``MLP((1024, 4096, 4096, 1024))``."""

    def __init__(self, sizes: tuple[int, ...]) -> None:
        super().__init__()
        layers: list[nn.Module] = []
        for index in range(len(sizes) - 1):
            layers.append(nn.Linear(sizes[index], sizes[index + 1]))
            if index < len(sizes) - 2:
                layers.append(nn.ReLU())
        self.layers = nn.Sequential(*layers)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.layers(x)


class ConvNet(nn.Module):
    """A VGG-style CNN with BatchNorm: (conv-bn-relu) x2 then a pool, per stage."""

    def __init__(self, channels: tuple[int, ...] = (32, 64, 128), num_classes: int = 10) -> None:
        super().__init__()
        stages: list[nn.Module] = []
        previous = 3
        for width in channels:
            for _ in range(2):
                stages += [
                    nn.Conv2d(previous, width, 3, padding=1, bias=False),
                    nn.BatchNorm2d(width),
                    nn.ReLU(),
                ]
                previous = width
            stages.append(nn.MaxPool2d(2))
        self.features = nn.Sequential(*stages)
        self.head = nn.Linear(previous, num_classes)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.features(x)
        return self.head(torch.flatten(F.adaptive_avg_pool2d(x, 1), 1))


class EncoderBlock(nn.Module):
    """A pre-norm transformer encoder block: LayerNorm, self-attention, LayerNorm, MLP."""

    def __init__(self, width: int, heads: int, hidden: int) -> None:
        super().__init__()
        self.heads = heads
        self.norm1 = nn.LayerNorm(width)
        self.qkv = nn.Linear(width, 3 * width)
        self.proj = nn.Linear(width, width)
        self.norm2 = nn.LayerNorm(width)
        self.fc1 = nn.Linear(width, hidden)
        self.fc2 = nn.Linear(hidden, width)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        batch, length, width = x.shape
        q, k, v = (
            self.qkv(self.norm1(x))
            .reshape(batch, length, 3, self.heads, width // self.heads)
            .permute(2, 0, 3, 1, 4)
            .unbind(0)
        )
        attended = F.scaled_dot_product_attention(q, k, v)
        x = x + self.proj(attended.transpose(1, 2).reshape(batch, length, width))
        return x + self.fc2(F.gelu(self.fc1(self.norm2(x))))


class TransformerEncoder(nn.Module):
    """Token embedding, ``depth`` encoder blocks, a final LayerNorm and a classifier on
    the mean token (integer token inputs of shape ``(batch, length)``)."""

    def __init__(
        self,
        vocab: int = 1000,
        width: int = 256,
        depth: int = 4,
        heads: int = 4,
        max_length: int = 512,
        num_classes: int = 10,
    ) -> None:
        super().__init__()
        self.embed = nn.Embedding(vocab, width)
        self.position = nn.Parameter(torch.zeros(1, max_length, width))
        self.blocks = nn.Sequential(*(EncoderBlock(width, heads, 4 * width) for _ in range(depth)))
        self.norm = nn.LayerNorm(width)
        self.head = nn.Linear(width, num_classes)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        x = self.embed(tokens) + self.position[:, : tokens.shape[1]]
        x = self.norm(self.blocks(x))
        return self.head(x.mean(dim=1))


class TinyMLP(nn.Module):
    """A small MLP (16-32-32-8 by default) for casts and numerics checks."""

    def __init__(self, sizes: tuple[int, ...] = (16, 32, 32, 8)) -> None:
        super().__init__()
        layers: list[nn.Module] = []
        for i, (a, b) in enumerate(itertools.pairwise(sizes)):
            layers.append(nn.Linear(a, b))
            if i < len(sizes) - 2:
                layers.append(nn.ReLU())
        self.net = nn.Sequential(*layers)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.net(x)


class SmallCNN(nn.Module):
    """conv-bn-relu x2, pool, linear: a torchvision-style block."""

    def __init__(self, channels: int = 8, classes: int = 10) -> None:
        super().__init__()
        self.conv1 = nn.Conv2d(3, channels, 3, padding=1, bias=False)
        self.bn1 = nn.BatchNorm2d(channels)
        self.conv2 = nn.Conv2d(channels, channels, 3, padding=1, bias=False)
        self.bn2 = nn.BatchNorm2d(channels)
        self.relu = nn.ReLU(inplace=True)
        self.pool = nn.AdaptiveAvgPool2d(1)
        self.fc = nn.Linear(channels, classes)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.relu(self.bn1(self.conv1(x)))
        x = self.relu(self.bn2(self.conv2(x)))
        return self.fc(torch.flatten(self.pool(x), 1))


class TinyTransformer(nn.Module):
    """Embedding, a transformer encoder layer, a classifier: a small language model."""

    def __init__(self, vocab: int = 50, dim: int = 32, heads: int = 4, classes: int = 5) -> None:
        super().__init__()
        self.embed = nn.Embedding(vocab, dim)
        self.encoder = nn.TransformerEncoderLayer(
            dim, heads, 2 * dim, dropout=0.0, batch_first=True
        )
        self.norm = nn.LayerNorm(dim)
        self.head = nn.Linear(dim, classes)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        x = self.encoder(self.embed(tokens))
        return self.head(self.norm(x).mean(dim=1))


def lenet5() -> nn.Module:
    """LeNet-5 for 10 classes on 1x32x32 images (the model ``mixprec demo`` trains).

    Example:
        >>> lenet5()(torch.randn(2, 1, 32, 32)).shape
        torch.Size([2, 10])
    """
    return LeNet5()


def mlp() -> nn.Module:
    """The benchmark MLP: 1024-4096-4096-1024 with ReLU (inputs ``(batch, 1024)``)."""
    return MLP((1024, 4096, 4096, 1024))


def cnn() -> nn.Module:
    """The benchmark CNN with BatchNorm (inputs ``(batch, 3, 32, 32)``)."""
    return ConvNet()


def transformer() -> nn.Module:
    """The benchmark transformer encoder (integer inputs ``(batch, length)``, length <= 512)."""
    return TransformerEncoder()
