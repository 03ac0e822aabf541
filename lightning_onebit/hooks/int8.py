"""An 8-bit DDP comm hook with error feedback: gradients averaged with one byte per element each way.

:func:`int8_allreduce_hook` averages a DDP bucket ``x`` of ``N`` elements over ``P`` ranks with the two phases of the
1-bit exchange (:mod:`lightning_onebit.comm.exchange`), eight bits per element instead of one. The bucket is laid out
as the 1-bit exchange lays it out (:class:`~lightning_onebit.comm.BucketLayout`: zero-padded to ``N_pad``, a multiple
of ``8 P``, cut into ``P`` chunks of ``c = N_pad / P``, rank ``r`` serving chunk ``r``), and its scale segments are the
layout's (tensor and chunk boundaries) cut further into pieces of at most ``segment_numel`` elements, so that one
large outlier costs the resolution of at most that many elements. Per segment of ``n`` elements, quantizing ``y``:
``s = max|y| / 127``, ``q = clamp(round(y / s), -127, 127)`` (round half to even; ``q = 0`` where ``s = 0``), decoded as
``q s``.

1. Worker: ``y = x + e_w``; quantize ``y`` per segment; ``e_w <- y - q s`` (zero without error feedback).
2. ``all_to_all``: rank ``r`` receives every rank's chunk ``r``, as a block of its segments' scales (float32, padded to
   ``S_max`` scales, the most segments of a chunk) followed by its ``c`` int8 values.
3. Server: ``z = (d_0 + d_1 + ... + d_(P-1)) / P + e_s``, ``d_j`` rank ``j``'s decoded block, added in rank order;
   quantize ``z`` per segment; ``e_s <- z - q s``.
4. ``all_gather`` of every server's block; every rank decodes the same bytes, so the average is bit-identical on every
   rank (replicas stay identical).

With error feedback (the default) what a rank's gradients lose to rounding is sent with its next gradients: summed
over steps, the averaged gradients follow the exact ones up to the last step's residual. The hook is for full-precision
gradient averages (1-bit Adam's warmup, 0/1 Adam's variance steps, or plain DDP); the arithmetic is in float32 whatever
the bucket's dtype.

Bytes per rank and call (counted in :attr:`Int8AllreduceState.counters` when the hook is called): the ``all_to_all``
sends ``(P - 1) B`` and the ring ``all_gather`` ``(P - 1) B``, ``B = 4 S_max + c``: about ``2 (P-1)/P N`` bytes, a
quarter of the fp32 ring allreduce's ``2 (P-1)/P 4 N`` for any ``P`` (torch's ``quantization_pertensor_hook`` and
``quantization_perchannel_hook`` all-gather every rank's whole bucket, ``(P - 1) N`` bytes, which is no saving from
``P = 8`` on, keep no error feedback, and scale a whole bucket of tensors of different magnitudes by one range in the
per-tensor hook).

Buckets are exchanged one after another: a bucket's exchange starts once the previous bucket's has completed, so that
every rank issues the collectives in the same order (the second phase is launched from the first one's callback, on
the backend's threads; gloo matches collectives by issue order). The error feedback is kept per DDP bucket (by its
index); a bucket whose tensors change (DDP rebuilds its buckets after the first iteration) starts its error feedback
from zero. It is not saved in checkpoints: a resumed run starts it from zero.

Usage, as the warmup exchange of 1-bit Adam or with plain DDP::

    state = Int8AllreduceState()
    OnebitStrategy(ddp_comm_hook=int8_allreduce_hook, ddp_comm_state=state)
    # or: ddp_model.register_comm_hook(state, int8_allreduce_hook)
"""

# No `from __future__ import annotations`: DDP checks the hook's annotations as real objects.
import dataclasses
import weakref
from typing import Optional

import torch
import torch.distributed as dist

from lightning_onebit._checks import check_flag, check_integer
from lightning_onebit.comm.accounting import CommunicationCounters, flat_two_phase_bytes, ring_allreduce_bytes
from lightning_onebit.comm.groups import all_gather_async
from lightning_onebit.comm.layout import SCALE_BYTES, BucketLayout
from lightning_onebit.comm.topology import Topology
from lightning_onebit.kernels import Segments

#: The largest magnitude of an int8 value: symmetric range, so that ``-q`` is ``q`` negated
INT8_LEVELS = 127


def int8_segments(layout: BucketLayout, segment_numel: int) -> tuple[Segments, tuple[Segments, ...]]:
    """The scale segments of the 8-bit exchange of ``layout``: its segments (tensor and chunk boundaries), each cut
    into pieces of at most ``segment_numel`` elements counted from the segment's start; the whole padded buffer's and,
    per chunk, those of the chunk (offsets relative to its start)."""
    offsets = set()
    for start, stop in layout.segments.bounds:
        offsets.update(range(start, stop, segment_numel))
    offsets.add(layout.padded_numel)
    ordered = sorted(offsets)
    chunk = layout.chunk_numel
    per_chunk = tuple(
        Segments([o - r * chunk for o in ordered if r * chunk <= o <= (r + 1) * chunk])
        for r in range(layout.world_size)
    )
    return Segments(ordered), per_chunk


def quantize_int8_(y: torch.Tensor, segments: Segments, error: Optional[torch.Tensor]) -> tuple[torch.Tensor, ...]:
    """``(scales, q)``: ``y`` (float32, 1-D, ``segments.total`` elements) quantized per segment as the module
    docstring says, and with ``error`` given, ``error <- y - q s`` in place."""
    lengths = segments.lengths_tensor(y.device)
    scales = torch.segment_reduce(y.abs(), "max", lengths=lengths).div_(INT8_LEVELS)
    safe = torch.where(scales > 0, scales, torch.ones_like(scales))
    q = torch.round(y / segments.expand(safe)).clamp_(-INT8_LEVELS, INT8_LEVELS)
    if error is not None:
        torch.sub(y, q * segments.expand(scales), out=error)
    return scales, q.to(torch.int8)


def dequantize_int8(scales: torch.Tensor, q: torch.Tensor, segments: Segments) -> torch.Tensor:
    """``q s`` per segment, float32."""
    return q.to(torch.float32) * segments.expand(scales)


@dataclasses.dataclass
class _Int8Bucket:
    """One DDP bucket's plan and error feedback."""

    tensor_numels: tuple[int, ...]
    layout: BucketLayout
    segments: Segments  # of the whole padded buffer
    chunk_segments: tuple[Segments, ...]  # per chunk, relative to its start
    chunk_scales: tuple[tuple[int, int], ...]  # per chunk, the range of its segments among the whole buffer's
    max_scales: int  # S_max: scales per wire block
    block_bytes: int
    worker_error: Optional[torch.Tensor]
    server_error: Optional[torch.Tensor]


class Int8AllreduceState:
    """State of :func:`int8_allreduce_hook`.

    Args:
        process_group: the group to average over; ``None`` (default): WORLD.
        segment_numel: the most elements that share one scale (an integer >= 1). Default ``1024`` (the scales then
            add at most 4 bytes per 1024 elements to the wire, 0.4%).
        error_feedback: send what rounding lost with the next call (see the module docstring). Default ``True``.
        topology: which ranks share a node, to split ``bytes_sent`` into intra- and inter-node bytes; ``None``
            (default): every peer counts as another node.

    Attributes:
        counters: this rank's bytes (:class:`~lightning_onebit.comm.CommunicationCounters`), counted when the hook is
            called; :class:`~lightning_onebit.hooks.GradientSyncState` adds them to the warmup's counters when this
            state is its ``averaging_hook_state``.
    """

    def __init__(
        self,
        process_group: Optional[dist.ProcessGroup] = None,
        segment_numel: int = 1024,
        error_feedback: bool = True,
        topology: Optional[Topology] = None,
    ) -> None:
        self.process_group = process_group
        self.segment_numel = check_integer(segment_numel, "Int8AllreduceState segment_numel")
        self.error_feedback = check_flag(error_feedback, "Int8AllreduceState error_feedback")
        self.topology = topology
        self.counters = CommunicationCounters()
        self._buckets: dict[int, _Int8Bucket] = {}
        self._previous: Optional[torch.futures.Future] = None

    def error_feedback_norm(self) -> float:
        """The L2 norm of every bucket's worker and server error feedback on this rank (0 without error feedback)."""
        total = 0.0
        for bucket in self._buckets.values():
            for error in (bucket.worker_error, bucket.server_error):
                if error is not None:
                    total += float(error.double().pow(2).sum())
        return total**0.5

    def _bucket(self, index: int, tensor_numels: tuple[int, ...], world_size: int,
                device: torch.device) -> _Int8Bucket:
        plan = self._buckets.get(index)
        if plan is not None and plan.tensor_numels == tensor_numels and plan.layout.world_size == world_size:
            return plan
        layout = BucketLayout.build(tensor_numels, world_size)
        segments, chunk_segments = int8_segments(layout, self.segment_numel)
        starts = [segments.offsets.index(r * layout.chunk_numel) for r in range(world_size)]
        chunk_scales = tuple((first, first + len(s)) for first, s in zip(starts, chunk_segments))
        max_scales = max(len(s) for s in chunk_segments)
        errors = [torch.zeros(n, dtype=torch.float32, device=device) if self.error_feedback else None
                  for n in (layout.padded_numel, layout.chunk_numel)]
        plan = self._buckets[index] = _Int8Bucket(
            tensor_numels, layout, segments, chunk_segments, chunk_scales, max_scales,
            SCALE_BYTES * max_scales + layout.chunk_numel, *errors,
        )
        return plan

    def _count(self, plan: _Int8Bucket, world_size: int, rank: int) -> None:
        intra, inter = flat_two_phase_bytes(plan.block_bytes, world_size, self.topology, rank)
        counters = self.counters
        counters.bytes_sent += intra + inter
        counters.bytes_received += intra + inter
        counters.bytes_sent_intra_node += intra
        counters.bytes_sent_inter_node += inter
        counters.bytes_fp32_equivalent += ring_allreduce_bytes(plan.layout.numel, 4, world_size)
        counters.collectives += 2
        counters.calls += 1


def _write_block(block: torch.Tensor, scales: torch.Tensor, q: torch.Tensor, max_scales: int) -> None:
    block[: SCALE_BYTES * scales.numel()].copy_(scales.view(torch.uint8))
    block[SCALE_BYTES * max_scales:].copy_(q.view(torch.uint8))


def _read_block(block: torch.Tensor, n_scales: int, max_scales: int) -> tuple[torch.Tensor, torch.Tensor]:
    # the clone realigns the scale bytes so that they can be viewed as float32
    return block[: SCALE_BYTES * n_scales].clone().view(torch.float32), block[SCALE_BYTES * max_scales:].view(
        torch.int8)


def int8_allreduce_hook(state: Int8AllreduceState, bucket: dist.GradBucket) -> torch.futures.Future[torch.Tensor]:
    """DDP comm hook: the bucket replaced by its 8-bit error-compensated average over ``state.process_group`` (the
    module docstring has the math), once the previous bucket's exchange completed."""
    tensor = bucket.buffer()
    group = state.process_group
    world_size, rank = dist.get_world_size(group), dist.get_rank(group)
    if world_size == 1:
        done: torch.futures.Future = torch.futures.Future()
        done.set_result(tensor)
        return done
    if state._previous is not None:
        state._previous.wait()  # one bucket at a time: the same order of collectives on every rank
    plan = state._bucket(bucket.index(), tuple(g.numel() for g in bucket.gradients()), world_size, tensor.device)
    layout, chunk, max_scales, size = plan.layout, plan.layout.chunk_numel, plan.max_scales, plan.block_bytes
    y = torch.zeros(layout.padded_numel, dtype=torch.float32, device=tensor.device)
    y[: layout.numel].copy_(tensor)
    if plan.worker_error is not None:
        y.add_(plan.worker_error)
    scales, q = quantize_int8_(y, plan.segments, plan.worker_error)
    send = torch.zeros(world_size * size, dtype=torch.uint8, device=tensor.device)
    for j, (first, last) in enumerate(plan.chunk_scales):
        _write_block(send[j * size:(j + 1) * size], scales[first:last], q[j * chunk:(j + 1) * chunk], max_scales)
    received = torch.empty_like(send)
    state._count(plan, world_size, rank)
    own_segments = plan.chunk_segments[rank]
    # The callbacks run on the backend's threads and are freed there, possibly after DDP has been told the bucket is
    # done: they reach the process group through the state, held weakly, so that the last reference to a group is
    # never dropped on its own worker thread (gloo aborts when it has to join the thread it runs on).
    state_ref = weakref.ref(state)

    def serve_and_gather(done: torch.futures.Future) -> torch.Tensor:
        done.wait()
        mean: Optional[torch.Tensor] = None
        for j in range(world_size):  # in rank order: the same sum on every rank and in every run
            block_scales, block_q = _read_block(received[j * size:(j + 1) * size], len(own_segments), max_scales)
            decoded = dequantize_int8(block_scales, block_q, own_segments)
            mean = decoded if mean is None else mean.add_(decoded)
        assert mean is not None
        z = mean.div_(world_size)
        if plan.server_error is not None:
            z.add_(plan.server_error)
        server_scales, server_q = quantize_int8_(z, own_segments, plan.server_error)
        block = torch.zeros(size, dtype=torch.uint8, device=tensor.device)
        _write_block(block, server_scales, server_q, max_scales)
        gathered = torch.empty(world_size * size, dtype=torch.uint8, device=tensor.device)
        held = state_ref()
        if held is None:
            raise RuntimeError("int8_allreduce_hook: its Int8AllreduceState was freed during the exchange")
        all_gather_async(gathered, block, held.process_group).wait()
        return gathered

    def decode(done: torch.futures.Future) -> torch.Tensor:
        gathered = done.value()
        average = torch.empty(layout.padded_numel, dtype=torch.float32, device=tensor.device)
        for j in range(world_size):
            block_scales, block_q = _read_block(gathered[j * size:(j + 1) * size], len(plan.chunk_segments[j]),
                                                max_scales)
            average[j * chunk:(j + 1) * chunk] = dequantize_int8(block_scales, block_q, plan.chunk_segments[j])
        tensor.copy_(average[: layout.numel])
        return tensor

    first = dist.all_to_all_single(received, send, group=group, async_op=True).get_future()
    future = state._previous = first.then(serve_and_gather).then(decode)
    return future
