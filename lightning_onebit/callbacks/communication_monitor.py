"""CommunicationMonitor: bytes and time of the gradient sync and the compressed exchange, and CompressionAdvice,
its answer to "will compression help on this link?"."""

from __future__ import annotations

import collections
import dataclasses
import statistics
import time
from typing import TYPE_CHECKING, Any, Optional

import lightning.pytorch as pl
import torch
from lightning.pytorch.callbacks import Callback
from lightning.pytorch.utilities.rank_zero import rank_zero_info

from lightning_onebit.callbacks._common import _onebit_optimizer, _onebit_strategy
from lightning_onebit.optim import CompressedOptimizer, StepKind
from lightning_onebit.strategy import OnebitStrategy

if TYPE_CHECKING:
    from lightning_onebit.comm.accounting import CommunicationCounters

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
    expected_step_s: float = dataclasses.field(init=False)
    measured_step_s: Optional[float] = None
    measured_steps: int = 0

    #: below this share of a step saved, the advice says compression cannot help
    NEGLIGIBLE_SAVING = 0.05

    def __post_init__(self) -> None:
        ratio = self.compressed_bytes / self.warmup_bytes if self.warmup_bytes else 1.0
        on_link = self.exposed_s if self.overlap else self.span_s
        self.expected_step_s = max(0.0, self.step_s - self.exposed_s + on_link * ratio)

    @property
    def helps(self) -> bool:
        """Whether the expected step is at least :attr:`NEGLIGIBLE_SAVING` (5%) shorter than the warmup step."""
        return self.step_s - self.expected_step_s >= self.NEGLIGIBLE_SAVING * self.step_s

    def message(self) -> str:
        """The estimate in words, saying plainly when compression cannot make steps faster."""
        fewer = f"{self.warmup_bytes / self.compressed_bytes:.1f}x fewer" if self.compressed_bytes else "no"
        share = self.exposed_s / self.step_s if self.step_s else 0.0
        text = (
            f"gradient allreduce exposed {_seconds(self.exposed_s)} of a {_seconds(self.step_s)} step ({share:.0%}, "
            f"median of the last {self.warmup_steps} warmup steps); the compression stage sends "
            f"{_bytes(self.compressed_bytes)} per step instead of {_bytes(self.warmup_bytes)} ({fewer} bytes)"
        )
        if self.helps:
            return f"{text}: expect about {_seconds(self.expected_step_s)} per step " \
                   f"({self.step_s / self.expected_step_s:.2f}x faster)"
        return (
            f"{text}: expect about {_seconds(self.expected_step_s)} per step. The link is fast enough here that "
            "compression cannot make steps noticeably faster: plain DDP (strategy='ddp') would train about as fast, "
            "and 1-bit compression only saves bytes"
        )

    def measured_message(self) -> str:
        """The measured compression-stage step next to the estimate."""
        assert self.measured_step_s is not None
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


class CommunicationMonitor(Callback):
    """Logs this rank's communication every optimizer step to the Trainer's logger, and says whether compression pays.

    Metrics (bytes are real payload bytes of this rank in this step unless marked total):

    * ``comm/bytes_sent``, ``comm/bytes_received``
    * ``comm/bytes_sent_inter_node``: the part of ``bytes_sent`` that crossed to other nodes (what the slow link
      carries); ``comm/bytes_sent_intra_node``: the part that stayed inside this rank's node. Which ranks share a node
      comes from the strategy's topology (the cluster environment).
    * ``comm/bytes_fp32_equivalent``: what an fp32 ring allreduce of the same gradients/momenta sends
    * ``comm/bytes_sent_uncompressed``: compression stage, the part of ``bytes_sent`` that averaged the gradients of
      param groups with ``compress=False`` in full precision (0 without such groups)
    * ``comm/compression_ratio``: ``bytes_fp32_equivalent / bytes_sent`` (1 in fp32 warmup, ~32 compressed; lower
      with ``compress=False`` groups, whose bytes count in both at their full size)
    * ``comm/bytes_sent_total``: cumulative since the start of ``fit``
    * ``comm/time_ms``: time in communication calls (compressed allreduce including its compression kernels; for
      the warmup allreduce, launch-to-completion of each bucket, which overlaps the backward pass)
    * ``comm/exposed_ms``: the exchange time the step could not hide behind backward. Warmup: from the launch of the
      allreduce of DDP's last gradient bucket to the completion of every allreduce. Compression stage: the time
      ``optimizer.step`` spent on the momentum exchange after backward (waiting on the link, decoding, and all of it
      for buckets not started during backward; without overlap, the whole exchange).
    * ``comm/hook_ms``: compression stage, time spent during backward in DDP's hooks folding, compressing and launching
      the overlapped exchange (0 without overlap). On CPU it runs on the backward thread; on CUDA on a side stream.
    * ``comm/stage``: 0 warmup, 1 compression (the stage of the step just taken)
    * ``onebit/freeze_step``: with ``freeze_step="auto"``, the step it decided (from the decision on; also in the
      progress bar)

    Warmup steps count DDP's gradient allreduce. The progress bar shows short names that fit a terminal: ``stage``
    (``comm/stage``), ``1bit_x`` (``comm/compression_ratio``) and ``freeze`` (``onebit/freeze_step``).

    **Will compression help?** With ``advise=True``, the callback times the warmup steps (wall time between optimizer
    steps) and the gradient allreduce's exposed time, and at the first compression-stage step logs
    :class:`CompressionAdvice`: the share of the step that waited for the allreduce, the bytes per step before and
    after, and the expected compression-stage step time, saying plainly when the link is fast enough that compression
    cannot help. After ``advise_steps`` more steps it logs the measured compression-stage step time next to the
    estimate. Both go to the log (rank 0) and the logger (``advisor/warmup_step_ms``, ``advisor/exposed_ms``,
    ``advisor/expected_step_ms``, ``advisor/measured_step_ms``); :attr:`advice` holds them. Each costs one small
    ``all_reduce`` (every rank's figures: the advice is the slowest rank's). A run resumed in the compression stage
    measured no warmup and gets no advice (the log says so). With ``ZeroOneAdam``, whose steps after its warmup mix
    full-precision variance steps, 1-bit compressed steps and local steps, the advice is about its 1-bit steps: it is
    given at the first one and measured on those only (until its local steps begin), and the log says what it covers.

    Args:
        prog_bar: show ``stage``, ``1bit_x`` and ``freeze`` in the progress bar. Default ``True``.
        advise: estimate whether compression will make steps faster, as above. Default ``True``.
        advise_steps: warmup steps the estimate uses (the last ones; the first 2 steps of a fit, which build DDP's
            buckets and warm allocators up, are never used) and compression-stage steps measured after it (counted
            from the 3rd). Default ``20``.
    """

    #: steps at the start of fit, and of the compression stage, that the advice does not time
    SETTLING_STEPS = 2

    def __init__(self, prog_bar: bool = True, advise: bool = True, advise_steps: int = 20) -> None:
        for name, value in (("prog_bar", prog_bar), ("advise", advise)):
            if not isinstance(value, bool):  # "yes", "no", 0 and 1 would all read as a truth value
                raise ValueError(f"CommunicationMonitor {name} must be True or False, got {value!r}")
        if isinstance(advise_steps, bool) or not isinstance(advise_steps, int) or advise_steps < 1:
            raise ValueError(f"CommunicationMonitor advise_steps must be an integer >= 1, got {advise_steps!r}")
        self.prog_bar = prog_bar
        self.advise = advise
        self.advise_steps = advise_steps
        self.advice: Optional[CompressionAdvice] = None
        self._last: Optional[CommunicationCounters] = None
        self._start: Optional[CommunicationCounters] = None
        self._last_step = -1
        self._last_time: Optional[float] = None
        self._last_span = 0.0
        self._steps_timed = 0
        self._warmup: collections.deque[tuple[float, float, float, int]] = collections.deque(maxlen=advise_steps)
        self._compressed: list[float] = []
        self._advice_done = False
        self._optimizer_note: Optional[str] = None  # what the advice adds about steps it does not time

    def setup(self, trainer: "pl.Trainer", pl_module: "pl.LightningModule", stage: str) -> None:
        if stage == "fit":
            _onebit_strategy(trainer, "CommunicationMonitor")

    def on_train_start(self, trainer: "pl.Trainer", pl_module: "pl.LightningModule") -> None:
        strategy = _onebit_strategy(trainer, "CommunicationMonitor")
        self._start = self._last = strategy.communication
        self._last_step = trainer.global_step
        self._last_span = strategy.gradient_sync.span_s
        self._last_time = None
        self._steps_timed = 0
        self._warmup.clear()
        self._compressed = []
        self.advice = None
        self._advice_done = False
        self._optimizer_note = strategy.onebit_optimizer.advisor_note

    def on_train_batch_end(
        self, trainer: "pl.Trainer", pl_module: "pl.LightningModule", outputs: Any, batch: Any, batch_idx: int
    ) -> None:
        if trainer.global_step == self._last_step:  # accumulating: no optimizer step yet
            return
        self._last_step = trainer.global_step
        now_s = time.perf_counter()
        step_s = None if self._last_time is None else now_s - self._last_time
        self._last_time = now_s
        optimizer = _onebit_optimizer(trainer, "CommunicationMonitor")
        strategy = _onebit_strategy(trainer, "CommunicationMonitor")
        now = strategy.communication
        step = now - self._last
        self._last = now
        span_s, self._last_span = strategy.gradient_sync.span_s - self._last_span, strategy.gradient_sync.span_s
        frozen = optimizer.freeze_step
        compressed = frozen is not None and optimizer.step_count > frozen
        stage = 1.0 if compressed else 0.0
        ratio = step.bytes_fp32_equivalent / step.bytes_sent if step.bytes_sent else 0.0
        metrics = {
            "comm/bytes_sent": float(step.bytes_sent),
            "comm/bytes_received": float(step.bytes_received),
            "comm/bytes_sent_intra_node": float(step.bytes_sent_intra_node),
            "comm/bytes_sent_inter_node": float(step.bytes_sent_inter_node),
            "comm/bytes_fp32_equivalent": float(step.bytes_fp32_equivalent),
            "comm/bytes_sent_uncompressed": float(step.bytes_sent_uncompressed),
            "comm/bytes_sent_total": float((now - self._start).bytes_sent),
            "comm/time_ms": 1000.0 * step.time_s,
            "comm/exposed_ms": 1000.0 * step.exposed_s,
            "comm/hook_ms": 1000.0 * step.hook_s,
        }
        pl_module.log_dict(metrics, on_step=True, on_epoch=False, batch_size=1)
        shown = {"comm/stage": stage, "comm/compression_ratio": ratio}
        short = {"stage": stage, "1bit_x": ratio}
        if optimizer.auto_freeze is not None and frozen is not None:
            shown["onebit/freeze_step"] = short["freeze"] = float(frozen)  # the step freeze_step='auto' decided
        pl_module.log_dict(shown, on_step=True, on_epoch=False, batch_size=1)
        if self.prog_bar:  # short names that fit a terminal; the logger has the full ones
            pl_module.log_dict(short, on_step=True, on_epoch=False, prog_bar=True, logger=False, batch_size=1)
        if self.advise and not self._advice_done:
            if compressed and optimizer.last_step_kind is not StepKind.COMPRESSED:
                # after the warmup, 0/1 Adam's variance steps cost a warmup step and its local steps send (almost)
                # nothing: the advice is about 1-bit compressed steps, so it times those only
                self._other_step(trainer, strategy, optimizer)
            else:
                self._advise(trainer, strategy, compressed, step, step_s, span_s)

    # -- will compression help? --------------------------------------------------------------------------------------
    def _advise(
        self,
        trainer: "pl.Trainer",
        strategy: OnebitStrategy,
        compressed: bool,
        step: CommunicationCounters,
        step_s: Optional[float],
        span_s: float,
    ) -> None:
        """Record one optimizer step; at the first compressed step estimate, ``advise_steps`` later measure."""
        self._steps_timed += 1
        if not compressed:
            if self._steps_timed > self.SETTLING_STEPS and step_s is not None:
                self._warmup.append((step_s, step.exposed_s, span_s, step.bytes_sent))
            return
        if self.advice is None:
            # The first compressed step: every rank is here (the stage is rank-identical), so the reduction is safe.
            if not self._warmup:
                self._advice_done = True  # resumed in the compression stage, or too short a warmup to time
                rank_zero_info(
                    "CommunicationMonitor: no compression advice: no warmup step was timed in this fit (more than "
                    f"{self.SETTLING_STEPS} warmup steps are needed)"
                )
                return
            step_times, exposed, spans, sent = zip(*self._warmup)
            figures = _reduce_max(
                strategy,
                [statistics.median(step_times), -statistics.median(exposed), statistics.median(spans),
                 statistics.median(sent), step.bytes_sent],
            )
            self.advice = CompressionAdvice(
                warmup_steps=len(self._warmup),
                step_s=figures[0],
                exposed_s=-figures[1],
                span_s=figures[2],
                warmup_bytes=figures[3],
                compressed_bytes=figures[4],
                overlap=strategy.overlap_state is not None and strategy.overlap_state.enabled,
            )
            self._warmup.clear()
            rank_zero_info(f"onebit_adam advisor: {self.advice.message()}{self._note}")
            _log_once(
                trainer,
                {
                    "advisor/warmup_step_ms": 1000.0 * self.advice.step_s,
                    "advisor/exposed_ms": 1000.0 * self.advice.exposed_s,
                    "advisor/expected_step_ms": 1000.0 * self.advice.expected_step_s,
                },
            )
            self._steps_timed = 1
            return
        if self._steps_timed > self.SETTLING_STEPS and step_s is not None:
            self._compressed.append(step_s)
        if len(self._compressed) < self.advise_steps:
            return
        self._measured(trainer, strategy)

    def _measured(self, trainer: "pl.Trainer", strategy: OnebitStrategy) -> None:
        assert self.advice is not None and self._compressed
        self.advice.measured_step_s = _reduce_max(strategy, [statistics.median(self._compressed)])[0]
        self.advice.measured_steps = len(self._compressed)
        self._advice_done = True
        rank_zero_info(f"onebit_adam advisor: {self.advice.measured_message()}{self._note}")
        _log_once(trainer, {"advisor/measured_step_ms": 1000.0 * self.advice.measured_step_s})

    @property
    def _note(self) -> str:
        return self._optimizer_note or ""

    def _other_step(self, trainer: "pl.Trainer", strategy: OnebitStrategy, optimizer: CompressedOptimizer) -> None:
        """A step after the warmup that is not a 1-bit compressed step (0/1 Adam's variance, local or sync steps):
        not timed. Once local steps begin there are no more 1-bit steps to time: the advice ends with what it has
        (the schedule is the same on every rank, so every rank ends here at the same step)."""
        if optimizer.last_step_kind not in (StepKind.LOCAL, StepKind.SYNC):
            return  # a variance step: a warmup step's cost, as the note says
        if self.advice is None:
            self._advice_done = True
            rank_zero_info(
                f"CommunicationMonitor: no compression advice: in this fit {type(optimizer).__name__} took no 1-bit "
                "compressed step before its local steps, so there is no compressed step to estimate; its local "
                f"steps send nothing but a 1-bit sync of the accumulated update now and then{self._note}"
            )
        elif self._compressed:
            self._measured(trainer, strategy)
        else:
            self._advice_done = True
            rank_zero_info(
                f"onebit_adam advisor: the 1-bit steps were not measured: {type(optimizer).__name__}'s local steps "
                f"began before a 1-bit step after the estimate's first {self.SETTLING_STEPS} could be timed"
                f"{self._note}"
            )


def _log_once(trainer: "pl.Trainer", metrics: dict[str, float]) -> None:
    """Send ``metrics`` to the Trainer's loggers at this step only (``LightningModule.log`` would repeat them at every
    logging step after this one)."""
    for logger in trainer.loggers:
        logger.log_metrics(metrics, step=trainer.global_step)


def _reduce_max(strategy: OnebitStrategy, values: list[float]) -> list[float]:
    """Elementwise maximum over the ranks of the strategy's process group (one small ``all_reduce``)."""
    if not (torch.distributed.is_available() and torch.distributed.is_initialized()):
        return [float(v) for v in values]
    tensor = torch.tensor(values, dtype=torch.float64, device=strategy.root_device)
    group = None if strategy.onebit_optimizer is None else strategy.onebit_optimizer.process_group
    torch.distributed.all_reduce(tensor, op=torch.distributed.ReduceOp.MAX, group=group)
    return tensor.tolist()
