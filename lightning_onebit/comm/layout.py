"""How a bucket is laid out on the wire: :class:`BucketLayout`, the padding, chunks and scale segments of a flat
buffer for ``P`` ranks and the size of one wire block (``S_max`` float32 scales, ``_SCALE_BYTES`` each, then the
packed signs). Pure and deterministic: every rank derives the same layout from the same inputs.
"""

from __future__ import annotations

import dataclasses
from typing import Sequence

from lightning_onebit.comm.accounting import ring_allreduce_bytes
from lightning_onebit.kernels import Segments

_SCALE_BYTES = 4  # scales travel as float32


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
