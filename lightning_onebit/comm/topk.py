"""Chunked top-k with 2-bit values (SparseLoCo's compression of the outer pseudo-gradient): the codec, pure and
deterministic, with no communication. :class:`~lightning_onebit.comm.outer.TopkAverage` exchanges its payloads.

A flat buffer of ``n`` values (``n`` a multiple of the chunk length ``C``) is cut into ``n / C`` chunks. In each
chunk the ``k`` values of largest magnitude are kept (their chunk-local indices, sorted ascending, as int16: ``C`` is
at most 32,768) and each is sent in 2 bits: a sign bit and a magnitude bit that picks one of two levels of its chunk,

    ``lo + (hi - lo) / 4``  and  ``lo + 3 (hi - lo) / 4``,

where ``lo`` and ``hi`` are the smallest and largest kept magnitude of the chunk: the midpoints of the lower and
upper half of ``[lo, hi]``, the magnitude bit being whether ``|v| >= (lo + hi) / 2`` (the nearer level). So the four
values a kept element can take are ``+-level_0`` and ``+-level_1``; both levels travel as float32, two per chunk.
A chunk whose kept values have one magnitude is sent exactly; a zero value is sent as ``+level_0``.

Payload of one buffer (bytes): ``8 m`` (levels) ``+ 2 m k`` (indices) ``+ ceil(m k / 4)`` (codes, four per byte),
the whole padded to a multiple of 4 so that every field of every rank's payload stays aligned in a gathered buffer
(``m = n / C`` chunks): :func:`topk_payload_bytes`.
"""

from __future__ import annotations

import torch

#: Largest chunk: indices travel as int16.
MAX_CHUNK = 32768
_LEVEL_BYTES = 4
_INDEX_BYTES = 2


def topk_payload_bytes(numel: int, chunk: int, keep: int) -> int:
    """Bytes of the payload of one buffer of ``numel`` values (a multiple of ``chunk``), ``keep`` values per chunk."""
    if numel % chunk:
        raise ValueError(f"a top-k buffer must hold a multiple of the chunk ({chunk}) values, got {numel}")
    chunks = numel // chunk
    codes = -(-chunks * keep // 4)
    raw = _LEVEL_BYTES * 2 * chunks + _INDEX_BYTES * chunks * keep + codes
    return -(-raw // 4) * 4


def _fields(payload: torch.Tensor, chunks: int, keep: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The levels (float32, ``chunks x 2``), indices (int16, ``chunks x keep``) and packed codes of a payload."""
    levels_end = _LEVEL_BYTES * 2 * chunks
    index_end = levels_end + _INDEX_BYTES * chunks * keep
    levels = payload[:levels_end].view(torch.float32).view(chunks, 2)
    indices = payload[levels_end:index_end].view(torch.int16).view(chunks, keep)
    codes = payload[index_end : index_end + -(-chunks * keep // 4)]
    return levels, indices, codes


def _quantized(levels: torch.Tensor, codes: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """The values ``codes`` (0..3 per kept element: bit 1 the sign, bit 0 the level) stand for, ``chunks x keep``."""
    magnitude = levels.gather(1, (codes & 1).long()).to(dtype)
    return torch.where(codes >= 2, -magnitude, magnitude)


def topk_encode(
    values: torch.Tensor, chunk: int, keep: int, payload: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """Encode ``values`` (1-D, a multiple of ``chunk`` long) into ``payload`` (uint8, :func:`topk_payload_bytes`
    long; its alignment padding is zeroed).

    Returns ``(indices, sent)``: the kept chunk-local indices (int64, ``chunks x keep``) and the values the payload
    stands for there (``values``' dtype), so that the caller can keep the residual ``values - sent`` as error
    feedback. Deterministic: the same input gives the same bytes on every rank.
    """
    chunks = values.numel() // chunk
    table = values.view(chunks, chunk)
    indices = table.abs().topk(keep, dim=1, sorted=False).indices.sort(dim=1).values
    kept = table.gather(1, indices)
    magnitude = kept.abs().float()
    lo, hi = magnitude.amin(dim=1, keepdim=True), magnitude.amax(dim=1, keepdim=True)
    spread = hi - lo
    levels_out, indices_out, codes_out = _fields(payload, chunks, keep)
    torch.cat([lo + spread * 0.25, lo + spread * 0.75], dim=1, out=levels_out)
    indices_out.copy_(indices)
    codes = (kept < 0).to(torch.uint8) * 2 + (magnitude >= (lo + hi) * 0.5).to(torch.uint8)
    flat = torch.zeros(-(-codes.numel() // 4) * 4, dtype=torch.uint8, device=values.device)
    flat[: codes.numel()] = codes.reshape(-1)
    quads = flat.view(-1, 4)
    codes_out.copy_(quads[:, 0] | (quads[:, 1] << 2) | (quads[:, 2] << 4) | (quads[:, 3] << 6))
    end = _LEVEL_BYTES * 2 * chunks + _INDEX_BYTES * chunks * keep + codes_out.numel()
    payload[end:].zero_()
    return indices, _quantized(levels_out, codes, values.dtype)


def topk_decode_add_(out: torch.Tensor, payload: torch.Tensor, chunk: int, keep: int) -> None:
    """Add the values ``payload`` stands for into ``out`` (1-D, as long as the encoded buffer): one ``scatter_add_``
    per call, each index of a payload once, so the result does not depend on the order of the additions inside it."""
    chunks = out.numel() // chunk
    levels, indices, packed = _fields(payload, chunks, keep)
    codes = torch.stack([(packed >> shift) & 3 for shift in (0, 2, 4, 6)], dim=1).reshape(-1)[: chunks * keep]
    values = _quantized(levels, codes.view(chunks, keep), out.dtype)
    out.view(chunks, chunk).scatter_add_(1, indices.long(), values)
