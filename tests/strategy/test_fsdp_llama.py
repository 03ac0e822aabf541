"""A Llama-style model ported to ``onebit_fsdp`` the way users write one (a regression test of the whole path), on 4
gloo ranks as 2 simulated nodes x 2: RMSNorm, rotary positions, attention and SwiGLU blocks, the embedding tied to
the output layer (:mod:`tests.llama_models`); the LightningModule shards itself in ``configure_model`` with the
strategy's mesh (each block, then the root); every process builds its own random weights (no ``seed_everything``);
``precision="bf16-mixed"``; activation checkpointing on the blocks; 1-bit Adam with a 3-step warmup; a distributed
checkpoint saved mid-run by ``ModelCheckpoint``.

* ``ReplicaCheck`` after every step: the replicas of each shard stay bitwise identical throughout (from the first
  step: the strategy broadcast the first replica's shards at setup);
* the run resumed from the mid-run checkpoint, in processes that build yet other random weights, is bitwise the
  uninterrupted one: the same losses and the same parameters.
"""

from __future__ import annotations

import os
from typing import Any, Optional

import pytest
import torch

import lightning.pytorch as pl
from lightning.pytorch.callbacks import ModelCheckpoint
from lightning_onebit import OnebitFSDPStrategy, ReplicaCheck
from tests.distributed import run_distributed
from tests.llama_models import LlamaLM, local_shards

FREEZE, SAVE_EVERY, STEPS = 3, 5, 10


def _fit(rank: int, workdir: str, init_seed: int, resume_from: Optional[str] = None) -> dict[str, Any]:
    model = LlamaLM(init_seed, checkpointing=True, freeze_step=FREEZE)
    strategy = OnebitFSDPStrategy(ranks_per_node=2)
    check = ReplicaCheck(every_n_steps=1)
    callbacks: list[Any] = [check]
    if resume_from is None:
        callbacks.append(ModelCheckpoint(dirpath=workdir, every_n_train_steps=SAVE_EVERY, save_top_k=-1))
    trainer = pl.Trainer(accelerator="cpu", devices=4, strategy=strategy, max_steps=STEPS, precision="bf16-mixed",
                         logger=False, enable_progress_bar=False, enable_model_summary=False, callbacks=callbacks,
                         enable_checkpointing=resume_from is None)
    trainer.fit(model, ckpt_path=resume_from)
    return dict(losses=model.losses, shards=local_shards(model), checks=check.checks, stage=strategy.stage.value,
                restored=strategy.error_feedback_restored, logits_dtype=model.logits_dtype,
                forward_passes=[block.forward_passes for block in model.llama.blocks],
                tied=model.llama.embed.weight is model.llama.lm_head.weight,
                buckets_started=strategy.overlap_state.buckets_started)


def scenario_llama(rank: int, world_size: int, workdir: str) -> dict[str, Any]:
    whole = _fit(rank, workdir, init_seed=100 + rank)
    saved = os.path.join(workdir, f"epoch=0-step={SAVE_EVERY}.ckpt")
    resumed = _fit(rank, workdir, init_seed=200 + rank, resume_from=saved)
    return dict(whole=whole, resumed=resumed, saved_is_folder=os.path.isdir(saved))


@pytest.fixture(scope="module")
def runs(tmp_path_factory: pytest.TempPathFactory) -> list[dict[str, Any]]:
    return run_distributed(scenario_llama, 4, str(tmp_path_factory.mktemp("fsdp_llama")), timeout_s=300)


def test_the_replicas_stay_identical_from_the_first_step(runs: list[dict[str, Any]]) -> None:
    for r in runs:
        whole = r["whole"]
        assert whole["checks"] == STEPS and r["resumed"]["checks"] == STEPS - SAVE_EVERY
        assert whole["stage"] == "compression" and whole["tied"] and whole["logits_dtype"] == torch.bfloat16
        # the blocks' forward ran again in backward (activation checkpointing)
        assert whole["forward_passes"] == [2 * STEPS] * 2, whole["forward_passes"]
        # overlapped: 3 FSDP groups started in backward from the second compressed step on
        assert whole["buckets_started"] == 3 * (STEPS - FREEZE - 1)
    assert torch.equal(runs[0]["whole"]["shards"], runs[2]["whole"]["shards"])
    assert torch.equal(runs[1]["whole"]["shards"], runs[3]["whole"]["shards"])


def test_a_resume_from_the_mid_run_checkpoint_is_bitwise_the_uninterrupted_run(runs: list[dict[str, Any]]) -> None:
    for r in runs:
        assert r["saved_is_folder"]  # a distributed checkpoint
        whole, resumed = r["whole"], r["resumed"]
        assert resumed["restored"] is True and resumed["stage"] == "compression"
        assert resumed["losses"] == whole["losses"][SAVE_EVERY:]
        assert torch.equal(resumed["shards"], whole["shards"]), float((resumed["shards"] - whole["shards"]).abs().max())
