"""The process groups a strategy makes and owns: the topology's node groups and the overlapped exchange's
second-phase groups, made once per process group (making them is a collective) and reused by every later ``fit``, and
the optimizers they were handed to, so that every one of them can be detached when the groups go; and their release
at interpreter exit (:func:`release_process_groups_at_exit`).

The owner holds the groups, the gradient sync's state and the optimizers' references, never the strategy, so that it
closes no reference cycle (see :func:`release_process_groups_at_exit` for why that matters at interpreter exit)."""

from __future__ import annotations

import atexit
import logging
import weakref
from datetime import timedelta
from typing import Any, Callable, Optional

import torch.distributed as dist
from lightning.fabric.plugins import ClusterEnvironment
from lightning.pytorch.utilities.rank_zero import rank_zero_info

from lightning_onebit._docs import docs_pointer
from lightning_onebit.comm.groups import destroy_groups, is_distributed
from lightning_onebit.comm.topology import new_gather_groups
from lightning_onebit.comm.topology import Topology, TopologyMode
from lightning_onebit.hooks import GradientSyncState, ParameterKeyedState
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
    to, and the optimizers (one per ``fit``, weakly) that were handed them.

    Args:
        gradient_sync: the strategy's warmup allreduce state, which holds DDP's process group and the topology too.
        warmup_state: the warmup exchange's state the strategy built (``warmup_exchange="int8"``/``"powersgd"``),
            which holds them too; ``None``: none. Default ``None``.
    """

    def __init__(self, gradient_sync: GradientSyncState, warmup_state: Optional[ParameterKeyedState] = None) -> None:
        self.gradient_sync = gradient_sync
        self.warmup_state = warmup_state
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
        """Detach every optimizer still alive (this ``fit``'s and earlier ones') and the gradient sync from the groups
        about to go. They stay remembered (weakly): at interpreter exit they drop DDP's group too
        (:meth:`release_at_exit`)."""
        for optimizer in list(self._optimizers):  # this fit's and earlier fits' that are still alive
            optimizer.compression.release_gather_groups()
            if optimizer.topology is not None and optimizer.topology.groups:
                optimizer.topology = None  # its groups are about to go (this resets the optimizer's error feedback)
        self.gradient_sync.topology = None
        if self.warmup_state is not None:
            self.warmup_state.topology = None

    def release_at_exit(self) -> None:
        """At interpreter exit: drop every reference of ours to DDP's process group (WORLD; the optimizers' and the
        gradient sync's), detach the optimizers and destroy every group made. Once torch has destroyed WORLD too,
        nothing of ours keeps its gloo backend, and with it its threads, alive into the process's C++ exit. A process
        that goes on keeps them (a later ``fit`` uses them again): this runs at exit only."""
        for optimizer in list(self._optimizers):
            optimizer.process_group = None
        self.gradient_sync.process_group = None
        if self.warmup_state is not None:
            self.warmup_state.process_group = None
        if isinstance(self.gradient_sync.averaging_hook_state, dist.ProcessGroup):  # the bf16 hook's state
            self.gradient_sync.averaging_hook_state = None
        self.detach_optimizers()
        self.destroy()

    def destroy(self) -> None:
        """Destroy every group made (no collective on gloo; in creation order, as NCCL wants on every rank)."""
        owned, self._owned = self._owned, []
        self.topology, self._made_for, self._gather = None, None, None
        destroyed = destroy_groups(owned)
        if destroyed:
            log.debug("onebit_adam: destroyed %d process group(s)", destroyed)


#: Owners of process groups that may still hold them at interpreter exit (weakly: one freed earlier holds none).
_LIVE_OWNERS: "weakref.WeakSet[OwnedProcessGroups]" = weakref.WeakSet()
_EXIT_HANDLER_REGISTERED = False


def release_at_exit(owner: OwnedProcessGroups) -> None:
    """Have ``owner``'s groups released at interpreter exit (:func:`release_process_groups_at_exit`, registered with
    ``atexit`` once)."""
    global _EXIT_HANDLER_REGISTERED
    _LIVE_OWNERS.add(owner)
    if not _EXIT_HANDLER_REGISTERED:
        atexit.register(release_process_groups_at_exit)
        _EXIT_HANDLER_REGISTERED = True


def release_process_groups_at_exit() -> None:
    """At interpreter exit, while the interpreter is still whole: every live owner of groups drops DDP's group and
    destroys the groups it made, with its optimizers detached (:meth:`OwnedProcessGroups.release_at_exit`), then WORLD
    is destroyed if still initialised (Lightning does that for NCCL only).

    Why: ``dist.destroy_process_group`` only unregisters a group; a gloo group stops its threads when its C++ object is
    freed, i.e. when the last Python reference to it goes. If that is during interpreter finalization (the trainer in
    a module global, or objects in a reference cycle that the final garbage collection meets), a thread that needs the
    GIL then is ended by the interpreter, and the forced unwind through C++ calls ``std::terminate``: "terminate called
    without an active exception" (SIGABRT, exit code 134) after training had succeeded, and the launcher reports a
    failed job. Unregistered by torch and no longer referenced by the strategy or its optimizers, the strategy's
    groups, and DDP's (WORLD, which the strategy's gradient sync and every optimizer it attached also hold), are
    freed here, by reference counting: no ``gc.collect()`` is needed, because none of them is held in a
    reference cycle (the DDP comm hook's state holds no strategy, :class:`~lightning_onebit.hooks.OverlapState` holds
    DDP weakly). Whatever else the program holds (its own references to WORLD) it keeps; those threads then live on,
    idle, as they would without this library.
    """
    for owner in list(_LIVE_OWNERS):
        owner.release_at_exit()
    if is_distributed():
        dist.destroy_process_group()
