"""MomentumMask: momentum masks, explicit or detected during warmup (dead coordinates)."""

from __future__ import annotations

import fnmatch
import logging
from typing import Any, Callable, Mapping, Optional, Union

import lightning.pytorch as pl
import torch
from lightning.pytorch.callbacks import Callback
from lightning.pytorch.utilities.rank_zero import rank_zero_info, rank_zero_warn

from lightning_onebit._checks import check_flag, check_integer, check_real
from lightning_onebit._docs import docs_pointer
from lightning_onebit.optim import CompressedOptimizer, OnebitStage, check_exp_avg_mask
from lightning_onebit.strategy.stepping import onebit_optimizer, onebit_strategy

log = logging.getLogger(__name__)


MaskSpec = Union[torch.Tensor, Callable[[torch.Tensor], torch.Tensor]]


class MomentumMask(Callback):
    """Masks momentum coordinates that must not move in the compression stage.

    1-bit compression cannot send an exact zero: a coordinate whose gradient is always zero (BERT position embeddings
    past the training sequence length, embedding rows never looked up) receives ``+-scale`` every step while its
    variance is ~0, and its update explodes to ``scale / eps``. A mask of 0 there keeps its momentum exactly zero
    (DeepSpeed's ``exp_avg_mask`` semantics: the mask multiplies the averaged momentum). If such coordinates should
    train later instead (embedding rows first seen after the warmup), put their parameters in a param group with
    ``"compress": False`` (for an embedding table with ``"sparse_rows": True`` too, which sends only the rows a step
    looked up) rather than masking them: that group's gradients are averaged exactly and its variance stays live (see
    ``OnebitAdam``).

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
            optimizer's own dead-coordinate warning (``OnebitAdam(dead_coordinates=...)``, whose default keeps the
            same coordinates at rest) is switched off, since this callback reports them.
        log_level: logging level (an int) of the per-parameter report of masked coordinates. Default ``logging.INFO``.
        warn_share: warn (on rank 0) when ``auto`` masks more than this share of any parameter's coordinates: they
            stay frozen for the rest of training, which may not be what you want (embedding rows not seen during
            warmup, for instance); the warning names the remedy, a param group with ``"compress": False`` (for an
            embedding table with ``"sparse_rows": True`` too), and the guide page with the others
            (``docs/guides/freeze-step.md``, "Embedding tables"). ``1.0`` never warns. Default ``0.01``.

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
        check_flag(auto, "MomentumMask auto")
        what = "a dict {parameter name or glob: mask tensor, or callable(parameter) -> mask tensor}"
        if masks is not None and not isinstance(masks, Mapping):
            raise ValueError(f"MomentumMask masks must be {what}, e.g. {{'emb.weight': mask}}; got a "
                             f"{type(masks).__name__}")
        for pattern, spec in (masks or {}).items():
            if not isinstance(pattern, str) or not (isinstance(spec, torch.Tensor) or callable(spec)):
                raise ValueError(f"MomentumMask masks must be {what}, e.g. {{'emb.weight': mask}}; got the entry "
                                 f"{pattern!r}: {type(spec).__name__}")
        if not masks and not auto:
            raise ValueError("MomentumMask needs explicit `masks`, `auto=True`, or both")
        self.warn_share = check_real(warn_share, "MomentumMask warn_share", at_least=0.0, at_most=1.0)
        check_integer(log_level, "MomentumMask log_level", at_least=None, what="a logging level, an int",
                      fix="e.g. logging.INFO (20) or logging.DEBUG (10)")
        self.masks = dict(masks or {})
        self.auto = auto
        self.log_level = log_level
        self._explicit: dict[str, torch.Tensor] = {}
        self._seen_nonzero: dict[str, torch.Tensor] = {}
        self._auto_masks: Optional[dict[str, torch.Tensor]] = None
        self._restored_auto: Optional[dict[str, torch.Tensor]] = None
        self._restored_seen: Optional[dict[str, torch.Tensor]] = None
        self._installed = False
        # sharded parameters (onebit_fsdp): masks and statistics are of this rank's shard; checkpoints hold them whole
        self._shards: Optional[Any] = None
        self._stand_ins: dict[str, torch.Tensor] = {}

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
        onebit_strategy(trainer, "MomentumMask")
        self._explicit = self._resolve_explicit(pl_module)
        self._installed = False
        if self.auto:
            self._seen_nonzero = {
                name: torch.zeros_like(p, dtype=torch.bool)
                for name, p in pl_module.named_parameters() if p.requires_grad
            }

    def on_fit_start(self, trainer: "pl.Trainer", pl_module: "pl.LightningModule") -> None:
        # Runs after `strategy.setup` (which calls `setup_optimizers`) and before any step: the optimizer exists.
        onebit = onebit_optimizer(trainer, "MomentumMask")
        held = {id(p) for group in onebit.param_groups for p in group["params"]}
        # the optimizer's tensor of each parameter: the parameter, or under sharding the stand-in over its shard
        named = {name: onebit.shards.stand_in_of(p) for name, p in pl_module.named_parameters()}
        self._shards = onebit.shards if onebit.shards else None
        self._stand_ins = named if self._shards is not None else {}
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
                    f"MomentumMask(auto=True) does not apply to {type(onebit).__name__}: it keeps zero-variance "
                    "coordinates at rest by itself and goes on updating the variance, where auto masks would freeze "
                    "rows that start training later for good. Remove auto=True (explicit masks still apply)."
                )
            compressed = _compressed_ids(onebit)
            self._seen_nonzero = {name: s for name, s in self._seen_nonzero.items() if id(named[name]) in compressed}
            if self._shards is not None:  # setup saw the parameters before sharding: count on the local shards
                self._seen_nonzero = {name: torch.zeros_like(named[name], dtype=torch.bool)
                                      for name in self._seen_nonzero}
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
            saved = None if restored is None else restored.get(name)
            if saved is not None and self._shards is not None and saved.shape == p.shape and saved.shape != seen.shape:
                saved = self._shards.local_part(p, saved)  # saved whole: this rank's part
            if saved is not None and saved.shape == seen.shape:
                seen |= saved.to(p.device)  # the warmup steps before the checkpoint

    # -- detection and installation ----------------------------------------------------------------------------------
    def on_before_optimizer_step(
        self, trainer: "pl.Trainer", pl_module: "pl.LightningModule", optimizer: torch.optim.Optimizer
    ) -> None:
        onebit = onebit_optimizer(trainer, "MomentumMask")
        if onebit.stage is OnebitStage.WARMUP:
            if self.auto and self._auto_masks is None:
                for name, p in pl_module.named_parameters():
                    seen = self._seen_nonzero.get(name)
                    if seen is not None and p.grad is not None:
                        seen |= (p.grad.to_local() if hasattr(p.grad, "to_local") else p.grad) != 0
            return
        if not self._installed:
            self._install(onebit, pl_module)

    def _install(self, onebit: CompressedOptimizer, pl_module: "pl.LightningModule") -> None:
        whole = dict(pl_module.named_parameters())
        named = {name: onebit.shards.stand_in_of(p) for name, p in whole.items()}
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
            if named[name] is not whole[name] and mask.shape == whole[name].shape != named[name].shape:
                mask = onebit.shards.local_part(whole[name], mask)  # saved whole (sharded): this rank's part
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
            onebit.set_exp_avg_mask(whole[name] if mask.shape == whole[name].shape else named[name], mask)
        self._installed = True
        report = {name: int((mask == 0).sum()) for name, mask in combined.items()}
        self.masked_coordinates = report
        for name, count in report.items():
            log.log(self.log_level, "MomentumMask: %s: %d of %d coordinates masked", name, count,
                    combined[name].numel())
        total = sum(report.values())
        table = "".join(
            f"\n  {name}: {count} of {combined[name].numel()} ({count / combined[name].numel():.1%})"
            for name, count in report.items()
        )
        shard = " (rank 0's shard)" if onebit.shards else ""
        rank_zero_info(f"MomentumMask: {total} momentum coordinates masked in {len(report)} parameter(s){shard}{table}")
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
        more = f" and {len(heavy) - 3} more" if len(heavy) > 3 else ""
        rank_zero_warn(
            f"MomentumMask(auto=True) masked {', '.join(heavy[:3])}{more}: rows no warmup batch looked up stay frozen. "
            "To train them: a param group with \"compress\": False (and \"sparse_rows\": True for an embedding); "
            f"{docs_pointer('guides/freeze-step', 'embedding-tables')}"
        )

    # -- checkpoint ----------------------------------------------------------------------------------------------------
    def state_dict(self) -> dict[str, Any]:
        masks = self._auto_masks
        state: dict[str, Any] = {
            "auto_masks": None if masks is None else {k: self._whole(k, v.to(torch.bool)) for k, v in masks.items()}
        }
        if self.auto and masks is None:
            # saved during warmup: the detection so far, so that a resumed warmup still covers every warmup step
            state["seen_nonzero"] = {k: self._whole(k, v) for k, v in self._seen_nonzero.items()}
        return state

    def _whole(self, name: str, local: torch.Tensor) -> torch.Tensor:
        """``local`` on the CPU, made whole from every shard when the parameter is sharded (a collective over the
        shard group: every rank saves its callbacks' state, in the same order): the checkpoint keeps one copy."""
        stand_in = self._stand_ins.get(name)
        if self._shards is not None and stand_in is not None and local.shape == stand_in.shape:
            local = self._shards.whole_of(stand_in, local.to(stand_in.device))
        return local.cpu()

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        saved = state_dict.get("auto_masks")
        self._restored_auto = None if saved is None or not self.auto else dict(saved)
        seen = state_dict.get("seen_nonzero")
        self._restored_seen = dict(seen) if self.auto and saved is None and seen else None
        self._auto_masks = None
        self._installed = False


def _compressed_ids(optimizer: CompressedOptimizer) -> set[int]:
    """The parameters of the optimizer's compressed param groups (those ``compress=False`` groups leave out)."""
    return {id(p) for group in optimizer.param_groups if group["compress"] for p in group["params"]}
