"""Distributed checkpoints of ``onebit_diloco_fsdp``, laid out by parameter so that they load at another number of
ranks per replica.

A checkpoint is a folder saved whole or not at all, with a manifest of its files' digests
(:class:`~lightning_onebit.strategy.checkpoint_files.FolderSave`), written by ``torch.distributed.checkpoint``:

* ``"state_dict"``: the module's state dict with the **outer** parameters (``DTensor`` s; the same on every replica,
  written once): what a plain model loads;
* ``"replica<k>"``, for each replica ``k`` (written by its ranks): its own parameters, its inner optimizers' states
  (``get_optimizer_state_dict``: keyed by parameter name, ``DTensor`` s), its error feedback per parameter, and its
  parameters at the start of an exchange whose rebase is still due (streaming);
* ``"outer_momentum"``: the outer optimizer's momentum per parameter, when it has one (the same on every replica);
* ``meta.pt`` (rank 0): Lightning's loops and schedulers, and under :data:`LOCAL_STEPS_KEY` the schedule's position
  (inner steps, each fragment's syncs, the rebases due), the replica layout and the parameter names;
* a sidecar per rank, when the model has buffers or the 1-bit exchange is two-phase (more than two replicas): this
  rank's own buffers (e.g. BatchNorm statistics; the module's state dict holds rank 0's) and the exchange's server
  error, laid out by its buckets. Both are restored at the same layout; at another the server error is reset and
  every rank starts from the state dict's buffers, rank 0's, with a warning.

Every ``DTensor`` is a shard over the replica's ``"shard"`` mesh, so ``torch.distributed.checkpoint`` reshards it to
the mesh of the run that loads it. The replicas must be as many as when saved (replica ``k`` continues replica
``k``).
"""

from __future__ import annotations

import logging
import uuid
from pathlib import Path
from typing import Any, Optional, Protocol, Sequence

import torch
from lightning.pytorch.strategies import ModelParallelStrategy
from lightning.pytorch.utilities.rank_zero import rank_zero_warn
from torch.nn import Module

from lightning_onebit.comm.agreement import agree
from lightning_onebit.optim.streaming import StreamingOuterStep
from lightning_onebit.strategy.checkpoint import PER_RANK_STATE_KEY, restore_per_rank_state, save_per_rank_state
from lightning_onebit.strategy.checkpoint_files import CheckpointIntegrityError, FolderSave, agree_on_problems
from lightning_onebit.strategy.checkpoint_files import first_line, folder_problems
from lightning_onebit.strategy.checkpoint_kinds import LOCAL_STEPS_RECORD_KEY
from lightning_onebit.strategy.local_steps_run import OuterSync
from lightning_onebit.strategy.sharded_checkpoint import is_distributed_checkpoint, save_sharded_checkpoint
from lightning_onebit.strategy.sharded_checkpoint import with_rank0_buffers
from lightning_onebit.strategy.sidecar import sidecar_in_folder

log = logging.getLogger(__name__)

__all__ = ["LOCAL_STEPS_KEY", "ShardedLocalSteps", "load_local_steps_checkpoint", "outer_model_state",
           "save_local_steps_checkpoint"]

#: The key of the strategy's record in ``meta.pt`` and of its per-rank state in the sidecars.
LOCAL_STEPS_KEY = LOCAL_STEPS_RECORD_KEY


class ShardedLocalSteps(Protocol):
    """What these functions read of the strategy (:class:`~lightning_onebit.OnebitDiLoCoFSDPStrategy`)."""

    strategy_name: str
    model: Optional[Module]
    outer_sync: OuterSync
    #: the trainable parameters by name (``DTensor`` s), in the outer step's order
    sharded_parameters: list[tuple[str, Any]]

    @property
    def outer_step(self) -> Optional[StreamingOuterStep]: ...
    @property
    def optimizers(self) -> list[Any]: ...
    @property
    def device_mesh(self) -> Any: ...
    @property
    def replica_index(self) -> int: ...
    @property
    def global_rank(self) -> int: ...
    @property
    def world_size(self) -> int: ...


def _as_dtensor(local: torch.Tensor, like: Any) -> Any:
    """``local`` (shaped like ``like``'s local shard) as a ``DTensor`` of ``like``'s mesh, placements and shape."""
    from torch.distributed.tensor import DTensor

    return DTensor.from_local(local, like.device_mesh, like.placements, run_check=False, shape=like.shape,
                              stride=like.stride())


def _by_name(names: Sequence[str], values: Sequence[Optional[torch.Tensor]], params: Sequence[Any]) -> dict[str, Any]:
    return {name: _as_dtensor(value, p) for name, value, p in zip(names, values, params) if value is not None}


def outer_model_state(state: dict[str, Any], model: Module, outer_step: StreamingOuterStep,
                      sharded_parameters: Sequence[tuple[str, Any]]) -> dict[str, Any]:
    """``state`` (the model's ``get_model_state_dict``) with every trainable parameter's outer value (every name of a
    tied one), as ``DTensor`` s, and rank 0's buffers (:func:`with_rank0_buffers`: each rank holds its own between two
    syncs). A collective: it finishes the exchanges in flight and broadcasts the buffers; the training does not
    change."""
    state = with_rank0_buffers(state, model)
    outer_step.finish_in_flight()
    values = outer_step.outer_values()
    outer = {id(p): _as_dtensor(values[id(local)].clone(), p)
             for (_, p), local in zip(sharded_parameters, outer_step.params)}
    params = dict(model.named_parameters(remove_duplicate=False))
    return {key: outer.get(id(params[key]), value) if key in params else value for key, value in state.items()}


def _training_state(strategy: ShardedLocalSteps, server_errors: list[dict[Any, torch.Tensor]]
                    ) -> tuple[dict[str, Any], dict[str, Any], dict[str, Any]]:
    """``(this replica's state, the outer momentum, the record for meta.pt)`` of a fit in progress
    (``server_errors``: each fragment's, the same emptiness on every rank)."""
    from torch.distributed.checkpoint.state_dict import get_optimizer_state_dict

    outer_step = strategy.outer_step
    assert outer_step is not None and strategy.model is not None
    names = [name for name, _ in strategy.sharded_parameters]
    params = [p for _, p in strategy.sharded_parameters]
    state = outer_step.per_parameter_state()
    replica = {
        "params": _by_name(names, strategy.outer_sync.local_values(), params),
        "error_feedback": _by_name(names, state["error_feedback"], params),
        "rebase_start": _by_name(names, state["rebase_start"], params),
        "optimizers": {str(i): get_optimizer_state_dict(strategy.model, optimizer)
                       for i, optimizer in enumerate(strategy.optimizers)},
    }
    momentum = _by_name(names, state["momentum"], params)
    replicas, per_replica = strategy.device_mesh.shape
    record = {"replicas": replicas, "ranks_per_replica": per_replica, "names": names,
              "inner_steps": strategy.outer_sync.inner_steps, "schedule": outer_step.schedule_state(),
              "momentum": sorted(momentum), "compressor": strategy.outer_sync.settings.compression.kind,
              "server_errors": any(server_errors), "local_buffers": len(strategy.outer_sync.buffers)}
    return replica, momentum, record


def save_local_steps_checkpoint(strategy: ShardedLocalSteps, checkpoint: dict[str, Any],
                                filepath: Any) -> None:
    """Write ``checkpoint`` as a distributed checkpoint at rank 0's ``filepath`` (see the module docstring): every
    rank calls it (a collective). Raises the same ``RuntimeError`` on every rank if any rank failed, leaving a
    checkpoint already under the name untouched."""
    rank, world_size = strategy.global_rank, strategy.world_size
    target, save_id = agree((str(filepath), uuid.uuid4().hex if rank == 0 else None))[0]
    save = FolderSave(Path(target), save_id, rank, world_size)
    shards: dict[str, Any] = {}
    checkpoint.pop("optimizer_states", None)  # each replica's, by parameter, below
    outer_step = strategy.outer_step
    if outer_step is not None:
        outer_step.finish_in_flight()
        server_errors = [f.compressor.server_errors() for f in outer_step.fragments]
        replica, momentum, record = _training_state(strategy, server_errors)
        shards[f"replica{strategy.replica_index}"] = replica
        if momentum:
            shards["outer_momentum"] = momentum
        checkpoint[LOCAL_STEPS_KEY] = record
        if record["server_errors"] or record["local_buffers"]:
            checkpoint[PER_RANK_STATE_KEY] = {LOCAL_STEPS_KEY: {
                "layout": tuple(strategy.device_mesh.shape),
                "server_errors": server_errors,
                "local_buffers": [b.detach().clone() for b in strategy.outer_sync.buffers]}}
    save.begin(lambda folder: save_per_rank_state(checkpoint, sidecar_in_folder(folder, rank), save_id, rank,
                                                  world_size, None))
    save_sharded_checkpoint(save, checkpoint, shards)


def _check_record(record: dict[str, Any], strategy: ShardedLocalSteps, path: Path) -> None:
    """``ValueError`` (the same on every rank: ``meta.pt`` is rank 0's) when the run cannot continue the saved one."""
    replicas, _ = strategy.device_mesh.shape
    names = [name for name, _ in strategy.sharded_parameters]
    problems = []
    if record["replicas"] != replicas:
        problems.append(f"it was saved by {record['replicas']} replicas and this run has {replicas} (each replica "
                        "continues its own parameters and inner state): resume with as many replicas, or load only the "
                        "outer model's weights into a new fit")
    if record["names"] != names:
        problems.append("its trainable parameters are not this model's (names or order differ)")
    if record["compressor"] != strategy.outer_sync.settings.compression.kind:
        problems.append(f"its error feedback is of compressor {record['compressor']!r} and this run uses "
                        f"{strategy.outer_sync.settings.compression.kind!r}")
    if problems:
        raise ValueError(f"strategy='{strategy.strategy_name}' cannot resume from {path}: " + "; ".join(problems))


def _template(strategy: ShardedLocalSteps, record: Optional[dict[str, Any]]) -> dict[str, Any]:
    """What to read, shaped like this run's shards: the model, and with ``record`` this replica's state."""
    from torch.distributed.checkpoint.state_dict import get_model_state_dict, get_optimizer_state_dict

    assert strategy.model is not None
    template: dict[str, Any] = {"state_dict": get_model_state_dict(strategy.model)}
    if record is None:
        return template
    names = [name for name, _ in strategy.sharded_parameters]
    params = [p for _, p in strategy.sharded_parameters]
    zeros = [torch.zeros_like(p.to_local()) for p in params]
    due = {k for k, _, _ in record["schedule"]["rebases"]}
    assert strategy.outer_step is not None
    in_due = [k in due for k, f in enumerate(strategy.outer_step.fragments) for _ in f.params]
    template[f"replica{strategy.replica_index}"] = {
        "params": _by_name(names, zeros, params),
        "error_feedback": _by_name(names, [z.clone() for z in zeros], params),
        "rebase_start": _by_name(names, [z.clone() if d else None for z, d in zip(zeros, in_due)], params),
        # get_optimizer_state_dict makes the state the optimizer has not made yet (no update: lr 0)
        "optimizers": {str(i): get_optimizer_state_dict(strategy.model, optimizer)
                       for i, optimizer in enumerate(strategy.optimizers)},
    }
    saved = set(record["momentum"])
    if saved:
        template["outer_momentum"] = _by_name(names, [z.clone() if n in saved else None
                                                      for z, n in zip(zeros, names)], params)
    return template


def load_local_steps_checkpoint(strategy: ShardedLocalSteps, path: Path,
                                weights_only: Optional[bool]) -> dict[str, Any]:
    """Load the checkpoint at ``path`` at this run's mesh and return its ``meta.pt`` (a collective). Before anything
    is read, every rank checks the folder against its manifest and every rank raises the same error if any rank
    found one (``ValueError`` for the wrong kind of checkpoint,
    :class:`~lightning_onebit.strategy.checkpoint_files.CheckpointIntegrityError` for a damaged one); then the
    record is checked against this run (``ValueError``). Outside ``fit`` a single file of weights loads as
    :class:`~lightning.pytorch.strategies.ModelParallelStrategy` loads it."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import set_model_state_dict

    rank, world_size = strategy.global_rank, strategy.world_size
    outer_step = strategy.outer_step
    problems = folder_problems(path, rank, world_size, outer_step is not None, weights_only, strategy.strategy_name)
    verified = agree_on_problems(problems, path, strategy.strategy_name)
    if not is_distributed_checkpoint(path):
        return ModelParallelStrategy.load_checkpoint(strategy, path, weights_only=weights_only)
    checkpoint = torch.load(path / "meta.pt", weights_only=weights_only)
    record = checkpoint.pop(LOCAL_STEPS_KEY, None) if outer_step is not None else None
    if outer_step is not None and record is None:
        rank_zero_warn(f"{strategy.strategy_name}: {path} holds no local-steps state (saved outside fit?): the "
                       "replicas start from its weights with fresh inner optimizers")
    if record is not None:
        _check_record(record, strategy, path)
    template = _template(strategy, record)
    try:
        dcp.load(template, checkpoint_id=str(path))
    except dcp.CheckpointException as err:  # DCP's read errors, gathered and raised on every rank
        if verified:
            raise
        raise CheckpointIntegrityError(f"the checkpoint {path} could not be read ({type(err).__name__}: "
                                       f"{first_line(err)}): resume from another checkpoint") from err
    assert strategy.model is not None
    set_model_state_dict(strategy.model, template["state_dict"])
    if outer_step is not None:
        _restore_training(strategy, template, record)
        restore_per_rank_state(checkpoint, sidecar_in_folder(path, rank), rank, world_size)
        _restore_per_rank(strategy, checkpoint, record)
    checkpoint.pop(PER_RANK_STATE_KEY, None)
    return checkpoint


def _restore_training(strategy: ShardedLocalSteps, template: dict[str, Any],
                      record: Optional[dict[str, Any]]) -> None:
    """The outer step and the parameters from what was read (without a record: the weights are outer and local)."""
    from torch.distributed.checkpoint.state_dict import set_optimizer_state_dict

    outer_step = strategy.outer_step
    assert outer_step is not None and strategy.model is not None
    names = [name for name, _ in strategy.sharded_parameters]
    outer = [template["state_dict"][name].to_local() for name in names]
    if record is None:
        state = outer_step.per_parameter_state()
        outer_step.load_per_parameter_state(dict(state, outer=outer), outer_step.schedule_state())
        return
    replica = template[f"replica{strategy.replica_index}"]
    momentum = template.get("outer_momentum", {})

    def local(table: dict[str, Any]) -> list[Optional[torch.Tensor]]:
        return [table[name].to_local() if name in table else None for name in names]

    outer_step.load_per_parameter_state({"outer": outer, "error_feedback": local(replica["error_feedback"]),
                                         "momentum": local(momentum), "rebase_start": local(replica["rebase_start"])},
                                        record["schedule"])
    with torch.no_grad():
        for p, value in zip(outer_step.params, local(replica["params"])):
            p.copy_(value)
    for i, optimizer in enumerate(strategy.optimizers):
        set_optimizer_state_dict(strategy.model, optimizer, replica["optimizers"][str(i)])
    strategy.outer_sync.inner_steps = int(record["inner_steps"])


def _restore_per_rank(strategy: ShardedLocalSteps, checkpoint: dict[str, Any],
                      record: Optional[dict[str, Any]]) -> None:
    """This rank's own buffers and the two-phase exchange's server errors from its sidecar when the layout is the
    saved one; else the buffers stay the state dict's (rank 0's) and the server errors are reset, said once (every
    rank decides alike: the layout is the same everywhere, a bad sidecar is agreed on). A checkpoint saved before the
    sidecars held buffers restores its server errors as before and leaves the buffers the state dict's."""
    if record is None:
        return
    saved_buffers = record.get("local_buffers", 0)
    wanted = [(what, instead) for what, instead, saved in (
        ("its buffers", "every rank starts from rank 0's buffers", saved_buffers),
        ("the server error", "the two-phase 1-bit exchange's server error restarts from zero", record["server_errors"]))
        if saved]
    if not wanted:
        return
    outer_step = strategy.outer_step
    assert outer_step is not None
    state = (checkpoint.get(PER_RANK_STATE_KEY) or {}).get(LOCAL_STEPS_KEY)
    layout = tuple(strategy.device_mesh.shape)
    buffers = strategy.outer_sync.buffers
    shapes = [b.shape for b in buffers]
    usable = (state is not None and tuple(state["layout"]) == layout
              and (not saved_buffers or [b.shape for b in state.get("local_buffers") or ()] == shapes))
    if all(agree(usable)):
        if record["server_errors"]:
            for fragment, saved in zip(outer_step.fragments, state["server_errors"]):
                fragment.compressor.load_server_errors(saved, fragment.buckets)
        if saved_buffers:
            with torch.no_grad():
                for buffer, saved in zip(buffers, state["local_buffers"]):
                    buffer.copy_(saved)
        return
    rank_zero_warn(f"{strategy.strategy_name}: each rank's own state kept beside the checkpoint ("
                   + " and ".join(what for what, _ in wanted) + f") was saved at {record['replicas']} x "
                   f"{record['ranks_per_replica']} ranks and is not restored at {layout[0]} x {layout[1]} (or a rank's "
                   "sidecar is missing or holds other buffers): " + "; ".join(instead for _, instead in wanted)
                   + "; every other state was restored")
