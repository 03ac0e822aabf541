"""Lightning callbacks for 1-bit Adam: momentum masks, compression state across checkpoints, communication logging.

All three need the ``onebit_adam`` strategy (:class:`~lightning_onebit.OnebitStrategy`) and fail at setup with a
clear message otherwise.
"""

from __future__ import annotations

import collections
import dataclasses
import fnmatch
import logging
import statistics
import time
from typing import TYPE_CHECKING, Any, Callable, Literal, Mapping, Optional, Union

import lightning.pytorch as pl
import torch
from lightning.pytorch.callbacks import Callback
from lightning.pytorch.utilities.rank_zero import rank_zero_info, rank_zero_warn

from lightning_onebit.optim import CompressedOptimizer, OnebitStage, StepKind, check_exp_avg_mask
from lightning_onebit.strategy import PER_RANK_STATE_KEY, PER_RANK_STATUS_KEY, OnebitStrategy

if TYPE_CHECKING:
    from lightning_onebit.comm import CommunicationCounters

log = logging.getLogger(__name__)

MaskSpec = Union[torch.Tensor, Callable[[torch.Tensor], torch.Tensor]]


def _onebit_strategy(trainer: "pl.Trainer", who: str) -> OnebitStrategy:
    strategy = trainer.strategy
    if not isinstance(strategy, OnebitStrategy):
        raise ValueError(
            f"{who} needs the 'onebit_adam' strategy (lightning_onebit.OnebitStrategy), but the Trainer uses "
            f"{type(strategy).__name__}. Pass Trainer(strategy='onebit_adam') or remove the callback."
        )
    return strategy


def _onebit_optimizer(trainer: "pl.Trainer", who: str) -> CompressedOptimizer:
    optimizer = _onebit_strategy(trainer, who).onebit_optimizer
    if optimizer is None:
        raise RuntimeError(f"{who}: the onebit_adam strategy has no OnebitAdam connected yet")
    return optimizer


def _compressed_ids(optimizer: CompressedOptimizer) -> set[int]:
    """The parameters of the optimizer's compressed param groups (those ``compress=False`` groups leave out)."""
    return {id(p) for group in optimizer.param_groups if group["compress"] for p in group["params"]}


# ---------------------------------------------------------------------------------------------------------------------
class MomentumMask(Callback):
    """Masks momentum coordinates that must not move in the compression stage.

    1-bit compression cannot send an exact zero: a coordinate whose gradient is always zero (BERT position embeddings
    past the training sequence length, embedding rows never looked up) receives ``+-scale`` every step while its
    variance is ~0, and its update explodes to ``scale / eps``. A mask of 0 there keeps its momentum exactly zero
    (DeepSpeed's ``exp_avg_mask`` semantics: the mask multiplies the averaged momentum). If such coordinates should
    train later instead (embedding rows first seen after the warmup), put their parameters in a param group with
    ``"compress": False`` rather than masking them: that group's gradients are averaged in full precision and its
    variance stays live (see ``OnebitAdam``).

    Args:
        masks: explicit masks, ``{name_or_glob: mask}`` where ``mask`` is a tensor of the parameter's shape or a
            callable ``f(parameter) -> tensor``; bool or floating point, holding only 0 (masked) and 1 (trained).
            Names are those of ``LightningModule.named_parameters()``; a glob (``"*.position_embeddings.weight"``)
            applies to every parameter it matches. Explicit masks always come from the code, also on resume. Errors
            at setup, before any step, naming the parameter: a pattern that matches nothing, a mask of the wrong shape
            or dtype, values other than 0 and 1 (NaN, 2.0, 0.5: the mask multiplies the momentum every compressed
            step), an exact name whose parameter the ``OnebitAdam`` does not hold, or a glob that matches only such
            parameters (a glob skips the ones the optimizer does not hold).
        auto: detect masks during warmup: coordinates whose (averaged) gradient stayed exactly zero in every warmup
            step are masked from the first compressed step on. Costs one bool per parameter element during warmup.
            Where an explicit mask is also given, the two are multiplied. The detected masks are saved in the
            checkpoint and restored on resume. Only parameters the optimizer holds in compressed param groups are
            watched (a ``compress=False`` group needs no mask: a zero gradient averages to an exact zero and its
            variance stays live; a saved auto mask of a parameter now in such a group is not applied), and the
            optimizer's own dead-coordinate warning (``OnebitAdam(warn_dead_coordinates=...)``) is switched off, since
            this masks every coordinate it would report.
        log_level: logging level of the per-parameter report of masked coordinates. Default ``logging.INFO``.
        warn_share: warn (on rank 0) when ``auto`` masks more than this share of any parameter's coordinates: they
            stay frozen for the rest of training, which may not be what you want (embedding rows not seen during
            warmup, for instance); the warning names the remedies, among them a param group with
            ``"compress": False`` for such parameters. ``1.0`` never warns. Default ``0.01``.

    At the first compressed step (when the masks take effect) the callback logs a table of the masked coordinates per
    parameter and the total, and :attr:`masked_coordinates` holds the counts.
    """

    def __init__(
        self,
        masks: Optional[Mapping[str, MaskSpec]] = None,
        auto: bool = False,
        log_level: int = logging.INFO,
        warn_share: float = 0.01,
    ) -> None:
        if not masks and not auto:
            raise ValueError("MomentumMask needs explicit `masks`, `auto=True`, or both")
        if isinstance(warn_share, bool) or not isinstance(warn_share, (int, float)) or not 0 <= warn_share <= 1:
            raise ValueError(f"MomentumMask warn_share must be a number in [0, 1], got {warn_share!r}")
        self.warn_share = float(warn_share)
        self.masks = dict(masks or {})
        self.auto = auto
        self.log_level = log_level
        self._explicit: dict[str, torch.Tensor] = {}
        self._seen_nonzero: dict[str, torch.Tensor] = {}
        self._auto_masks: Optional[dict[str, torch.Tensor]] = None
        self._restored_auto: Optional[dict[str, torch.Tensor]] = None
        self._restored_seen: Optional[dict[str, torch.Tensor]] = None
        self._installed = False

    # -- resolution --------------------------------------------------------------------------------------------------
    def _resolve_explicit(self, pl_module: "pl.LightningModule") -> dict[str, torch.Tensor]:
        named = dict(pl_module.named_parameters())
        resolved: dict[str, torch.Tensor] = {}
        for pattern, spec in self.masks.items():
            names = [pattern] if pattern in named else fnmatch.filter(named, pattern)
            if not names:
                raise ValueError(
                    f"MomentumMask: {pattern!r} matches no parameter of {type(pl_module).__name__}; "
                    f"parameter names look like {list(named)[:4]}"
                )
            for name in names:
                param = named[name]
                mask = spec(param) if callable(spec) else spec
                if not isinstance(mask, torch.Tensor):
                    raise ValueError(f"MomentumMask: the mask for {name!r} is a {type(mask).__name__}, not a tensor")
                mask = check_exp_avg_mask(mask.detach(), param, f"MomentumMask: the mask for {name!r}")
                resolved[name] = mask if name not in resolved else resolved[name] * mask
        return resolved

    def setup(self, trainer: "pl.Trainer", pl_module: "pl.LightningModule", stage: str) -> None:
        if stage != "fit":
            return
        _onebit_strategy(trainer, "MomentumMask")
        self._explicit = self._resolve_explicit(pl_module)
        self._installed = False
        if self.auto:
            self._seen_nonzero = {
                name: torch.zeros_like(p, dtype=torch.bool) for name, p in pl_module.named_parameters() if p.requires_grad
            }

    def on_fit_start(self, trainer: "pl.Trainer", pl_module: "pl.LightningModule") -> None:
        # Runs after `strategy.setup` (which calls `setup_optimizers`) and before any step: the optimizer exists.
        onebit = _onebit_optimizer(trainer, "MomentumMask")
        held = {id(p) for group in onebit.param_groups for p in group["params"]}
        named = dict(pl_module.named_parameters())
        for pattern in self.masks:
            names = [pattern] if pattern in named else fnmatch.filter(named, pattern)
            outside = [name for name in names if id(named[name]) not in held]
            if outside and (pattern in named or len(outside) == len(names)):
                raise ValueError(
                    f"MomentumMask: {pattern!r} names {outside[:4]}, which the OnebitAdam optimizer does not hold "
                    "(configure_optimizers did not pass it), so it has no momentum to mask. Pass the parameter to "
                    "the optimizer or remove its mask."
                )
        self._explicit = {name: mask for name, mask in self._explicit.items() if id(named[name]) in held}
        if self.auto:
            if onebit.masks_zero_variance:
                raise ValueError(
                    f"MomentumMask(auto=True) does not apply to {type(onebit).__name__}: it keeps every coordinate whose "
                    "variance is still zero at rest by itself and goes on updating the variance after its first "
                    f"{onebit.freeze_step} steps, whereas auto masks are fixed then and would freeze for good the "
                    "embedding rows that start training later. Remove auto=True (explicit masks still apply)."
                )
            compressed = _compressed_ids(onebit)
            self._seen_nonzero = {name: s for name, s in self._seen_nonzero.items() if id(named[name]) in compressed}
            onebit.dead_coordinates_masked_by("MomentumMask(auto=True)")  # it masks every coordinate it would report

    def on_train_start(self, trainer: "pl.Trainer", pl_module: "pl.LightningModule") -> None:
        # Runs after the strategy moved the model to its device and after a checkpoint was restored.
        restored, self._restored_seen = self._restored_seen, None
        if not self.auto or self._auto_masks is not None:
            return
        for name, p in pl_module.named_parameters():
            seen = self._seen_nonzero.get(name)
            if seen is None:
                continue
            seen = self._seen_nonzero[name] = seen.to(p.device)  # setup allocated it before the model was moved
            if restored is not None and name in restored and restored[name].shape == seen.shape:
                seen |= restored[name].to(p.device)  # the warmup steps before the checkpoint

    # -- detection and installation ----------------------------------------------------------------------------------
    def on_before_optimizer_step(
        self, trainer: "pl.Trainer", pl_module: "pl.LightningModule", optimizer: torch.optim.Optimizer
    ) -> None:
        onebit = _onebit_optimizer(trainer, "MomentumMask")
        if onebit.stage is OnebitStage.WARMUP:
            if self.auto and self._auto_masks is None:
                for name, p in pl_module.named_parameters():
                    seen = self._seen_nonzero.get(name)
                    if seen is not None and p.grad is not None:
                        seen |= p.grad != 0
            return
        if not self._installed:
            self._install(onebit, pl_module)

    def _install(self, onebit: CompressedOptimizer, pl_module: "pl.LightningModule") -> None:
        named = dict(pl_module.named_parameters())
        held = {id(p) for group in onebit.param_groups for p in group["params"]}
        compressed = _compressed_ids(onebit)
        if self.auto and self._auto_masks is None:
            if self._restored_auto is not None:
                self._auto_masks = self._restored_auto
            elif self._seen_nonzero:
                self._auto_masks = {name: seen.to(named[name].dtype) for name, seen in self._seen_nonzero.items()}
            else:
                raise RuntimeError(
                    "MomentumMask(auto=True) has no warmup statistics: training resumed in the compression stage from "
                    "a checkpoint without saved masks. Resume from a checkpoint written by this callback, or give "
                    "explicit masks."
                )
            self._seen_nonzero = {}
        combined = dict(self._explicit)
        applied_auto: dict[str, torch.Tensor] = {}
        for name, mask in (self._auto_masks or {}).items():
            if name not in named:
                raise ValueError(f"MomentumMask: the saved auto mask names {name!r}, which the model no longer has")
            if id(named[name]) not in held:
                continue  # a saved mask of a parameter this optimizer does not train: nothing to mask
            if id(named[name]) not in compressed:
                # saved before its group got compress=False: averaged in full precision now, it needs no mask
                log.info("MomentumMask: the saved auto mask of %s is not applied: its param group has compress=False",
                         name)
                continue
            if mask.shape != named[name].shape:
                raise ValueError(
                    f"MomentumMask: the saved auto mask for {name!r} has shape {tuple(mask.shape)} but the parameter "
                    f"now has {tuple(named[name].shape)}; masks cannot be re-detected in the compression stage. "
                    "Resume from a warmup checkpoint or give explicit masks."
                )
            mask = mask.to(device=named[name].device, dtype=named[name].dtype)
            applied_auto[name] = mask
            combined[name] = combined[name] * mask if name in combined else mask
        # A mask of all ones changes nothing: leave it out rather than multiply by it every step.
        combined = {name: mask for name, mask in combined.items() if not bool((mask == 1).all())}
        for name, mask in combined.items():
            onebit.set_exp_avg_mask(named[name], mask)
        self._installed = True
        report = {name: int((mask == 0).sum()) for name, mask in combined.items()}
        self.masked_coordinates = report
        for name, count in report.items():
            log.log(self.log_level, "MomentumMask: %s: %d of %d coordinates masked", name, count, combined[name].numel())
        total = sum(report.values())
        table = "".join(
            f"\n  {name}: {count} of {combined[name].numel()} ({count / combined[name].numel():.1%})"
            for name, count in report.items()
        )
        rank_zero_info(f"MomentumMask: {total} momentum coordinates masked in {len(report)} parameter(s){table}")
        self._warn_heavy_auto_masks(applied_auto)

    def _warn_heavy_auto_masks(self, applied_auto: dict[str, torch.Tensor]) -> None:
        """Warn about parameters of which ``auto`` masked more than ``warn_share``: those coordinates never train."""
        heavy = []
        for name, mask in applied_auto.items():
            share = float((mask == 0).sum()) / max(mask.numel(), 1)
            if share > self.warn_share:
                heavy.append(f"{name} {share:.1%} ({int((mask == 0).sum())} of {mask.numel()})")
        if not heavy:
            return
        rank_zero_warn(
            f"MomentumMask(auto=True) masked more than {self.warn_share:.0%} of {', '.join(heavy)}: coordinates whose "
            "gradient was exactly zero in every warmup step (in an embedding, the rows no warmup batch looked up). "
            "They stay frozen for the rest of training, since their variance is 0 and a compressed update would "
            "explode. If they should train: keep such a parameter out of compression by putting it in a param group "
            "of its own with \"compress\": False (e.g. in configure_optimizers `[{\"params\": embeddings, "
            "\"compress\": False}, {\"params\": rest}]`: its gradients are then averaged in full precision every "
            "step, 2 (P-1)/P * 4 bytes per element for fp32, and its variance stays live), freeze later (a larger "
            "freeze_step, or freeze_step='auto'), give explicit masks for the rows you know are unused instead of "
            "auto=True, or use ZeroOneAdam, which goes on updating the variance. MomentumMask(warn_share=1.0) "
            "silences this."
        )

    # -- checkpoint ----------------------------------------------------------------------------------------------------
    def state_dict(self) -> dict[str, Any]:
        masks = self._auto_masks
        state: dict[str, Any] = {
            "auto_masks": None if masks is None else {k: v.to(torch.bool).cpu() for k, v in masks.items()}
        }
        if self.auto and masks is None:
            # saved during warmup: the detection so far, so that a resumed warmup still covers every warmup step
            state["seen_nonzero"] = {k: v.cpu() for k, v in self._seen_nonzero.items()}
        return state

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        saved = state_dict.get("auto_masks")
        self._restored_auto = None if saved is None or not self.auto else dict(saved)
        seen = state_dict.get("seen_nonzero")
        self._restored_seen = dict(seen) if self.auto and saved is None and seen else None
        self._auto_masks = None
        self._installed = False


# ---------------------------------------------------------------------------------------------------------------------
class ErrorFeedbackCheckpoint(Callback):
    """What happens to the compression error buffers when training resumes from a checkpoint.

    Each rank holds its own worker and server error buffers (they are what makes 1-bit compression unbiased over
    time). Lightning writes only rank 0's state, so they need a policy:

    * ``"reset"`` (default, DeepSpeed's behaviour): they restart from zero after a load; the norm that was dropped
      (rank 0's buffers at save time) is logged. The 1-bit Adam paper reports that occasional resets do not hurt.
    * ``"keep"``: every rank saves its own buffers in a sidecar file next to the checkpoint
      (``<checkpoint>.onebit-rank<r>``, see :mod:`lightning_onebit.sidecar`). On resume each rank validates its own
      file: missing, unreadable, corrupt (checksum), stale or foreign (another checkpoint's or another rank's file),
      or mismatched (world size, topology, bucket layout). The ranks then agree with one small collective: if every
      rank can restore, all do, and the resumed run continues bitwise as an uninterrupted one would; if any rank
      cannot, **every** rank resets, and a warning names each such rank, its file and the reason. A bad file never
      stops training under ``keep``.
    * ``"require"``: as ``keep``, but if any rank cannot restore, every rank raises ``RuntimeError`` naming the
      ranks, files and reasons, at the start of training, before any training collective.

    Sidecars are written atomically with the checkpoint's permission bits, follow a checkpoint reached through a
    symbolic link (``save_last="link"``), and are removed with their checkpoint (e.g. by
    ``ModelCheckpoint(save_top_k=...)``), each rank removing its own.

    Restored buffers stay restored when the momentum buckets are laid out anew after the resume (a checkpoint saved
    with ``overlap=False`` resumed with ``overlap=True``, whose hook lays the momenta out like DDP's gradient buckets
    at the second step): the optimizer carries them into the new layout coordinate by coordinate, and logs it.

    Args:
        policy: ``"reset"``, ``"keep"`` or ``"require"``. Default ``"reset"``.
    """

    _STATE_NAME = "error_feedback"
    _POLICIES = ("reset", "keep", "require")

    def __init__(self, policy: Literal["reset", "keep", "require"] = "reset") -> None:
        if policy not in self._POLICIES:
            raise ValueError(f"ErrorFeedbackCheckpoint policy must be one of {self._POLICIES}, got {policy!r}")
        self.policy = policy
        self._pending: Optional[dict[str, Any]] = None
        self._status: Optional[dict[str, Any]] = None
        self._saved_norm: Optional[float] = None
        self._strategy: Optional[OnebitStrategy] = None
        self._loaded = False
        self.restored: Optional[bool] = None  # after a resume: True if buffers were restored, False if reset

    def setup(self, trainer: "pl.Trainer", pl_module: "pl.LightningModule", stage: str) -> None:
        if stage == "fit":
            self._strategy = _onebit_strategy(trainer, "ErrorFeedbackCheckpoint")

    def on_save_checkpoint(
        self, trainer: "pl.Trainer", pl_module: "pl.LightningModule", checkpoint: dict[str, Any]
    ) -> None:
        optimizer = _onebit_optimizer(trainer, "ErrorFeedbackCheckpoint")
        if self.policy != "reset":
            per_rank = checkpoint.setdefault(PER_RANK_STATE_KEY, {})
            per_rank[self._STATE_NAME] = optimizer.error_feedback_state_dict()

    def state_dict(self) -> dict[str, Any]:
        # Lightning collects callback state before it calls `on_save_checkpoint`: measure the norm here, or the
        # checkpoint would carry the norm of the previous save.
        strategy = self._strategy
        optimizer = None if strategy is None else strategy.onebit_optimizer
        if optimizer is not None:
            self._saved_norm = optimizer.compression.error_feedback_norm()
        world_size = None if strategy is None else strategy.world_size
        return {"policy": self.policy, "error_norm_rank0": self._saved_norm, "world_size": world_size}

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        self._saved_norm = state_dict.get("error_norm_rank0")
        self._loaded = True

    def on_load_checkpoint(
        self, trainer: "pl.Trainer", pl_module: "pl.LightningModule", checkpoint: dict[str, Any]
    ) -> None:
        self._loaded = True
        self._pending = (checkpoint.get(PER_RANK_STATE_KEY) or {}).get(self._STATE_NAME)
        self._status = checkpoint.get(PER_RANK_STATUS_KEY)

    def on_train_start(self, trainer: "pl.Trainer", pl_module: "pl.LightningModule") -> None:
        # Runs after the optimizer state was restored (which resets the error buffers), on every rank, before the
        # first training step: the place for the ranks to agree.
        if not self._loaded:
            return
        self._loaded = False
        optimizer = _onebit_optimizer(trainer, "ErrorFeedbackCheckpoint")
        pending, status = self._pending, self._status or {}
        self._pending = self._status = None
        if self.policy == "reset":
            self._reset(optimizer)
            return
        reason = status.get("reason", "the strategy found no per-rank file for this rank")
        if reason is None and pending is None:
            reason = "the per-rank file holds no error feedback (saved without ErrorFeedbackCheckpoint keep)"
        if reason is None:
            reason = optimizer.error_feedback_mismatch(pending)
        verdicts = _gather_verdicts((trainer.global_rank, status.get("file"), reason), optimizer.process_group)
        failures = [(rank, file, why) for rank, file, why in verdicts if why is not None]
        if not failures:
            optimizer.load_error_feedback_state_dict(pending)
            self.restored = True
            rank_zero_info(
                f"ErrorFeedbackCheckpoint: compression error feedback restored on every rank ({len(verdicts)} ranks)"
            )
            return
        text = "; ".join(f"rank {rank} ({file}): {why}" for rank, file, why in failures)
        if self.policy == "require":
            raise RuntimeError(
                f"ErrorFeedbackCheckpoint(policy='require'): compression error feedback cannot be restored: {text}. "
                "Resume from a checkpoint whose per-rank files are intact and match this run, or use "
                "policy='keep' to reset instead."
            )
        rank_zero_warn(f"ErrorFeedbackCheckpoint(policy='keep'): error feedback reset on every rank because {text}")
        self._reset(optimizer)

    def _reset(self, optimizer: CompressedOptimizer) -> None:
        optimizer.reset_error_feedback()
        self.restored = False
        norm = "unknown" if self._saved_norm is None else f"{self._saved_norm:.4g}"
        rank_zero_info(f"ErrorFeedbackCheckpoint: compression error feedback reset (rank 0 norm at save: {norm})")


def _gather_verdicts(mine: tuple, group: Any) -> list[tuple]:
    """Every rank's ``(rank, file, reason)``, in rank order (one small all_gather_object)."""
    if not (torch.distributed.is_available() and torch.distributed.is_initialized()):
        return [mine]
    everyone: list[Any] = [None] * torch.distributed.get_world_size(group)
    torch.distributed.all_gather_object(everyone, mine, group=group)
    return everyone


# ---------------------------------------------------------------------------------------------------------------------
@dataclasses.dataclass
class CompressionAdvice:
    """Whether the compression stage should make steps faster, from what the warmup measured (``CommunicationMonitor``).

    The model: a warmup step of ``step_s`` seconds waited ``exposed_s`` for DDP's gradient allreduce after backward
    had nothing left to compute (the allreduce of the last gradient bucket and whatever of the earlier ones was still
    on the link). In the compression stage that wait goes, and the momentum exchange, ``compressed_bytes /
    warmup_bytes`` of the allreduce's bytes, takes its place: after backward in full (``span_s``, the time the link
    was in use, scaled by the bytes ratio) without overlap, or the part backward cannot hide (``exposed_s``, scaled)
    with overlap::

        expected_step_s = step_s - exposed_s + (exposed_s if overlap else span_s) * compressed_bytes / warmup_bytes

    It leaves out the compression kernels and the cheaper frozen-variance update (both a few percent of a step in
    this project's CPU measurements) and assumes the link, not the collective's fixed costs, is what takes the time.

    Attributes:
        warmup_steps: warmup steps measured (the last ones, at most ``CommunicationMonitor(advise_steps=...)``).
        step_s: median warmup step time, seconds (the slowest rank's).
        exposed_s: median time per warmup step spent waiting for the gradient allreduce after backward, seconds (the
            least-waiting rank's: the rank with the most compute sets the pace once the wait is gone).
        span_s: median time per warmup step from the first gradient bucket's launch to the completion of the last
            allreduce, seconds: an upper bound on the link's busy time.
        warmup_bytes: bytes this rank sent per warmup step (the largest over ranks).
        compressed_bytes: bytes sent in the first compression-stage step (the largest over ranks).
        overlap: whether the compression stage overlaps the exchange with backward.
        expected_step_s: the estimate above, seconds.
        measured_step_s: median compression-stage step time of the slowest rank, seconds, once measured (``None``
            before).
        measured_steps: compression-stage steps in that median.
    """

    warmup_steps: int
    step_s: float
    exposed_s: float
    span_s: float
    warmup_bytes: float
    compressed_bytes: float
    overlap: bool
    expected_step_s: float = dataclasses.field(init=False)
    measured_step_s: Optional[float] = None
    measured_steps: int = 0

    #: below this share of a step saved, the advice says compression cannot help
    NEGLIGIBLE_SAVING = 0.05

    def __post_init__(self) -> None:
        ratio = self.compressed_bytes / self.warmup_bytes if self.warmup_bytes else 1.0
        on_link = self.exposed_s if self.overlap else self.span_s
        self.expected_step_s = max(0.0, self.step_s - self.exposed_s + on_link * ratio)

    @property
    def helps(self) -> bool:
        """Whether the expected step is at least :attr:`NEGLIGIBLE_SAVING` (5%) shorter than the warmup step."""
        return self.step_s - self.expected_step_s >= self.NEGLIGIBLE_SAVING * self.step_s

    def message(self) -> str:
        """The estimate in words, saying plainly when compression cannot make steps faster."""
        fewer = f"{self.warmup_bytes / self.compressed_bytes:.1f}x fewer" if self.compressed_bytes else "no"
        share = self.exposed_s / self.step_s if self.step_s else 0.0
        text = (
            f"gradient allreduce exposed {_seconds(self.exposed_s)} of a {_seconds(self.step_s)} step ({share:.0%}, "
            f"median of the last {self.warmup_steps} warmup steps); the compression stage sends "
            f"{_bytes(self.compressed_bytes)} per step instead of {_bytes(self.warmup_bytes)} ({fewer} bytes)"
        )
        if self.helps:
            return f"{text}: expect about {_seconds(self.expected_step_s)} per step " \
                   f"({self.step_s / self.expected_step_s:.2f}x faster)"
        return (
            f"{text}: expect about {_seconds(self.expected_step_s)} per step. The link is fast enough here that "
            "compression cannot make steps noticeably faster: plain DDP (strategy='ddp') would train about as fast, "
            "and 1-bit compression only saves bytes"
        )

    def measured_message(self) -> str:
        """The measured compression-stage step next to the estimate."""
        assert self.measured_step_s is not None
        return (
            f"compression-stage step measured {_seconds(self.measured_step_s)} (median of {self.measured_steps} "
            f"steps, slowest rank) against {_seconds(self.expected_step_s)} estimated and "
            f"{_seconds(self.step_s)} in warmup ({self.step_s / self.measured_step_s:.2f}x)"
        )


def _seconds(value: float) -> str:
    return f"{value * 1000:.0f} ms" if value < 1 else f"{value:.2f} s"


def _bytes(value: float) -> str:
    for unit, size in (("GB", 1e9), ("MB", 1e6), ("kB", 1e3)):
        if value >= size:
            return f"{value / size:.1f} {unit}"
    return f"{value:.0f} B"


class CommunicationMonitor(Callback):
    """Logs this rank's communication every optimizer step to the Trainer's logger, and says whether compression pays.

    Metrics (bytes are real payload bytes of this rank in this step unless marked total):

    * ``comm/bytes_sent``, ``comm/bytes_received``
    * ``comm/bytes_sent_inter_node``: the part of ``bytes_sent`` that crossed to other nodes (what the slow link
      carries); ``comm/bytes_sent_intra_node``: the part that stayed inside this rank's node. Which ranks share a node
      comes from the strategy's topology (the cluster environment).
    * ``comm/bytes_fp32_equivalent``: what an fp32 ring allreduce of the same gradients/momenta sends
    * ``comm/bytes_sent_uncompressed``: compression stage, the part of ``bytes_sent`` that averaged the gradients of
      param groups with ``compress=False`` in full precision (0 without such groups)
    * ``comm/compression_ratio``: ``bytes_fp32_equivalent / bytes_sent`` (1 in fp32 warmup, ~32 compressed; lower
      with ``compress=False`` groups, whose bytes count in both at their full size)
    * ``comm/bytes_sent_total``: cumulative since the start of ``fit``
    * ``comm/time_ms``: time in communication calls (compressed allreduce including its compression kernels; for
      the warmup allreduce, launch-to-completion of each bucket, which overlaps the backward pass)
    * ``comm/exposed_ms``: the exchange time the step could not hide behind backward. Warmup: from the launch of the
      allreduce of DDP's last gradient bucket to the completion of every allreduce. Compression stage: the time
      ``optimizer.step`` spent on the momentum exchange after backward (waiting on the link, decoding, and all of it
      for buckets not started during backward; without overlap, the whole exchange).
    * ``comm/hook_ms``: compression stage, time spent during backward in DDP's hooks folding, compressing and launching
      the overlapped exchange (0 without overlap). On CPU it runs on the backward thread; on CUDA on a side stream.
    * ``comm/stage``: 0 warmup, 1 compression (the stage of the step just taken)
    * ``onebit/freeze_step``: with ``freeze_step="auto"``, the step it decided (from the decision on; also in the
      progress bar)

    Warmup steps count DDP's gradient allreduce. The progress bar shows short names that fit a terminal: ``stage``
    (``comm/stage``), ``1bit_x`` (``comm/compression_ratio``) and ``freeze`` (``onebit/freeze_step``).

    **Will compression help?** With ``advise=True``, the callback times the warmup steps (wall time between optimizer
    steps) and the gradient allreduce's exposed time, and at the first compression-stage step logs
    :class:`CompressionAdvice`: the share of the step that waited for the allreduce, the bytes per step before and
    after, and the expected compression-stage step time, saying plainly when the link is fast enough that compression
    cannot help. After ``advise_steps`` more steps it logs the measured compression-stage step time next to the
    estimate. Both go to the log (rank 0) and the logger (``advisor/warmup_step_ms``, ``advisor/exposed_ms``,
    ``advisor/expected_step_ms``, ``advisor/measured_step_ms``); :attr:`advice` holds them. Each costs one small
    ``all_reduce`` (every rank's figures: the advice is the slowest rank's). A run resumed in the compression stage
    measured no warmup and gets no advice (the log says so). With ``ZeroOneAdam``, whose steps after its warmup mix
    full-precision variance steps, 1-bit compressed steps and local steps, the advice is about its 1-bit steps: it is
    given at the first one and measured on those only (until its local steps begin), and the log says what it covers.

    Args:
        prog_bar: show ``stage``, ``1bit_x`` and ``freeze`` in the progress bar. Default ``True``.
        advise: estimate whether compression will make steps faster, as above. Default ``True``.
        advise_steps: warmup steps the estimate uses (the last ones; the first 2 steps of a fit, which build DDP's
            buckets and warm allocators up, are never used) and compression-stage steps measured after it (counted
            from the 3rd). Default ``20``.
    """

    #: steps at the start of fit, and of the compression stage, that the advice does not time
    SETTLING_STEPS = 2

    def __init__(self, prog_bar: bool = True, advise: bool = True, advise_steps: int = 20) -> None:
        for name, value in (("prog_bar", prog_bar), ("advise", advise)):
            if not isinstance(value, bool):  # "yes", "no", 0 and 1 would all read as a truth value
                raise ValueError(f"CommunicationMonitor {name} must be True or False, got {value!r}")
        if isinstance(advise_steps, bool) or not isinstance(advise_steps, int) or advise_steps < 1:
            raise ValueError(f"CommunicationMonitor advise_steps must be an integer >= 1, got {advise_steps!r}")
        self.prog_bar = prog_bar
        self.advise = advise
        self.advise_steps = advise_steps
        self.advice: Optional[CompressionAdvice] = None
        self._last: Optional[CommunicationCounters] = None
        self._start: Optional[CommunicationCounters] = None
        self._last_step = -1
        self._last_time: Optional[float] = None
        self._last_span = 0.0
        self._steps_timed = 0
        self._warmup: collections.deque[tuple[float, float, float, int]] = collections.deque(maxlen=advise_steps)
        self._compressed: list[float] = []
        self._advice_done = False
        self._optimizer_note: Optional[str] = None  # what the advice adds about steps it does not time

    def setup(self, trainer: "pl.Trainer", pl_module: "pl.LightningModule", stage: str) -> None:
        if stage == "fit":
            _onebit_strategy(trainer, "CommunicationMonitor")

    def on_train_start(self, trainer: "pl.Trainer", pl_module: "pl.LightningModule") -> None:
        strategy = _onebit_strategy(trainer, "CommunicationMonitor")
        self._start = self._last = strategy.communication
        self._last_step = trainer.global_step
        self._last_span = strategy.gradient_sync.span_s
        self._last_time = None
        self._steps_timed = 0
        self._warmup.clear()
        self._compressed = []
        self.advice = None
        self._advice_done = False
        self._optimizer_note = strategy.onebit_optimizer.advisor_note

    def on_train_batch_end(
        self, trainer: "pl.Trainer", pl_module: "pl.LightningModule", outputs: Any, batch: Any, batch_idx: int
    ) -> None:
        if trainer.global_step == self._last_step:  # accumulating: no optimizer step yet
            return
        self._last_step = trainer.global_step
        now_s = time.perf_counter()
        step_s = None if self._last_time is None else now_s - self._last_time
        self._last_time = now_s
        optimizer = _onebit_optimizer(trainer, "CommunicationMonitor")
        strategy = _onebit_strategy(trainer, "CommunicationMonitor")
        now = strategy.communication
        step = now - self._last
        self._last = now
        span_s, self._last_span = strategy.gradient_sync.span_s - self._last_span, strategy.gradient_sync.span_s
        frozen = optimizer.freeze_step
        compressed = frozen is not None and optimizer.step_count > frozen
        stage = 1.0 if compressed else 0.0
        ratio = step.bytes_fp32_equivalent / step.bytes_sent if step.bytes_sent else 0.0
        metrics = {
            "comm/bytes_sent": float(step.bytes_sent),
            "comm/bytes_received": float(step.bytes_received),
            "comm/bytes_sent_intra_node": float(step.bytes_sent_intra_node),
            "comm/bytes_sent_inter_node": float(step.bytes_sent_inter_node),
            "comm/bytes_fp32_equivalent": float(step.bytes_fp32_equivalent),
            "comm/bytes_sent_uncompressed": float(step.bytes_sent_uncompressed),
            "comm/bytes_sent_total": float((now - self._start).bytes_sent),
            "comm/time_ms": 1000.0 * step.time_s,
            "comm/exposed_ms": 1000.0 * step.exposed_s,
            "comm/hook_ms": 1000.0 * step.hook_s,
        }
        pl_module.log_dict(metrics, on_step=True, on_epoch=False, batch_size=1)
        shown = {"comm/stage": stage, "comm/compression_ratio": ratio}
        short = {"stage": stage, "1bit_x": ratio}
        if optimizer.auto_freeze is not None and frozen is not None:
            shown["onebit/freeze_step"] = short["freeze"] = float(frozen)  # the step freeze_step='auto' decided
        pl_module.log_dict(shown, on_step=True, on_epoch=False, batch_size=1)
        if self.prog_bar:  # short names that fit a terminal; the logger has the full ones
            pl_module.log_dict(short, on_step=True, on_epoch=False, prog_bar=True, logger=False, batch_size=1)
        if self.advise and not self._advice_done:
            if compressed and optimizer.last_step_kind is not StepKind.COMPRESSED:
                # after the warmup, 0/1 Adam's variance steps cost a warmup step and its local steps send (almost)
                # nothing: the advice is about 1-bit compressed steps, so it times those only
                self._other_step(trainer, strategy, optimizer)
            else:
                self._advise(trainer, strategy, compressed, step, step_s, span_s)

    # -- will compression help? --------------------------------------------------------------------------------------
    def _advise(
        self,
        trainer: "pl.Trainer",
        strategy: OnebitStrategy,
        compressed: bool,
        step: CommunicationCounters,
        step_s: Optional[float],
        span_s: float,
    ) -> None:
        """Record one optimizer step; at the first compressed step estimate, ``advise_steps`` later measure."""
        self._steps_timed += 1
        if not compressed:
            if self._steps_timed > self.SETTLING_STEPS and step_s is not None:
                self._warmup.append((step_s, step.exposed_s, span_s, step.bytes_sent))
            return
        if self.advice is None:
            # The first compressed step: every rank is here (the stage is rank-identical), so the reduction is safe.
            if not self._warmup:
                self._advice_done = True  # resumed in the compression stage, or too short a warmup to time
                rank_zero_info(
                    "CommunicationMonitor: no compression advice: no warmup step was timed in this fit (more than "
                    f"{self.SETTLING_STEPS} warmup steps are needed)"
                )
                return
            step_times, exposed, spans, sent = zip(*self._warmup)
            figures = _reduce_max(
                strategy,
                [statistics.median(step_times), -statistics.median(exposed), statistics.median(spans),
                 statistics.median(sent), step.bytes_sent],
            )
            self.advice = CompressionAdvice(
                warmup_steps=len(self._warmup),
                step_s=figures[0],
                exposed_s=-figures[1],
                span_s=figures[2],
                warmup_bytes=figures[3],
                compressed_bytes=figures[4],
                overlap=strategy.overlap_state is not None and strategy.overlap_state.enabled,
            )
            self._warmup.clear()
            rank_zero_info(f"onebit_adam advisor: {self.advice.message()}{self._note}")
            _log_once(
                trainer,
                {
                    "advisor/warmup_step_ms": 1000.0 * self.advice.step_s,
                    "advisor/exposed_ms": 1000.0 * self.advice.exposed_s,
                    "advisor/expected_step_ms": 1000.0 * self.advice.expected_step_s,
                },
            )
            self._steps_timed = 1
            return
        if self._steps_timed > self.SETTLING_STEPS and step_s is not None:
            self._compressed.append(step_s)
        if len(self._compressed) < self.advise_steps:
            return
        self._measured(trainer, strategy)

    def _measured(self, trainer: "pl.Trainer", strategy: OnebitStrategy) -> None:
        assert self.advice is not None and self._compressed
        self.advice.measured_step_s = _reduce_max(strategy, [statistics.median(self._compressed)])[0]
        self.advice.measured_steps = len(self._compressed)
        self._advice_done = True
        rank_zero_info(f"onebit_adam advisor: {self.advice.measured_message()}{self._note}")
        _log_once(trainer, {"advisor/measured_step_ms": 1000.0 * self.advice.measured_step_s})

    @property
    def _note(self) -> str:
        return self._optimizer_note or ""

    def _other_step(self, trainer: "pl.Trainer", strategy: OnebitStrategy, optimizer: CompressedOptimizer) -> None:
        """A step after the warmup that is not a 1-bit compressed step (0/1 Adam's variance, local or sync steps):
        not timed. Once local steps begin there are no more 1-bit steps to time: the advice ends with what it has
        (the schedule is the same on every rank, so every rank ends here at the same step)."""
        if optimizer.last_step_kind not in (StepKind.LOCAL, StepKind.SYNC):
            return  # a variance step: a warmup step's cost, as the note says
        if self.advice is None:
            self._advice_done = True
            rank_zero_info(
                f"CommunicationMonitor: no compression advice: in this fit {type(optimizer).__name__} took no 1-bit "
                "compressed step before its local steps, so there is no compressed step to estimate; its local "
                f"steps send nothing but a 1-bit sync of the accumulated update now and then{self._note}"
            )
        elif self._compressed:
            self._measured(trainer, strategy)
        else:
            self._advice_done = True
            rank_zero_info(
                f"onebit_adam advisor: the 1-bit steps were not measured: {type(optimizer).__name__}'s local steps "
                f"began before a 1-bit step after the estimate's first {self.SETTLING_STEPS} could be timed"
                f"{self._note}"
            )


def _log_once(trainer: "pl.Trainer", metrics: dict[str, float]) -> None:
    """Send ``metrics`` to the Trainer's loggers at this step only (``LightningModule.log`` would repeat them at every
    logging step after this one)."""
    for logger in trainer.loggers:
        logger.log_metrics(metrics, step=trainer.global_step)


def _reduce_max(strategy: OnebitStrategy, values: list[float]) -> list[float]:
    """Elementwise maximum over the ranks of the strategy's process group (one small ``all_reduce``)."""
    if not (torch.distributed.is_available() and torch.distributed.is_initialized()):
        return [float(v) for v in values]
    tensor = torch.tensor(values, dtype=torch.float64, device=strategy.root_device)
    group = None if strategy.onebit_optimizer is None else strategy.onebit_optimizer.process_group
    torch.distributed.all_reduce(tensor, op=torch.distributed.ReduceOp.MAX, group=group)
    return tensor.tolist()


# ---------------------------------------------------------------------------------------------------------------------
class ReplicaCheck(Callback):
    """Fails loudly if the model replicas stop being bitwise identical.

    In both stages every rank applies the same update to the same parameters, so replicas must stay bit-identical
    with no parameter broadcast (with :class:`~lightning_onebit.ZeroOneAdam`, after every sync: a check that falls
    between syncs waits for the next one). Ranks that run different kernels (see ``OnebitAdam.agree_kernel_backend``), a
    nondeterministic custom op or a corrupted rank would make them drift apart silently. Every ``every_n_steps``
    optimizer steps this callback compares a checksum of every parameter's bits across ranks
    (:meth:`OnebitStrategy.assert_replicas_identical`: one pass over the parameters and an all-gather of 8 bytes per
    parameter tensor) and raises ``RuntimeError`` on every rank, naming the parameters that differ.

    Args:
        every_n_steps: check after every this many optimizer steps (``>= 1``). Default ``100``.
    """

    def __init__(self, every_n_steps: int = 100) -> None:
        if isinstance(every_n_steps, bool) or not isinstance(every_n_steps, int) or every_n_steps < 1:
            raise ValueError(f"ReplicaCheck every_n_steps must be an integer >= 1, got {every_n_steps!r}")
        self.every_n_steps = every_n_steps
        self.checks = 0
        self._last_step = -1
        self._due = False  # a check fell between two syncs of an optimizer with local steps

    def setup(self, trainer: "pl.Trainer", pl_module: "pl.LightningModule", stage: str) -> None:
        if stage == "fit":
            _onebit_strategy(trainer, "ReplicaCheck")

    def on_train_batch_end(
        self, trainer: "pl.Trainer", pl_module: "pl.LightningModule", outputs: Any, batch: Any, batch_idx: int
    ) -> None:
        step = trainer.global_step
        if step == 0 or step == self._last_step:
            return
        self._last_step = step
        self._due = self._due or step % self.every_n_steps == 0
        optimizer = _onebit_optimizer(trainer, "ReplicaCheck")
        if not self._due or not optimizer.replicas_in_sync:  # (rank-identical: the sync schedule is)
            return
        self._due = False
        trainer.strategy.assert_replicas_identical(pl_module)
        self.checks += 1
