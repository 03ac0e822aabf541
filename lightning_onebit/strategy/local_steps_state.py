"""What ``onebit_diloco`` reads back from a rank's sidecar (:class:`~lightning_onebit.strategy.local_steps.
OnebitDiLoCoStrategy`'s per-rank state): the agreement that every rank has its own, and the outer state of a sidecar
saved before streaming, in today's form."""

from __future__ import annotations

from typing import Any

from lightning_onebit.comm.agreement import agree
from lightning_onebit.strategy.checkpoint import PER_RANK_STATE_KEY, PER_RANK_STATUS_KEY

__all__ = ["STATE_KEY", "agreed_per_rank_state", "streaming_outer_state"]

#: The key of the strategy's part of a rank's per-rank checkpoint state.
STATE_KEY = "onebit_diloco"


def agreed_per_rank_state(checkpoint: dict[str, Any]) -> dict[str, Any]:
    """This rank's state from its sidecar, once every rank has said it has its own (a collective): else a
    ``RuntimeError`` on every rank naming the ranks whose sidecar cannot be used and why."""
    state = (checkpoint.get(PER_RANK_STATE_KEY) or {}).get(STATE_KEY)
    status = checkpoint.get(PER_RANK_STATUS_KEY) or {}
    reason = None if state is not None else (status.get("reason") or "it holds no onebit_diloco state")
    problems = {rank: (file, why) for rank, (file, why) in enumerate(agree((status.get("file"), reason)))
                if why is not None}
    if problems:
        raise RuntimeError(
            "onebit_diloco cannot resume: every rank needs its own sidecar (its parameters, inner optimizer state, "
            f"error feedback and outer momentum), and {problems} (rank: (file, reason)). Resume from a checkpoint "
            "whose sidecars are all present, or load only its weights (the outer model) and start a new fit"
        )
    assert state is not None
    return state


def streaming_outer_state(state: dict[str, Any], sync_every: int) -> dict[str, Any]:
    """The outer state of a per-rank state, as :meth:`~lightning_onebit.optim.streaming.StreamingOuterStep.
    load_state_dict` takes it; a sidecar saved before streaming holds one :class:`~lightning_onebit.optim.outer_step.
    OuterStep`'s: one fragment, synced every ``sync_every`` inner steps, nothing in flight."""
    outer = state["outer"]
    if "fragments" in outer:
        return outer
    since = int(state["inner_steps"]) % sync_every
    return {"fragments": [outer], "last_started": [int(state["inner_steps"]) - since], "params_are_outer": since == 0,
            "rebases": []}
