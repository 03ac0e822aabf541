"""``lightning_onebit.streams``: the stream seam and the lazily read, bounded device timings (with stand-in events,
so that the logic is checked without a GPU)."""

from __future__ import annotations

import types

import torch

from lightning_onebit.streams import DeviceTimings, SingleStream, StreamOps, stream_ops, use_stream_ops


class StubEvent:
    """A CUDA event stand-in: completes when told to; ``elapsed_time`` in ms from the stub clock."""

    clock_ms = 0.0
    waits = 0

    def __init__(self) -> None:
        self.at_ms = StubEvent.clock_ms
        self.complete = False

    def query(self) -> bool:
        return self.complete

    def synchronize(self) -> None:
        StubEvent.waits += 1
        self.complete = True

    def elapsed_time(self, end: "StubEvent") -> float:
        assert self.complete and end.complete, "elapsed_time before both events completed"
        return end.at_ms - self.at_ms


class StubStreams(SingleStream):
    def __init__(self) -> None:
        super().__init__()
        self.events: list[StubEvent] = []

    def record_event(self, device, stream=None):
        self.events.append(StubEvent())
        return self.events[-1]


def test_host_spans_are_added_at_once():
    counters = types.SimpleNamespace(time_s=0.0)
    timings = DeviceTimings()
    with timings.span(counters, "time_s", torch.device("cpu")):
        sum(range(10000))
    assert counters.time_s > 0 and timings.unsettled == 0


def test_event_spans_are_read_back_only_once_complete_and_never_waited_for():
    counters = types.SimpleNamespace(time_s=0.0, exposed_s=0.0)
    timings = DeviceTimings()
    with use_stream_ops(StubStreams()) as ops:
        for i in range(3):
            start = timings.mark(torch.device("cuda"))
            StubEvent.clock_ms += 2.0 + i
            timings.add(counters, "time_s" if i < 2 else "exposed_s", start, timings.mark(torch.device("cuda")))
        waits = StubEvent.waits
        timings.settle()
        assert counters.time_s == 0.0 and timings.unsettled == 3  # nothing completed: nothing read, nothing waited
        for event in ops.events[:4]:  # the first two spans complete
            event.complete = True
        timings.settle()
        assert counters.time_s == (2.0 + 3.0) / 1000 and counters.exposed_s == 0.0 and timings.unsettled == 1
        for event in ops.events:
            event.complete = True
        timings.settle()
        assert counters.exposed_s == 4.0 / 1000 and timings.unsettled == 0
        assert StubEvent.waits == waits


def test_unread_spans_are_bounded():
    counters = types.SimpleNamespace(time_s=0.0)
    timings = DeviceTimings(bound=4)
    with use_stream_ops(StubStreams()):
        for _ in range(10):
            start = timings.mark(torch.device("cuda"))
            StubEvent.clock_ms += 1.0
            timings.add(counters, "time_s", start, timings.mark(torch.device("cuda")))
            assert timings.unsettled <= 4
    assert abs(counters.time_s - 6 / 1000) < 1e-12  # the 6 oldest were settled to keep 4


def test_single_stream_has_no_side_streams_and_real_ops_none_off_cuda():
    assert SingleStream().side_stream(torch.device("cuda")) is None
    ops = StreamOps()
    assert ops.side_stream(torch.device("cpu")) is None
    assert ops.record_event(torch.device("cpu")) is None
    ops.wait_for_current(None, torch.device("cpu"))
    with ops.use(None):
        pass
    assert isinstance(stream_ops(), StreamOps)
