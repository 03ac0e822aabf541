"""Error-compensated two-phase 1-bit compressed allreduce over ``torch.distributed``.

The algorithm (1-bit Adam, arXiv 2102.02888) averages a flat buffer ``x`` of ``N`` elements over ``P`` ranks while
sending about one bit per element each way. The buffer is zero-padded to ``N_pad`` (a multiple of ``8 P``) and cut
into ``P`` chunks of ``c = N_pad / P`` elements; rank ``r`` is the *server* of chunk ``r``.

1. Worker: ``y = x + e_w``; per segment ``s_w = ||y|| / sqrt(n)``; ``e_w <- y - s_w sgn(y)``; pack ``sgn(y)``.
2. ``all_to_all``: rank ``r`` receives every rank's packed chunk ``r`` together with the worker scales of the
   segments in that chunk.
3. Server: ``z = mean_j(s_w_j sgn_j) + e_s``; per segment ``s_s = ||z|| / sqrt(n)``; ``e_s <- z - s_s sgn(z)``.
4. ``all_gather`` of every server's packed chunk and scales; the result ``concat_j(s_s_j sgn_j)`` is identical on
   every rank, so replicas that apply it stay bit-identical.

Scales are kept per *segment*: the buffer's tensors cut at chunk boundaries. A bucket of many parameters therefore
keeps one scale per parameter (DeepSpeed's fused 1-bit LAMB needed extra rescaling because one scale covered tensors
of very different magnitude), and still costs exactly **two collectives per call however many parameters it holds**
(DeepSpeed's 1-bit Adam issued four per parameter). Scales travel in the same byte blocks as the signs.

Error state per bucket and rank: ``e_w`` (``N_pad`` elements) and ``e_s`` (``c`` elements), in the buffer's dtype.

Bytes per rank and call, counted as each rank's payload on the wire: the all_to_all sends and receives
``(P-1) B_1`` and the all_gather ``(P-1) B_2``, with blocks ``B = c/8 + 4 S_max`` (``S_max`` = most segments in one
chunk). An fp32 ring allreduce of the same ``N`` elements sends ``2 (P-1)/P * 4 N``: the compressed call is ~32x
lighter. With ``P = 1`` nothing is communicated and the buffer is left exactly as it is (the mean over one rank).

:func:`compressed_allreduce_buckets_` runs several buckets at once with asynchronous collectives, so that one
bucket's transfer overlaps another's compression; :func:`compressed_allreduce_` is the one-bucket case.
"""

from __future__ import annotations

import dataclasses
import math
import time
from typing import Any, Hashable, Optional, Sequence

import torch
import torch.distributed as dist

from lightning_onebit import kernels
from lightning_onebit.kernels import Backend, Segments

_SCALE_BYTES = 4  # scales travel as float32


def ring_allreduce_bytes(numel: int, element_size: int, world_size: int) -> int:
    """Bytes one rank sends (and receives) in a ring allreduce of ``numel`` elements: ``2 (P-1)/P * numel * size``."""
    if world_size <= 1:
        return 0
    return (2 * (world_size - 1) * numel * element_size) // world_size


@dataclasses.dataclass
class CommunicationCounters:
    """Cumulative communication of one rank. All byte counts are payload bytes of this rank.

    Attributes:
        bytes_sent: bytes this rank put on the wire.
        bytes_received: bytes this rank received.
        bytes_fp32_equivalent: bytes an fp32 ring allreduce of the same data would have sent from this rank.
        collectives: number of collective operations issued.
        calls: number of allreduce calls (one per bucket per step).
        time_s: wall-clock seconds spent inside the calls (compression included; host time on CUDA).
    """

    bytes_sent: int = 0
    bytes_received: int = 0
    bytes_fp32_equivalent: int = 0
    collectives: int = 0
    calls: int = 0
    time_s: float = 0.0

    def snapshot(self) -> "CommunicationCounters":
        return dataclasses.replace(self)

    def __sub__(self, other: "CommunicationCounters") -> "CommunicationCounters":
        return CommunicationCounters(
            *(getattr(self, f.name) - getattr(other, f.name) for f in dataclasses.fields(self))
        )

    def __add__(self, other: "CommunicationCounters") -> "CommunicationCounters":
        return CommunicationCounters(
            *(getattr(self, f.name) + getattr(other, f.name) for f in dataclasses.fields(self))
        )

    def reset(self) -> None:
        for f in dataclasses.fields(self):
            setattr(self, f.name, f.default)


@dataclasses.dataclass(frozen=True)
class BucketLayout:
    """How a flat buffer made of tensors of ``tensor_numels`` elements is padded, chunked and segmented for ``P`` ranks.

    Pure and deterministic: every rank derives the same layout from the same inputs.

    Attributes:
        tensor_numels: element count of each tensor in the buffer, in order.
        world_size: ``P``.
        numel: ``N``, the real elements (sum of ``tensor_numels``).
        padded_numel: ``N_pad``, ``N`` rounded up to a multiple of ``8 P``.
        chunk_numel: ``c = N_pad / P``, the elements each rank serves.
        segments: the scale segments of the padded buffer: tensor boundaries, chunk boundaries and the padding.
        chunk_segments: per chunk, its segments with offsets relative to the chunk start.
        max_chunk_segments: ``S_max``, the most segments in one chunk (scales are padded to this on the wire).
    """

    tensor_numels: tuple[int, ...]
    world_size: int
    numel: int
    padded_numel: int
    chunk_numel: int
    segments: Segments
    chunk_segments: tuple[Segments, ...]
    max_chunk_segments: int

    @classmethod
    def build(cls, tensor_numels: Sequence[int], world_size: int) -> "BucketLayout":
        tensor_numels = tuple(int(n) for n in tensor_numels)
        if world_size < 1:
            raise ValueError(f"world_size must be >= 1, got {world_size}")
        if any(n < 0 for n in tensor_numels):
            raise ValueError("tensor sizes must be non-negative")
        numel = sum(tensor_numels)
        if numel == 0:
            raise ValueError("a bucket needs at least one element")
        quantum = 8 * world_size
        padded = -(-numel // quantum) * quantum
        chunk = padded // world_size
        cuts = {0, padded, numel}
        offset = 0
        for n in tensor_numels:
            offset += n
            cuts.add(offset)
        cuts.update(range(0, padded, chunk))
        offsets = sorted(cuts)
        chunk_segments = []
        for r in range(world_size):
            lo, hi = r * chunk, (r + 1) * chunk
            chunk_segments.append(Segments([o - lo for o in offsets if lo <= o <= hi]))
        return cls(
            tensor_numels=tensor_numels,
            world_size=world_size,
            numel=numel,
            padded_numel=padded,
            chunk_numel=chunk,
            segments=Segments(offsets),
            chunk_segments=tuple(chunk_segments),
            max_chunk_segments=max(len(s) for s in chunk_segments),
        )

    @property
    def block_bytes(self) -> int:
        """Bytes of one wire block: ``S_max`` float32 scales followed by ``c / 8`` packed sign bytes."""
        return _SCALE_BYTES * self.max_chunk_segments + self.chunk_numel // 8

    def bytes_per_call(self) -> int:
        """Bytes one rank sends (and, equally, receives) per compressed allreduce of this layout."""
        if self.world_size == 1:
            return 0
        return 2 * (self.world_size - 1) * self.block_bytes

    def fp32_equivalent_bytes(self) -> int:
        """Bytes one rank would send in an fp32 ring allreduce of the ``N`` real elements."""
        return ring_allreduce_bytes(self.numel, 4, self.world_size)


class _BucketBuffers:
    """Error feedback and reusable workspaces of one bucket on one rank."""

    def __init__(self, layout: BucketLayout, like: torch.Tensor) -> None:
        device, dtype = like.device, like.dtype
        c, blocks = layout.chunk_numel, layout.block_bytes * layout.world_size
        self.layout = layout
        self.worker_error = torch.zeros(layout.padded_numel, dtype=dtype, device=device)
        self.server_error = torch.zeros(c, dtype=dtype, device=device)
        self.send = torch.zeros(blocks, dtype=torch.uint8, device=device)
        self.recv = torch.empty(blocks, dtype=torch.uint8, device=device)
        self.gather_send = torch.zeros(layout.block_bytes, dtype=torch.uint8, device=device)
        self.gather_recv = torch.empty(blocks, dtype=torch.uint8, device=device)


class CompressedAllreduceState:
    """Everything the compressed allreduce keeps between calls, for one process group.

    Holds, per bucket key, the worker and server error-feedback buffers (created as zeros on first use) and reusable
    communication workspaces, plus cumulative :class:`CommunicationCounters`. Modelled on PyTorch's ``PowerSGDState``:
    a state object plus the pure function :func:`compressed_allreduce_`.

    Args:
        process_group: group to average over; ``None`` means the default (WORLD) group. Resolved at call time, so the
            state may be built before ``torch.distributed`` is initialised.
        backend: kernel backend, see :mod:`lightning_onebit.kernels`.
    """

    def __init__(self, process_group: Optional[dist.ProcessGroup] = None, backend: Backend = "auto") -> None:
        self.process_group = process_group
        self.backend = backend
        self.counters = CommunicationCounters()
        self._buckets: dict[Hashable, _BucketBuffers] = {}
        # Scratch memory for the kernels, shared by all buckets (they are reduced one after another): it is sized
        # for the largest bucket instead of growing with their number.
        self.workspace = kernels.Workspace()

    # ------------------------------------------------------------------ group
    def world_size(self) -> int:
        if not (dist.is_available() and dist.is_initialized()):
            return 1
        return dist.get_world_size(self.process_group)

    def rank(self) -> int:
        if not (dist.is_available() and dist.is_initialized()):
            return 0
        return dist.get_rank(self.process_group)

    # ------------------------------------------------------------------ error feedback
    def buffers(self, key: Hashable, layout: BucketLayout, like: torch.Tensor) -> _BucketBuffers:
        """The bucket's buffers, (re)created as zeros when new or when the layout, dtype or device changed."""
        buffers = self._buckets.get(key)
        if (
            buffers is None
            or buffers.layout != layout
            or buffers.worker_error.dtype != like.dtype
            or buffers.worker_error.device != like.device
        ):
            buffers = self._buckets[key] = _BucketBuffers(layout, like)
        return buffers

    def error_feedback_norm(self) -> float:
        """L2 norm of all error-feedback buffers of this rank (worker and server)."""
        total = 0.0
        for b in self._buckets.values():
            total += float(b.worker_error.float().square().sum()) + float(b.server_error.float().square().sum())
        return math.sqrt(total)

    def reset_error_feedback(self) -> float:
        """Drop all error-feedback buffers (they restart from zero); returns the norm that was dropped."""
        norm = self.error_feedback_norm()
        self._buckets.clear()
        return norm

    def error_feedback_state_dict(self) -> dict[str, Any]:
        """This rank's error-feedback buffers with the layouts they belong to (for per-rank checkpoints)."""
        return {
            "world_size": self.world_size(),
            "buckets": {
                key: {
                    "layout": (b.layout.tensor_numels, b.layout.world_size),
                    "worker_error": b.worker_error.detach().clone(),
                    "server_error": b.server_error.detach().clone(),
                }
                for key, b in self._buckets.items()
            },
        }

    def load_error_feedback_state_dict(self, state: dict[str, Any], layouts: dict[Hashable, BucketLayout]) -> None:
        """Restore buffers saved by :meth:`error_feedback_state_dict`.

        ``layouts`` maps each bucket key to the layout in use now. Raises ``ValueError`` (and changes nothing) unless
        the saved buckets and layouts match exactly, so a caller can fall back to a reset with a reason.
        """
        saved = state["buckets"]
        if set(saved) != set(layouts):
            raise ValueError(f"saved buckets {sorted(map(str, saved))} differ from current {sorted(map(str, layouts))}")
        for key, layout in layouts.items():
            if tuple(saved[key]["layout"]) != (layout.tensor_numels, layout.world_size):
                raise ValueError(f"bucket {key!r}: saved layout differs from the current one")
        for key, layout in layouts.items():
            entry = saved[key]
            buffers = self.buffers(key, layout, entry["worker_error"])
            buffers.worker_error.copy_(entry["worker_error"])
            buffers.server_error.copy_(entry["server_error"])


def _all_gather(output: torch.Tensor, input: torch.Tensor, group: Optional[dist.ProcessGroup]) -> dist.Work:
    # torch 2.13 renamed all_gather_into_tensor to all_gather_single (the old name warns).
    gather = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
    return gather(output, input, group=group, async_op=True)


def _write_scales(block: torch.Tensor, scales: torch.Tensor) -> None:
    # A wire block is S_max float32 scales (unused tail left as is) followed by the packed signs, written in place.
    block[: _SCALE_BYTES * scales.numel()].copy_(scales.view(torch.uint8))


def _read_block(block: torch.Tensor, n_scales: int, n_scales_max: int) -> tuple[torch.Tensor, torch.Tensor]:
    # The clone realigns the scale bytes so they can be viewed as float32.
    scales = block[: _SCALE_BYTES * n_scales].clone().view(torch.float32)
    return scales, block[_SCALE_BYTES * n_scales_max :]


def compressed_allreduce_(
    state: CompressedAllreduceState, key: Hashable, buffer: torch.Tensor, layout: BucketLayout
) -> torch.Tensor:
    """Replace ``buffer`` by the error-compensated 1-bit average of ``buffer`` over the state's process group.

    Args:
        state: the :class:`CompressedAllreduceState` holding this bucket's error feedback and counters.
        key: identifies the bucket across calls (its error feedback belongs to it); any hashable.
        buffer: 1-D contiguous floating tensor of ``layout.padded_numel`` elements, modified in place. Elements past
            ``layout.numel`` must be zero; they stay zero.
        layout: from :meth:`BucketLayout.build` with this group's world size.

    Returns:
        ``buffer``, now holding the same values on every rank.
    """
    compressed_allreduce_buckets_(state, [(key, buffer, layout)])
    return buffer


def compressed_allreduce_buckets_(
    state: CompressedAllreduceState, buckets: Sequence[tuple[Hashable, torch.Tensor, BucketLayout]]
) -> None:
    """:func:`compressed_allreduce_` of several buckets, pipelined: one bucket's transfer overlaps another's compression.

    Every collective is asynchronous. All buckets are compressed and their ``all_to_all`` launched first (the transfer
    of bucket ``k`` runs while bucket ``k + 1`` is compressed); then, bucket by bucket, the server phase waits for its
    ``all_to_all`` and launches its ``all_gather``; finally each bucket waits for its ``all_gather`` and decodes. Still
    two collectives per bucket, issued in the same order on every rank. All arguments are checked before the first
    collective, so a bad bucket raises on every rank instead of leaving the others waiting.

    Args:
        state: as for :func:`compressed_allreduce_`.
        buckets: ``(key, buffer, layout)`` triples, each as for :func:`compressed_allreduce_`; keys must differ.
    """
    world_size = state.world_size()
    keys = set()
    for key, buffer, layout in buckets:
        if key in keys:
            raise ValueError(f"bucket key {key!r} appears twice")
        keys.add(key)
        if layout.world_size != world_size:
            raise ValueError(f"layout was built for {layout.world_size} ranks but the process group has {world_size}")
        if buffer.dim() != 1 or not buffer.is_contiguous() or buffer.numel() != layout.padded_numel:
            raise ValueError(
                f"buffer must be 1-D contiguous with {layout.padded_numel} elements, got {tuple(buffer.shape)}"
            )
        if not buffer.is_floating_point():
            raise ValueError(f"buffer must be floating point, got {buffer.dtype}")
    if world_size == 1 or not buckets:
        return

    started = time.perf_counter()
    group, backend, workspace = state.process_group, state.backend, state.workspace
    rank = state.rank()
    bucket_buffers = [state.buffers(key, layout, buffer) for key, buffer, layout in buckets]

    # Phase 1 (worker): compress x + e_w; chunk r's signs and scales go to rank r.
    exchanges = []
    for (_, buffer, layout), bufs in zip(buckets, bucket_buffers):
        c, s_max, block = layout.chunk_numel, layout.max_chunk_segments, layout.block_bytes
        # chunk r is compressed straight into its all_to_all block (segments never cross a chunk boundary)
        for r, chunk_segments in enumerate(layout.chunk_segments):
            chunk, send = slice(r * c, (r + 1) * c), bufs.send[r * block : (r + 1) * block]
            scales, _ = kernels.compress_with_error_feedback(
                buffer[chunk],
                bufs.worker_error[chunk],
                chunk_segments,
                packed_out=send[_SCALE_BYTES * s_max :],
                backend=backend,
                workspace=workspace,
            )
            _write_scales(send, scales)
        exchanges.append(dist.all_to_all_single(bufs.recv, bufs.send, group=group, async_op=True))

    # Phase 2 (server of chunk `rank`): e_s += mean of the P decompressed chunks; compress e_s; all_gather.
    gathers = []
    for (_, buffer, layout), bufs, exchange in zip(buckets, bucket_buffers, exchanges):
        s_max, block = layout.max_chunk_segments, layout.block_bytes
        own_segments = layout.chunk_segments[rank]
        exchange.wait()
        blocks = [_read_block(bufs.recv[j * block : (j + 1) * block], len(own_segments), s_max) for j in range(world_size)]
        kernels.add_mean_of_signs_(
            bufs.server_error,
            [signs for _, signs in blocks],
            [scales for scales, _ in blocks],
            own_segments,
            backend=backend,
            workspace=workspace,
        )
        # the server's signs are packed straight into its all_gather block, behind the scales
        server_scales, _ = kernels.compress_in_place(
            bufs.server_error,
            own_segments,
            packed_out=bufs.gather_send[_SCALE_BYTES * s_max :],
            backend=backend,
            workspace=workspace,
        )
        _write_scales(bufs.gather_send, server_scales)
        gathers.append(_all_gather(bufs.gather_recv, bufs.gather_send, group))

    # Every rank rebuilds the full result from all servers' chunks.
    for (_, buffer, layout), bufs, gather in zip(buckets, bucket_buffers, gathers):
        c, s_max, block = layout.chunk_numel, layout.max_chunk_segments, layout.block_bytes
        gather.wait()
        for j, chunk_segments in enumerate(layout.chunk_segments):
            scales, signs = _read_block(bufs.gather_recv[j * block : (j + 1) * block], len(chunk_segments), s_max)
            kernels.decompress(
                signs, scales, chunk_segments, buffer[j * c : (j + 1) * c], backend=backend, workspace=workspace
            )

    counters = state.counters
    for _, _, layout in buckets:
        counters.bytes_sent += layout.bytes_per_call()
        counters.bytes_received += layout.bytes_per_call()
        counters.bytes_fp32_equivalent += layout.fp32_equivalent_bytes()
        counters.collectives += 2
        counters.calls += 1
    counters.time_s += time.perf_counter() - started
