"""Resuming ``onebit_fsdp`` from a distributed checkpoint, on 4 gloo ranks as 2 simulated nodes x 2, with the
exchange overlapped with backward (the default):

* one rank's sidecar missing, or truncated, under the default ``error_feedback="keep"``: every rank resets its error
  feedback the same way, so every rank takes the same path through the first resumed backward and step (no rank
  starts exchanges in backward while its replica exchanges in ``step``); the run goes on, its replicas bitwise
  identical after every step (a Llama-style model: its blocks' FSDP groups are the same size, where mismatched
  exchanges would pair up silently);
* 1-bit LAMB resumed with kept error feedback continues bitwise as the uninterrupted run, with and without overlap.
"""

from __future__ import annotations

import os
from typing import Any, Optional

import pytest
import torch
import torch.distributed as dist

import lightning.pytorch as pl
from lightning_onebit import OnebitFSDPStrategy, OnebitLamb, ReplicaCheck
from lightning_onebit.strategy.sidecar import sidecar_in_folder
from tests.capture import capture_warnings
from tests.distributed import run_distributed, run_scenarios, scenario_results
from tests.llama_models import LlamaLM, local_shards

SAVED_AT, STEPS = 5, 9  # freeze_step 3: the checkpoint is in the compression stage


def _fit(rank: int, steps: int, resume_from: Optional[str] = None, save_to: Optional[str] = None,
         overlap: Any = "auto", optimizer: Any = "onebit_adam", callbacks: Any = None,
         init_seed: Optional[int] = None) -> dict[str, Any]:
    model = LlamaLM(100 + rank if init_seed is None else init_seed, optimizer=optimizer)
    strategy = OnebitFSDPStrategy(ranks_per_node=2, overlap=overlap)
    trainer = pl.Trainer(accelerator="cpu", devices=4, strategy=strategy, max_steps=steps, logger=False,
                         enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False,
                         callbacks=callbacks)
    trainer.fit(model, ckpt_path=resume_from)
    if save_to is not None:
        trainer.save_checkpoint(save_to)
    overlap_state = strategy.overlap_state
    return dict(shards=local_shards(model), restored=strategy.error_feedback_restored,
                steps=strategy.onebit_optimizer.step_count, stage=strategy.stage.value,
                buckets_started=None if overlap_state is None else overlap_state.buckets_started)


def _lamb(params: Any) -> OnebitLamb:
    return OnebitLamb(params, lr=3e-3, freeze_step=3)


def scenario_lamb(rank: int, world_size: int, workdir: str) -> dict[str, Any]:
    out = {}
    for overlap in (True, False):
        path = os.path.join(workdir, f"lamb_{overlap}.ckpt")
        # every process builds the same weights: what this checks is the optimizer's resume alone
        kwargs = dict(overlap=overlap, optimizer=_lamb, init_seed=0)
        out[overlap] = dict(
            whole=_fit(rank, STEPS, **kwargs),
            saved=_fit(rank, SAVED_AT, save_to=path, **kwargs),
            resumed=_fit(rank, STEPS, resume_from=path, **kwargs),
        )
    return out


def scenario_bad_sidecar(rank: int, world_size: int, workdir: str) -> dict[str, Any]:
    """Saved once; rank 1's sidecar then removed from one copy and truncated in another; each resumed."""
    missing, truncated = os.path.join(workdir, "missing.ckpt"), os.path.join(workdir, "truncated.ckpt")
    _fit(rank, SAVED_AT, save_to=missing)
    _fit(rank, SAVED_AT, save_to=truncated)  # the same run again: the same checkpoint
    dist.barrier()
    if rank == 1:
        os.remove(sidecar_in_folder(missing, 1))
        with open(sidecar_in_folder(truncated, 1), "r+b") as f:
            f.truncate(os.path.getsize(sidecar_in_folder(truncated, 1)) // 2)
    dist.barrier()
    out: dict[str, Any] = {}
    for name, path in (("missing", missing), ("truncated", truncated)):
        check = ReplicaCheck(every_n_steps=1)
        with capture_warnings() as warned:
            try:
                run = _fit(rank, STEPS, resume_from=path, callbacks=[check])
                run["error"] = None
            except Exception as error:  # noqa: BLE001 - the test says what it was
                run = dict(error=f"{type(error).__name__}: {error}")
        out[name] = dict(run, checks=check.checks, warnings=[w for w in warned if "error feedback reset" in w])
    return out


_SCENARIOS = (("bad_sidecar", scenario_bad_sidecar), ("lamb", scenario_lamb))


@pytest.fixture(scope="module")
def session(tmp_path_factory: pytest.TempPathFactory) -> list[dict[str, Any]]:
    workdir = str(tmp_path_factory.mktemp("fsdp_resume"))
    return run_distributed(run_scenarios, 4, _SCENARIOS, workdir, timeout_s=300)


@pytest.mark.parametrize("damage", ["missing", "truncated"])
def test_a_missing_or_truncated_sidecar_resets_every_rank_alike(session: list[dict[str, Any]], damage: str) -> None:
    runs = [r[damage] for r in scenario_results(session, "bad_sidecar")]
    for rank, run in enumerate(runs):
        assert run["error"] is None, f"rank {rank}: {run['error']}"
        assert run["restored"] is False and run["steps"] == STEPS and run["stage"] == "compression"
        # every resumed step checked: the replicas of each shard stayed bitwise identical
        assert run["checks"] == STEPS - SAVED_AT, run["checks"]
        # every rank took the same path: the first resumed step exchanged in step (it laid the buckets out), the
        # later ones started every bucket (3 FSDP groups) in backward
        assert run["buckets_started"] == 3 * (STEPS - SAVED_AT - 1), run["buckets_started"]
    assert torch.equal(runs[0]["shards"], runs[2]["shards"]) and torch.equal(runs[1]["shards"], runs[3]["shards"])
    warning = session[0]["bad_sidecar"][damage]["warnings"]
    assert len(warning) == 1 and "rank 1" in warning[0], warning


@pytest.mark.parametrize("overlap", [True, False])
def test_a_lamb_resume_with_kept_error_feedback_continues_bitwise(session: list[dict[str, Any]],
                                                                  overlap: bool) -> None:
    for r in (ranks[overlap] for ranks in scenario_results(session, "lamb")):
        assert r["resumed"]["restored"] is True and r["resumed"]["steps"] == STEPS
        if overlap:  # every resumed step started its exchanges during backward
            assert r["resumed"]["buckets_started"] == 3 * (STEPS - SAVED_AT), r["resumed"]["buckets_started"]
        assert torch.equal(r["whole"]["shards"], r["resumed"]["shards"]), \
            float((r["whole"]["shards"] - r["resumed"]["shards"]).abs().max())
