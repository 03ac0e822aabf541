"""0/1 Adam (arXiv 2202.06009) as a ``torch.optim.Optimizer`` over plain ``torch.distributed``: its variance,
compressed and local steps, and what it reports. Its schedule is a part of its own
(:class:`~lightning_onebit.optim.zeroone_schedule.ZeroOneSchedule`), and so are the local steps' sums and syncs
(:class:`~lightning_onebit.optim.local_steps.LocalSteps`)."""

from __future__ import annotations

import logging
import warnings
from typing import Any, Iterable, Literal, Optional, Sequence, Union

import torch
import torch.distributed as dist

from lightning_onebit._checks import check_integer
from lightning_onebit.comm.topology import Topology
from lightning_onebit.kernels import Backend
from lightning_onebit.optim.base import DEFAULT_BUCKET_CAP_MB, CompressedOptimizer
from lightning_onebit.optim.bucket_layout import MomentumBucket
from lightning_onebit.optim.buckets import compressed_trainable
from lightning_onebit.optim.error_feedback import feedback_key
from lightning_onebit.optim.functional import adam_update_, fold_gradients_, mask_, update_variances_
from lightning_onebit.optim.groups import check_exchange
from lightning_onebit.optim.local_steps import LocalSteps
from lightning_onebit.optim.onebit_adam import adamw_steps_
from lightning_onebit.optim.phases import StepKind, zeroone_phase_sentence
from lightning_onebit.optim.torch_options import check_torch_adamw_options
from lightning_onebit.optim.zeroone_schedule import (
    DEEPSPEED_LOCAL_STEP_SCALER,
    DEEPSPEED_VAR_FREEZE_STEP,
    DEEPSPEED_VAR_UPDATE_SCALER,
    SYNC_STATE,
    ZeroOneSchedule,
)

log = logging.getLogger(__name__)

class ZeroOneAdam(CompressedOptimizer):
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

    **Param groups with** ``compress=False`` (the param-group option of :class:`~lightning_onebit.OnebitAdam`) take an
    AdamW step at *every* step (momentum and variance updated, bias corrections of the true step ``t``), on gradients
    averaged in full precision: by DDP's allreduce on variance steps, by one ``all_reduce`` in :meth:`step` on every
    other step, local and sync steps included. They are left out of the buckets, the local-step sums and the syncs, and
    their replicas stay identical after every step. The cost: such a group communicates every step, like DDP (``2
    (P-1)/P * 4`` bytes per element in fp32), so a local step is no longer silent; use it for small groups or
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
    advisor_note = " (ZeroOneAdam: for its 1-bit steps only; its variance steps cost about a warmup step)"

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
        from_run = {name for name, value in (("var_freeze_step", var_freeze_step),
                                             ("var_update_scaler", var_update_scaler),
                                             ("local_step_scaler", local_step_scaler)) if value is None}
        arguments = (("var_freeze_step", var_freeze_step, DEEPSPEED_VAR_FREEZE_STEP),
                     ("var_update_scaler", var_update_scaler, DEEPSPEED_VAR_UPDATE_SCALER),
                     ("local_step_scaler", local_step_scaler, DEEPSPEED_LOCAL_STEP_SCALER),
                     ("local_step_clipper", local_step_clipper, None))
        schedule = ZeroOneSchedule(*(check_integer(default if value is None else value, name)
                                     for name, value, default in arguments), from_run=from_run)
        exchange = check_exchange(exchange, compress)
        check_torch_adamw_options(type(self).__name__, amsgrad=amsgrad, maximize=maximize,
                                  differentiable=differentiable, capturable=capturable, foreach=foreach, fused=fused)
        defaults = dict(lr=lr, betas=betas, eps=eps, weight_decay=weight_decay, bias_correction=bias_correction)
        super().__init__(params, defaults, freeze_step=schedule.warmup_steps, bucket_cap_mb=bucket_cap_mb,
                         process_group=process_group, kernel_backend=kernel_backend, topology=topology,
                         dead_coordinates="ignore")  # kept at rest by _keep_at_rest_ while the variance still changes
        #: The schedules (:class:`ZeroOneSchedule`) and the local steps' sums and syncs (a part each).
        self.schedule = schedule
        self.local_steps = LocalSteps(self.momentum_buckets)
        self.exchange_kind = exchange  # what the compressed steps before var_freeze_step average in 1 bit
        # id(param) -> bool tensor of its coordinates whose variance is exactly zero (1 byte per element); valid until
        # the variance next changes
        self._zero_variance: dict[int, torch.Tensor] = {}

    # ------------------------------------------------------------------ status (the schedule's and the local steps')
    var_freeze_step = property(lambda self: self.schedule.var_freeze_step, doc="The last step that may update v.")
    var_update_scaler = property(lambda self: self.schedule.var_update_scaler, doc="``kappa`` (see the class).")
    local_step_scaler = property(lambda self: self.schedule.local_step_scaler, doc="See the class docstring.")
    local_step_clipper = property(lambda self: self.schedule.local_step_clipper, doc="``H`` (see the class).")
    var_interval = property(lambda self: self.schedule.var_interval, doc="Steps between variance steps now.")
    local_step_interval = property(lambda self: self.schedule.local_step_interval, doc="Local steps between syncs.")
    variance_updates = property(lambda self: self.schedule.variance_updates, doc="Variance steps taken so far.")
    forced_syncs = property(lambda self: self.local_steps.forced_syncs, doc="Syncs by :meth:`synchronize`.")
    local_steps_since_sync = property(lambda self: self.local_steps.since_sync, doc="0: every replica the same.")

    def is_variance_step(self, t: int) -> bool:
        """Whether step ``t`` updates the variance (:meth:`ZeroOneSchedule.is_variance_step`)."""
        return self.schedule.is_variance_step(t)

    @property
    def next_step_kind(self) -> StepKind:
        """``VARIANCE`` (the warmup's steps and every ``var_interval``-th step up to ``var_freeze_step``: gradients
        averaged in full precision), ``COMPRESSED`` (the other steps until then), then ``LOCAL``, or ``SYNC`` every
        ``local_step_interval``-th step. Exact: the schedules depend only on the step."""
        return self.schedule.kind(self._step + 1)

    @property
    def replicas_in_sync(self) -> bool:
        """False after a local step, until the next sync."""
        return self.local_steps.since_sync == 0

    def fit_schedule_to_run(self, total_steps: Optional[int]) -> Optional[str]:
        """Scale the schedule arguments given as ``None`` to a run of ``total_steps`` optimizer steps (the Lightning
        strategies call this at the start of ``fit`` with the Trainer's estimate): ``var_update_scaler`` a tenth of
        the run (the steps that are all variance steps), ``var_freeze_step`` half the run (at least
        ``var_update_scaler``), ``local_step_scaler`` such that ``local_step_interval`` reaches
        ``local_step_clipper`` a quarter of the way into the remaining steps. Returns what was set, for the log
        (``None``: every argument was given). ``total_steps=None`` (a run of unknown length) raises ``ValueError``
        naming the arguments to give, unless every one was given; so does anything but ``None`` or an integer
        ``>= 1`` (a bool, a float, a string)."""
        scaled = self.schedule.fit_to_run(total_steps, self._step)
        if scaled is not None:
            self.freeze_step = self.schedule.warmup_steps
        return scaled

    def describe_phase(self) -> tuple[StepKind, str]:
        schedule = self.schedule
        return zeroone_phase_sentence(self._step, schedule.warmup_steps, schedule.var_freeze_step,
                                      schedule.var_interval, schedule.var_update_scaler, schedule.local_step_interval,
                                      schedule.local_step_scaler, schedule.local_step_clipper, self.exchange_kind,
                                      bool(self._uncompressed_groups()))

    # ------------------------------------------------------------------ steps
    def _warmup_step(self) -> StepKind:
        t = self._step  # every warmup step is a variance step: t variance updates so far, as AdamW's step t
        adamw_steps_(self.param_groups, self._moment_state, t)
        self.schedule.advance(t)
        return StepKind.VARIANCE

    def _full_precision_update_(self, groups: Sequence[dict[str, Any]]) -> None:
        # every step of a compress=False group is an AdamW step: its variance has received t updates
        adamw_steps_(groups, self._moment_state, self._step, compression_stage=True)

    def _compressed_step(self) -> StepKind:
        t = self._step
        # compress=False groups: an AdamW step every step; variance steps' gradients are already averaged by DDP
        self._step_uncompressed_groups_(averaged=self.schedule.is_variance_step(t))
        if t > self.schedule.var_freeze_step:
            kind = self._local_step(t)
        elif t % self.schedule.var_interval == 0:
            kind = self._variance_step(t)
        else:
            kind = self._compressed_exchange_step(t)
        self.schedule.advance(t)
        return kind

    def _variance_step(self, t: int) -> StepKind:
        """Averaged gradients: ``m`` and ``v`` updated (parameters without a gradient are skipped, as in AdamW)."""
        self._ensure_buckets(carry=True)
        self._zero_variance.clear()
        n = self.schedule.variance_updates + 1
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
        """Local gradients reach the momentum through one 1-bit compressed exchange, of the momenta (fold, exchange)
        or of the gradients with ``exchange="gradient"`` (exchange, fold); then mask and update, ``v`` unchanged."""
        if self.exchange_kind == "momentum":
            exchange = self._begin_exchange()
            for group in self.param_groups:  # fold: m = b1 m + (1 - b1) g, with this rank's gradient
                params = exchange.unfolded(group)
                fold_gradients_([self.state[p]["exp_avg"] for p in params], [p.grad for p in params],
                                group["betas"][0])
            exchange.finish_(self.state)  # exchange: m = the 1-bit compressed average of every rank's m
        else:
            self._average_gradients_into_momenta_()
        for group in self.param_groups:
            params = self._updated_params(group)
            if not params:
                continue
            exp_avgs = [self.state[p]["exp_avg"] for p in params]
            self._keep_at_rest_(group, params, exp_avgs)  # mask: exp_avg_mask, and zero-variance coordinates
            exp_avg_sqs = [self.state[p]["exp_avg_sq"] for p in params]
            adam_update_(group, params, exp_avgs, exp_avg_sqs, t, self.schedule.variance_updates,
                         self.compression.backend)
        return StepKind.COMPRESSED

    def _average_gradients_into_momenta_(self) -> None:
        """DeepSpeed's form: ``m = b1 m + (1 - b1) CompressedAllreduce(g_local)``."""
        averaged: dict[int, torch.Tensor] = {}
        pairs = []
        for bucket in self._ensure_buckets(carry=True):  # a missing gradient: this rank contributes a zero one
            flat, views = bucket.filled("gradient", [p.grad for p in bucket.params])
            averaged.update(zip(map(id, bucket.params), views))
            pairs.append((bucket, flat))
        self._compressed_average_("gradient", pairs)
        for group in self.param_groups:
            params = self._updated_params(group)
            if params:
                fold_gradients_([self.state[p]["exp_avg"] for p in params], [averaged[id(p)] for p in params],
                                group["betas"][0])

    def _local_step(self, t: int) -> StepKind:
        """A step on this rank's own gradient with no communication (fold, mask, accumulate, update); a sync after it
        when the schedule says so."""
        local = self.local_steps
        buckets = self._ensure_buckets(carry=True)
        if local.lr_sum is None:
            local.begin_(self._bucket_source(), buckets, self.schedule.var_freeze_step)
        local.update_buffers(self._bucket_source(), buckets)
        for index, group in enumerate(self.param_groups):
            params = local.updated(group)
            if not params:
                continue
            exp_avgs = [self.state[p]["exp_avg"] for p in params]
            fold_gradients_(exp_avgs, [p.grad for p in params], group["betas"][0])  # a missing gradient: zero
            self._keep_at_rest_(group, params, exp_avgs)
            local.accumulate_(index, group, params, exp_avgs, self.state, t)
            exp_avg_sqs = [self.state[p]["exp_avg_sq"] for p in params]
            adam_update_(group, params, exp_avgs, exp_avg_sqs, t, self.schedule.variance_updates,
                         self.compression.backend)
        local.since_sync += 1
        if t % self.schedule.local_step_interval == 0:
            self._sync(t)
            return StepKind.SYNC
        return StepKind.LOCAL

    @torch.no_grad()
    def synchronize(self) -> bool:
        """Sync now if local steps were taken since the last sync (every rank must call it; the next scheduled sync
        still comes when the schedule says). Returns whether it synced.

        This sync averages the accumulated updates in full precision (one ``all_reduce`` of their size), not in 1
        bit, and leaves the compression error feedback to the next scheduled sync. A 1-bit sync here, a step or two
        after a scheduled one, would fold the compression error of a whole interval (up to ``local_step_clipper``
        steps of updates) into an update of one step, and the momentum it sets (the average update over the summed
        learning rate) would grow by that ratio: on the example, syncs before every validation so made the local
        steps diverge."""
        if self.local_steps.since_sync == 0:
            return False
        self._sync(self._step, exact=True)
        self.local_steps.forced_syncs += 1
        return True

    def _sync(self, t: int, exact: bool = False) -> None:
        """Average the accumulated updates (1 bit; ``exact``: in full precision) and move every replica to the same
        new point (:meth:`LocalSteps.sync_`)."""
        self.local_steps.sync_(self._bucket_source(), self._ensure_buckets(carry=True), t,
                               self.schedule.variance_updates, lambda pairs: self._compressed_average_("update", pairs),
                               self._keep_at_rest_, exact)

    def _compressed_average_(self, stream: str, buffers: Sequence[tuple[MomentumBucket, torch.Tensor]]) -> None:
        """Replace each buffer (laid out like its bucket) by its error-compensated 1-bit average over the process
        group, identical on every rank; the error feedback is ``stream``'s. Buckets are pipelined."""
        if not self._backend_agreed:
            self.agree_kernel_backend()
        self.exchange.average_([(feedback_key(stream, bucket.key), flat, bucket.layout) for bucket, flat in buffers])

    def _keep_at_rest_(self, group: dict[str, Any], params: list[torch.Tensor], tensors: list[torch.Tensor]) -> None:
        """Multiply ``tensors`` (one per parameter: momenta, exchanged gradients or updates) by the parameters' masks
        and zero them where the variance is exactly zero (``v == 0``, a bool tensor per parameter kept until the
        variance next changes: always a tensor, also where no coordinate is zero, since asking whether any is would
        synchronise the host with the device once per parameter after every variance step)."""
        for p in params:
            if id(p) not in self._zero_variance:
                self._zero_variance[id(p)] = self.state[p]["exp_avg_sq"] == 0
        mask_(group, params, tensors, self._zero_variance)

    # ------------------------------------------------------------------ checkpoints
    def state_dict(self) -> dict[str, Any]:
        """As :meth:`CompressedOptimizer.state_dict`, plus the sums since the last sync. Between syncs (after a
        local step) it holds this rank's own replica state and warns: call :meth:`synchronize` on every rank first
        for a checkpoint that resumes exactly (the Lightning strategy does)."""
        if self.local_steps.since_sync:
            warnings.warn(
                f"ZeroOneAdam.state_dict() after {self.local_steps.since_sync} local step(s) since the last sync: "
                "this rank's replica differs from the others'; call synchronize() on every rank before saving for "
                "an exact resume",
                UserWarning,
                stacklevel=2,
            )
        state_dict = super().state_dict()
        # the schedules themselves follow from the step and their arguments (load_state_dict replays them)
        state_dict["onebit"][SYNC_STATE] = dict(self.local_steps.state_dict(),
                                                 schedule_arguments=self.schedule.arguments())
        return state_dict

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """As :meth:`CompressedOptimizer.load_state_dict`; the schedules are recomputed from the loaded step with
        this optimizer's schedule arguments (logged if the checkpoint was saved with others), the sums since the last
        sync are restored."""
        saved = (state_dict.get("onebit") or {}).get(SYNC_STATE)
        super().load_state_dict(state_dict)
        self.schedule.replay(self._step)
        self._zero_variance = {}
        self.local_steps.load_state_dict(saved or {}, len(self.param_groups))
        if saved is None:
            return  # e.g. an AdamW or OnebitAdam state dict: local steps (if any) start from the loaded point
        if saved.get("schedule_arguments") not in (None, self.schedule.arguments()):
            log.info("ZeroOneAdam: the checkpoint was saved with schedule arguments %s; continuing from step %d "
                     "with those of the code, %s", saved["schedule_arguments"], self._step, self.schedule.arguments())
