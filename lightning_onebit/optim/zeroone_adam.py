"""0/1 Adam (arXiv 2202.06009) as a ``torch.optim.Optimizer`` over plain ``torch.distributed``: its arguments, its
variance and compressed steps, and what it reports. The schedules and their checkpoint state are
:mod:`~lightning_onebit.optim.zeroone_schedule`'s, the local steps and syncs
:mod:`~lightning_onebit.optim.zeroone_local_steps`'."""

from __future__ import annotations

import warnings
from typing import Any, Iterable, Literal, Optional, Sequence, Union

import torch
import torch.distributed as dist

from lightning_onebit._checks import check_integer
from lightning_onebit._docs import docs_pointer
from lightning_onebit.comm.topology import Topology
from lightning_onebit.kernels import Backend
from lightning_onebit.optim.base import DEFAULT_BUCKET_CAP_MB, CompressedOptimizer
from lightning_onebit.optim.functional import adam_update_, fold_gradients_, update_variances_
from lightning_onebit.optim.groups import compressed_trainable
from lightning_onebit.optim.functional import mask_like
from lightning_onebit.optim.phase import resumed_at
from lightning_onebit.optim.step_kind import StepKind
from lightning_onebit.optim.torch_options import check_torch_adamw_options
from lightning_onebit.optim.zeroone_local_steps import LocalStepsMixin
from lightning_onebit.optim.zeroone_schedule import (
    DEEPSPEED_LOCAL_STEP_SCALER,
    DEEPSPEED_VAR_FREEZE_STEP,
    DEEPSPEED_VAR_UPDATE_SCALER,
    ZeroOneScheduleMixin,
)


#: The page with 0/1 Adam's schedules (what its phase announcements summarise).
_DOCS = docs_pointer("guides/configuration")


class ZeroOneAdam(ZeroOneScheduleMixin, LocalStepsMixin, CompressedOptimizer):
    r"""0/1 Adam: Adam whose variance is updated on ever rarer steps, with 1-bit compressed communication in
    between, then local steps whose accumulated update is synchronised ever more rarely.

    The paper reports up to 87% less data volume and 54% fewer communication rounds than 1-bit Adam. Three phases,
    by optimizer step ``t`` (1 for the first step):

    **Variance steps** (``t <= var_freeze_step`` and ``t % var_interval == 0``): the gradient is averaged in full
    precision (the strategy's DDP hook is on for exactly these steps, decided per step from
    :attr:`needs_gradient_allreduce`), and ``m``, ``v`` and ``p`` are updated as AdamW. ``var_interval`` starts at 1
    and doubles after every ``var_update_scaler`` variance steps: with 16 (DeepSpeed's default), steps 1-16 are all
    variance steps (exactly AdamW), then every 2nd step up to step 48, every 4th up to 112, and so on; under the
    Lightning strategies it is a tenth of the run by default (62 in a 620-step run).

    **Compressed steps** (the other steps up to ``var_freeze_step``): each rank folds its *local* gradient into its
    momentum and the momenta are averaged by the error-compensated 1-bit compressed allreduce
    (:mod:`lightning_onebit.comm`), as in 1-bit Adam; ``v`` is left as it is::

        m = CompressedAllreduce(b1 m + (1 - b1) g_local) * mask
        p = p (1 - lr wd) - lr m_hat / (sqrt(v_hat) + eps)

    ``m`` is the same on every rank before the fold, so in exact arithmetic this is DeepSpeed's
    ``m = b1 m + (1 - b1) CompressedAllreduce(g_local)``, which ``exchange="gradient"`` runs; only the compression
    error differs, and it matters: see the README's 0/1 Adam section for the example's BERT task with either form.

    **Local steps** (``t > var_freeze_step``): the variance is frozen and nothing is sent. Each rank moves its own
    replica with its own gradient and keeps the sum of its momentum steps since the last sync::

        m = b1 m + (1 - b1) g_local;  p = p (1 - lr wd) - lr m_hat / (sqrt(v_hat) + eps)
        U = U + lr m_hat;  lr_sum = lr_sum + lr;  D = D (1 - lr wd)

    and on a *sync step* (``t % local_step_interval == 0``, after that step's local update) the ranks agree::

        W = CompressedAllreduce(U)                 (1 bit; the lr-weighted sum of momenta, no weight decay in it)
        m_hat = W / lr_sum                         (DeepSpeed: W / lr_sum with weight decay leaked into W)
        p = p_sync D - W / (sqrt(v_hat) + eps);  p_sync = p;  U = 0;  lr_sum = 0;  D = 1

    ``p_sync``, the parameters at the last sync, is kept (one copy of the parameters), so that every replica computes
    the new point from rank-identical values only: replicas are bitwise identical after every sync. (DeepSpeed rolled
    each replica back by subtracting its own update, which is exact only up to rounding.) ``local_step_interval``
    starts at 1 and doubles after every ``local_step_scaler`` local steps, up to ``local_step_clipper``. If a param
    group's learning rate was 0 over a whole interval (``lr_sum = 0``, where DeepSpeed divided by zero), its momenta
    themselves are averaged instead and its parameters stay at ``p_sync``. The error feedback restarts from zero when
    the local steps begin (it held momentum or gradient errors, it now holds update errors).

    Between syncs the replicas differ (that is the point of local steps): :attr:`replicas_in_sync` is false, and
    :meth:`synchronize` (a collective) syncs at once. The Lightning strategies sync before every validation (so the
    metrics are those of the one model the ranks share), before every checkpoint they save (so a checkpoint holds the
    rank-identical model, and resuming from it continues exactly as the run that saved it) and at the end of ``fit``;
    without Lightning call :meth:`synchronize` on every rank before evaluating or saving.

    **Zero-variance coordinates.** A coordinate whose variance is still exactly zero (no variance step has seen a
    nonzero averaged gradient for it: embedding rows not looked up yet, position embeddings past the sequence length)
    has its momentum zeroed after every compressed or local update, so it stays at rest (weight decay aside) instead
    of exploding to ``lr m / eps`` from 1-bit noise; it starts training at the first variance step that gives it a
    variance. :class:`~lightning_onebit.MomentumMask` with ``auto=True`` is therefore refused with this optimizer
    (its masks are fixed after the first ``var_update_scaler`` steps and would freeze such rows for good); explicit
    masks (``exp_avg_mask``) apply to the exchanged gradients, updates and momenta.

    Bias correction (``bias_correction=True``) divides ``m`` by ``1 - b1^t`` and ``v`` by ``1 - b2^n``, ``n`` the
    number of variance steps so far. With ``bias_correction=False`` neither is corrected, which is what DeepSpeed did
    whatever the flag said. Step numbers: DeepSpeed's first ``step()`` only allocated state, so its step ``s`` is this
    optimizer's step ``s - 1``, and its schedules counted its own steps.

    Memory: besides Adam's ``m`` and ``v``, the error feedback (about ``N (1 + 1/P)`` elements) and, in the
    local-step phase, ``U`` and ``p_sync`` (``exchange="gradient"`` also keeps a gradient-sized exchange buffer
    before it); after the warmup, a bool ``v == 0`` per parameter (1 byte per element) and, where the update runs
    the torch kernels (CUDA, or ``kernel_backend="torch"``), the frozen variance's denominator ``sqrt(v_hat) + eps``
    (one tensor per parameter, recomputed after each variance step).

    Host synchronisations: none in any step after the warmup (the step kinds and schedules are decided from Python
    numbers; the zero-variance masks and denominators stay on the device).

    **Param groups with** ``compress=False`` (the param-group option of :class:`~lightning_onebit.OnebitAdam`) take an AdamW
    step at *every* step (momentum and variance updated, bias corrections of the true step ``t``), on gradients
    averaged in full precision: by DDP's allreduce on variance steps, by one ``all_reduce`` in :meth:`step` on every
    other step, local and sync steps included. They are left out of the buckets, the local-step sums and the syncs,
    and their replicas stay identical after every step. The cost: such a group communicates every step, like DDP
    (``2 (P-1)/P * 4`` bytes per element in fp32), so a local step is no longer silent; use it for small groups or
    embeddings.

    Args:
        params, lr, betas, eps: as for :class:`~lightning_onebit.OnebitAdam`.
        weight_decay: as for :class:`~lightning_onebit.OnebitAdam`: default ``0``, where ``torch.optim.AdamW``'s is
            ``0.01`` (a port from AdamW passes it).
        bias_correction, bucket_cap_mb: as for :class:`~lightning_onebit.OnebitAdam`.
        amsgrad, maximize, differentiable, capturable, foreach, fused: ``torch.optim.AdamW``'s, as for
            :class:`~lightning_onebit.OnebitAdam` (only ``False`` for the first four; ``foreach`` and ``fused`` have
            no effect and warn unless ``None``).
        process_group, kernel_backend, topology: as for :class:`~lightning_onebit.OnebitAdam`.
        var_freeze_step: the last step that may update the variance; local steps start after it. Default ``None``:
            half the run under the Lightning strategies, which know its length (:meth:`fit_schedule_to_run`; at
            least ``var_update_scaler``), else ``100000`` (DeepSpeed's default, which keeps runs shorter than that
            from ever taking a local step). The paper freezes at the end of the learning-rate warmup (12500 of 125000
            steps for BERT-Large).
        var_update_scaler: ``kappa``, the number of variance steps at each ``var_interval`` before it doubles. Also
            the number of initial steps that are all variance steps (AdamW, gradients averaged in full precision).
            Default ``None``: a tenth of the run under the Lightning strategies (:meth:`fit_schedule_to_run`), else
            ``16`` (DeepSpeed's default, made for pretraining behind a long learning-rate warmup; on the example
            from scratch, 16 compressed from step 17, in the middle of the loss's fall, and ended 4.8 points under
            AdamW; a tenth of the run, with ``local_step_clipper`` 4, within 0.4 point of it on two seeds,
            docs/benchmarks.md).
        local_step_scaler: local steps at each ``local_step_interval`` before it doubles. Default ``None``: under the
            Lightning strategies, such that the interval reaches ``local_step_clipper`` a quarter of the way into the
            local steps (:meth:`fit_schedule_to_run`), else ``32678`` (DeepSpeed's default, which keeps syncing every
            step in practice; its tutorial uses ``1000``).
        local_step_clipper: ``H``, the largest ``local_step_interval``, in steps. Default ``4`` (DeepSpeed's is
            16: on the example from scratch, validated on the synced model, 16 ended 0.8 and 1.2 points under AdamW
            on two seeds, 4 ended +0.2 and -0.4 points, with the same bytes: the syncs are 1-bit and few).
        exchange: what the compressed steps before ``var_freeze_step`` average in 1 bit: ``"momentum"`` (default,
            the momentum after folding in the local gradient, as 1-bit Adam) or ``"gradient"`` (the local gradient,
            DeepSpeed's form).
        compress: the former name of ``exchange`` (deprecated: it is also the name of the param-group option that
            keeps a group out of compression); given, it sets ``exchange`` with a ``FutureWarning``.

    The four schedule arguments are integers ``>= 1`` (``var_freeze_step`` and ``local_step_scaler`` may be ``None``),
    checked in the constructor.
    """

    overlap_unsupported_reason = (
        "ZeroOneAdam decides in optimizer.step what each step exchanges, so its exchange cannot start during backward"
    )
    masks_zero_variance = True

    def __init__(
        self,
        params: Union[Iterable[torch.Tensor], Iterable[dict[str, Any]]],
        lr: float = 1e-3,
        betas: tuple[float, float] = (0.9, 0.999),
        eps: float = 1e-8,
        weight_decay: float = 0.0,
        *,
        var_freeze_step: Optional[int] = None,
        var_update_scaler: Optional[int] = None,
        local_step_scaler: Optional[int] = None,
        local_step_clipper: int = 4,
        exchange: Literal["momentum", "gradient"] = "momentum",
        compress: Optional[Literal["momentum", "gradient"]] = None,
        bias_correction: bool = True,
        amsgrad: bool = False,
        maximize: bool = False,
        foreach: Optional[bool] = None,
        fused: Optional[bool] = None,
        capturable: bool = False,
        differentiable: bool = False,
        bucket_cap_mb: float = DEFAULT_BUCKET_CAP_MB,
        process_group: Optional[dist.ProcessGroup] = None,
        kernel_backend: Backend = "auto",
        topology: Optional[Topology] = None,
    ) -> None:
        # the schedule arguments left to the run's length (fit_schedule_to_run); DeepSpeed's values until then
        self._schedule_from_run = {name for name, value in (("var_freeze_step", var_freeze_step),
                                                            ("var_update_scaler", var_update_scaler),
                                                            ("local_step_scaler", local_step_scaler)) if value is None}
        var_freeze_step = DEEPSPEED_VAR_FREEZE_STEP if var_freeze_step is None else var_freeze_step
        var_update_scaler = DEEPSPEED_VAR_UPDATE_SCALER if var_update_scaler is None else var_update_scaler
        local_step_scaler = DEEPSPEED_LOCAL_STEP_SCALER if local_step_scaler is None else local_step_scaler
        var_freeze_step, var_update_scaler, local_step_scaler, local_step_clipper = (
            check_integer(value, name) for name, value in (
                ("var_freeze_step", var_freeze_step), ("var_update_scaler", var_update_scaler),
                ("local_step_scaler", local_step_scaler), ("local_step_clipper", local_step_clipper),
            )
        )
        if compress is not None:
            if exchange != "momentum" and compress != exchange:
                raise ValueError(
                    f"ZeroOneAdam got exchange={exchange!r} and compress={compress!r}: compress is the former name of "
                    "exchange; pass exchange only"
                )
            warnings.warn(
                f"ZeroOneAdam(compress={compress!r}) is deprecated: pass exchange={compress!r} (compress is also the "
                "name of the param-group option that keeps a group out of compression)",
                FutureWarning,
                stacklevel=2,
            )
            exchange = compress
        if exchange not in ("momentum", "gradient"):
            raise ValueError(f"exchange must be 'momentum' or 'gradient', got {exchange!r}")
        check_torch_adamw_options(type(self).__name__, amsgrad=amsgrad, maximize=maximize,
                                  differentiable=differentiable, capturable=capturable, foreach=foreach, fused=fused)
        defaults = dict(lr=lr, betas=betas, eps=eps, weight_decay=weight_decay, bias_correction=bias_correction)
        super().__init__(
            params,
            defaults,
            # the steps before any compression: the first var_update_scaler steps are all variance steps
            freeze_step=min(var_update_scaler, var_freeze_step),
            bucket_cap_mb=bucket_cap_mb,
            process_group=process_group,
            kernel_backend=kernel_backend,
            topology=topology,
            dead_coordinates="ignore",  # kept at rest by _keep_at_rest_ while the variance still changes
        )
        self.var_freeze_step = var_freeze_step
        self.var_update_scaler = var_update_scaler
        self.local_step_scaler = local_step_scaler
        self.local_step_clipper = local_step_clipper
        self.exchange_kind = exchange  # what the compressed steps before var_freeze_step average in 1 bit
        self._replay_schedules(0)
        self.forced_syncs = 0  # syncs made by synchronize() between scheduled ones (e.g. before a checkpoint)
        # id(param) -> bool tensor of its coordinates whose variance is exactly zero (1 byte per element); valid until
        # the variance next changes
        self._zero_variance: dict[int, torch.Tensor] = {}

    # ------------------------------------------------------------------ status
    @property
    def advisor_note(self) -> str:
        return " (ZeroOneAdam: for its 1-bit steps only; its variance steps cost about a warmup step)"

    def describe_phase(self) -> tuple[StepKind, str]:
        t = self._step + 1
        if t <= self.freeze_step:
            return StepKind.WARMUP, (
                f"warmup until optimizer step {self.freeze_step}: every step a variance step (gradients averaged in full precision, "
                f"full-precision Adam update); {_DOCS}"
            )
        if t <= self.var_freeze_step:
            averaged = "momenta" if self.exchange_kind == "momentum" else "gradients"
            return StepKind.VARIANCE, (
                f"from optimizer step {self.freeze_step + 1}{resumed_at(self._step, self.freeze_step)}: a variance "
                f"step (DDP allreduce) every {self.var_interval} steps, the "
                f"interval doubling every {self.var_update_scaler} of them, until step {self.var_freeze_step}; "
                f"{averaged} averaged in 1 bit in between; {_DOCS}"
            )
        uncompressed = " (compress=False groups: full precision every step)" if self._uncompressed_groups() else ""
        return StepKind.LOCAL, (
            f"from optimizer step {self.var_freeze_step + 1}{resumed_at(self._step, self.var_freeze_step)}: variance "
            f"frozen; local steps without communication{uncompressed}, the "
            f"accumulated update averaged in 1 bit every {self.local_step_interval} steps (doubling every "
            f"{self.local_step_scaler} steps up to {self.local_step_clipper}); {_DOCS}"
        )

    # ------------------------------------------------------------------ steps
    def _warmup_step(self) -> StepKind:
        t = self._step  # every warmup step is a variance step: t variance updates so far, as AdamW's step t
        self._adamw_step_(t)
        self._advance_schedules(t)
        return StepKind.VARIANCE

    def _full_precision_update_(self, groups: Sequence[dict[str, Any]]) -> None:
        # every step of a compress=False group is an AdamW step: its variance has received t updates
        self._adamw_step_(self._step, groups, compression_stage=True)

    def _compressed_step(self) -> StepKind:
        t = self._step
        # compress=False groups: an AdamW step every step; variance steps' gradients are already averaged by DDP
        self._step_uncompressed_groups_(averaged=self.is_variance_step(t))
        if t > self.var_freeze_step:
            kind = self._local_step(t)
        elif t % self.var_interval == 0:
            kind = self._variance_step(t)
        else:
            kind = self._compressed_exchange_step(t)
        self._advance_schedules(t)
        return kind

    def _variance_step(self, t: int) -> StepKind:
        """Averaged gradients: ``m`` and ``v`` updated (parameters without a gradient are skipped, as in AdamW)."""
        self._ensure_buckets(carry=True)
        self._zero_variance.clear()
        n = self.variance_updates + 1
        for group in self.param_groups:
            params = [p for p in compressed_trainable(group) if p.grad is not None]
            if not params:
                continue
            states = [self._moment_state(p) for p in params]  # a parameter first seen now gets its variance here
            grads = [p.grad for p in params]
            exp_avgs, exp_avg_sqs = [s["exp_avg"] for s in states], [s["exp_avg_sq"] for s in states]
            b1, b2 = group["betas"]
            fold_gradients_(exp_avgs, grads, b1)
            update_variances_(exp_avg_sqs, grads, b2)
            self._keep_at_rest_(group, params, exp_avgs)
            adam_update_(group, params, exp_avgs, exp_avg_sqs, t, n, self.compression.backend)
        return StepKind.VARIANCE

    def _compressed_exchange_step(self, t: int) -> StepKind:
        """Local gradients reach the momentum through one 1-bit compressed exchange (of the momenta, or of the
        gradients with ``exchange="gradient"``); ``v`` unchanged."""
        if self.exchange_kind == "momentum":
            self._average_momenta_()  # m = CompressedAllreduce(b1 m + (1 - b1) g_local), masked
        else:
            self._average_gradients_into_momenta_()
        for group in self.param_groups:
            params = self._updated_params(group)
            if not params:
                continue
            exp_avgs = [self.state[p]["exp_avg"] for p in params]
            self._keep_at_rest_(group, params, exp_avgs)
            exp_avg_sqs = [self.state[p]["exp_avg_sq"] for p in params]
            adam_update_(group, params, exp_avgs, exp_avg_sqs, t, self.variance_updates, self.compression.backend)
        return StepKind.COMPRESSED

    def _average_gradients_into_momenta_(self) -> None:
        """DeepSpeed's form: ``m = b1 m + (1 - b1) CompressedAllreduce(g_local)``."""
        buckets = self._ensure_buckets(carry=True)
        averaged: dict[int, torch.Tensor] = {}
        pairs = []
        for bucket in buckets:
            flat = bucket.extra.get("gradient")
            if flat is None:
                flat = bucket.extra["gradient"] = torch.zeros_like(bucket.flat)
            offset = 0
            for p in bucket.params:
                view = flat[offset : offset + p.numel()].view_as(p)
                offset += p.numel()
                if p.grad is None:
                    view.zero_()  # this rank contributes a zero gradient
                else:
                    view.copy_(p.grad)
                averaged[id(p)] = view
            pairs.append((bucket, flat))
        self._compressed_average_("gradient", pairs)
        for group in self.param_groups:
            params = self._updated_params(group)
            if params:
                exp_avgs = [self.state[p]["exp_avg"] for p in params]
                torch._foreach_lerp_(exp_avgs, [averaged[id(p)] for p in params], 1 - group["betas"][0])

    def _keep_at_rest_(self, group: dict[str, Any], params: list[torch.Tensor], tensors: list[torch.Tensor]) -> None:
        """Multiply ``tensors`` (one per parameter: momenta, exchanged gradients or updates) by the parameters' masks
        and zero them where the variance is exactly zero."""
        masks = group["exp_avg_mask"]
        index = {id(q): i for i, q in enumerate(group["params"])}
        for p, x in zip(params, tensors):
            i = index[id(p)]
            if masks[i] is not None:
                x.mul_(mask_like(masks, i, x))
            x.masked_fill_(self._zero_variance_of(p), 0)

    def _zero_variance_of(self, p: torch.Tensor) -> torch.Tensor:
        """``v == 0`` for ``p`` (a bool tensor, kept until the variance next changes). Always a tensor, also where no
        coordinate is zero: asking whether any is (``bool(zero.any())``) would synchronise the host with the device
        once per parameter after every variance step; the ``masked_fill_`` it would save is one pass."""
        key = id(p)
        zero = self._zero_variance.get(key)
        if zero is None:
            zero = self._zero_variance[key] = self.state[p]["exp_avg_sq"] == 0
        return zero
