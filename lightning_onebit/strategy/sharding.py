"""The model's side of the ``onebit_fsdp`` strategy: the node mesh's rank grid, ``fully_shard`` over the node, the
check that every parameter is sharded there, and the momentum buckets laid out like FSDP's groups. Pure functions of
the model, the mesh and the optimizer (no Lightning), so the strategy stays about when to sync."""

from __future__ import annotations

import logging
from typing import Any, Optional, Sequence

import torch
import torch.distributed as dist
from torch.nn import Module

from lightning_onebit._docs import docs_pointer
from lightning_onebit.comm.topology import Topology
from lightning_onebit.hooks.fsdp import fsdp_modules
from lightning_onebit.optim import CompressedOptimizer
from lightning_onebit.optim.sharded import is_sharded

log = logging.getLogger(__name__)


def node_mesh_ranks(placements: Sequence[tuple[int, int]], ranks_per_node: Optional[int]) -> list[list[int]]:
    """The ``(M, L)`` rank grid of the ``("replicate", "shard")`` mesh: row ``n`` is node ``n``'s ranks by local index.
    ``placements``: every rank's ``(node_rank, local_rank)``; ``ranks_per_node`` overrides them (ranks ``kL .. kL +
    L - 1`` form node ``k``). Raises ``ValueError`` (pure: before any collective) for one node or uneven nodes, saying
    what to use instead. One rank per node is allowed (nothing is sharded; ``onebit_adam`` does the same with less
    overhead, which the strategy logs)."""
    if ranks_per_node is not None and len(placements) % ranks_per_node:
        raise ValueError(
            f"strategy='onebit_fsdp' needs nodes of equal size, but ranks_per_node={ranks_per_node} does not divide "
            f"the {len(placements)} ranks: pass a ranks_per_node that divides the world size"
        )
    topology = Topology.plan(placements, "auto", ranks_per_node=ranks_per_node)
    sizes = topology.node_sizes
    if topology.num_nodes == 1 or len(set(sizes)) != 1:
        why = (f"all {topology.world_size} ranks are on one node" if topology.num_nodes == 1
               else f"nodes have uneven numbers of ranks {list(sizes)}")
        raise ValueError(
            f"strategy='onebit_fsdp' shards the model inside each node and compresses across nodes, so it needs "
            f"several nodes with the same number of ranks each, but {why}. On one node there is nothing to "
            "compress: use FSDP2 with a plain optimizer (strategy=ModelParallelStrategy()), or strategy='onebit_adam' "
            "to compress between the ranks; to simulate nodes on one host pass ranks_per_node. "
            f"{docs_pointer('guides/sharded-training')}"
        )
    return [list(topology.node_ranks(node)) for node in range(topology.num_nodes)]


def shard_model(model: Module, mesh: Any, shard_modules: tuple[type[Module], ...], mixed_precision: Any) -> None:
    """``fully_shard`` over ``mesh`` (the node's shard mesh, with FSDP2's ``mixed_precision`` policy if any) every
    instance of ``shard_modules`` (children before parents), then every direct child of
    the LightningModule that still holds unsharded parameters (the modules ``training_step`` calls, e.g.
    ``self.bert``: FSDP gathers a module's parameters in its own forward, and ``training_step`` need not call the
    LightningModule's ``forward``), then the LightningModule itself if it holds parameters of its own."""
    from torch.distributed.fsdp import FSDPModule, fully_shard

    kwargs = {} if mixed_precision is None else {"mp_policy": mixed_precision}
    chosen = [m for m in model.modules() if isinstance(m, shard_modules) and not isinstance(m, FSDPModule)]
    if not chosen:
        names = ", ".join(c.__name__ for c in shard_modules)
        raise ValueError(f"shard_modules ({names}) matched no module of {type(model).__name__}")
    for module in reversed(chosen):  # modules() lists parents first
        fully_shard(module, mesh=mesh, **kwargs)
    for child in model.children():
        if not isinstance(child, FSDPModule) and any(not is_sharded(p) for p in child.parameters()):
            fully_shard(child, mesh=mesh, **kwargs)
    if any(True for _ in model.parameters(recurse=False)) and not isinstance(model, FSDPModule):
        fully_shard(model, mesh=mesh, **kwargs)


def check_sharded(model: Module, shard_mesh: Any) -> None:
    """Every parameter must be a ``DTensor`` sharded over ``shard_mesh`` (the strategy's): raise ``ValueError`` (on
    every rank, before any collective of training) naming the modules that are not, or whose mesh spans nodes."""
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


def point_at_sharded_parameters(
    optimizer: CompressedOptimizer, model: Module, names_before_sharding: dict[int, tuple[Any, str]]
) -> None:
    """An optimizer built from the parameters as they were before sharding (LightningCLI builds its optimizer
    from ``model.parameters()`` before ``fit``) gets the sharded ones of the same names, in the same groups. It
    must not have stepped yet; any other foreign parameter is a ``ValueError``. ``names_before_sharding``: ``id`` of
    each parameter before sharding -> (a weak reference to it, its name)."""
    current = dict(model.named_parameters())
    held = {id(p) for p in current.values()}
    groups = optimizer.param_groups
    if all(optimizer.shards.dtensor_of(p) is not None or id(p) in held for g in groups for p in g["params"]):
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
    log.info("onebit_fsdp: %s was built from the parameters before sharding; it now holds the sharded ones",
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


def _names(names: list[str], shown: int = 6) -> str:
    more = len(names) - shown
    return ", ".join(names[:shown]) + (f" and {more} more" if more > 0 else "")
