"""What a compressed optimizer's checkpoint holds beyond torch's optimizer state, and whose state another can
continue from.

``state_dict()["onebit"]`` (:data:`CHECKPOINT_KEY`, written by :func:`onebit_state_dict`) records the global step,
the freeze step, the algorithm that wrote it (``"optimizer"``), the state of ``freeze_step="auto"`` and the momentum
bucket plan as parameter indices; loading reads them back (:func:`loaded_step`, :func:`restored_freeze_step`,
:func:`plan_from_indices`). Error feedback is per rank and saved apart
(:meth:`CompressedOptimizer.error_feedback_state_dict`).
"""

from __future__ import annotations

import logging
import warnings
from typing import Any, Optional, Sequence

import torch

from lightning_onebit._docs import docs_pointer
from lightning_onebit.optim.auto_freeze import FreezeDetector
from lightning_onebit.optim.bucket_plan import Plan
from lightning_onebit.optim.masks import describe_param

log = logging.getLogger(__name__)

#: The entry of an optimizer state dict that holds what torch's does not.
CHECKPOINT_KEY = "onebit"


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
    if "zeroone" in meta:
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


class CheckpointMixin:
    """The checkpoint side of :class:`~lightning_onebit.optim.CompressedOptimizer`: its state dict (torch's plus
    :data:`CHECKPOINT_KEY`), whose states it continues from, and the per-rank error feedback. The base sets the
    attributes below and ``_state_family`` (the algorithm that writes the state)."""

    param_groups: list[dict[str, Any]]
    state: Any
    _step: int
    freeze_step: Optional[int]
    auto_freeze: Any
    _detector: Optional[FreezeDetector]
    momentum_buckets: Any
    compression: Any
    exchange: Any
    _zero_variance: Any
    last_dropped_error_norm: Optional[float]
    _ensure_detector: Any
    _ensure_buckets: Any
    _bucket_layouts_now: Any
    _state_family: Any

    def state_dict(self) -> dict[str, Any]:
        """Torch's optimizer state plus ``"onebit"``: the global step, the freeze step, the optimizer that wrote it
        (``"optimizer"``: OnebitAdam, ZeroOneAdam or OnebitLamb, checked by :meth:`load_state_dict`) and the momentum
        bucket plan (:meth:`set_bucket_plan`, as parameter indices), if any. Masks, the groups' ``compress`` and
        error feedback are not included (masks and ``compress`` come from the code; error feedback is per rank, see
        :meth:`error_feedback_state_dict`). See :func:`~lightning_onebit.optim.checkpoint.onebit_state_dict`."""
        return onebit_state_dict(
            super().state_dict(),
            step=self._step,
            freeze_step=self.freeze_step,
            family=self._state_family(),
            detector=self._detector if self.auto_freeze is not None else None,
            plan=self.momentum_buckets.plan,
            params=self._all_params(),
        )

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """Load a state dict from :meth:`state_dict` (or from ``torch.optim.AdamW``: the step is then taken from its
        per-parameter ``step``). The stage is re-derived from the step; masks and each group's ``compress`` stay those
        of the code (a group may be switched in or out of compression between runs: its momentum and variance are
        ordinary state, and the buckets are rebuilt); error feedback is reset to zero and the norm that was dropped is
        kept in :attr:`last_dropped_error_norm`.

        The state of another algorithm is checked first (:meth:`_check_state_writer`): one this optimizer cannot
        continue from (1-bit LAMB's and the Adam family's, either way) raises ``ValueError`` naming the optimizer that
        wrote it and this one, changing nothing; OnebitAdam's and ZeroOneAdam's states continue each other with a
        warning (the Adam moments and the step are carried, the other algorithm's own state is dropped)."""
        state_dict = self._check_state_writer(state_dict)
        meta = state_dict.pop(CHECKPOINT_KEY, None)
        code_groups = self.param_groups
        super().load_state_dict(state_dict)
        keep_code_options_(self.param_groups, code_groups)
        self._step = loaded_step(meta, self.state)
        if meta is not None:
            # freeze_step='auto': the detector is kept, not made anew (the strategy may have set its max_step already)
            detector = self._ensure_detector() if self.auto_freeze is not None else None
            self.freeze_step = restored_freeze_step(meta, self._step, self.freeze_step, detector, type(self).__name__)
        saved_plan = meta.get("bucket_plan") if meta is not None else None
        self.momentum_buckets.load_plan(
            plan_from_indices(saved_plan, self._all_params(), type(self).__name__) if saved_plan else None
        )
        self._zero_variance = None  # found again from the loaded variance
        for state in self.state.values():
            state.pop("step", None)  # AdamW's per-parameter step; this optimizer keeps one global step
        self.last_dropped_error_norm = self.compression.reset_error_feedback()

    #: The algorithms whose optimizer state this one can continue from (see :meth:`_check_state_writer`);
    #: ``"torch.optim"``: a torch optimizer's state dict (e.g. AdamW's: its moments and step).
    _continues_state_of: tuple[str, ...] = ("OnebitAdam", "ZeroOneAdam", "torch.optim")

    def _all_params(self) -> list[torch.Tensor]:
        """Every parameter of every param group, in order (how checkpoints index them)."""
        return [p for group in self.param_groups for p in group["params"]]

    def _check_state_writer(self, state_dict: dict[str, Any]) -> dict[str, Any]:
        """A shallow copy of ``state_dict`` that this optimizer can load (:func:`~lightning_onebit.optim.checkpoint.
        continuable_state_dict`): raises ``ValueError`` before any step and any collective when another algorithm
        wrote it that this one cannot continue from; keeps the Adam moments of one it can, with a warning (rank 0)."""
        return continuable_state_dict(
            state_dict, self._state_family(), type(self).__name__, self._continues_state_of,
            warn=self.compression.rank() == 0,
        )

    def error_feedback_state_dict(self) -> dict[str, Any]:
        """This rank's compression error buffers (worker and server, per bucket). Each rank must save its own."""
        return self.compression.error_feedback_state_dict()

    def error_feedback_mismatch(self, state: Any) -> Optional[str]:
        """Why ``state`` (from :meth:`error_feedback_state_dict`, possibly of another rank or run) cannot be restored
        here, or ``None`` if it can. Checks that the optimizer state fits the parameters (the buckets are built from
        it), then the world size, the topology, the bucket layouts (those the buckets have or would have: none is
        built here) and the buffers' sizes and values; changes nothing and does not communicate
        (:meth:`MomentumExchange.feedback_mismatch`)."""
        return self._state_shape_mismatch() or self.exchange.feedback_mismatch(state, self._bucket_layouts_now)

    def _state_shape_mismatch(self) -> Optional[str]:
        """The first parameter whose state holds a tensor of another shape than the parameter's (a checkpoint of a
        model that has changed since), described; ``None`` if none does."""
        for g, group in enumerate(self.param_groups):
            for i, p in enumerate(group["params"]):
                for key, value in (self.state[p] if p in self.state else {}).items():
                    if isinstance(value, torch.Tensor) and value.dim() > 0 and value.shape != p.shape:
                        return (f"the optimizer state {key!r} of {describe_param(group, g, i, p)} has shape "
                                f"{tuple(value.shape)}: the model changed since the checkpoint")
        return None

    def load_error_feedback_state_dict(self, state: dict[str, Any]) -> None:
        """Restore buffers from :meth:`error_feedback_state_dict` of the same rank. Raises ``ValueError`` with the
        reason of :meth:`error_feedback_mismatch` (changing nothing) if they do not fit; callers can then fall back
        to the default reset (:meth:`MomentumExchange.load_feedback_`)."""
        reason = self._state_shape_mismatch()
        if reason is not None:
            raise ValueError(reason)
        self.exchange.load_feedback_(state, self._ensure_buckets)

    def reset_error_feedback(self) -> float:
        """Zero the compression error buffers; returns the L2 norm that was dropped."""
        return self.compression.reset_error_feedback()
