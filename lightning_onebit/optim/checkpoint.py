"""What a compressed optimizer's checkpoint holds beyond torch's optimizer state, and whose state another can
continue from: the optimizer's checkpoint part, :class:`CheckpointWriter`, and the functions it is made of.

``state_dict()["onebit"]`` (:data:`CHECKPOINT_KEY`, written by :func:`onebit_state_dict`) records the global step,
the freeze step, the algorithm that wrote it (``"optimizer"``), the state of ``freeze_step="auto"`` and the momentum
bucket plan as parameter indices; loading reads them back (:func:`loaded_step`, :func:`restored_freeze_step`,
:func:`plan_from_indices`). 0/1 Adam adds its local steps' sums and its schedule arguments (:data:`SYNC_STATE`,
:class:`LocalStepsEntry`). Error feedback is per rank and saved apart
(:meth:`CompressedOptimizer.error_feedback_state_dict`).
"""

from __future__ import annotations

import logging
import warnings
from typing import Any, Callable, Optional, Sequence

import torch

from lightning_onebit._docs import docs_pointer
from lightning_onebit.optim.auto_freeze import FreezeDetector
from lightning_onebit.optim.bucket_layout import Plan
from lightning_onebit.optim.masks import describe_param

log = logging.getLogger(__name__)

#: The entry of an optimizer state dict that holds what torch's does not.
CHECKPOINT_KEY = "onebit"
#: Key of 0/1 Adam's local-step sums and schedule arguments inside the :data:`CHECKPOINT_KEY` entry.
SYNC_STATE = "zeroone"


def onebit_state_dict(
    state_dict: dict[str, Any],
    *,
    step: int,
    freeze_step: Optional[int],
    family: str,
    detector: Optional[FreezeDetector],
    plan: Plan,
    params: Sequence[torch.Tensor],
) -> dict[str, Any]:
    """Torch's optimizer ``state_dict`` with :data:`CHECKPOINT_KEY` added: the global ``step``, the ``freeze_step``
    (``"auto"`` while undecided), the state ``family`` that wrote it (:func:`state_family`), the ``detector``'s
    state and reason (``freeze_step="auto"``; ``None``: nothing to save) and the bucket ``plan`` as indices into
    ``params`` (if any). Masks and the groups' ``compress`` are taken out: they come from the code."""
    for group in state_dict["param_groups"]:
        group.pop("exp_avg_mask", None)
        group.pop("compress", None)
    meta: dict[str, Any] = {"step": step, "freeze_step": freeze_step or "auto", "optimizer": family}
    if detector is not None:
        meta["auto_freeze"] = dict(detector.state_dict(), reason=detector.reason)
    if plan is not None:
        meta["bucket_plan"] = plan_as_indices(plan, params)
    state_dict[CHECKPOINT_KEY] = meta
    return state_dict


def keep_code_options_(groups: Sequence[dict[str, Any]], code_groups: Sequence[dict[str, Any]]) -> None:
    """After torch loaded a state dict into ``groups``: the options it lacks (e.g. ``bias_correction``, absent from a
    ``torch.optim.AdamW`` state dict) come from the code's groups ``code_groups``, and so do the masks and
    ``compress`` always (a group may be switched in or out of compression between runs)."""
    for group, code_group in zip(groups, code_groups):
        for key, value in code_group.items():
            group.setdefault(key, value)
        group["exp_avg_mask"] = code_group["exp_avg_mask"]
        group["compress"] = code_group["compress"]


def loaded_step(meta: Optional[dict[str, Any]], state: Any) -> int:
    """The global step a loaded state dict was saved at: the one ``meta`` (its :data:`CHECKPOINT_KEY`) records, else
    (a torch optimizer's, e.g. AdamW's) the largest per-parameter ``step`` of the loaded ``state`` (0 if none)."""
    if meta is not None:
        return int(meta["step"])
    steps = [int(s["step"]) for s in state.values() if isinstance(s, dict) and "step" in s]
    return max(steps, default=0)


def restored_freeze_step(
    meta: dict[str, Any], step: int, freeze_step: Optional[int], detector: Optional[FreezeDetector], name: str
) -> Optional[int]:
    """The freeze step the optimizer ``name`` goes on with after loading ``meta``, saved at ``step``.

    An integer ``freeze_step`` (``detector`` ``None``) is the code's, logged when the checkpoint's differs. With
    ``freeze_step="auto"`` (``detector``: the optimizer's, loaded with the saved measurements): the step the
    checkpoint decided (or its fixed freeze step, if that was already reached), else ``None``, and the detector goes
    on measuring from the saved snapshots."""
    if detector is None:
        if meta.get("freeze_step", freeze_step) != freeze_step:
            log.info("%s: checkpoint used freeze_step=%s; continuing with freeze_step=%s from the code", name,
                     meta["freeze_step"], freeze_step)
        return freeze_step
    saved, measured = meta.get("freeze_step"), meta.get("auto_freeze") or {}
    detector.load_state_dict(measured)
    if isinstance(saved, int) and saved <= step:
        detector.reason = measured.get("reason") or "checkpoint"
        detector.load_state_dict(dict(measured, snapshots={}))  # nothing more to measure
        log.info("%s: freeze_step='auto' resumed with the step the checkpoint decided: %d", name, saved)
        return saved
    detector.reason = None
    return None


def state_family(cls: type, base: type) -> str:
    """The algorithm whose state an optimizer of class ``cls`` writes: the nearest class of this package in its MRO
    below ``base`` (``CompressedOptimizer``; a user's subclass of OnebitAdam writes OnebitAdam's state)."""
    for klass in cls.__mro__:
        if klass is base:
            break
        if klass.__module__.startswith("lightning_onebit.optim."):
            return klass.__name__
    return cls.__name__


def state_writer(state_dict: dict[str, Any]) -> Optional[str]:
    """Which algorithm wrote ``state_dict``: the one it records, else (checkpoints written before it was recorded)
    what its contents show; ``"torch.optim"`` without an ``"onebit"`` entry; ``None`` when it holds no per-parameter
    state (nothing to continue)."""
    meta = state_dict.get(CHECKPOINT_KEY)
    states = [s for s in (state_dict.get("state") or {}).values() if isinstance(s, dict) and s]
    if not isinstance(meta, dict):
        return "torch.optim" if states else None
    if meta.get("optimizer"):
        return str(meta["optimizer"])
    if SYNC_STATE in meta:
        return "ZeroOneAdam"
    if any(k.startswith("lamb_") or k in ("exp_avg_last", "exp_avg_sq_fresh") for s in states for k in s):
        return "OnebitLamb"
    return "OnebitAdam" if states else None


def continuable_state_dict(
    state_dict: dict[str, Any], reader: str, name: str, continues_of: Sequence[str], warn: bool
) -> dict[str, Any]:
    """A shallow copy of ``state_dict`` that the optimizer ``name`` (whose state family is ``reader``) can load.

    Raises ``ValueError`` naming the optimizer that wrote it and this one when it is another algorithm's that is not
    in ``continues_of`` (before any step and any collective: every rank reads the same checkpoint, so every rank
    raises). A state of another algorithm this one can continue from (OnebitAdam <-> ZeroOneAdam) is kept to the
    Adam moments, with a warning if ``warn`` (rank 0); a torch optimizer's (``"torch.optim"``, e.g. AdamW's moments
    and step) is taken as it is.
    """
    state_dict = dict(state_dict)
    writer = state_writer(state_dict)
    if writer is None or writer == reader:
        return state_dict
    shown = "a torch.optim optimizer (e.g. AdamW)" if writer == "torch.optim" else writer
    if writer not in continues_of:
        if reader == "OnebitLamb":
            why = f"1-bit LAMB needs trust-ratio coefficients (lamb_coeff) that {shown}'s state does not hold"
        elif writer == "OnebitLamb":
            why = "1-bit LAMB's state (layer-wise trust ratios) is not an Adam update's"
        else:
            why = f"{name} does not continue from {shown}'s state"
        raise ValueError(
            f"{name}.load_state_dict: this optimizer state was written by {shown} and is read by {name}: {why}. "
            f"Resume with the optimizer that wrote it ({shown}), or switch optimizers from the checkpoint's weights "
            f"only (load its 'state_dict' into the model, fit without ckpt_path); {docs_pointer('guides/checkpoints')}"
        )
    if writer == "torch.optim":
        return state_dict  # e.g. AdamW: its moments and step are this optimizer's (the documented migration)
    state = state_dict.get("state") or {}
    dropped = sorted({k for s in state.values() if isinstance(s, dict) for k in s} - {"exp_avg", "exp_avg_sq"})
    state_dict["state"] = {
        key: {k: v for k, v in s.items() if k in ("exp_avg", "exp_avg_sq")} if isinstance(s, dict) else s
        for key, s in state.items()
    }
    if warn:
        warnings.warn(
            f"{name}.load_state_dict: this optimizer state was written by {writer} and is read by {name}: the Adam "
            "moments and the step carry over"
            + (f", {writer}'s own state ({', '.join(dropped)}) is dropped" if dropped else "")
            + f". If not meant, resume with {writer}; {docs_pointer('guides/checkpoints')}",
            UserWarning,
            stacklevel=3,
        )
    return state_dict


def plan_as_indices(plan: Plan, params: Sequence[torch.Tensor]) -> list[list[Any]]:
    """A bucket plan as ``[key, [parameter indices]]`` pairs over ``params`` (what a checkpoint saves)."""
    assert plan is not None
    index = {id(p): i for i, p in enumerate(params)}
    return [[key, [index[id(p)] for p in bucket]] for key, bucket in plan]


def plan_from_indices(saved: Any, params: Sequence[torch.Tensor], name: str) -> Plan:
    """A saved bucket plan (:func:`plan_as_indices`) mapped back to ``params``; ``None``, logged, if it does not fit
    (the model changed): the momenta are then packed by ``bucket_cap_mb``."""
    try:
        return [(int(key), [params[int(i)] for i in indices]) for key, indices in saved]
    except (TypeError, ValueError, IndexError) as err:
        log.warning("%s: the checkpoint's momentum bucket plan does not fit this model (%s); ignored", name, err)
        return None


def take_scalar_state_(state_dict: dict[str, Any], names: Sequence[str]) -> dict[Any, dict[str, Any]]:
    """Take the per-parameter entries ``names`` (0-dim float64 tensors, or the Python floats older checkpoints hold)
    out of ``state_dict["state"]`` (a copy of it replaces it: the caller's is left alone), by saved parameter id, so
    that torch's loading does not cast them to the parameters' dtype (:func:`restore_scalar_state_` puts them back)."""
    scalars: dict[Any, dict[str, Any]] = {}
    saved_state = {}
    for key, entry in (state_dict.get("state") or {}).items():
        if isinstance(entry, dict) and any(name in entry for name in names):
            entry = dict(entry)
            scalars[key] = {name: entry.pop(name) for name in names if name in entry}
        saved_state[key] = entry
    state_dict["state"] = saved_state
    return scalars


def restore_scalar_state_(state: Any, scalars: dict[Any, dict[str, Any]], saved_groups: Sequence[dict[str, Any]],
                          groups: Sequence[dict[str, Any]]) -> None:
    """Put :func:`take_scalar_state_`'s entries back into the loaded ``state``, as 0-dim float64 tensors on each
    parameter's device (``saved_groups``: the state dict's param groups, which name the saved ids in order)."""
    saved_ids = [i for group in saved_groups for i in group["params"]]
    by_id = dict(zip(saved_ids, [p for group in groups for p in group["params"]]))
    for key, values in scalars.items():
        p = by_id.get(key)
        if p is None:
            continue
        for name, value in values.items():
            if isinstance(value, torch.Tensor):
                state[p][name] = value.detach().to(device=p.device, dtype=torch.float64).reshape(()).clone()
            else:  # a Python number: filled on the device (no host-to-device copy)
                state[p][name] = torch.full((), float(value), dtype=torch.float64, device=p.device)


class LocalStepsEntry:
    """0/1 Adam's extension of its checkpoint, under :data:`SYNC_STATE`, which its :class:`CheckpointWriter` writes
    and restores with the rest (:attr:`CheckpointWriter.extension`): the sums of the local steps since the last sync
    (``local_steps``, a :class:`~lightning_onebit.optim.local_steps.LocalSteps`) and the schedule's four arguments
    (``schedule``, a :class:`~lightning_onebit.optim.zeroone_adam.ZeroOneSchedule`; the schedule itself follows from
    the step and them, and is replayed to the loaded step). ``at_load``: what else a load resets (the zero-variance
    masks, found again from the loaded variance). ``owner``: the optimizer's class name, for messages."""

    def __init__(self, owner: str, local_steps: Any, schedule: Any, at_load: Callable[[], None]) -> None:
        self.owner, self.local_steps, self.schedule, self.at_load = owner, local_steps, schedule, at_load

    def write(self, meta: dict[str, Any]) -> None:
        """Add the entry to ``meta`` (a state dict's :data:`CHECKPOINT_KEY`). Between syncs (local steps since the
        last) it holds this rank's own replica state, and warns."""
        saved = self.local_steps.state_dict()
        if saved["local_steps_since_sync"]:
            warnings.warn(
                f"{self.owner}.state_dict() after {saved['local_steps_since_sync']} local step(s) since the last "
                "sync: this rank's replica differs from the others'; call synchronize() on every rank before saving "
                "for an exact resume",
                UserWarning,
                stacklevel=4,  # the caller of state_dict(), through CompressedOptimizer.state_dict and write
            )
        meta[SYNC_STATE] = dict(saved, schedule_arguments=self.schedule.arguments())

    def restore(self, meta: Optional[dict[str, Any]], step: int, groups: int) -> None:
        """After a load at ``step`` (``meta``: the state dict's :data:`CHECKPOINT_KEY`, ``None`` for a torch
        optimizer's): the schedule replayed to it with the code's arguments (logged when the checkpoint's differ),
        the sums of ``groups`` param groups restored (none in an AdamW or OnebitAdam state dict: the local steps, if
        any, start from the loaded point)."""
        saved = (meta or {}).get(SYNC_STATE) or {}
        self.schedule.replay(step)
        self.at_load()
        arguments = self.schedule.arguments()
        if saved.get("schedule_arguments") not in (None, arguments):
            log.info("%s: the checkpoint was saved with schedule arguments %s; continuing from step %d with those of "
                     "the code, %s", self.owner, saved["schedule_arguments"], step, arguments)
        self.local_steps.load_state_dict(saved, groups)


class CheckpointWriter:
    """The checkpoint part of a compressed optimizer: what its ``state_dict()`` holds beyond torch's
    (:data:`CHECKPOINT_KEY`, :func:`onebit_state_dict`), which states it reads (:func:`continuable_state_dict`), and
    whether a loaded state fits the parameters.

    Args:
        owner: the optimizer's class name, for messages.
        family: the algorithm whose state the optimizer writes (:func:`state_family`).
        continues_of: the algorithms whose state it can continue from (``"torch.optim"``: a torch optimizer's, e.g.
            AdamW's moments and step).
    """

    def __init__(self, owner: str, family: str, continues_of: Sequence[str]) -> None:
        self.owner, self.family, self.continues_of = owner, family, tuple(continues_of)
        #: An algorithm's state beyond the moments, written and restored with the rest (0/1 Adam's
        #: :class:`LocalStepsEntry`); ``None``: none.
        self.extension: Optional[LocalStepsEntry] = None

    def write(self, state_dict: dict[str, Any], *, step: int, freeze_step: Optional[int],
              detector: Optional[FreezeDetector], plan: Plan, params: Sequence[torch.Tensor]) -> dict[str, Any]:
        """Torch's ``state_dict`` with :data:`CHECKPOINT_KEY` added (:func:`onebit_state_dict`, and the
        :attr:`extension`'s entry)."""
        state_dict = onebit_state_dict(state_dict, step=step, freeze_step=freeze_step, family=self.family,
                                       detector=detector, plan=plan, params=params)
        if self.extension is not None:
            self.extension.write(state_dict[CHECKPOINT_KEY])
        return state_dict

    def readable(self, state_dict: dict[str, Any], warn: bool) -> dict[str, Any]:
        """A shallow copy of ``state_dict`` the optimizer can load; ``ValueError`` before any step and any collective
        when another algorithm wrote it that this one cannot continue from (:func:`continuable_state_dict`)."""
        return continuable_state_dict(state_dict, self.family, self.owner, self.continues_of, warn)

    def restore_(self, meta: Optional[dict[str, Any]], groups: Sequence[dict[str, Any]],
                 code_groups: Sequence[dict[str, Any]], state: Any, freeze_step: Optional[int],
                 detector: Optional[FreezeDetector]) -> tuple[int, Optional[int], Plan]:
        """After torch loaded a state dict into ``groups`` and ``state`` (``meta``: its :data:`CHECKPOINT_KEY`, popped
        first): the options the code's groups ``code_groups`` keep (:func:`keep_code_options_`), AdamW's per-parameter
        step dropped, the :attr:`extension` restored, and ``(step, freeze step, bucket plan)`` to go on with
        (:func:`loaded_step`, :func:`restored_freeze_step` with the code's ``freeze_step`` and ``detector``,
        :func:`plan_from_indices`)."""
        keep_code_options_(groups, code_groups)
        step = loaded_step(meta, state)
        if self.extension is not None:
            self.extension.restore(meta, step, len(groups))
        if meta is not None:
            freeze_step = restored_freeze_step(meta, step, freeze_step, detector, self.owner)
        for entry in state.values():
            entry.pop("step", None)  # AdamW's per-parameter step; this optimizer keeps one global step
        saved = meta.get("bucket_plan") if meta is not None else None
        params = [p for group in groups for p in group["params"]]
        return step, freeze_step, plan_from_indices(saved, params, self.owner) if saved else None

    def shape_mismatch(self, groups: Sequence[dict[str, Any]], state: Any) -> Optional[str]:
        """The first parameter whose state holds a tensor of another shape than the parameter's (a checkpoint of a
        model that has changed since), described; ``None`` if none does."""
        for g, group in enumerate(groups):
            for i, p in enumerate(group["params"]):
                for key, value in (state[p] if p in state else {}).items():
                    if isinstance(value, torch.Tensor) and value.dim() > 0 and value.shape != p.shape:
                        return (f"the optimizer state {key!r} of {describe_param(group, g, i, p)} has shape "
                                f"{tuple(value.shape)}: the model changed since the checkpoint")
        return None
