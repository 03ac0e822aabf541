"""The one place the exchange touches the CUDA stream runtime, as a replaceable object.

The overlapped exchange runs its folding and compression on a side stream, ordered against the stream that runs
backward; its timings are CUDA events. Everything else is plain tensor code that runs on any device. Keeping the
stream calls behind :class:`StreamOps` lets tests run the whole optimizer on tensors that only *claim* to be on
``cuda`` (``torch._subclasses.fake_tensor.FakeTensorMode`` on a CPU-only torch, which cannot create real streams or
events): they install :class:`SingleStream`, under which all work is issued on the current stream (a correct, merely
non-overlapped schedule), and check every op's device placement.
"""

from __future__ import annotations

import collections
import contextlib
import threading
import time
from typing import Any, Iterator, Optional, Union

import torch


class StreamOps:
    """Real CUDA streams: a side stream per device for work that should overlap the current stream.

    Non-CUDA devices have no streams: :meth:`side_stream` returns ``None`` and every other method accepts ``None``
    and does nothing, so callers need no device checks.
    """

    def __init__(self) -> None:
        self._side: dict[torch.device, Any] = {}

    def side_stream(self, device: torch.device) -> Optional["torch.cuda.Stream"]:
        """The side stream of ``device`` (created once), or ``None`` off CUDA."""
        if device.type != "cuda":
            return None
        stream = self._side.get(device)
        if stream is None:
            stream = self._side[device] = torch.cuda.Stream(device=device)
        return stream

    def wait_for_current(self, stream: Optional["torch.cuda.Stream"], device: torch.device) -> None:
        """Order ``stream`` after everything queued so far on ``device``'s current stream."""
        if stream is not None:
            stream.wait_stream(torch.cuda.current_stream(device))

    def current_waits_for(self, stream: Optional["torch.cuda.Stream"], device: torch.device) -> None:
        """Order ``device``'s current stream after everything queued so far on ``stream``."""
        if stream is not None:
            torch.cuda.current_stream(device).wait_stream(stream)

    def use(self, stream: Optional["torch.cuda.Stream"]) -> contextlib.AbstractContextManager:
        """Make ``stream`` current inside the block (nothing happens for ``None``)."""
        return torch.cuda.stream(stream) if stream is not None else contextlib.nullcontext()

    def record_event(self, device: torch.device, stream: Optional["torch.cuda.Stream"] = None) -> Optional[Any]:
        """A timing event recorded on ``stream`` (default: ``device``'s current stream); ``None`` off CUDA."""
        if device.type != "cuda":
            return None
        event = torch.cuda.Event(enable_timing=True)
        event.record(stream if stream is not None else torch.cuda.current_stream(device))
        return event


class SingleStream(StreamOps):
    """No side streams and no events: every launch goes to the current stream. For tests on fake CUDA tensors."""

    def side_stream(self, device: torch.device) -> None:
        return None

    def record_event(self, device: torch.device, stream: Optional[Any] = None) -> None:
        return None


_ops: StreamOps = StreamOps()


def stream_ops() -> StreamOps:
    """The stream operations in use (:class:`StreamOps` unless a test installed others)."""
    return _ops


@contextlib.contextmanager
def use_stream_ops(ops: StreamOps) -> Iterator[StreamOps]:
    """Install ``ops`` for the duration of the block (e.g. ``use_stream_ops(SingleStream())`` under fake CUDA)."""
    global _ops
    previous, _ops = _ops, ops
    try:
        yield ops
    finally:
        _ops = previous


class DeviceTimings:
    """Spans of device time, measured with CUDA events on the stream that does the work and added to a counter once
    both events have completed: read back lazily (``Event.query``, which never waits), never by stalling a stream.

    Off CUDA (or under :class:`SingleStream`) a span is host wall-clock time, added at once. At most ``bound`` spans
    wait to be read back: past it the oldest is settled, waiting for its end event if need be (a span that old has
    long completed, so in practice nothing waits). Thread-safe: DDP's future callbacks record from other threads.

    Args:
        bound: the most spans kept unread (default 256).
    """

    def __init__(self, bound: int = 256) -> None:
        self.bound = bound
        self._lock = threading.Lock()
        self._pending: collections.deque = collections.deque()  # (target, field, start event, end event)

    def mark(self, device: torch.device, stream: Optional[Any] = None) -> Union[float, Any]:
        """A point in time: a CUDA event recorded on ``stream`` (default: the current stream of ``device``), or host
        seconds off CUDA."""
        event = stream_ops().record_event(device, stream)
        return time.perf_counter() if event is None else event

    def add(self, target: Any, field: str, start: Union[float, Any], end: Union[float, Any]) -> None:
        """Add the time from mark ``start`` to mark ``end`` (seconds, at least 0) to ``target.field``: now for host
        marks, once ``end`` has completed for events."""
        if isinstance(start, float) and isinstance(end, float):
            with self._lock:
                setattr(target, field, getattr(target, field) + max(0.0, end - start))
            return
        with self._lock:
            self._pending.append((target, field, start, end))
            overflow = len(self._pending) > self.bound
        if overflow:
            self.settle(wait_for=len(self._pending) - self.bound)

    @contextlib.contextmanager
    def span(self, target: Any, field: str, device: torch.device, stream: Optional[Any] = None) -> Iterator[None]:
        """Time the block's work on ``stream`` (default: the current stream) into ``target.field``."""
        start = self.mark(device, stream)
        try:
            yield
        finally:
            self.add(target, field, start, self.mark(device, stream))

    def settle(self, wait_for: int = 0) -> None:
        """Add every completed span to its counter (waiting for the oldest ``wait_for`` ones if they have not)."""
        with self._lock:
            pending, self._pending = self._pending, collections.deque()
        kept = collections.deque()
        for i, (target, field, start, end) in enumerate(pending):
            if i < wait_for:
                start.synchronize()
                end.synchronize()
            elif not (end.query() and start.query()):  # two streams may be involved: both must have passed
                kept.append((target, field, start, end))
                continue
            with self._lock:
                setattr(target, field, getattr(target, field) + max(0.0, start.elapsed_time(end) / 1000.0))
        with self._lock:
            self._pending.extendleft(reversed(kept))

    @property
    def unsettled(self) -> int:
        """Spans not read back yet."""
        return len(self._pending)
