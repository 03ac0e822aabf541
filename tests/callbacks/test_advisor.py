"""Tests of "will compression help?": the warmup allreduce's exposed time (GradientSyncState) and the advice
CommunicationMonitor gives at the freeze (CompressionAdvice), with its measured compression-stage step.

The multi-rank tests slow the link down by delaying the completion of every DDP gradient allreduce (the hook's
``all_reduce`` future finishes ``LINK_DELAY_S`` late, as a slow link would), or slow one rank's compute down (a
straggler, which is not communication)."""

from __future__ import annotations

import os
import statistics
import time
import types
from contextlib import contextmanager
from typing import Any, Iterator

import lightning.pytorch as pl
import pytest
import torch
import torch.distributed as dist
from lightning.pytorch.loggers import CSVLogger
from torch import nn

from lightning_onebit import CommunicationMonitor, CompressionAdvice, OnebitStrategy
from lightning_onebit.comm import ring_allreduce_bytes
from lightning_onebit.hooks import GradientSyncState, gradient_sync, switchable_allreduce_hook
from tests.capture import capture_logs, logged_columns
from tests.distributed import run_distributed, run_scenarios, scenario_results
from tests.lightning_models import Regressor, loader, trainer_kwargs

LINK_DELAY_S = 0.12  # added to every gradient allreduce's completion
STRAGGLER_S = 0.3  # rank 1's extra compute per training step: long enough that rank 0 being descheduled on a busy
# machine (a 2-core CI runner) does not make rank 1 wait in the median advised step
FREEZE = 8
ADVISE_STEPS = 3
MAX_STEPS = FREEZE + 2 + ADVISE_STEPS + 1  # 2 settling compressed steps, then the measured ones


# ======================================================================================== CompressionAdvice alone
def advice(**overrides: Any) -> CompressionAdvice:
    figures: dict[str, Any] = dict(
        warmup_steps=20, step_s=1.2, exposed_s=0.31, span_s=0.5, warmup_bytes=64e6, compressed_bytes=2e6, overlap=False
    )
    figures.update(overrides)
    return CompressionAdvice(**figures)


def test_estimate_replaces_the_exposed_allreduce_by_the_compressed_exchange() -> None:
    # without overlap the whole compressed exchange follows backward: the link's busy time, scaled by the bytes
    assert advice().expected_step_s == pytest.approx(1.2 - 0.31 + 0.5 / 32)
    # with overlap only what backward cannot hide: the exposed part, scaled
    assert advice(overlap=True).expected_step_s == pytest.approx(1.2 - 0.31 + 0.31 / 32)
    # bytes that do not shrink leave the step as it was
    assert advice(compressed_bytes=64e6, overlap=True).expected_step_s == pytest.approx(1.2)


def test_message_gives_the_figures_and_says_plainly_when_compression_cannot_help() -> None:
    helpful = advice(overlap=True)
    assert helpful.helps
    text = helpful.message()
    for figure in ("310 ms", "1.20 s", "26%", "20 warmup steps", "2.0 MB", "64.0 MB", "32.0x fewer", "expect about 900 ms"):
        assert figure in text, (figure, text)
    assert "cannot" not in text

    fast_link = advice(exposed_s=0.02, span_s=0.3)  # 2% of the step waits on the link
    assert not fast_link.helps
    assert "expect about" in fast_link.message()
    assert "cannot make steps noticeably faster" in fast_link.message()
    assert "strategy='ddp'" in fast_link.message()

    measured = advice(overlap=True, measured_step_s=0.95, measured_steps=20)
    text = measured.measured_message()
    assert "950 ms" in text and "900 ms estimated" in text and "median of 20 steps" in text and "1.26x" in text


def test_one_process_is_told_there_is_nothing_to_compress() -> None:
    # the example on one GPU (an H200) printed "1-bit steps send 0 B, not 0 B"
    text = advice(warmup_bytes=0, compressed_bytes=0, exposed_s=0.0, step_s=0.037).message()
    assert "sent nothing" in text and "one process" in text and "strategy='auto'" in text, text
    assert "0 B" not in text and "37 ms" in text and "median of 20" in text, text
    assert not advice(warmup_bytes=0, compressed_bytes=0, exposed_s=0.0).helps


def test_advise_steps_is_checked() -> None:
    for bad in (0, -1, 2.5, True, "20"):
        with pytest.raises(ValueError, match="advise_steps must be an integer >= 1"):
            CommunicationMonitor(advise_steps=bad)


# ======================================================================================== a slow link, simulated
class _LateWork:
    """A collective's work whose future completes ``delay_s`` after the real one (on the backend's thread)."""

    def __init__(self, work: Any, delay_s: float) -> None:
        self._work, self._delay_s = work, delay_s

    def get_future(self) -> torch.futures.Future:
        def late(done: torch.futures.Future) -> Any:
            time.sleep(self._delay_s)
            return done.value()

        return self._work.get_future().then(late)


@contextmanager
def slow_gradient_allreduce(delay_s: float) -> Iterator[None]:
    """Delay the completion of the DDP gradient allreduces that ``lightning_onebit.hooks.gradient_sync`` launches."""

    def all_reduce(tensor: torch.Tensor, *args: Any, **kwargs: Any) -> Any:
        return _LateWork(dist.all_reduce(tensor, *args, **kwargs), delay_s)

    real = gradient_sync.dist
    gradient_sync.dist = types.SimpleNamespace(**{**vars(dist), "all_reduce": all_reduce})
    try:
        yield
    finally:
        gradient_sync.dist = real


# ======================================================================================== GradientSyncState on DDP
def _ddp_exposed(rank: int, world_size: int, delay_s: float, straggler_s: float, steps: int) -> dict[str, Any]:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(64, 256), nn.Tanh(), nn.Linear(256, 256), nn.Tanh(), nn.Linear(256, 1))
    # small buckets, so that several allreduces are in flight in one backward
    ddp = torch.nn.parallel.DistributedDataParallel(model, bucket_cap_mb=0.1)
    state = GradientSyncState()
    ddp.register_comm_hook(state, switchable_allreduce_hook)
    per_step = []
    with slow_gradient_allreduce(delay_s):
        for step in range(steps):
            x = torch.randn(32, 64, generator=torch.Generator().manual_seed(step * world_size + rank))
            loss = ddp(x).square().mean()
            if rank == 1:
                time.sleep(straggler_s)  # compute the other rank has to wait for
            before, span_before = state.counters.snapshot(), state.span_s
            loss.backward()
            per_step.append(((state.counters - before).exposed_s, state.span_s - span_before))
    return dict(per_step=per_step, calls=state.counters.calls)


@pytest.mark.parametrize("world_size", [2, 3])
def test_exposed_time_is_the_wait_for_the_link_after_backward(world_size: int) -> None:
    steps = 4
    results = run_distributed(_ddp_exposed, world_size, LINK_DELAY_S, 0.0, steps)
    for rank, result in enumerate(results):
        # DDP's first backward has one bucket of at most 1 MiB, the rebuilt ones several
        assert result["calls"] >= 1 + 2 * (steps - 1), result["calls"]
        for step, (exposed, span) in enumerate(result["per_step"]):
            # every allreduce completes LINK_DELAY_S late, the last bucket's too: backward waits at least that long,
            # once per backward (not once per bucket)
            assert LINK_DELAY_S * 0.9 <= exposed, (rank, step, exposed)
            assert exposed <= span < 10 * LINK_DELAY_S * (result["calls"] // steps), (rank, step, exposed, span)


def test_a_straggler_shows_as_exposed_time_on_the_other_ranks_only() -> None:
    results = run_distributed(_ddp_exposed, 2, 0.0, STRAGGLER_S, 6)
    rank0 = [exposed for exposed, _ in results[0]["per_step"]]
    rank1 = [exposed for exposed, _ in results[1]["per_step"]]
    # rank 0 launched its allreduces STRAGGLER_S before rank 1 joined them; rank 1 found rank 0 waiting. Medians over
    # the steps: on a loaded machine a descheduled rank can wait (or make its peer wait) in a step or two, and the
    # first step starts with whatever skew the processes' start-up left (the min and max failed under a load of ~10)
    assert statistics.median(rank0) >= 0.7 * STRAGGLER_S, rank0
    assert statistics.median(rank1) < 0.3 * STRAGGLER_S, rank1


# ======================================================================================== CommunicationMonitor's advice
class SlowRankRegressor(Regressor):
    """``Regressor`` whose rank ``slow_rank`` computes ``extra_s`` longer every training step."""

    def __init__(self, slow_rank: int = -1, extra_s: float = 0.0, **kwargs: Any) -> None:
        super().__init__(**kwargs)
        self.slow_rank, self.extra_s = slow_rank, extra_s

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        if self.global_rank == self.slow_rank:
            time.sleep(self.extra_s)
        return super().training_step(batch, batch_idx)


def _fit_with_monitor(rank: int, world_size: int, workdir: str, name: str, warmup_exchange: str = "fp32",
                      **model_kwargs: Any) -> dict[str, Any]:
    monitor = CommunicationMonitor(advise_steps=ADVISE_STEPS)
    model = SlowRankRegressor(freeze_step=FREEZE, **model_kwargs)
    logger = CSVLogger(workdir, name=name, version=0)
    trainer = pl.Trainer(
        # the fp32 warmup: what slow_gradient_allreduce slows (whatever the library's default warmup exchange)
        **trainer_kwargs(world_size, MAX_STEPS, callbacks=[monitor], logger=logger, log_every_n_steps=1,
                         strategy=OnebitStrategy(warmup_exchange=warmup_exchange))
    )
    with capture_logs() as messages:
        trainer.fit(model, loader(rank, MAX_STEPS))
    onebit = trainer.strategy.onebit_optimizer
    n_params = sum(p.numel() for p in model.parameters())
    return dict(
        advice=monitor.advice,
        messages=[m for m in messages if "advisor" in m],
        csv=os.path.join(logger.log_dir, "metrics.csv"),
        compressed_bytes_per_step=onebit.communication.bytes_sent / (MAX_STEPS - FREEZE),
        fp32_bytes=ring_allreduce_bytes(n_params, 4, world_size),
    )


def scenario_slow_link(rank: int, world_size: int, workdir: str) -> dict[str, Any]:
    with slow_gradient_allreduce(LINK_DELAY_S):
        return _fit_with_monitor(rank, world_size, workdir, "slow_link")


def scenario_straggler(rank: int, world_size: int, workdir: str) -> dict[str, Any]:
    return _fit_with_monitor(rank, world_size, workdir, "straggler", slow_rank=1, extra_s=STRAGGLER_S)


def scenario_bf16_warmup(rank: int, world_size: int, workdir: str) -> dict[str, Any]:
    # bf16: half the bytes whatever the shapes (PowerSGD would leave this small model's matrices uncompressed)
    return _fit_with_monitor(rank, world_size, workdir, "bf16", warmup_exchange="bf16")


def _advice_ranks(rank: int, world_size: int, workdir: str) -> dict[str, Any]:
    scenarios = (("slow_link", scenario_slow_link), ("straggler", scenario_straggler),
                 ("bf16_warmup", scenario_bf16_warmup))
    return run_scenarios(rank, world_size, scenarios, workdir)


@pytest.fixture(scope="module")
def session(tmp_path_factory: pytest.TempPathFactory) -> list[dict[str, Any]]:
    return run_distributed(_advice_ranks, 2, str(tmp_path_factory.mktemp("advisor")), timeout_s=240.0)


def test_slow_link_advice_expects_a_faster_step_and_measures_it(session: list[dict[str, Any]]) -> None:
    results = scenario_results(session, "slow_link")
    a = results[0]["advice"]
    assert a is not None and results[1]["advice"] == a  # one advice, agreed by every rank
    # the figures behind it: the warmup's fp32 allreduce bytes, and what a compressed step sent
    assert a.warmup_bytes == results[0]["fp32_bytes"]
    assert a.compressed_bytes == max(r["compressed_bytes_per_step"] for r in results)
    assert a.warmup_steps == ADVISE_STEPS and a.overlap  # the last ADVISE_STEPS of FREEZE - 2 timed warmup steps
    # every step waited for the delayed allreduce after backward
    assert a.exposed_s >= 0.9 * LINK_DELAY_S and a.step_s >= a.exposed_s
    assert a.expected_step_s == pytest.approx(a.step_s - a.exposed_s + a.exposed_s * a.compressed_bytes / a.warmup_bytes)
    assert a.helps
    # the compression stage does not wait for the link, and the callback measured it
    assert a.measured_steps == ADVISE_STEPS
    assert a.measured_step_s is not None and a.measured_step_s < a.step_s - 0.5 * LINK_DELAY_S
    # said on rank 0 only, and logged
    estimate, measured = results[0]["messages"]
    assert "expect about" in estimate and "cannot" not in estimate
    assert "compression-stage step measured" in measured
    assert all(m.endswith("; see docs/guides/why-no-speedup.md") for m in (estimate, measured)), (estimate, measured)
    assert results[1]["messages"] == []
    logged = logged_columns(results[0]["csv"], "advisor/")
    assert logged["advisor/exposed_ms"] == [pytest.approx(1000 * a.exposed_s)]
    assert logged["advisor/expected_step_ms"] == [pytest.approx(1000 * a.expected_step_s)]
    assert logged["advisor/measured_step_ms"] == [pytest.approx(1000 * a.measured_step_s)]


def test_a_straggler_is_not_mistaken_for_a_slow_link(session: list[dict[str, Any]]) -> None:
    results = scenario_results(session, "straggler")
    a = results[0]["advice"]
    assert a is not None and results[1]["advice"] == a
    # rank 0 waits for rank 1 after every backward, but rank 1 never waits: with 1-bit compression rank 1 would still
    # set the pace, so the advice takes the least-waiting rank's exposed time
    assert a.step_s >= STRAGGLER_S and a.exposed_s < 0.5 * STRAGGLER_S
    assert not a.helps
    assert "cannot make steps noticeably faster" in results[0]["messages"][0]


def test_a_compressed_warmup_gives_no_estimate_only_the_measurement(session: list[dict[str, Any]]) -> None:
    # a PowerSGD warmup's exchange time is partly PowerSGD's own work: an estimate scaled by the 1-bit exchange's
    # bytes over PowerSGD's said 3.41 s against 1.82 s measured on a real task (mail corpus, 2 ranks)
    results = scenario_results(session, "bf16_warmup")
    a = results[0]["advice"]
    assert a is not None and results[1]["advice"] == a
    assert a.warmup_compressed and a.expected_step_s == a.step_s and not a.helps
    assert a.measured_steps == ADVISE_STEPS and a.measured_step_s is not None
    estimate, measured = results[0]["messages"]
    assert "compressed gradients" in estimate and "not estimated but measured" in estimate, estimate
    assert "expect about" not in estimate
    assert "in the compressed warmup" in measured, measured
    logged = logged_columns(results[0]["csv"], "advisor/")
    assert "advisor/expected_step_ms" not in logged and "advisor/measured_step_ms" in logged
    # the fp32 warmup of the other scenarios is not taken for a compressed one
    assert not scenario_results(session, "slow_link")[0]["advice"].warmup_compressed


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available() or not dist.is_nccl_available(), reason="needs CUDA and NCCL")
def test_exposed_time_on_cuda_is_measured_with_events() -> None:
    """One NCCL rank in this process: the exposed time and span come from CUDA events, read back by settle_timings."""
    dist.init_process_group("nccl", store=dist.HashStore(), rank=0, world_size=1)
    try:
        torch.manual_seed(0)
        model = nn.Sequential(nn.Linear(256, 1024), nn.Tanh(), nn.Linear(1024, 1)).cuda()
        ddp = torch.nn.parallel.DistributedDataParallel(model, bucket_cap_mb=1)
        state = GradientSyncState()
        ddp.register_comm_hook(state, switchable_allreduce_hook)
        for _ in range(3):
            ddp(torch.randn(64, 256, device="cuda")).square().mean().backward()
        torch.cuda.synchronize()
        assert state.counters.exposed_s == 0.0 and state.span_s == 0.0  # not read back yet
        state.settle_timings()
        assert 0.0 <= state.counters.exposed_s <= state.span_s < 10.0 and state.span_s > 0.0
        assert state.timings.unsettled == 0
    finally:
        dist.destroy_process_group()
