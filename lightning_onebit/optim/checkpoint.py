"""What a compressed optimizer's checkpoint holds beyond torch's optimizer state, and whose state another can
continue from.

``state_dict()["onebit"]`` (:data:`CHECKPOINT_KEY`) records the global step, the freeze step, the algorithm that
wrote it (``"optimizer"``), the state of ``freeze_step="auto"`` and the momentum bucket plan as parameter indices.
Error feedback is per rank and saved apart (:meth:`CompressedOptimizer.error_feedback_state_dict`).
"""

from __future__ import annotations

import logging
import warnings
from typing import Any, Optional, Sequence

import torch

from lightning_onebit.optim.buckets import Plan

log = logging.getLogger(__name__)

#: The entry of an optimizer state dict that holds what torch's does not.
CHECKPOINT_KEY = "onebit"


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
            why = (
                "1-bit LAMB needs its per-tensor trust-ratio coefficients (lamb_coeff, frozen at the end of "
                f"warmup, and the exchange's lamb_scaling_coeff), which {shown}'s state does not hold"
            )
        elif writer == "OnebitLamb":
            why = (
                "that is 1-bit LAMB's state (layer-wise trust ratios, with a learning rate of another scale), not "
                "the state of an Adam update"
            )
        else:
            why = f"{name} does not continue from {shown}'s state"
        raise ValueError(
            f"{name}.load_state_dict: this optimizer state was written by {shown} and is read by {name}: {why}. "
            f"Resume with the optimizer that wrote it ({shown}); to switch optimizers, start from the checkpoint's "
            "weights only (load its 'state_dict' into the model and fit without ckpt_path), so the new optimizer "
            "starts fresh"
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
            f"moments (exp_avg, exp_avg_sq) and the step are carried over"
            + (f", {writer}'s own per-parameter state ({', '.join(dropped)}) is dropped" if dropped else "")
            + f", and {name} goes on with its own schedule from the step. If this was not meant, resume with "
            f"{writer}.",
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
