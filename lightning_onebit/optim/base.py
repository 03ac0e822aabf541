"""The lean base of the compressed optimizers: the step and its stage, the dispatch to a subclass's warmup and
compressed steps, the freeze (fixed or ``"auto"``), the process group and topology, the overlap entry points and the
checkpoint state.

What it delegates, one module each: the momentum buckets and their layout (:mod:`~lightning_onebit.optim.buckets`),
their compressed exchange (:mod:`~lightning_onebit.optim.exchange`), masks and dead coordinates
(:mod:`~lightning_onebit.optim.masks`), param-group options (:mod:`~lightning_onebit.optim.groups`), the checkpoint
format (:mod:`~lightning_onebit.optim.checkpoint`), the automatic freeze (:mod:`~lightning_onebit.optim.auto_freeze`)
and the update math (:mod:`~lightning_onebit.optim.functional`).

An algorithm is a subclass (:class:`~lightning_onebit.OnebitAdam`) that implements its warmup step and its
compressed step; the compressed step calls :meth:`CompressedOptimizer._average_momenta_` to turn every rank's local
momentum into the rank-identical compressed average, then applies its update.
"""

from __future__ import annotations

import collections
import enum
import logging
import warnings
from typing import Any, Callable, Hashable, Iterable, Optional, Sequence, Union

import torch
import torch.distributed as dist

from lightning_onebit import kernels
from lightning_onebit.comm.accounting import CommunicationCounters
from lightning_onebit.comm.agreement import agree_kernel_backend
from lightning_onebit.comm.full_precision import full_precision_allreduce_, sparse_rows_allreduce_
from lightning_onebit.comm.layout import BucketLayout
from lightning_onebit.comm.state import CompressedAllreduceState
from lightning_onebit.comm.topology import Topology
from lightning_onebit.kernels import Backend
from lightning_onebit.optim.auto_freeze import AutoFreeze, FreezeDetector, VarianceReading
from lightning_onebit.optim.buckets import (
    MomentumBucket,
    MomentumBuckets,
    Plan,
    carry_error_feedback_,
    checked_plan,
    feedback_key,
    same_plan,
    stream_of,
)
from lightning_onebit.optim.checkpoint import (
    CHECKPOINT_KEY,
    continuable_state_dict,
    plan_as_indices,
    plan_from_indices,
)
from lightning_onebit.optim.exchange import MomentumExchange
from lightning_onebit.optim.groups import check_param_group, compressed_trainable, is_real, trainable
from lightning_onebit.optim.masks import DeadCoordinateTracker, check_exp_avg_mask, describe_param, mask_like
from lightning_onebit.optim.functional import adamw_step_
from lightning_onebit.optim.step_kind import StepKind

log = logging.getLogger(__name__)

#: Default size of a compressed momentum bucket, MB (DDP's default bucket size).
DEFAULT_BUCKET_CAP_MB = 25.0

class OnebitStage(str, enum.Enum):
    """The stage an optimizer step runs in."""

    WARMUP = "warmup"
    COMPRESSION = "compression"


class CompressedOptimizer(torch.optim.Optimizer):
    """Base of the optimizers that average 1-bit compressed momenta after a full-precision warmup.

    It owns what they share: the global step and the stage (:attr:`stage`, :attr:`needs_gradient_allreduce`), the
    momentum buckets (flat, zero-padded buffers whose views are the parameters' ``exp_avg``; laid out by
    ``bucket_cap_mb`` or by :meth:`set_bucket_plan`), the compressed exchange and its counters, the overlap with
    backward (:meth:`start_bucket_exchange_`), momentum masks (param-group option ``exp_avg_mask``), param groups kept
    out of compression (param-group option ``compress=False``), dead-coordinate detection, and the checkpoint state
    (:meth:`state_dict`, per-rank error feedback). Param groups hold ``lr``, ``betas``, ``eps``, ``weight_decay``,
    ``bias_correction`` and ``compress``, checked when a group is added.

    A subclass passes its ``defaults`` and implements ``_warmup_step()`` (averaged gradients), ``_compressed_step()``
    (local gradients; it calls :meth:`_average_momenta_`, or :meth:`_compressed_average_` for other quantities, and
    applies its update) and ``_full_precision_update_(groups)`` (its warmup update of the given groups, on averaged
    gradients, with ``exp_avg_mask`` applied to the momentum: what ``compress=False`` groups take in the compression
    stage, after :meth:`_step_uncompressed_groups_` averaged their gradients); ``_warmup_step`` and
    ``_compressed_step`` may return the kind of step they took (see :attr:`steps_by_kind`). See
    :class:`~lightning_onebit.OnebitAdam` for the arguments, which every subclass shares.
    """

    #: Why this optimizer's exchange cannot start during backward (``None``: it can, see
    #: :meth:`start_bucket_exchange_`). The strategy's ``overlap="auto"`` falls back with this reason.
    overlap_unsupported_reason: Optional[str] = None
    #: Whether the optimizer itself keeps coordinates with an exactly-zero variance at rest (their momentum is zeroed),
    #: instead of relying on masks fixed at the end of warmup (:class:`~lightning_onebit.MomentumMask`'s ``auto``).
    masks_zero_variance: bool = False

    def __init__(
        self,
        params: Union[Iterable[torch.Tensor], Iterable[dict[str, Any]]],
        defaults: dict[str, Any],
        *,
        freeze_step: Union[int, str],
        auto_freeze: Optional[AutoFreeze] = None,
        bucket_cap_mb: float = DEFAULT_BUCKET_CAP_MB,
        process_group: Optional[dist.ProcessGroup] = None,
        kernel_backend: Backend = "auto",
        topology: Optional[Topology] = None,
        warn_dead_coordinates: bool = True,
    ) -> None:
        if freeze_step != "auto" and (
            isinstance(freeze_step, bool) or not isinstance(freeze_step, int) or freeze_step < 1
        ):
            raise ValueError(
                f"freeze_step must be an integer >= 1 (the number of warmup steps that estimate the variance) or "
                f"'auto', got {freeze_step!r}"
            )
        if auto_freeze is not None and freeze_step != "auto":
            raise ValueError(
                f"auto_freeze configures freeze_step='auto', but freeze_step is {freeze_step!r}: drop auto_freeze or "
                "pass freeze_step='auto'"
            )
        if auto_freeze is not None and not isinstance(auto_freeze, AutoFreeze):
            raise ValueError(f"auto_freeze must be a lightning_onebit.AutoFreeze, got {type(auto_freeze).__name__}")
        if not is_real(bucket_cap_mb) or not bucket_cap_mb > 0:
            raise ValueError(f"bucket_cap_mb must be a number > 0 (MB), got {bucket_cap_mb!r}")
        if not isinstance(warn_dead_coordinates, bool):
            raise ValueError(f"warn_dead_coordinates must be True or False, got {warn_dead_coordinates!r}")
        # which momenta share a bucket (packed by bucket_cap_mb, or as set_bucket_plan says) and the buckets; before
        # the param groups are added (add_param_group invalidates the buckets)
        self.momentum_buckets = MomentumBuckets(int(bucket_cap_mb * 2**20))
        # every param group is compressed unless it says compress=False (see _check_group)
        super().__init__(params, {**defaults, "compress": True})
        #: The last warmup step: an int, or ``None`` while ``freeze_step="auto"`` is still measuring.
        self.freeze_step: Optional[int] = None if freeze_step == "auto" else freeze_step
        self.auto_freeze = (auto_freeze or AutoFreeze()) if freeze_step == "auto" else None
        self._detector: Optional[FreezeDetector] = None  # created at the first warmup step (needs the betas)
        # whether step(closure) records the closure's loss for freeze_step="auto" (see observe_losses_from_caller)
        self._observe_closure_loss = True
        if topology is not None and not isinstance(topology, Topology):
            raise ValueError(
                f"topology must be a lightning_onebit.Topology (from Topology.build), got {type(topology).__name__}"
            )
        kernels.effective_backend(kernel_backend)  # raises on an unknown name
        self.kernel_backend = kernel_backend
        self.compression = CompressedAllreduceState(process_group, kernel_backend, topology)
        self._backend_agreed = False
        self._step = 0
        # the buckets' compressed exchanges: started during backward (the overlap hook) or in step
        self.exchange = MomentumExchange(self.compression)
        self._frozen_params: set[int] = set()
        # id(param) -> factor (a 0-dim tensor on the parameter's device) its momentum is multiplied by for the
        # exchange and divided by after it; set by a subclass (1-bit LAMB's scaling coefficients), empty for 1-bit Adam
        self._exchange_scale: dict[int, torch.Tensor] = {}
        self.last_dropped_error_norm: Optional[float] = None
        self.warn_dead_coordinates = warn_dead_coordinates
        # dead-coordinate detection (warmup only), by id(param); its first step is > 1 after a resume in warmup
        self._dead_coordinates = DeadCoordinateTracker()
        #: Steps this process took, by :class:`~lightning_onebit.optim.StepKind`: ``WARMUP`` and ``COMPRESSED``;
        #: :class:`~lightning_onebit.ZeroOneAdam` takes ``VARIANCE``, ``COMPRESSED``, ``LOCAL`` and ``SYNC`` steps.
        #: Not saved in checkpoints.
        self.steps_by_kind: collections.Counter[StepKind] = collections.Counter()
        self.last_step_kind: Optional[StepKind] = None  # the kind of the latest step

    # ------------------------------------------------------------------ validation
    def add_param_group(self, param_group: dict[str, Any]) -> None:
        """Add a param group (see the class docstring for its options). An invalid group raises ``ValueError`` naming
        the option and the group, and is not added."""
        super().add_param_group(param_group)
        try:
            self._check_group(self.param_groups[-1], len(self.param_groups) - 1)
        except ValueError:
            self.param_groups.pop()
            raise
        self.momentum_buckets.built = None  # a new group changes the bucket layout

    @classmethod
    def _check_group(cls, group: dict[str, Any], index: int) -> None:
        check_param_group(group, index, cls.__name__)

    # ------------------------------------------------------------------ read-only status
    @property
    def step_count(self) -> int:
        """Optimizer steps taken so far (warmup and compressed)."""
        return self._step

    @property
    def stage(self) -> OnebitStage:
        """The stage the next :meth:`step` runs in."""
        if self.freeze_step is None or self._step < self.freeze_step:
            return OnebitStage.WARMUP
        return OnebitStage.COMPRESSION

    @property
    def next_step_kind(self) -> StepKind:
        """What the next :meth:`step` will do (``WARMUP`` until the freeze step, ``COMPRESSED`` after it; exact as
        long as the freeze step is known, and ``WARMUP`` while ``freeze_step="auto"`` has not decided)."""
        return StepKind.WARMUP if self.stage is OnebitStage.WARMUP else StepKind.COMPRESSED

    @property
    def needs_gradient_allreduce(self) -> bool:
        """Whether gradients of the next backward must be averaged across ranks (the next step's kind says so)."""
        return self.next_step_kind.averages_gradients

    #: What :class:`~lightning_onebit.CommunicationMonitor`'s advice adds about the steps of this optimizer that it
    #: does not time (``None``: it times every compressed step).
    advisor_note: Optional[str] = None

    @property
    def replicas_in_sync(self) -> bool:
        """Whether every rank holds the same parameters now (always, except between the synchronisations of an
        optimizer that takes local steps, :class:`~lightning_onebit.ZeroOneAdam`)."""
        return True

    def synchronize(self) -> bool:
        """Make the replicas identical now if they are not (:attr:`replicas_in_sync`); a collective when it acts,
        so call it on every rank (the strategy does, before it saves a checkpoint). Returns whether it communicated.
        Nothing to do here: this optimizer's replicas are identical after every step."""
        return False

    def describe_phase(self) -> tuple[StepKind, str]:
        """``(phase, sentence)``: the phase the next step is in, named by the kind of step that characterises it, and
        a sentence for the log saying what it does. The strategy announces each new phase once."""
        name = type(self).__name__
        if self.stage is OnebitStage.WARMUP:
            until = (
                f"optimizer step {self.freeze_step}"
                if self.freeze_step is not None
                else "the variance settles (freeze_step='auto': " + self._detector_rule() + ")"
            )
            return StepKind.WARMUP, f"warmup (DDP gradient allreduce, full-precision {name} update) until {until}"
        decided = "" if self._detector is None else f" (freeze_step='auto' decided {self.freeze_step}: " + (
            self._detector.describe() + ")"
        )
        uncompressed = (
            "; param groups with compress=False: gradients averaged in full precision, variance live"
            if self._uncompressed_groups()
            else ""
        )
        return StepKind.COMPRESSED, (
            f"compression stage from optimizer step {self._step + 1}: DDP gradient allreduce off, momenta averaged by "
            f"the 1-bit compressed allreduce, variance frozen{decided}{uncompressed}"
        )

    def _detector_rule(self) -> str:
        return self._ensure_detector().rule()

    def observe_loss(self, loss: Union[torch.Tensor, float]) -> None:
        """Record a training loss for ``freeze_step="auto"``, whose :class:`~lightning_onebit.AutoFreeze` ``loss_drop``
        guard waits for the loss to leave its initial plateau. Call it every step (or every micro-batch) on every rank,
        before :meth:`step`; a ``closure`` passed to :meth:`step` is observed too. The Lightning strategy calls it
        from its ``backward``. A scalar tensor is summed on its device and read once per check, so this adds no host
        synchronisation per step. Does nothing once the freeze step is known, or with an integer ``freeze_step``."""
        if self.auto_freeze is None or self.freeze_step is not None:
            return
        self._ensure_detector().record_loss(loss)

    def observe_losses_from_caller(self) -> None:
        """Declare that the caller passes every training loss to :meth:`observe_loss` itself, so that the loss a
        ``closure`` given to :meth:`step` returns is not recorded a second time. The Lightning strategy does this: it
        records every loss in its ``backward`` (micro-batches and manual optimization included)."""
        self._observe_closure_loss = False

    def _ensure_detector(self) -> FreezeDetector:
        if self._detector is None:
            assert self.auto_freeze is not None
            self._detector = FreezeDetector(self.auto_freeze, self.param_groups[0]["betas"][1], type(self).__name__)
        return self._detector

    @property
    def freeze_detector(self) -> Optional[FreezeDetector]:
        """The measuring state of ``freeze_step="auto"`` (its figures, ``describe()``), ``None`` with an int."""
        return self._ensure_detector() if self.auto_freeze is not None else None

    def _variance_reading(self) -> VarianceReading:
        """What the freeze detector measures now: ``(numel, v, correction, beta2)`` for every trainable parameter of
        the compressed param groups, in order (the update will use ``v / correction``, 1 without bias correction;
        ``v`` is ``None`` where the parameter has no variance yet; ``compress=False`` groups are left out: their
        variance is never frozen), the subclass's settling figures, the parameters' device and the process group."""
        variances = []
        for group in self.param_groups:
            if not group["compress"]:
                continue
            b2 = group["betas"][1]
            correction = 1 - b2**self._step if group["bias_correction"] else 1.0
            variances += [(p.numel(), self.state[p].get("exp_avg_sq"), correction, b2) for p in trainable(group)]
        params = [p for group in self.param_groups for p in group["params"]]
        device = params[0].device if params else torch.device("cpu")
        return VarianceReading(variances, self._settling_figures(), device, self.process_group)

    def _on_freeze(self) -> None:
        """Called once, after the last warmup step (fixed or decided ``freeze_step``)."""

    def _settling_figures(self) -> Optional[torch.Tensor]:
        """Other per-tensor figures that must settle before an automatic freeze (1-bit LAMB: its trust-ratio EMAs);
        ``None``: only the variance."""
        return None

    @property
    def process_group(self) -> Optional[dist.ProcessGroup]:
        return self.compression.process_group

    @process_group.setter
    def process_group(self, group: Optional[dist.ProcessGroup]) -> None:
        if group is not self.compression.process_group:
            self.compression.process_group = group
            self.compression.reset_error_feedback()
            self.momentum_buckets.built = None
            self._backend_agreed = False

    @property
    def topology(self) -> Optional[Topology]:
        """The :class:`~lightning_onebit.Topology` of the momentum exchange (``None``: flat, nodes unknown)."""
        return self.compression.topology

    @topology.setter
    def topology(self, topology: Optional[Topology]) -> None:
        if topology is not None and not isinstance(topology, Topology):
            raise ValueError(f"topology must be a lightning_onebit.Topology, got {type(topology).__name__}")
        if topology is not self.compression.topology:
            self.compression.topology = topology
            self.compression.reset_error_feedback()  # its shapes and meaning depend on the exchange

    def agree_kernel_backend(self) -> str:
        """Agree the kernel backend with every rank of :attr:`process_group` (a collective; see ``kernel_backend``).
        Returns the backend every rank now runs. Called at the first compressed step if nobody called it before."""
        self.compression.backend = agree_kernel_backend(self.kernel_backend, self.compression.process_group)
        self._backend_agreed = True
        return self.compression.backend

    @property
    def communication(self) -> CommunicationCounters:
        """Cumulative counters of the compressed allreduce on this rank, and of the full-precision allreduce of
        ``compress=False`` groups (``bytes_sent_uncompressed``); the warmup gradient sync is not included. On CUDA
        the times count once their events completed (read back here without waiting)."""
        return self.compression.settle_timings()


    # ------------------------------------------------------------------ step
    @torch.no_grad()
    def step(self, closure: Optional[Callable[[], Any]] = None) -> Any:
        """One optimization step; warmup or compressed according to :attr:`stage`."""
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
            if loss is not None and self._observe_closure_loss:
                self.observe_loss(loss)
        for group in self.param_groups:
            for p in group["params"]:
                if p.grad is not None and p.grad.is_sparse:
                    raise ValueError(f"{type(self).__name__} does not support sparse gradients; use dense embeddings")
        # Everything this step does comes after the work the overlap hook queued on its side stream (folded momenta,
        # compression, launches): compressed-group momenta and the kernel workspace are read from here on.
        self.exchange.join_side_stream()
        stage = self.stage
        self._step += 1
        if stage is OnebitStage.WARMUP:
            kind = self._warmup_step() or StepKind.WARMUP
            if self.freeze_step is None:
                self._observe_variance()
            if self.stage is OnebitStage.COMPRESSION:
                self._on_freeze()
        else:
            kind = self._compressed_step() or StepKind.COMPRESSED
        self.steps_by_kind[kind] += 1
        self.last_step_kind = kind
        if self.momentum_buckets.deferred_plan is not None:
            (plan,), self.momentum_buckets.deferred_plan = self.momentum_buckets.deferred_plan, None
            self._install_plan(plan)
        return loss

    def _observe_variance(self) -> None:
        """freeze_step='auto': measure after this warmup step; end the warmup here if the detector says so."""
        detector = self._ensure_detector()
        decided = detector.observe(self._step, self._variance_reading)
        if decided is not None:
            self.freeze_step = decided
            if self.compression.rank() == 0:
                log.info(
                    "%s: freeze_step='auto' decided %d (%s); the compression stage starts at step %d",
                    type(self).__name__,
                    decided,
                    detector.describe(),
                    decided + 1,
                )

    def _moment_state(self, p: torch.Tensor) -> dict[str, Any]:
        """``p``'s state with ``exp_avg`` and ``exp_avg_sq`` (zeros when new), for a warmup step where ``p`` has a
        gradient; from then on ``p`` has a variance estimate and is no longer frozen."""
        state = self.state[p]
        if "exp_avg_sq" not in state:
            if "exp_avg" not in state:  # else: a zero momentum view into a bucket built early
                state["exp_avg"] = torch.zeros_like(p, memory_format=torch.preserve_format)
            state["exp_avg_sq"] = torch.zeros_like(p, memory_format=torch.preserve_format)
            self._frozen_params.discard(id(p))
        return state

    def _adamw_step_(
        self, t: int, groups: Optional[Sequence[dict[str, Any]]] = None, compression_stage: bool = False
    ) -> None:
        """Step ``t`` of :class:`torch.optim.AdamW` (:func:`~lightning_onebit.optim.functional.adamw_step_`) on the
        (averaged) gradients of the parameters of ``groups`` (default all) that have one.

        The Adam-based optimizers' warmup, where it records nonzero gradients of the compressed groups for the
        dead-coordinate warning when it is on, and their ``compress=False`` groups in the compression stage
        (``compression_stage=True``), where explicit ``exp_avg_mask`` multiply the momentum after the gradient is
        folded in, as they multiply the averaged momentum of the compressed groups."""
        for group in self.param_groups if groups is None else groups:
            params, grads, exp_avgs, exp_avg_sqs, masks = [], [], [], [], []
            for i, p in enumerate(group["params"]):
                if p.grad is None:
                    continue
                state = self._moment_state(p)
                params.append(p)
                grads.append(p.grad)
                exp_avgs.append(state["exp_avg"])
                exp_avg_sqs.append(state["exp_avg_sq"])
                if compression_stage and group["exp_avg_mask"][i] is not None:
                    masks.append((len(params) - 1, mask_like(group["exp_avg_mask"], i, state["exp_avg"])))
                if self.warn_dead_coordinates and group["compress"] and not compression_stage:
                    self._track_nonzero(p)
            if params:
                adamw_step_(group, params, grads, exp_avgs, exp_avg_sqs, t, masks)

    def _warmup_step(self) -> Optional[StepKind]:
        raise NotImplementedError

    def _compressed_step(self) -> Optional[StepKind]:
        raise NotImplementedError

    def _full_precision_update_(self, groups: Sequence[dict[str, Any]]) -> None:
        """The warmup update of these param groups on their (averaged) gradients, in the compression stage, with
        explicit ``exp_avg_mask`` applied to the momentum: what ``compress=False`` groups take."""
        raise NotImplementedError

    def _uncompressed_groups(self) -> list[dict[str, Any]]:
        """The param groups with ``compress=False``."""
        return [group for group in self.param_groups if not group["compress"]]

    def _step_uncompressed_groups_(self, averaged: bool = False) -> None:
        """Compression stage: average the gradients of the ``compress=False`` groups in full precision (unless
        ``averaged``: DDP's allreduce already did, e.g. 0/1 Adam's variance steps) and take their warmup update.

        One ``all_reduce`` per (device, dtype) over all their trainable parameters' gradients
        (:func:`~lightning_onebit.comm.full_precision_allreduce_`), and for groups with ``sparse_rows=True`` two
        ``all_gather`` of their nonzero rows (:func:`~lightning_onebit.comm.sparse_rows_allreduce_`). A parameter without a gradient on this rank
        contributes a zero gradient (written into its ``.grad``), as in the compressed groups, so that every rank
        sends the same buffer; after the step ``.grad`` holds the averaged gradient. Since the momentum is identical on
        every rank before the gradient is folded in, averaging the gradient is averaging the momentum exactly.
        """
        groups = self._uncompressed_groups()
        if not groups:
            return
        if not averaged:
            dense, sparse = [], []
            for group in groups:
                for p in trainable(group):
                    if p.grad is None:
                        p.grad = torch.zeros_like(p, memory_format=torch.preserve_format)
                    (sparse if group["sparse_rows"] else dense).append(p.grad)
            full_precision_allreduce_(self.compression, dense)
            sparse_rows_allreduce_(self.compression, sparse)
        self._full_precision_update_(groups)

    def _track_nonzero(self, p: torch.Tensor) -> None:
        """Record which elements of ``p`` had a nonzero gradient in this warmup step (dead-coordinate detection)."""
        self._dead_coordinates.track(id(p), p.grad, self._step)

    def dead_coordinates_masked_by(self, owner: str) -> None:
        """Declare that ``owner`` masks every dead coordinate itself (``MomentumMask(auto=True)`` does), so that this
        optimizer neither tracks them nor warns about them (as ``warn_dead_coordinates=False``)."""
        self.warn_dead_coordinates = False
        self._dead_coordinates.clear()
        log.debug("%s: dead coordinates are masked by %s", type(self).__name__, owner)

    def _report_dead_coordinates(self) -> None:
        """At the first compressed step (masks are in place by then): warn about trainable coordinates whose gradient
        was exactly zero in every tracked warmup step and that no mask covers; free the detection state."""
        tracker, self._dead_coordinates = self._dead_coordinates, DeadCoordinateTracker()
        since = tracker.since
        if not self.warn_dead_coordinates:  # switched off during warmup (MomentumMask(auto=True) does that)
            return
        found, total = [], 0
        for g, group in enumerate(self.param_groups):
            if not group["compress"]:  # averaged in full precision: a zero gradient stays an exact zero
                continue
            for i, p in enumerate(group["params"]):
                dead = tracker.dead(id(p), p, group["exp_avg_mask"][i]) if p.requires_grad else None
                if dead is None:
                    continue
                count = int(dead.sum())
                if count:
                    found.append(f"{describe_param(group, g, i, p)}: {count} of {p.numel()}")
                    total += count
        if not found or self.compression.rank() != 0:
            return
        tracked = f"steps {since}..{self._step - 1}" if since is not None else "warmup"
        if since is not None and since > 1:
            tracked += f"; steps before {since} ran before a resume and were not observed"
        more = f" and {len(found) - 8} more" if len(found) > 8 else ""
        warnings.warn(
            f"{type(self).__name__}: {total} coordinate(s) in {len(found)} parameter(s) had an exactly-zero gradient "
            f"in every warmup step ({tracked}) and are not masked: {'; '.join(found[:8])}{more}. 1-bit compression "
            "cannot send zero, so from this compressed step on they can receive +-scale momentum with a ~0 variance, "
            "and their updates then explode (to about lr * scale / eps per step). Fix: add `MomentumMask(auto=True)` "
            f"to the Trainer's callbacks (without Lightning: an exp_avg_mask with 0 there), which freezes them, or, if "
            "they should train (embedding rows first seen later), put such parameters in a param group with "
            "`\"compress\": False` (their gradients are then averaged in full precision and their variance stays "
            f"live); {type(self).__name__}(warn_dead_coordinates=False) silences this.",
            UserWarning,
            stacklevel=4,
        )


    def _average_momenta_(self) -> None:
        """Fold each rank's local gradient into its momentum (``m = lerp(m, g, 1 - beta1)``), replace the momenta by
        their 1-bit compressed average over the process group (identical on every rank), and apply the masks; for
        the compressed param groups only (``compress=False`` groups: :meth:`_step_uncompressed_groups_`).

        Buckets whose exchange started during backward (the overlap hook) were folded there and are only finished
        here. Runs the dead-coordinate report and the kernel agreement at the first compressed step.
        """
        if self._dead_coordinates:
            self._report_dead_coordinates()
        if not self._backend_agreed:
            self.agree_kernel_backend()
        started = self.exchange.take_started()
        buckets = self._ensure_buckets(carry=True)
        flats = {b.key: b.flat for b in buckets}
        if any(flats.get(p.key) is not p.buffer for p in started):
            raise RuntimeError(
                f"{type(self).__name__}: the momentum buckets changed while their exchange was in flight: the "
                "trainable parameters (requires_grad, a param group's compress, a new param group) changed after "
                "backward had started exchanging them and before optimizer.step(). Change them before the forward "
                "pass (in Lightning: e.g. in on_train_batch_start; a hook marked leaves_gradients_unchanged must not "
                "change them), or turn overlap off"
            )
        in_flight = {p.key for p in started}
        rest = [b for b in buckets if b.key not in in_flight]
        with self.exchange.exposed(buckets[0].flat.device if buckets else None):
            # Fold the local gradients into the momenta of the buckets whose exchange did not start during backward.
            # A parameter without a gradient folds a zero gradient (lerp towards 0), as the backward hook does for
            # DDP's zero-filled bucket entries, so that both paths give the same bits.
            folded = {id(q) for b in buckets if b.key in in_flight for q in b.params}
            for group in self.param_groups:
                grads, exp_avgs, decays = [], [], []
                for p in compressed_trainable(group):
                    if id(p) in folded:
                        continue
                    m = self.state[p]["exp_avg"]
                    (decays if p.grad is None else exp_avgs).append(m)
                    if p.grad is not None:
                        grads.append(p.grad)
                weight = 1 - group["betas"][0]
                if exp_avgs:
                    torch._foreach_lerp_(exp_avgs, grads, weight)
                if decays:
                    torch._foreach_lerp_(decays, [m.new_zeros(()).expand_as(m) for m in decays], weight)
            self._scale_for_exchange_([q for b in rest for q in b.params])
            self.exchange.finish_(started, rest)
        if self._exchange_scale:
            scaled = [q for b in buckets for q in b.params if id(q) in self._exchange_scale]
            torch._foreach_div_(
                [self.state[q]["exp_avg"] for q in scaled], [self._exchange_scale[id(q)] for q in scaled]
            )
        for group in self.param_groups:
            if not group["compress"]:  # masked in their own update, after their gradient is folded in
                continue
            masks = group["exp_avg_mask"]
            for i, p in enumerate(group["params"]):
                if p.requires_grad and masks[i] is not None:
                    m = self.state[p]["exp_avg"]
                    m.mul_(mask_like(masks, i, m))

    def _scale_for_exchange_(self, params: Sequence[torch.Tensor]) -> None:
        """Multiply these parameters' folded momenta by their :attr:`_exchange_scale` (if any) before compression;
        :meth:`_average_momenta_` divides the average by it again. 1-bit LAMB uses it to give every tensor a
        similar magnitude inside a bucket (one sign per element, scales per segment)."""
        if not self._exchange_scale:
            return
        scaled = [q for q in params if id(q) in self._exchange_scale]
        if scaled:
            torch._foreach_mul_(
                [self.state[q]["exp_avg"] for q in scaled], [self._exchange_scale[id(q)] for q in scaled]
            )

    def _compressed_average_(self, stream: str, buffers: Sequence[tuple[MomentumBucket, torch.Tensor]]) -> None:
        """Replace each buffer (laid out like its bucket, e.g. from :meth:`_bucket_state_buffer`) by its
        error-compensated 1-bit average over the process group, identical on every rank; the error feedback is
        ``stream``'s (:func:`~lightning_onebit.optim.buckets.feedback_key`). Buckets are pipelined."""
        if not self._backend_agreed:
            self.agree_kernel_backend()
        self.exchange.average_([(feedback_key(stream, bucket.key), flat, bucket.layout) for bucket, flat in buffers])

    def _bucket_state_buffer(self, bucket: MomentumBucket, name: str) -> torch.Tensor:
        """``bucket``'s flat buffer of ``state[p][name]`` (:meth:`MomentumBucket.state_buffer`)."""
        return bucket.state_buffer(name, self.state)

    def _updated_params(self, group: dict[str, Any]) -> list[torch.Tensor]:
        """The group's parameters a compressed step updates: trainable ones with a variance estimate; none in a
        ``compress=False`` group (:meth:`_step_uncompressed_groups_` updates those)."""
        return [p for p in compressed_trainable(group) if id(p) not in self._frozen_params]

    # ------------------------------------------------------------------ overlap with backward
    def start_bucket_exchange_(
        self,
        key: int,
        params: Sequence[torch.Tensor],
        gradients: Sequence[torch.Tensor],
        clip_value: Optional[float] = None,
    ) -> bool:
        """Fold one bucket's local gradients into its momenta and start its compressed exchange, during backward.

        For a DDP communication hook (:func:`~lightning_onebit.overlapped_exchange_hook`): ``key`` is the momentum
        bucket (see :meth:`set_bucket_plan`), ``params`` and ``gradients`` the gradient bucket's parameters and their
        gradients, in order (``GradBucket.parameters()`` and ``gradients()``). Parameters this optimizer does not
        train, and those of ``compress=False`` groups (their local gradients stay in ``.grad`` for :meth:`step` to
        average in full precision), are skipped. ``clip_value``: first clamp the gradients to ``[-clip_value, clip_value]`` in place
        (clipping by value, elementwise, so it can happen per bucket). The next :meth:`step` then only folds the other
        buckets, finishes every exchange, decodes and applies, with the same bits as without the hook.

        Returns ``False``, doing nothing, where it cannot start: in warmup, before the first compressed step built
        the buckets, when the trainable parameters changed since they were built (``requires_grad`` switched: then
        for every bucket of this backward, and the next :meth:`step` rebuilds them and exchanges everything), or when
        bucket ``key`` does not hold exactly these parameters (the plan changed). Every rank
        must get the same answer (true for DDP's buckets, which rank 0 decides). Raises ``RuntimeError`` if the
        bucket's exchange was already started since the last step (a second backward pass before ``step``).
        """
        buckets = self.momentum_buckets
        if self.stage is not OnebitStage.COMPRESSION or buckets.built is None or buckets.deferred_plan is not None:
            return False
        if not self.exchange.in_flight and self._bucket_inputs()[0] != buckets.built_for:
            # The buckets no longer fit the trainable parameters (a layer frozen or unfrozen, a group's compress
            # switched): the next step rebuilds them. No bucket of this backward starts; step exchanges them all, as
            # without overlap. Read from requires_grad at the first bucket, before the step's first collective: the
            # same on every rank (the model is). Later buckets skip the check once one has started.
            return False
        bucket = buckets.by_key.get(key)
        if bucket is None:
            return False
        # the trainable parameters the buckets were built for (a change rebuilds them at the next step)
        chosen = [i for i, p in enumerate(params) if id(p) in buckets.bucketed_ids]
        if len(chosen) != len(bucket.params) or any(params[i] is not q for i, q in zip(chosen, bucket.params)):
            return False
        if self.exchange.started(key):
            raise RuntimeError(
                f"{type(self).__name__}: gradient bucket {key} was ready twice before optimizer.step(): a second "
                "backward pass ran while its momentum exchange from the first was in flight. The overlapped "
                "exchange folds each backward's gradients into the momentum at once, so it needs exactly one backward "
                "pass (with gradient sync) per step: use no_sync() for the other micro-batches, or turn overlap off"
            )
        grads = [gradients[i] for i in chosen]
        if clip_value is not None:
            torch._foreach_clamp_min_(grads, -clip_value)
            torch._foreach_clamp_max_(grads, clip_value)

        def fold() -> None:
            for weight, indices in bucket.fold_groups:
                torch._foreach_lerp_(
                    [self.state[bucket.params[i]]["exp_avg"] for i in indices], [grads[i] for i in indices], weight
                )
            self._scale_for_exchange_(bucket.params)

        self.exchange.start_(bucket, fold)
        return True

    def progress_exchanges(self) -> None:
        """Advance every exchange started during this backward to its last launch (serve it and launch its second
        phase; :meth:`MomentumExchange.progress`). The overlap hook calls it for a gradient bucket that started no
        exchange, which every rank does at the same point of the bucket schedule. Harmless at any time."""
        self.exchange.progress()

    @property
    def exchanges_in_flight(self) -> int:
        """Bucket exchanges started during backward and not yet finished by :meth:`step`."""
        return self.exchange.in_flight

    # ------------------------------------------------------------------ buckets
    @property
    def bucket_cap_bytes(self) -> int:
        """The size a packed momentum bucket is filled to (``bucket_cap_mb``), bytes."""
        return self.momentum_buckets.cap_bytes

    @property
    def plan_version(self) -> int:
        """Incremented whenever the installed bucket plan changes (set or loaded)."""
        return self.momentum_buckets.plan_version

    def set_bucket_plan(self, buckets: Optional[Sequence[Sequence[torch.Tensor]]]) -> bool:
        """Lay the momenta out in these buckets: bucket ``i`` holds the momenta of ``buckets[i]``'s parameters, in
        that order, in one flat buffer exchanged by one compressed allreduce (its key is ``i``).

        The overlap hook passes DDP's gradient buckets (after DDP rebuilt them), so that a gradient bucket can be
        folded and exchanged as soon as it is ready. Parameters this optimizer does not train or does not compress
        (``compress=False`` groups) are skipped; trainable compressed parameters no bucket names are packed by
        ``bucket_cap_mb`` after them. ``None`` returns to packing everything
        by ``bucket_cap_mb``. The plan is saved in :meth:`state_dict`, so a resumed run keeps its layout (and its
        error feedback, which belongs to the layout).

        Changing the plan during the compression stage moves the momenta into the new layout and carries the error
        feedback over coordinate by coordinate (:func:`~lightning_onebit.optim.buckets.carry_error_feedback_`, a
        collective: call it on every rank); while exchanges are in flight the change waits for the end of the next
        :meth:`step`. Raises ``ValueError`` if a bucket mixes devices or dtypes or names a parameter twice.

        Returns whether the plan changed.
        """
        plan = checked_plan(buckets, self._trainable_ids)
        current = self.momentum_buckets
        if same_plan(plan, current.deferred_plan[0] if current.deferred_plan is not None else current.plan):
            return False
        if self.exchange.in_flight:
            current.deferred_plan = (plan,)
        else:
            self._install_plan(plan)
        return True

    def _install_plan(self, plan: Plan) -> None:
        buckets = self.momentum_buckets
        if same_plan(plan, buckets.plan):
            return
        buckets.plan = plan
        buckets.plan_version += 1
        if buckets.built is not None:
            old, buckets.built = buckets.built, None
            self._carry_error_feedback_(old, "new bucket plan" if plan is not None else "packed by bucket_cap_mb")

    @property
    def bucket_plan(self) -> Optional[list[list[torch.Tensor]]]:
        """The parameters of each planned momentum bucket (:meth:`set_bucket_plan`), or ``None``."""
        plan = self.momentum_buckets.plan
        return None if plan is None else [list(params) for _, params in plan]

    @property
    def _trainable_ids(self) -> set[int]:
        """The trainable parameters whose momenta are compressed (those of ``compress=False`` groups are not)."""
        return {id(p) for group in self.param_groups for p in compressed_trainable(group)}

    def _bucket_inputs(self) -> tuple[Any, list[torch.Tensor]]:
        """``(built_for, trainable)``: what the buckets are built from (:meth:`MomentumBuckets.inputs`; a change
        rebuilds them) and the compressed trainable parameters. Host-only (no device access)."""
        trainable = [p for group in self.param_groups for p in compressed_trainable(group)]
        return self.momentum_buckets.inputs(trainable, self.compression.world_size()), trainable

    def _ensure_buckets(self, carry: bool = False) -> list[MomentumBucket]:
        """Pack momenta of the compressed trainable parameters into flat padded buckets (once per layout; rebuilt
        when that set changes, e.g. a group's ``compress`` or a ``requires_grad``); momenta become views.

        ``carry=True`` (the step's exchange paths, which every rank runs at the same step): a rebuild carries the
        error feedback of the parameters that stay over to the new layout (:meth:`_carry_error_feedback_`, a
        collective), so freezing one layer does not reset the error of the others. Other callers (e.g.
        :meth:`bucket_layouts`, which one rank may call alone) never start a collective here."""
        buckets = self.momentum_buckets
        built_for, trainable = self._bucket_inputs()
        if buckets.fits(built_for):
            return buckets.built
        if carry and buckets.built is not None:
            old, buckets.built = buckets.built, None
            self._carry_error_feedback_(old, "the compressed trainable parameters changed")
            # without error feedback to carry, nothing was built yet
            return buckets.built if buckets.built is not None else self._ensure_buckets()
        if not trainable:
            return buckets.built_empty(built_for[1])
        self._frozen_params = set()
        never_updated = []
        for p in trainable:
            state = self.state[p]
            if "exp_avg_sq" not in state:
                # No variance estimate: frozen. It gets no exp_avg_sq, so it is recognised again whenever the
                # buckets are rebuilt (after load_state_dict, a process-group change).
                if "exp_avg" not in state:
                    state["exp_avg"] = torch.zeros_like(p)
                self._frozen_params.add(id(p))
                never_updated.append(tuple(p.shape))
        if never_updated:
            log.warning(
                "%s: %d parameter(s) had no gradient during warmup (shapes %s); without a variance estimate "
                "they stay frozen in the compression stage. Mask or exclude them, or lengthen warmup.",
                type(self).__name__,
                len(never_updated),
                never_updated[:8],
            )
        fold_weight = {
            id(p): 1 - group["betas"][0] for group in self.param_groups for p in compressed_trainable(group)
        }
        built = buckets.build(trainable, self.state, fold_weight, built_for[1])
        log.info(
            "%s: compression stage from step %d: %d trainable tensors in %d bucket(s) over %d rank(s)%s",
            type(self).__name__,
            self._step,
            len(trainable),
            len(built),
            built_for[1],
            " (laid out like DDP's gradient buckets)" if buckets.plan is not None else "",
        )
        return built

    def set_exp_avg_mask(self, param: torch.Tensor, mask: Optional[torch.Tensor]) -> None:
        """Set (or with ``None`` clear) the momentum mask of one parameter of this optimizer.

        ``mask`` must have exactly the parameter's shape, be bool or floating point and hold only 0 and 1 (see the
        class docstring); it is converted to the parameter's dtype and device and takes effect from the next compressed
        step. Raises ``ValueError`` naming the parameter if the mask is invalid or the optimizer does not hold it.
        """
        for g, group in enumerate(self.param_groups):
            for index, p in enumerate(group["params"]):
                if p is param:
                    if mask is not None:
                        what = f"set_exp_avg_mask: the mask for {describe_param(group, g, index, p)}"
                        mask = check_exp_avg_mask(mask, p, what)
                    group["exp_avg_mask"][index] = mask
                    return
        shape = tuple(param.shape) if isinstance(param, torch.Tensor) else type(param).__name__
        raise ValueError(
            f"set_exp_avg_mask: the parameter of shape {shape} is not managed by this optimizer (it is in none of its "
            f"{len(self.param_groups)} param group(s)); pass it to {type(self).__name__} (or add_param_group) or drop "
            "its mask"
        )

    def bucket_layouts(self) -> dict[int, BucketLayout]:
        """Layouts of the compressed buckets (building them if needed); keys are bucket keys."""
        return {b.key: b.layout for b in self._ensure_buckets()}

    # ------------------------------------------------------------------ checkpoints
    def state_dict(self) -> dict[str, Any]:
        """Torch's optimizer state plus ``"onebit"``: the global step, the freeze step, the optimizer that wrote it
        (``"optimizer"``: OnebitAdam, ZeroOneAdam or OnebitLamb, checked by :meth:`load_state_dict`) and the momentum
        bucket plan (:meth:`set_bucket_plan`, as parameter indices), if any. Masks, the groups' ``compress`` and
        error feedback are not included (masks and ``compress`` come from the code; error feedback is per rank, see
        :meth:`error_feedback_state_dict`)."""
        state_dict = super().state_dict()
        for group in state_dict["param_groups"]:
            group.pop("exp_avg_mask", None)
            group.pop("compress", None)
        meta: dict[str, Any] = {
            "step": self._step, "freeze_step": self.freeze_step or "auto", "optimizer": self._state_family()
        }
        if self.auto_freeze is not None and self._detector is not None:
            meta["auto_freeze"] = dict(self._detector.state_dict(), reason=self._detector.reason)
        if self.momentum_buckets.plan is not None:
            meta["bucket_plan"] = plan_as_indices(self.momentum_buckets.plan, self._all_params())
        state_dict[CHECKPOINT_KEY] = meta
        return state_dict

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """Load a state dict from :meth:`state_dict` (or from ``torch.optim.AdamW``: the step is then taken from its
        per-parameter ``step``). The stage is re-derived from the step; masks and each group's ``compress`` stay those
        of the code (a group may be switched in or out of compression between runs: its momentum and variance are
        ordinary state, and the buckets are rebuilt); error feedback is reset to zero and the norm that was dropped is
        kept in :attr:`last_dropped_error_norm`.

        The state of another algorithm is checked first (:meth:`_check_state_writer`): one this optimizer cannot
        continue from (1-bit LAMB's and the Adam family's, either way) raises ``ValueError`` naming the optimizer that
        wrote it and this one, changing nothing; OnebitAdam's and ZeroOneAdam's states continue each other with a
        warning (the Adam moments and the step are carried, the other algorithm's own state is dropped)."""
        state_dict = self._check_state_writer(state_dict)
        meta = state_dict.pop(CHECKPOINT_KEY, None)
        code_groups = self.param_groups
        super().load_state_dict(state_dict)
        for group, code_group in zip(self.param_groups, code_groups):
            for key, value in code_group.items():  # e.g. bias_correction, absent from a torch.optim.AdamW state dict
                group.setdefault(key, value)
            group["exp_avg_mask"] = code_group["exp_avg_mask"]
            group["compress"] = code_group["compress"]
        if meta is not None and self.auto_freeze is not None:
            step = int(meta["step"])
            self._restore_auto_freeze(meta, step)
        elif meta is not None:
            step = int(meta["step"])
            if meta.get("freeze_step", self.freeze_step) != self.freeze_step:
                log.info(
                    "%s: checkpoint used freeze_step=%s; continuing with freeze_step=%s from the code",
                    type(self).__name__,
                    meta["freeze_step"],
                    self.freeze_step,
                )
        else:
            steps = [int(s["step"]) for s in self.state.values() if isinstance(s, dict) and "step" in s]
            step = max(steps, default=0)
        self._step = step
        buckets = self.momentum_buckets
        buckets.plan = buckets.deferred_plan = None
        buckets.plan_version += 1
        if meta is not None and meta.get("bucket_plan"):
            buckets.plan = plan_from_indices(meta["bucket_plan"], self._all_params(), type(self).__name__)
        self._dead_coordinates.clear()  # dead-coordinate detection restarts from the loaded step
        for state in self.state.values():
            state.pop("step", None)  # AdamW's per-parameter step; this optimizer keeps one global step
        buckets.built = None
        self.last_dropped_error_norm = self.compression.reset_error_feedback()

    #: The algorithms whose optimizer state this one can continue from (see :meth:`_check_state_writer`);
    #: ``"torch.optim"``: a torch optimizer's state dict (e.g. AdamW's: its moments and step).
    _continues_state_of: tuple[str, ...] = ("OnebitAdam", "ZeroOneAdam", "torch.optim")

    def _all_params(self) -> list[torch.Tensor]:
        """Every parameter of every param group, in order (how checkpoints index them)."""
        return [p for group in self.param_groups for p in group["params"]]

    def _state_family(self) -> str:
        """The algorithm whose state this optimizer writes: the nearest class of this package in its MRO (a user's
        subclass of OnebitAdam writes OnebitAdam's state)."""
        for cls in type(self).__mro__:
            if cls is CompressedOptimizer:
                break
            if cls.__module__.startswith("lightning_onebit.optim."):
                return cls.__name__
        return type(self).__name__

    def _check_state_writer(self, state_dict: dict[str, Any]) -> dict[str, Any]:
        """A shallow copy of ``state_dict`` that this optimizer can load (:func:`~lightning_onebit.optim.checkpoint.
        continuable_state_dict`): raises ``ValueError`` before any step and any collective when another algorithm
        wrote it that this one cannot continue from; keeps the Adam moments of one it can, with a warning (rank 0)."""
        return continuable_state_dict(
            state_dict, self._state_family(), type(self).__name__, self._continues_state_of,
            warn=self.compression.rank() == 0,
        )

    def _restore_auto_freeze(self, meta: dict[str, Any], step: int) -> None:
        """freeze_step='auto' resumed: keep the step the checkpoint decided (or its fixed freeze step, if that was
        already reached); otherwise go on measuring from the saved snapshots."""
        saved, measured = meta.get("freeze_step"), meta.get("auto_freeze") or {}
        detector = self._ensure_detector()  # kept: the strategy may have set its max_step already
        detector.load_state_dict(measured)
        if isinstance(saved, int) and saved <= step:
            self.freeze_step = saved
            detector.reason = measured.get("reason") or "checkpoint"
            detector.load_state_dict(dict(measured, snapshots={}))  # nothing more to measure
            log.info("%s: freeze_step='auto' resumed with the step the checkpoint decided: %d", type(self).__name__,
                     saved)
            return
        self.freeze_step = None
        detector.reason = None

    def error_feedback_state_dict(self) -> dict[str, Any]:
        """This rank's compression error buffers (worker and server, per bucket). Each rank must save its own."""
        return self.compression.error_feedback_state_dict()

    def error_feedback_mismatch(self, state: Any) -> Optional[str]:
        """Why ``state`` (from :meth:`error_feedback_state_dict`, possibly of another rank or run) cannot be restored
        here, or ``None`` if it can. Checks the world size, the topology, the bucket layouts and the buffers' sizes
        and values; changes nothing and does not communicate."""
        if not isinstance(state, dict):
            return f"the saved error feedback is a {type(state).__name__}, not a dict"
        if state.get("world_size") != self.compression.world_size():
            return (
                f"error feedback was saved with world size {state.get('world_size')}, "
                f"the current world size is {self.compression.world_size()}"
            )
        if not state.get("buckets"):
            return None  # nothing had been compressed: the saved error feedback is all zero
        return self.compression.error_feedback_mismatch(state, self._feedback_layouts(state))

    def load_error_feedback_state_dict(self, state: dict[str, Any]) -> None:
        """Restore buffers from :meth:`error_feedback_state_dict` of the same rank. Raises ``ValueError`` with the
        reason of :meth:`error_feedback_mismatch` (changing nothing) if they do not fit; callers can then fall back
        to the default reset."""
        reason = self.error_feedback_mismatch(state)
        if reason is not None:
            raise ValueError(reason)
        if not state.get("buckets"):
            # Nothing had been compressed (one rank, or saved before the first compressed step): the saved error
            # feedback is all zero. Building the layouts here would also be wrong during warmup.
            self.compression.reset_error_feedback()
            return
        layouts = self._feedback_layouts(state)
        flats = {b.key: b.flat for b in self._ensure_buckets()}
        like = {key: flats[key[1] if isinstance(key, tuple) else key] for key in layouts}
        self.compression.load_error_feedback_state_dict(state, layouts, like)

    def _feedback_layouts(self, state: dict[str, Any]) -> dict[Hashable, BucketLayout]:
        """Error-feedback key -> bucket layout, for every bucket in every stream the saved ``state`` holds: a stream
        saved for other buckets than the current ones then shows as a mismatch."""
        layouts = self.bucket_layouts()
        try:
            streams = {stream_of(key) for key in state["buckets"]}
        except TypeError:
            streams = {"momentum"}
        return {feedback_key(stream, key): layout for stream in sorted(streams) for key, layout in layouts.items()}

    def reset_error_feedback(self) -> float:
        """Zero the compression error buffers; returns the L2 norm that was dropped."""
        return self.compression.reset_error_feedback()

    def _carry_error_feedback_(self, old_buckets: list[MomentumBucket], why: str) -> None:
        """The momentum buckets were re-laid out (``old_buckets`` is the layout the error feedback belongs to): build
        the new buckets and move every rank's error buffers into them, coordinate by coordinate
        (:func:`~lightning_onebit.optim.buckets.carry_error_feedback_`, a collective when there is error feedback:
        every rank calls it at the same point, as it does the bucket plan change). A parameter no longer in any
        bucket drops its error (counted in the log)."""
        name = type(self).__name__
        carried = carry_error_feedback_(self.compression, old_buckets, self._ensure_buckets)
        if carried is None:
            log.info("%s: momentum buckets re-laid out at step %d (%s); no error feedback to carry over", name,
                     self._step, why)
            return
        new_buckets, lost, stale = carried
        log.info(
            "%s: momentum buckets re-laid out at step %d (%s); error feedback carried over coordinate by coordinate "
            "(%d bucket(s) -> %d)%s",
            name,
            self._step,
            why,
            len(old_buckets),
            len(new_buckets),
            "".join([
                f"; dropped for {lost} parameter(s) no longer in the buckets" if lost else "",
                f"; {stale} buffer(s) of another layout dropped" if stale else "",
            ]),
        )
