"""The lean base of the compressed optimizers: the step and its stage, the dispatch to a subclass's warmup and
compressed steps, the freeze step, and the public entry points of what it delegates.

What it delegates, one module each: the momentum buckets and their layout (:mod:`~lightning_onebit.optim.buckets`),
their plan (:mod:`~lightning_onebit.optim.bucket_plan`), their compressed exchange and its error feedback
(:mod:`~lightning_onebit.optim.exchange`; carried over to a new layout by
:mod:`~lightning_onebit.optim.error_feedback`), masks and dead coordinates (:mod:`~lightning_onebit.optim.masks`),
param-group options (:mod:`~lightning_onebit.optim.groups`), the full-precision average of ``compress=False`` groups
(:mod:`~lightning_onebit.optim.uncompressed`), the checkpoint format (:mod:`~lightning_onebit.optim.checkpoint`), the
phase sentences (:mod:`~lightning_onebit.optim.phase`) and the update math (:mod:`~lightning_onebit.optim.functional`).
Three mixins give it the process group and topology (:mod:`~lightning_onebit.optim.process_group`), the measuring side
of ``freeze_step="auto"`` (:mod:`~lightning_onebit.optim.freeze`; the rule is
:mod:`~lightning_onebit.optim.auto_freeze`'s), and the parts its subclasses' steps are made of
(:mod:`~lightning_onebit.optim.step_parts`).

An algorithm is a subclass (:class:`~lightning_onebit.OnebitAdam`) that implements its warmup step and its
compressed step; the compressed step calls :meth:`CompressedOptimizer._average_momenta_` to turn every rank's local
momentum into the rank-identical compressed average, then applies its update.
"""

from __future__ import annotations

import collections
import enum
import logging
from typing import Any, Callable, Iterable, Optional, Sequence, Union, get_args

import torch
import torch.distributed as dist

from lightning_onebit import kernels
from lightning_onebit._checks import check_bucket_cap_mb
from lightning_onebit.comm.agreement import agree_kernel_backend
from lightning_onebit.comm.layout import BucketLayout
from lightning_onebit.comm.state import CompressedAllreduceState
from lightning_onebit.comm.topology import Topology
from lightning_onebit.kernels import Backend
from lightning_onebit.optim.auto_freeze_config import AutoFreeze
from lightning_onebit.optim.bucket_plan import Plan
from lightning_onebit.optim.buckets import BucketSource, MomentumBucket, MomentumBuckets
from lightning_onebit.optim.checkpoint import CheckpointMixin, state_family
from lightning_onebit.optim.exchange import MomentumExchange
from lightning_onebit.optim.freeze import AutoFreezeMixin, check_freeze_options
from lightning_onebit.optim.groups import check_param_group
from lightning_onebit.optim.masks import DeadCoordinates, set_exp_avg_mask
from lightning_onebit.optim.phase import phase_sentence
from lightning_onebit.optim.process_group import ProcessGroupMixin
from lightning_onebit.optim.sharded import ShardedParams, is_sharded
from lightning_onebit.optim.step_kind import StepKind
from lightning_onebit.optim.step_parts import StepPartsMixin

log = logging.getLogger(__name__)

#: Default size of a compressed momentum bucket, MB (DDP's default bucket size).
DEFAULT_BUCKET_CAP_MB = 25.0

class OnebitStage(str, enum.Enum):
    """The stage an optimizer step runs in."""

    WARMUP = "warmup"
    COMPRESSION = "compression"


class CompressedOptimizer(ProcessGroupMixin, AutoFreezeMixin, StepPartsMixin, CheckpointMixin, torch.optim.Optimizer):
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
    #: Why this optimizer cannot train sharded (``DTensor``, FSDP2) parameters (``None``: it can, see
    #: :mod:`~lightning_onebit.optim.sharded`).
    sharded_unsupported_reason: Optional[str] = None

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
        auto_freeze = check_freeze_options(freeze_step, auto_freeze, type(self).__name__)
        check_bucket_cap_mb(bucket_cap_mb, "bucket_cap_mb")
        if process_group is not None and not (dist.is_available() and isinstance(process_group, dist.ProcessGroup)):
            raise ValueError(
                f"process_group must be a torch.distributed.ProcessGroup or None (WORLD), got {process_group!r}"
            )
        if dead_coordinates not in get_args(DeadCoordinates):
            raise ValueError(
                f"dead_coordinates must be one of {get_args(DeadCoordinates)}, got {dead_coordinates!r}"
            )
        # which momenta share a bucket (packed by bucket_cap_mb, or as set_bucket_plan says) and the buckets; before
        # the param groups are added (add_param_group invalidates the buckets)
        self.momentum_buckets = MomentumBuckets(int(bucket_cap_mb * 2**20))
        # DTensor parameters (FSDP2 shards) and the plain tensors over their local shards that stand in for them
        self.shards = ShardedParams(type(self).__name__)
        self._exchange_group_checked = False
        # every param group is compressed unless it says compress=False (see _check_group)
        super().__init__(params, {**defaults, "compress": True})
        self._init_freeze(freeze_step, auto_freeze)  # freeze_step, auto_freeze and what measures it
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
        # id(param) -> factor (a 0-dim tensor on the parameter's device) its momentum is multiplied by for the
        # exchange and divided by after it (exchange.scale_momenta_); set by a subclass (1-bit LAMB's scaling
        # coefficients), empty for 1-bit Adam
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

    # ------------------------------------------------------------------ validation
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

    def fit_schedule_to_run(self, total_steps: Optional[int]) -> Optional[str]:
        """Scale schedule arguments left to the run's length to ``total_steps`` optimizer steps (``None``: unknown;
        the Lightning strategies call it at the start of ``fit``); returns what was set, for the log. Nothing here
        (see :meth:`ZeroOneAdam.fit_schedule_to_run`)."""
        return None

    def describe_phase(self) -> tuple[StepKind, str]:
        """``(phase, sentence)``: the phase the next step is in, named by the kind of step that characterises it, and
        a sentence for the log saying what it does (:func:`~lightning_onebit.optim.phase.phase_sentence`). The
        strategy announces each new phase once."""
        return phase_sentence(
            type(self).__name__, self.stage is OnebitStage.WARMUP, self._step, self.freeze_step, self._detector,
            lambda: self._ensure_detector().rule(), bool(self._uncompressed_groups()),
        )

    def _on_freeze(self) -> None:
        """Called once, after the last warmup step (fixed or decided ``freeze_step``)."""

    def _settling_figures(self) -> Optional[torch.Tensor]:
        """Other per-tensor figures that must settle before an automatic freeze (1-bit LAMB: its trust-ratio EMAs);
        ``None``: only the variance."""
        return None

    def _steps_capped(self) -> bool:
        """Whether no compressed step can be larger than a warmup step whatever the gradients do (see
        ``VarianceReading.steps_capped``): then an automatic freeze waits neither for the gradient excess nor for the
        largest tensor's settling figure."""
        return False

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
        if self.shards:
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
        if self.shards:
            self.shards.clear_gradients_(set_to_none)

    def _warmup_step(self) -> Optional[StepKind]:
        raise NotImplementedError

    def _compressed_step(self) -> Optional[StepKind]:
        raise NotImplementedError

    def _full_precision_update_(self, groups: Sequence[dict[str, Any]]) -> None:
        """The warmup update of these param groups on their (averaged) gradients, in the compression stage, with
        explicit ``exp_avg_mask`` applied to the momentum: what ``compress=False`` groups take."""
        raise NotImplementedError

    def dead_coordinates_masked_by(self, owner: str) -> None:
        """Declare that ``owner`` masks and reports every dead coordinate itself (``MomentumMask(auto=True)`` does),
        so that this optimizer does not warn about them."""
        self._dead_coordinates_masked_by = owner
        log.debug("%s: dead coordinates are masked by %s", type(self).__name__, owner)

    # ------------------------------------------------------------------ overlap with backward
    def start_bucket_exchange_(
        self,
        key: int,
        params: Sequence[torch.Tensor],
        gradients: Sequence[torch.Tensor],
        clip_value: Optional[float] = None,
    ) -> bool:
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
        """Lay the momenta out in these buckets (lists of parameters; bucket ``i`` is exchanged as one flat buffer of
        key ``i``), or with ``None`` pack them by ``bucket_cap_mb`` again. Saved in :meth:`state_dict`. A collective
        when it re-lays out buckets in the compression stage (call it on every rank); waits for the end of the next
        :meth:`step` while exchanges are in flight. Returns whether the plan changed; raises ``ValueError`` for a
        bucket that mixes devices or dtypes or names a parameter twice (:meth:`MomentumBuckets.request_plan`). A
        sharded (``DTensor``) parameter may be named by itself or by its stand-in (:attr:`shards`): its bucket holds
        its local shard."""
        if buckets is not None and self.shards:  # sharded parameters may be named by their DTensor
            buckets = [[self.shards.stand_in_of(p) for p in bucket] for bucket in buckets]
        return self.momentum_buckets.request_plan(
            buckets, self._bucket_source(), defer=self.exchange.in_flight > 0, install=self._install_plan
        )

    def _install_plan(self, plan: Plan) -> None:
        """Install ``plan`` now, re-laying out built buckets (:meth:`MomentumBuckets.install_plan_`)."""
        self.momentum_buckets.install_plan_(plan, self._bucket_source())

    @property
    def bucket_plan(self) -> Optional[list[list[torch.Tensor]]]:
        """The parameters of each planned momentum bucket (:meth:`set_bucket_plan`), or ``None``."""
        return self.momentum_buckets.planned_params()

    def _bucket_source(self) -> BucketSource:
        """What the buckets are built from, now (:class:`~lightning_onebit.optim.buckets.BucketSource`)."""
        return BucketSource(self.param_groups, self.state, self.compression, type(self).__name__, self._step)

    def _ensure_buckets(self, carry: bool = False) -> list[MomentumBucket]:
        """The momentum buckets, built or rebuilt if the compressed trainable parameters changed; ``carry=True``
        carries the error feedback over to a new layout, a collective (:meth:`MomentumBuckets.ensure`)."""
        return self.momentum_buckets.ensure(self._bucket_source(), carry)

    def _bucket_layouts_now(self) -> dict[int, BucketLayout]:
        """Layouts of the buckets as they are or would be built now, building none
        (:meth:`MomentumBuckets.layouts`)."""
        return self.momentum_buckets.layouts(self._bucket_source())

    def set_exp_avg_mask(self, param: torch.Tensor, mask: Optional[torch.Tensor]) -> None:
        """Set (or with ``None`` clear) the momentum mask of one parameter of this optimizer.

        ``mask`` must have exactly the parameter's shape, be bool or floating point and hold only 0 and 1 (see the
        class docstring); it is converted to the parameter's dtype and device and takes effect from the next compressed
        step. Raises ``ValueError`` naming the parameter if the mask is invalid or the optimizer does not hold it. A
        sharded (``DTensor``) parameter takes a mask of its whole shape (this rank's part is kept) or of its local
        shard's shape.
        """
        if self.shards and is_sharded(param):  # a sharded parameter's mask: whole, or already this rank's part
            if mask is not None and tuple(mask.shape) == tuple(param.shape):
                mask = self.shards.local_part(param, mask)
            param = self.shards.stand_in_of(param)
        set_exp_avg_mask(self.param_groups, param, mask, type(self).__name__)

    def bucket_layouts(self) -> dict[int, BucketLayout]:
        """Layouts of the compressed buckets (building them if needed); keys are bucket keys."""
        return {b.key: b.layout for b in self._ensure_buckets()}

    def _state_family(self) -> str:
        """The algorithm whose state this optimizer writes: the nearest class of this package in its MRO (a user's
        subclass of OnebitAdam writes OnebitAdam's state)."""
        return state_family(type(self), CompressedOptimizer)
