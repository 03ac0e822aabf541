"""Byte accounting of the comm layer: what each exchange puts on the wire, counted per rank.

* :class:`CommunicationCounters`: one rank's cumulative bytes (split into intra- and inter-node bytes), collectives,
  calls and times;
* :func:`ring_allreduce_bytes` and :func:`bytes_leaving_node`: the formulas (a ring allreduce per rank; the bytes that
  leave one node per step for the fp32 ring, the flat and the hierarchical 1-bit exchange);
* :func:`flat_two_phase_bytes`: what a flat two-phase exchange of blocks (``all_to_all``, then a ring ``all_gather``)
  sends to the node and beyond it (the 1-bit exchange's and the int8 hook's);
* :func:`count_ring_allreduce` (one ring allreduce, also used by the DDP hooks) and :func:`count_ring_all_gather` (one
  ring all-gather, e.g. the outer step's inside a replica): how a call is added to the counters; :func:`add_traffic`,
  a hook's own counts added to another's.

A compressed exchange's bytes follow from its bucket's layout (:meth:`~lightning_onebit.comm.BucketLayout.bytes_sent`)
and are counted by its state (:meth:`~lightning_onebit.comm.CompressedAllreduceState.count_call`).
"""

from __future__ import annotations

import dataclasses
from typing import Optional

import torch

from lightning_onebit.comm.topology import Topology


def ring_allreduce_bytes(numel: int, element_size: int, world_size: int) -> int:
    """Bytes one rank sends (and receives) in a ring allreduce of ``numel`` elements: ``2 (P-1)/P * numel * size``."""
    if world_size <= 1:
        return 0
    return (2 * (world_size - 1) * numel * element_size) // world_size


def bytes_leaving_node(numel: int, num_nodes: int, ranks_per_node: int, exchange: str) -> float:
    """Payload bytes that leave one node per step to average ``numel`` fp32 elements over ``num_nodes`` x
    ``ranks_per_node`` ranks, by formula (ring and two-phase byte counts; scales and padding ignored, ranks numbered
    node by node so that a ring crosses each node boundary once).

    ``exchange``:

    * ``"fp32_ring"``: DDP's fp32 ring allreduce, ``2 (P-1)/P 4N``;
    * ``"flat"``: the flat 1-bit exchange, all_to_all ``L (P-L) N / (8P)`` plus ring all_gather ``(P-1) N / (8P)``;
    * ``"hierarchical"``: the hierarchical 1-bit exchange, ``2 (M-1)/M N/8``.
    """
    m, l = num_nodes, ranks_per_node
    p = m * l
    if m < 1 or l < 1:
        raise ValueError(f"need at least one node of one rank, got {m} x {l}")
    if exchange == "fp32_ring":
        return 2 * (p - 1) / p * 4 * numel if m > 1 else 0.0
    if exchange == "flat":
        return (l * (p - l) + (p - 1 if m > 1 else 0)) * numel / (8 * p)
    if exchange == "hierarchical":
        return 2 * (m - 1) / m * numel / 8
    raise ValueError(f"exchange must be 'fp32_ring', 'flat' or 'hierarchical', got {exchange!r}")


@dataclasses.dataclass
class CommunicationCounters:
    """Cumulative communication of one rank. All byte counts are payload bytes of this rank.

    Attributes:
        bytes_sent: bytes this rank put on the wire.
        bytes_received: bytes this rank received.
        bytes_sent_intra_node: the part of ``bytes_sent`` that went to ranks on this rank's node.
        bytes_sent_inter_node: the part of ``bytes_sent`` that crossed to other nodes (the slow link). Without a
            :class:`~lightning_onebit.Topology` every peer counts as another node.
        bytes_fp32_equivalent: bytes an fp32 ring allreduce of the same data would have sent from this rank.
        bytes_sent_uncompressed: the part of ``bytes_sent`` (and of ``bytes_received``) that averaged gradients of
            param groups with ``compress=False`` in full precision (:func:`full_precision_allreduce_`), counted as a
            ring allreduce in the gradients' dtype; also in ``bytes_fp32_equivalent`` (an fp32 allreduce of fp32
            data costs exactly itself) and split into intra- and inter-node bytes like the rest.
        collectives: number of collective operations issued.
        calls: number of allreduce calls (one per bucket per step, plus one per device and dtype of the
            full-precision allreduce of ``compress=False`` groups).
        time_s: seconds spent inside the calls (compression included).
        exposed_s: the exchange time *not* hidden behind backward, seconds. Compressed exchange: the time the
            optimizer step spent on it after backward (starting buckets that were not started during backward,
            waiting, decoding). DDP's warmup allreduce (:class:`~lightning_onebit.GradientSyncState`): per backward,
            from the launch of the last gradient bucket's allreduce to the completion of every allreduce.
        hook_s: seconds spent during backward, inside DDP's hooks, folding gradients into momenta, compressing and
            launching (the overlapped exchange; 0 without it).

    Times are host wall-clock seconds off CUDA. On CUDA they are device times between CUDA events recorded on the
    stream that runs the work (the hooks' side stream, the optimizer step's stream), read back lazily: a figure
    counts once its end event has completed (``settle_timings`` of the owning state; the optimizer's
    ``communication`` and the strategy's do it), typically a step later.
    """

    bytes_sent: int = 0
    bytes_received: int = 0
    bytes_sent_intra_node: int = 0
    bytes_sent_inter_node: int = 0
    bytes_fp32_equivalent: int = 0
    bytes_sent_uncompressed: int = 0
    collectives: int = 0
    calls: int = 0
    time_s: float = 0.0
    exposed_s: float = 0.0
    hook_s: float = 0.0

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


#: The fields of :class:`CommunicationCounters` that count traffic (bytes, collectives, calls), not time
TRAFFIC_FIELDS = ("bytes_sent", "bytes_received", "bytes_sent_intra_node", "bytes_sent_inter_node",
                  "bytes_fp32_equivalent", "bytes_sent_uncompressed", "collectives", "calls")


def add_traffic(counters: CommunicationCounters, delta: CommunicationCounters) -> None:
    """Add ``delta``'s traffic (:data:`TRAFFIC_FIELDS`) to ``counters`` in place; times are left alone (the caller
    times the calls its own way)."""
    for name in TRAFFIC_FIELDS:
        setattr(counters, name, getattr(counters, name) + getattr(delta, name))


def count_ring_bytes(
    counters: CommunicationCounters, sent: int, world_size: int, rank: int, topology: Optional[Topology]
) -> None:
    """Count ``sent`` bytes of a ring collective (each rank sends to ``(rank + 1) % P`` and receives as much):
    intra-node when the topology puts that neighbour on this rank's node, else (or without a topology) inter-node."""
    _count_sent(counters, sent, topology is not None and topology.same_node(rank, (rank + 1) % world_size))


def _count_sent(counters: CommunicationCounters, sent: int, intra_node: bool) -> None:
    """``sent`` bytes sent and as many received, intra- or inter-node."""
    counters.bytes_sent += sent
    counters.bytes_received += sent
    if intra_node:
        counters.bytes_sent_intra_node += sent
    else:
        counters.bytes_sent_inter_node += sent


def count_ring_allreduce(
    counters: CommunicationCounters,
    tensor: torch.Tensor,
    world_size: int,
    rank: int,
    topology: Optional[Topology],
    element_size: Optional[int] = None,
) -> int:
    """Count one ring allreduce of ``tensor`` in ``counters`` and return the bytes this rank sends; ``element_size``:
    bytes per element on the wire (default: ``tensor``'s; 2 when a hook sends it in bf16 or fp16).

    A ring sends everything to the next rank, ``(rank + 1) % P``: intra-node bytes when the topology puts it on this
    rank's node, else (or without a topology) inter-node. ``bytes_fp32_equivalent`` counts the same data in fp32."""
    size = tensor.element_size() if element_size is None else element_size
    sent = ring_allreduce_bytes(tensor.numel(), size, world_size)
    count_ring_bytes(counters, sent, world_size, rank, topology)
    counters.bytes_fp32_equivalent += ring_allreduce_bytes(tensor.numel(), 4, world_size)
    counters.collectives += 1
    counters.calls += 1
    return sent


def flat_two_phase_bytes(block: int, world_size: int, topology: Optional[Topology], rank: int) -> tuple[int, int]:
    """Payload bytes ``rank`` sends to ranks on its own node and to other nodes in one flat two-phase exchange of
    ``block``-byte blocks: an ``all_to_all`` (one block to every peer) and a ring ``all_gather`` (``P - 1`` blocks to
    the next rank). Without a topology every peer counts as another node."""
    if world_size <= 1:
        return 0, 0
    if topology is None:
        return 0, 2 * (world_size - 1) * block
    same_node_peers = topology.node_sizes[topology.node_of[rank]] - 1
    intra, inter = same_node_peers * block, (world_size - 1 - same_node_peers) * block
    if topology.same_node(rank, (rank + 1) % world_size):
        intra += (world_size - 1) * block
    else:
        inter += (world_size - 1) * block
    return intra, inter


def count_ring_all_gather(counters: CommunicationCounters, shard_bytes: int, world_size: int,
                          intra_node: bool) -> None:
    """Count a ring ``all_gather`` of ``shard_bytes`` per rank: ``(P - 1)`` shards sent to the next rank, intra- or
    inter-node bytes as ``intra_node`` says, and as themselves in fp32 equivalent (nothing is compressed)."""
    sent = (world_size - 1) * shard_bytes
    _count_sent(counters, sent, intra_node)
    counters.bytes_fp32_equivalent += sent
    counters.collectives += 1
    counters.calls += 1
