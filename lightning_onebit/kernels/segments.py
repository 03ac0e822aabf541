"""Contiguous segments of a flat buffer: the granularity at which 1-bit compression keeps one scale."""

from __future__ import annotations

from typing import Callable, Sequence

import numpy as np
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

    def _on_device(self, name: str, device: torch.device,
                   build: Callable[[torch.device], torch.Tensor]) -> torch.Tensor:
        """``build(device)``, computed once per (name, device)."""
        key = (name, torch.device(device))
        cached = self._device_tensors.get(key)
        if cached is None:
            cached = self._device_tensors[key] = build(key[1])
        return cached

    def sqrt_lengths(self, device: torch.device) -> torch.Tensor:
        """``sqrt(len_s)`` as a float32 tensor on ``device`` (cached)."""
        return self._on_device(
            # numpy's sqrt is correctly rounded (torch's CPU sqrt is not, and its bits depend on the processor)
            "sqrt_lengths", device, lambda d: torch.from_numpy(np.sqrt(np.asarray(self.lengths, np.float32))).to(d)
        )

    def offsets_tensor(self, device: torch.device) -> torch.Tensor:
        """The offsets ``o_0 .. o_S`` as a contiguous int64 tensor on ``device`` (cached)."""
        return self._on_device("offsets", device, lambda d: torch.tensor(self.offsets, dtype=torch.int64, device=d))

    def chunk_owner(self, device: torch.device) -> torch.Tensor:
        """For every norm chunk, the index of its segment (int64 on ``device``, cached)."""
        return self._on_device(
            "chunk_owner", device, lambda d: torch.tensor(self._chunk_owner_list, dtype=torch.int64, device=d)
        )

    def lengths_tensor(self, device: torch.device) -> torch.Tensor:
        """The segment lengths as an int64 tensor on ``device`` (cached)."""
        return self._on_device("lengths", device, lambda d: torch.tensor(self.lengths, dtype=torch.int64, device=d))

    def chunk_table(self, device: torch.device) -> torch.Tensor:
        """``[S, K]`` int64 table (``K`` a power of two): row ``s`` lists segment ``s``'s norm chunks in order,
        padded with the index one past the last chunk (the caller puts a zero there). Summing a row by halving it
        (:meth:`sum_per_segment`) is a fixed order of additions on every device."""

        def build(d: torch.device) -> torch.Tensor:
            rows: list[list[int]] = [[] for _ in self.bounds]
            for chunk, owner in enumerate(self._chunk_owner_list):
                rows[owner].append(chunk)
            width = 1
            while width < max(len(r) for r in rows):
                width *= 2
            pad = len(self._chunk_owner_list)
            return torch.tensor([r + [pad] * (width - len(r)) for r in rows], dtype=torch.int64, device=d)

        return self._on_device("chunk_table", device, build)

    def sum_per_segment(self, per_chunk: torch.Tensor) -> torch.Tensor:
        """Sum ``per_chunk`` (one value per norm chunk) over each segment's chunks, in a pairwise order that is the
        same on every device and run: no atomics (``index_add_`` on CUDA adds in a run-dependent order), no host
        synchronisation, ``log2(K)`` small kernels for a segment of ``K`` chunks (none when every segment has one)."""
        if per_chunk.numel() == len(self):  # one chunk per segment: nothing to add
            return per_chunk
        padded = torch.cat([per_chunk, per_chunk.new_zeros(1)])
        index = self.chunk_table(per_chunk.device)
        table = torch.index_select(padded, 0, index.view(-1)).view(index.shape)
        while table.shape[1] > 1:  # neighbours in pairs: a sum of two is the same whatever the reduction order
            table = table.view(len(self), -1, 2).sum(dim=2)
        return table.view(len(self))

    def expand(self, per_segment: torch.Tensor) -> torch.Tensor:
        """One value per element: ``per_segment[s]`` repeated over segment ``s`` (``total`` elements), without a
        host synchronisation.

        CUDA: one ``repeat_interleave`` kernel (the output size is given, so the device never reports it back).
        Elsewhere: a concatenation of broadcast views, about 30x faster than torch's CPU ``repeat_interleave``.
        """
        if per_segment.device.type == "cuda":
            lengths = self.lengths_tensor(per_segment.device)
            return torch.repeat_interleave(per_segment, lengths, output_size=self.total)
        return torch.cat([value.expand(n) for value, n in zip(per_segment.unbind(), self.lengths)])
