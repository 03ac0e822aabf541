"""torch's PowerSGD DDP comm hook with its buckets compressed one after another and its bytes counted.

torch's ``powerSGD_hook`` (``torch.distributed.algorithms.ddp_comm_hooks.powerSGD_hook``; Vogels et al., arXiv
1905.13727) replaces a bucket's allreduce, from iteration ``start_powerSGD_iter`` on, by three allreduces: the tensors
it leaves uncompressed (vectors, and matrices too small to gain), then ``P = M Q`` of every compressed matrix ``M``
(``n x m`` viewed as such, rank ``r = min(n, m, matrix_approximation_rank)``: ``n r`` elements), then ``Q = M^T P``
(``m r`` elements); the bucket becomes ``P Q^T``, and with error feedback the difference is added to the bucket's next
gradient. The second and third allreduces are launched from callbacks of the one before, on the backend's threads.
With several DDP buckets, the next bucket's first allreduce (launched by the autograd thread) can then come before or
after them, differently on each rank; gloo matches collectives by issue order and fails ("Received data size doesn't
match expected size"). :func:`ordered_powersgd_hook` starts a compressed bucket only after the previous bucket's
future completed, which makes the order the bucket order on every rank (it costs the overlap of one compressed bucket
with the backward pass of the next; the vanilla allreduces before ``start_powerSGD_iter`` are not delayed).

Bytes (:attr:`OrderedPowerSGDState.counters`), counted when the hook is called, as ring allreduces in the gradient's
dtype: before ``start_powerSGD_iter`` one allreduce of the bucket; after it, three, of the uncompressed elements,
``sum n r`` and ``sum m r`` elements (which tensors are compressed is decided as the hook decides it: a matrix whose
``(n + m) r * min_compression_rate`` is below ``n m``). ``bytes_fp32_equivalent`` is the bucket's fp32 ring
allreduce either way.

Usage, as the warmup exchange of 1-bit Adam or with plain DDP::

    from torch.distributed.algorithms.ddp_comm_hooks.powerSGD_hook import PowerSGDState
    state = OrderedPowerSGDState(PowerSGDState(None, matrix_approximation_rank=4, start_powerSGD_iter=10))
    OnebitStrategy(ddp_comm_hook=ordered_powersgd_hook, ddp_comm_state=state)
    # or: ddp_model.register_comm_hook(state, ordered_powersgd_hook)
"""

# No `from __future__ import annotations`: DDP checks the hook's annotations as real objects.
from typing import Optional

import torch
import torch.distributed as dist
from torch.distributed.algorithms.ddp_comm_hooks import powerSGD_hook as torch_powersgd

from lightning_onebit.comm.accounting import CommunicationCounters, count_ring_bytes, ring_allreduce_bytes
from lightning_onebit.comm.topology import Topology


def powersgd_allreduce_numels(state: "torch_powersgd.PowerSGDState", shapes: list) -> tuple[int, int, int]:
    """``(uncompressed, P, Q)``: the elements of the three allreduces ``powerSGD_hook`` makes for a bucket of
    gradients of ``shapes`` once compressing (each tensor viewed as ``shape[0] x rest``; see the module docstring)."""
    uncompressed = p_numel = q_numel = 0
    for shape in shapes:
        n = int(shape[0]) if len(shape) else 1
        numel = 1
        for size in shape:
            numel *= int(size)
        m = numel // n if n else 0
        rank = min(n, m, state.matrix_approximation_rank)
        if (n + m) * rank * state.min_compression_rate < n * m:
            p_numel, q_numel = p_numel + n * rank, q_numel + m * rank
        else:
            uncompressed += numel
    return uncompressed, p_numel, q_numel


class OrderedPowerSGDState:
    """State of :func:`ordered_powersgd_hook`: torch's ``PowerSGDState`` and this rank's byte counters.

    Args:
        state: torch's ``PowerSGDState`` (its process group, ``matrix_approximation_rank``, ``start_powerSGD_iter``,
            ``min_compression_rate``, ``use_error_feedback``, ``warm_start``: torch's meanings and defaults; torch
            requires ``start_powerSGD_iter >= 2`` with error feedback or warm start, as DDP rebuilds its buckets
            after the first iteration).
        topology: which ranks share a node, to split ``bytes_sent`` into intra- and inter-node bytes as a ring
            allreduce sends them (to the next rank); ``None`` (default): all inter-node.

    Attributes:
        powersgd: the ``PowerSGDState``.
        counters: this rank's bytes (:class:`~lightning_onebit.comm.CommunicationCounters`), counted when the hook is
            called (the module docstring says how); :class:`~lightning_onebit.hooks.GradientSyncState` adds them to
            the warmup's counters when this state is its ``averaging_hook_state``.
        vanilla_buckets, compressed_buckets: buckets averaged by a plain allreduce (before ``start_powerSGD_iter``)
            and by PowerSGD.
    """

    def __init__(self, state: "torch_powersgd.PowerSGDState", topology: Optional[Topology] = None) -> None:
        if not isinstance(state, torch_powersgd.PowerSGDState):
            raise ValueError(f"OrderedPowerSGDState takes torch's PowerSGDState, got {type(state).__name__}; build "
                             "it with torch.distributed.algorithms.ddp_comm_hooks.powerSGD_hook.PowerSGDState(...)")
        self.powersgd = state
        self.topology = topology
        self.counters = CommunicationCounters()
        self.vanilla_buckets = 0
        self.compressed_buckets = 0
        self._previous: Optional[torch.futures.Future] = None

    def _count(self, bucket: dist.GradBucket, compress: bool) -> None:
        group = self.powersgd.process_group
        world_size, rank = dist.get_world_size(group), dist.get_rank(group)
        tensor = bucket.buffer()
        size = tensor.element_size()
        if compress:
            numels = powersgd_allreduce_numels(self.powersgd, [g.shape for g in bucket.gradients()])
        else:
            numels = (tensor.numel(),)
        for numel in numels:
            count_ring_bytes(self.counters, ring_allreduce_bytes(numel, size, world_size), world_size, rank,
                             self.topology)
        self.counters.bytes_fp32_equivalent += ring_allreduce_bytes(tensor.numel(), 4, world_size)
        self.counters.collectives += len(numels)
        self.counters.calls += 1


def ordered_powersgd_hook(state: OrderedPowerSGDState, bucket: dist.GradBucket) -> torch.futures.Future[torch.Tensor]:
    """torch's ``powerSGD_hook(state.powersgd, bucket)``, started once the previous bucket's hook has completed when
    this bucket is compressed, and counted in ``state.counters`` (see the module docstring)."""
    powersgd = state.powersgd
    compress = powersgd.iter >= powersgd.start_powerSGD_iter
    if compress and state._previous is not None:
        state._previous.wait()  # the previous bucket's three allreduces are issued: this bucket's come after them
    state._count(bucket, compress)
    if compress:
        state.compressed_buckets += 1
    else:
        state.vanilla_buckets += 1
    future = state._previous = torch_powersgd.powerSGD_hook(powersgd, bucket)
    return future
