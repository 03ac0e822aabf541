"""OnebitStrategy(ddp_comm_hook=...): the warmup averages gradients with the user's DDP comm hook (here torch's
bf16_compress_hook, on CPU gloo), counts its bytes on the wire, and leaves the compression stage as it was."""

from __future__ import annotations

from typing import Any

import pytest
import torch
from torch.distributed.algorithms.ddp_comm_hooks import default_hooks

import lightning.pytorch as pl
from lightning_onebit import OnebitStrategy
from lightning_onebit.comm import ring_allreduce_bytes
from tests.distributed import run_distributed
from tests.lightning_models import Regressor, batch, hand_gradient, loader, trainer_kwargs

WORLD_SIZE, FREEZE, STEPS = 2, 3, 5


def _bf16_hook_run(rank: int, world_size: int) -> dict[str, Any]:
    model = Regressor(freeze_step=FREEZE)
    strategy = OnebitStrategy(ddp_comm_hook=default_hooks.bf16_compress_hook)
    trainer = pl.Trainer(**trainer_kwargs(world_size, STEPS, strategy=strategy))
    trainer.fit(model, loader(rank, STEPS))
    sync = trainer.strategy.gradient_sync.counters
    return dict(records=[dict(r) for r in model.records], warmup_bytes=sync.bytes_sent,
                warmup_fp32_bytes=sync.bytes_fp32_equivalent, warmup_calls=sync.calls,
                n_params=sum(p.numel() for p in model.parameters()))


def test_bf16_warmup_hook_averages_in_bf16_and_counts_half_the_bytes() -> None:
    results = run_distributed(_bf16_hook_run, WORLD_SIZE, timeout_s=120)
    records = [r["records"] for r in results]
    for step in range(STEPS):
        params_before = records[0][step]["params_before"]
        local = [hand_gradient(params_before, *batch(r, STEPS, step)) for r in range(WORLD_SIZE)]
        grads = [rs[step]["grad"] for rs in records]
        if step < FREEZE:
            # bf16_compress_hook: each rank's bucket cast to bf16 and divided by the world size, summed in bf16,
            # copied back to fp32 (two addends: the sum's order cannot matter)
            expected = sum(g.to(torch.bfloat16).div_(WORLD_SIZE) for g in local).to(torch.float32)
            for g in grads:
                assert torch.equal(g, expected), f"warmup step {step}"
            assert not torch.equal(expected, torch.stack(local).mean(0))  # bf16 really differs from the fp32 mean
        else:  # the compression stage does not average gradients
            for r in range(WORLD_SIZE):
                torch.testing.assert_close(grads[r], local[r], rtol=1e-5, atol=1e-6)
        assert torch.equal(records[0][step]["params_after"], records[1][step]["params_after"]), step
    for r in results:
        # one DDP bucket per warmup backward, counted as a ring allreduce of 2-byte elements
        assert r["warmup_calls"] == FREEZE
        assert r["warmup_bytes"] == FREEZE * ring_allreduce_bytes(r["n_params"], 2, WORLD_SIZE)
        assert r["warmup_fp32_bytes"] == 2 * r["warmup_bytes"]


@pytest.mark.parametrize(
    ("ddp_kwargs", "match"),
    [
        ({"ddp_comm_hook": default_hooks.bf16_compress_hook}, r"strategy argument ddp_comm_hook=\.\.\."),
        ({"ddp_comm_state": None}, r"strategy argument ddp_comm_state=\.\.\."),
        ({"bucket_cap_mb": 5}, r"strategy argument ddp_bucket_cap_mb=\.\.\."),
        ({"ddp_comm_wrapper": default_hooks.bf16_compress_wrapper}, "wrap the hook yourself"),
        ({"model_averaging_period": 4}, "post-local SGD"),
    ],
)
def test_hook_arguments_inside_ddp_kwargs_are_refused_with_the_fix(ddp_kwargs: dict, match: str) -> None:
    with pytest.raises(ValueError, match=match):
        OnebitStrategy(ddp_kwargs=ddp_kwargs)


def test_a_hook_that_is_not_callable_is_refused() -> None:
    with pytest.raises(ValueError, match="ddp_comm_hook must be a DDP comm hook"):
        OnebitStrategy(ddp_comm_hook="bf16")


PSGD_FREEZE, PSGD_START = 4, 2


def _counted_hook_run(rank: int, world_size: int, kind: str) -> dict[str, Any]:
    from torch.distributed.algorithms.ddp_comm_hooks.powerSGD_hook import PowerSGDState

    from lightning_onebit.hooks import Int8AllreduceState, OrderedPowerSGDState, int8_allreduce_hook
    from lightning_onebit.hooks import ordered_powersgd_hook

    if kind == "powersgd":
        hook, state = ordered_powersgd_hook, OrderedPowerSGDState(
            PowerSGDState(None, matrix_approximation_rank=1, start_powerSGD_iter=PSGD_START))
    else:
        hook, state = int8_allreduce_hook, Int8AllreduceState()
    model = Regressor(freeze_step=PSGD_FREEZE)
    strategy = OnebitStrategy(ddp_comm_hook=hook, ddp_comm_state=state)
    trainer = pl.Trainer(**trainer_kwargs(world_size, STEPS + 1, strategy=strategy))
    trainer.fit(model, loader(rank, STEPS + 1))
    warm = trainer.strategy.warmup_communication
    return dict(warmup_bytes=warm.bytes_sent, warmup_fp32_bytes=warm.bytes_fp32_equivalent,
                warmup_collectives=warm.collectives, warmup_calls=warm.calls, hook_bytes=state.counters.bytes_sent,
                params=[p.detach().clone() for p in model.parameters()])


def test_powersgd_warmup_is_counted_as_the_all_reduces_it_makes() -> None:
    """Regressor (Linear(6, 8), Linear(8, 1)) with PowerSGD rank 1 from warmup step 3: the 8 x 6 weight is compressed
    ((8 + 6) * 1 * 2 = 28 < 48: P 8, Q 6 elements); the 1 x 8 weight and the biases (8 and 1) go uncompressed (17
    elements). Per rank, a ring allreduce over 2 ranks sends 4 bytes per fp32 element: steps 1-2 send the 65
    gradient elements, steps 3-4 the 17 + 8 + 6 of PowerSGD's three allreduces; the compression stage none."""
    for r in run_distributed(_counted_hook_run, WORLD_SIZE, "powersgd", timeout_s=120):
        assert r["warmup_calls"] == PSGD_FREEZE
        assert r["warmup_bytes"] == r["hook_bytes"] == PSGD_START * 4 * 65 + (PSGD_FREEZE - PSGD_START) * 4 * 31, r
        assert r["warmup_collectives"] == PSGD_START + 3 * (PSGD_FREEZE - PSGD_START)
        assert r["warmup_fp32_bytes"] == PSGD_FREEZE * 4 * 65


def test_int8_warmup_is_counted_by_its_own_state() -> None:
    """The 8-bit exchange: the strategy's warmup counters hold what the hook's state counted (about a quarter of the
    fp32 bytes, two collectives a step), and the replicas stay identical."""
    results = run_distributed(_counted_hook_run, WORLD_SIZE, "int8", timeout_s=120)
    for r in results:
        assert r["warmup_calls"] == PSGD_FREEZE and r["warmup_collectives"] == 2 * PSGD_FREEZE
        assert r["warmup_bytes"] == r["hook_bytes"] > 0, r
        # 65 elements padded to 80 (2 chunks of 40) with a few float32 scales: 2 x (4 S + 40) bytes a step
        assert r["warmup_fp32_bytes"] == PSGD_FREEZE * 4 * 65
        assert PSGD_FREEZE * 2 * 40 < r["warmup_bytes"] < r["warmup_fp32_bytes"] / 2, r
    for a, b in zip(results[0]["params"], results[1]["params"]):
        assert torch.equal(a, b)
