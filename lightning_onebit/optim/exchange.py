"""The momentum exchange: starts, advances and finishes the compressed exchanges of momentum buckets.

It works on flat local tensors with a layout (:class:`~lightning_onebit.optim.buckets.MomentumBucket`: a DDP bucket
today), never on DDP or on whole parameters: a caller hands it a bucket and the work that fills it (folding this
step's gradients into the momenta), and it runs that work and the first launches of the bucket's exchange, on a side
stream when it runs during backward (CUDA), keeps the exchanges in flight in start order, advances them at the points
every rank reaches in the same order (the launch order is a function of the bucket schedule, the same on every rank),
and finishes them all at the optimizer's step. It times what it does: ``hook_s`` (work during backward) and
``exposed_s`` (the step's own exchange time), in the compression state's counters, with CUDA events on the stream
that does the work. It also checks, saves and restores the exchange's per-rank error feedback against the current
buckets.
"""

from __future__ import annotations

import contextlib
from typing import Any, Callable, Hashable, Iterator, Optional, Sequence

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
from lightning_onebit.optim.buckets import BucketSource, MomentumBucket, MomentumBuckets, feedback_key, stream_of
from lightning_onebit.optim.groups import compressed_trainable
from lightning_onebit.streams import stream_ops


class MomentumExchange:
    """The exchanges of one optimizer's momentum buckets over ``compression``'s process group.

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

    def start_bucket_(
        self,
        buckets: MomentumBuckets,
        source: BucketSource,
        key: int,
        params: Sequence[torch.Tensor],
        gradients: Sequence[torch.Tensor],
        clip_value: Optional[float],
        scales: dict[int, torch.Tensor],
    ) -> bool:
        """The optimizer's ``start_bucket_exchange_`` in the compression stage: fold one gradient bucket's local
        gradients into the momenta of momentum bucket ``key`` and start its exchange (:meth:`start_`), during backward.

        For a DDP communication hook (:func:`~lightning_onebit.overlapped_exchange_hook`): ``key`` is the momentum
        bucket (see the optimizer's ``set_bucket_plan``), ``params`` and ``gradients`` the gradient bucket's
        parameters and their gradients, in order (``GradBucket.parameters()`` and ``gradients()``). Parameters the
        optimizer does not train, and those of ``compress=False`` groups (their local gradients stay in ``.grad`` for
        the step to average in full precision), are skipped: they are in none of ``buckets``. ``clip_value`` (``None``:
        no clipping): first clamp the gradients to ``[-clip_value, clip_value]`` in place (clipping by value,
        elementwise, so it can happen per bucket). The folded momenta are multiplied by their ``scales``
        (:func:`scale_momenta_`). The next step then only folds the other buckets, finishes every
        exchange, decodes and applies (:meth:`finish_step_`), with the same bits as without the hook.

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
            for weight, indices in bucket.fold_groups:
                torch._foreach_lerp_(
                    [source.state[bucket.params[i]]["exp_avg"] for i in indices], [grads[i] for i in indices], weight
                )
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

    def finish_(self, started: Sequence[PendingExchange], rest: Sequence[MomentumBucket]) -> None:
        """Start the exchanges of the buckets ``rest`` (their momenta already filled), then finish those and
        ``started``: every buffer then holds the rank-identical compressed average."""
        items = [(b.key, b.flat, b.layout) for b in rest]
        check_buckets(self.compression, items)
        pending = list(started) + [
            start_exchange_(self.compression, key, flat, layout, checked=True) for key, flat, layout in items
        ]
        finish_exchanges_(self.compression, pending)

    def finish_step_(
        self,
        started: Sequence[PendingExchange],
        buckets: Sequence[MomentumBucket],
        source: BucketSource,
        scales: dict[int, torch.Tensor],
    ) -> None:
        """The step's part of the exchange of ``buckets`` (all of them, built for ``source``): fold the local gradients
        into the momenta of the buckets whose exchange did not start during backward (``started``, from
        :meth:`take_started`), multiply those momenta by their ``scales`` (:func:`scale_momenta_`), finish every
        exchange (:meth:`finish_`; this much is timed as ``exposed_s``), and divide every averaged momentum by its
        scale again. Raises ``RuntimeError`` if a started exchange's bucket is no longer among
        ``buckets`` (they were rebuilt)."""
        flats = {b.key: b.flat for b in buckets}
        if any(flats.get(p.key) is not p.buffer for p in started):
            raise RuntimeError(
                f"{source.name}: the momentum buckets changed while their exchange was in flight: the "
                "trainable parameters (requires_grad, a param group's compress, a new param group) changed between "
                "backward and optimizer.step(). Change them before the forward pass (in Lightning: e.g. in "
                "on_train_batch_start), or turn overlap off"
            )
        in_flight = {p.key for p in started}
        rest = [b for b in buckets if b.key not in in_flight]
        with self.exposed(buckets[0].flat.device if buckets else None):
            # Fold the local gradients into the momenta of the buckets whose exchange did not start during backward.
            # A parameter without a gradient folds a zero gradient (lerp towards 0), as the backward hook does for
            # DDP's zero-filled bucket entries, so that both paths give the same bits.
            folded = {id(q) for b in buckets if b.key in in_flight for q in b.params}
            for group in source.groups:
                grads, exp_avgs, decays = [], [], []
                for p in compressed_trainable(group):
                    if id(p) in folded:
                        continue
                    m = source.state[p]["exp_avg"]
                    (decays if p.grad is None else exp_avgs).append(m)
                    if p.grad is not None:
                        grads.append(p.grad)
                weight = 1 - group["betas"][0]
                if exp_avgs:
                    torch._foreach_lerp_(exp_avgs, grads, weight)
                if decays:
                    torch._foreach_lerp_(decays, [m.new_zeros(()).expand_as(m) for m in decays], weight)
            scale_momenta_(source.state, [q for b in rest for q in b.params], scales)
            self.finish_(started, rest)
        if scales:
            scaled = [q for b in buckets for q in b.params if id(q) in scales]
            torch._foreach_div_([source.state[q]["exp_avg"] for q in scaled], [scales[id(q)] for q in scaled])

    def average_(self, items: Sequence[tuple[Any, torch.Tensor, BucketLayout]]) -> None:
        """Replace each ``(error-feedback key, flat, layout)`` buffer by its error-compensated 1-bit average, in the
        step, buckets pipelined (:func:`~lightning_onebit.comm.compressed_allreduce_buckets_`)."""
        if items:
            with self._timed("exposed_s", items[0][1].device):
                compressed_allreduce_buckets_(self.compression, items)

    # ------------------------------------------------------------------ error feedback
    def feedback_mismatch(self, state: Any, layouts: Callable[[], dict[int, BucketLayout]]) -> Optional[str]:
        """Why ``state`` (the compression state's ``error_feedback_state_dict()``, possibly of another rank or run)
        cannot be restored here, or ``None`` if it can: the world size, the topology, the bucket layouts ``layouts()``
        returns (key -> layout; called only where ``state`` holds buffers) and the buffers' sizes and values. Changes
        nothing and does not communicate: whatever one rank finds, every rank's buckets stay as they were, so that
        ranks that go on to reset rather than restore take the same path through the next backward and step."""
        if not isinstance(state, dict):
            return f"the saved error feedback is a {type(state).__name__}, not a dict"
        if state.get("world_size") != self.compression.world_size():
            return (
                f"error feedback was saved with world size {state.get('world_size')}, "
                f"the current world size is {self.compression.world_size()}"
            )
        if not state.get("buckets"):
            return None  # nothing had been compressed: the saved error feedback is all zero
        return self.compression.error_feedback_mismatch(state, _feedback_layouts(state, layouts()))

    def load_feedback_(self, state: dict[str, Any], built: Callable[[], list[MomentumBucket]]) -> None:
        """Restore the error buffers of ``state`` into the buckets ``built()`` returns. Raises ``ValueError`` with
        the reason of :meth:`feedback_mismatch` (changing nothing) if they do not fit."""
        reason = self.feedback_mismatch(state, lambda: {b.key: b.layout for b in built()})
        if reason is not None:
            raise ValueError(reason)
        if not state.get("buckets"):
            # Nothing had been compressed (one rank, or saved before the first compressed step): the saved error
            # feedback is all zero. Building the layouts here would also be wrong during warmup.
            self.compression.reset_error_feedback()
            return
        buckets = built()
        layouts = _feedback_layouts(state, {b.key: b.layout for b in buckets})
        flats = {b.key: b.flat for b in buckets}
        like = {key: flats[key[1] if isinstance(key, tuple) else key] for key in layouts}
        self.compression.load_error_feedback_state_dict(state, layouts, like)

    @contextlib.contextmanager
    def exposed(self, device: Optional[torch.device]) -> Iterator[None]:
        """Count what runs inside as the step's exposed exchange time (``exposed_s``); nothing if ``device`` is
        ``None`` (no bucket)."""
        if device is None:
            yield
            return
        with self._timed("exposed_s", device):
            yield

    def _timed(self, field: str, device: torch.device) -> Any:
        return self.compression.timings.span(self.compression.counters, field, device)


def _feedback_layouts(state: dict[str, Any], layouts: dict[int, BucketLayout]) -> dict[Hashable, BucketLayout]:
    """Error-feedback key -> bucket layout, for every bucket of ``layouts`` (key -> layout) in every stream the saved
    ``state`` holds: a stream saved for other buckets than the current ones then shows as a mismatch."""
    try:
        streams = {stream_of(key) for key in state["buckets"]}
    except TypeError:
        streams = {"momentum"}
    return {feedback_key(stream, key): layout for stream in sorted(streams) for key, layout in layouts.items()}


def scale_momenta_(state: Any, params: Sequence[torch.Tensor], scales: dict[int, torch.Tensor]) -> None:
    """Multiply the folded momenta ``state[p]["exp_avg"]`` of those ``params`` that have a factor in ``scales`` (by
    ``id(param)``: a 0-dim tensor on the parameter's device) by it, before they are compressed;
    :meth:`MomentumExchange.finish_step_` divides the average by it again. 1-bit LAMB gives every tensor a similar
    magnitude inside a bucket this way (one sign per element, scales per segment); empty ``scales`` (1-bit Adam)
    change nothing."""
    if not scales:
        return
    scaled = [q for q in params if id(q) in scales]
    if scaled:
        torch._foreach_mul_([state[q]["exp_avg"] for q in scaled], [scales[id(q)] for q in scaled])
