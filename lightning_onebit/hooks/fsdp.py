"""FSDP2 hooks of the compressed optimizers: an all-reduce hook that averages each gradient shard over the replicate
group during warmup and sends nothing afterwards (the sharded counterpart of
:func:`~lightning_onebit.hooks.switchable_allreduce_hook`), and the overlapped exchange, which starts the compressed
momentum exchange of each FSDP group during backward (the sharded counterpart of
:func:`~lightning_onebit.hooks.overlapped_exchange_hook`, :class:`ShardedOverlapState`).

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
    overlap = ShardedOverlapState(optimizer)  # optional: exchange during backward
    overlap.register()
    for x, y in data:
        overlap.new_backward(); loss_fn(model(x), y).backward(); optimizer.step(); optimizer.zero_grad()
"""

from __future__ import annotations

import functools
from typing import TYPE_CHECKING, Any, Callable, Optional

import torch
import torch.distributed as dist

from lightning_onebit.comm.accounting import CommunicationCounters, count_ring_allreduce

if TYPE_CHECKING:
    from lightning_onebit.optim import CompressedOptimizer

__all__ = [
    "ReplicaAllReduceState",
    "ShardedOverlapState",
    "fsdp_managed_parameters",
    "fsdp_modules",
    "register_replica_allreduce_hook",
    "replica_allreduce_hook",
    "sharded_exchange_hook",
]


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


def fsdp_managed_parameters(module: torch.nn.Module) -> Optional[list[torch.Tensor]]:
    """The sharded parameters that an FSDP group of ``module`` (itself included) manages: those ``fully_shard``
    registered, which FSDP all-gathers in forward and reduce-scatters in backward (and whose reduce-scatter output the
    all-reduce hook sees). A ``DTensor`` parameter set on a module after its ``fully_shard`` is in none. ``None``
    where this torch does not say.

    torch has no public accessor for them: read from each FSDP module's state (its param groups' ``fsdp_params``), as
    ``FSDPModule`` itself does (checked on torch 2.13; earlier releases keep one param group per state)."""
    managed: dict[int, torch.Tensor] = {}
    for m in fsdp_modules(module):
        state = m._get_fsdp_state() if hasattr(m, "_get_fsdp_state") else None
        groups = getattr(state, "_fsdp_param_groups", None)
        if groups is None:
            if not hasattr(state, "_fsdp_param_group"):
                return None
            groups = [] if state._fsdp_param_group is None else [state._fsdp_param_group]
        for group in groups:
            for fsdp_param in group.fsdp_params:
                managed.setdefault(id(fsdp_param.sharded_param), fsdp_param.sharded_param)
    return list(managed.values())


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


class ShardedOverlapState:
    """State of :func:`sharded_exchange_hook`: the compressed momentum exchange of each FSDP group started during
    backward, as soon as that group's gradient shards exist.

    FSDP2 reduce-scatters an FSDP group's gradients inside the node as soon as backward has produced them (while
    backward goes on through the layers below), assigns each parameter's sharded gradient, and then calls the
    parameter's post-accumulate-grad hooks: the point FSDP2 offers for optimizer work during backward. The optimizer's
    momentum buckets follow the FSDP groups (one per ``fully_shard`` module,
    :func:`~lightning_onebit.strategy.sharding.fsdp_buckets`), so when the last parameter of a bucket has its gradient,
    the hook folds the bucket's gradient shards into its momenta, compresses them with error feedback and launches the
    first collective of the exchange over the replicate group (on a CUDA side stream); the next bucket launches the
    previous one's second phase (:meth:`~lightning_onebit.optim.CompressedOptimizer.start_bucket_exchange_`, as with
    DDP's buckets). ``optimizer.step()`` then only finishes the exchanges, decodes and applies, with exactly the bits of
    the exchange done in ``step``.

    In warmup (and in 0/1 Adam's full-precision steps) the hook does nothing: :class:`ReplicaAllReduceState` averages
    the gradients. A bucket whose parameters did not all get a gradient in this backward (an unused layer), one whose
    parameters no longer match the momentum layout (``requires_grad`` switched since the last step: change it before
    the forward pass) and the first compressed step (which lays the momenta out) are exchanged by ``step``, as without
    overlap. FSDP groups finish backward in the same order on every node, which is what keeps the launches in the
    same order in every replicate group; a model whose set of parameters that get a gradient differs between nodes
    (data-dependent branches) must turn overlap off.

    Gradients are consumed as backward produces them: anything that changes them after backward (clipping by norm,
    a GradScaler, a hook that edits ``.grad``) cannot run (the Lightning strategy checks this, as for DDP); clipping by
    value can (``clip_value``). Gradient accumulation: FSDP reduces only in the last micro-batch's backward
    (``set_requires_gradient_sync(False)`` before the others), and only that one starts exchanges.

    Args:
        optimizer: the compressed optimizer over the sharded parameters, its momentum buckets laid out like the FSDP
            groups (``set_bucket_plan``) and its exchange over the replicate group (``process_group``). Its
            second-phase groups: install them first (``optimizer.compression.install_gather_groups``) or they are
            created here (a collective over WORLD, every rank calls it).
        clip_value: clip each gradient element to ``[-clip_value, clip_value]`` before folding it; ``None`` (default):
            no clipping.

    Attributes:
        buckets_started: momentum buckets whose exchange the hook started (cumulative).
    """

    def __init__(self, optimizer: "CompressedOptimizer", clip_value: Optional[float] = None) -> None:
        if clip_value is not None and (isinstance(clip_value, bool) or not isinstance(clip_value, (int, float))
                                       or not clip_value >= 0):
            raise ValueError(f"clip_value must be a number >= 0 or None, got {clip_value!r}")
        if optimizer.overlap_unsupported_reason is not None:
            raise ValueError(f"ShardedOverlapState: {optimizer.overlap_unsupported_reason}; exchange in step instead")
        if not optimizer.shards:
            raise ValueError("ShardedOverlapState: the optimizer holds no sharded (DTensor) parameter")
        self.optimizer = optimizer
        self.clip_value = clip_value
        self.buckets_started = 0
        self._handles: list[Any] = []
        self._plan_version = -1
        self._bucket_of: dict[int, int] = {}  # id(DTensor parameter) -> momentum bucket key
        self._members: list[list[torch.Tensor]] = []  # each bucket's DTensor parameters, in bucket order
        self._ready: dict[int, set[int]] = {}  # bucket key -> ids of its parameters with a gradient, this backward
        if not optimizer.compression.has_gather_groups:
            optimizer.compression.create_gather_groups()

    def register(self) -> int:
        """Register the hook on every parameter of the optimizer's momentum buckets (their ``DTensor``); returns how
        many. Raises ``ValueError`` when the optimizer has no bucket plan. :meth:`remove` undoes it."""
        self.remove()
        self._read_plan()
        if not self._members:
            raise ValueError(
                "ShardedOverlapState: the optimizer has no momentum bucket plan: lay its buckets out like the FSDP "
                "groups first (optimizer.set_bucket_plan)"
            )
        hook = functools.partial(sharded_exchange_hook, self)
        self._handles = [p.register_post_accumulate_grad_hook(hook) for bucket in self._members for p in bucket]
        return len(self._handles)

    def remove(self) -> None:
        """Remove the hooks :meth:`register` set."""
        for handle in self._handles:
            handle.remove()
        self._handles = []

    def _read_plan(self) -> None:
        optimizer = self.optimizer
        plan = optimizer.bucket_plan or []
        self._members = [[optimizer.shards.dtensor_of(p) for p in bucket] for bucket in plan]
        if any(p is None for bucket in self._members for p in bucket):
            raise ValueError("ShardedOverlapState: every parameter of the momentum buckets must be sharded (DTensor)")
        self._bucket_of = {id(p): key for key, bucket in enumerate(self._members) for p in bucket}
        self._plan_version = optimizer.plan_version

    def new_backward(self) -> None:
        """Call before each backward pass (the Lightning strategy does, in ``pre_backward``): forget the gradients of
        the last one (a bucket only part of whose parameters got one), and let the optimizer see which parameters
        train now (``requires_grad``), read before any exchange starts, the same on every rank."""
        self._ready = {}
        self.optimizer.shards.follow_requires_grad_()
        if self.optimizer.plan_version != self._plan_version and self._handles:
            self.register()  # the plan changed (e.g. loaded from a checkpoint)


@torch.no_grad()
def sharded_exchange_hook(state: ShardedOverlapState, param: torch.Tensor) -> None:
    """Post-accumulate-grad hook of a sharded parameter (FSDP2 calls it once the parameter's gradient shard is
    assigned): when every parameter of its momentum bucket has its gradient, start the bucket's compressed exchange
    (:class:`ShardedOverlapState`)."""
    optimizer = state.optimizer
    if optimizer.needs_gradient_allreduce:
        return
    key = state._bucket_of.get(id(param))
    if key is None:
        return
    ready = state._ready.setdefault(key, set())
    ready.add(id(param))
    members = state._members[key]
    if len(ready) < len(members):
        return
    del state._ready[key]  # every parameter of the bucket has its gradient (FSDP sets it before calling the hook)
    stand_ins = [optimizer.shards.stand_in_of(p) for p in members]
    gradients = [p.grad.to_local() for p in members]
    started = optimizer.start_bucket_exchange_(key, stand_ins, gradients, clip_value=state.clip_value)
    state.buckets_started += started
    if not started:
        optimizer.progress_exchanges()
