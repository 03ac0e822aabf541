"""Fused 1-bit kernels for float32 tensors in CPU memory, from the native library (``cpu_native.c``, built on first
use by :mod:`lightning_onebit.kernels.native`, which says how and where).

The pure-torch kernels make several passes over memory per operation (``torch.ge``, a bool buffer, a multiply-pack, a
table decode, one ``sub_`` per segment). These C kernels make one, with AVX2 where the CPU has it, and the compression
kernels give exactly the same bits (tests compare them byte for byte). They are optional: :func:`is_available` is
``False`` when no C compiler is found or the build fails, and the dispatcher in :mod:`lightning_onebit.kernels` then
uses the torch kernels. The functions run with the GIL released (ctypes does so for every foreign call).
"""

from __future__ import annotations

import ctypes
from typing import Optional, Sequence

import torch
from torch.autograd.graph import increment_version

from lightning_onebit.kernels.native import is_available, library
from lightning_onebit.kernels.segments import Segments
from lightning_onebit.kernels.torch_kernels import segment_scales



def supports(tensor: torch.Tensor) -> bool:
    """True for tensors these kernels take: float32 in CPU memory."""
    return tensor.device.type == "cpu" and tensor.dtype == torch.float32


def _lib() -> ctypes.CDLL:
    native = library()
    if native is None:
        raise RuntimeError(
            "the native CPU kernels are unavailable (no working C compiler, or LIGHTNING_ONEBIT_NATIVE=0); "
            "use kernel_backend='torch' or 'auto'"
        )
    return native


def _check(tensor: torch.Tensor, name: str, dtype: torch.dtype = torch.float32) -> None:
    if tensor.device.type != "cpu" or tensor.dtype != dtype or not tensor.is_contiguous():
        raise ValueError(f"{name}: the native CPU kernels need a contiguous {dtype} CPU tensor, got "
                         f"{tensor.dtype} on {tensor.device}")


def compress_in_place(
    y: torch.Tensor, segments: Segments, packed_out: Optional[torch.Tensor] = None
) -> tuple[torch.Tensor, torch.Tensor]:
    """Per segment ``scale = ||y_s|| / sqrt(len_s)``; ``packed = bits(y >= 0)``; ``y <- y - scale * sgn(y)``."""
    _check(y, "y")
    scales = segment_scales(y, segments)  # shared with the torch path, so the scales are the same bits
    if packed_out is None:
        packed_out = torch.empty(y.numel() // 8, dtype=torch.uint8)
    _check(packed_out, "packed_out", torch.uint8)
    if packed_out.numel() * 8 != y.numel() or segments.total != y.numel():
        raise ValueError(f"{y.numel()} elements need {y.numel() // 8} packed bytes and segments covering them, got "
                         f"{packed_out.numel()} bytes and segments of {segments.total}")
    _lib().onebit_pack_and_subtract(
        y.data_ptr(), y.numel(), segments.offsets_tensor(y.device).data_ptr(), scales.data_ptr(), packed_out.data_ptr()
    )
    return scales, packed_out


def decompress(
    packed: torch.Tensor, scales: torch.Tensor, segments: Segments, out: torch.Tensor, accumulate: bool = False
) -> torch.Tensor:
    """``out (+)= scale_s * sgn`` per segment; elements past ``segments.total`` are zeroed when not accumulating."""
    _check(out, "out")
    _check(packed, "packed", torch.uint8)
    scales = scales.to(torch.float32).contiguous()
    n = segments.total
    if packed.numel() * 8 != n or out.numel() < n or scales.numel() != len(segments):
        raise ValueError(f"decompress: {packed.numel()} bytes, {scales.numel()} scales and out of {out.numel()} "
                         f"elements do not fit segments of {n} elements in {len(segments)} segments")
    _lib().onebit_decode(
        packed.data_ptr(), n, segments.offsets_tensor(out.device).data_ptr(), scales.data_ptr(), out.data_ptr(),
        int(accumulate),
    )
    if not accumulate and n < out.numel():
        out[n:].zero_()
    return out


def add_mean_of_signs_(
    target: torch.Tensor, packed: Sequence[torch.Tensor], scales: Sequence[torch.Tensor], segments: Segments
) -> torch.Tensor:
    """``target += mean_j(scale_{j,s} * sgn_j)`` over the sources ``j`` (summed in order, then divided)."""
    _check(target, "target")
    scales = [s.to(torch.float32).contiguous() for s in scales]
    for p in packed:
        _check(p, "packed", torch.uint8)
    if not packed or len(packed) != len(scales) or target.numel() != segments.total:
        raise ValueError("add_mean_of_signs_: need one scale tensor per source and a target covering the segments")
    for p, sc in zip(packed, scales):
        if p.numel() * 8 != segments.total or sc.numel() != len(segments):
            raise ValueError(
                "add_mean_of_signs_: every source needs segments.total / 8 bytes and one scale per segment"
            )
    count = len(packed)
    packed_pointers = (ctypes.c_void_p * count)(*(p.data_ptr() for p in packed))
    scale_pointers = (ctypes.c_void_p * count)(*(s.data_ptr() for s in scales))
    _lib().onebit_add_mean_of_signs(
        target.data_ptr(), segments.total, segments.offsets_tensor(target.device).data_ptr(),
        packed_pointers, scale_pointers, count,
    )
    return target


def frozen_adam_update_(
    params: Sequence[torch.Tensor],
    exp_avgs: Sequence[torch.Tensor],
    exp_avg_sqs: Sequence[torch.Tensor],
    decay: Optional[float],
    bias_correction2_sqrt: float,
    eps: float,
    step: float,
    limit: Optional[float] = None,
) -> None:
    """``p <- p * decay`` (unless ``None``), then ``p <- p + (step * m) / d`` with
    ``d = sqrt(v) / bias_correction2_sqrt + eps``, or with ``limit`` ``p <- p + step * clip(m / d, -limit, limit)``.

    One pass per parameter. Every operation is correctly rounded IEEE float32 (numpy's float32 sequence gives the same
    bits), as is the torch path's (its square root is :func:`~lightning_onebit.kernels.native.sqrt_into`'s): without
    a limit the two give the same bits.
    """
    update = _lib().onebit_frozen_adam_update
    if not len(params) == len(exp_avgs) == len(exp_avg_sqs):
        raise ValueError(f"got {len(params)} params, {len(exp_avgs)} exp_avgs and {len(exp_avg_sqs)} exp_avg_sqs")
    for p, m, v in zip(params, exp_avgs, exp_avg_sqs):
        for tensor, name in ((p, "param"), (m, "exp_avg"), (v, "exp_avg_sq")):
            _check(tensor, name)
        if not p.numel() == m.numel() == v.numel():
            raise ValueError(f"param, exp_avg and exp_avg_sq differ in size: {p.numel()}, {m.numel()}, {v.numel()}")
    for p, m, v in zip(params, exp_avgs, exp_avg_sqs):
        update(
            p.data_ptr(), m.data_ptr(), v.data_ptr(), p.numel(), 1.0 if decay is None else decay, decay is not None,
            bias_correction2_sqrt, eps, step, 0.0 if limit is None else limit, limit is not None,
        )
        increment_version(p)  # as an in-place torch op would: autograd must see that p changed


def lamb_prepare_(
    exp_avgs: Sequence[torch.Tensor],
    scratch: Sequence[torch.Tensor],
    fresh: Sequence[torch.Tensor],
    roots: Sequence[torch.Tensor],
    denominators: Sequence[torch.Tensor],
    params: Sequence[torch.Tensor],
    betas: tuple[float, float],
    eps: float,
    bias_correction1: float,
    weight_decay: float,
    limit: Optional[float] = None,
) -> torch.Tensor:
    """1-bit LAMB's compression-stage first pass in one C pass per parameter (CPU float32; check with
    :func:`lightning_onebit.kernels.uses_native_update`). Per element, each a float32 IEEE operation, with ``m`` the
    averaged momentum and ``scratch`` holding the previous one::

        g = (b1 last - m) / -(1 - b1);   f = b2 f + (1 - b2) g g          (the fresh variance, in place)
        ratio = root / (sqrt(f) + eps)                                   (root: the frozen sqrt(v) + eps)
        u0 = (m / bias_correction1) / denominator   (then clipped to [-limit, limit], with a limit)
        u = u0 + weight_decay p;   scratch = u

    Returns a float64 ``(len(params), 3)`` CPU tensor: per parameter the largest ratio (NaN if any is), the sum of
    ``u0^2`` and the sum of ``u^2`` (accumulated in float64). The torch ops of
    :func:`~lightning_onebit.optim.functional.compressed_lamb_update_` compute the same quantities; the norms differ in
    their summation order, so the two can differ in the last bits (every rank runs the same backend, so replicas stay
    identical)."""
    prepare = _lib().onebit_lamb_prepare
    b1, b2 = betas
    out = torch.empty((len(params), 3), dtype=torch.float64)
    for k, tensors in enumerate(zip(exp_avgs, scratch, fresh, roots, denominators, params)):
        n = tensors[-1].numel()
        for tensor, name in zip(tensors, ("exp_avg", "scratch", "fresh variance", "root", "denominator", "param")):
            _check(tensor, name)
            if tensor.numel() != n:
                raise ValueError(f"lamb_prepare_: {name} has {tensor.numel()} elements, the parameter {n}")
        m, s, f, root, denominator, p = tensors
        prepare(m.data_ptr(), s.data_ptr(), f.data_ptr(), root.data_ptr(), denominator.data_ptr(), p.data_ptr(), n,
                b1, -(1 - b1), b2, 1 - b2, eps, bias_correction1, weight_decay, bool(weight_decay),
                0.0 if limit is None else limit, limit is not None, out[k].data_ptr())
        increment_version(s)
        increment_version(f)
    return out


def lamb_apply_(params: Sequence[torch.Tensor], updates: Sequence[torch.Tensor], steps: Sequence[float]) -> None:
    """``p <- p + step * u`` per parameter in one C pass (CPU float32; ``steps`` are Python floats, rounded to
    float32)."""
    apply = _lib().onebit_lamb_apply
    for p, u, step in zip(params, updates, steps):
        _check(p, "param")
        _check(u, "update")
        if p.numel() != u.numel():
            raise ValueError(f"lamb_apply_: param has {p.numel()} elements, update {u.numel()}")
        apply(p.data_ptr(), u.data_ptr(), p.numel(), step)
        increment_version(p)
