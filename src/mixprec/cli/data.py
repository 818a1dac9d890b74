"""The demo's data: scikit-learn's handwritten digits, as 1x32x32 float32 images.

``sklearn.datasets.load_digits`` ships 1,797 real 8x8 images (values 0-16) inside the
package, so nothing is downloaded. They are upsampled to 32x32 (bilinear) for LeNet-5,
standardised with the training split's mean and standard deviation, and split into
stratified train and test sets by a seed.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

__all__ = ["Digits", "batch_order", "load_digits"]


@dataclass(frozen=True)
class Digits:
    """Train and test splits: images ``(n, 1, 32, 32)`` float32, labels ``(n,)`` int64."""

    x_train: torch.Tensor
    y_train: torch.Tensor
    x_test: torch.Tensor
    y_test: torch.Tensor


def load_digits(seed: int, test_fraction: float = 0.3, size: int = 32) -> Digits:
    """Load, upsample, split (stratified, by ``seed``) and standardise the digits.

    Example:
        >>> data = load_digits(seed=0)
        >>> data.x_train.shape[1:], len(data.y_train) + len(data.y_test)
        (torch.Size([1, 32, 32]), 1797)
    """
    from sklearn.datasets import load_digits as sklearn_digits
    from sklearn.model_selection import train_test_split

    digits = sklearn_digits()
    images = torch.tensor(digits.images, dtype=torch.float32).unsqueeze(1) / 16.0
    images = F.interpolate(images, size=(size, size), mode="bilinear", align_corners=False)
    labels = torch.tensor(digits.target, dtype=torch.int64)
    train, test = train_test_split(
        list(range(len(labels))),
        test_size=test_fraction,
        random_state=seed,
        stratify=digits.target,
    )
    train_index, test_index = torch.tensor(train), torch.tensor(test)
    mean = images[train_index].mean()
    std = images[train_index].std()
    images = (images - mean) / std
    return Digits(images[train_index], labels[train_index], images[test_index], labels[test_index])


def batch_order(num_samples: int, batch_size: int, epochs: int, seed: int) -> list[torch.Tensor]:
    """The index of every training batch, epoch after epoch: one fixed order for all runs.

    Each epoch is a fresh permutation from a generator seeded by ``seed``; a last partial
    batch is dropped so every step sees ``batch_size`` samples.

    Example:
        >>> [b.tolist() for b in batch_order(4, 2, 1, seed=0)]
        [[0, 1], [3, 2]]
    """
    generator = torch.Generator().manual_seed(seed)
    batches: list[torch.Tensor] = []
    for _ in range(epochs):
        permutation = torch.randperm(num_samples, generator=generator)
        full = num_samples // batch_size * batch_size
        batches.extend(permutation[:full].split(batch_size))
    return batches
