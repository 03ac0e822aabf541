"""The base of the compressed optimizers: their parts, the step and its stage, and the public interface.

A compressed optimizer *has* parts, each an attribute with a small public interface: the momentum buckets and their
exchange (:attr:`~CompressedOptimizer.momentum_buckets`, :attr:`~CompressedOptimizer.exchange`,
:mod:`~lightning_onebit.optim.buckets`) over the compressed allreduce's state (:attr:`~CompressedOptimizer.compression`),
the checkpoint writer (:attr:`~CompressedOptimizer.checkpoint`, :mod:`~lightning_onebit.optim.checkpoint`), the freeze
detector of ``freeze_step="auto"`` (:attr:`~CompressedOptimizer.freeze_detector`,
:mod:`~lightning_onebit.optim.auto_freeze`) and the sharded parameters' stand-ins (:attr:`~CompressedOptimizer.shards`,
:mod:`~lightning_onebit.optim.sharded`). The math is :mod:`~lightning_onebit.optim.functional`'s.

An algorithm is a subclass (:class:`~lightning_onebit.OnebitAdam`) whose compressed step reads top-down: fold the
local gradients into the momenta, exchange them (:meth:`CompressedOptimizer._begin_exchange`), mask, update.
"""

from __future__ import annotations

import collections
import logging
from typing import Any, Callable, Iterable, Optional, Sequence, Union

import torch
import torch.distributed as dist

from lightning_onebit import kernels
from lightning_onebit.comm.accounting import CommunicationCounters
from lightning_onebit.comm.agreement import agree_kernel_backend
from lightning_onebit.comm.layout import BucketLayout
from lightning_onebit.comm.state import CompressedAllreduceState
from lightning_onebit.comm.topology import Topology
from lightning_onebit.kernels import Backend
from lightning_onebit.optim.auto_freeze import FreezeDetector, VarianceReading
from lightning_onebit.optim.auto_freeze_config import AutoFreeze
from lightning_onebit.optim.bucket_layout import Plan
from lightning_onebit.optim.buckets import BucketSource, MomentumBucket, MomentumBuckets, MomentumExchange
from lightning_onebit.optim.buckets import StepExchange, compressed_trainable
from lightning_onebit.optim.checkpoint import CHECKPOINT_KEY, CheckpointWriter, keep_code_options_, loaded_step
from lightning_onebit.optim.checkpoint import restored_freeze_step, state_family
from lightning_onebit.optim.error_feedback import feedback_mismatch, load_feedback_
from lightning_onebit.optim.freeze import log_decision, variance_reading
from lightning_onebit.optim.functional import adamw_step_, mask_like
from lightning_onebit.optim.groups import average_gradients_, check_optimizer_options, check_param_group
from lightning_onebit.optim.masks import DeadCoordinates, set_exp_avg_mask, warn_zero_variance
from lightning_onebit.optim.masks import zero_variance_coordinates
from lightning_onebit.optim.phases import OnebitStage, StepKind, phase_sentence
from lightning_onebit.optim.sharded import ShardedParams, is_sharded

log = logging.getLogger(__name__)

#: Default size of a compressed momentum bucket, MB (DDP's default bucket size).
DEFAULT_BUCKET_CAP_MB = 25.0


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
    (local gradients: fold, exchange, mask, update) and ``_full_precision_update_(groups)`` (its warmup update of the
    given groups, on averaged gradients, with ``exp_avg_mask`` applied to the momentum: what ``compress=False``
    groups take in the compression stage, after :meth:`_step_uncompressed_groups_` averaged their gradients);
    ``_warmup_step`` and ``_compressed_step`` may return the kind of step they took (see :attr:`steps_by_kind`). See
    :class:`~lightning_onebit.OnebitAdam` for the arguments, which every subclass shares.
    """

    #: Why this optimizer's exchange cannot start during backward (``None``: it can, see
    #: :meth:`start_bucket_exchange_`). The strategy's ``overlap="auto"`` falls back with this reason.
    overlap_unsupported_reason: Optional[str] = None
    #: Whether the optimizer itself keeps coordinates with an exactly-zero variance at rest (their momentum is zeroed),
    #: instead of relying on masks fixed at the end of warmup (:class:`~lightning_onebit.MomentumMask`'s ``auto``).
    masks_zero_variance: bool = False
    #: Why this optimizer cannot train sharded (``DTensor``, FSDP2) parameters (``None``: it can).
    sharded_unsupported_reason: Optional[str] = None
    #: What :class:`~lightning_onebit.CommunicationMonitor`'s advice adds about the steps of this optimizer that it
    #: does not time (``None``: it times every compressed step).
    advisor_note: Optional[str] = None
    #: The algorithms whose optimizer state this one can continue from (see :meth:`load_state_dict`);
    #: ``"torch.optim"``: a torch optimizer's state dict (e.g. AdamW's: its moments and step).
    _continues_state_of: tuple[str, ...] = ("OnebitAdam", "ZeroOneAdam", "torch.optim")

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
        dead_coordinates: DeadCoordinates = "mask",
    ) -> None:
        name = type(self).__name__
        auto_freeze = check_optimizer_options(name, freeze_step, auto_freeze, bucket_cap_mb, process_group, topology,
                                              dead_coordinates, kernel_backend)
        # parts made before the param groups are added (add_param_group invalidates the buckets)
        self.momentum_buckets = MomentumBuckets(int(bucket_cap_mb * 2**20))
        # DTensor parameters (FSDP2 shards) and the plain tensors over their local shards that stand in for them
        self.shards = ShardedParams(name)
        self._exchange_group_checked = False
        # every param group is compressed unless it says compress=False (see _check_group)
        super().__init__(params, {**defaults, "compress": True})
        #: The last warmup step: an int, or ``None`` while ``freeze_step="auto"`` is still measuring.
        self.freeze_step: Optional[int] = None if freeze_step == "auto" else freeze_step
        self.auto_freeze = (auto_freeze or AutoFreeze()) if freeze_step == "auto" else None
        self._detector: Optional[FreezeDetector] = None  # made at first use (it needs the first group's beta2)
        self._observe_closure_loss = True  # whether step(closure) records the closure's loss
        self.kernel_backend = kernel_backend
        self.compression = CompressedAllreduceState(process_group, kernel_backend, topology)
        self._backend_agreed = False
        self._step = 0
        # the buckets' compressed exchanges: started during backward (the overlap hook) or in step
        self.exchange = MomentumExchange(self.compression)
        self.checkpoint = CheckpointWriter(name, state_family(type(self), CompressedOptimizer),
                                           self._continues_state_of)
        # id(param) -> factor (a 0-dim tensor) its momentum is multiplied by for the exchange and divided by after it;
        # set by a subclass (1-bit LAMB's scaling coefficients), empty for 1-bit Adam
        self._exchange_scale: dict[int, torch.Tensor] = {}
        self.last_dropped_error_norm: Optional[float] = None
        self.dead_coordinates = dead_coordinates
        self._dead_coordinates_masked_by: Optional[str] = None  # a callback that masks and reports them itself
        # id(param) -> v == 0 of the compressed groups' dead coordinates, found at the first compressed step after
        # construction or a load (None until then), kept at rest with dead_coordinates="mask"
        self._zero_variance: Optional[dict[int, torch.Tensor]] = None
        #: Steps this process took, by :class:`~lightning_onebit.optim.StepKind`: ``WARMUP`` and ``COMPRESSED``;
        #: :class:`~lightning_onebit.ZeroOneAdam` takes ``VARIANCE``, ``COMPRESSED``, ``LOCAL`` and ``SYNC`` steps.
        #: Not saved in checkpoints.
        self.steps_by_kind: collections.Counter[StepKind] = collections.Counter()
        self.last_step_kind: Optional[StepKind] = None  # the kind of the latest step

    def add_param_group(self, param_group: dict[str, Any]) -> None:
        """Add a param group (see the class docstring for its options). An invalid group raises ``ValueError`` naming
        the option and the group, and is not added."""
        params = param_group["params"]
        params = [params] if isinstance(params, torch.Tensor) else list(params)
        if self.sharded_unsupported_reason is not None and any(is_sharded(p) for p in params):
            raise ValueError(f"{type(self).__name__} cannot train sharded (DTensor) parameters yet: "
                             f"{self.sharded_unsupported_reason}")
        super().add_param_group({**param_group, "params": self.shards.localize(params)})
        try:
            self._check_group(self.param_groups[-1], len(self.param_groups) - 1)
        except ValueError:
            self.param_groups.pop()
            raise
        self.momentum_buckets.built = None  # a new group changes the bucket layout
        self._zero_variance = None  # and may hold dead coordinates

    @classmethod
    def _check_group(cls, group: dict[str, Any], index: int) -> None:
        check_param_group(group, index, cls.__name__)

    # ------------------------------------------------------------------ status
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

    def fit_schedule_to_run(self, total_steps: Optional[int]) -> Optional[str]:
        """Scale schedule arguments left to the run's length to ``total_steps`` optimizer steps (``None``: unknown;
        the Lightning strategies call it at the start of ``fit``); returns what was set, for the log. Nothing here
        (see :meth:`ZeroOneAdam.fit_schedule_to_run`)."""
        return None

    def describe_phase(self) -> tuple[StepKind, str]:
        """``(phase, sentence)``: the phase the next step is in, named by the kind of step that characterises it, and
        a sentence for the log saying what it does (:func:`~lightning_onebit.optim.phases.phase_sentence`). The
        strategy announces each new phase once."""
        return phase_sentence(
            type(self).__name__, self.stage is OnebitStage.WARMUP, self._step, self.freeze_step, self._detector,
            lambda: self._ensure_detector().rule(), bool(self._uncompressed_groups()),
        )

    # ------------------------------------------------------------------ where the exchange runs
    @property
    def process_group(self) -> Optional[dist.ProcessGroup]:
        """The process group the momenta are averaged over (``None``: the default group). Setting another one resets
        the error feedback, rebuilds the buckets at their next use and agrees the kernel backend again."""
        return self.compression.process_group

    @process_group.setter
    def process_group(self, group: Optional[dist.ProcessGroup]) -> None:
        if group is not self.compression.process_group:
            self.compression.process_group = group
            self.compression.reset_error_feedback()
            self.momentum_buckets.built = None
            self._backend_agreed = self._exchange_group_checked = False

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

    @property
    def communication(self) -> CommunicationCounters:
        """Cumulative counters of the compressed allreduce on this rank, and of the full-precision allreduce of
        ``compress=False`` groups (``bytes_sent_uncompressed``); the warmup gradient sync is not included. On CUDA
        the times count once their events completed (read back here without waiting)."""
        return self.compression.settle_timings()

    def agree_kernel_backend(self) -> str:
        """Agree the kernel backend with every rank of :attr:`process_group` (a collective; see ``kernel_backend``).
        Returns the backend every rank now runs. Called at the first compressed step if nobody called it before."""
        self.compression.backend = agree_kernel_backend(self.kernel_backend, self.compression.process_group)
        self._backend_agreed = True
        return self.compression.backend

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
        if self.shards.pairs:
            if not self._exchange_group_checked:  # before any collective of this step
                self.shards.check_exchange_group(self.compression.process_group)
                self._exchange_group_checked = True
            self.shards.bind_gradients_()
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

    def zero_grad(self, set_to_none: bool = True) -> None:
        """As ``torch.optim.Optimizer.zero_grad``; sharded parameters' ``DTensor`` gradients are cleared too."""
        super().zero_grad(set_to_none)
        self.shards.clear_gradients_(set_to_none)

    def _warmup_step(self) -> Optional[StepKind]:
        raise NotImplementedError

    def _compressed_step(self) -> Optional[StepKind]:
        raise NotImplementedError

    def _full_precision_update_(self, groups: Sequence[dict[str, Any]]) -> None:
        """The warmup update of these param groups on their (averaged) gradients, in the compression stage, with
        explicit ``exp_avg_mask`` applied to the momentum: what ``compress=False`` groups take."""
        raise NotImplementedError

    def _on_freeze(self) -> None:
        """Called once, after the last warmup step (fixed or decided ``freeze_step``)."""

    # ------------------------------------------------------------------ what the algorithms' steps are made of
    def _moment_state(self, p: torch.Tensor) -> dict[str, Any]:
        """``p``'s state with ``exp_avg`` and ``exp_avg_sq`` (zeros when new), for a warmup step where ``p`` has a
        gradient; from then on ``p`` has a variance estimate and is no longer frozen."""
        state = self.state[p]
        if "exp_avg_sq" not in state:
            if "exp_avg" not in state:  # else: a zero momentum view into a bucket built early
                state["exp_avg"] = torch.zeros_like(p, memory_format=torch.preserve_format)
            state["exp_avg_sq"] = torch.zeros_like(p, memory_format=torch.preserve_format)
            self.momentum_buckets.frozen.discard(id(p))
        return state

    def _adamw_step_(self, t: int, groups: Optional[Sequence[dict[str, Any]]] = None,
                     compression_stage: bool = False) -> None:
        """Step ``t`` of :class:`torch.optim.AdamW` (:func:`~lightning_onebit.optim.functional.adamw_step_`) on the
        (averaged) gradients of the parameters of ``groups`` (default all) that have one: the Adam-based optimizers'
        warmup, and their ``compress=False`` groups in the compression stage (``compression_stage=True``), where
        explicit ``exp_avg_mask`` multiply the momentum after the gradient is folded in."""
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
            if params:
                adamw_step_(group, params, grads, exp_avgs, exp_avg_sqs, t, masks)

    def _uncompressed_groups(self) -> list[dict[str, Any]]:
        """The param groups with ``compress=False``."""
        return [group for group in self.param_groups if not group["compress"]]

    def _step_uncompressed_groups_(self, averaged: bool = False) -> None:
        """Compression stage: average the gradients of the ``compress=False`` groups in full precision (unless
        ``averaged``: DDP's allreduce already did, e.g. 0/1 Adam's variance steps;
        :func:`~lightning_onebit.optim.groups.average_gradients_`) and take their warmup update."""
        groups = self._uncompressed_groups()
        if groups:
            if not averaged:
                average_gradients_(self.compression, groups)
            self._full_precision_update_(groups)

    def _begin_exchange(self) -> StepExchange:
        """The compressed step's exchange of the momenta (:class:`~lightning_onebit.optim.buckets.StepExchange`):
        the buckets (rebuilt, their error feedback carried over, if the trainable parameters changed) and those the
        overlap hook folded and started during backward; the caller folds the rest (``unfolded``) and finishes
        (``finish_``). Finds the dead coordinates (:attr:`dead_coordinates`) and agrees the kernel backend at the first
        compressed step."""
        if self._zero_variance is None:
            self._zero_variance = self._find_zero_variance()
        if not self._backend_agreed:
            self.agree_kernel_backend()
        return self.exchange.begin_step(self._ensure_buckets(carry=True), type(self).__name__)

    def _find_zero_variance(self) -> dict[int, torch.Tensor]:
        """The dead coordinates to keep at rest from now on (``v == 0`` with the variance frozen; see
        ``dead_coordinates`` of :class:`~lightning_onebit.OnebitAdam`), reported on rank 0 unless ``'ignore'`` or a
        callback masks them (:meth:`dead_coordinates_masked_by`)."""
        if self.dead_coordinates == "ignore":
            return {}
        zero_variance, report = zero_variance_coordinates(self.param_groups, self.state)
        masked = self.dead_coordinates == "mask"
        if report and self._dead_coordinates_masked_by is None and self.compression.rank() == 0:
            warn_zero_variance(report, type(self).__name__, masked)
        return zero_variance if masked else {}

    def _updated_params(self, group: dict[str, Any]) -> list[torch.Tensor]:
        """The group's parameters a compressed step updates: trainable ones with a variance estimate; none in a
        ``compress=False`` group (:meth:`_step_uncompressed_groups_` updates those)."""
        return [p for p in compressed_trainable(group) if id(p) not in self.momentum_buckets.frozen]

    # ------------------------------------------------------------------ overlap with backward
    def start_bucket_exchange_(self, key: int, params: Sequence[torch.Tensor], gradients: Sequence[torch.Tensor],
                               clip_value: Optional[float] = None) -> bool:
        """Fold one bucket's local gradients into its momenta and start its compressed exchange, during backward (for
        a DDP communication hook, :func:`~lightning_onebit.overlapped_exchange_hook`). ``key``: the momentum bucket
        (:meth:`set_bucket_plan`); ``params``, ``gradients``: the gradient bucket's, in order; ``clip_value`` (default
        ``None``: no clipping): clamp the gradients to ``[-clip_value, clip_value]`` first. Returns whether it started
        (``False`` in warmup, and where the buckets do not fit: :meth:`MomentumExchange.start_bucket_`); raises
        ``RuntimeError`` on a second backward pass before :meth:`step`."""
        if self.stage is not OnebitStage.COMPRESSION:
            return False
        return self.exchange.start_bucket_(
            self.momentum_buckets, self._bucket_source(), key, params, gradients, clip_value, self._exchange_scale
        )

    def progress_exchanges(self) -> None:
        """Advance every exchange started during this backward to its last launch (:meth:`MomentumExchange.progress`).
        The overlap hook calls it for a gradient bucket that started no exchange, which every rank does at the same
        point of the bucket schedule. Harmless at any time."""
        self.exchange.progress()

    @property
    def exchanges_in_flight(self) -> int:
        """Bucket exchanges started during backward and not yet finished by :meth:`step`."""
        return self.exchange.in_flight

    # ------------------------------------------------------------------ buckets and masks
    @property
    def bucket_cap_bytes(self) -> int:
        """The size a packed momentum bucket is filled to (``bucket_cap_mb``), bytes."""
        return self.momentum_buckets.cap_bytes

    @property
    def plan_version(self) -> int:
        """Incremented whenever the installed bucket plan changes (set or loaded)."""
        return self.momentum_buckets.plan_version

    def set_bucket_plan(self, buckets: Optional[Sequence[Sequence[torch.Tensor]]]) -> bool:
        """Lay the momenta out in these buckets (lists of parameters; bucket ``i`` holds ``buckets[i]``'s momenta, in
        that order, exchanged as one flat buffer of key ``i``), or with ``None`` pack them by ``bucket_cap_mb`` again.
        The overlap hook passes DDP's gradient buckets, so that a bucket can be folded and exchanged as soon as its
        gradients are ready. Parameters not trained or in ``compress=False`` groups are skipped; trained compressed
        ones no bucket names are packed by ``bucket_cap_mb`` after them. Saved in :meth:`state_dict` (the error
        feedback belongs to the layout). A collective when it re-lays out buckets in the compression stage (call it
        on every rank: the error feedback is carried over coordinate by coordinate); waits for the end of the next
        :meth:`step` while exchanges are in flight. Returns whether the plan changed; raises ``ValueError`` for a
        bucket that mixes devices or dtypes or names a parameter twice. A sharded (``DTensor``) parameter may be named
        by itself or by its stand-in (:attr:`shards`): its bucket holds its local shard."""
        if buckets is not None and self.shards.pairs:  # sharded parameters may be named by their DTensor
            buckets = [[self.shards.stand_in_of(p) for p in bucket] for bucket in buckets]
        return self.momentum_buckets.request_plan(
            buckets, self._bucket_source(), defer=self.exchange.in_flight > 0, install=self._install_plan
        )

    def _install_plan(self, plan: Plan) -> None:
        self.momentum_buckets.install_plan_(plan, self._bucket_source())

    @property
    def bucket_plan(self) -> Optional[list[list[torch.Tensor]]]:
        """The parameters of each planned momentum bucket (:meth:`set_bucket_plan`), or ``None``."""
        return self.momentum_buckets.planned_params()

    def bucket_layouts(self) -> dict[int, BucketLayout]:
        """Layouts of the compressed buckets (building them if needed); keys are bucket keys."""
        return {b.key: b.layout for b in self._ensure_buckets()}

    def _bucket_source(self) -> BucketSource:
        return BucketSource(self.param_groups, self.state, self.compression, type(self).__name__, self._step)

    def _ensure_buckets(self, carry: bool = False) -> list[MomentumBucket]:
        """The momentum buckets, built or rebuilt if the compressed trainable parameters changed; ``carry=True``
        carries the error feedback over to a new layout, a collective (:meth:`MomentumBuckets.ensure`)."""
        return self.momentum_buckets.ensure(self._bucket_source(), carry)

    def set_exp_avg_mask(self, param: torch.Tensor, mask: Optional[torch.Tensor]) -> None:
        """Set (or with ``None`` clear) the momentum mask of one parameter of this optimizer: a tensor of exactly the
        parameter's shape, bool or floating point, holding only 0 and 1 (see the class docstring), converted to the
        parameter's dtype and device, from the next compressed step on. ``ValueError`` naming the parameter if the
        mask is invalid or the optimizer does not hold it. A sharded (``DTensor``) parameter takes a mask of its whole
        shape (this rank's part is kept) or of its local shard's shape."""
        if self.shards.pairs and is_sharded(param):  # a sharded parameter's mask: whole, or already this rank's part
            if mask is not None and tuple(mask.shape) == tuple(param.shape):
                mask = self.shards.local_part(param, mask)
            param = self.shards.stand_in_of(param)
        set_exp_avg_mask(self.param_groups, param, mask, type(self).__name__)

    def dead_coordinates_masked_by(self, owner: str) -> None:
        """Declare that ``owner`` masks and reports every dead coordinate itself (``MomentumMask(auto=True)`` does),
        so that this optimizer does not warn about them."""
        self._dead_coordinates_masked_by = owner
        log.debug("%s: dead coordinates are masked by %s", type(self).__name__, owner)

    # ------------------------------------------------------------------ freeze_step="auto"
    def observe_loss(self, loss: Union[torch.Tensor, float]) -> None:
        """Record a training loss for ``freeze_step="auto"``, whose :class:`~lightning_onebit.AutoFreeze` ``loss_drop``
        guard waits for the loss to leave its initial plateau. Call it every step (or micro-batch) on every rank,
        before :meth:`step`; a ``closure`` passed to :meth:`step` is observed too. The Lightning strategy calls it
        from its ``backward``. A scalar tensor is summed on its device and read once per check: no host
        synchronisation per step. Does nothing once the freeze step is known, or with an integer ``freeze_step``."""
        if self.auto_freeze is not None and self.freeze_step is None:
            self._ensure_detector().record_loss(loss)

    def observe_losses_from_caller(self) -> None:
        """Declare that the caller passes every training loss to :meth:`observe_loss` itself, so that the loss a
        ``closure`` given to :meth:`step` returns is not recorded a second time (the Lightning strategy does this)."""
        self._observe_closure_loss = False

    @property
    def freeze_detector(self) -> Optional[FreezeDetector]:
        """The measuring state of ``freeze_step="auto"`` (its figures, ``describe()``), ``None`` with an int."""
        return self._ensure_detector() if self.auto_freeze is not None else None

    def _ensure_detector(self) -> FreezeDetector:
        if self._detector is None:
            assert self.auto_freeze is not None
            self._detector = FreezeDetector(self.auto_freeze, self.param_groups[0]["betas"][1], type(self).__name__)
        return self._detector

    def _observe_variance(self) -> None:
        """freeze_step='auto': measure after this warmup step; end the warmup here if the detector says so."""
        detector = self._ensure_detector()
        decided = detector.observe(self._step, self._variance_reading)
        if decided is not None:
            self.freeze_step = decided
            if self.compression.rank() == 0:
                log_decision(type(self).__name__, detector, decided)

    def _variance_reading(self) -> VarianceReading:
        """What the detector reads at a check (:func:`~lightning_onebit.optim.freeze.variance_reading`), agreed by
        every rank when the parameters are sharded (each measures its own shard: the ranks of a node must end their
        warmups together), else by the process group."""
        return variance_reading(self.param_groups, self.state, self._step, self._settling_figures(),
                                None if self.shards.pairs else self.process_group, self._steps_capped())

    def _settling_figures(self) -> Optional[torch.Tensor]:
        """Other per-tensor figures that must settle before an automatic freeze (1-bit LAMB: its trust-ratio EMAs);
        ``None``: only the variance."""
        return None

    def _steps_capped(self) -> bool:
        """Whether no compressed step can be larger than a warmup step whatever the gradients do (see
        ``VarianceReading.steps_capped``)."""
        return False

    # ------------------------------------------------------------------ checkpoints
    def state_dict(self) -> dict[str, Any]:
        """Torch's optimizer state plus ``"onebit"`` (:class:`~lightning_onebit.optim.checkpoint.CheckpointWriter`):
        the global step, the freeze step, the optimizer that wrote it and the momentum bucket plan (as parameter
        indices). Masks, the groups' ``compress`` and the error feedback are not included (masks and ``compress`` come
        from the code; the error feedback is per rank: :meth:`error_feedback_state_dict`)."""
        return self.checkpoint.write(
            super().state_dict(), step=self._step, freeze_step=self.freeze_step, plan=self.momentum_buckets.plan,
            detector=self._detector if self.auto_freeze is not None else None, params=self._all_params(),
        )

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """Load a state dict from :meth:`state_dict` (or from ``torch.optim.AdamW``: the step is then taken from its
        per-parameter ``step``). The stage is re-derived from the step; masks and each group's ``compress`` stay those
        of the code (the buckets are rebuilt); the error feedback is reset, its dropped norm kept in
        :attr:`last_dropped_error_norm`. Another algorithm's state this one cannot continue from (1-bit LAMB's and the
        Adam family's, either way) raises ``ValueError`` naming both, changing nothing; OnebitAdam's and ZeroOneAdam's
        continue each other with a warning (the Adam moments and the step carry over)."""
        state_dict = self.checkpoint.readable(state_dict, warn=self.compression.rank() == 0)
        meta = state_dict.pop(CHECKPOINT_KEY, None)
        code_groups = self.param_groups
        super().load_state_dict(state_dict)
        keep_code_options_(self.param_groups, code_groups)
        self._step = loaded_step(meta, self.state)
        if meta is not None:
            # freeze_step='auto': the detector is kept, not made anew (the strategy may have set its max_step already)
            detector = self._ensure_detector() if self.auto_freeze is not None else None
            self.freeze_step = restored_freeze_step(meta, self._step, self.freeze_step, detector, type(self).__name__)
        self.momentum_buckets.load_plan(self.checkpoint.plan(meta, self._all_params()))
        self._zero_variance = None  # found again from the loaded variance
        for state in self.state.values():
            state.pop("step", None)  # AdamW's per-parameter step; this optimizer keeps one global step
        self.last_dropped_error_norm = self.compression.reset_error_feedback()

    def _all_params(self) -> list[torch.Tensor]:
        """Every parameter of every param group, in order (how checkpoints index them)."""
        return [p for group in self.param_groups for p in group["params"]]

    def error_feedback_state_dict(self) -> dict[str, Any]:
        """This rank's compression error buffers (worker and server, per bucket). Each rank must save its own."""
        return self.compression.error_feedback_state_dict()

    def error_feedback_mismatch(self, state: Any) -> Optional[str]:
        """Why ``state`` (from :meth:`error_feedback_state_dict`, possibly of another rank or run) cannot be restored
        here, or ``None`` if it can: the optimizer state must fit the parameters, then the world size, the topology,
        the bucket layouts (those the buckets have or would have: none is built here) and the buffers' sizes and
        values (:func:`~lightning_onebit.optim.error_feedback.feedback_mismatch`). Changes nothing, no collective."""
        return self.checkpoint.shape_mismatch(self.param_groups, self.state) or feedback_mismatch(
            self.compression, state, lambda: self.momentum_buckets.layouts(self._bucket_source()))

    def load_error_feedback_state_dict(self, state: dict[str, Any]) -> None:
        """Restore buffers from :meth:`error_feedback_state_dict` of the same rank. Raises ``ValueError`` with the
        reason of :meth:`error_feedback_mismatch` (changing nothing) if they do not fit."""
        reason = self.checkpoint.shape_mismatch(self.param_groups, self.state)
        if reason is not None:
            raise ValueError(reason)
        load_feedback_(self.compression, state, self._ensure_buckets)

    def reset_error_feedback(self) -> float:
        """Zero the compression error buffers; returns the L2 norm that was dropped."""
        return self.compression.reset_error_feedback()
