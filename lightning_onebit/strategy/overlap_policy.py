"""When the compressed exchange can start during backward (the overlapped DDP hook), and why not when it cannot.

The overlapped hook folds each gradient bucket into the momenta as soon as backward produces it, so anything that
changes gradients after backward (a GradScaler's unscale and skip, clipping by norm, a hook that edits ``.grad``,
several backward passes per step) would be lost: those runs exchange in ``optimizer.step`` instead
(``OnebitStrategy(overlap="auto")``) or are refused at setup (``overlap=True``).
"""

from __future__ import annotations

from typing import Any, Callable, Literal, Optional, Union

import lightning.pytorch as pl
from lightning.pytorch.plugins.precision import MixedPrecision, Precision
from lightning.pytorch.utilities.model_helpers import is_overridden
from lightning.pytorch.utilities.rank_zero import rank_zero_info

from lightning_onebit._docs import docs_pointer
from lightning_onebit.hooks import OverlapFallbackReason, is_marked_read_only
from lightning_onebit.optim import CompressedOptimizer
from lightning_onebit.optim.base import DEFAULT_BUCKET_CAP_MB

#: The hooks that run between backward and ``optimizer.step`` and may edit ``.grad``.
GRADIENT_HOOKS = ("on_after_backward", "on_before_optimizer_step")

#: The page on when the exchange overlaps backward, and why not.
_DOCS = docs_pointer("guides/overlap")


def overlap_blocker(
    trainer: "pl.Trainer", module: Optional[pl.LightningModule], precision: Precision, ddp_kwargs: dict[str, Any]
) -> Optional[OverlapFallbackReason]:
    """Why this run's exchange cannot overlap backward (``None``: it can). Manual optimization comes last:
    ``overlap=True`` accepts it, so any other reason must be found first."""
    if isinstance(precision, MixedPrecision) and precision.scaler is not None:
        return OverlapFallbackReason(
            "grad_scaler",
            "16-mixed: the GradScaler decides whether to skip a step only after backward, when the momenta already "
            "hold the gradients (use bf16-mixed)",
        )
    if trainer.gradient_clip_val and trainer.gradient_clip_algorithm != "value":
        return OverlapFallbackReason(
            "clip_by_norm",
            "gradient clipping by norm needs the whole gradient before anything is folded (clip by value, "
            "gradient_clip_algorithm='value', runs in the hook)",
        )
    if module is not None and is_overridden("configure_gradient_clipping", module, pl.LightningModule):
        return OverlapFallbackReason(
            "clipping_override",
            "the LightningModule overrides configure_gradient_clipping, which changes gradients after backward",
        )
    hooks = gradient_hooks(trainer, module)
    if hooks:
        return OverlapFallbackReason(
            "gradient_hook",
            f"{' and '.join(hooks)} could edit .grad after the overlap folded it (a hook that only reads it: mark it "
            "@lightning_onebit.hooks.leaves_gradients_unchanged)",
        )
    if ddp_kwargs.get("static_graph") and trainer.accumulate_grad_batches > 1:
        return OverlapFallbackReason(
            "static_graph_accumulation",
            "static_graph with gradient accumulation (DDP's static graph does not support no_sync)",
        )
    if module is not None and not module.automatic_optimization:
        return OverlapFallbackReason(
            "manual_optimization",
            "manual optimization: a step may have several backward passes, and each would fold its gradients into "
            "the momentum at once",
        )
    return None


def gradient_hooks(trainer: "pl.Trainer", module: Optional[pl.LightningModule]) -> list[str]:
    """``Class.hook`` for every :data:`GRADIENT_HOOKS` override of the LightningModule and of the user callbacks
    that is not marked :func:`~lightning_onebit.hooks.leaves_gradients_unchanged`. Callbacks whose hook is defined by
    Lightning or by this package (``MomentumMask`` reads gradients only) do not count; a user subclass that
    overrides the hook does."""
    found = []
    owners: list[tuple[Any, type]] = [(module, pl.LightningModule)]
    owners += [(callback, pl.Callback) for callback in getattr(trainer, "callbacks", None) or []]
    for owner, base in owners:
        if owner is None:
            continue
        for name in GRADIENT_HOOKS:
            if not is_overridden(name, owner, base):
                continue
            hook = getattr(type(owner), name)
            package = (getattr(hook, "__module__", None) or "").split(".")[0]
            if base is pl.Callback and package in ("lightning", "pytorch_lightning", "lightning_onebit"):
                continue
            if not is_marked_read_only(hook):
                found.append(f"{type(owner).__name__}.{name}")
    return found


def explicit_overlap_message(reason: str, strategy: str = "OnebitStrategy") -> str:
    """The error of ``OnebitStrategy(overlap=True)`` (or ``strategy``'s) in a run it cannot serve."""
    return (
        f"{strategy}(overlap=True) cannot overlap the exchange with backward here: {reason}. "
        "Use overlap='auto' (falls back to exchanging in optimizer.step) or overlap=False."
    )


def overlap_fallback(
    overlap: Union[bool, Literal["auto"]],
    reason: Optional[OverlapFallbackReason],
    strategy: str = "OnebitStrategy",
    prefix: str = "onebit_adam",
) -> Optional[OverlapFallbackReason]:
    """What ``OnebitStrategy(overlap=...)`` (or ``strategy``'s) does about ``reason`` (``None``: nothing stops the
    overlap): the reason to exchange in ``optimizer.step`` instead, logged with ``prefix`` (``overlap="auto"``), or
    ``None`` to overlap. ``overlap=True`` raises ``ValueError`` instead, except for manual optimization (a second
    backward pass before ``step`` raises)."""
    if reason is None or (overlap is True and reason.cause == "manual_optimization"):
        return None
    if overlap is True:
        raise ValueError(explicit_overlap_message(reason, strategy))
    rank_zero_info(f"{prefix}: momentum exchange not overlapped with backward: {reason}; {_DOCS}")
    return reason


def decide_overlap(
    overlap: Union[bool, Literal["auto"]],
    optimizer: CompressedOptimizer,
    run_reason: Callable[[], Optional[str]],
    strategy: str = "OnebitStrategy",
    prefix: str = "onebit_adam",
) -> Optional[OverlapFallbackReason]:
    """Both strategies' decision at ``setup_optimizers``: the reason the exchange stays in ``optimizer.step``
    (the optimizer's own first, then ``run_reason()``, the run's from :func:`overlap_blocker` or an override, asked
    only when needed), logged once, or ``None`` to overlap; :func:`overlap_fallback` for ``overlap=True``.
    ``overlap=False``: ``None`` (the caller does not overlap)."""
    if overlap is False:
        return None
    reason = OverlapFallbackReason.of(optimizer.overlap_unsupported_reason, "optimizer") or OverlapFallbackReason.of(
        run_reason()
    )
    return overlap_fallback(overlap, reason, strategy, prefix)


def note_bucket_cap(optimizer: CompressedOptimizer) -> None:
    """Say that the optimizer's own ``bucket_cap_mb``, when not the default, lays out only the momenta outside DDP's
    gradient buckets once the exchange overlaps backward."""
    if optimizer.bucket_cap_bytes != int(DEFAULT_BUCKET_CAP_MB * 2**20):
        rank_zero_info(
            f"onebit_adam: {type(optimizer).__name__}(bucket_cap_mb={optimizer.bucket_cap_bytes / 2**20:g}) "
            "applies only to parameters outside DDP's gradient buckets: the overlapped exchange lays the momenta out "
            f"like DDP's buckets (size them with ddp_bucket_cap_mb); {_DOCS}"
        )
