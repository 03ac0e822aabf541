"""CONTRIBUTING's "Adding an optimizer", tried: a new compressed optimizer written in this one file from the library's
parts, with nothing added to the library, trained under the ``onebit_adam`` strategy on 2 gloo ranks.

:class:`OnebitSignum` is sign momentum (signSGD with momentum, "Signum") with the 1-bit exchange: AdamW during the
warmup (``adamw_steps_``, which also gives the base its variance: dead coordinates, ``freeze_step="auto"``), then each
step folds this rank's gradient into the momentum, averages the momenta with the 1-bit compressed allreduce, masks them
and moves every coordinate by the learning rate along the averaged momentum's sign::

    m = CompressedAllreduce(b1 m + (1 - b1) g_local) * mask
    p = p (1 - lr wd) - lr sign(m)
"""

from __future__ import annotations

from typing import Any, Optional, Sequence

import pytest
import torch

import lightning.pytorch as pl
from lightning_onebit import OnebitStrategy
from lightning_onebit.optim import CompressedOptimizer, StepKind
from lightning_onebit.optim.buckets import compressed_trainable
from lightning_onebit.optim.functional import fold_gradients_, mask_
from lightning_onebit.optim.onebit_adam import adamw_steps_
from tests.distributed import run_distributed
from tests.lightning_models import Regressor, flat_params, held_out_loss, loader, trainer_kwargs
from tests.tensors import same_bits

FREEZE_STEP, STEPS, LR = 4, 16, 1e-2


# ============================================================================================= the new optimizer
class OnebitSignum(CompressedOptimizer):
    """Sign momentum with 1-bit compressed momentum averaging, after an AdamW warmup of ``freeze_step`` steps.

    Args:
        params: parameters or param-group dicts (the options of :class:`~lightning_onebit.OnebitAdam`'s groups).
        lr: learning rate, the size of every coordinate's step after the warmup. Default ``1e-3``.
        betas: ``(b1, b2)``: the momentum's decay (every step), and the variance's (the warmup's AdamW only).
            Default ``(0.9, 0.999)``.
        eps, weight_decay: AdamW's, for the warmup; decoupled weight decay in every step. Defaults ``1e-8``, ``0``.
        freeze_step: the last warmup step (an int), or ``"auto"``.
        kwargs: the base's (``bucket_cap_mb``, ``process_group``, ``kernel_backend``, ``topology``, ...).
    """

    def __init__(self, params: Any, lr: float = 1e-3, betas: tuple[float, float] = (0.9, 0.999), eps: float = 1e-8,
                 weight_decay: float = 0.0, *, freeze_step: Any, **kwargs: Any) -> None:
        defaults = dict(lr=lr, betas=betas, eps=eps, weight_decay=weight_decay, bias_correction=True)
        super().__init__(params, defaults, freeze_step=freeze_step, **kwargs)

    def _warmup_step(self) -> None:  # averaged gradients: AdamW
        adamw_steps_(self.param_groups, self._moment_state, self.step_count)

    def _full_precision_update_(self, groups: Sequence[dict[str, Any]]) -> None:  # compress=False groups, later on
        adamw_steps_(groups, self._moment_state, self.step_count, compression_stage=True)

    def _compressed_step(self) -> Optional[StepKind]:  # local gradients
        self._step_uncompressed_groups_()
        exchange = self._begin_exchange()  # the buckets, and those the overlap hook started during backward
        for group in self.param_groups:  # fold: m = b1 m + (1 - b1) g, with this rank's gradient
            params = exchange.unfolded(group)
            fold_gradients_([self.state[p]["exp_avg"] for p in params], [p.grad for p in params], group["betas"][0])
        exchange.finish_(self.state)  # exchange: m = the 1-bit compressed average of every rank's m
        for group in self.param_groups:  # mask: exp_avg_mask, and the dead coordinates kept at rest
            params = compressed_trainable(group)
            mask_(group, params, [self.state[p]["exp_avg"] for p in params], self.masks.kept)
        for group in self.param_groups:  # update: p = p (1 - lr wd) - lr sign(m)
            params = self._updated_params(group)
            if params:
                torch._foreach_mul_(params, 1 - group["lr"] * group["weight_decay"])
                torch._foreach_add_(params, torch._foreach_sign([self.state[p]["exp_avg"] for p in params]),
                                    alpha=-group["lr"])
        return StepKind.COMPRESSED


# ==================================================================================== trained under the strategy
class SignumRegressor(Regressor):
    """The strategy tests' regressor, trained by :class:`OnebitSignum`; records each step's averaged momenta."""

    def configure_optimizers(self) -> Any:
        return OnebitSignum(self.parameters(), lr=self.lr, freeze_step=self.freeze_step)

    def _onebit(self) -> Any:
        return self.trainer.strategy.onebit_optimizer

    def optimizer_step(self, *args: Any, **kwargs: Any) -> None:
        super().optimizer_step(*args, **kwargs)
        optimizer = self._onebit()
        self.records[-1]["momenta"] = torch.cat([optimizer.state[p]["exp_avg"].reshape(-1).clone()
                                                 for p in self.parameters()])


def _fit(rank: int, world_size: int, overlap: bool) -> dict[str, Any]:
    torch.manual_seed(0)
    model = SignumRegressor(lr=LR, freeze_step=FREEZE_STEP)
    before = held_out_loss(model)
    trainer = pl.Trainer(**trainer_kwargs(world_size, STEPS, strategy=OnebitStrategy(overlap=overlap)))
    trainer.fit(model, loader(seed=rank, n_batches=STEPS))  # each rank its own data
    optimizer = trainer.strategy.onebit_optimizer
    return dict(
        before=before, after=held_out_loss(model), params=flat_params(model), records=model.records,
        kinds=dict(optimizer.steps_by_kind), calls=optimizer.communication.calls,
        overlapped=trainer.strategy.overlap_state is not None, optimizer=type(optimizer).__name__,
    )


@pytest.mark.parametrize("overlap", [True, False], ids=["overlapped", "in_step"])
def test_an_optimizer_written_in_one_file_trains_under_the_strategy(overlap: bool) -> None:
    ranks = run_distributed(_fit, 2, overlap)
    for result in ranks:
        assert result["optimizer"] == "OnebitSignum"
        assert result["kinds"] == {StepKind.WARMUP: FREEZE_STEP, StepKind.COMPRESSED: STEPS - FREEZE_STEP}
        assert result["overlapped"] is overlap  # the overlap hook starts its exchanges during backward, or step does
        assert result["calls"] > 0  # momenta went through the 1-bit compressed allreduce
        assert result["after"] < 0.5 * result["before"]  # and it learns
    # the replicas are identical after every step: the momentum each rank moved along is the same 1-bit average
    assert same_bits(ranks[0]["params"], ranks[1]["params"])
    for first, second in zip(ranks[0]["records"], ranks[1]["records"]):
        assert same_bits(first["params_after"], second["params_after"])
        assert same_bits(first["momenta"], second["momenta"])
    # a compressed step moves every coordinate by lr along the sign of the averaged momentum (no weight decay here)
    for record in ranks[0]["records"][FREEZE_STEP:]:
        expected = record["params_before"] - LR * torch.sign(record["momenta"])
        assert same_bits(record["params_after"], expected)
