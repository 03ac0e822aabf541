"""Sign-packing and 1-bit compression kernels ("bits on a device").

Two implementations give identical bytes:

* ``"torch"``: pure torch, any device; the reference.
* ``"cupy"``: CUDA tensors only, used automatically for CUDA tensors when cupy is importable.

Every entry point takes ``backend="auto" | "torch" | "cupy"``; ``"auto"`` follows :func:`set_default_backend`
(itself ``"auto"`` unless changed), which picks cupy for CUDA tensors when available and torch otherwise.

The one fused entry point that performance work optimises is :func:`compress_with_error_feedback`; its inverse is
:func:`decompress`. Both take an optional :class:`Workspace` so that per-step calls reuse their scratch memory.
"""

from __future__ import annotations

from typing import Literal, Optional

import torch

from lightning_onebit.kernels import cupy_kernels, torch_kernels
from lightning_onebit.kernels.segments import Segments
from lightning_onebit.kernels.workspace import Workspace

Backend = Literal["auto", "torch", "cupy"]
_BACKENDS = ("auto", "torch", "cupy")
_default_backend: str = "auto"

__all__ = [
    "Backend",
    "Segments",
    "Workspace",
    "available_backends",
    "compress_with_error_feedback",
    "decompress",
    "pack_signs",
    "resolve_backend",
    "set_default_backend",
    "unpack_signs",
]


def set_default_backend(backend: Backend) -> None:
    """Choose the backend used when a call passes ``backend="auto"`` (process-wide)."""
    global _default_backend
    if backend not in _BACKENDS:
        raise ValueError(f"unknown kernel backend {backend!r}; choose one of {_BACKENDS}")
    _default_backend = backend


def available_backends() -> tuple[str, ...]:
    return ("torch", "cupy") if cupy_kernels.is_available() else ("torch",)


def resolve_backend(tensor: torch.Tensor, backend: Backend = "auto") -> str:
    """The backend a call on ``tensor`` runs with: ``"torch"`` or ``"cupy"``."""
    if backend not in _BACKENDS:
        raise ValueError(f"unknown kernel backend {backend!r}; choose one of {_BACKENDS}")
    if backend == "auto":
        backend = _default_backend
    if backend == "auto":
        return "cupy" if tensor.is_cuda and cupy_kernels.is_available() else "torch"
    if backend == "cupy":
        if not tensor.is_cuda:
            raise ValueError(f"backend='cupy' needs CUDA tensors, got a tensor on {tensor.device}")
        if not cupy_kernels.is_available():
            raise RuntimeError("backend='cupy' was requested but cupy is not importable: pip install 'lightning-onebit[cuda]'")
    return backend


def _bit_kernels(tensor: torch.Tensor, backend: Backend):
    module = cupy_kernels if resolve_backend(tensor, backend) == "cupy" else torch_kernels
    return module.pack_bool, module.unpack_signs_into


def pack_signs(x: torch.Tensor, out: Optional[torch.Tensor] = None, backend: Backend = "auto") -> torch.Tensor:
    """Pack the signs of a 1-D tensor into bytes: bit 1 for ``x >= 0`` (so 0 -> +1), most significant bit first.

    The bytes equal ``numpy.packbits(x >= 0)``. ``x.numel()`` must be a multiple of 8.
    """
    pack_bool, _ = _bit_kernels(x, backend)
    torch_kernels._check_packable(x)
    return pack_bool(torch.ge(x, 0), out=out)


def unpack_signs(packed: torch.Tensor, dtype: torch.dtype = torch.float32, backend: Backend = "auto") -> torch.Tensor:
    """Unpack bytes to +1/-1 values of ``dtype``; the result has ``8 * packed.numel()`` elements."""
    _, signs_into = _bit_kernels(packed, backend)
    return signs_into(packed, torch.empty(8 * packed.numel(), dtype=dtype, device=packed.device))


def compress_with_error_feedback(
    x: torch.Tensor,
    error: torch.Tensor,
    segments: Segments,
    packed_out: Optional[torch.Tensor] = None,
    backend: Backend = "auto",
    workspace: Optional[Workspace] = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Error-compensated 1-bit compression of ``x``; updates ``error`` in place.

    With ``y = x + error``, for every segment ``s``: ``scale_s = ||y_s||_2 / sqrt(len_s)`` and
    ``error_s <- y_s - scale_s * sgn(y_s)``, ``sgn(0) = +1``. Returns ``(scales, packed)``: float32 scales (one per
    segment) and the packed sign bits of ``y`` (``x.numel() / 8`` bytes). ``x`` and ``error`` are 1-D, same dtype and
    length (a multiple of 8, equal to ``segments.total``).
    """
    if x.shape != error.shape or x.dtype != error.dtype:
        raise ValueError(f"x and error must match: {x.dtype}{tuple(x.shape)} vs {error.dtype}{tuple(error.shape)}")
    if segments.total != x.numel():
        raise ValueError(f"segments cover {segments.total} elements but the buffer has {x.numel()}")
    torch_kernels._check_packable(x)
    pack_bool, signs_into = _bit_kernels(x, backend)
    return torch_kernels.compress_with_error_feedback(
        x, error, segments, packed_out=packed_out, pack=pack_bool, signs_into=signs_into, workspace=workspace
    )


def decompress(
    packed: torch.Tensor,
    scales: torch.Tensor,
    segments: Segments,
    out: torch.Tensor,
    accumulate: bool = False,
    backend: Backend = "auto",
    workspace: Optional[Workspace] = None,
) -> torch.Tensor:
    """Write (or with ``accumulate=True`` add) ``scale_s * sgn`` into ``out`` for every segment; returns ``out``.

    ``packed`` holds ``segments.total / 8`` bytes; elements of ``out`` past ``segments.total`` are zeroed when not
    accumulating.
    """
    if packed.numel() * 8 != segments.total:
        raise ValueError(f"{packed.numel()} packed bytes cannot hold {segments.total} signs")
    if scales.numel() != len(segments):
        raise ValueError(f"got {scales.numel()} scales for {len(segments)} segments")
    _, signs_into = _bit_kernels(packed, backend)
    return torch_kernels.decompress(
        packed, scales, segments, out, accumulate=accumulate, signs_into=signs_into, workspace=workspace
    )
