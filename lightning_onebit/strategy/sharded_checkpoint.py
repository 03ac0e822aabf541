"""Distributed checkpoints of a compressed optimizer over sharded (``DTensor``) parameters, for ``onebit_fsdp``.

The optimizer keeps its per-parameter state on plain tensors over the local shards
(:mod:`lightning_onebit.optim.sharded`), keyed by parameter index. In a checkpoint the state is keyed by the
parameter's name in the model, and every tensor laid out like its parameter's local shard is saved as a ``DTensor``
with the parameter's mesh and placement: ``torch.distributed.checkpoint`` then writes one shard per rank and, on load,
reshards to the mesh of the run that loads it (4 ranks to 2, say). Per-tensor scalars and the optimizer's own record
(step, freeze step, bucket plan) are the same on every rank and saved once.

The ``freeze_step="auto"`` measurement in progress (its variance snapshots are of this rank's shard) is not saved: a
run resumed during an automatic warmup measures afresh from the resumed step (one more window), and says so.
"""

from __future__ import annotations

import logging
from pathlib import Path
from typing import Any, Optional

import torch
from torch.nn import Module

from lightning_onebit.comm.groups import broadcast_coalesced
from lightning_onebit.optim import CompressedOptimizer
from lightning_onebit.optim.checkpoint import CHECKPOINT_KEY
from lightning_onebit.strategy.checkpoint_files import CheckpointIntegrityError, FolderSave, first_line

log = logging.getLogger(__name__)

__all__ = ["load_sharded_checkpoint", "load_sharded_optimizer_state", "save_sharded_checkpoint",
           "sharded_optimizer_state", "with_rank0_buffers"]

# the optimizer's record of the auto-freeze measurement (per rank under sharding: not saved, see the module docstring)
_DETECTOR_KEY = "auto_freeze"


def _names(optimizer: CompressedOptimizer, model: Module) -> list[str]:
    """The model's name of every parameter the optimizer holds, in the optimizer's order."""
    name_of = {id(p): name for name, p in model.named_parameters()}
    names = []
    for group in optimizer.param_groups:
        for p in group["params"]:
            owner = optimizer.shards.dtensor_of(p)
            name = name_of.get(id(owner if owner is not None else p))
            if name is None:
                raise ValueError(f"{type(optimizer).__name__} holds a parameter that is not the model's: it cannot be "
                                 "named in a distributed checkpoint")
            names.append(name)
    return names


def _is_shard_of(value: Any, stand_in: torch.Tensor) -> bool:
    return isinstance(value, torch.Tensor) and value.dim() > 0 and value.shape == stand_in.shape


def sharded_optimizer_state(optimizer: CompressedOptimizer, model: Module) -> dict[str, Any]:
    """The optimizer's state dict keyed by parameter name, its shard-shaped tensors as ``DTensor`` s."""
    from torch.distributed.tensor import DTensor

    state_dict = optimizer.state_dict()
    params = [p for group in optimizer.param_groups for p in group["params"]]
    names = _names(optimizer, model)
    state: dict[str, Any] = {}
    for index, entry in state_dict["state"].items():
        stand_in = params[index]
        owner = optimizer.shards.dtensor_of(stand_in)
        state[names[index]] = {
            key: DTensor.from_local(value, owner.device_mesh, owner.placements, run_check=False, shape=owner.shape,
                                    stride=owner.stride())
            if owner is not None and _is_shard_of(value, stand_in) else value
            for key, value in entry.items()
        }
    groups = [dict(group, params=[names[i] for i in group["params"]]) for group in state_dict["param_groups"]]
    meta = dict(state_dict.get(CHECKPOINT_KEY) or {})
    if meta.get(_DETECTOR_KEY) is not None:  # the decision's reason is kept, the per-rank snapshots are not
        meta[_DETECTOR_KEY] = {"reason": meta[_DETECTOR_KEY].get("reason")}
    return {"state": state, "param_groups": groups, CHECKPOINT_KEY: meta}


def load_sharded_optimizer_state(optimizer: CompressedOptimizer, model: Module, path: Path, key: str) -> None:
    """Load ``key`` (e.g. ``"optimizer_0"``) of the distributed checkpoint at ``path`` into ``optimizer``, resharded
    to the current mesh. A collective (every rank calls it). Parameters the checkpoint does not hold keep their
    state; state of parameters the model no longer has is dropped."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.tensor import DTensor

    metadata = dcp.FileSystemReader(str(path)).read_metadata()
    params = [p for group in optimizer.param_groups for p in group["params"]]
    names = _names(optimizer, model)
    index_of = {name: i for i, name in enumerate(names)}
    template: dict[str, Any] = {}
    for flat_key, where in (metadata.planner_data or {}).items():
        if not where or where[0] != key:
            continue
        stored = metadata.state_dict_metadata[flat_key]
        size = getattr(stored, "size", None)
        value: Any = None  # an object: DCP puts the saved one here
        if size is not None:
            owner = None
            if len(where) == 4 and where[1] == "state" and where[2] in index_of:
                stand_in = params[index_of[where[2]]]
                owner = optimizer.shards.dtensor_of(stand_in)
            elif len(where) == 4 and where[1] == "state":
                continue  # a parameter this model does not have
            if owner is not None and tuple(size) == tuple(owner.shape):
                local = torch.zeros_like(stand_in, dtype=stored.properties.dtype)
                value = DTensor.from_local(local, owner.device_mesh, owner.placements, run_check=False,
                                           shape=owner.shape, stride=owner.stride())
            else:
                value = torch.zeros(tuple(size), dtype=stored.properties.dtype)
        _set_path(template, where[1:], value)
    loaded = {key: template}
    dcp.load(loaded, checkpoint_id=str(path))
    saved = loaded[key]
    state = {}
    for name, entry in saved.get("state", {}).items():
        state[index_of[name]] = {k: v.to_local() if isinstance(v, DTensor) else v for k, v in entry.items()}
    groups = saved.get("param_groups")
    if not groups:
        raise ValueError(f"the checkpoint at {path} holds no optimizer param groups under {key!r}")
    groups = [dict(group, params=[index_of[n] for n in group["params"] if n in index_of]) for group in groups]
    optimizer.load_state_dict({"state": state, "param_groups": groups, CHECKPOINT_KEY: saved.get(CHECKPOINT_KEY)})
    if optimizer.auto_freeze is not None and optimizer.freeze_step is None:
        log.info("onebit_fsdp: resumed during the automatic warmup; freeze_step='auto' measures afresh from step %d",
                 optimizer.step_count)


def _set_path(container: Any, path: tuple, value: Any) -> None:
    """Put ``value`` at ``path`` (keys and list indices) in nested dicts and lists, creating them as needed (the
    shape ``torch.distributed.checkpoint`` flattened the saved state from)."""
    for step, following in zip(path[:-1], path[1:]):
        empty: Any = [] if isinstance(following, int) else {}
        if isinstance(container, list):
            container.extend([None] * (step + 1 - len(container)))
            if container[step] is None:
                container[step] = empty
            container = container[step]
        else:
            container = container.setdefault(step, empty)
    last = path[-1]
    if isinstance(container, list):
        container.extend([None] * (last + 1 - len(container)))
    container[last] = value


def with_rank0_buffers(state: dict[str, Any], model: Module) -> dict[str, Any]:
    """``state`` (``model``'s state dict) with rank 0's values of ``model``'s buffers. FSDP2 leaves each rank its own
    buffers (e.g. BatchNorm statistics from its own batches), and ``torch.distributed.checkpoint`` writes a tensor
    every rank holds from one rank chosen per tensor: without this a BatchNorm's mean could come from one rank and
    its variance from another. A collective over every rank (one broadcast per dtype of every persistent buffer,
    also where ``state`` is empty: a consolidated state dict is rank 0's alone); ``model`` is unchanged."""
    persistent = {id(t) for t in model.state_dict(keep_vars=True).values()}
    rank0 = {key: b.detach().clone() for key, b in model.named_buffers(remove_duplicate=False) if id(b) in persistent}
    if rank0 and torch.distributed.is_available() and torch.distributed.is_initialized():
        broadcast_coalesced(list(rank0.values()))
    # on the state's device: a consolidated state dict is offloaded to the CPU
    return {key: rank0[key].to(value.device) if key in rank0 and isinstance(value, torch.Tensor) else value
            for key, value in state.items()}


def is_distributed_checkpoint(path: Optional[Path]) -> bool:
    """Whether ``path`` is a folder written by ``torch.distributed.checkpoint``."""
    return path is not None and path.is_dir() and (path / ".metadata").is_file()


def save_sharded_checkpoint(save: FolderSave, checkpoint: dict[str, Any],
                            extra_shards: Optional[dict[str, Any]] = None) -> None:
    """Write ``checkpoint`` (model and optimizer states as ``DTensor`` shards, the rest rank 0's ``meta.pt``) through
    ``save`` (:class:`~lightning_onebit.strategy.checkpoint_files.FolderSave`, begun): ``torch.distributed.checkpoint``
    writes every rank's shards (and ``extra_shards``, more top-level keys), then ``save.finish`` puts the folder in
    place. A collective."""
    import torch.distributed.checkpoint as dcp

    shards = {"state_dict": checkpoint.pop("state_dict")}
    shards.update({f"optimizer_{i}": state for i, state in enumerate(checkpoint.pop("optimizer_states", []))})
    shards.update(extra_shards or {})
    writer = save.storage_writer()
    try:
        dcp.save(shards, storage_writer=writer)
    except BaseException:
        save.abandon()  # DCP gathers every rank's failure: every rank is here
        raise
    save.finish(writer, checkpoint)


def load_sharded_checkpoint(model: Module, optimizer: CompressedOptimizer, path: Path, verified: bool,
                            weights_only: Optional[bool]) -> dict[str, Any]:
    """Load the distributed checkpoint at ``path`` into ``model`` and ``optimizer`` (resharded to this run's mesh)
    and return its ``meta.pt``. A read error of ``torch.distributed.checkpoint`` (raised on every rank) is raised as
    it is where the files were ``verified`` against their digests, else as a
    :class:`~lightning_onebit.strategy.checkpoint_files.CheckpointIntegrityError` (which file is damaged is not
    known). A collective."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import get_model_state_dict, set_model_state_dict

    try:
        model_state = {"state_dict": get_model_state_dict(model)}
        dcp.load(model_state, checkpoint_id=str(path))
        set_model_state_dict(model, model_state["state_dict"])
        load_sharded_optimizer_state(optimizer, model, path, "optimizer_0")
    except dcp.CheckpointException as err:  # DCP's read errors, gathered and raised on every rank
        if verified:
            raise
        raise CheckpointIntegrityError(
            f"the checkpoint {path} could not be read ({type(err).__name__}: {first_line(err)}); it records no digests "
            "of its files (written before lightning_onebit recorded them), so which file is damaged is not known: "
            "resume from another checkpoint"
        ) from err
    return torch.load(path / "meta.pt", weights_only=weights_only)
