"""CompressionAdvice: whether the compression stage should make steps faster, from what the warmup measured (made by
:class:`~lightning_onebit.CommunicationMonitor` at the freeze)."""

from __future__ import annotations

import dataclasses
from typing import Optional


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


def _seconds(value: float) -> str:
    return f"{value * 1000:.0f} ms" if value < 1 else f"{value:.2f} s"


def _bytes(value: float) -> str:
    for unit, size in (("GB", 1e9), ("MB", 1e6), ("kB", 1e3)):
        if value >= size:
            return f"{value / size:.1f} {unit}"
    return f"{value:.0f} B"
