"""OnebitStrategy(warmup_exchange=...): the int8 and PowerSGD warmup exchanges under the strategy (2 and 3 gloo ranks,
the example-shaped TinyClassifier in several DDP buckets): a run interrupted mid-warmup (after PowerSGD's vanilla
steps) and resumed from its checkpoint equals the uninterrupted run bit for bit; a checkpoint without the exchange's
state (an older one, or error_feedback="reset") resets it on every rank alike with one message; replicas are
identical after every step; the bytes are counted as by hand; bad arguments fail at construction."""

from __future__ import annotations

import os
from typing import Any, Optional

import pytest
import torch

import lightning.pytorch as pl
from lightning.pytorch.callbacks import ModelCheckpoint
from lightning_onebit import OnebitStrategy
from lightning_onebit.comm import ring_allreduce_bytes
from lightning_onebit.strategy.warmup_exchange import DEFAULT_WARMUP_EXCHANGE, WARMUP_EXCHANGE_KEY
from tests.capture import capture_logs, capture_warnings
from tests.distributed import run_distributed
from tests.lightning_models import TinyClassifier, loader, trainer_kwargs

VANILLA, FREEZE, SAVE_AT, STEPS = 2, 8, 4, 10
BUCKET_CAP_MB = 2e-3  # 2 kB DDP buckets: several, rebuilt after the first step of every process


def _strategy(exchange: str, policy: str = "keep") -> OnebitStrategy:
    powersgd = dict(powersgd_rank=2, powersgd_vanilla_steps=VANILLA) if exchange == "powersgd" else {}
    return OnebitStrategy(warmup_exchange=exchange, error_feedback=policy, ddp_bucket_cap_mb=BUCKET_CAP_MB,
                          **powersgd)


def _fit(rank: int, world_size: int, workdir: str, exchange: str, run: str, resume_from: Optional[str] = None,
         policy: str = "keep", drop_state: bool = False) -> dict[str, Any]:
    model = TinyClassifier(freeze_step=FREEZE, data_seed=rank)
    strategy = _strategy(exchange, policy)
    checkpoints = ModelCheckpoint(dirpath=os.path.join(workdir, run), filename="{step}", every_n_train_steps=SAVE_AT,
                                  save_top_k=-1)
    trainer = pl.Trainer(**trainer_kwargs(world_size, STEPS, strategy=strategy, callbacks=[checkpoints],
                                          enable_checkpointing=True))
    ckpt_path = None if resume_from is None else os.path.join(workdir, resume_from, f"step={SAVE_AT}.ckpt")
    if ckpt_path is not None and drop_state:
        ckpt_path = _as_an_older_checkpoint(rank, ckpt_path, os.path.join(workdir, "older.ckpt"))
    with capture_logs() as logs, capture_warnings() as warned:
        trainer.fit(model, loader(rank, STEPS), ckpt_path=ckpt_path)
    state = strategy.warmup_exchange_state
    warm = strategy.warmup_communication
    return dict(params=model.params_after, state=state.state_dict(), restored=strategy.warmup_exchange_restored,
                logs=logs, warned=warned, bytes_sent=warm.bytes_sent, collectives=warm.collectives,
                calls=warm.calls, shapes=[p.shape for p in model.parameters()])


def _as_an_older_checkpoint(rank: int, path: str, older: str) -> str:
    """A copy of the checkpoint at ``path`` as one written before the warmup exchange's state was kept."""
    if rank == 0:
        checkpoint = torch.load(path, weights_only=False)
        checkpoint.pop(WARMUP_EXCHANGE_KEY)
        torch.save(checkpoint, older)
    torch.distributed.barrier()
    return older


def _interrupted_and_resumed(rank: int, world_size: int, workdir: str, exchange: str) -> dict[str, Any]:
    full = _fit(rank, world_size, workdir, exchange, "full")
    resumed = _fit(rank, world_size, workdir, exchange, "resumed", resume_from="full")
    return dict(full=full, resumed=resumed)


@pytest.mark.parametrize("world_size", [2, 3])
@pytest.mark.parametrize("exchange", ["powersgd", "int8"])
def test_a_run_resumed_mid_warmup_equals_the_uninterrupted_one_bit_for_bit(tmp_path: Any, exchange: str,
                                                                            world_size: int) -> None:
    results = run_distributed(_interrupted_and_resumed, world_size, str(tmp_path), exchange, timeout_s=180)
    for rank, r in enumerate(results):
        full, resumed = r["full"], r["resumed"]
        assert resumed["restored"] is True and full["restored"] is None
        assert len(full["params"]) == STEPS and len(resumed["params"]) == STEPS - SAVE_AT
        for step in range(SAVE_AT, STEPS):  # the warmup steps after the save, then the compression stage
            assert torch.equal(resumed["params"][step - SAVE_AT], full["params"][step]), (rank, step + 1)
        assert full["state"]["iteration"] == resumed["state"]["iteration"] == FREEZE
        kept_full, kept_resumed = full["state"]["parameters"], resumed["state"]["parameters"]
        assert kept_full and kept_full.keys() == kept_resumed.keys()
        for index, tensors in kept_full.items():
            for name, tensor in tensors.items():
                assert torch.equal(kept_resumed[index][name], tensor), (rank, index, name)
        assert any("warmup exchange's state restored on every rank" in m for m in resumed["logs"]) == (rank == 0)
    for step in range(STEPS):  # replicas identical after every step
        assert all(torch.equal(r["full"]["params"][step], results[0]["full"]["params"][step]) for r in results), step


def _without_state(rank: int, world_size: int, workdir: str, how: str) -> dict[str, Any]:
    policy = "reset" if how == "reset" else "keep"
    full = _fit(rank, world_size, workdir, "powersgd", "full", policy=policy)
    resumed = _fit(rank, world_size, workdir, "powersgd", "resumed", resume_from="full", policy=policy,
                   drop_state=how == "older")
    return dict(full=full, resumed=resumed)


@pytest.mark.parametrize("how", ["older", "reset"])
def test_a_checkpoint_without_the_state_resets_it_on_every_rank_with_one_message(tmp_path: Any, how: str) -> None:
    results = run_distributed(_without_state, 2, str(tmp_path), how, timeout_s=180)
    for rank, r in enumerate(results):
        full, resumed = r["full"], r["resumed"]
        assert resumed["restored"] is False
        said = [m for m in resumed["logs"] + resumed["warned"] if "warmup exchange" in m and "reset" in m]
        assert len(said) == (1 if rank == 0 else 0), said
        if how == "older":  # no step count either: PowerSGD starts over with its vanilla steps
            assert "holds no warmup exchange state" in "".join(said) or rank != 0
            assert resumed["state"]["iteration"] == FREEZE - SAVE_AT < full["state"]["iteration"] == FREEZE
        else:  # the step count is in the main checkpoint: PowerSGD goes on compressing, from fresh error and Q
            assert "error_feedback='reset'" in "".join(said) or rank != 0
            assert resumed["state"]["iteration"] == full["state"]["iteration"] == FREEZE
        # the state restarted alike on every rank: the replicas stay identical
        assert not torch.equal(resumed["params"][0], full["params"][SAVE_AT])
    for step in range(STEPS - SAVE_AT):
        assert torch.equal(results[0]["resumed"]["params"][step], results[1]["resumed"]["params"][step]), step


def _counted(rank: int, world_size: int) -> dict[str, Any]:
    model = TinyClassifier(freeze_step=FREEZE, data_seed=rank)
    strategy = OnebitStrategy(warmup_exchange="powersgd", powersgd_rank=2, powersgd_vanilla_steps=VANILLA)
    trainer = pl.Trainer(**trainer_kwargs(world_size, STEPS, strategy=strategy))
    trainer.fit(model, loader(rank, STEPS))
    warm = strategy.warmup_communication
    return dict(bytes_sent=warm.bytes_sent, collectives=warm.collectives, calls=warm.calls,
                shapes=[p.shape for p in model.parameters()], params=model.params_after)


@pytest.mark.parametrize("world_size", [2, 3])
def test_powersgd_warmup_bytes_are_the_hand_computation(world_size: int) -> None:
    """TinyClassifier in one bucket, rank 2: the 40 x 16 embedding (P 40 x 2, Q 16 x 2) and the 32 x 16 dense weight
    (P 32 x 2, Q 16 x 2) are compressed ((40 + 16) 2 x 2 = 224 < 640, (32 + 16) 2 x 2 = 192 < 512); the 3 x 32 head
    (140 > 96) and the vectors (32 + 32 + 32 + 3) go uncompressed: 195 elements."""
    for r in run_distributed(_counted, world_size, timeout_s=120):
        n = sum(s.numel() for s in r["shapes"])
        assert n == 640 + 512 + 32 + 32 + 32 + 96 + 3
        compressed = FREEZE - VANILLA
        expected = (VANILLA * ring_allreduce_bytes(n, 4, world_size)
                    + compressed * (ring_allreduce_bytes(195 + 40 * 2 + 32 * 2, 4, world_size)
                                    + ring_allreduce_bytes(16 * 2 + 16 * 2, 4, world_size)))
        assert r["bytes_sent"] == expected and r["collectives"] == VANILLA + 2 * compressed, r
        assert r["calls"] == FREEZE


@pytest.mark.parametrize(("kwargs", "match"), [
    (dict(warmup_exchange="int4"), "warmup_exchange must be one of 'fp32', 'bf16', 'int8', 'powersgd', got 'int4'"),
    (dict(warmup_exchange="int8", ddp_comm_hook=lambda state, bucket: None), "not both"),
    (dict(warmup_exchange="powersgd", powersgd_rank=0), "powersgd_rank must be an integer >= 1, got 0"),
    (dict(warmup_exchange="powersgd", powersgd_vanilla_steps=-1), "powersgd_vanilla_steps must be an integer >= 0"),
    (dict(warmup_exchange="int8", powersgd_rank=4), "powersgd_rank apply to warmup_exchange='powersgd'"),
    (dict(powersgd_vanilla_steps=4, ddp_comm_hook=lambda state, bucket: None), "uses a ddp_comm_hook"),
])
def test_bad_warmup_exchange_arguments_fail_at_construction(kwargs: dict, match: str) -> None:
    with pytest.raises(ValueError, match=match):
        OnebitStrategy(**kwargs)


def test_the_default_is_the_one_place_and_a_hook_given_wins_over_it() -> None:
    assert OnebitStrategy().warmup_exchange == DEFAULT_WARMUP_EXCHANGE
    hooked = OnebitStrategy(ddp_comm_hook=lambda state, bucket: None)
    assert hooked.warmup_exchange is None and hooked.warmup_exchange_state is None


@pytest.mark.parametrize("exchange", ["bf16", "int8", "powersgd", "int4"])
def test_onebit_fsdp_refuses_a_warmup_exchange_it_cannot_honour(exchange: str) -> None:
    from lightning_onebit import OnebitFSDPStrategy

    with pytest.raises(ValueError, match="onebit_fsdp's warmup averages FSDP's gradient shards across nodes in fp32"):
        OnebitFSDPStrategy(warmup_exchange=exchange)
    OnebitFSDPStrategy(warmup_exchange="fp32")  # what it does anyway
