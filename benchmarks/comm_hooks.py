"""DDP communication hooks the benchmarks share, and the DDP baselines of the real-task sweeps.

* :func:`bf16_compress_hook_any_backend`: torch's ``bf16_compress_hook`` registrable on gloo (``slow_link``);
* :class:`CountedDDPStrategy`: Lightning's ``DDPStrategy`` whose gradient average is one of :data:`EXCHANGES`
  (fp32 allreduce, torch's bf16 hook, torch's PowerSGD, the library's 8-bit exchange), registered on the DDP model on
  every device and counted, for the example's DDP baselines (``freeze_sweep``'s ``ddp_bf16`` and
  ``ddp_powersgd_rR@F`` runs). Lightning's ``DDPStrategy(ddp_comm_hook=...)`` registers its hook on CUDA only: on CPU
  it is silently ignored. This strategy registers on any device and fails the run when the exchange did not run;
* :func:`onebit_exchange_args`: the example's arguments that give ``OnebitStrategy``'s warmup the same exchanges by
  name (``--trainer.strategy.warmup_exchange``: the library's int8 and PowerSGD exchanges, whose state is kept per
  parameter; the DDP baselines' PowerSGD stays torch's, what a DDP user has).

Bytes are counted as the library counts its warmup (:class:`~lightning_onebit.hooks.GradientSyncState`, the counter
of ``CommunicationMonitor``'s DDP baseline too): ring allreduces in the gradient's dtype (fp32), in bf16 for torch's
bf16 hook, and what the PowerSGD and 8-bit states count for their collectives
(:class:`~lightning_onebit.hooks.OrderedPowerSGDState`, :class:`~lightning_onebit.hooks.Int8AllreduceState`).
"""

from __future__ import annotations

from typing import Any, Literal, Optional

from lightning.pytorch.strategies import DDPStrategy
from torch.distributed.algorithms.ddp_comm_hooks import default_hooks
from torch.distributed.algorithms.ddp_comm_hooks.powerSGD_hook import PowerSGDState
from torch.nn.parallel import DistributedDataParallel

from lightning_onebit._checks import check_integer
from lightning_onebit.comm import CommunicationCounters
from lightning_onebit.hooks import GradientSyncState, Int8AllreduceState, OrderedPowerSGDState, int8_allreduce_hook
from lightning_onebit.hooks import ordered_powersgd_hook, switchable_allreduce_hook

#: The gradient averages a run can name
EXCHANGES = ("fp32", "bf16", "powersgd", "int8")
Exchange = Literal["fp32", "bf16", "powersgd", "int8"]



def bf16_compress_hook_any_backend(process_group, bucket):  # type: ignore[no-untyped-def]
    """torch's ``bf16_compress_hook``, unchanged, under another name: DDP refuses to register a hook *named*
    ``bf16_compress_hook`` unless CUDA+NCCL or XPU+XCCL is present, although the hook is plain Python (cast to bf16,
    ``dist.all_reduce``, cast back) and gloo allreduces bf16 tensors. (No annotations: DDP checks them as objects.)"""
    return default_hooks.bf16_compress_hook(process_group, bucket)


def powersgd_state(rank: int, start_iter: int) -> PowerSGDState:
    """torch's ``PowerSGDState`` as the sweeps use it: ``matrix_approximation_rank=rank``, ``start_powerSGD_iter=
    start_iter`` (vanilla allreduces before it), error feedback and warm start on (torch's defaults), WORLD."""
    return PowerSGDState(None, matrix_approximation_rank=rank, start_powerSGD_iter=start_iter, use_error_feedback=True,
                         warm_start=True)


def exchange_hook(exchange: Exchange, powersgd_rank: int = 4, powersgd_start: int = 2,
                  int8_segment_numel: int = 1024) -> tuple[Optional[Any], Any]:
    """``(hook, state)`` of an exchange for :class:`~lightning_onebit.hooks.GradientSyncState`'s ``averaging_hook``
    (``(None, None)``: the plain fp32 ``mean`` allreduce)."""
    if exchange == "fp32":
        return None, None
    if exchange == "bf16":
        return default_hooks.bf16_compress_hook, None
    if exchange == "powersgd":
        return ordered_powersgd_hook, OrderedPowerSGDState(powersgd_state(powersgd_rank, powersgd_start))
    if exchange == "int8":
        return int8_allreduce_hook, Int8AllreduceState(segment_numel=int8_segment_numel)
    raise ValueError(f"gradient_exchange must be one of {', '.join(EXCHANGES)}, got {exchange!r}")


def onebit_exchange_args(exchange: Exchange, powersgd_rank: int = 4, powersgd_start: int = 2) -> list[str]:
    """The example's arguments that make a 1-bit run's warmup average with ``exchange`` (``OnebitStrategy(
    warmup_exchange=..., powersgd_rank=..., powersgd_vanilla_steps=...)``), fp32 included: it is no longer the
    strategy's default."""
    args = ["--trainer.strategy", "lightning_onebit.OnebitStrategy", "--trainer.strategy.warmup_exchange", exchange]
    if exchange == "powersgd":
        args += ["--trainer.strategy.powersgd_rank", str(powersgd_rank), "--trainer.strategy.powersgd_vanilla_steps",
                 str(powersgd_start)]
    return args


class CountedDDPStrategy(DDPStrategy):
    """Lightning's DDP whose gradient average is ``gradient_exchange``, registered on the DDP model on every device
    (CPU too), counted (:attr:`communication`), and checked: a fit whose exchange did not run, or whose PowerSGD never
    compressed although the run outlasted ``powersgd_start``, raises at the end of training.

    Args:
        gradient_exchange: ``"fp32"`` (DDP's ``mean`` allreduce), ``"bf16"`` (torch's ``bf16_compress_hook``),
            ``"powersgd"`` (torch's PowerSGD through :func:`~lightning_onebit.hooks.ordered_powersgd_hook`: rank
            ``powersgd_rank``, error feedback and warm start, vanilla allreduce for the first ``powersgd_start``
            steps) or ``"int8"`` (:func:`~lightning_onebit.hooks.int8_allreduce_hook`). Default ``"fp32"``.
        powersgd_rank: PowerSGD's ``matrix_approximation_rank``, an integer >= 1. Default 4.
        powersgd_start: PowerSGD's ``start_powerSGD_iter``, in optimizer steps (torch requires >= 2 with error
            feedback). Default 2.
        ddp_kwargs: further ``DDPStrategy`` arguments (e.g. ``{"start_method": "popen"}``).
    """

    def __init__(self, gradient_exchange: Exchange = "fp32", powersgd_rank: int = 4, powersgd_start: int = 2,
                 ddp_kwargs: Optional[dict[str, Any]] = None) -> None:
        if gradient_exchange not in EXCHANGES:
            raise ValueError(f"gradient_exchange must be one of {', '.join(EXCHANGES)}, got {gradient_exchange!r}")
        check_integer(powersgd_rank, "powersgd_rank")
        check_integer(powersgd_start, "powersgd_start", at_least=2,
                      fix="torch's PowerSGD with error feedback starts compressing at iteration 2 at the earliest")
        super().__init__(**(ddp_kwargs or {}))
        self.gradient_exchange = gradient_exchange
        self.powersgd_rank, self.powersgd_start = powersgd_rank, powersgd_start
        hook, state = exchange_hook(gradient_exchange, powersgd_rank, powersgd_start)
        self.exchange_state = state
        self.gradient_sync = GradientSyncState(averaging_hook=hook, averaging_hook_state=state)

    @property
    def communication(self) -> CommunicationCounters:
        """This rank's gradient averages since the strategy was made: bytes, collectives, calls."""
        self.gradient_sync.settle_timings()
        return self.gradient_sync.counters.snapshot()

    def _register_ddp_hooks(self) -> None:
        # DDPStrategy registers ddp_comm_hook on CUDA only; this one runs on every device
        assert isinstance(self.model, DistributedDataParallel)
        self.gradient_sync.process_group = self.model.process_group
        self.model.register_comm_hook(self.gradient_sync, switchable_allreduce_hook)

    def exchange_report(self) -> dict[str, Any]:
        """What the exchange did: its name, bucket calls, and for PowerSGD the buckets averaged before
        ``powersgd_start`` (vanilla) and compressed."""
        report: dict[str, Any] = dict(exchange=self.gradient_exchange, calls=self.gradient_sync.counters.calls)
        if isinstance(self.exchange_state, OrderedPowerSGDState):
            report.update(rank=self.powersgd_rank, start=self.powersgd_start,
                          vanilla_buckets=self.exchange_state.vanilla_buckets,
                          compressed_buckets=self.exchange_state.compressed_buckets)
        return report

    def on_train_end(self) -> None:
        super().on_train_end()
        steps = self.lightning_module.trainer.global_step
        report = self.exchange_report()
        if steps > 0 and self.world_size > 1 and report["calls"] == 0:
            raise RuntimeError(f"CountedDDPStrategy: the {self.gradient_exchange} gradient exchange never ran in "
                               f"{steps} steps (its DDP comm hook was not called)")
        if report.get("compressed_buckets") == 0 and steps > self.powersgd_start and self.world_size > 1:
            raise RuntimeError(f"CountedDDPStrategy: PowerSGD never compressed in {steps} steps (start "
                               f"{self.powersgd_start}): {report}")

    def teardown(self) -> None:
        # the hook's state holds DDP's process group: let go of it with DDP (a gloo group freed while the interpreter
        # finalises can abort a finished run); the counts stay readable
        self.gradient_sync.process_group = None
        super().teardown()

