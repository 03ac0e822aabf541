"""The model's side of the ``onebit_fsdp`` strategy: the node mesh (its rank grid and its process groups),
``fully_shard`` over the node (tied weights kept tied), the check that every parameter is sharded there and managed
by an FSDP group, the replicas made identical at setup, and the momentum buckets laid out like FSDP's groups.
Functions of the model, the mesh and the optimizer (no Lightning), so the strategy stays about when to sync."""

from __future__ import annotations

import contextlib
import logging
from datetime import timedelta
from typing import Any, Iterable, Iterator, Optional, Sequence

import torch
import torch.distributed as dist
from torch.nn import Module

from lightning_onebit._docs import docs_pointer
from lightning_onebit.comm.groups import BROADCAST_BUCKET_BYTES, broadcast_coalesced, new_group_family
from lightning_onebit.comm.topology import Topology
from lightning_onebit.hooks.fsdp import fsdp_managed_parameters, fsdp_modules
from lightning_onebit.optim import CompressedOptimizer
from lightning_onebit.optim.sharded import is_sharded

log = logging.getLogger(__name__)


def node_mesh_ranks(placements: Sequence[tuple[int, int]], ranks_per_node: Optional[int],
                    strategy: str = "onebit_fsdp") -> list[list[int]]:
    """The ``(M, L)`` rank grid of the ``("replicate", "shard")`` mesh: row ``n`` is node ``n``'s ranks by local index.
    ``placements``: every rank's ``(node_rank, local_rank)``; ``ranks_per_node`` overrides them (ranks ``kL .. kL +
    L - 1`` form node ``k``). Raises ``ValueError`` (pure: before any collective) for one node or uneven nodes, saying
    what to use instead (``strategy``: the strategy's name, for the message). One rank per node is allowed (nothing
    is sharded; ``onebit_adam`` does the same with less overhead, which the strategy logs)."""
    if ranks_per_node is not None and len(placements) % ranks_per_node:
        raise ValueError(
            f"strategy={strategy!r} needs nodes of equal size, but ranks_per_node={ranks_per_node} does not divide "
            f"the {len(placements)} ranks: pass a ranks_per_node that divides the world size"
        )
    topology = Topology.plan(placements, "auto", ranks_per_node=ranks_per_node)
    sizes = topology.node_sizes
    if topology.num_nodes == 1 or len(set(sizes)) != 1:
        why = (f"all {topology.world_size} ranks are on one node" if topology.num_nodes == 1
               else f"nodes have uneven numbers of ranks {list(sizes)}")
        raise ValueError(
            f"strategy={strategy!r} shards the model inside each node and compresses across nodes, so it needs "
            f"several nodes with the same number of ranks each, but {why}. On one node there is nothing to "
            "compress: use FSDP2 with a plain optimizer (strategy=ModelParallelStrategy()), or strategy='onebit_adam' "
            "to compress between the ranks; to simulate nodes on one host pass ranks_per_node. "
            f"{docs_pointer('guides/sharded-training')}"
        )
    return [list(topology.node_ranks(node)) for node in range(topology.num_nodes)]


def node_device_mesh(device_type: str, grid: Sequence[Sequence[int]], timeout: Optional[timedelta]) -> Any:
    """The ``("replicate", "shard")`` ``DeviceMesh`` of the rank ``grid`` (:func:`node_mesh_ranks`: row ``n`` is node
    ``n``), its groups made with ``timeout``: a collective over WORLD (every rank calls it, with the same grid).

    ``DeviceMesh(...)`` and ``init_device_mesh`` give their groups torch's default timeout (30 minutes on gloo)
    whatever WORLD's: a stalled rank then held its node's FSDP collectives and its replicate group's exchange for half
    an hour. So the groups are made here (the columns, then the rows; :func:`~lightning_onebit.comm.groups.
    new_group_family`, ``None``: WORLD's timeout) and the mesh built from them (``DeviceMesh.from_group``)."""
    from torch.distributed.device_mesh import DeviceMesh

    rows = [list(row) for row in grid]
    columns = [list(column) for column in zip(*rows)]
    replicate = new_group_family(columns, None, timeout)
    shard = new_group_family(rows, None, timeout)
    return DeviceMesh.from_group([replicate, shard], device_type, mesh=torch.tensor(rows),
                                 mesh_dim_names=("replicate", "shard"))


def shard_model(model: Module, mesh: Any, shard_modules: tuple[type[Module], ...], mixed_precision: Any) -> None:
    """``fully_shard`` over ``mesh`` (the node's shard mesh, with FSDP2's ``mixed_precision`` policy if any) every
    instance of ``shard_modules`` (children before parents), then every direct child of
    the LightningModule that still holds unsharded parameters (the modules ``training_step`` calls, e.g.
    ``self.bert``: FSDP gathers a module's parameters in its own forward, and ``training_step`` need not call the
    LightningModule's ``forward``), then the LightningModule itself if parameters are left (its own, or tied ones).

    Tied weights stay tied: a module holding a parameter that a module outside it holds too (an embedding shared with
    the output layer) is not sharded on its own, which would give each module a parameter of its own; the parameter
    goes to the FSDP group of the first candidate above that holds every module sharing it (for an embedding and an
    output layer that are children of the LightningModule: the LightningModule, whose ``forward`` must then be what
    ``training_step`` calls). Logged once, naming the parameters."""
    from torch.distributed.fsdp import FSDPModule, fully_shard

    kwargs = {} if mixed_precision is None else {"mp_policy": mixed_precision}
    chosen = [m for m in model.modules() if isinstance(m, shard_modules) and not isinstance(m, FSDPModule)]
    if not chosen:
        classes = ", ".join(c.__name__ for c in shard_modules)
        raise ValueError(f"shard_modules ({classes}) matched no module of {type(model).__name__}")
    holders = _holders_of_tied_parameters(model)
    names: dict[int, str] = {}  # a tied parameter under each of its names: "embed.weight = head.weight"
    for name, p in model.named_parameters(remove_duplicate=False):
        names[id(p)] = f"{names[id(p)]} = {name}" if id(p) in names else name
    left_for_ties: dict[str, list[str]] = {}

    def shard_unless_it_unties(module: Module, name: str) -> None:
        tied = _tied_outside(module, holders)
        if tied:
            left_for_ties[name or type(module).__name__] = [names[id(p)] for p in tied]
            return
        fully_shard(module, mesh=mesh, **kwargs)

    module_names = {id(m): name for name, m in model.named_modules()}
    for module in reversed(chosen):  # modules() lists parents first
        shard_unless_it_unties(module, module_names.get(id(module), ""))
    for child_name, child in model.named_children():
        if not isinstance(child, FSDPModule) and any(not is_sharded(p) for p in child.parameters()):
            shard_unless_it_unties(child, child_name)
    if any(not is_sharded(p) for p in model.parameters()) and not isinstance(model, FSDPModule):
        fully_shard(model, mesh=mesh, **kwargs)
    if left_for_ties:
        tied = sorted({name for found in left_for_ties.values() for name in found})
        log.info(
            "onebit_fsdp: %s hold parameters shared with other modules (tied weights: %s); they are sharded with an "
            "FSDP group that holds every module sharing them, so that the weights stay tied",
            ", ".join(left_for_ties), ", ".join(tied),
        )


def _holders_of_tied_parameters(model: Module) -> dict[int, set[int]]:
    """``id`` of each parameter that several modules hold directly -> the ``id`` s of those modules."""
    holders: dict[int, set[int]] = {}
    for module in model.modules():
        for p in module.parameters(recurse=False):
            holders.setdefault(id(p), set()).add(id(module))
    return {key: modules for key, modules in holders.items() if len(modules) > 1}


def _tied_outside(module: Module, holders: dict[int, set[int]]) -> list[torch.Tensor]:
    """The parameters of ``module`` that a module outside it holds too (sharding ``module`` alone would untie them)."""
    if not holders:
        return []
    inside = {id(m) for m in module.modules()}
    return [p for p in module.parameters() if not holders.get(id(p), set()) <= inside]


def broadcast_from_first_replica(model: Module, replicate_group: Any,
                                 bucket_bytes: int = BROADCAST_BUCKET_BYTES) -> int:
    """Make the replicas identical, as DDP does at setup: each parameter's local shard is broadcast over
    ``replicate_group`` (the ranks that hold the same shard on every node) from its first rank, and the module's
    buffers (FSDP2 does not shard them: every rank holds them whole) over WORLD from rank 0.

    Without it, processes that build the model from different random states (no ``seed_everything``) train different
    models on each node from the first step. Tensors are packed per device and dtype into flat buffers of at most
    ``bucket_bytes`` (a tensor larger than that alone): one broadcast per buffer. A collective: every rank calls it
    with the same model, after sharding and before training. Returns how many broadcasts it made."""
    shards = [p.to_local() for p in model.parameters() if is_sharded(p)]
    buffers = list(model.buffers())
    with torch.no_grad():
        count = broadcast_coalesced(shards, replicate_group, bucket_bytes)
        count += broadcast_coalesced(buffers, None, bucket_bytes)
    return count


def check_sharded(model: Module, shard_mesh: Any) -> None:
    """Every parameter must be a ``DTensor`` sharded over ``shard_mesh`` (the strategy's) and managed by an FSDP group:
    raise ``ValueError`` (on every rank, before any collective of training) naming the parameters that are not
    sharded, whose mesh spans nodes, or that no FSDP group manages (their gradients would never be averaged)."""
    node = set(dist.get_process_group_ranks(shard_mesh.get_group()))
    unsharded, spanning = [], []
    for name, p in model.named_parameters():
        if not is_sharded(p):
            unsharded.append(name)
        elif p.device_mesh != shard_mesh:
            ranks = set(p.device_mesh.mesh.flatten().tolist())
            (spanning if not ranks <= node else unsharded).append(name)
    if spanning:
        raise ValueError(
            f"parameters {_names(spanning)} are sharded over a mesh that spans nodes: their reduce-scatters and "
            "all-gathers would cross the slow link in full precision. Shard with the node's mesh, "
            "fully_shard(module, mesh=self.device_mesh['shard'])"
        )
    if unsharded:
        raise ValueError(
            f"parameters {_names(unsharded)} are not sharded over the strategy's shard mesh: wrap their modules "
            "with fully_shard(module, mesh=self.device_mesh['shard']) in configure_model (or name their classes in "
            "OnebitFSDPStrategy(shard_modules=[...])), and the root module last"
        )
    if not fsdp_modules(model):
        raise ValueError("the model has no module sharded with fully_shard")
    managed = fsdp_managed_parameters(model)
    known = {id(p) for p in managed} if managed is not None else None
    unmanaged = [name for name, p in model.named_parameters() if known is not None and id(p) not in known]
    if unmanaged:
        raise ValueError(
            f"parameters {_names(unmanaged)} are sharded over the shard mesh, but no FSDP group manages them (set on "
            "a module after fully_shard was called on it): FSDP would neither gather nor reduce-scatter them, and "
            "their gradients would never be averaged across nodes. Create them before the fully_shard call of the "
            "module that holds them (e.g. in __init__), or shard a module that holds them with "
            "fully_shard(module, mesh=self.device_mesh['shard']) after they exist"
        )


def point_at_sharded_parameters(
    optimizer: Any, model: Module, names_before_sharding: dict[int, tuple[Any, str]], strategy: str = "onebit_fsdp"
) -> None:
    """An optimizer built from the parameters as they were before sharding (LightningCLI builds its optimizer
    from ``model.parameters()`` before ``fit``) gets the sharded ones of the same names, in the same groups. It
    must not have stepped yet; any other foreign parameter is a ``ValueError``. ``names_before_sharding``: ``id`` of
    each parameter before sharding -> (a weak reference to it, its name). ``optimizer``: a
    :class:`~lightning_onebit.optim.CompressedOptimizer` (whose stand-ins of sharded parameters are its own) or any
    torch optimizer."""
    current = dict(model.named_parameters())
    held = {id(p) for p in current.values()}
    shards = getattr(optimizer, "shards", None)
    groups = optimizer.param_groups
    if all(id(p) in held or (shards is not None and shards.dtensor_of(p) is not None)
           for g in groups for p in g["params"]):
        return
    if optimizer.state:
        raise ValueError(f"{type(optimizer).__name__} holds parameters from before sharding and has state already: "
                         "create it in configure_optimizers from self.parameters()")
    rebuilt = []
    for group in groups:
        params = []
        for p in group["params"]:
            ref, name = names_before_sharding.get(id(p), (None, None))
            if ref is None or ref() is not p or name not in current:
                raise ValueError(
                    f"{type(optimizer).__name__} holds a parameter that is not the model's: create it in "
                    "configure_optimizers from self.parameters()"
                )
            params.append(current[name])
        rebuilt.append({**{k: v for k, v in group.items() if k not in ("params", "exp_avg_mask")},
                        "params": params})
    optimizer.param_groups.clear()
    for group in rebuilt:
        optimizer.add_param_group(group)
    log.info("%s: %s was built from the parameters before sharding; it now holds the sharded ones", strategy,
             type(optimizer).__name__)


def fsdp_buckets(model: Module, optimizer: CompressedOptimizer) -> list[list[torch.Tensor]]:
    """One momentum bucket per FSDP group: each ``fully_shard`` module's own parameters (not those of a nested
    FSDP module) that the optimizer compresses and trains."""
    held = {id(p) for group in optimizer.param_groups if group["compress"] for p in group["params"]}
    buckets = []
    for module in fsdp_modules(model):
        nested = {id(p) for child in fsdp_modules(module) if child is not module for p in child.parameters()}
        own = [p for p in module.parameters() if id(p) not in nested and p.requires_grad]
        own = [p for p in own if id(optimizer.shards.stand_in_of(p)) in held]
        if own:
            buckets.append(own)
    return buckets


@contextlib.contextmanager
def no_gradient_sync(model: Optional[Module]) -> Iterator[None]:
    """No reduce-scatter inside the node for the backward passes run meanwhile (the micro-batches before the last of
    an accumulation): every FSDP group of ``model`` keeps its unsharded gradients to accumulate into."""
    modules = fsdp_modules(model) if model is not None else []
    for module in modules:
        module.set_requires_gradient_sync(False, recurse=False)
    try:
        yield
    finally:
        for module in modules:
            module.set_requires_gradient_sync(True, recurse=False)


def _names(names: list[str], shown: int = 6) -> str:
    more = len(names) - shown
    return ", ".join(names[:shown]) + (f" and {more} more" if more > 0 else "")
