"""Reference sign-packing and compression kernels in pure torch (any device).

Bit layout: bit ``1`` means "non-negative" (``sgn(0) = +1``), packed most significant bit first, i.e. exactly the
bytes of ``numpy.packbits(x >= 0)``. Packing uses one 64-bit multiply per output byte: eight 0/1 bytes read as a
little-endian int64 word ``w`` are gathered into the top byte of ``w * 0x8040201008040201`` (the eight partial
products land on distinct bit positions, so no carries disturb the result).
"""

from __future__ import annotations

import sys
from typing import Callable, Optional, Sequence

import torch

from lightning_onebit.kernels.native import foreach_sqrt, sqrt_into
from lightning_onebit.kernels.segments import Segments
from lightning_onebit.kernels.workspace import Workspace

# 0x8040201008040201 as a two's-complement int64 (torch has no general uint64 arithmetic).
_GATHER_MAGIC = 0x8040201008040201 - (1 << 64)
# Spreads one byte over eight: byte k of (b * 0x0101010101010101) & _SPREAD_MASK keeps bit (7 - k) of b.
_SPREAD_MASK = 0x0102040810204080
_REPLICATE = 0x0101010101010101
_LITTLE_ENDIAN = sys.byteorder == "little"


def check_packable(x: torch.Tensor) -> None:
    if x.dim() != 1 or not x.is_contiguous():
        raise ValueError(f"expected a contiguous 1-D tensor, got shape {tuple(x.shape)}")
    if x.numel() % 8:
        raise ValueError(f"the number of elements ({x.numel()}) must be a multiple of 8; pad the buffer first")


def pack_bool(bits: torch.Tensor, out: Optional[torch.Tensor] = None) -> torch.Tensor:
    """Pack a 1-D bool tensor (length multiple of 8) into uint8, most significant bit first."""
    check_packable(bits)
    n_bytes = bits.numel() // 8
    if out is None:
        out = torch.empty(n_bytes, dtype=torch.uint8, device=bits.device)
    if n_bytes == 0:
        return out
    if _LITTLE_ENDIAN:
        words = bits.view(torch.uint8).view(torch.int64)
        gathered = torch.mul(words, _GATHER_MAGIC).bitwise_right_shift_(56)
        out.copy_(gathered)  # keeps the low byte (the top byte of the product, sign-extended)
    else:  # pragma: no cover - no big-endian machine in CI
        weights = torch.tensor([128, 64, 32, 16, 8, 4, 2, 1], dtype=torch.uint8, device=bits.device)
        torch.sum(bits.view(n_bytes, 8).to(torch.uint8) * weights, dim=1, dtype=torch.uint8, out=out)
    return out


def unpack_bool(packed: torch.Tensor, out: Optional[torch.Tensor] = None) -> torch.Tensor:
    """Inverse of :func:`pack_bool`: uint8 tensor of ``n`` bytes -> bool tensor of ``8 n`` elements."""
    if packed.dtype != torch.uint8 or packed.dim() != 1:
        raise ValueError(f"expected a 1-D uint8 tensor, got {packed.dtype} of shape {tuple(packed.shape)}")
    n_bytes = packed.numel()
    if out is None:
        out = torch.empty(8 * n_bytes, dtype=torch.bool, device=packed.device)
    if n_bytes == 0:
        return out
    if _LITTLE_ENDIAN:
        spread = packed.to(torch.int64).mul_(_REPLICATE).bitwise_and_(_SPREAD_MASK)
        torch.ne(spread.view(torch.uint8), 0, out=out)
    else:  # pragma: no cover
        shifts = torch.arange(7, -1, -1, dtype=torch.uint8, device=packed.device)
        torch.ne((packed.unsqueeze(1) >> shifts) & 1, 0, out=out.view(n_bytes, 8))
    return out


def pack_signs(x: torch.Tensor, out: Optional[torch.Tensor] = None) -> torch.Tensor:
    """Pack ``x >= 0`` into bytes (MSB first); ``x.numel()`` must be a multiple of 8."""
    check_packable(x)
    return pack_bool(torch.ge(x, 0), out=out)


_SIGN_TABLES: dict[tuple[torch.device, torch.dtype], torch.Tensor] = {}


def _sign_table(device: torch.device, dtype: torch.dtype) -> torch.Tensor:
    """``table[b]`` = the eight signs (+1/-1, MSB first) encoded by byte ``b``: a (256, 8) tensor."""
    key = (torch.device(device), dtype)
    table = _SIGN_TABLES.get(key)
    if table is None:
        bits = (torch.arange(256).unsqueeze(1) >> torch.arange(7, -1, -1)) & 1
        table = _SIGN_TABLES[key] = (bits * 2 - 1).to(device=device, dtype=dtype)
    return table


def unpack_signs_into(packed: torch.Tensor, out: torch.Tensor, workspace: Optional[Workspace] = None) -> torch.Tensor:
    """Write the +1/-1 signs encoded by ``packed`` into ``out`` (``8 * packed.numel()`` floating elements).

    One table lookup per byte (``index_select`` of a 256 x 8 table): a single pass writing ``out``.
    """
    if packed.dtype != torch.uint8 or packed.dim() != 1:
        raise ValueError(f"expected a 1-D uint8 tensor, got {packed.dtype} of shape {tuple(packed.shape)}")
    if out.numel() != 8 * packed.numel():
        raise ValueError(f"{packed.numel()} bytes hold {8 * packed.numel()} signs, but out has {out.numel()} elements")
    if packed.numel() == 0:
        return out
    ws = workspace or Workspace()
    index = ws.get("sign_index", packed.numel(), torch.int32, packed.device)
    index.copy_(packed)
    torch.index_select(_sign_table(out.device, out.dtype), 0, index, out=out.view(-1, 8))
    return out


def unpack_signs(packed: torch.Tensor, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """Unpack bytes to a tensor of +1/-1 in ``dtype`` (length ``8 * packed.numel()``)."""
    return unpack_signs_into(packed, torch.empty(8 * packed.numel(), dtype=dtype, device=packed.device))


PackFn = Callable[..., torch.Tensor]
SignsFn = Callable[..., torch.Tensor]


#: Accumulation dtype of the per-chunk norms, by device type. CUDA reads memory far slower than it adds doubles, so it
#: accumulates in float64 for free; that makes its scales the same bits as a float64 computation anywhere else (up to a
#: double-rounding tie, about one scale in 10^8). The CPU is compute-bound and accumulates in float32 (chunks of
#: NORM_CHUNK elements keep that accurate). Every rank runs one device type, so replicas agree either way.
NORM_ACCUMULATE_DTYPE: dict[str, torch.dtype] = {"cuda": torch.float64}


def segment_scales(y: torch.Tensor, segments: Segments) -> torch.Tensor:
    """``||y_s||_2 / sqrt(len_s)`` for every segment ``s`` of ``y``, in float32, with no host synchronisation.

    Norms of chunks of at most ``NORM_CHUNK`` elements (one multi-tensor kernel) are squared and summed per segment
    in float64 in a fixed pairwise order (:meth:`Segments.sum_per_segment`), which keeps the scale accurate for
    tensors of any size and the same bits on every run.
    """
    if not segments.bounds:
        return torch.empty(0, dtype=torch.float32, device=y.device)
    views = [y[a:b] for a, b in segments.chunk_bounds]
    # Accumulate in at least float32 but never narrow (torch refuses a float64 -> float32 norm dtype).
    norm_dtype = torch.promote_types(y.dtype, NORM_ACCUMULATE_DTYPE.get(y.device.type, torch.float32))
    norms = torch.stack(torch._foreach_norm(views, 2, dtype=norm_dtype)).to(torch.float64)
    sum_squares = segments.sum_per_segment(norms.square_())
    return sqrt_into(sum_squares, sum_squares).div_(segments.sqrt_lengths(y.device)).to(torch.float32)


def compress_in_place(
    y: torch.Tensor,
    segments: Segments,
    packed_out: Optional[torch.Tensor] = None,
    pack: PackFn = pack_bool,
    signs_into: SignsFn = unpack_signs_into,
    workspace: Optional[Workspace] = None,
    scales: Optional[torch.Tensor] = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """1-bit compression of ``y``, leaving the compression error in ``y``.

    Per segment ``scale = ||y_s|| / sqrt(len_s)`` (or the given float32 ``scales``); ``packed = bits(y >= 0)``;
    ``y <- y - scale * sgn(y)``. Returns ``(scales, packed)`` with float32 scales, one per segment. The signs
    subtracted are decoded from ``packed``, so the error is exactly consistent with what was sent. A fixed number of
    kernels whatever the number of segments, and no host synchronisation: ``scale * sgn`` is exact, so
    ``addcmul`` rounds once, like the per-segment ``sub_(signs, alpha=scale)`` it replaces (16-bit buffers compute in
    float32 and round once too).
    """
    ws = workspace or Workspace()
    if scales is None:
        scales = segment_scales(y, segments)
    bits = torch.ge(y, 0, out=ws.get("bits", y.numel(), torch.bool, y.device))
    packed = pack(bits, out=packed_out)
    signs = signs_into(packed, ws.get("signs", y.numel(), y.dtype, y.device), workspace=ws)
    y.addcmul_(signs, segments.expand(scales), value=-1)
    return scales, packed


def decompress(
    packed: torch.Tensor,
    scales: torch.Tensor,
    segments: Segments,
    out: torch.Tensor,
    accumulate: bool = False,
    signs_into: SignsFn = unpack_signs_into,
    workspace: Optional[Workspace] = None,
) -> torch.Tensor:
    """``out (+)= scale_s * sgn`` per segment, from packed sign bits and per-segment scales (no host
    synchronisation; each element rounds once, as with a per-segment ``add_(signs, alpha=scale)``)."""
    ws = workspace or Workspace()
    n = segments.total
    per_element = segments.expand(scales)
    if accumulate:
        signs = signs_into(packed, ws.get("signs", n, out.dtype, out.device), workspace=ws)
        out[:n].addcmul_(signs, per_element)
    else:
        signs_into(packed, out[:n], workspace=ws)
        out[:n].mul_(per_element)
        if n < out.numel():
            out[n:].zero_()
    return out


def add_mean_of_signs_(
    target: torch.Tensor,
    packed: Sequence[torch.Tensor],
    scales: Sequence[torch.Tensor],
    segments: Segments,
    signs_into: SignsFn = unpack_signs_into,
    workspace: Optional[Workspace] = None,
) -> torch.Tensor:
    """``target += (sum_j scale_{j,s} sgn_j) / J`` over ``J`` sources of packed signs sharing one segmentation.

    The sum runs over ``j = 0, 1, ...`` in order and is divided by ``J`` before it is added (the server phase of the
    compressed allreduce: the mean of the workers' compressed chunks, plus the server's error).
    """
    ws = workspace or Workspace()
    mean = ws.get("mean_of_signs", segments.total, target.dtype, target.device)
    for j, (p, s) in enumerate(zip(packed, scales)):
        decompress(p, s, segments, mean, accumulate=j > 0, signs_into=signs_into, workspace=ws)
    return target.add_(divide_(mean, len(packed)))


def divide_(x: torch.Tensor, divisor: int) -> torch.Tensor:
    """``x /= divisor``, each element the correctly rounded quotient, on every device. Returns ``x``.

    torch's CUDA kernels divide by a Python number as ``x * (1 / divisor)``: two roundings, one ulp off the quotient
    for some elements when ``divisor`` is not a power of two (a mean over 3 or 5 ranks on an H200 differed from the
    CPU's in 30-40% of its elements). A 0-dim tensor on ``x``'s device as the divisor takes CUDA's division kernel,
    which rounds once, as the CPU's does. ``torch.full`` makes it on the device: no copy from the host, no host
    synchronisation. Where ``x``'s dtype cannot hold every integer up to ``divisor`` exactly (``2 / eps``: 256 for
    bf16), the Python number is kept.
    """
    if x.device.type == "cpu" or divisor & (divisor - 1) == 0 or divisor > 2 / torch.finfo(x.dtype).eps:
        return x.div_(divisor)
    return x.div_(torch.full((), divisor, dtype=x.dtype, device=x.device))


def frozen_adam_update_(
    params: Sequence[torch.Tensor],
    exp_avgs: Sequence[torch.Tensor],
    exp_avg_sqs: Sequence[torch.Tensor],
    decay: Optional[float],
    bias_correction2_sqrt: float,
    eps: float,
    step: float,
    denominators: Optional[Sequence[torch.Tensor]] = None,
    limit: Optional[float] = None,
) -> None:
    """``p <- p * decay`` (unless ``None``), then ``p <- p + (step * m) / d`` with
    ``d = sqrt(v) / bias_correction2_sqrt + eps``, as the ``_foreach`` sequence of :class:`torch.optim.AdamW`.

    ``denominators``: ``d`` per tensor, already computed (by :func:`frozen_adam_denominators_into`, the same ops, so
    the same bits): a frozen variance's, cached. The update is then two passes (decay, ``addcdiv``) instead of five and
    allocates nothing.

    ``limit``: the update is ``p <- p + step * clip(m / d, -limit, limit)`` instead (the momentum itself is not
    changed), made run by run with one temporary ``m / d`` of at most :data:`CLIP_RUN_NUMEL` elements: five passes
    with ``denominators`` (decay, divide, two clamps, add), against two without the limit."""
    if decay is not None:
        torch._foreach_mul_(params, decay)
    if denominators is None:
        denominators = foreach_sqrt(exp_avg_sqs)
        torch._foreach_div_(denominators, bias_correction2_sqrt)
        torch._foreach_add_(denominators, eps)
    if limit is None:
        torch._foreach_addcdiv_(params, exp_avgs, denominators, value=step)
        return
    for run in _runs(params, CLIP_RUN_NUMEL):
        ratios = torch._foreach_div([exp_avgs[i] for i in run], [denominators[i] for i in run])
        torch._foreach_clamp_min_(ratios, -limit)  # clamp keeps NaN, as the C kernel's ordered compares do
        torch._foreach_clamp_max_(ratios, limit)
        torch._foreach_add_([params[i] for i in run], ratios, alpha=step)


#: The clipped update of :func:`frozen_adam_update_` makes its temporary for runs of tensors of at most this many
#: elements (a larger tensor alone): 64 MiB in float32.
CLIP_RUN_NUMEL = 2**24


def _runs(tensors: Sequence[torch.Tensor], limit: int) -> list[list[int]]:
    """Indices into ``tensors`` in consecutive runs of at most ``limit`` elements (a larger tensor alone), each run on
    one device (the ``_foreach`` ops take one device per call)."""
    out: list[list[int]] = []
    size = 0
    for i, t in enumerate(tensors):
        if not out or size + t.numel() > limit or t.device != tensors[out[-1][0]].device:
            out.append([])
            size = 0
        out[-1].append(i)
        size += t.numel()
    return out


def frozen_adam_denominators_into(
    v: torch.Tensor, out: torch.Tensor, bias_correction2_sqrt: float, eps: float
) -> torch.Tensor:
    """``out = sqrt(v) / bias_correction2_sqrt + eps``: the ops of :func:`frozen_adam_update_`'s denominator, one
    tensor, written into ``out`` (no temporary)."""
    sqrt_into(v, out)
    out.div_(bias_correction2_sqrt)
    return out.add_(eps)
