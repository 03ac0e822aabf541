"""0/1 Adam (arXiv 2202.06009) over plain ``torch.distributed``: its variance, compressed, local and sync steps, each
read top-down here, and the schedule they consult (:class:`ZeroOneSchedule`); the local steps' sums and the schedule's
arguments are parts of their own (``optim/local_steps.py``, ``optim/zeroone_schedule.py``)."""

from __future__ import annotations

import logging
from typing import Any, Hashable, Iterable, Literal, Optional, Sequence, Union

import torch
import torch.distributed as dist

from lightning_onebit.comm.full_precision import full_precision_allreduce_
from lightning_onebit.comm.layout import BucketLayout
from lightning_onebit.comm.topology import Topology
from lightning_onebit.kernels import Backend
from lightning_onebit.optim.base import DEFAULT_BUCKET_CAP_MB, CompressedOptimizer
from lightning_onebit.optim.bucket_layout import ExchangeBuffers
from lightning_onebit.optim.buckets import compressed_trainable
from lightning_onebit.optim.checkpoint import LocalStepsEntry
from lightning_onebit.optim.error_feedback import feedback_key
from lightning_onebit.optim.functional import accumulate_update_, adam_update_, fold_gradients_, mask_, sync_update_
from lightning_onebit.optim.functional import update_variances_
from lightning_onebit.optim.groups import check_exchange
from lightning_onebit.optim.local_steps import SYNCED, UPDATE, LocalSteps
from lightning_onebit.optim.onebit_adam import adamw_steps_
from lightning_onebit.optim.phases import StepKind, zeroone_phase_sentence
from lightning_onebit.optim.torch_options import check_torch_adamw_options
from lightning_onebit.optim.zeroone_schedule import SCHEDULE_ARGUMENTS, fit_schedule_, schedule_arguments

log = logging.getLogger(__name__)


class ZeroOneSchedule:
    """0/1 Adam's schedule (:class:`ZeroOneAdam` says what its arguments and counters mean): which step updates the
    variance, which is a local step and which syncs. It follows from the step and the four arguments alone
    (:meth:`replay`: a resumed run replays it). ``from_run``: the arguments given as ``None``, which
    :meth:`ZeroOneAdam.fit_schedule_to_run` scales to the run's length."""

    def __init__(self, var_freeze_step: int, var_update_scaler: int, local_step_scaler: int, local_step_clipper: int,
                 from_run: set[str]) -> None:
        self.var_freeze_step, self.var_update_scaler = var_freeze_step, var_update_scaler
        self.local_step_scaler, self.local_step_clipper = local_step_scaler, local_step_clipper
        self.from_run = from_run
        self.replay(0)

    warmup_steps = property(lambda self: min(self.var_update_scaler, self.var_freeze_step), doc=(
        "The optimizer's ``freeze_step``: its first ``var_update_scaler`` steps are all variance steps."))

    def arguments(self) -> dict[str, int]:
        """The four schedule arguments (what a checkpoint records)."""
        return {name: getattr(self, name) for name in SCHEDULE_ARGUMENTS}

    def replay(self, steps: int) -> None:
        """Set the counters to their state after ``steps`` steps."""
        self.var_interval, self.var_counter, self.variance_updates = 1, 0, 0
        self.local_step_interval, self.local_step_counter = 1, 0
        for t in range(1, steps + 1):
            self.advance(t)

    def is_variance_step(self, t: int) -> bool:
        """Whether step ``t`` (the next one: exact) updates the variance with averaged gradients."""
        return t <= self.var_freeze_step and t % self.var_interval == 0

    def kind(self, t: int) -> StepKind:
        """What step ``t`` (the next one) does: ``VARIANCE``, ``COMPRESSED``, then ``LOCAL`` or ``SYNC``."""
        if t > self.var_freeze_step:
            return StepKind.SYNC if t % self.local_step_interval == 0 else StepKind.LOCAL
        return StepKind.VARIANCE if self.is_variance_step(t) else StepKind.COMPRESSED

    def advance(self, t: int) -> None:
        """The counters after step ``t``."""
        if t <= self.var_freeze_step:
            if t % self.var_interval == 0:
                self.variance_updates += 1
                self.var_counter += 1
                if self.var_counter == self.var_update_scaler:
                    self.var_counter = 0
                    self.var_interval *= 2
        else:
            self.local_step_counter += 1
            if self.local_step_counter == self.local_step_scaler:
                self.local_step_counter = 0
                self.local_step_interval = min(self.local_step_clipper, 2 * self.local_step_interval)


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
    the new point from rank-identical values only: replicas are bitwise identical after every sync.
    ``local_step_interval`` starts at 1 and doubles after every ``local_step_scaler`` local steps, up to
    ``local_step_clipper``. A param group whose learning rate was 0 over a whole interval (``lr_sum = 0``) averages
    its momenta instead and stays at ``p_sync``. The error feedback restarts from zero when the local steps begin.

    Between syncs the replicas differ: :attr:`replicas_in_sync` is false, :meth:`state_dict` holds this rank's replica
    and warns, and :meth:`synchronize` (a collective) syncs at once. The Lightning strategies sync before every
    validation, before every checkpoint they save and at the end of ``fit``; without Lightning call
    :meth:`synchronize` on every rank before evaluating or saving (docs/guides/configuration.md says why).

    **Zero-variance coordinates** (no variance step has seen a nonzero averaged gradient for them: embedding rows not
    looked up yet) have their momentum zeroed after every compressed or local update, so they stay at rest instead of
    exploding to ``lr m / eps`` from 1-bit noise, until a variance step gives them a variance; hence
    :class:`~lightning_onebit.MomentumMask` with ``auto=True`` is refused. Explicit masks (``exp_avg_mask``) apply to
    the exchanged gradients, updates and momenta.

    Bias correction (``bias_correction=True``) divides ``m`` by ``1 - b1^t`` and ``v`` by ``1 - b2^n``, ``n`` the
    number of variance steps so far (``False``: neither, which is what DeepSpeed did whatever the flag said).
    DeepSpeed's first ``step()`` only allocated state: its step ``s`` is this optimizer's step ``s - 1``.

    Memory: besides Adam's ``m`` and ``v``, the error feedback (about ``N (1 + 1/P)`` elements), ``U`` and ``p_sync``
    in the local-step phase, and a bool ``v == 0`` per parameter (1 byte per element); no host synchronisation in any
    step after the warmup (docs/guides/configuration.md has the details, and ``compress=False`` groups: an AdamW step
    on averaged gradients every step, local steps included, at DDP's cost).

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
            ``16`` (DeepSpeed's default, made for pretraining behind a long learning-rate warmup: from scratch, the
            example ended 4.8 points under AdamW with it, within 0.4 with a tenth of the run, docs/benchmarks.md).
        local_step_scaler: local steps at each ``local_step_interval`` before it doubles. Default ``None``: under the
            Lightning strategies, such that the interval reaches ``local_step_clipper`` a quarter of the way into the
            local steps (:meth:`fit_schedule_to_run`), else ``32678`` (DeepSpeed's default, which keeps syncing every
            step in practice; its tutorial uses ``1000``).
        local_step_clipper: ``H``, the largest ``local_step_interval``, in steps. Default ``4`` (DeepSpeed's 16
            ended 0.8 and 1.2 points under AdamW on the example, 4 within 0.4, with the same bytes).
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
        # those left to the run's length (fit_schedule_to_run) are DeepSpeed's until then
        arguments, from_run = schedule_arguments(var_freeze_step, var_update_scaler, local_step_scaler,
                                                 local_step_clipper)
        schedule = ZeroOneSchedule(**arguments, from_run=from_run)
        exchange = check_exchange(exchange, compress)
        check_torch_adamw_options(type(self).__name__, amsgrad=amsgrad, maximize=maximize,
                                  differentiable=differentiable, capturable=capturable, foreach=foreach, fused=fused)
        defaults = dict(lr=lr, betas=betas, eps=eps, weight_decay=weight_decay, bias_correction=bias_correction)
        super().__init__(params, defaults, freeze_step=schedule.warmup_steps, bucket_cap_mb=bucket_cap_mb,
                         process_group=process_group, kernel_backend=kernel_backend, topology=topology,
                         dead_coordinates="ignore")  # kept at rest by _keep_at_rest_ while the variance still changes
        #: The schedule (:class:`ZeroOneSchedule`) and the local steps' sums (:class:`LocalSteps`): a part each.
        self.schedule = schedule
        self.local_steps = LocalSteps()
        self.exchange_kind = exchange  # what the compressed steps before var_freeze_step average in 1 bit
        self.gradient_buffers = ExchangeBuffers()  # exchange="gradient": the gradients', laid out like the buckets
        # id(param) -> bool tensor of its coordinates whose variance is exactly zero (1 byte per element); valid until
        # the variance next changes
        self._zero_variance: dict[int, torch.Tensor] = {}
        # the checkpoint holds the local steps' sums and the schedule's arguments too (state_dict warns between syncs)
        self.checkpoint.extension = LocalStepsEntry(type(self).__name__, self.local_steps, schedule,
                                                    self._zero_variance.clear)

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
        """Scale the schedule arguments given as ``None`` to a run of ``total_steps`` optimizer steps, as the Args say
        (the Lightning strategies call this at the start of ``fit`` with the Trainer's estimate;
        :func:`~lightning_onebit.optim.zeroone_schedule.fit_schedule_`). Returns what was set, for the log (``None``:
        every argument was given). ``ValueError`` for ``total_steps=None`` (a run of unknown length), naming the
        arguments to give, unless every one was given, and for anything but ``None`` or an integer ``>= 1``."""
        fitted = fit_schedule_(self.schedule, total_steps, self._step)
        self.freeze_step = self.schedule.warmup_steps
        return fitted

    def describe_phase(self) -> tuple[StepKind, str]:
        return zeroone_phase_sentence(self._step, self.schedule, self.exchange_kind, bool(self._uncompressed_groups()))

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
            fold_gradients_(exp_avgs, grads, group["betas"][0])
            update_variances_(exp_avg_sqs, grads, group["betas"][1])
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
        """DeepSpeed's form: ``m = b1 m + (1 - b1) CompressedAllreduce(g_local)``, the local gradients copied into
        buffers laid out like the buckets once per bucket layout (a missing gradient: this rank contributes zeros)."""
        gradients, buckets = self.gradient_buffers, self._ensure_buckets(carry=True)
        if gradients.laid_out_for is not buckets:
            gradients.lay_out_(buckets, lambda key: feedback_key("gradient", key))
        if gradients.views:
            torch._foreach_copy_(gradients.views, [p.grad if p.grad is not None else v.new_zeros(()).expand_as(v)
                                                   for p, v in zip(gradients.params, gradients.views)])
        self._compressed_average_(gradients.items)
        for group in self.param_groups:
            params = self._updated_params(group)
            if params:
                fold_gradients_([self.state[p]["exp_avg"] for p in params],
                                [gradients.by_param[id(p)] for p in params], group["betas"][0])

    def _local_step(self, t: int) -> StepKind:
        """A step on this rank's own gradient with no communication (fold, mask, accumulate, update); a sync after it
        when the schedule says so."""
        local = self._laid_out_local_steps()
        for index, group in enumerate(self.param_groups):
            params = self._updated_params(group)
            if not params:
                continue
            exp_avgs = [self.state[p]["exp_avg"] for p in params]
            fold_gradients_(exp_avgs, [p.grad for p in params], group["betas"][0])  # a missing gradient: zero
            self._keep_at_rest_(group, params, exp_avgs)
            # U = U + lr m_hat (before the update), lr_sum = lr_sum + lr, D = D (1 - lr wd)
            accumulate_update_(group, [self.state[p][UPDATE] for p in params], exp_avgs, t)
            local.lr_sum[index] += group["lr"]
            local.decay[index] *= 1 - group["lr"] * group["weight_decay"]
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
        It averages the updates in full precision (one ``all_reduce`` of their size), not in 1 bit: a 1-bit sync a step
        after a scheduled one would fold a whole interval's compression error into one step (on the example, syncs
        before every validation so made the local steps diverge)."""
        if self.local_steps.since_sync == 0:
            return False
        self._sync(self._step, exact=True)
        self.local_steps.forced_syncs += 1
        return True

    def _sync(self, t: int, exact: bool = False) -> None:
        """Average the accumulated updates ``U`` (1 bit; ``exact``: in full precision) and move every replica to the
        same new point from rank-identical values only (:func:`~lightning_onebit.optim.functional.sync_update_`);
        a param group whose learning rate was 0 over the whole interval averages its momenta instead."""
        local, state = self._laid_out_local_steps(), self.state
        for index, group in enumerate(self.param_groups):
            params = self._updated_params(group)
            if local.lr_sum[index] == 0 and params:  # lr was 0 throughout: nothing moved; average the momenta
                torch._foreach_copy_([state[p][UPDATE] for p in params], [state[p]["exp_avg"] for p in params])
        if exact:  # W = the average of U
            full_precision_allreduce_(self.compression, local.flats)
        else:
            self._compressed_average_(local.items)
        for index, group in enumerate(self.param_groups):
            params = self._updated_params(group)
            if not params:
                continue
            updates = [state[p][UPDATE] for p in params]
            self._keep_at_rest_(group, params, updates)
            sync_update_(group, params, updates, [state[p]["exp_avg"] for p in params],
                         [state[p]["exp_avg_sq"] for p in params], [state[p][SYNCED] for p in params],
                         local.lr_sum[index], local.decay[index], t, self.schedule.variance_updates,
                         self.compression.backend)
        for flat in local.flats:  # U = 0;  lr_sum = 0;  D = 1
            flat.zero_()
        local.lr_sum, local.decay, local.since_sync = [0.0] * len(local.decay), [1.0] * len(local.decay), 0

    def _laid_out_local_steps(self) -> LocalSteps:
        """The local steps' sums, begun at the first local step; ``U`` laid out like the buckets (again if rebuilt)."""
        local, buckets = self.local_steps, self._ensure_buckets(carry=True)
        if local.lr_sum is None:  # no gradient is exchanged in 1 bit after var_freeze_step: their buffers freed
            self.gradient_buffers = ExchangeBuffers()
            local.begin_(self._bucket_source(), buckets, self._updated_params, self.schedule.var_freeze_step)
        elif local.laid_out_for is not buckets:
            local.lay_out_(self._bucket_source(), buckets, self._updated_params)
        return local

    def _compressed_average_(self, items: Sequence[tuple[Hashable, torch.Tensor, BucketLayout]]) -> None:
        """Replace each ``(error-feedback key, flat, layout)`` by its 1-bit average over the group (rank-identical)."""
        if not self._backend_agreed:
            self.agree_kernel_backend()
        self.exchange.average_(items)

    def _keep_at_rest_(self, group: dict[str, Any], params: list[torch.Tensor], tensors: list[torch.Tensor]) -> None:
        """Multiply ``tensors`` (one per parameter: momenta, exchanged gradients or updates) by the parameters' masks
        and zero them where the variance is exactly zero (``v == 0``, a bool tensor per parameter kept until the
        variance next changes: always a tensor, also where no coordinate is zero, since asking whether any is would
        synchronise the host with the device once per parameter after every variance step)."""
        for p in params:
            if id(p) not in self._zero_variance:
                self._zero_variance[id(p)] = self.state[p]["exp_avg_sq"] == 0
        mask_(group, params, tensors, self._zero_variance)
