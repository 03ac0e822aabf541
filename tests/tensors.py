"""Reproducible test inputs and bitwise comparisons, shared by the tests of several layers."""

from __future__ import annotations

import zlib
from typing import TYPE_CHECKING, Any, Sequence

import numpy as np
import torch

if TYPE_CHECKING:
    from lightning_onebit.comm import BucketLayout


def seed_of(*parts: Any) -> int:
    """A generator seed made of ``parts`` (e.g. call, rank, bucket), different for every combination."""
    # torch's CPU generator keeps only 32 bits of a seed
    return zlib.crc32(repr(parts).encode())


def bucket_buffer(layout: BucketLayout, magnitudes, seed: int) -> torch.Tensor:
    """A bucket's flat buffer (``layout.padded_numel``): each tensor normal with its own magnitude, zero padding."""
    g = torch.Generator().manual_seed(seed)
    buffer = torch.zeros(layout.padded_numel)
    offset = 0
    for n, mag in zip(layout.tensor_numels, magnitudes):
        buffer[offset : offset + n] = torch.randn(n, generator=g) * mag
        offset += n
    return buffer


def exact_sqrt(t: torch.Tensor) -> torch.Tensor:
    """The correctly rounded square root of a CPU float32/float64 tensor (numpy's: the processor's IEEE instruction),
    the reference for the library's square roots. torch's own CPU ``sqrt`` is not correctly rounded, and its bits
    depend on the processor."""
    return torch.from_numpy(np.sqrt(t.detach().cpu().numpy()))


def same_bits(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Bitwise equality: ``torch.equal``, and also the same bits where values compare equal but are not the same
    (``-0.0`` and ``0.0``) or do not compare at all (NaN)."""
    if a.dtype != b.dtype or a.shape != b.shape:
        return False
    return torch.equal(a.reshape(-1).view(torch.uint8), b.reshape(-1).view(torch.uint8))


def identical(tensors: Sequence[torch.Tensor]) -> bool:
    """Every tensor ``torch.equal`` to the first (e.g. one per rank: replicas in sync)."""
    return all(torch.equal(tensors[0], t) for t in tensors[1:])
