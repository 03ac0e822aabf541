"""The momentum buckets and their exchange, the two parts of a compressed optimizer every compressed step runs:
:class:`MomentumBuckets` (the bucket state: which compressed momenta share a bucket, the buckets built for it, and
when they must be built again; laying them out is :mod:`~lightning_onebit.optim.bucket_layout`'s, carrying their error
feedback over :mod:`~lightning_onebit.optim.error_feedback`'s) and :class:`MomentumExchange` (the exchange: started
during backward by the overlap hook, or in the step, :meth:`~MomentumExchange.begin_step`). Nothing here steps an
optimizer: the optimizer hands in a :class:`BucketSource` and folds and updates with
:mod:`~lightning_onebit.optim.functional`.
"""

from __future__ import annotations

import logging
from typing import Any, Callable, NamedTuple, Optional, Sequence

import torch

from lightning_onebit.comm.exchange import (
    PendingExchange,
    check_buckets,
    compressed_allreduce_buckets_,
    finish_exchanges_,
    progress_exchanges_,
    start_exchange_,
)
from lightning_onebit.comm.layout import BucketLayout
from lightning_onebit.comm.state import CompressedAllreduceState
from lightning_onebit.optim.bucket_layout import (
    MomentumBucket,
    Plan,
    build_buckets,
    checked_plan,
    layouts_of,
    pack,
    same_plan,
)
from lightning_onebit.optim.error_feedback import carry_error_feedback_, feedback_key, relayout_, stream_of
from lightning_onebit.optim.functional import fold_gradients_
from lightning_onebit.streams import stream_ops

# (MomentumBucket, Plan, checked_plan, same_plan, carry_error_feedback_, feedback_key and stream_of are defined in
# bucket_layout and error_feedback, and imported here too, where callers import them from)
__all__ = ["BucketSource", "MomentumBucket", "MomentumBuckets", "MomentumExchange", "Plan", "StepExchange",
           "carry_error_feedback_", "checked_plan", "compressed_trainable", "feedback_key", "same_plan", "stream_of",
           "trainable"]

log = logging.getLogger(__name__)


def trainable(group: dict[str, Any]) -> list[torch.Tensor]:
    """The param group's parameters that train (``requires_grad``)."""
    return [p for p in group["params"] if p.requires_grad]


def compressed_trainable(group: dict[str, Any]) -> list[torch.Tensor]:
    """The group's trainable parameters whose momenta the 1-bit exchange averages (none with ``compress=False``)."""
    return trainable(group) if group["compress"] else []


class BucketSource(NamedTuple):
    """What an optimizer's buckets are built from, taken when they are used (``load_state_dict`` replaces the
    optimizer's groups and state, so they are not kept): its param groups and per-parameter state (where the momenta
    live), its compression state (the world size, and the error feedback a re-layout carries over), and its class name
    and global step (for the log and the errors)."""

    groups: Sequence[dict[str, Any]]
    state: Any
    compression: CompressedAllreduceState
    name: str
    step: int

    def trainable(self) -> list[torch.Tensor]:
        """The compressed trainable parameters, in order (those of ``compress=False`` groups are not compressed)."""
        return [p for group in self.groups for p in compressed_trainable(group)]


class MomentumBuckets:
    """Which compressed momenta share a bucket, and the buckets built for it.

    Attributes:
        cap_bytes: the size a packed bucket is filled to (``bucket_cap_mb``), bytes.
        plan: the installed plan (:func:`~lightning_onebit.optim.bucket_layout.checked_plan`), or ``None`` (packed by
            ``cap_bytes``).
        plan_version: incremented whenever the installed plan changes (set or loaded); the overlap hook reads it to
            hand DDP's buckets again after a checkpoint brought another plan.
        deferred_plan: ``(plan,)`` asked for while exchanges were in flight, installed after the next step.
        built: the buckets, or ``None`` until built (and after anything that changes them).
        built_for: what ``built`` was made from (the plan as ids, the world size, the trainable ids): a rebuild is due
            when it changes (:meth:`fits`).
        by_key: ``built`` by bucket key.
        bucketed_ids: ids of the parameters in ``built``.
        frozen: ids of the compressed trainable parameters that had no variance estimate when ``built`` was made
            (never updated in warmup): the compression stage leaves them frozen; a warmup step that gives one a
            variance takes it out.
    """

    def __init__(self, cap_bytes: int) -> None:
        self.cap_bytes = cap_bytes
        self.plan: Plan = None
        self.plan_version = 0
        self.deferred_plan: Optional[tuple[Plan]] = None
        self.built: Optional[list[MomentumBucket]] = None
        self.built_for: Any = None
        self.by_key: dict[int, MomentumBucket] = {}
        self.bucketed_ids: set[int] = set()
        self.frozen: set[int] = set()

    def inputs(self, trainable: Sequence[torch.Tensor], world_size: int) -> Any:
        """What buckets over ``trainable`` and ``world_size`` are built from (host-only: no device access)."""
        plan = None if self.plan is None else [(key, [id(p) for p in params]) for key, params in self.plan]
        return plan, world_size, [id(p) for p in trainable]

    def fits(self, built_for: Any) -> bool:
        """Whether the built buckets are the ones for ``built_for`` (:meth:`inputs`)."""
        return self.built is not None and self.built_for == built_for

    def runs(self, trainable: Sequence[torch.Tensor], momentum: Callable[[torch.Tensor], torch.Tensor]
             ) -> list[tuple[int, list[torch.Tensor]]]:
        """``(key, parameters)`` per bucket for the installed plan and ``cap_bytes``
        (:func:`~lightning_onebit.optim.bucket_layout.pack`)."""
        return pack(trainable, momentum, self.plan, self.cap_bytes)

    def build(self, trainable: Sequence[torch.Tensor], state: Any, beta1: dict[int, float],
              world_size: int) -> list[MomentumBucket]:
        """Build the buckets over ``trainable`` for ``world_size`` ranks, the momenta becoming views of them
        (:func:`~lightning_onebit.optim.bucket_layout.build_buckets`; ``beta1[id(p)]``: ``p``'s param group's).
        Afterwards :meth:`fits` holds for ``inputs(trainable, world_size)``."""
        self.built_for = self.inputs(trainable, world_size)
        self.bucketed_ids = set(self.built_for[2])
        self.built = build_buckets(self.runs(trainable, lambda p: state[p]["exp_avg"]), state, beta1, world_size)
        self.by_key = {bucket.key: bucket for bucket in self.built}
        return self.built

    def layouts(self, source: BucketSource) -> dict[int, BucketLayout]:
        """Bucket key -> layout of the buckets :meth:`ensure` would use for ``source`` now: the built ones if they fit,
        else those it would build, computed without building them (nothing changes: no momentum moves, no state is
        made). What a check of saved error feedback compares against, which every rank must be able to make without
        changing what the next backward and step do."""
        trainable, world_size = source.trainable(), source.compression.world_size()
        if self.fits(self.inputs(trainable, world_size)):
            return {b.key: b.layout for b in self.built}
        state = source.state

        def momentum(p: torch.Tensor) -> torch.Tensor:  # ensure() gives a parameter without one zeros like it
            return (state[p] if p in state else {}).get("exp_avg", p)

        return layouts_of(self.runs(trainable, momentum), world_size)

    def built_empty(self, world_size: int) -> list[MomentumBucket]:
        """No compressed trainable parameter: no bucket."""
        self.built_for, self.bucketed_ids, self.by_key, self.built = self.inputs([], world_size), set(), {}, []
        return self.built

    # ------------------------------------------------------------------ the plan
    def planned_params(self) -> Optional[list[list[torch.Tensor]]]:
        """The parameters of each bucket of the installed plan, or ``None`` (packed by ``cap_bytes``)."""
        return None if self.plan is None else [list(params) for _, params in self.plan]

    def request_plan(self, buckets: Optional[Sequence[Sequence[torch.Tensor]]], source: BucketSource, *, defer: bool,
                     install: Callable[[Plan], None]) -> bool:
        """The optimizer's ``set_bucket_plan`` (whose docstring says what a plan is): the plan over ``source``'s
        compressed trainable parameters (:func:`~lightning_onebit.optim.bucket_layout.checked_plan`, which raises
        ``ValueError`` for a bad one). Nothing happens if it is the one installed, or waiting; otherwise, while
        exchanges are in flight (``defer``), it waits in :attr:`deferred_plan` for the end of the next step, else
        ``install`` installs it now (:meth:`install_plan_`). Returns whether the plan changed."""
        plan = checked_plan(buckets, {id(p) for p in source.trainable()})
        if same_plan(plan, self.deferred_plan[0] if self.deferred_plan is not None else self.plan):
            return False
        if defer:
            self.deferred_plan = (plan,)
        else:
            install(plan)
        return True

    def install_plan_(self, plan: Plan, source: BucketSource) -> None:
        """Install ``plan`` (unless it is installed already); buckets already built are re-laid out at once, with
        their error feedback carried over (:meth:`relayout_`, a collective when there is error feedback)."""
        if same_plan(plan, self.plan):
            return
        self.plan = plan
        self.plan_version += 1
        if self.built is not None:
            old, self.built = self.built, None
            self.relayout_(old, source, "new bucket plan" if plan is not None else "packed by bucket_cap_mb")

    def load_plan(self, plan: Plan) -> None:
        """Install a plan read from a checkpoint (``None``: packed by ``cap_bytes``), dropping a waiting one; the
        buckets are rebuilt at their next use, without error feedback to carry (a load resets it)."""
        self.plan, self.deferred_plan = plan, None
        self.plan_version += 1
        self.built = None

    # ------------------------------------------------------------------ the buckets
    def ensure(self, source: BucketSource, carry: bool = False) -> list[MomentumBucket]:
        """Pack momenta of the compressed trainable parameters into flat padded buckets (once per layout; rebuilt
        when that set changes, e.g. a group's ``compress`` or a ``requires_grad``); momenta become views.

        ``carry=True`` (the step's exchange paths, which every rank runs at the same step): a rebuild carries the
        error feedback of the parameters that stay over to the new layout (:meth:`relayout_`, a collective), so
        freezing one layer does not reset the error of the others. Other callers (e.g. the optimizer's
        ``bucket_layouts``, which one rank may call alone) never start a collective here."""
        trainable = source.trainable()
        built_for = self.inputs(trainable, source.compression.world_size())
        if self.fits(built_for):
            return self.built
        if carry and self.built is not None:
            old, self.built = self.built, None
            self.relayout_(old, source, "the compressed trainable parameters changed")
            # without error feedback to carry, nothing was built yet
            return self.built if self.built is not None else self.ensure(source)
        if not trainable:
            return self.built_empty(built_for[1])
        self.frozen = set()
        never_updated = []
        for p in trainable:
            state = source.state[p]
            if "exp_avg_sq" not in state:
                # No variance estimate: frozen. It gets no exp_avg_sq, so it is recognised again whenever the
                # buckets are rebuilt (after load_state_dict, a process-group change).
                if "exp_avg" not in state:
                    state["exp_avg"] = torch.zeros_like(p)
                self.frozen.add(id(p))
                never_updated.append(tuple(p.shape))
        if never_updated:
            log.warning("%s: %d parameter(s) had no gradient during warmup (shapes %s); without a variance estimate "
                        "they stay frozen in the compression stage. Mask or exclude them, or lengthen warmup.",
                        source.name, len(never_updated), never_updated[:8])
        beta1 = {id(p): group["betas"][0] for group in source.groups for p in compressed_trainable(group)}
        built = self.build(trainable, source.state, beta1, built_for[1])
        log.info("%s: momentum buckets laid out at step %d: %d trainable tensors in %d bucket(s) over %d rank(s)%s",
                 source.name, source.step, len(trainable), len(built), built_for[1],
                 " (laid out like DDP's gradient buckets)" if self.plan is not None else "")
        return built

    def relayout_(self, old_buckets: list[MomentumBucket], source: BucketSource, why: str) -> None:
        """Build the buckets anew with every rank's error buffers moved into them from ``old_buckets``
        (:func:`~lightning_onebit.optim.error_feedback.relayout_`, a collective when there is error feedback)."""
        relayout_(source.compression, old_buckets, lambda: self.ensure(source), source.name, source.step, why)


class StepExchange:
    """One step's part of the exchange of the compressed momenta (:meth:`MomentumExchange.begin_step`): which momenta
    the step still folds itself (:meth:`unfolded`: those whose exchange did not start during backward), then every
    exchange finished (:meth:`finish_`). From its start to the end of :meth:`finish_` is the step's ``exposed_s``."""

    def __init__(self, exchange: MomentumExchange, buckets: Sequence[MomentumBucket],
                 started: Sequence[PendingExchange]) -> None:
        self.exchange, self.buckets, self.started = exchange, buckets, started
        in_flight = {p.key for p in started}
        self.folded = {id(q) for b in buckets if b.key in in_flight for q in b.params}  # folded during backward
        self.rest = [b for b in buckets if b.key not in in_flight]
        self.device = buckets[0].flat.device if buckets else None
        self.began = exchange.compression.timings.mark(self.device) if self.device is not None else None

    def unfolded(self, group: dict[str, Any]) -> list[torch.Tensor]:
        """The group's compressed trainable parameters whose momenta this step folds (the overlap hook folded the
        others during backward)."""
        return [p for p in compressed_trainable(group) if id(p) not in self.folded]

    def finish_(self, state: Any, scales: Optional[dict[int, torch.Tensor]] = None) -> None:
        """Start the exchanges of the buckets not started during backward and finish every exchange: each bucket's
        momenta (``state[p]["exp_avg"]``) then hold the rank-identical 1-bit average. ``scales``
        (``id(param) -> 0-dim tensor``, 1-bit LAMB's scaling coefficients): the folded momenta are multiplied by them
        for the exchange (those started during backward were, in the hook) and divided by them after."""
        scale_momenta_(state, [q for b in self.rest for q in b.params], scales)
        self.exchange.finish_(self.started, self.rest)
        if scales:
            scaled = [q for b in self.buckets for q in b.params if id(q) in scales]
            torch._foreach_div_([state[q]["exp_avg"] for q in scaled], [scales[id(q)] for q in scaled])
        if self.began is not None:
            timings = self.exchange.compression.timings
            timings.add(self.exchange.compression.counters, "exposed_s", self.began, timings.mark(self.device))


class MomentumExchange:
    """The exchanges of one optimizer's momentum buckets over ``compression``'s process group.

    It works on flat local tensors with a layout (:class:`~lightning_onebit.optim.bucket_layout.MomentumBucket`),
    never on DDP or on whole parameters: a caller hands it a bucket and the work that fills it (folding this step's
    gradients into the momenta), and it runs that work and the first launches of the bucket's exchange, on a side
    stream when it runs during backward (CUDA), keeps the exchanges in flight in start order, advances them at the
    points every rank reaches in the same order (the launch order is a function of the bucket schedule, the same on
    every rank), and finishes them all at the optimizer's step. It times what it does: ``hook_s`` (work during
    backward) and ``exposed_s`` (the step's own exchange time), in the compression state's counters, with CUDA events
    on the stream that does the work.

    Attributes:
        compression: the compressed allreduce's state (process group, topology, error feedback, counters).
        side_stream: CUDA: the stream the work started during backward runs on (``None`` until then, and off CUDA).
    """

    def __init__(self, compression: CompressedAllreduceState) -> None:
        self.compression = compression
        self.side_stream: Optional[Any] = None
        self._pending: list[PendingExchange] = []  # started during backward, in start order
        self._pending_by_key: dict[int, PendingExchange] = {}

    @property
    def in_flight(self) -> int:
        """Exchanges started during backward and not yet finished."""
        return len(self._pending)

    def started(self, key: int) -> bool:
        """Whether bucket ``key``'s exchange was started since the last :meth:`finish_`."""
        return key in self._pending_by_key

    def start_(self, bucket: MomentumBucket, fill: Callable[[], None]) -> None:
        """Run ``fill`` (what makes ``bucket.flat`` this step's momenta: folding the gradients in) and start the
        bucket's exchange, during backward: on the side stream (CUDA), after the work queued so far on the current
        one, so that it overlaps the backward kernels still to come; then advance the exchanges in flight."""
        ops, device = stream_ops(), bucket.flat.device
        stream = self.side_stream = ops.side_stream(device)
        ops.wait_for_current(stream, device)
        with ops.use(stream), self._timed("hook_s", device):
            fill()
            pending = start_exchange_(self.compression, bucket.key, bucket.flat, bucket.layout)
            self._pending.append(pending)
            self._pending_by_key[bucket.key] = pending
            progress_exchanges_(self.compression, self._pending)

    def start_bucket_(self, buckets: MomentumBuckets, source: BucketSource, key: int, params: Sequence[torch.Tensor],
                      gradients: Sequence[torch.Tensor], clip_value: Optional[float],
                      scales: dict[int, torch.Tensor]) -> bool:
        """The optimizer's ``start_bucket_exchange_`` in the compression stage: fold one gradient bucket's local
        gradients into the momenta of momentum bucket ``key`` and start its exchange (:meth:`start_`), during backward.

        For a DDP communication hook (:func:`~lightning_onebit.overlapped_exchange_hook`): ``params`` and
        ``gradients`` are the gradient bucket's parameters and their gradients, in order. Parameters in none of
        ``buckets`` (not trained, or in ``compress=False`` groups, whose local gradients stay in ``.grad`` for the step
        to average in full precision) are skipped. ``clip_value`` (``None``: no clipping): first clamp the gradients to
        ``[-clip_value, clip_value]`` in place (elementwise, so it can happen per bucket). The folded momenta are
        multiplied by their ``scales`` (:func:`scale_momenta_`). The step then folds only the other buckets and
        finishes every exchange (:meth:`begin_step`), with the same bits as without the hook.

        Returns ``False``, doing nothing, where it cannot start: before the first compressed step built the buckets,
        while a plan waits for the end of the step, when the trainable parameters changed since the buckets were built
        (``requires_grad`` switched: then for every bucket of this backward, and the next step rebuilds them and
        exchanges everything), or when bucket ``key`` does not hold exactly these parameters (the plan changed). Every
        rank must get the same answer (true for DDP's buckets, which rank 0 decides). Raises ``RuntimeError`` if the
        bucket's exchange was already started since the last step (a second backward pass before ``step``).
        """
        if buckets.built is None or buckets.deferred_plan is not None:
            return False
        if not self.in_flight and (
            buckets.inputs(source.trainable(), self.compression.world_size()) != buckets.built_for
        ):
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
        if self.started(key):
            raise RuntimeError(
                f"{source.name}: gradient bucket {key} was ready twice before optimizer.step(): a second "
                "backward pass ran while its momentum exchange was in flight. The overlapped exchange needs exactly "
                "one backward pass with gradient sync per step: use no_sync() for the other micro-batches, or turn "
                "overlap off"
            )
        grads = [gradients[i] for i in chosen]
        if clip_value is not None:
            torch._foreach_clamp_min_(grads, -clip_value)
            torch._foreach_clamp_max_(grads, clip_value)

        def fold() -> None:
            for beta1, indices in bucket.fold_groups:
                fold_gradients_([source.state[bucket.params[i]]["exp_avg"] for i in indices],
                                [grads[i] for i in indices], beta1)
            scale_momenta_(source.state, bucket.params, scales)

        self.start_(bucket, fold)
        return True

    def progress(self) -> None:
        """Advance every exchange in flight to its last launch (serve it and launch its second phase;
        :func:`~lightning_onebit.comm.progress_exchanges_`), on the side stream like every other launch during
        backward (the exchanges share its kernel workspace). Harmless at any time."""
        if self._pending:
            device = self._pending[0].buffer.device
            ops = stream_ops()
            ops.wait_for_current(self.side_stream, device)
            with ops.use(self.side_stream), self._timed("hook_s", device):
                progress_exchanges_(self.compression, self._pending, keep_newest=False)

    def join_side_stream(self) -> None:
        """Make the current stream wait for the work queued on the side stream (CUDA): the step reads the folded
        momenta and the kernel workspace from here on."""
        if self._pending:
            stream_ops().current_waits_for(self.side_stream, self._pending[0].buffer.device)

    def take_started(self) -> list[PendingExchange]:
        """The exchanges started during backward, handed to the caller (which finishes them with :meth:`finish_`)."""
        pending, self._pending, self._pending_by_key = self._pending, [], {}
        return pending

    def begin_step(self, buckets: Sequence[MomentumBucket], owner: str) -> StepExchange:
        """The step's part of the exchange of ``buckets`` (all of them): the exchanges started during backward taken
        over (:meth:`take_started`), and what the step still folds and finishes (:class:`StepExchange`). Raises
        ``RuntimeError`` if a started exchange's bucket is no longer among ``buckets`` (they were rebuilt: the
        trainable parameters of the optimizer ``owner`` changed between backward and ``step``)."""
        started = self.take_started()
        flats = {b.key: b.flat for b in buckets}
        if any(flats.get(p.key) is not p.buffer for p in started):
            raise RuntimeError(
                f"{owner}: the momentum buckets changed while their exchange was in flight: the trainable parameters "
                "(requires_grad, a param group's compress, a new param group) changed between backward and "
                "optimizer.step(). Change them before the forward pass (in Lightning: e.g. in on_train_batch_start), "
                "or turn overlap off"
            )
        return StepExchange(self, buckets, started)

    def finish_(self, started: Sequence[PendingExchange], rest: Sequence[MomentumBucket]) -> None:
        """Start the exchanges of the buckets ``rest`` (their momenta already filled), then finish those and
        ``started``: every buffer then holds the rank-identical compressed average."""
        items = [(b.key, b.flat, b.layout) for b in rest]
        check_buckets(self.compression, items)
        pending = list(started) + [
            start_exchange_(self.compression, key, flat, layout, checked=True) for key, flat, layout in items
        ]
        finish_exchanges_(self.compression, pending)

    def average_(self, items: Sequence[tuple[Any, torch.Tensor, BucketLayout]]) -> None:
        """Replace each ``(error-feedback key, flat, layout)`` buffer by its error-compensated 1-bit average, in the
        step, buckets pipelined (:func:`~lightning_onebit.comm.compressed_allreduce_buckets_`); timed as
        ``exposed_s``."""
        if items:
            with self._timed("exposed_s", items[0][1].device):
                compressed_allreduce_buckets_(self.compression, items)

    def _timed(self, field: str, device: torch.device) -> Any:
        return self.compression.timings.span(self.compression.counters, field, device)


def scale_momenta_(state: Any, params: Sequence[torch.Tensor], scales: Optional[dict[int, torch.Tensor]]) -> None:
    """Multiply the folded momenta ``state[p]["exp_avg"]`` of those ``params`` that have a factor in ``scales`` (by
    ``id(param)``: a 0-dim tensor on the parameter's device) by it, before they are compressed;
    :meth:`StepExchange.finish_` divides the average by it again. 1-bit LAMB gives every tensor a similar magnitude
    inside a bucket this way (one sign per element, scales per segment); empty ``scales`` change nothing."""
    if not scales:
        return
    scaled = [q for q in params if id(q) in scales]
    if scaled:
        torch._foreach_mul_([state[q]["exp_avg"] for q in scaled], [scales[id(q)] for q in scaled])
