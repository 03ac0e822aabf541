"""The process groups a strategy makes and owns: the topology's node groups and the overlapped exchange's
second-phase groups, made once per process group (making them is a collective) and reused by every later ``fit``, and
the optimizers they were handed to, so that every one of them can be detached when the groups go.

The owner holds the groups and the optimizers' references, never the strategy, so that it closes no reference cycle
(see :mod:`lightning_onebit.strategy.teardown` for why that matters at interpreter exit)."""

from __future__ import annotations

import logging
import weakref
from datetime import timedelta
from typing import Any, Callable, Optional

from lightning.fabric.plugins import ClusterEnvironment
from lightning.pytorch.utilities.rank_zero import rank_zero_info

from lightning_onebit._docs import docs_pointer
from lightning_onebit.comm.groups import destroy_groups
from lightning_onebit.comm.topology import new_gather_groups
from lightning_onebit.comm.topology import Topology, TopologyMode
from lightning_onebit.optim import CompressedOptimizer

log = logging.getLogger(__name__)


def build_topology(
    env: ClusterEnvironment,
    mode: TopologyMode,
    ranks_per_node: Optional[int],
    process_group: Any,
    timeout: Optional[timedelta],
) -> Topology:
    """Every rank's ``(node_rank, local_rank)`` from the cluster environment ``env``, gathered, and the process groups
    of the exchange ``mode`` chooses, with ``timeout`` (a collective: every rank calls it); the choice is logged."""
    topology = Topology.build(
        node_rank=env.node_rank(),
        local_rank=env.local_rank(),
        mode=mode,
        ranks_per_node=ranks_per_node,
        group=process_group,
        timeout=timeout,  # a stalled rank fails its peers' collectives in these groups too, not in 30 min
    )
    rank_zero_info(
        f"onebit_adam: {topology.mode} momentum exchange ({topology.reason}); {docs_pointer('guides/multi-node')}"
    )
    return topology


class OwnedProcessGroups:
    """The process groups one strategy made, in creation order (destroyed in it), the :class:`Topology` they belong
    to, and the optimizers (one per ``fit``, weakly) that were handed them."""

    def __init__(self) -> None:
        self.topology: Optional[Topology] = None
        self._made_for: Any = None  # the process group self.topology and the groups below were made for
        self._gather: Optional[tuple[Any, Any]] = None  # the overlapped exchange's second phase (inter, intra)
        self._owned: list[Any] = []  # every group made, in creation order (destroyed in it)
        # every optimizer that was handed these groups (one per fit), to detach them all when the groups go, and
        # from DDP's group at interpreter exit
        self._optimizers: "weakref.WeakSet[CompressedOptimizer]" = weakref.WeakSet()

    @property
    def groups(self) -> tuple[Any, ...]:
        """Every group made and not yet destroyed, in creation order."""
        return tuple(self._owned)

    def topology_for(self, process_group: Any, build: Callable[[Any], Topology]) -> Topology:
        """The topology for ``process_group``: the one made before when it was made for this process group, else
        ``build(process_group)`` (a collective), the groups made for an earlier process group destroyed first."""
        if self.topology is None or self._made_for is not process_group:
            # Once per process group: creating its node groups is a collective, and they are reused by every later
            # fit (groups made for an earlier process group are destroyed first).
            self.destroy()
            self.topology = build(process_group)
            self._made_for = process_group
            self._owned.extend(self.topology.groups)
        return self.topology

    def attach(self, optimizer: CompressedOptimizer, process_group: Any, build: Callable[[Any], Topology]) -> None:
        """Hand ``optimizer`` DDP's ``process_group`` and the topology for it (:meth:`topology_for`), and remember it,
        to detach it when the groups go."""
        optimizer.process_group = process_group
        optimizer.topology = self.topology_for(process_group, build)
        self._optimizers.add(optimizer)

    def gather_groups(self, process_group: Any, timeout: Optional[timedelta]) -> tuple[Any, Any]:
        """The overlapped exchange's second-phase groups ``(inter, intra)`` for the topology, made at the first call
        (a collective) and reused by every later ``fit``'s optimizer (``OverlapState`` would otherwise make new ones
        for each)."""
        if self._gather is None:
            self._gather = new_gather_groups(process_group, self.topology, timeout)
            self._owned.extend(g for g in self._gather if g is not None)
        return self._gather

    def detach_optimizers(self) -> None:
        """Detach every optimizer still alive (this ``fit``'s and earlier ones') from the groups about to go. They
        stay remembered (weakly): at interpreter exit they drop DDP's group too (:meth:`release_ddp_group`)."""
        for optimizer in list(self._optimizers):  # this fit's and earlier fits' that are still alive
            optimizer.compression.release_gather_groups()
            if optimizer.topology is not None and optimizer.topology.groups:
                optimizer.topology = None  # its groups are about to go (this resets the optimizer's error feedback)

    def release_ddp_group(self) -> None:
        """Drop the optimizers' references to DDP's process group."""
        for optimizer in list(self._optimizers):
            optimizer.process_group = None

    def destroy(self) -> None:
        """Destroy every group made (no collective on gloo; in creation order, as NCCL wants on every rank)."""
        owned, self._owned = self._owned, []
        self.topology, self._made_for, self._gather = None, None, None
        destroyed = destroy_groups(owned)
        if destroyed:
            log.debug("onebit_adam: destroyed %d process group(s)", destroyed)
