"""An 8-bit DDP comm hook with error feedback: gradients averaged with one byte per element each way.

:func:`int8_allreduce_hook` averages a DDP bucket over ``P`` ranks with the two phases of the 1-bit exchange
(:mod:`lightning_onebit.comm.exchange`), eight bits per element instead of one. Every parameter is laid out on its
own, so that what the hook computes depends on the parameters alone, not on how DDP grouped them into buckets (DDP's
buckets in the first iteration of a process differ from the rebuilt ones it uses after, which is what a resumed run
meets): parameter ``i`` of ``n_i`` elements is zero-padded to ``P c_i``, ``c_i = ceil(n_i / P)``, and cut into ``P``
chunks of ``c_i``; rank ``r`` serves chunk ``r`` of every parameter. A parameter's chunk is cut into scale segments of
at most ``segment_numel`` elements, so that one large outlier costs the resolution of at most that many elements. Per
segment of ``n`` elements, quantizing ``y``: ``s = max|y| / 127``, ``q = clamp(round(y / s), -127, 127)`` (round half
to even; ``q = 0`` where ``s = 0``), decoded as ``q s``.

1. Worker: ``y = x + e_w``; quantize ``y`` per segment; ``e_w <- y - q s`` (zero without error feedback).
2. ``all_to_all``: rank ``r`` receives from every rank its block ``r``: the scales of chunk ``r`` of the bucket's
   parameters (float32), then their int8 values (``C = sum c_i`` bytes).
3. Server: ``z = (d_0 + d_1 + ... + d_(P-1)) / P + e_s``, ``d_j`` rank ``j``'s decoded block, added in rank order;
   quantize ``z`` per segment; ``e_s <- z - q s``.
4. ``all_gather`` of every server's block; every rank decodes the same bytes, so the average is bit-identical on every
   rank (replicas stay identical).

With error feedback (the default) what a rank's gradients lose to rounding is sent with its next gradients: summed
over steps, the averaged gradients follow the exact ones up to the last step's residual. The hook is for full-precision
gradient averages (1-bit Adam's warmup, 0/1 Adam's variance steps, or plain DDP); the arithmetic is in float32 whatever
the bucket's dtype.

Bytes per rank and call (counted in :attr:`Int8AllreduceState.counters` when the hook is called): the ``all_to_all``
sends ``(P - 1) B`` and the ring ``all_gather`` ``(P - 1) B``, ``B = 4 S + C`` with ``S`` the scales of one block
(``sum ceil(c_i / segment_numel)``): about ``2 (P-1)/P N`` bytes for ``N`` elements, a quarter of the fp32 ring
allreduce's ``2 (P-1)/P 4 N`` for any ``P`` (torch's ``quantization_pertensor_hook`` and
``quantization_perchannel_hook`` all-gather every rank's whole bucket, ``(P - 1) N`` bytes, which is no saving from
``P = 8`` on, keep no error feedback, and scale a whole bucket of tensors of different magnitudes by one range in the
per-tensor hook).

Buckets are exchanged one after another: a bucket's exchange starts once the previous bucket's has completed, so that
every rank issues the collectives in the same order (the second phase is launched from the first one's callback, on
the backend's threads; gloo matches collectives by issue order). The error feedback is kept per parameter (by its
index in the DDP module, :class:`~lightning_onebit.hooks.parameter_state.ParameterKeyedState`): ``OnebitStrategy``
saves it with each checkpoint, one file per rank, and a resumed run continues bit for bit.

Usage, as the warmup exchange of 1-bit Adam (``OnebitStrategy(warmup_exchange="int8")``) or with plain DDP::

    state = Int8AllreduceState()
    state.bind(ddp_model)
    ddp_model.register_comm_hook(state, int8_allreduce_hook)
"""

# No `from __future__ import annotations`: DDP checks the hook's annotations as real objects.
import dataclasses
import weakref
from typing import Optional

import torch
import torch.distributed as dist

from lightning_onebit._checks import check_flag, check_integer
from lightning_onebit.comm.accounting import flat_two_phase_bytes, ring_allreduce_bytes
from lightning_onebit.comm.groups import all_gather_async
from lightning_onebit.comm.layout import SCALE_BYTES
from lightning_onebit.comm.topology import Topology
from lightning_onebit.hooks.parameter_state import ParameterKeyedState
from lightning_onebit.kernels import Segments

#: The largest magnitude of an int8 value: symmetric range, so that ``-q`` is ``q`` negated
INT8_LEVELS = 127




def int8_block_segments(numels: tuple[int, ...], world_size: int, segment_numel: int) -> Segments:
    """The scale segments of one block (the chunks ``c_i = ceil(n_i / P)`` of parameters of ``numels`` elements, one
    after another, each cut into pieces of at most ``segment_numel`` elements from its start): every block of a
    bucket has these."""
    lengths = []
    for numel in numels:
        chunk = -(-numel // world_size)
        lengths += [min(segment_numel, chunk - start) for start in range(0, chunk, segment_numel)]
    return Segments.from_lengths(lengths)


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
    """One DDP bucket's plan: its parameters and where their elements go on the wire; its error feedback buffers, of
    which each parameter's kept tensors are views."""

    indices: tuple[int, ...]
    numel: int
    values: int  # C: int8 values per block
    n_scales: int  # S: scales per block
    block_segments: Segments  # of one block's C values
    all_segments: Segments  # of the P blocks' values one after another (what a worker quantizes)
    gather: torch.Tensor  # per wire position (P C), its element in the bucket, or `numel` (a zero) for padding
    scatter: torch.Tensor  # per element of the bucket, its wire position
    worker_error: Optional[torch.Tensor]  # P x C
    server_error: Optional[torch.Tensor]  # C

    @property
    def block_bytes(self) -> int:
        return SCALE_BYTES * self.n_scales + self.values


class Int8AllreduceState(ParameterKeyedState):
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
        parameters: per parameter index, its ``worker_error`` (``P x c_i``: its chunks, padding included) and
            ``server_error`` (``c_i``: the chunk this rank serves), float32 (with error feedback).
    """

    error_feedback_names = ("worker_error", "server_error")

    def __init__(
        self,
        process_group: Optional[dist.ProcessGroup] = None,
        segment_numel: int = 1024,
        error_feedback: bool = True,
        topology: Optional[Topology] = None,
    ) -> None:
        super().__init__("int8", process_group, topology)
        self.segment_numel = check_integer(segment_numel, "Int8AllreduceState segment_numel")
        self.error_feedback = check_flag(error_feedback, "Int8AllreduceState error_feedback")
        self._buckets: dict[int, _Int8Bucket] = {}
        self._previous: Optional[torch.futures.Future] = None

    def config(self) -> dict:
        return {"segment_numel": self.segment_numel, "error_feedback": self.error_feedback}

    def expected_shapes(self, index: int) -> dict[str, tuple[int, ...]]:
        world_size = self.world_size()
        chunk = -(-self._shapes[index].numel() // world_size)
        return {"worker_error": (world_size, chunk), "server_error": (chunk,)}

    def _state_replaced(self) -> None:
        self._buckets = {}  # rebuilt at the next call, from the per-parameter tensors

    def _bucket(self, index: int, indices: tuple[int, ...], numels: tuple[int, ...], world_size: int,
                device: torch.device) -> _Int8Bucket:
        plan = self._buckets.get(index)
        if plan is not None and plan.indices == indices:
            return plan
        chunks = [-(-n // world_size) for n in numels]
        values = sum(chunks)
        numel = sum(numels)
        gather = torch.full((world_size, values), numel, dtype=torch.int64)
        offset = start = 0
        for n, c in zip(numels, chunks):
            padded = torch.full((world_size * c,), numel, dtype=torch.int64)
            padded[:n] = torch.arange(start, start + n)
            gather[:, offset:offset + c] = padded.view(world_size, c)
            offset, start = offset + c, start + n
        gather = gather.view(-1)
        scatter = torch.empty(numel, dtype=torch.int64)
        real = gather < numel
        scatter[gather[real]] = torch.arange(world_size * values)[real]
        block_segments = int8_block_segments(numels, world_size, self.segment_numel)
        all_segments = Segments.from_lengths(block_segments.lengths * world_size)
        worker_error = server_error = None
        if self.error_feedback:
            worker_error = torch.zeros(world_size, values, dtype=torch.float32, device=device)
            server_error = torch.zeros(values, dtype=torch.float32, device=device)
            offset = 0
            for i, c in zip(indices, chunks):  # each parameter's kept tensors become views of the bucket's buffers
                kept = self.parameters.get(i, {})
                worker, server = worker_error[:, offset:offset + c], server_error[offset:offset + c]
                if "worker_error" in kept:
                    worker.copy_(kept["worker_error"])
                    server.copy_(kept["server_error"])
                self.parameters[i] = {"worker_error": worker, "server_error": server}
                offset += c
        plan = self._buckets[index] = _Int8Bucket(
            indices, numel, values, len(block_segments), block_segments, all_segments, gather.to(device),
            scatter.to(device), worker_error, server_error,
        )
        return plan

    def _count(self, plan: _Int8Bucket, world_size: int, rank: int) -> None:
        intra, inter = flat_two_phase_bytes(plan.block_bytes, world_size, self.topology, rank)
        counters = self.counters
        counters.bytes_sent += intra + inter
        counters.bytes_received += intra + inter
        counters.bytes_sent_intra_node += intra
        counters.bytes_sent_inter_node += inter
        counters.bytes_fp32_equivalent += ring_allreduce_bytes(plan.numel, 4, world_size)
        counters.collectives += 2
        counters.calls += 1


def _write_blocks(blocks: torch.Tensor, scales: torch.Tensor, q: torch.Tensor, n_scales: int) -> None:
    """Rows of ``blocks`` (``k x B`` bytes): each row's scales, then its values."""
    rows = blocks.shape[0]
    blocks[:, : SCALE_BYTES * n_scales].copy_(scales.view(torch.uint8).view(rows, -1))
    blocks[:, SCALE_BYTES * n_scales:].copy_(q.view(torch.uint8).view(rows, -1))


def _read_blocks(blocks: torch.Tensor, n_scales: int) -> tuple[torch.Tensor, torch.Tensor]:
    """``(scales, q)`` of every row of ``blocks``, flat and in row order."""
    # the clone realigns the scale bytes so that they can be viewed as float32
    scales = blocks[:, : SCALE_BYTES * n_scales].contiguous().view(torch.float32).view(-1)
    return scales, blocks[:, SCALE_BYTES * n_scales:].contiguous().view(torch.int8).view(-1)


def int8_allreduce_hook(state: Int8AllreduceState, bucket: dist.GradBucket) -> torch.futures.Future[torch.Tensor]:
    """DDP comm hook: the bucket replaced by its 8-bit error-compensated average over ``state.process_group`` (the
    module docstring has the math), once the previous bucket's exchange completed."""
    tensor = bucket.buffer()
    group = state.process_group
    world_size, rank = dist.get_world_size(group), dist.get_rank(group)
    if bucket.is_last():
        state.iteration += 1
    if world_size == 1:
        done: torch.futures.Future = torch.futures.Future()
        done.set_result(tensor)
        return done
    if state._previous is not None:
        state._previous.wait()  # one bucket at a time: the same order of collectives on every rank
    numels = tuple(g.numel() for g in bucket.gradients())
    plan = state._bucket(bucket.index(), state.parameter_indices(bucket), numels, world_size, tensor.device)
    values, n_scales, size = plan.values, plan.n_scales, plan.block_bytes
    padded = torch.cat([tensor.reshape(-1).to(torch.float32), tensor.new_zeros(1, dtype=torch.float32)])
    y = padded[plan.gather]
    worker_error = None if plan.worker_error is None else plan.worker_error.view(-1)
    if worker_error is not None:
        y.add_(worker_error)
    scales, q = quantize_int8_(y, plan.all_segments, worker_error)
    send = torch.empty(world_size, size, dtype=torch.uint8, device=tensor.device)
    _write_blocks(send, scales, q, n_scales)
    received = torch.empty_like(send)
    state._count(plan, world_size, rank)
    # The callbacks run on the backend's threads and are freed there, possibly after DDP has been told the bucket is
    # done: they reach the process group through the state, held weakly, so that the last reference to a group is
    # never dropped on its own worker thread (gloo aborts when it has to join the thread it runs on).
    state_ref = weakref.ref(state)

    def serve_and_gather(done: torch.futures.Future) -> torch.Tensor:
        done.wait()
        block_scales, block_q = _read_blocks(received, n_scales)
        decoded = dequantize_int8(block_scales, block_q, plan.all_segments).view(world_size, values)
        mean = decoded[0].clone()
        for j in range(1, world_size):  # in rank order: the same sum on every rank and in every run
            mean.add_(decoded[j])
        z = mean.div_(world_size)
        if plan.server_error is not None:
            z.add_(plan.server_error)
        server_scales, server_q = quantize_int8_(z, plan.block_segments, plan.server_error)
        block = torch.empty(1, size, dtype=torch.uint8, device=tensor.device)
        _write_blocks(block, server_scales, server_q, n_scales)
        gathered = torch.empty(world_size, size, dtype=torch.uint8, device=tensor.device)
        held = state_ref()
        if held is None:
            raise RuntimeError("int8_allreduce_hook: its Int8AllreduceState was freed during the exchange")
        all_gather_async(gathered.view(-1), block.view(-1), held.process_group).wait()
        return gathered

    def decode(done: torch.futures.Future) -> torch.Tensor:
        gathered_scales, gathered_q = _read_blocks(done.value(), n_scales)
        average = dequantize_int8(gathered_scales, gathered_q, plan.all_segments)
        tensor.copy_(average[plan.scatter].view_as(tensor))
        return tensor

    first = dist.all_to_all_single(received.view(-1), send.view(-1), group=group, async_op=True).get_future()
    future = state._previous = first.then(serve_and_gather).then(decode)
    return future
