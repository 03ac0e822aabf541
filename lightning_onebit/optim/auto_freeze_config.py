"""The options of ``freeze_step="auto"``: the :class:`AutoFreeze` dataclass, checked when it is made, and the defaults
that depend on the run's length. The rule that uses them is :mod:`lightning_onebit.optim.auto_freeze`'s.
"""

from __future__ import annotations

import dataclasses
from typing import Optional

from lightning_onebit._checks import check_integer, check_real

#: Without ``AutoFreeze(max_step=...)`` the Lightning strategy bounds the warmup by this share of the run. Half: on
#: the synthetic example from scratch the gradients still grow after the loss leaves its plateau at about 13% of the
#: run (1-bit Adam frozen at 20% of it collapsed to chance on one seed, and 1-bit LAMB without its trust-ratio cap
#: frozen at 25%); the rule itself decides before the bound on the real fine-tuning tasks.
DEFAULT_BOUND_SHARE = 0.5
#: The default window is this fraction of ``max_step``: 1/12 of the run under the default bound.
WINDOW_SHARE_OF_BOUND = 6


@dataclasses.dataclass
class AutoFreeze:
    """How ``freeze_step="auto"`` decides the end of the warmup (see :mod:`lightning_onebit.optim.auto_freeze` for the
    rule). Every field is optional.

    Args:
        window: ``W``, the distance in optimizer steps between the two variance snapshots compared. Default ``None``:
            a sixth of ``max_step``, rounded down to a multiple of 4 (at least 4), and at most the time constant of
            the variance's moving average, ``round(1 / (1 - beta2))`` of the first param group (1000 for 0.999). So
            the window follows the run: under the Lightning strategy's default bound (half the run) it is 1/12 of
            the run, and the earliest decision (a full window, then ``patience`` passing checks ``W / 4`` apart) comes
            at about 12.5% of the run; a 600-step run compares windows of 48 steps. Set while the bound is unknown
            (outside Lightning without ``max_step``) it is fixed at the first step.
        check_every: optimizer steps between checks; the window must be a multiple of it. Default ``None``: ``W / 4``
            (rounded so that it divides ``W``).
        threshold: the largest backtest excess ``e`` on the coordinate sample: how far the last window's gradient
            RMS may exceed the ``sqrt(v_hat)`` of a window ago (``0.3``: by 30% on average, so steps with that frozen
            variance would have been at most about 30% larger than Adam's). Also bounds 1-bit LAMB's trust-ratio
            change over the window, averaged over the coordinates. Default ``0.3``.
        tensor_threshold: the same bound for every tensor's ``e_T`` (catches a small tensor still growing, which the
            sample may hardly contain) and for every tensor's trust-ratio change. Default ``1.0``. For 1-bit LAMB
            with its trust-ratio cap (the default) neither the sample's excess nor these are required, only the
            averaged trust-ratio change and the loss guard: its compressed steps cannot outgrow LAMB's.
        loss_drop: the mean training loss over the last window must be at least this fraction below its mean over the
            first ``check_every`` steps (every rank's, when ranks differ). Needs the loss: the Lightning strategy passes
            it; without Lightning call ``optimizer.observe_loss(loss)`` every step or pass ``step(closure)``. ``None``
            switches the guard off (a model on an initial loss plateau may then be frozen there). Default ``0.1``.
        patience: consecutive passing checks needed. Default ``3``.
        min_step: never end the warmup before this step. Default ``None``: the first full window (``W``).
        max_step: end the warmup at this step at the latest. Default ``None``: under the Lightning strategy half of
            ``trainer.estimated_stepping_batches``; without it a number is required (checked at the first step).
        sample_size: coordinates in the fixed random sample (the same on every rank). Default ``2**20``.
        seed: seed of the sample, an integer in ``[-2**63, 2**64 - 1]`` (``torch.Generator.manual_seed``'s range).
            Default ``0``.

    Cost while measuring: ``W / check_every + 1`` snapshots of ``sample_size + number of tensors`` float64 values
    (about 40 MiB with the defaults), one pass over the variance per check, the losses summed on their device (read
    once per check), and one ``all_reduce`` of 6 floats per check (from the first full window on). All of it is freed
    when the warmup ends.
    """

    window: Optional[int] = None
    check_every: Optional[int] = None
    threshold: float = 0.3
    tensor_threshold: float = 1.0
    loss_drop: Optional[float] = 0.1
    patience: int = 3
    min_step: Optional[int] = None
    max_step: Optional[int] = None
    sample_size: int = 2**20
    seed: int = 0

    def __post_init__(self) -> None:
        for name in ("window", "check_every", "min_step", "max_step"):
            check_integer(getattr(self, name), f"AutoFreeze {name}", none=True)
        for name in ("patience", "sample_size"):
            check_integer(getattr(self, name), f"AutoFreeze {name}")
        # the seed of torch.Generator.manual_seed, which takes this range (negative seeds wrap around)
        check_integer(self.seed, "AutoFreeze seed", at_least=-(2**63), at_most=2**64 - 1,
                      what="an integer (the seed of the coordinate sample, in [-2**63, 2**64 - 1])", fix="e.g. seed=0")
        for name in ("threshold", "tensor_threshold"):
            check_real(getattr(self, name), f"AutoFreeze {name}", above=0.0)
        check_real(self.loss_drop, "AutoFreeze loss_drop", at_least=0.0, below=1.0, none=True,
                   fix="a fraction of the initial loss; None switches the loss guard off")
        if self.window is not None and self.check_every is not None and self.window % self.check_every:
            raise ValueError(
                f"AutoFreeze window ({self.window}) must be a multiple of check_every ({self.check_every})"
            )
        if self.min_step is not None and self.max_step is not None and self.min_step > self.max_step:
            raise ValueError(f"AutoFreeze min_step ({self.min_step}) is after max_step ({self.max_step})")
