"""Reusable scratch buffers, so kernels called every step allocate nothing in steady state.

Fresh large allocations are expensive on CPU (the first touch of every page faults: a new 32 MB tensor costs several
times a copy into an existing one), so callers that run every step keep one :class:`Workspace` per buffer shape.
"""

from __future__ import annotations

import torch


class Workspace:
    """Named scratch tensors. A request gets a prefix of the named buffer, which is (re)allocated only when it is too
    small or of another dtype or device."""

    def __init__(self) -> None:
        self._buffers: dict[str, torch.Tensor] = {}

    def get(self, name: str, numel: int, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
        buffer = self._buffers.get(name)
        if buffer is None or buffer.numel() < numel or buffer.dtype != dtype or buffer.device != torch.device(device):
            buffer = self._buffers[name] = torch.empty(numel, dtype=dtype, device=device)
        return buffer[:numel]

    def nbytes(self) -> int:
        return sum(b.numel() * b.element_size() for b in self._buffers.values())
