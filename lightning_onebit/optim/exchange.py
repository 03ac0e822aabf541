"""The momentum exchange: starts, advances and finishes the compressed exchanges of momentum buckets.

It works on flat local tensors with a layout (:class:`~lightning_onebit.optim.buckets.MomentumBucket`: a DDP bucket
today), never on DDP or on whole parameters: a caller hands it a bucket and the work that fills it (folding this
step's gradients into the momenta), and it runs that work and the first launches of the bucket's exchange, on a side
stream when it runs during backward (CUDA), keeps the exchanges in flight in start order, advances them at the points
every rank reaches in the same order (the launch order is a function of the bucket schedule, the same on every rank),
and finishes them all at the optimizer's step. It times what it does: ``hook_s`` (work during backward) and
``exposed_s`` (the step's own exchange time), in the compression state's counters, with CUDA events on the stream
that does the work.
"""

from __future__ import annotations

import contextlib
from typing import Any, Callable, Iterator, Optional, Sequence

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
from lightning_onebit.optim.buckets import MomentumBucket
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

    def average_(self, items: Sequence[tuple[Any, torch.Tensor, BucketLayout]]) -> None:
        """Replace each ``(error-feedback key, flat, layout)`` buffer by its error-compensated 1-bit average, in the
        step, buckets pipelined (:func:`~lightning_onebit.comm.compressed_allreduce_buckets_`)."""
        if items:
            with self._timed("exposed_s", items[0][1].device):
                compressed_allreduce_buckets_(self.compression, items)

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
