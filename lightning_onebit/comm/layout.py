"""How a bucket is laid out on the wire: :class:`BucketLayout`, the padding, chunks and scale segments of a flat
buffer for ``P`` ranks, the size of one wire block (``S_max`` float32 scales, :data:`SCALE_BYTES` each, then the
packed signs) and the bytes one exchange of it sends (:meth:`BucketLayout.bytes_sent`). Pure and deterministic: every
rank derives the same layout from the same inputs.
"""

from __future__ import annotations

import dataclasses
from typing import Optional, Sequence

from lightning_onebit.comm.accounting import flat_two_phase_bytes, ring_allreduce_bytes
from lightning_onebit.comm.topology import Topology
from lightning_onebit.kernels import Segments

#: Bytes of one scale on the wire (scales travel as float32).
SCALE_BYTES = 4


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
        return SCALE_BYTES * self.max_chunk_segments + self.chunk_numel // 8

    def bytes_per_call(self) -> int:
        """Bytes one rank sends (and, equally, receives) per compressed allreduce of this layout."""
        if self.world_size == 1:
            return 0
        return 2 * (self.world_size - 1) * self.block_bytes

    def fp32_equivalent_bytes(self) -> int:
        """Bytes one rank would send in an fp32 ring allreduce of the ``N`` real elements."""
        return ring_allreduce_bytes(self.numel, 4, self.world_size)

    def bytes_sent(self, element_size: int, topology: Optional[Topology], rank: int) -> tuple[int, int]:
        """Payload bytes one compressed exchange of this layout sends from ``rank`` to ranks on its own node and to
        other nodes (``element_size``: bytes per element of the buffer).

        Flat: the ``all_to_all`` sends one block to every peer; gloo's and NCCL's ``all_gather`` are rings that send
        ``P - 1`` blocks to the next group rank. Hierarchical: the intra-node reduce-scatter sends ``L - 1`` shards in
        the buffer's dtype and the intra-node gather ``(L - 1) M`` blocks; the inter-node ``all_to_all`` and
        ``all_gather`` send ``M - 1`` blocks each. Without a topology every peer counts as another node.
        """
        block, world_size = self.block_bytes, self.world_size
        if topology is not None and topology.is_hierarchical:
            nodes, per_node = topology.num_nodes, topology.ranks_per_node
            shard_bytes = self.padded_numel // per_node * element_size
            intra = (per_node - 1) * shard_bytes + (per_node - 1) * nodes * block
            return intra, 2 * (nodes - 1) * block
        return flat_two_phase_bytes(block, world_size, topology, rank)
