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
bucket's transfer overlaps another's compression; :func:`compressed_allreduce_` is the one-bucket case. Both are
:func:`start_exchange_` (compress, launch the first collective) per bucket, then :func:`finish_exchanges_`; the
overlapped exchange calls the same functions, starting each bucket from DDP's comm hook during backward and
advancing earlier ones with :func:`progress_exchanges_` (second phase in groups of its own,
:meth:`CompressedAllreduceState.create_gather_groups`), so both paths compute the same bits.

With a hierarchical :class:`~lightning_onebit.Topology` (``M`` nodes x ``L`` ranks) the same two phases run between
nodes only: a full-precision reduce-scatter inside each node gives local rank ``l`` its node's mean of shard ``l``,
the 1-bit exchange of that shard runs among the ``M`` ranks with local rank ``l``, and an all-gather of the packed
server blocks inside the node gives every rank every chunk (see :func:`_hierarchical_buckets_`). Error state then
shrinks to ``N_pad / L`` (worker) and ``c`` (server) elements, and about ``2 (M-1)/M N/8`` bytes leave each node per
call (:func:`bytes_leaving_node`). The counters split every call's bytes into intra- and inter-node bytes.
"""

from __future__ import annotations

import enum
from typing import Hashable, Optional, Sequence

import torch
import torch.distributed as dist

from lightning_onebit import kernels
from lightning_onebit.comm.groups import all_gather_async, naming_the_group
from lightning_onebit.comm.layout import SCALE_BYTES, BucketLayout
from lightning_onebit.comm.state import BucketBuffers, CompressedAllreduceState
from lightning_onebit.kernels import Backend, Segments


def _write_scales(block: torch.Tensor, scales: torch.Tensor) -> None:
    # A wire block is S_max float32 scales (unused tail left as is) followed by the packed signs, written in place.
    block[: SCALE_BYTES * scales.numel()].copy_(scales.view(torch.uint8))


def _read_block(block: torch.Tensor, n_scales: int, n_scales_max: int) -> tuple[torch.Tensor, torch.Tensor]:
    # The clone realigns the scale bytes so they can be viewed as float32.
    scales = block[: SCALE_BYTES * n_scales].clone().view(torch.float32)
    return scales, block[SCALE_BYTES * n_scales_max :]


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
    """:func:`compressed_allreduce_` of several buckets, pipelined: one bucket's transfer overlaps another's
    compression.

    :func:`start_exchange_` for every bucket (the transfer of bucket ``k`` runs while bucket ``k + 1`` is compressed),
    then :func:`finish_exchanges_`. Still two collectives per bucket (four hierarchical), issued in the same order on
    every rank. All arguments are checked before the first collective, so a bad bucket raises on every rank instead of
    leaving the others waiting.

    Args:
        state: as for :func:`compressed_allreduce_`.
        buckets: ``(key, buffer, layout)`` triples, each as for :func:`compressed_allreduce_`; keys must differ.
    """
    check_buckets(state, buckets)
    pending = [start_exchange_(state, key, buffer, layout, checked=True) for key, buffer, layout in buckets]
    finish_exchanges_(state, pending)


def check_buckets(
    state: CompressedAllreduceState, buckets: Sequence[tuple[Hashable, torch.Tensor, BucketLayout]]
) -> None:
    """Raise ``ValueError`` unless every ``(key, buffer, layout)`` fits ``state``'s process group and topology and the
    keys differ. Local (no communication): call it on every rank before the first collective."""
    world_size = state.world_size()
    topology = state.topology
    if topology is not None and topology.world_size != world_size:
        raise ValueError(
            f"the topology describes {topology.world_size} ranks but the process group has {world_size}: build it "
            "over the same group (Topology.build(..., group=process_group))"
        )
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


class ExchangePhase(enum.IntEnum):
    """The collective a :class:`PendingExchange` waits for. Flat: ``ALL_TO_ALL -> GATHER -> DONE``. Hierarchical:
    ``ALL_TO_ALL`` (inter-node) ``-> GATHER`` (inter-node) ``-> NODE_GATHER`` (intra-node) ``-> DONE``."""

    ALL_TO_ALL = 1
    GATHER = 2
    NODE_GATHER = 3
    DONE = 4


_PHASE_NAMES = {ExchangePhase.ALL_TO_ALL: "1-bit all_to_all", ExchangePhase.GATHER: "all_gather of the server blocks",
                ExchangePhase.NODE_GATHER: "intra-node all_gather of the server blocks"}


class PendingExchange:
    """One bucket's compressed allreduce in flight, from :func:`start_exchange_` to :func:`finish_exchanges_`.

    Attributes:
        key, buffer, layout: as passed to :func:`start_exchange_`; ``buffer`` holds the average once done.
        done: whether the average has been written into ``buffer``.
    """

    __slots__ = ("key", "buffer", "layout", "buffers", "work", "group", "phase", "hierarchical")

    def __init__(self, key: Hashable, buffer: torch.Tensor, layout: BucketLayout) -> None:
        self.key, self.buffer, self.layout = key, buffer, layout
        self.buffers: Optional[BucketBuffers] = None
        self.work: Optional[dist.Work] = None  # the collective in flight
        self.group: Optional[dist.ProcessGroup] = None  # its process group (named if it fails)
        self.phase = ExchangePhase.DONE
        self.hierarchical = False

    @property
    def done(self) -> bool:
        return self.phase == ExchangePhase.DONE


def start_exchange_(
    state: CompressedAllreduceState, key: Hashable, buffer: torch.Tensor, layout: BucketLayout, checked: bool = False
) -> PendingExchange:
    """Start the compressed allreduce of one bucket: compress it and launch its first collective asynchronously.

    Flat: worker compression of ``buffer + e_w`` into ``P`` wire blocks and an ``all_to_all`` in
    ``state.process_group``. Hierarchical: the intra-node reduce-scatter (synchronous, full precision), compression of
    the node's shard and the ``all_to_all`` in the inter-node group. Every rank must start the same buckets in the same
    order; :func:`finish_exchanges_` completes them. ``buffer`` must not be changed until then.

    Args:
        state, key, buffer, layout: as for :func:`compressed_allreduce_`.
        checked: the caller already ran :func:`check_buckets` on this bucket (skips the check).

    Returns:
        The :class:`PendingExchange`, for :func:`progress_exchanges_` and :func:`finish_exchanges_`.
    """
    if not checked:
        check_buckets(state, [(key, buffer, layout)])
    pending = PendingExchange(key, buffer, layout)
    if state.world_size() == 1:
        return pending  # the mean over one rank: nothing to do
    started = state.timings.mark(buffer.device)  # on the stream that runs the work (the hook's side stream)
    bufs = pending.buffers = state.buffers(key, layout, buffer)
    pending.hierarchical = state.ranks_per_node > 1
    backend, workspace = state.backend, state.workspace
    if pending.hierarchical:
        topology = state.topology
        assert topology is not None and topology.intra_group is not None and topology.inter_group is not None, (
            "a hierarchical Topology needs its process groups: build it with Topology.build"
        )
        per_node, nodes = topology.ranks_per_node, topology.num_nodes
        local = topology.local_index
        # intra-node reduce-scatter: all_to_all of the L shards, then a sum in local-rank order and a division by L
        # (gloo has no AVG, and a fixed order gives the same bits as a single-process reference)
        shard = layout.padded_numel // per_node
        received = workspace.get("intra_reduce_scatter", layout.padded_numel, buffer.dtype, buffer.device)
        with naming_the_group("intra-node reduce-scatter (all_to_all)", topology.intra_group):
            dist.all_to_all_single(received, buffer, group=topology.intra_group)
        node_mean = received[:shard]
        for j in range(1, per_node):
            node_mean.add_(received[j * shard : (j + 1) * shard])
        kernels.divide_(node_mean, per_node)
        own_chunks = range(local * nodes, (local + 1) * nodes)
        _compress_chunks(node_mean, bufs.worker_error, bufs.send, layout, own_chunks, backend, workspace)
        pending.group = topology.inter_group
    else:
        _compress_chunks(buffer, bufs.worker_error, bufs.send, layout, range(state.world_size()), backend, workspace)
        pending.group = state.process_group
    with naming_the_group("1-bit all_to_all", pending.group):
        pending.work = dist.all_to_all_single(bufs.recv, bufs.send, group=pending.group, async_op=True)
    pending.phase = ExchangePhase.ALL_TO_ALL
    state.count_call(layout, buffer)
    state.timings.add(state.counters, "time_s", started, state.timings.mark(buffer.device))
    return pending


def progress_exchanges_(
    state: CompressedAllreduceState, pending: Sequence[PendingExchange], keep_newest: bool = True
) -> None:
    """Advance the exchanges started so far on a fixed schedule: serve each one and launch the rest of its
    collectives (decoding is left to :func:`finish_exchanges_`), except the newest when ``keep_newest`` (its first
    collective then stays in flight while the caller computes).

    Called after each start (the overlapped hook does), bucket ``k``'s start therefore advances bucket ``k - 1``: the
    order of launches on every process group, and their interleaving across groups, is a function of the bucket
    schedule alone, the same on every rank. NCCL requires that (operations on different communicators issued in the
    same order on every rank, or kernels that cannot co-reside deadlock). Waiting is stream-ordered on CUDA (the
    host does not block); on gloo it blocks until that bucket's first collective arrived.

    Needs the second phase in process groups of its own (:meth:`CompressedAllreduceState.create_gather_groups`), so
    that the ``all_gather`` of bucket ``k - 1`` and the ``all_to_all`` of bucket ``k`` run concurrently instead of
    queueing in one communicator. Without them this does nothing (:func:`finish_exchanges_` does it all).
    """
    if not state.has_gather_groups or not pending:
        return
    device = pending[0].buffer.device
    with state.timings.span(state.counters, "time_s", device):
        last = ExchangePhase.NODE_GATHER if pending[0].hierarchical else ExchangePhase.GATHER
        advancing = pending[:-1] if keep_newest else pending
        # phase by phase, oldest first: every group sees start order
        for phase in range(ExchangePhase.ALL_TO_ALL, last):
            for p in advancing:
                if p.phase == phase:
                    advance_exchange_(state, p)


def finish_exchanges_(state: CompressedAllreduceState, pending: Sequence[PendingExchange]) -> None:
    """Complete the exchanges (waiting where needed) and write each average into its buffer, in start order: first
    every server phase and its ``all_gather``, then (hierarchical) every intra-node gather, then every decode."""
    if all(p.done for p in pending):
        return
    with state.timings.span(state.counters, "time_s", pending[0].buffer.device):
        for phase in (ExchangePhase.ALL_TO_ALL, ExchangePhase.GATHER, ExchangePhase.NODE_GATHER):
            for p in pending:
                if p.phase == phase:
                    advance_exchange_(state, p)


def advance_exchange_(state: CompressedAllreduceState, p: PendingExchange) -> None:
    """Wait for ``p``'s collective and run its next phase (:class:`ExchangePhase`); what
    :func:`progress_exchanges_` and :func:`finish_exchanges_` do to each exchange in turn."""
    bufs, layout = p.buffers, p.layout
    assert bufs is not None and p.work is not None
    with naming_the_group(_PHASE_NAMES[p.phase], p.group):
        p.work.wait()
    backend, workspace = state.backend, state.workspace
    inter_gather_group, intra_gather_group = state.gather_groups()
    if p.phase == ExchangePhase.ALL_TO_ALL:
        if p.hierarchical:
            topology = state.topology
            chunk = topology.local_index * topology.num_nodes + topology.inter_index
            sources = topology.num_nodes
        else:
            chunk, sources = state.rank(), state.world_size()
        _serve_chunk(bufs, layout, layout.chunk_segments[chunk], sources, backend, workspace)
        with naming_the_group(_PHASE_NAMES[ExchangePhase.GATHER], inter_gather_group):
            p.work = all_gather_async(bufs.gather_recv, bufs.gather_send, inter_gather_group)
        p.group, p.phase = inter_gather_group, ExchangePhase.GATHER
    elif p.phase == ExchangePhase.GATHER and p.hierarchical:
        # every server block of the bucket, gathered packed inside the node (32x fewer bytes than the decoded shard)
        with naming_the_group(_PHASE_NAMES[ExchangePhase.NODE_GATHER], intra_gather_group):
            p.work = all_gather_async(bufs.node_gather_recv, bufs.gather_recv, intra_gather_group)
        p.group, p.phase = intra_gather_group, ExchangePhase.NODE_GATHER
    else:
        _decode_all(p.buffer, bufs.gather_recv if not p.hierarchical else bufs.node_gather_recv, layout, backend,
                    workspace)
        p.work, p.phase = None, ExchangePhase.DONE


def simulate_compressed_allreduce_(
    buffers: Sequence[torch.Tensor],
    layout: BucketLayout,
    states: Optional[Sequence[BucketBuffers]] = None,
    backend: Backend = "auto",
    workspace: Optional[kernels.Workspace] = None,
) -> list[BucketBuffers]:
    """The flat compressed allreduce of ``P = layout.world_size`` ranks, simulated in one process: ``buffers[r]`` is
    rank ``r``'s input (``layout.padded_numel`` elements, padding zero) and is replaced by the average every rank
    would get. The collectives become copies between the ranks' wire buffers; the compression, serving and decoding
    are the kernels and helpers the distributed path runs, so the bits are the same.

    For checks and benchmarks on a single device (a one-GPU machine cannot run two NCCL ranks). ``states``: each
    rank's error feedback and wire buffers from an earlier call (``None``: zeros). Returns the states, to pass on.
    """
    world_size = layout.world_size
    if len(buffers) != world_size:
        raise ValueError(f"the layout is for {world_size} ranks but {len(buffers)} buffers were given")
    for buffer in buffers:
        if buffer.dim() != 1 or buffer.numel() != layout.padded_numel or not buffer.is_contiguous():
            raise ValueError(f"every buffer must be 1-D contiguous with {layout.padded_numel} elements")
    ranks = list(states) if states is not None else [BucketBuffers(layout, buffers[0]) for _ in range(world_size)]
    workspace = workspace if workspace is not None else kernels.Workspace()
    block = layout.block_bytes
    for buffer, bufs in zip(buffers, ranks):
        _compress_chunks(buffer, bufs.worker_error, bufs.send, layout, range(world_size), backend, workspace)
    for r, bufs in enumerate(ranks):  # all_to_all: rank r receives every rank's block r
        for j, peer in enumerate(ranks):
            bufs.recv[j * block : (j + 1) * block].copy_(peer.send[r * block : (r + 1) * block])
    for r, bufs in enumerate(ranks):
        _serve_chunk(bufs, layout, layout.chunk_segments[r], world_size, backend, workspace)
    for bufs in ranks:  # all_gather of the server blocks
        for j, peer in enumerate(ranks):
            bufs.gather_recv[j * block : (j + 1) * block].copy_(peer.gather_send)
    for buffer, bufs in zip(buffers, ranks):
        _decode_all(buffer, bufs.gather_recv, layout, backend, workspace)
    return ranks


def _compress_chunks(
    x: torch.Tensor,
    worker_error: torch.Tensor,
    send: torch.Tensor,
    layout: BucketLayout,
    chunks: range,
    backend: Backend,
    workspace: kernels.Workspace,
) -> None:
    """Worker phase: compress ``x + e_w`` (``x`` covers ``chunks`` of the layout) straight into one wire block per
    chunk, in order (segments never cross a chunk boundary)."""
    c, s_max, block = layout.chunk_numel, layout.max_chunk_segments, layout.block_bytes
    for i, r in enumerate(chunks):
        part, out = slice(i * c, (i + 1) * c), send[i * block : (i + 1) * block]
        scales, _ = kernels.compress_with_error_feedback(
            x[part],
            worker_error[part],
            layout.chunk_segments[r],
            packed_out=out[SCALE_BYTES * s_max :],
            backend=backend,
            workspace=workspace,
        )
        _write_scales(out, scales)


def _serve_chunk(
    bufs: BucketBuffers, layout: BucketLayout, segments: Segments, sources: int, backend: Backend, workspace
) -> None:
    """Server phase: ``e_s += mean of the received chunks``; compress ``e_s`` into the all_gather block."""
    s_max, block = layout.max_chunk_segments, layout.block_bytes
    blocks = [_read_block(bufs.recv[j * block : (j + 1) * block], len(segments), s_max) for j in range(sources)]
    kernels.add_mean_of_signs_(
        bufs.server_error,
        [signs for _, signs in blocks],
        [scales for scales, _ in blocks],
        segments,
        backend=backend,
        workspace=workspace,
    )
    # the server's signs are packed straight into its all_gather block, behind the scales
    server_scales, _ = kernels.compress_in_place(
        bufs.server_error, segments, packed_out=bufs.gather_send[SCALE_BYTES * s_max :], backend=backend,
        workspace=workspace,
    )
    _write_scales(bufs.gather_send, server_scales)


def _decode_all(
    buffer: torch.Tensor, blocks: torch.Tensor, layout: BucketLayout, backend: Backend, workspace
) -> None:
    """Write every server's chunk (``P`` wire blocks in chunk order) into ``buffer``."""
    c, s_max, block = layout.chunk_numel, layout.max_chunk_segments, layout.block_bytes
    for j, chunk_segments in enumerate(layout.chunk_segments):
        scales, signs = _read_block(blocks[j * block : (j + 1) * block], len(chunk_segments), s_max)
        kernels.decompress(signs, scales, chunk_segments, buffer[j * c : (j + 1) * c], backend=backend,
                           workspace=workspace)
