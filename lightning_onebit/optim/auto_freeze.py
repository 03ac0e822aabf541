"""``freeze_step="auto"``: end the warmup once a variance frozen a window ago would have covered the gradients since,
and training has left its initial plateau; decided by every rank together.

The rule (1-bit Adam's variance-stability idea, reworked on the example's freeze-step sweep). Every ``check_every``
warmup steps, with ``v_t`` the raw variance now, ``v_{t-W}`` the one ``window`` steps earlier, ``a = beta2^W`` and ``c``
the bias corrections:

* the mean squared gradient of the last ``W`` steps follows from the two snapshots, with no extra state:
  ``E = (v_t - a v_{t-W}) / (1 - a)`` (weighted within the window as ``v`` weights it);
* a **backtest** of freezing ``W`` steps ago: the excess of those gradients over the ``sqrt(v_hat)`` the compression
  stage would have frozen then, ``sqrt(v_{t-W} / c_{t-W})``, on a fixed random coordinate sample and per tensor::

      e = sum max(0, sqrt(E) - sqrt(v_hat_{t-W})) / sum sqrt(v_hat_{t-W})       (the sample)
      e_T = max over tensors of max(0, sqrt(sum_T E / sum_T v_hat_{t-W}) - 1)    (tensors whose variance is
                                                                                  numerically zero left out)

  Only an excess counts: frozen steps are ``m / sqrt(v_hat)``, so gradients that outgrow the frozen estimate make
  them larger than Adam's (the classic failure of an early freeze), while gradients that shrink only make them
  smaller. Unlike the relative change of ``sqrt(v_hat)`` itself, ``e`` does not fade as ``W / t`` merely because
  ``v_hat`` averages ever more steps early in training (with ``beta2 = 0.999`` it is close to a plain mean of all
  steps for the first thousand);
* the **training loss**, when the optimizer is given it (the Lightning strategy does; see
  :meth:`~lightning_onebit.optim.base.CompressedOptimizer.observe_loss`): its mean over the last window must be at least
  ``loss_drop`` below its mean over the first ``check_every`` steps. A model on its initial plateau has steady, small
  gradients that pass the backtest, and a variance frozen there is far too small for the gradients that come when the
  loss starts to fall (the example's sweep: freezing on the plateau left the task at chance);
* for 1-bit LAMB, the relative change of its trust-ratio EMAs over the window, read like the variance: averaged over
  the coordinates (each tensor's change weighted by its size) against ``threshold``, and at its largest tensor against
  ``tensor_threshold``. A small tensor's ratio ``||p|| / ||u||`` can swing by half within a window while the
  coordinates' average has settled (AG News: 0.664 at the largest tensor when the run reached its bound). With the
  trust-ratio cap (``OnebitLamb(cap_trust_ratio=True)``, the default) only that average and the loss guard are
  required; the backtest and the largest tensor's change are reported (:attr:`VarianceReading.steps_capped`). Every
  tensor's compressed step is then at most LAMB's, so gradients that outgrow the frozen variance, or a frozen ratio
  above the live one, cannot enlarge it. On the synthetic example the backtest held 1-bit LAMB's warmup to its
  bound (excess 1.5 at half the run), while a warmup fixed at a quarter of the run ended within 0.3 point of LAMB
  that never freezes.

The ranks take the maximum of each figure with one ``all_reduce`` of a few floats, so every rank sees the same
figures and decides the same step. The warmup ends after the check where all of them have passed for ``patience``
checks in a row, not before ``min_step``, and at ``max_step`` at the latest.
"""

from __future__ import annotations

import collections
import dataclasses
import logging
import math
import time
from typing import Any, Callable, Optional, Sequence, Union

import torch
import torch.distributed as dist

from lightning_onebit._checks import is_real

# AutoFreeze and its defaults are defined in auto_freeze_config; imported here too, where callers import them from
from lightning_onebit.optim.auto_freeze_config import DEFAULT_BOUND_SHARE, WINDOW_SHARE_OF_BOUND, AutoFreeze
from lightning_onebit.optim.auto_freeze_figures import agree_max, draw_sample, excesses, read_on_host

__all__ = ["DEFAULT_BOUND_SHARE", "AutoFreeze", "FreezeDetector", "VarianceReading"]

log = logging.getLogger(__name__)


@dataclasses.dataclass(frozen=True)
class VarianceReading:
    """What :class:`FreezeDetector` reads at a check. The optimizer supplies it through a callable that the detector
    calls only at check steps, so the detector holds no reference to the optimizer.

    Attributes:
        variances: one entry per measured tensor, in a fixed order: ``(numel, v, correction, beta2)``, with ``v`` the
            raw variance (``None`` where the tensor has none yet), ``correction`` the bias correction the update
            divides it by now (1 without bias correction) and ``beta2`` the tensor's.
        extra: other figures that must settle before a freeze (1-bit LAMB's trust-ratio EMAs), one tensor with one
            value per measured tensor, in the same order; ``None`` or empty for none.
        device: where the ranks' agreement runs (NCCL takes CUDA tensors only).
        process_group: the ranks that decide together (``None``: WORLD).
        steps_capped: the optimizer's compressed steps can never be larger than its warmup steps, whatever the
            gradients do after the freeze (1-bit LAMB with ``cap_trust_ratio``: every tensor's step is at most
            LAMB's). A gradient excess, or one tensor's trust ratio still moving, can then only make steps smaller
            than the warmup's, never larger, so these figures are measured and reported but do not hold the freeze;
            the loss guard and the coordinates' mean trust-ratio change still do. Default ``False``.
    """

    variances: Sequence[tuple[int, Optional[torch.Tensor], float, float]]
    extra: Optional[torch.Tensor]
    device: torch.device
    process_group: Optional[dist.ProcessGroup]
    steps_capped: bool = False


class FreezeDetector:
    """The measuring state of :class:`AutoFreeze` for one optimizer (snapshots, losses, streak, last figures).

    Args:
        config: the settings.
        beta2: the first param group's ``beta2`` (the default window is its time constant).
        owner: the optimizer's name, for messages.
    """

    def __init__(self, config: AutoFreeze, beta2: float, owner: str = "the optimizer") -> None:
        self.config = config
        self.owner = owner
        self.time_constant = max(1, round(1 / (1 - beta2)))  # of the variance's moving average, in steps
        self.max_step = config.max_step
        # the schedule (window, check interval, first decision step): set once the bound is known (see _schedule)
        self.window: Optional[int] = None
        self.check_every: Optional[int] = None
        self.min_step: Optional[int] = None
        self.streak = 0
        self.seconds = 0.0  # wall time spent measuring and agreeing (this process)
        self.last: Optional[dict[str, Any]] = None  # figures of the latest comparison
        self.reason: Optional[str] = None  # why the warmup ended, once it has
        self._snapshots: dict[int, tuple[torch.Tensor, torch.Tensor, torch.Tensor]] = {}
        self._sample: Optional[list[tuple[int, torch.Tensor]]] = None  # (parameter index, flat indices)
        self._sample_on: dict[tuple[int, torch.device], torch.Tensor] = {}  # the sample's indices, moved once
        # losses: summed on their device between checks (no host sync per step), then one (sum, count) per check
        self._loss_sum: Optional[torch.Tensor] = None
        # a sum restored from a checkpoint (a number): added to the first loss recorded after the resume, on that
        # loss's device (a CPU tensor here would make every later micro-batch copy its loss to the CPU: a host sync)
        self._loss_carry: Optional[float] = None
        self._loss_count = 0
        self._loss_intervals: collections.deque[tuple[float, int]] = collections.deque()
        self._initial_loss: Optional[float] = None
        if config.window is not None or config.max_step is not None:
            self._schedule()

    def _schedule(self) -> None:
        """Fix the window, the check interval and the first decision step, from the settings and the bound."""
        config = self.config
        if config.window is not None:
            window = config.window
        else:
            window = min(self.time_constant, max(4, self.max_step // WINDOW_SHARE_OF_BOUND // 4 * 4))
        every = config.check_every or max(1, window // 4)
        while window % every:  # the largest divisor of the window not above W / 4
            every -= 1
        self.window, self.check_every = window, every
        self.min_step = config.min_step or window
        self._loss_intervals = collections.deque(self._loss_intervals, maxlen=window // every)

    # ------------------------------------------------------------------ the loss
    def record_loss(self, loss: Union[torch.Tensor, float]) -> None:
        """Add one training loss (a number or a one-element tensor; read on the host only at the next check)."""
        if isinstance(loss, torch.Tensor):
            if loss.numel() != 1:
                raise ValueError(f"observe_loss takes a scalar loss, got a tensor of shape {tuple(loss.shape)}")
            value = loss.detach().reshape(()).double()
            if self._loss_sum is not None and self._loss_sum.device != value.device:
                # the sum follows the losses' device (moved once; to a GPU without waiting for it)
                self._loss_sum = self._loss_sum.to(value.device, non_blocking=value.device.type != "cpu")
        elif is_real(loss):
            value = float(loss)
            if self._loss_sum is None:
                value = torch.tensor(value, dtype=torch.float64)
        else:
            raise ValueError(f"observe_loss takes a number or a scalar tensor, got {type(loss).__name__}")
        if self._loss_sum is None:
            self._loss_sum = value if self._loss_carry is None else value + self._loss_carry
            self._loss_carry = None
        else:
            self._loss_sum = self._loss_sum + value
        self._loss_count += 1

    def _pending_loss(self) -> Optional[float]:
        """The sum of the losses recorded since the last check (a host sync when on a device), or ``None``."""
        if self._loss_sum is not None:
            return float(self._loss_sum)
        return self._loss_carry

    def _close_loss_interval(self, total: Optional[float]) -> None:
        """End the interval of losses since the last check; ``total``: their sum, read with the check's figures."""
        total = 0.0 if total is None else total
        if self._loss_count:
            self._loss_intervals.append((total, self._loss_count))
            if self._initial_loss is None:
                self._initial_loss = total / self._loss_count
        self._loss_sum, self._loss_carry, self._loss_count = None, None, 0

    def _loss_figures(self) -> list[float]:
        """``[loss ratio, no loss seen]``: the mean loss over the last window over the initial mean (0 where the guard
        is off or cannot apply), and 1.0 if the guard is on and no loss was ever observed."""
        if self.config.loss_drop is None:
            return [0.0, 0.0]
        if self._initial_loss is None:
            return [math.inf, 1.0]
        if not self._initial_loss > 0:  # a ratio to a loss <= 0 means nothing
            return [0.0, 0.0]
        count = sum(n for _, n in self._loss_intervals)
        recent = sum(s for s, _ in self._loss_intervals) / count if count else self._initial_loss
        ratio = recent / self._initial_loss
        return [ratio if math.isfinite(ratio) else math.inf, 0.0]

    # ------------------------------------------------------------------ the decision
    def bound_by_run(self, run_steps: int) -> int:
        """The latest step of the warmup for a run of ``run_steps`` optimizer steps: ``AutoFreeze(max_step)`` when set,
        else :data:`DEFAULT_BOUND_SHARE` (half) of the run, which then becomes this detector's bound. The Lightning
        strategy calls it at the start of every fit; outside it ``max_step`` must be set."""
        if self.max_step is None:
            self.max_step = max(1, int(DEFAULT_BOUND_SHARE * run_steps))
        if self.window is None:
            self._schedule()
        return self.max_step

    def observe(self, t: int, read: Callable[[], VarianceReading]) -> Optional[int]:
        """Called after warmup step ``t`` on every rank; returns ``t`` when the warmup ends with it, else ``None``.
        ``read`` is called at check steps only. A collective at check steps from the first full window on (every
        rank calls it at the same steps)."""
        if self.max_step is None:
            raise ValueError(
                f"{self.owner}(freeze_step='auto') needs AutoFreeze(max_step=...) outside the Lightning "
                f"strategy (which defaults it to {DEFAULT_BOUND_SHARE:.0%} of the run): the latest step at which to "
                "end the warmup"
            )
        if self.window is None:
            self._schedule()
        started = time.perf_counter()
        decided = None
        if t % self.check_every == 0:
            reading = read()
            snapshot, loss_total = self._snapshot(reading)
            self._close_loss_interval(loss_total)
            self._snapshots[t] = snapshot
            for old_step in [s for s in self._snapshots if s < t - self.window]:
                del self._snapshots[old_step]
            old = self._snapshots.get(t - self.window)
            if old is not None and any(a.shape != b.shape for a, b in zip(old, snapshot)):
                # the measured tensors changed (a resume with other trainable parameters or compress=False groups):
                # the saved snapshots describe other coordinates, so measure afresh from this one
                self._snapshots, old = {t: snapshot}, None
                log.info("freeze_step='auto': the measured parameters changed; measuring afresh from step %d", t)
            if old is not None:
                numels = [numel for numel, *_ in reading.variances]
                local = excesses(old, snapshot, self._decays(reading), self._sample_counts(len(snapshot[1])), numels)
                local += self._loss_figures()
                figures = agree_max(local, reading.process_group, reading.device)
                sample, tensor, coeff_mean, coeff_max, loss_ratio, no_loss = figures
                if no_loss:
                    raise ValueError(
                        f"{self.owner}(freeze_step='auto') waits for the training loss to fall "
                        f"(AutoFreeze(loss_drop={self.config.loss_drop})) but was given no loss by step {t}: call "
                        "optimizer.observe_loss(loss) every step or pass a closure to step() (the Lightning strategy "
                        "does this), or set AutoFreeze(loss_drop=None) to decide on the variance alone"
                    )
                config = self.config
                drop_ok = config.loss_drop is None or loss_ratio <= 1 - config.loss_drop
                # capped steps: only the mean trust-ratio change (and the loss) holds the freeze; see VarianceReading
                passed = coeff_mean < config.threshold and (reading.steps_capped or (
                    sample < config.threshold and tensor < config.tensor_threshold
                    and coeff_max < config.tensor_threshold
                ))
                self.streak = self.streak + 1 if passed and drop_ok else 0
                self.last = dict(step=t, sample_excess=sample, tensor_excess=tensor, coeff_change_mean=coeff_mean,
                                 coeff_change=coeff_max, largest_required=not reading.steps_capped,
                                 loss_ratio=loss_ratio if config.loss_drop is not None else None,
                                 streak=self.streak)
                if self.streak >= config.patience and t >= self.min_step:
                    decided, self.reason = t, "settled"
        if decided is None and t >= self.max_step:
            decided, self.reason = t, "max_step"
        if decided is not None:  # freed: nothing more to measure
            self._snapshots, self._sample, self._sample_on = {}, None, {}
            self._loss_sum, self._loss_carry = None, None
            self._loss_intervals = collections.deque(maxlen=self._loss_intervals.maxlen)
        self.seconds += time.perf_counter() - started
        return decided

    def describe(self) -> str:
        """The figures behind the decision, for logs and the stage announcement."""
        last = self.last
        if last is None:
            figures = "no comparison yet"
        else:
            figures = (
                f"at step {last['step']}: {self.window}-step gradient excess {last['sample_excess']:.3g} (sample), "
                f"{last['tensor_excess']:.3g} (largest tensor)"
                + ("" if last.get("largest_required", True) else " (not required: steps capped)")
                + (f"; trust-ratio change {last.get('coeff_change_mean', last['coeff_change']):.3g} (mean), "
                   f"{last['coeff_change']:.3g} (largest tensor"
                   + (")" if last.get("largest_required", True) else ", not required)")
                   if last["coeff_change"] > 0 else "")
                + (f"; loss at {last['loss_ratio']:.3g} of its start" if last.get("loss_ratio") is not None else "")
                + f"; {last['streak']} passing check{'' if last['streak'] == 1 else 's'} in a row"
            )
        if self.reason == "max_step":
            return f"max_step {self.max_step} reached ({figures})"
        return figures

    def rule(self) -> str:
        """The rule's settings (``AutoFreeze``'s names), for the warmup announcement."""
        config = self.config
        loss = "None" if config.loss_drop is None else f"{config.loss_drop:g}"
        settings = (
            f"threshold {config.threshold:g}, tensor_threshold {config.tensor_threshold:g}, loss_drop {loss}, "
            f"patience {config.patience}"
        )
        if self.window is None:
            return f"window a sixth of max_step, set when the run's length is known; {settings}"
        return (
            f"window {self.window}, {settings}, check_every {self.check_every}, steps {self.min_step}-{self.max_step}"
        )

    # ------------------------------------------------------------------ measurements
    def _decays(self, reading: VarianceReading) -> list[tuple[float, float]]:
        """``(beta2^W, bias correction)`` per measured tensor, as of now."""
        return [(b2**self.window, c) for _, _, c, b2 in reading.variances]

    def _sample_counts(self, tensors: int) -> torch.Tensor:
        counts = torch.zeros(tensors, dtype=torch.long)
        for i, idx in self._sample or []:
            counts[i] = len(idx)
        return counts

    def _snapshot(
        self, reading: VarianceReading
    ) -> tuple[tuple[torch.Tensor, torch.Tensor, torch.Tensor], Optional[float]]:
        """``(sample of the raw v, sum of the raw v per tensor, the optimizer's extra settling figures)``, in float64 on
        the CPU (the sample laid out tensor by tensor, see :func:`draw_sample`), and the sum of the losses recorded
        since the last check. Gathered on the device and read with one copy per device (one host synchronisation per
        check on a single GPU, not two per tensor)."""
        params = reading.variances
        if self._sample is None:
            self._sample = draw_sample([numel for numel, *_ in params], self.config.sample_size, self.config.seed)
            self._sample_on = {}
        parts: list[torch.Tensor] = []
        for _, v, _, _ in params:  # the sums
            parts.append(torch.zeros(1, dtype=torch.float64) if v is None else v.double().sum().reshape(1))
        for i, idx in self._sample:
            v = params[i][1]
            if v is None:
                parts.append(torch.zeros(len(idx), dtype=torch.float64))
                continue
            on_device = self._sample_on.get((i, v.device))
            if on_device is None:
                on_device = self._sample_on[(i, v.device)] = idx.to(v.device)
            parts.append(v.reshape(-1).index_select(0, on_device).double())
        extra = reading.extra
        parts.append(torch.zeros(0, dtype=torch.float64) if extra is None else extra.reshape(-1).double())
        if self._loss_sum is not None:
            parts.append(self._loss_sum.reshape(1))
        host = read_on_host(parts)
        n, k = len(params), len(self._sample)
        sums, sample, extra_host = host[:n], host[n : n + k], host[n + k]
        loss_total = float(host[n + k + 1][0]) if self._loss_sum is not None else self._loss_carry
        snapshot = (
            torch.cat(sample) if sample else torch.zeros(0, dtype=torch.float64),
            torch.cat(sums) if sums else torch.zeros(0, dtype=torch.float64),
            extra_host,
        )
        return snapshot, loss_total

    # ------------------------------------------------------------------ checkpoints
    def state_dict(self) -> dict[str, Any]:
        pending = self._pending_loss()
        return dict(
            streak=self.streak,
            last=self.last,
            snapshots={k: list(v) for k, v in self._snapshots.items()},
            losses=dict(sum=pending, count=self._loss_count, intervals=list(self._loss_intervals),
                        initial=self._initial_loss),
        )

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Restore :meth:`state_dict` (an empty dict: start measuring afresh)."""
        self.streak = int(state.get("streak", 0))
        self.last = state.get("last")
        self._snapshots = {int(k): tuple(v) for k, v in (state.get("snapshots") or {}).items()}
        self._sample, self._sample_on = None, {}  # drawn again from the seed: the same coordinates
        losses = state.get("losses") or {}
        total = losses.get("sum")
        self._loss_sum = None
        self._loss_carry = None if total is None else float(total)
        self._loss_count = int(losses.get("count", 0))
        self._loss_intervals = collections.deque(
            [(float(s), int(n)) for s, n in losses.get("intervals", [])], maxlen=self._loss_intervals.maxlen
        )
        self._initial_loss = losses.get("initial")
        if self.last is not None and "sample_excess" not in self.last:  # measured by the older rule: compare afresh
            self.last, self.streak, self._snapshots = None, 0, {}
