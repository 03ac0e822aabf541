"""Sign packing on CUDA tensors with cupy, sharing memory with torch through DLPack (no copies).

Produces the same bytes as :mod:`lightning_onebit.kernels.torch_kernels` (``cupy.packbits`` with ``bitorder="big"``).
Importing this module does not import cupy; :func:`is_available` does, once.
"""

from __future__ import annotations

import functools
from typing import Optional

import torch


@functools.lru_cache(maxsize=1)
def _cupy():
    try:
        import cupy  # noqa: F401
    except Exception:  # ImportError, or a cupy built for another CUDA that fails at import
        return None
    return cupy


def is_available() -> bool:
    """True when cupy imports and sees a CUDA device."""
    cupy = _cupy()
    if cupy is None:
        return False
    try:
        return cupy.cuda.runtime.getDeviceCount() > 0
    except Exception:
        return False


def _as_cupy(tensor: torch.Tensor):
    cupy = _cupy()
    if cupy is None:
        raise RuntimeError("the cupy kernels need cupy: pip install 'lightning-onebit[cuda]'")
    if not tensor.is_cuda:
        raise ValueError(f"the cupy kernels need a CUDA tensor, got one on {tensor.device}")
    return cupy.from_dlpack(tensor)


def pack_bool(bits: torch.Tensor, out: Optional[torch.Tensor] = None) -> torch.Tensor:
    """Pack a 1-D bool CUDA tensor (length multiple of 8) into uint8, most significant bit first."""
    if bits.dim() != 1 or bits.numel() % 8:
        raise ValueError(f"expected a 1-D tensor whose length is a multiple of 8, got shape {tuple(bits.shape)}")
    cupy = _cupy()
    if out is None:
        out = torch.empty(bits.numel() // 8, dtype=torch.uint8, device=bits.device)
    if bits.numel():
        with cupy.cuda.ExternalStream(torch.cuda.current_stream(bits.device).cuda_stream):
            packed = cupy.packbits(_as_cupy(bits.contiguous().view(torch.uint8)), bitorder="big")
            _as_cupy(out)[...] = packed
    return out


def unpack_bool(packed: torch.Tensor, out: Optional[torch.Tensor] = None) -> torch.Tensor:
    """Inverse of :func:`pack_bool`."""
    if packed.dtype != torch.uint8 or packed.dim() != 1:
        raise ValueError(f"expected a 1-D uint8 tensor, got {packed.dtype} of shape {tuple(packed.shape)}")
    cupy = _cupy()
    if out is None:
        out = torch.empty(8 * packed.numel(), dtype=torch.bool, device=packed.device)
    if packed.numel():
        with cupy.cuda.ExternalStream(torch.cuda.current_stream(packed.device).cuda_stream):
            _as_cupy(out.view(torch.uint8))[...] = cupy.unpackbits(_as_cupy(packed), bitorder="big")
    return out


def unpack_signs_into(packed: torch.Tensor, out: torch.Tensor, workspace=None) -> torch.Tensor:
    """Write the +1/-1 signs encoded by ``packed`` into the floating CUDA tensor ``out``."""
    bits = unpack_bool(packed)
    return out.copy_(bits).mul_(2).sub_(1)
