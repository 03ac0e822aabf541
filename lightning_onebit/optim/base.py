"""The base of the compressed optimizers: the step and its stage, and the public interface over their parts, each an
attribute with a small interface: the momentum buckets and their exchange (``momentum_buckets``, ``exchange``) over the
compressed allreduce's state (``compression``), the checkpoint writer (``checkpoint``), the freeze detector
(``freezing``), the dead-coordinate masks (``masks``) and the sharded parameters' stand-ins (``shards``). The math is
:mod:`~lightning_onebit.optim.functional`'s; an algorithm's compressed step reads fold, exchange, mask, update."""

from __future__ import annotations

import collections
import logging
from typing import Any, Callable, Iterable, Optional, Sequence, Union

import torch
import torch.distributed as dist

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
from lightning_onebit.optim.checkpoint import CHECKPOINT_KEY, CheckpointWriter, state_family
from lightning_onebit.optim.error_feedback import feedback_mismatch, load_feedback_
from lightning_onebit.optim.freeze import FreezeControl, variance_reading
from lightning_onebit.optim.groups import average_gradients_, check_optimizer_options, check_param_group
from lightning_onebit.optim.masks import DeadCoordinateMasks, DeadCoordinates, set_exp_avg_mask
from lightning_onebit.optim.phases import OnebitStage, StepKind, phase_sentence
from lightning_onebit.optim.sharded import ShardedParams, is_sharded

log = logging.getLogger(__name__)

#: Default size of a compressed momentum bucket, MB (DDP's default bucket size).
DEFAULT_BUCKET_CAP_MB = 25.0


class CompressedOptimizer(torch.optim.Optimizer):
    """Base of the optimizers that average 1-bit compressed momenta after a full-precision warmup: the global step and
    the stage (:attr:`stage`, :attr:`needs_gradient_allreduce`), the momentum buckets and their exchange, the overlap
    with backward (:meth:`start_bucket_exchange_`), momentum masks (param-group option ``exp_avg_mask``), param groups
    kept out of compression (``compress=False``), dead coordinates and the checkpoint state. Param groups hold ``lr``,
    ``betas``, ``eps``, ``weight_decay``, ``bias_correction`` and ``compress``, checked when a group is added.

    A subclass passes its ``defaults`` and implements ``_warmup_step()`` (averaged gradients), ``_compressed_step()``
    (local gradients: fold, exchange, mask, update) and ``_full_precision_update_(groups)`` (its warmup update of
    these groups, with ``exp_avg_mask`` applied to the momentum: what ``compress=False`` groups take in the compression
    stage); the two steps may return the kind of step they took (:attr:`steps_by_kind`). See
    :class:`~lightning_onebit.OnebitAdam` for the arguments, which every subclass shares, and CONTRIBUTING.md.
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
        self.masks = DeadCoordinateMasks(dead_coordinates, name)
        # every param group is compressed unless it says compress=False (see _check_group)
        super().__init__(params, {**defaults, "compress": True})
        #: The last warmup step: an int, or ``None`` while ``freeze_step="auto"`` is still measuring.
        self.freeze_step: Optional[int] = None if freeze_step == "auto" else freeze_step
        self.freezing = FreezeControl((auto_freeze or AutoFreeze()) if freeze_step == "auto" else None, name)
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
        #: Steps this process took, by :class:`~lightning_onebit.optim.StepKind` (not saved in checkpoints).
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
        self.masks.kept = None  # and may hold dead coordinates

    @classmethod
    def _check_group(cls, group: dict[str, Any], index: int) -> None:
        check_param_group(group, index, cls.__name__)

    step_count = property(lambda self: self._step, doc="Optimizer steps taken so far (warmup and compressed).")

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

    needs_gradient_allreduce = property(lambda self: self.next_step_kind.averages_gradients, doc=(
        "Whether gradients of the next backward must be averaged across ranks (the next step's kind says so)."))
    #: Whether every rank holds the same parameters now (always, except between the synchronisations of an optimizer
    #: that takes local steps, :class:`~lightning_onebit.ZeroOneAdam`).
    replicas_in_sync = property(lambda self: True)

    def synchronize(self) -> bool:
        """Make the replicas identical now if they are not (:attr:`replicas_in_sync`): a collective when it acts, which
        every rank calls (the strategy does, before it saves a checkpoint); returns whether it communicated. Nothing
        to do here: the replicas are identical after every step."""
        return False

    def fit_schedule_to_run(self, total_steps: Optional[int]) -> Optional[str]:
        """Scale schedule arguments left to the run's length to ``total_steps`` optimizer steps (``None``: unknown; the
        strategies call it at the start of ``fit``); returns what was set, for the log. None here (see ZeroOneAdam)."""
        return None

    def describe_phase(self) -> tuple[StepKind, str]:
        """``(phase, sentence)``: the phase of the next step, named by the kind of step that characterises it, and what
        it does (:func:`~lightning_onebit.optim.phases.phase_sentence`); the strategy announces each new phase once."""
        return phase_sentence(
            type(self).__name__, self.stage is OnebitStage.WARMUP, self._step, self.freeze_step,
            self.freezing.detector, lambda: self._ensure_detector().rule(), bool(self._uncompressed_groups()),
        )

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
            self._backend_agreed = self.shards.exchange_group_checked = False

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

    #: Cumulative :class:`~lightning_onebit.comm.CommunicationCounters` of the compressed allreduce on this rank, and
    #: of the full-precision allreduce of ``compress=False`` groups (``bytes_sent_uncompressed``); not the warmup's. On
    #: CUDA the times count once their events completed (read back here without waiting).
    communication = property(lambda self: self.compression.settle_timings())

    def agree_kernel_backend(self) -> str:
        """Agree the kernel backend with every rank of :attr:`process_group` (a collective; see ``kernel_backend``).
        Returns the backend every rank now runs. Called at the first compressed step if nobody called it before."""
        self.compression.backend = agree_kernel_backend(self.kernel_backend, self.compression.process_group)
        self._backend_agreed = True
        return self.compression.backend

    @torch.no_grad()
    def step(self, closure: Optional[Callable[[], Any]] = None) -> Any:
        """One optimization step; warmup or compressed according to :attr:`stage`."""
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
            if loss is not None and self.freezing.observe_closure_loss:
                self.observe_loss(loss)
        if self.shards.pairs:  # gradients bound to the local shards; the exchange group checked before any collective
            self.shards.prepare_step_(self.compression.process_group)
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
            if self.freeze_step is None:  # freeze_step="auto": measure after this warmup step, maybe end it here
                self.freeze_step = self.freezing.after_warmup_step(
                    self._step, self.param_groups[0]["betas"][1], self._variance_reading, self.compression.rank())
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
        raise NotImplementedError  # the subclass's (see the class docstring), as the two below

    def _compressed_step(self) -> Optional[StepKind]:
        raise NotImplementedError

    def _full_precision_update_(self, groups: Sequence[dict[str, Any]]) -> None:
        raise NotImplementedError

    def _on_freeze(self) -> None:
        """Called once, after the last warmup step (fixed or decided ``freeze_step``)."""

    def _moment_state(self, p: torch.Tensor) -> dict[str, Any]:
        """``p``'s state with ``exp_avg`` and ``exp_avg_sq`` (zeros when new) for a step where ``p`` has a gradient
        and its variance is updated: from then on ``p`` is no longer frozen."""
        state = self.state[p]
        if "exp_avg_sq" not in state:
            if "exp_avg" not in state:  # else: a zero momentum view into a bucket built early
                state["exp_avg"] = torch.zeros_like(p, memory_format=torch.preserve_format)
            state["exp_avg_sq"] = torch.zeros_like(p, memory_format=torch.preserve_format)
            self.momentum_buckets.frozen.discard(id(p))
        return state

    def _uncompressed_groups(self) -> list[dict[str, Any]]:
        """The param groups with ``compress=False``."""
        return [group for group in self.param_groups if not group["compress"]]

    def _step_uncompressed_groups_(self, averaged: bool = False) -> None:
        """Compression stage: the ``compress=False`` groups' gradients averaged in full precision (unless ``averaged``
        by DDP already: 0/1 Adam's variance steps) and their warmup update."""
        groups = self._uncompressed_groups()
        if groups:
            if not averaged:
                average_gradients_(self.compression, groups)
            self._full_precision_update_(groups)

    def _begin_exchange(self) -> StepExchange:
        """The compressed step's exchange of the momenta (:class:`~lightning_onebit.optim.buckets.StepExchange`: the
        buckets, rebuilt if the trainable parameters changed, and those the overlap hook started; the caller folds the
        rest and finishes). Finds the dead coordinates and agrees the kernel backend at the first compressed step."""
        if self.masks.kept is None:  # the first compressed step (or the first after a load) finds them
            self.masks.find(self.param_groups, self.state, self.compression.rank())
        if not self._backend_agreed:
            self.agree_kernel_backend()
        return self.exchange.begin_step(self._ensure_buckets(carry=True), type(self).__name__)

    def _updated_params(self, group: dict[str, Any]) -> list[torch.Tensor]:
        """The group's compressed trainable parameters with a variance estimate: what a compressed step updates."""
        return [p for p in compressed_trainable(group) if id(p) not in self.momentum_buckets.frozen]

    def start_bucket_exchange_(self, key: int, params: Sequence[torch.Tensor], gradients: Sequence[torch.Tensor],
                               clip_value: Optional[float] = None) -> bool:
        """Fold one gradient bucket's local gradients into momentum bucket ``key``'s momenta and start its compressed
        exchange, during backward (:meth:`MomentumExchange.start_bucket_`, which says when it cannot: it returns
        whether it started; never in warmup). ``clip_value`` (``None``: no clipping): clamp the gradients first."""
        if self.stage is not OnebitStage.COMPRESSION:
            return False
        return self.exchange.start_bucket_(
            self.momentum_buckets, self._bucket_source(), key, params, gradients, clip_value, self._exchange_scale
        )

    def progress_exchanges(self) -> None:
        """Advance every exchange started during this backward (:meth:`MomentumExchange.progress`); the overlap hook
        calls it for a gradient bucket that started none, at the same point of the schedule on every rank."""
        self.exchange.progress()

    exchanges_in_flight = property(lambda self: self.exchange.in_flight,
                                   doc="Bucket exchanges started during backward and not yet finished by ``step``.")

    bucket_cap_bytes = property(lambda self: self.momentum_buckets.cap_bytes,
                                doc="The size a packed momentum bucket is filled to (``bucket_cap_mb``), bytes.")
    plan_version = property(lambda self: self.momentum_buckets.plan_version,
                            doc="Incremented whenever the installed bucket plan changes (set or loaded).")

    def set_bucket_plan(self, buckets: Optional[Sequence[Sequence[torch.Tensor]]]) -> bool:
        """Lay the momenta out in these buckets (lists of parameters: bucket ``i`` is ``buckets[i]``'s momenta, in that
        order, exchanged as one flat buffer), or with ``None`` pack them by ``bucket_cap_mb`` again; what a plan is and
        when it takes effect: :mod:`~lightning_onebit.optim.bucket_layout`. A collective when it re-lays out built
        buckets (call it on every rank). Returns whether the plan changed; ``ValueError`` for a bucket that mixes
        devices or dtypes or names a parameter twice. A sharded parameter may be named by its ``DTensor``."""
        if buckets is not None and self.shards.pairs:  # sharded parameters may be named by their DTensor
            buckets = [[self.shards.stand_in_of(p) for p in bucket] for bucket in buckets]
        return self.momentum_buckets.request_plan(
            buckets, self._bucket_source(), defer=self.exchange.in_flight > 0, install=self._install_plan
        )

    def _install_plan(self, plan: Plan) -> None:
        self.momentum_buckets.install_plan_(plan, self._bucket_source())

    bucket_plan = property(lambda self: self.momentum_buckets.planned_params(),
                           doc="The parameters of each planned momentum bucket (``set_bucket_plan``), or ``None``.")

    def bucket_layouts(self) -> dict[int, BucketLayout]:
        """Layouts of the compressed buckets (building them if needed); keys are bucket keys."""
        return {b.key: b.layout for b in self._ensure_buckets()}

    def _bucket_source(self) -> BucketSource:
        return BucketSource(self.param_groups, self.state, self.compression, type(self).__name__, self._step)

    def _ensure_buckets(self, carry: bool = False) -> list[MomentumBucket]:
        """The momentum buckets, built or rebuilt as needed (:meth:`MomentumBuckets.ensure`)."""
        return self.momentum_buckets.ensure(self._bucket_source(), carry)

    def set_exp_avg_mask(self, param: torch.Tensor, mask: Optional[torch.Tensor]) -> None:
        """Set (or with ``None`` clear) the momentum mask of one parameter from the next compressed step on
        (:func:`~lightning_onebit.optim.masks.set_exp_avg_mask`, which says what a mask may be). A sharded (``DTensor``)
        parameter takes a mask of its whole shape (this rank's part is kept) or of its local shard's shape."""
        set_exp_avg_mask(self.param_groups, *self.shards.localize_mask(param, mask), type(self).__name__)

    def dead_coordinates_masked_by(self, owner: str) -> None:
        """Declare that ``owner`` masks and reports every dead coordinate itself (``MomentumMask(auto=True)`` does),
        so that this optimizer does not warn about them."""
        self.masks.masked_by = owner
        log.debug("%s: dead coordinates are masked by %s", type(self).__name__, owner)

    auto_freeze = property(lambda self: self.freezing.config,
                           doc='The settings of ``freeze_step="auto"`` (``None`` with an integer ``freeze_step``).')
    dead_coordinates = property(lambda self: self.masks.policy, doc="See :class:`~lightning_onebit.OnebitAdam`.")

    def observe_loss(self, loss: Union[torch.Tensor, float]) -> None:
        """Record a training loss for ``freeze_step="auto"`` (its ``loss_drop`` guard), every step or micro-batch on
        every rank, before :meth:`step` (a ``closure`` passed to :meth:`step` is observed too; the Lightning strategy
        calls this from ``backward``). A scalar tensor is summed on its device: no host synchronisation per step."""
        if self.freezing.config is not None and self.freeze_step is None:
            self._ensure_detector().record_loss(loss)

    def observe_losses_from_caller(self) -> None:
        """Declare that the caller passes every training loss to :meth:`observe_loss` itself, so that the loss a
        ``closure`` given to :meth:`step` returns is not recorded a second time (the Lightning strategy does this)."""
        self.freezing.observe_closure_loss = False

    @property
    def freeze_detector(self) -> Optional[FreezeDetector]:
        """The measuring state of ``freeze_step="auto"`` (its figures, ``describe()``), ``None`` with an int."""
        return self._ensure_detector() if self.freezing.config is not None else None

    def _ensure_detector(self) -> FreezeDetector:
        return self.freezing.ensure(self.param_groups[0]["betas"][1])

    def _variance_reading(self) -> VarianceReading:
        """What the detector reads at a check (:func:`~lightning_onebit.optim.freeze.variance_reading`), agreed by
        every rank when the parameters are sharded (the ranks of a node must end their warmups together)."""
        return variance_reading(self.param_groups, self.state, self._step, self._settling_figures(),
                                None if self.shards.pairs else self.process_group, self._steps_capped())

    def _settling_figures(self) -> Optional[torch.Tensor]:
        """Per-tensor figures that must settle before an automatic freeze besides the variance (1-bit LAMB's)."""
        return None

    def _steps_capped(self) -> bool:
        """Whether no compressed step can be larger than a warmup step (``VarianceReading.steps_capped``)."""
        return False

    def state_dict(self) -> dict[str, Any]:
        """Torch's optimizer state plus ``"onebit"``: the global step, the freeze step, the optimizer that wrote it and
        the bucket plan (:class:`~lightning_onebit.optim.checkpoint.CheckpointWriter`). Not the masks and ``compress``
        (they come from the code) nor the error feedback (per rank: :meth:`error_feedback_state_dict`)."""
        return self.checkpoint.write(
            super().state_dict(), step=self._step, freeze_step=self.freeze_step, plan=self.momentum_buckets.plan,
            detector=self.freezing.detector, params=[p for group in self.param_groups for p in group["params"]])

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """Load a state dict from :meth:`state_dict` (or ``torch.optim.AdamW``'s: its per-parameter step); the stage
        follows the step, masks and ``compress`` stay the code's, the error feedback is reset (its dropped norm:
        :attr:`last_dropped_error_norm`). Another algorithm's state is read or refused as
        :meth:`CheckpointWriter.readable <lightning_onebit.optim.checkpoint.CheckpointWriter.readable>` says."""
        state_dict = self.checkpoint.readable(state_dict, warn=self.compression.rank() == 0)
        meta, code_groups = state_dict.pop(CHECKPOINT_KEY, None), self.param_groups
        super().load_state_dict(state_dict)
        # freeze_step='auto': the detector is kept, not made anew (the strategy may have set its max_step already)
        detector = self._ensure_detector() if self.auto_freeze is not None else None
        self._step, self.freeze_step, plan = self.checkpoint.restore_(meta, self.param_groups, code_groups, self.state,
                                                                      self.freeze_step, detector)
        self.momentum_buckets.load_plan(plan)
        self.masks.kept = None  # found again from the loaded variance
        self.last_dropped_error_norm = self.compression.reset_error_feedback()

    def error_feedback_state_dict(self) -> dict[str, Any]:
        """This rank's compression error buffers (worker and server, per bucket). Each rank must save its own."""
        return self.compression.error_feedback_state_dict()

    def error_feedback_mismatch(self, state: Any) -> Optional[str]:
        """Why ``state`` (from :meth:`error_feedback_state_dict`, possibly of another rank or run) cannot be restored
        here (the optimizer state must fit the parameters; then :func:`~lightning_onebit.optim.error_feedback.
        feedback_mismatch`), or ``None`` if it can. Changes nothing, no collective."""
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
