"""CommunicationMonitor: bytes and time of the gradient sync and the compressed exchange (and of plain DDP's gradient
allreduce, the baseline), at the freeze its :class:`~lightning_onebit.callbacks.advice.CompressionAdvice`, and under
``onebit_diloco`` its :class:`~lightning_onebit.callbacks.advice.LocalStepsAdvice`."""

from __future__ import annotations

import collections
import statistics
import time
import weakref
from typing import Any, Optional, Union

import lightning.pytorch as pl
import torch
from lightning.pytorch.callbacks import Callback
from lightning.pytorch.strategies import DDPStrategy
from lightning.pytorch.utilities.rank_zero import rank_zero_info, rank_zero_warn
from torch.nn.parallel import DistributedDataParallel

from lightning_onebit._checks import check_flag, check_integer
from lightning_onebit._docs import docs_pointer
from lightning_onebit.callbacks.advice import CompressionAdvice, LocalStepsAdvice
from lightning_onebit.callbacks.local_steps_timer import LocalStepsTimer
from lightning_onebit.comm.accounting import CommunicationCounters
from lightning_onebit.comm.agreement import agree
from lightning_onebit.comm.topology import Topology
from lightning_onebit.hooks import GradientSyncState, switchable_allreduce_hook
from lightning_onebit.optim import CompressedOptimizer, StepKind
from lightning_onebit.strategy import OnebitDiLoCoFSDPStrategy, OnebitDiLoCoStrategy, OnebitFSDPStrategy, OnebitStrategy
from lightning_onebit.strategy.stepping import onebit_optimizer, onebit_strategy

#: Where the advisor's messages send the user: how the estimate is made, and why a link may give no speedup.
_ADVISOR_DOCS = docs_pointer("guides/why-no-speedup")

#: the local-steps strategies (DDP and FSDP2 inside the replica): counted by the strategy, advised on sync_every
_LOCAL_STEPS = (OnebitDiLoCoStrategy, OnebitDiLoCoFSDPStrategy)


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

    **Plain DDP, the baseline.** Under ``Trainer(strategy="ddp")`` (Lightning's ``DDPStrategy``) the callback registers
    a DDP communication hook at the start of training that runs DDP's usual ``mean`` allreduce and counts it as the
    ``onebit_adam`` strategy counts its warmup (:class:`~lightning_onebit.hooks.GradientSyncState`: a ring allreduce
    in the gradients' dtype, nodes from the cluster environment; one small ``all_gather_object`` per ``fit`` to learn
    them). It logs the same bytes and time metrics as in the warmup (``comm/bytes_*``, ``comm/time_ms``,
    ``comm/exposed_ms``, ``comm/compression_ratio``, 1 in fp32), so the two runs plot side by side; ``comm/stage``,
    ``comm/hook_ms``, ``comm/bytes_sent_uncompressed``, the progress bar and the advice, which are about the
    compression stage, are left out. DDP takes one communication hook: when the run already has one (e.g.
    ``DDPStrategy(ddp_comm_hook=...)`` on CUDA), the callback warns once and counts nothing (:attr:`communication` is
    ``None``). Any other strategy is refused at setup.

    **Will compression help?** With ``advise=True``, the callback times the warmup steps (wall time between optimizer
    steps) and the gradient allreduce's exposed time, and at the first compression-stage step logs
    :class:`CompressionAdvice`: the share of the step that waited for the allreduce, the bytes per step before and
    after, and the expected compression-stage step time, saying plainly when the link is fast enough that compression
    cannot help. After ``advise_steps`` more steps it logs the measured compression-stage step time next to the
    estimate. A warmup that averaged compressed gradients (``warmup_exchange`` other than "fp32", or a hook of yours)
    times the compressor's work with the link's, so then the step is only measured, and the advice says why. Both go
    to the log (rank 0) and the logger (``advisor/warmup_step_ms``, ``advisor/exposed_ms``,
    ``advisor/expected_step_ms``, ``advisor/measured_step_ms``); :attr:`advice` holds them. Each costs one small
    ``all_reduce`` (every rank's figures: the advice is the slowest rank's). A run resumed in the compression stage
    measured no warmup and gets no advice (the log says so). With ``ZeroOneAdam``, whose steps after its warmup mix
    full-precision variance steps, 1-bit compressed steps and local steps, the advice is about its 1-bit steps: it is
    given at the first one and measured on those only (until its local steps begin), and the log says what it covers.

    **How often to sync?** Under ``onebit_diloco`` (local steps) the callback times the steps the same way and tells a
    step that ran an outer sync from one that did not. Once it has timed ``advise_steps`` steps without a sync and 2
    with one (not the fit's first sync, which lays buffers out), it logs :class:`LocalStepsAdvice`: the inner step (the
    no-communication floor), what a sync adds, the average step with the run's ``sync_every`` and the ``sync_every``
    that keeps it within 1.15x the floor, to the log (rank 0) and the logger (``advisor/inner_step_ms``,
    ``advisor/sync_ms``, ``advisor/expected_step_ms``, ``advisor/suggested_sync_every``), at the cost of one small
    ``all_reduce``; :attr:`advice` holds it. A fit too short for that says so in one line at its end.

    Args:
        prog_bar: show ``stage``, ``1bit_x`` and ``freeze`` in the progress bar. Default ``True``.
        advise: estimate whether compression will make steps faster (or which ``sync_every`` suits), as above.
            Default ``True``.
        advise_steps: warmup steps the estimate uses (the last ones; the first 2 steps of a fit, which build DDP's
            buckets and warm allocators up, are never used) and compression-stage steps measured after it (counted
            from the 3rd); under ``onebit_diloco``, steps without a sync timed before advising. Default ``20``.
    """

    #: steps at the start of fit, and of the compression stage, that the advice does not time
    SETTLING_STEPS = 2

    def __init__(self, prog_bar: bool = True, advise: bool = True, advise_steps: int = 20) -> None:
        for name, value in (("prog_bar", prog_bar), ("advise", advise)):
            check_flag(value, f"CommunicationMonitor {name}")
        check_integer(advise_steps, "CommunicationMonitor advise_steps")
        self.prog_bar = prog_bar
        self.advise = advise
        self.advise_steps = advise_steps
        self.advice: Optional[Union[CompressionAdvice, LocalStepsAdvice]] = None
        self._last: Optional[CommunicationCounters] = None
        self._start: Optional[CommunicationCounters] = None
        self._last_step = -1
        self._last_time: Optional[float] = None
        self._last_span = 0.0
        self._steps_timed = 0
        self._warmup: collections.deque[tuple[float, float, float, int, int]] = collections.deque(maxlen=advise_steps)
        self._compressed: list[float] = []
        self._advice_done = False
        self._optimizer_note: Optional[str] = None  # what the advice adds about steps it does not time
        self._strategy: Optional[Union[OnebitStrategy, DDPStrategy]] = None  # the fit's, from on_train_start
        # strategy="ddp": the counting hook's state, and the DDP wrapper it is registered on (a new one every fit)
        self._ddp_sync: Optional[GradientSyncState] = None
        self._ddp_hooked: Optional[weakref.ref[DistributedDataParallel]] = None
        self._warned_foreign_hook = False
        self._local_steps: Optional[LocalStepsTimer] = None  # onebit_diloco, until the advice is given

    @property
    def communication(self) -> Optional[CommunicationCounters]:
        """This rank's communication counted since the start of the current (or last) ``fit``'s training: the
        ``onebit_adam`` strategy's counters (warmup allreduces and compressed exchanges) or, under
        ``strategy="ddp"``, the counting hook's. ``None`` before training starts, and under ``strategy="ddp"`` when
        the run had a communication hook of its own (nothing counted)."""
        if self._strategy is None or self._start is None:
            return None
        now = self._counters_now(self._strategy)
        return None if now is None else now - self._start

    def setup(self, trainer: "pl.Trainer", pl_module: "pl.LightningModule", stage: str) -> None:
        if stage == "fit":
            _monitored_strategy(trainer)

    def teardown(self, trainer: "pl.Trainer", pl_module: "pl.LightningModule", stage: str) -> None:
        # Under strategy="ddp" the counting hook's state holds DDP's process group. Lightning drops its DDP wrapper at
        # teardown, but this callback lives as long as the trainer, often until the interpreter finalises; a gloo
        # group destroyed then can abort a finished run ("terminate called without an active exception"). The
        # counts stay readable; the next fit hooks its new wrapper with a new state.
        if self._ddp_sync is not None:
            self._ddp_sync.process_group = None
            self._ddp_sync.topology = None

    def on_train_start(self, trainer: "pl.Trainer", pl_module: "pl.LightningModule") -> None:
        strategy = self._strategy = _monitored_strategy(trainer)
        # counted by the strategy; no advice (yet) under sharding
        if isinstance(strategy, (OnebitFSDPStrategy, *_LOCAL_STEPS)):
            self._start = self._last = strategy.communication
            self._last_step = trainer.global_step
            self.advice, self._local_steps = None, None
            if isinstance(strategy, _LOCAL_STEPS) and self.advise:  # the advice on sync_every
                self._local_steps = LocalStepsTimer(strategy, self.advise_steps, self.SETTLING_STEPS)
            return
        if not isinstance(strategy, OnebitStrategy):
            self._start_counting_ddp(strategy)
            self._start = self._last = self._counters_now(strategy)
            self._last_step = trainer.global_step
            return
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
        if not isinstance(trainer.strategy, OnebitStrategy):
            self._log_ddp_step(pl_module)
            if self._local_steps is not None:
                self._time_local_step(trainer, self._local_steps)
            if isinstance(trainer.strategy, OnebitFSDPStrategy):
                optimizer = trainer.strategy.onebit_optimizer
                frozen = None if optimizer is None else optimizer.freeze_step
                compressed = frozen is not None and optimizer.step_count > frozen
                shown = {"comm/stage": 1.0 if compressed else 0.0}
                if optimizer is not None and optimizer.auto_freeze is not None and frozen is not None:
                    shown["onebit/freeze_step"] = float(frozen)
                pl_module.log_dict(shown, on_step=True, on_epoch=False, batch_size=1)
            return
        now_s = time.perf_counter()
        step_s = None if self._last_time is None else now_s - self._last_time
        self._last_time = now_s
        optimizer = onebit_optimizer(trainer, "CommunicationMonitor")
        strategy = onebit_strategy(trainer, "CommunicationMonitor")
        now = strategy.communication
        step = now - self._last
        self._last = now
        span_s, self._last_span = strategy.gradient_sync.span_s - self._last_span, strategy.gradient_sync.span_s
        frozen = optimizer.freeze_step
        compressed = frozen is not None and optimizer.step_count > frozen
        stage = 1.0 if compressed else 0.0
        ratio = _ratio(step)
        metrics = dict(_step_metrics(step, now - self._start),
                       **{"comm/bytes_sent_uncompressed": float(step.bytes_sent_uncompressed),
                          "comm/hook_ms": 1000.0 * step.hook_s})
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

    def on_validation_end(self, trainer: "pl.Trainer", pl_module: "pl.LightningModule") -> None:
        if self._local_steps is not None:  # the next step's wall time holds this validation: not a step's
            self._local_steps.pause()

    def on_train_end(self, trainer: "pl.Trainer", pl_module: "pl.LightningModule") -> None:
        if self._local_steps is not None:
            rank_zero_info(f"CommunicationMonitor: no local-steps advice: {self._local_steps.why_no_advice()}")
            self._local_steps = None

    def _time_local_step(self, trainer: "pl.Trainer", timer: LocalStepsTimer) -> None:
        """Time one ``onebit_diloco`` step; once enough are timed (at the same step on every rank), advise."""
        timer.record()
        if not timer.ready:
            return
        self._local_steps = None
        advice = self.advice = timer.advice()
        rank_zero_info(f"onebit_diloco advisor: {advice.message()}")
        _log_once(trainer, advice.metrics())

    # -- strategy="ddp": the baseline ----------------------------------------------------------------------------------
    def _start_counting_ddp(self, strategy: DDPStrategy) -> None:
        """Register the counting hook on this fit's DDP wrapper (Lightning wraps the module anew in every ``fit``),
        unless the run already has a communication hook of its own: DDP takes only one."""
        ddp = strategy.model
        if not isinstance(ddp, DistributedDataParallel):  # not wrapped (one process): nothing is sent
            self._ddp_sync, self._ddp_hooked = GradientSyncState(), None
            return
        if self._ddp_hooked is not None and self._ddp_hooked() is ddp:
            return  # this wrapper has the counting hook already
        # hooks registered with register_comm_hook are listed in _comm_hooks; a built-in (C++) one is not, and
        # shows up as the RuntimeError below
        foreign = bool(getattr(ddp, "_comm_hooks", None))
        state = None
        if not foreign:
            env = strategy.cluster_environment
            assert env is not None  # set by the Trainer before setup
            # a flat plan creates no process group: it only gathers every rank's node, to split intra/inter bytes
            topology = Topology.build(env.node_rank(), env.local_rank(), mode="flat", group=ddp.process_group)
            state = GradientSyncState(process_group=ddp.process_group, topology=topology)
            try:
                ddp.register_comm_hook(state, switchable_allreduce_hook)
            except RuntimeError:  # "register_comm_hook or register_builtin_comm_hook can only be called once"
                foreign, state = True, None
        self._ddp_sync, self._ddp_hooked = state, weakref.ref(ddp)
        if foreign and not self._warned_foreign_hook:
            self._warned_foreign_hook = True
            rank_zero_warn(
                "CommunicationMonitor: this DDP run already has a communication hook (e.g. ddp_comm_hook=...) and DDP "
                "takes only one: DDP's gradient bytes are not counted in this run (training is unaffected)"
            )

    def _counters_now(self, strategy: Any) -> Optional[CommunicationCounters]:
        """This rank's cumulative counters now (``None``: plain DDP with a hook of the user's, nothing counted)."""
        if isinstance(strategy, (OnebitStrategy, OnebitFSDPStrategy, *_LOCAL_STEPS)):
            return strategy.communication
        if self._ddp_sync is None:
            return None
        self._ddp_sync.settle_timings()
        return self._ddp_sync.counters.snapshot()

    def _log_ddp_step(self, pl_module: "pl.LightningModule") -> None:
        """Log one plain-DDP optimizer step under the warmup's metric names."""
        assert self._strategy is not None
        now = self._counters_now(self._strategy)
        if now is None or self._last is None or self._start is None:
            return
        step, self._last = now - self._last, now
        metrics = dict(_step_metrics(step, now - self._start), **{"comm/compression_ratio": _ratio(step)})
        pl_module.log_dict(metrics, on_step=True, on_epoch=False, batch_size=1)

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
                self._warmup.append((step_s, step.exposed_s, span_s, step.bytes_sent, step.bytes_fp32_equivalent))
            return
        if self.advice is None:
            # The first compressed step: every rank is here (the stage is rank-identical), so the reduction is safe.
            if not self._warmup:
                self._advice_done = True  # resumed in the compression stage, or too short a warmup to time
                rank_zero_info(
                    "CommunicationMonitor: no compression advice: no warmup step was timed in this fit (more than "
                    f"{self.SETTLING_STEPS} warmup steps are needed); {_ADVISOR_DOCS}"
                )
                return
            step_times, exposed, spans, sent, fp32 = zip(*self._warmup)
            # a warmup exchange that sent fewer bytes than fp32 (bf16, int8, PowerSGD, a hook of the user's)
            compressed_warmup = float(sum(sent) < sum(fp32))
            figures = _reduce_max(
                strategy,
                [statistics.median(step_times), -statistics.median(exposed), statistics.median(spans),
                 statistics.median(sent), step.bytes_sent, compressed_warmup],
            )
            self.advice = CompressionAdvice(
                warmup_steps=len(self._warmup),
                step_s=figures[0],
                exposed_s=-figures[1],
                span_s=figures[2],
                warmup_bytes=figures[3],
                compressed_bytes=figures[4],
                overlap=strategy.overlap_state is not None and strategy.overlap_state.enabled,
                warmup_compressed=bool(figures[5]),
            )
            self._warmup.clear()
            rank_zero_info(f"onebit_adam advisor: {self.advice.message()}{self._note}; {_ADVISOR_DOCS}")
            logged = {"advisor/warmup_step_ms": 1000.0 * self.advice.step_s,
                      "advisor/exposed_ms": 1000.0 * self.advice.exposed_s}
            if not self.advice.warmup_compressed:  # else no estimate was made
                logged["advisor/expected_step_ms"] = 1000.0 * self.advice.expected_step_s
            _log_once(trainer, logged)
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
        rank_zero_info(f"onebit_adam advisor: {self.advice.measured_message()}{self._note}; {_ADVISOR_DOCS}")
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
                "compressed step before its local steps (which send only a 1-bit sync now and then); "
                f"{_ADVISOR_DOCS}"
            )
        elif self._compressed:
            self._measured(trainer, strategy)
        else:
            self._advice_done = True
            rank_zero_info(
                f"onebit_adam advisor: the 1-bit steps were not measured: {type(optimizer).__name__}'s local steps "
                f"began before a 1-bit step after the estimate's first {self.SETTLING_STEPS} could be timed; "
                f"{_ADVISOR_DOCS}"
            )


def _monitored_strategy(trainer: "pl.Trainer") -> Any:
    """The Trainer's strategy when the monitor can count it (``onebit_adam``, ``onebit_fsdp``, ``onebit_diloco``,
    ``onebit_diloco_fsdp``, or plain DDP), else a clear error."""
    strategy = trainer.strategy
    if isinstance(strategy, (OnebitStrategy, OnebitFSDPStrategy, *_LOCAL_STEPS, DDPStrategy)):
        return strategy
    raise ValueError(
        "CommunicationMonitor needs one of the strategies 'onebit_adam', 'onebit_fsdp', 'onebit_diloco' or "
        "'onebit_diloco_fsdp' (lightning_onebit.OnebitStrategy, OnebitFSDPStrategy, OnebitDiLoCoStrategy, "
        "OnebitDiLoCoFSDPStrategy) or plain DDP "
        f"(strategy='ddp', the baseline to compare with), but the Trainer uses {type(strategy).__name__}. Pass "
        "Trainer(strategy='onebit_adam') or Trainer(strategy='ddp'), or remove the callback."
    )


def _log_once(trainer: "pl.Trainer", metrics: dict[str, float]) -> None:
    """Send ``metrics`` to the Trainer's loggers at this step only (``LightningModule.log`` would repeat them at every
    logging step after this one)."""
    for logger in trainer.loggers:
        logger.log_metrics(metrics, step=trainer.global_step)


def _reduce_max(strategy: OnebitStrategy, values: list[float]) -> list[float]:
    """Elementwise maximum over the ranks of the strategy's process group (:func:`~lightning_onebit.comm.agree`, one
    small ``all_reduce``)."""
    group = None if strategy.onebit_optimizer is None else strategy.onebit_optimizer.process_group
    tensor = torch.tensor(values, dtype=torch.float64, device=strategy.root_device)
    return agree(tensor, group, reduce="max").tolist()


def _step_metrics(step: CommunicationCounters, run: CommunicationCounters) -> dict[str, float]:
    """The per-step figures logged for both strategies: ``step``, this step's counters; ``run``, this fit's so far."""
    return {
        "comm/bytes_sent": float(step.bytes_sent),
        "comm/bytes_received": float(step.bytes_received),
        "comm/bytes_sent_intra_node": float(step.bytes_sent_intra_node),
        "comm/bytes_sent_inter_node": float(step.bytes_sent_inter_node),
        "comm/bytes_fp32_equivalent": float(step.bytes_fp32_equivalent),
        "comm/bytes_sent_total": float(run.bytes_sent),
        "comm/time_ms": 1000.0 * step.time_s,
        "comm/exposed_ms": 1000.0 * step.exposed_s,
    }


def _ratio(step: CommunicationCounters) -> float:
    """fp32-equivalent bytes over the bytes sent (0 when nothing was sent)."""
    return step.bytes_fp32_equivalent / step.bytes_sent if step.bytes_sent else 0.0
