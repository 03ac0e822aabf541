"""Contiguous segments of a flat buffer: the granularity at which 1-bit compression keeps one scale."""

from __future__ import annotations

from typing import Callable, Sequence

import torch


#: Elements per partial norm. torch's float32 norm loses accuracy on long vectors (relative error ~1e-5 at 1M
#: elements, ~3e-4 at 8M on CPU); chunks of 64K are accurate, and their squares are summed in float64.
NORM_CHUNK = 1 << 16


class Segments:
    """Consecutive ``[start, stop)`` ranges covering ``[0, total)`` of a flat buffer, none of them empty.

    Args:
        offsets: ``0 = o_0 < o_1 < ... < o_S = total``; segment ``s`` is ``[o_s, o_{s+1})``.
    """

    def __init__(self, offsets: Sequence[int]) -> None:
        offsets = tuple(int(o) for o in offsets)
        if not offsets or offsets[0] != 0:
            raise ValueError(f"segment offsets must start at 0, got {offsets[:3]}...")
        if any(b <= a for a, b in zip(offsets, offsets[1:])):
            raise ValueError("segment offsets must be strictly increasing (no empty segments)")
        self.offsets = offsets
        self.bounds = tuple(zip(offsets[:-1], offsets[1:]))
        self.lengths = tuple(b - a for a, b in self.bounds)
        self._device_tensors: dict[tuple[str, torch.device], torch.Tensor] = {}
        # Norm chunks: every segment cut into pieces of at most NORM_CHUNK elements (see torch_kernels.segment_scales).
        self.chunk_bounds = tuple(
            (start, min(start + NORM_CHUNK, b)) for a, b in self.bounds for start in range(a, b, NORM_CHUNK)
        )
        self._chunk_owner_list = [s for s, (a, b) in enumerate(self.bounds) for _ in range(a, b, NORM_CHUNK)]

    @classmethod
    def from_lengths(cls, lengths: Sequence[int]) -> "Segments":
        offsets = [0]
        for n in lengths:
            offsets.append(offsets[-1] + int(n))
        return cls(offsets)

    @property
    def total(self) -> int:
        return self.offsets[-1]

    def __len__(self) -> int:
        return len(self.bounds)

    def __eq__(self, other: object) -> bool:
        return isinstance(other, Segments) and other.offsets == self.offsets

    def __hash__(self) -> int:
        return hash(self.offsets)

    def __repr__(self) -> str:
        return f"Segments(count={len(self)}, total={self.total})"

    def split(self, buffer: torch.Tensor) -> list[torch.Tensor]:
        """Views of ``buffer`` (1-D), one per segment."""
        return [buffer[a:b] for a, b in self.bounds]

    def _on_device(self, name: str, device: torch.device, build: Callable[[torch.device], torch.Tensor]) -> torch.Tensor:
        """``build(device)``, computed once per (name, device)."""
        key = (name, torch.device(device))
        cached = self._device_tensors.get(key)
        if cached is None:
            cached = self._device_tensors[key] = build(key[1])
        return cached

    def sqrt_lengths(self, device: torch.device) -> torch.Tensor:
        """``sqrt(len_s)`` as a float32 tensor on ``device`` (cached)."""
        return self._on_device(
            "sqrt_lengths", device, lambda d: torch.tensor(self.lengths, dtype=torch.float32, device=d).sqrt_()
        )

    def offsets_tensor(self, device: torch.device) -> torch.Tensor:
        """The offsets ``o_0 .. o_S`` as a contiguous int64 tensor on ``device`` (cached)."""
        return self._on_device("offsets", device, lambda d: torch.tensor(self.offsets, dtype=torch.int64, device=d))

    def chunk_owner(self, device: torch.device) -> torch.Tensor:
        """For every norm chunk, the index of its segment (int64 on ``device``, cached)."""
        return self._on_device(
            "chunk_owner", device, lambda d: torch.tensor(self._chunk_owner_list, dtype=torch.int64, device=d)
        )
