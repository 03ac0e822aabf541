"""The advice :class:`~lightning_onebit.CommunicationMonitor` gives: :class:`CompressionAdvice`, whether the
compression stage should make steps faster, from what the warmup measured (at the freeze), and
:class:`LocalStepsAdvice`, which ``sync_every`` the measured inner steps and outer syncs of ``onebit_diloco`` call
for."""

from __future__ import annotations

import dataclasses
import math
from typing import Optional

from lightning_onebit._checks import check_integer, check_real
from lightning_onebit._docs import docs_pointer

#: Where the local-steps advice sends the user: what fewer syncs cost in accuracy, and what the advice assumes.
LOCAL_STEPS_DOCS = docs_pointer("guides/local-steps", "how-often-to-sync-the-advisor")


@dataclasses.dataclass
class CompressionAdvice:
    """Whether the compression stage should make steps faster, from what the warmup measured (``CommunicationMonitor``).

    The model: a warmup step of ``step_s`` seconds waited ``exposed_s`` for DDP's gradient allreduce after backward
    had nothing left to compute (the allreduce of the last gradient bucket and whatever of the earlier ones was still
    on the link). In the compression stage that wait goes, and the momentum exchange, ``compressed_bytes /
    warmup_bytes`` of the allreduce's bytes, takes its place: after backward in full (``span_s``, the time the link
    was in use, scaled by the bytes ratio) without overlap, or the part backward cannot hide (``exposed_s``, scaled)
    with overlap::

        expected_step_s = step_s - exposed_s + (exposed_s if overlap else span_s) * compressed_bytes / warmup_bytes

    It leaves out the compression kernels and the cheaper frozen-variance update (both a few percent of a step in
    this project's CPU measurements) and assumes the link, not the collective's fixed costs, is what takes the time.

    Attributes:
        warmup_steps: warmup steps measured (the last ones, at most ``CommunicationMonitor(advise_steps=...)``).
        step_s: median warmup step time, seconds (the slowest rank's).
        exposed_s: median time per warmup step spent waiting for the gradient allreduce after backward, seconds (the
            least-waiting rank's: the rank with the most compute sets the pace once the wait is gone).
        span_s: median time per warmup step from the first gradient bucket's launch to the completion of the last
            allreduce, seconds: an upper bound on the link's busy time.
        warmup_bytes: bytes this rank sent per warmup step (the largest over ranks).
        compressed_bytes: bytes sent in the first compression-stage step (the largest over ranks).
        overlap: whether the compression stage overlaps the exchange with backward.
        warmup_compressed: whether the warmup averaged compressed gradients (``warmup_exchange`` "bf16", "int8",
            "powersgd" or a hook of the user's: fewer bytes than fp32). Its exchange time is then partly the
            compressor's own work (PowerSGD's products and orthogonalisation), not the link's, so it says nothing of
            what the 1-bit exchange's bytes will take: no estimate is made (``expected_step_s`` is the warmup step)
            and the compression-stage step is only measured. Default ``False``.
        expected_step_s: the estimate above, seconds.
        measured_step_s: median compression-stage step time of the slowest rank, seconds, once measured (``None``
            before).
        measured_steps: compression-stage steps in that median.
    """

    warmup_steps: int
    step_s: float
    exposed_s: float
    span_s: float
    warmup_bytes: float
    compressed_bytes: float
    overlap: bool
    warmup_compressed: bool = False
    expected_step_s: float = dataclasses.field(init=False)
    measured_step_s: Optional[float] = None
    measured_steps: int = 0

    #: below this share of a step saved, the advice says compression cannot help
    NEGLIGIBLE_SAVING = 0.05

    def __post_init__(self) -> None:
        if self.warmup_compressed:
            self.expected_step_s = self.step_s
            return
        ratio = self.compressed_bytes / self.warmup_bytes if self.warmup_bytes else 1.0
        on_link = self.exposed_s if self.overlap else self.span_s
        self.expected_step_s = max(0.0, self.step_s - self.exposed_s + on_link * ratio)

    @property
    def helps(self) -> bool:
        """Whether the expected step is at least :attr:`NEGLIGIBLE_SAVING` (5%) shorter than the warmup step."""
        return self.step_s - self.expected_step_s >= self.NEGLIGIBLE_SAVING * self.step_s

    def message(self) -> str:
        """The estimate in words, saying plainly when compression cannot make steps faster."""
        if not self.warmup_bytes:  # one process: DDP averaged nothing over a link, so there is nothing to compress
            return (
                f"the warmup's {_seconds(self.step_s)} steps (median of {self.warmup_steps}) sent nothing: with one "
                "process there is no gradient average to compress and compression cannot make steps faster; on one "
                "device train with strategy='auto' and torch.optim.AdamW"
            )
        if self.warmup_compressed:
            return (
                f"the warmup averaged compressed gradients ({_bytes(self.warmup_bytes)} per step, a "
                f"{_seconds(self.step_s)} step, median of {self.warmup_steps} warmup steps): its exchange time is "
                "partly the compressor's own work, not the link's, so the compression-stage step, whose 1-bit "
                f"exchange sends {_bytes(self.compressed_bytes)}, is not estimated but measured"
            )
        fewer = f" ({self.warmup_bytes / self.compressed_bytes:.1f}x fewer)" if self.compressed_bytes else ""
        share = self.exposed_s / self.step_s if self.step_s else 0.0
        text = (
            f"allreduce exposed {_seconds(self.exposed_s)} of a {_seconds(self.step_s)} step ({share:.0%}, median of "
            f"{self.warmup_steps} warmup steps); 1-bit steps send {_bytes(self.compressed_bytes)}, not "
            f"{_bytes(self.warmup_bytes)}{fewer}: expect about {_seconds(self.expected_step_s)} per step"
        )
        if self.helps:
            return f"{text} ({self.step_s / self.expected_step_s:.2f}x faster)"
        return f"{text}: compression cannot make steps noticeably faster than plain DDP (strategy='ddp') here"

    def measured_message(self) -> str:
        """The measured compression-stage step next to the estimate."""
        assert self.measured_step_s is not None
        if self.warmup_compressed:
            return (
                f"compression-stage step measured {_seconds(self.measured_step_s)} (median of {self.measured_steps} "
                f"steps, slowest rank) against {_seconds(self.step_s)} in the compressed warmup "
                f"({self.step_s / self.measured_step_s:.2f}x)"
            )
        return (
            f"compression-stage step measured {_seconds(self.measured_step_s)} (median of {self.measured_steps} "
            f"steps, slowest rank) against {_seconds(self.expected_step_s)} estimated and "
            f"{_seconds(self.step_s)} in warmup ({self.step_s / self.measured_step_s:.2f}x)"
        )


@dataclasses.dataclass
class LocalStepsAdvice:
    """Which ``sync_every`` the measured steps of ``onebit_diloco`` call for (made by ``CommunicationMonitor``).

    The model: a step without an outer sync takes ``inner_step_s`` (it sends nothing across replicas: the
    no-communication floor of these processes), and a step that runs one takes ``sync_s`` longer, whatever
    ``sync_every`` is (the bytes of a sync are fixed by the compressor). So with an outer sync every ``H`` steps the
    average step takes ``inner_step_s + sync_s / H``: :attr:`expected_step_s` for the current ``sync_every``, and
    :meth:`suggested_sync_every` is the smallest ``H`` that keeps it within ``target`` times the floor. It says
    nothing about accuracy, which fewer syncs may cost (``docs/guides/local-steps.md``).

    Attributes:
        inner_step_s: median wall time of a step without an outer sync, seconds (> 0; the slowest rank's: it sets
            the pace).
        sync_s: median extra wall time of a step that ran an outer sync, over ``inner_step_s``, seconds (>= 0; the
            least over the ranks: a faster rank's sync step also holds its wait for the slowest rank's inner steps).
        sync_every: the run's inner steps per outer sync (>= 1).
        bytes_per_sync: bytes this rank sent across replicas (inter-node) in one outer sync, the largest over ranks.
        steps_timed: steps without an outer sync in the median of ``inner_step_s``.
        syncs_timed: steps with an outer sync in the median of ``sync_s``.
    """

    inner_step_s: float
    sync_s: float
    sync_every: int
    bytes_per_sync: float
    steps_timed: int
    syncs_timed: int

    #: the slowdown over the no-communication floor the suggestion keeps within, by default
    TARGET_SLOWDOWN = 1.15

    def __post_init__(self) -> None:
        check_real(self.inner_step_s, "LocalStepsAdvice inner_step_s", above=0.0, unit="seconds")
        check_real(self.sync_s, "LocalStepsAdvice sync_s", at_least=0.0, unit="seconds")
        check_integer(self.sync_every, "LocalStepsAdvice sync_every")

    @property
    def expected_step_s(self) -> float:
        """The average step with this ``sync_every``: ``inner_step_s + sync_s / sync_every``, seconds."""
        return self.inner_step_s + self.sync_s / self.sync_every

    @property
    def slowdown(self) -> float:
        """``expected_step_s / inner_step_s``: how much slower the average step is than the floor (>= 1)."""
        return self.expected_step_s / self.inner_step_s

    def suggested_sync_every(self, target: float = TARGET_SLOWDOWN) -> int:
        """The smallest integer ``H >= 1`` with ``inner_step_s + sync_s / H <= target * inner_step_s``, i.e.
        ``ceil(sync_s / ((target - 1) * inner_step_s))`` (up to a relative rounding of 1e-9, so that a figure on the
        boundary is within it); 1 when ``sync_s`` is 0. ``target``: a slowdown > 1, default 1.15."""
        target = check_real(target, "target", above=1.0, fix="e.g. 1.15: at most 15% slower than the floor")
        assert target is not None
        ratio = self.sync_s / ((target - 1.0) * self.inner_step_s)
        return max(1, math.ceil(ratio * (1.0 - 1e-9)))

    def metrics(self) -> dict[str, float]:
        """The figures under the names ``CommunicationMonitor`` logs them with: ``advisor/inner_step_ms``,
        ``advisor/sync_ms``, ``advisor/expected_step_ms`` (milliseconds) and ``advisor/suggested_sync_every`` (for
        the default target)."""
        return {"advisor/inner_step_ms": 1000.0 * self.inner_step_s, "advisor/sync_ms": 1000.0 * self.sync_s,
                "advisor/expected_step_ms": 1000.0 * self.expected_step_s,
                "advisor/suggested_sync_every": float(self.suggested_sync_every())}

    def message(self, target: float = TARGET_SLOWDOWN) -> str:
        """The figures in words: the floor, the sync's cost, the average step now, and the ``sync_every`` that keeps
        it within ``target`` times the floor (saying plainly when the current one already does)."""
        suggested = self.suggested_sync_every(target)
        cost = f"an outer sync adds {_seconds(self.sync_s)}" if self.sync_s else "an outer sync adds no measurable time"
        text = (
            f"inner step {_seconds(self.inner_step_s)} (median of {self.steps_timed} steps), {cost} "
            f"({_bytes(self.bytes_per_sync)} per rank, median of {self.syncs_timed} syncs): with "
            f"sync_every={self.sync_every} a step averages {_seconds(self.expected_step_s)}, {self.slowdown:.2f}x the "
            "no-communication floor"
        )
        if suggested > self.sync_every:
            return (
                f"{text}; sync_every >= {suggested} keeps it within {target:.2f}x (fewer syncs: fewer bytes, and "
                f"accuracy may drop: {LOCAL_STEPS_DOCS})"
            )
        if suggested == self.sync_every:
            smaller = "no smaller sync_every would be"
        else:
            smaller = f"sync_every down to {suggested} would still be (more syncs are affordable)"
        return f"{text}, within {target:.2f}x; {smaller}; {LOCAL_STEPS_DOCS}"


def _seconds(value: float) -> str:
    return f"{value * 1000:.0f} ms" if value < 1 else f"{value:.2f} s"


def _bytes(value: float) -> str:
    for unit, size in (("GB", 1e9), ("MB", 1e6), ("kB", 1e3)):
        if value >= size:
            return f"{value / size:.1f} {unit}"
    return f"{value:.0f} B"
