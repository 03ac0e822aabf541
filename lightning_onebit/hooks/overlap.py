"""A DDP communication hook that starts 1-bit Adam's momentum exchange bucket by bucket during backward, and the
marks and reasons that decide whether it may.

Like torch's ``ddp_zero_hook``, the hook's state holds DDP by weak reference (DDP -> reducer -> hook state -> DDP
would be a reference cycle keeping DDP and its process group alive until a garbage collection) and runs optimizer
work inside DDP's hook. Usable with plain DDP (see :class:`OverlapState`) and used by
:class:`lightning_onebit.OnebitStrategy`.
"""

# No `from __future__ import annotations`: DDP checks the hook's annotations as real objects.
import weakref
from typing import TYPE_CHECKING, Any, Callable, Optional, TypeVar

import torch
import torch.distributed as dist

from lightning_onebit.comm.accounting import CommunicationCounters
from lightning_onebit.hooks.gradient_sync import GradientSyncState, switchable_allreduce_hook

if TYPE_CHECKING:
    from lightning_onebit.optim import CompressedOptimizer


_F = TypeVar("_F", bound=Callable[..., Any])
_READ_ONLY_MARK = "_onebit_leaves_gradients_unchanged"


def leaves_gradients_unchanged(hook: _F) -> _F:
    """Mark a LightningModule or Callback hook (``on_after_backward``, ``on_before_optimizer_step``) as one that only
    reads gradients, so that it does not turn the overlapped exchange off.

    The overlapped exchange folds each gradient bucket into the momenta during backward, before these hooks run, so
    an edit of ``.grad`` there could not reach the momenta. ``OnebitStrategy(overlap="auto")`` therefore exchanges
    in ``optimizer.step`` whenever the LightningModule or a user callback overrides one of them (``overlap=True`` is
    then an error at setup), unless the override carries this mark::

        @leaves_gradients_unchanged
        def on_before_optimizer_step(self, optimizer):
            self.log_dict(grad_norm(self, norm_type=2))

    A marked hook that does change gradients (or ``requires_grad``) gives silently wrong results under overlap.
    """
    setattr(hook, _READ_ONLY_MARK, True)
    return hook


def is_marked_read_only(hook: Any) -> bool:
    """Whether ``hook`` (a function or bound method) carries :func:`leaves_gradients_unchanged`'s mark."""
    return bool(getattr(hook, _READ_ONLY_MARK, False))


class OverlapFallbackReason(str):
    """Why the momentum exchange is not overlapped with backward: the sentence the strategy logs (this string) and a
    stable :attr:`cause` to branch on (never the text): ``"manual_optimization"``, ``"grad_scaler"``,
    ``"clip_by_norm"``, ``"clipping_override"``, ``"gradient_hook"``, ``"static_graph_accumulation"``,
    ``"optimizer"`` (the optimizer's ``overlap_unsupported_reason``) or ``"custom"`` (a plain string from an
    override of ``OnebitStrategy.overlap_unsupported_reason``)."""

    cause: str

    def __new__(cls, cause: str, text: str) -> "OverlapFallbackReason":
        reason = super().__new__(cls, text)
        reason.cause = cause
        return reason

    def __reduce__(self) -> tuple[Any, ...]:
        return (OverlapFallbackReason, (self.cause, str(self)))

    @classmethod
    def of(cls, reason: Optional[str], cause: str = "custom") -> Optional["OverlapFallbackReason"]:
        """``reason`` as an :class:`OverlapFallbackReason` (a plain string gets ``cause``); ``None`` stays ``None``."""
        if reason is None or isinstance(reason, OverlapFallbackReason):
            return reason
        return cls(cause, reason)


class OverlapState:
    """State of :func:`overlapped_exchange_hook`: 1-bit Adam's exchange started bucket by bucket during backward.

    DDP calls a communication hook for each gradient bucket as soon as all its gradients are ready, in bucket order on
    every rank. In the compression stage the hook folds the bucket's local gradients into the matching momentum
    bucket (the optimizer lays its momenta out like DDP's buckets, :meth:`CompressedOptimizer.set_bucket_plan`),
    compresses it with error feedback and launches its first collective, all from the hook body (on a CUDA side
    stream); it also serves the previous bucket and launches its second phase, in a process group of its own, so the
    launch order is a function of the bucket schedule, the same on every rank.
    ``optimizer.step()`` then only finishes the exchanges, decodes and applies, with exactly the bits of the
    non-overlapped path. Warmup is DDP's allreduce, as with :func:`switchable_allreduce_hook`.

    Overlap starts once DDP's buckets are final (:attr:`ddp_buckets_final`: after DDP's first iteration, or two with
    ``static_graph``), from the second compressed step on (the first one lays the momenta out); until then, for
    any bucket the momentum layout does not match, and in a backward where the trainable parameters differ from those
    the momentum buckets were built for (``requires_grad`` switched since the last step: a layer frozen or unfrozen;
    read at the first bucket, before any collective, so the same on every rank), the hook leaves the gradients local
    and ``step`` does everything (rebuilding the buckets), as without overlap. Change ``requires_grad`` before the
    forward pass: a change between backward and ``step`` finds exchanges in flight and raises. Gradients
    are consumed as backward produces them: clipping by value can run in the hook (``clip_value``), but anything
    that changes gradients after backward (clipping by norm, a GradScaler's unscale and skip, a second backward pass
    before ``step``) cannot, so use :func:`switchable_allreduce_hook` there (the Lightning strategy decides this).

    Creating the state is a collective unless the optimizer already has its second-phase process groups (it then
    creates them, :meth:`CompressedAllreduceState.create_gather_groups`): every rank calls it. Usage::

        def train():
            ddp_model = DistributedDataParallel(model)
            optimizer = OnebitAdam(ddp_model.parameters(), lr=1e-3, freeze_step=1000)
            state = OverlapState(ddp_model, optimizer)
            ddp_model.register_comm_hook(state, overlapped_exchange_hook)
            for x, y in data:
                loss_fn(ddp_model(x), y).backward(); optimizer.step(); optimizer.zero_grad()

        dist.init_process_group("gloo")  # or "nccl"
        try:
            train()
        finally:
            dist.destroy_process_group()

    Tearing down: let the DDP module, the optimizer and this state go (here: ``train`` returns), then call
    ``dist.destroy_process_group()``, which destroys every process group, the second-phase groups included, before
    the interpreter exits. No ``gc.collect()`` is needed: the state holds the DDP module by weak reference (as torch's
    ZeRO hook does; DDP holds the state through its hook, so a strong reference would make a cycle), and nothing
    here refers back to the state, so all three are freed by reference counting when ``train`` returns, and the
    second-phase groups are then held by torch's registry alone, which ``destroy_process_group`` empties. Why it
    matters: ``destroy_process_group`` only unregisters a group, and a gloo group stops its threads when its last
    Python reference goes; if that happens during interpreter finalization (e.g. when the final garbage collection
    meets a cycle), a finished process can abort with "terminate called without an active exception" (SIGABRT).

    Args:
        ddp: the ``DistributedDataParallel`` module the hook is registered on, held by weak reference (its bucket
            rebuild is read from its private ``_has_rebuilt_buckets``, as torch's ZeRO hook does, see
            :attr:`ddp_buckets_final`).
        optimizer: the compressed optimizer (:class:`~lightning_onebit.OnebitAdam`) training ``ddp``'s parameters,
            over ``ddp``'s process group (set here).
        clip_value: clip each gradient element to ``[-clip_value, clip_value]`` before folding it (Lightning's
            ``gradient_clip_algorithm="value"``); ``None`` (default): no clipping.
        enabled: start exchanges in the hook; ``False`` makes this :func:`switchable_allreduce_hook` with the bucket
            plan still recorded (the momenta laid out like DDP's buckets). Can be switched between steps.
        gradient_sync: the :class:`GradientSyncState` of the warmup allreduce (its counters); default: a new one.

    Attributes:
        buckets_started: gradient buckets whose exchange the hook started (cumulative).
    """

    def __init__(
        self,
        ddp: "torch.nn.parallel.DistributedDataParallel",
        optimizer: "CompressedOptimizer",
        clip_value: Optional[float] = None,
        enabled: bool = True,
        gradient_sync: Optional[GradientSyncState] = None,
    ) -> None:
        missing = [a for a in ("_has_rebuilt_buckets", "find_unused_parameters", "static_graph") if not hasattr(ddp, a)]
        if missing:
            raise RuntimeError(
                f"this torch's DistributedDataParallel has no {', '.join(missing)} attribute(s), which the overlapped "
                "exchange reads to know when DDP's gradient buckets are final; turn overlap off"
            )
        if clip_value is not None and (isinstance(clip_value, bool) or not isinstance(clip_value, (int, float))
                                       or not clip_value >= 0):
            raise ValueError(f"clip_value must be a number >= 0 or None, got {clip_value!r}")
        if optimizer.overlap_unsupported_reason is not None:
            raise ValueError(f"OverlapState: {optimizer.overlap_unsupported_reason}; use switchable_allreduce_hook")
        optimizer.process_group = ddp.process_group
        self.gradient_sync = gradient_sync or GradientSyncState(topology=optimizer.topology)
        self.gradient_sync.process_group = ddp.process_group
        self.gradient_sync.sync_predicate = lambda: optimizer.needs_gradient_allreduce
        self._ddp = weakref.ref(ddp)  # DDP -> reducer -> hook state -> DDP would be a cycle
        self.optimizer = optimizer
        self.clip_value = clip_value
        self.enabled = enabled
        self.buckets_started = 0
        self._observed: list[list[torch.Tensor]] = []
        self._handed: list[list[torch.Tensor]] = []  # the layout last handed to the optimizer ...
        self._handed_version = -1  # ... and the optimizer's plan_version right after
        if enabled and not optimizer.compression.has_gather_groups:
            optimizer.compression.create_gather_groups()

    @property
    def ddp(self) -> "torch.nn.parallel.DistributedDataParallel":
        """The ``DistributedDataParallel`` module this state serves (held by weak reference)."""
        ddp = self._ddp()
        if ddp is None:
            raise RuntimeError(
                "OverlapState: its DistributedDataParallel module was freed; the state is held by weak reference to it "
                "and serves only the module it was made for"
            )
        return ddp

    @property
    def counters(self) -> CommunicationCounters:
        """The warmup allreduces' counters (``gradient_sync.counters``); the compressed exchange counts in
        ``optimizer.communication``."""
        return self.gradient_sync.counters

    @property
    def ddp_buckets_final(self) -> bool:
        """Whether DDP's gradient buckets have their final layout. DDP rebuilds them once, in gradient-ready order,
        in the forward after its first backward (second with ``static_graph``); with ``find_unused_parameters`` and
        no ``static_graph`` it never rebuilds, so the buckets it was built with are final."""
        ddp = self.ddp
        return bool(ddp._has_rebuilt_buckets) or (ddp.find_unused_parameters and not ddp.static_graph)

    def _observe(self, bucket: dist.GradBucket) -> None:
        """Record DDP's final bucket layout; at the last bucket, hand it to the optimizer as its momentum plan."""
        if not self.ddp_buckets_final:
            return
        index = bucket.index()
        if index == 0:
            self._observed = []
        if index != len(self._observed):  # a hook was skipped: do not trust this pass's record
            self._observed = []
            return
        self._observed.append(bucket.parameters())
        stale = self.optimizer.plan_version != self._handed_version  # e.g. a plan loaded from a checkpoint
        if bucket.is_last() and (stale or not _same_tensors(self._observed, self._handed)):
            # once per layout change, not every backward: set_bucket_plan re-derives the plan from scratch
            self.optimizer.set_bucket_plan(self._observed)
            self._handed, self._handed_version = self._observed, self.optimizer.plan_version


def _same_tensors(a: list[list[torch.Tensor]], b: list[list[torch.Tensor]]) -> bool:
    return len(a) == len(b) and all(len(x) == len(y) and all(p is q for p, q in zip(x, y)) for x, y in zip(a, b))


def overlapped_exchange_hook(state: OverlapState, bucket: dist.GradBucket) -> torch.futures.Future[torch.Tensor]:
    """DDP comm hook: warmup allreduce, then 1-bit Adam's compressed exchange started per bucket during backward.

    See :class:`OverlapState`. In the compression stage the returned future holds the local gradients (DDP's
    allreduce is off), as with :func:`switchable_allreduce_hook`.
    """
    if state.gradient_sync.sync_predicate():
        state._observe(bucket)
        return switchable_allreduce_hook(state.gradient_sync, bucket)
    started = False
    if state.enabled and state.ddp_buckets_final:
        started = state.optimizer.start_bucket_exchange_(
            bucket.index(), bucket.parameters(), bucket.gradients(), clip_value=state.clip_value
        )
        state.buckets_started += started
    if not started:
        state.optimizer.progress_exchanges()
    state._observe(bucket)
    state.gradient_sync.skipped_buckets += 1
    local = torch.futures.Future()
    local.set_result(bucket.buffer())
    return local


class ExchangeHookState:
    """State of :func:`exchange_hook`: the warmup allreduce's :class:`GradientSyncState`, and the overlapped
    exchange's :class:`OverlapState` once there is one (``None``: every bucket goes to
    :func:`switchable_allreduce_hook`).

    DDP takes one communication hook, registered before the optimizer exists; this state lets its owner (the Lightning
    strategy) register :func:`exchange_hook` then and hand it the overlapped exchange, or take it back, between fits.
    It holds no reference to its owner, so DDP (which keeps its hook state alive) holds no cycle through it."""

    __slots__ = ("gradient_sync", "overlap")

    def __init__(self, gradient_sync: GradientSyncState, overlap: Optional[OverlapState] = None) -> None:
        self.gradient_sync = gradient_sync
        self.overlap = overlap


def exchange_hook(state: ExchangeHookState, bucket: dist.GradBucket) -> torch.futures.Future[torch.Tensor]:
    """DDP comm hook: :func:`overlapped_exchange_hook` while ``state.overlap`` is set, else
    :func:`switchable_allreduce_hook` with ``state.gradient_sync``."""
    if state.overlap is not None:
        return overlapped_exchange_hook(state.overlap, bucket)
    return switchable_allreduce_hook(state.gradient_sync, bucket)
