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
