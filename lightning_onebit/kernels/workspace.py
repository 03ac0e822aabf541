"""Reusable scratch buffers, so kernels called every step allocate nothing in steady state.

Fresh large allocations are expensive on CPU (the first touch of every page faults: a new 32 MB tensor costs several
times a copy into an existing one), so callers that run every step keep one :class:`Workspace` per buffer shape.
"""

from __future__ import annotations

import torch


class Workspace:
    """Named scratch tensors, one per (name, dtype, device). A request gets a prefix of that buffer, which is
    (re)allocated only when it is too small."""

    def __init__(self) -> None:
        self._buffers: dict[tuple[str, torch.dtype, torch.device], torch.Tensor] = {}

    def get(self, name: str, numel: int, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
        key = (name, dtype, torch.device(device))
        buffer = self._buffers.get(key)
        if buffer is None or buffer.numel() < numel:
            buffer = self._buffers[key] = torch.empty(numel, dtype=dtype, device=device)
        return buffer[:numel]

    def nbytes(self) -> int:
        return sum(b.numel() * b.element_size() for b in self._buffers.values())
