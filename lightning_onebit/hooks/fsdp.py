"""An FSDP2 all-reduce hook that averages each gradient shard over the replicate group during warmup and sends nothing
afterwards: the sharded counterpart of :func:`~lightning_onebit.hooks.switchable_allreduce_hook`.

With a ``("replicate", "shard")`` mesh, ``fully_shard(module, mesh=mesh["shard"])`` reduce-scatters gradients inside
the shard group (one node) and leaves each rank with its shard of the node's average. FSDP2 then calls the hook set with
``FSDPModule.set_all_reduce_hook`` on that flat, padded shard of each FSDP group's gradients (before its post-divide,
which is linear, so the order does not matter). This hook averages the shard over the replicate group (the ranks on
the other nodes that hold the same shard) while the optimizer needs averaged gradients, and leaves the node's average
alone afterwards, when the optimizer averages its compressed momenta instead. (Native HSDP's
``set_requires_all_reduce(False)`` cannot do this: it keeps the partial output for a later accumulation and leaves
``param.grad`` unset.)

Usable without Lightning::

    mesh = init_device_mesh("cuda", (nodes, ranks_per_node), mesh_dim_names=("replicate", "shard"))
    for block in model.blocks:
        fully_shard(block, mesh=mesh["shard"])
    fully_shard(model, mesh=mesh["shard"])
    optimizer = OnebitAdam(model.parameters(), freeze_step=1000, process_group=mesh["replicate"].get_group())
    state = ReplicaAllReduceState(mesh["replicate"].get_group(), lambda: optimizer.needs_gradient_allreduce)
    register_replica_allreduce_hook(model, state)
"""

from __future__ import annotations

import functools
from typing import Callable, Optional

import torch
import torch.distributed as dist

from lightning_onebit.comm.accounting import CommunicationCounters, count_ring_allreduce

__all__ = ["ReplicaAllReduceState", "fsdp_modules", "register_replica_allreduce_hook", "replica_allreduce_hook"]


class ReplicaAllReduceState:
    """State of :func:`replica_allreduce_hook`.

    Args:
        process_group: the replicate group (the ranks holding the same shard on every node).
        sync_predicate: called once per FSDP group per backward; ``True`` averages the shard over the group, ``False``
            leaves it (no communication). Default: always average.

    Attributes:
        counters: bytes of the replica all-reduces on this rank (a ring all-reduce in the gradients' dtype; every
            peer is on another node), and their host time.
        skipped: gradient shards left alone because ``sync_predicate`` returned ``False``.
    """

    def __init__(self, process_group: dist.ProcessGroup, sync_predicate: Optional[Callable[[], bool]] = None) -> None:
        self.process_group = process_group
        self.sync_predicate = sync_predicate or (lambda: True)
        self.counters = CommunicationCounters()
        self.skipped = 0


@torch.no_grad()
def replica_allreduce_hook(state: ReplicaAllReduceState, reduce_output: torch.Tensor) -> None:
    """Average ``reduce_output`` (this rank's flat gradient shard of one FSDP group) over ``state.process_group`` in
    place when ``state.sync_predicate()`` says so; otherwise leave it."""
    if not state.sync_predicate():
        state.skipped += 1
        return
    group = state.process_group
    size = dist.get_world_size(group)
    if size == 1:
        return
    count_ring_allreduce(state.counters, reduce_output, size, dist.get_rank(group), None)
    state.counters.collectives += 1
    state.counters.calls += 1
    dist.all_reduce(reduce_output, group=group)
    reduce_output.div_(size)


def fsdp_modules(module: torch.nn.Module) -> list[torch.nn.Module]:
    """The modules of ``module`` (itself included) that ``fully_shard`` made FSDP modules, in ``modules()`` order."""
    from torch.distributed.fsdp import FSDPModule

    return [m for m in module.modules() if isinstance(m, FSDPModule)]


def register_replica_allreduce_hook(module: torch.nn.Module, state: ReplicaAllReduceState) -> int:
    """Set :func:`replica_allreduce_hook` with ``state`` as the all-reduce hook of every FSDP module in ``module``;
    returns how many. Raises ``ValueError`` when there is none (the model is not sharded)."""
    modules = fsdp_modules(module)
    if not modules:
        raise ValueError("no module was sharded with fully_shard: there is no FSDP all-reduce hook to set")
    hook = functools.partial(replica_allreduce_hook, state)
    for m in modules:
        m.set_all_reduce_hook(hook)
    return len(modules)
