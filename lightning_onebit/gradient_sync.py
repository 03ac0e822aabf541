"""A DDP communication hook that averages gradients during warmup and sends nothing afterwards.

1-bit Adam needs DDP's gradient allreduce only during warmup; in the compression stage each rank keeps its local
gradient and the optimizer averages compressed momenta instead. The switch is a predicate consulted for every
bucket of every backward, so it follows the optimizer's own step, including right after a checkpoint is restored.

Used by :class:`lightning_onebit.OnebitAdamStrategy`, and usable with plain DDP::

    state = GradientSyncState(process_group=None, sync_predicate=lambda: optimizer.needs_gradient_allreduce)
    ddp_model.register_comm_hook(state, switchable_allreduce_hook)
"""

# No `from __future__ import annotations`: DDP checks the hook's annotations as real objects.
import time
from typing import Callable, Optional

import torch
import torch.distributed as dist

from lightning_onebit.comm import CommunicationCounters, ring_allreduce_bytes
from lightning_onebit.topology import Topology


class GradientSyncState:
    """State of :func:`switchable_allreduce_hook`.

    Args:
        process_group: group to average over; ``None`` means WORLD.
        sync_predicate: called once per bucket per backward; ``True`` averages the bucket across ranks, ``False``
            leaves the local gradient untouched (no communication). Defaults to always averaging.
        topology: which ranks share a node (a :class:`~lightning_onebit.Topology` over ``process_group``), to split
            ``bytes_sent`` into intra- and inter-node bytes: a ring allreduce sends everything to the next rank, so a
            rank's bytes cross the node boundary when that rank is on another node. ``None``: all count as inter-node.

    Attributes:
        counters: bytes and time of the warmup allreduces on this rank (``bytes_sent`` counts a ring allreduce in the
            gradient's dtype; ``time_s`` is launch-to-completion time, which overlaps the backward pass).
        skipped_buckets: buckets left local because ``sync_predicate`` returned ``False``.
    """

    def __init__(
        self,
        process_group: Optional[dist.ProcessGroup] = None,
        sync_predicate: Optional[Callable[[], bool]] = None,
        topology: Optional[Topology] = None,
    ) -> None:
        self.process_group = process_group
        self.sync_predicate = sync_predicate or (lambda: True)
        self.topology = topology
        self.counters = CommunicationCounters()
        self.skipped_buckets = 0


def switchable_allreduce_hook(state: GradientSyncState, bucket: dist.GradBucket) -> torch.futures.Future[torch.Tensor]:
    """DDP comm hook: ``mean`` allreduce of the bucket when ``state.sync_predicate()``, else the local bucket as is."""
    tensor = bucket.buffer()
    if not state.sync_predicate():
        state.skipped_buckets += 1
        local = torch.futures.Future()
        local.set_result(tensor)
        return local

    world_size = dist.get_world_size(state.process_group)
    counters = state.counters
    sent = ring_allreduce_bytes(tensor.numel(), tensor.element_size(), world_size)
    counters.bytes_sent += sent
    counters.bytes_received += sent
    topology = state.topology
    rank = dist.get_rank(state.process_group)
    if topology is not None and topology.same_node(rank, (rank + 1) % world_size):
        counters.bytes_sent_intra_node += sent
    else:
        counters.bytes_sent_inter_node += sent
    counters.bytes_fp32_equivalent += ring_allreduce_bytes(tensor.numel(), 4, world_size)
    counters.collectives += 1
    counters.calls += 1
    started = time.perf_counter()
    tensor.div_(world_size)
    future = dist.all_reduce(tensor, group=state.process_group, async_op=True).get_future()

    def finish(done: torch.futures.Future) -> torch.Tensor:
        counters.time_s += time.perf_counter() - started
        return done.value()[0]

    return future.then(finish)
