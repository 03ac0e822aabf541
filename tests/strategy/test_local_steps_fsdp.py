"""The ``onebit_diloco_fsdp`` strategy (``OnebitDiLoCoFSDPStrategy``: FSDP2 inside each replica, the compressed outer
step across replicas) under Lightning on gloo, with the Llama-style test model sharded by its ``configure_model``:

* 2 x 2 (4 ranks, 1-bit over two replicas, Nesterov, 2 fragments, 1 overlapped step) and 3 x 1 (the two-phase 1-bit
  exchange with its server error): every replica's shards bitwise the same after every step that ends an exchange,
  the same at the end of fit, and a run resumed from a checkpoint saved mid-period (an exchange in flight on 2 x 2)
  continues bit for bit; a BatchNorm model's (2 x 2) too, every rank's own buffers included, and resumed at 2 x 1
  every rank starts from rank 0's buffers, with a warning;
* with one rank per replica (2 x 1) it trains the same bits as ``onebit_diloco`` (every loss, the final model);
* the 2 x 2 checkpoint resumed on 2 ranks (2 x 1): the outer model, each replica's own parameters, its AdamW state,
  its error feedback, the outer momentum and the streaming rebase's saved parameters are the saved ones, whole; the
  run goes on with its replicas bitwise the same after the syncs;
* an optimizer built from the parameters before sharding (as LightningCLI builds it) steps the sharded ones;
* bf16-mixed, gradient accumulation, clipping and the strategy's own sharding (``shard_modules``) together, with
  ``CommunicationMonitor`` and validation: the validation sees the outer model, and the training is the same bits
  with or without it; ``Trainer(strategy="onebit_diloco_fsdp")`` by name;
* resuming with another number of replicas, one replica, a layout that does not divide the world, a compressed
  optimizer (``OnebitAdam``) as the inner one, a single-file checkpoint, and this strategy's folder under
  ``onebit_diloco`` are refused on every rank with the reason and the strategy to use.
"""

from __future__ import annotations

import os
from typing import Any, Optional

import pytest
import torch

import lightning.pytorch as pl
from lightning.pytorch.callbacks import ModelCheckpoint
from lightning_onebit import CommunicationMonitor, OnebitDiLoCoFSDPStrategy, OnebitDiLoCoStrategy
from lightning_onebit.strategy.local_steps_run import DEFAULTS
from tests.distributed import run_distributed, run_scenarios, scenario_results
from tests.lightning_models import loader
from tests.llama_models import LlamaBlock, LlamaLM, local_shards
from tests.strategy.test_local_steps import BufferRecorder, NormalizedRegressor, flat_buffers
from tests.strategy.test_topology_lightning import RecordingLogger

SYNC_EVERY, STEPS, SAVED_AT = 4, 10, 6


def _adamw(params: Any) -> torch.optim.Optimizer:
    return torch.optim.AdamW(params, lr=3e-3, weight_decay=0.01)


def _full(local: torch.Tensor, like: Any) -> torch.Tensor:
    from torch.distributed.tensor import DTensor

    return DTensor.from_local(local, like.device_mesh, like.placements, run_check=False, shape=like.shape,
                              stride=like.stride()).full_tensor()


def snapshot(strategy: OnebitDiLoCoFSDPStrategy) -> dict[str, torch.Tensor]:
    """The training state, each tensor whole (all-gathered over the replica: every rank of it calls this): outer
    values, own parameters, error feedback, outer momentum, rebase starts and AdamW's moments, each flat."""
    outer_step = strategy.outer_step
    outer_step.finish_in_flight()
    pairs = strategy.sharded_parameters
    state = outer_step.per_parameter_state()
    out: dict[str, torch.Tensor] = {}
    for key in ("outer", "error_feedback", "momentum", "rebase_start"):
        parts = [_full(t, p) for t, (_, p) in zip(state[key], pairs) if t is not None]
        out[key] = torch.cat([t.reshape(-1) for t in parts]) if parts else torch.zeros(0)
    out["local"] = torch.cat([p.full_tensor().reshape(-1) for _, p in pairs])
    adam = strategy.optimizers[0].state
    out["adam"] = torch.cat([adam[p][k].full_tensor().reshape(-1) for _, p in pairs for k in ("exp_avg", "exp_avg_sq")])
    out["adam_step"] = torch.stack([adam[pairs[0][1]]["step"].reshape(())])
    return out


class Recorder(pl.Callback):
    """Per optimizer step: the local shards and the step; the snapshot when a checkpoint is saved and after the
    restore (at the start of training)."""

    def __init__(self) -> None:
        self.shards: list[torch.Tensor] = []
        self.saved: Optional[dict] = None
        self.restored: Optional[dict] = None

    def on_train_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        if trainer.global_step:
            self.restored = snapshot(trainer.strategy)

    def on_train_batch_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule, *args: Any) -> None:
        self.shards.append(local_shards(pl_module))

    def on_save_checkpoint(self, trainer: pl.Trainer, pl_module: pl.LightningModule, checkpoint: Any) -> None:
        self.saved = snapshot(trainer.strategy)


def _fit(rank: int, world_size: int, *, per_replica: int, steps: int = STEPS, ckpt_path: Optional[str] = None,
         save_dir: Optional[str] = None, **strategy_kwargs: Any) -> dict[str, Any]:
    strategy = OnebitDiLoCoFSDPStrategy(sync_every=SYNC_EVERY, ranks_per_node=per_replica, **strategy_kwargs)
    recorder = Recorder()
    callbacks: list[Any] = [recorder]
    if save_dir is not None:
        callbacks.append(ModelCheckpoint(dirpath=save_dir, filename="{step}", every_n_train_steps=SAVED_AT,
                                         save_top_k=-1))
    trainer = pl.Trainer(accelerator="cpu", devices=world_size, strategy=strategy, max_steps=steps, logger=False,
                         enable_checkpointing=save_dir is not None, enable_progress_bar=False,
                         enable_model_summary=False, callbacks=callbacks)
    model = LlamaLM(100 + rank, optimizer=_adamw)  # unseeded alike: the first replica's weights win
    trainer.fit(model, ckpt_path=ckpt_path)
    return {"shards": recorder.shards, "final": local_shards(model), "saved": recorder.saved,
            "restored": recorder.restored, "losses": model.losses, "syncs": strategy.outer_syncs,
            "inner_steps": strategy.inner_steps, "bytes": strategy.communication.bytes_sent_inter_node}


_STREAMED = dict(outer_optimizer="nesterov", fragments=2, overlap_steps=1)


def scenario_2x2(rank: int, world_size: int, workdir: str) -> dict[str, Any]:
    run = os.path.join(workdir, "2x2")
    full = _fit(rank, world_size, per_replica=2, save_dir=run, **_STREAMED)
    resumed = _fit(rank, world_size, per_replica=2, ckpt_path=os.path.join(run, f"step={SAVED_AT}.ckpt"), **_STREAMED)
    return {"full": full, "resumed": resumed}


def scenario_3x1(rank: int, world_size: int, workdir: str) -> dict[str, Any]:
    run = os.path.join(workdir, "3x1")
    full = _fit(rank, world_size, per_replica=1, save_dir=run)
    resumed = _fit(rank, world_size, per_replica=1, ckpt_path=os.path.join(run, f"step={SAVED_AT}.ckpt"))
    return {"full": full, "resumed": resumed}


class ValidatedLlama(LlamaLM):
    """Validates on one batch; records the local shards it validated and the outer values then."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.validated: list[tuple[torch.Tensor, torch.Tensor]] = []

    def validation_step(self, batch: Any, batch_idx: int) -> None:
        outer_step = self.trainer.strategy.outer_step
        if outer_step is None:  # trainer.validate: no outer step outside fit
            return
        outer = outer_step.outer_values()
        self.validated.append((local_shards(self), torch.cat([outer[id(t)].reshape(-1) for t in outer_step.params])))

    def val_dataloader(self) -> Any:
        return self.train_dataloader()


def _features(rank: int, world_size: int, validate: bool) -> dict[str, Any]:
    strategy = OnebitDiLoCoFSDPStrategy(ranks_per_node=2, shard_modules=[LlamaBlock])
    logger = RecordingLogger()
    trainer = pl.Trainer(accelerator="cpu", devices=world_size, strategy=strategy, max_steps=STEPS,
                         precision="bf16-mixed", accumulate_grad_batches=2, gradient_clip_val=0.5, logger=logger,
                         enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False,
                         limit_val_batches=1 if validate else 0, val_check_interval=6 if validate else 1.0,
                         num_sanity_val_steps=0, log_every_n_steps=1, callbacks=[CommunicationMonitor()])
    model = ValidatedLlama(100 + rank, optimizer=_adamw, shard=False)
    trainer.fit(model)
    logged = [row["comm/bytes_sent_total"] for row in logger.rows if "comm/bytes_sent_total" in row]
    return {"final": local_shards(model), "validated": model.validated, "losses": model.losses, "logged": logged,
            "bytes": strategy.communication.bytes_sent, "syncs": strategy.outer_syncs}


class EarlyOptimizerLlama(LlamaLM):
    """Builds its AdamW from the parameters before sharding (as LightningCLI does)."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.early = _adamw(self.parameters())

    def configure_optimizers(self) -> Any:
        return self.early


def scenario_features(rank: int, world_size: int, workdir: str) -> dict[str, Any]:
    resolved = pl.Trainer(accelerator="cpu", devices=world_size, strategy="onebit_diloco_fsdp", logger=False).strategy
    early = EarlyOptimizerLlama(100 + rank, optimizer=_adamw)
    trainer = pl.Trainer(accelerator="cpu", devices=world_size, max_steps=2, logger=False, enable_checkpointing=False,
                         enable_progress_bar=False, enable_model_summary=False,
                         strategy=OnebitDiLoCoFSDPStrategy(ranks_per_node=2))
    trainer.fit(early)
    sharded = {id(p) for p in early.parameters()}
    return {"by_name": type(resolved).__name__, "plain": _features(rank, world_size, False),
            "validated": _features(rank, world_size, True),
            "early_points_at_shards": all(id(p) in sharded for g in early.early.param_groups for p in g["params"])
            and len(early.early.state) == len(sharded)}


def _error(fn: Any) -> Optional[str]:
    try:
        fn()
    except Exception as err:  # noqa: BLE001 - the test reads the message
        return f"{type(err).__name__}: {err}"
    return None


class ShardedNormalizedRegressor(NormalizedRegressor):
    """Without ``Regressor``'s records of whole flat parameters (its parameters are DTensors here)."""

    def on_before_optimizer_step(self, optimizer: Any) -> None:
        pass

    def optimizer_step(self, *args: Any, **kwargs: Any) -> None:
        pl.LightningModule.optimizer_step(self, *args, **kwargs)


def scenario_buffers(rank: int, world_size: int, workdir: str) -> dict[str, Any]:
    """A BatchNorm model sharded with ``shard_modules``, 2 x 2: every rank's buffers after every step; then the same
    run saved at step ``SAVED_AT`` (between two syncs) and resumed from there."""
    run = os.path.join(workdir, "buffers")

    def fit(ckpt_path: Optional[str] = None) -> dict[str, Any]:
        recorder = BufferRecorder()
        strategy = OnebitDiLoCoFSDPStrategy(sync_every=SYNC_EVERY, ranks_per_node=2, shard_modules=torch.nn.Linear)
        save = ModelCheckpoint(dirpath=run, filename="{step}", every_n_train_steps=SAVED_AT, save_top_k=-1)
        trainer = pl.Trainer(accelerator="cpu", devices=world_size, strategy=strategy, max_steps=STEPS, logger=False,
                             enable_checkpointing=ckpt_path is None, enable_progress_bar=False,
                             enable_model_summary=False, callbacks=[recorder] + ([save] if ckpt_path is None else []),
                             limit_val_batches=0)
        model = ShardedNormalizedRegressor(optimizer="adamw", seed=0, data_seed=7 + rank)
        trainer.fit(model, loader(rank, 20), ckpt_path=ckpt_path)
        return {"steps": recorder.steps, "final": flat_buffers(model)}

    full = fit()
    return dict(full, resumed=fit(os.path.join(run, f"step={SAVED_AT}.ckpt")))


def scenario_buffers_2x1(rank: int, world_size: int, workdir: str) -> dict[str, Any]:
    """The BatchNorm model's 2 x 2 checkpoint (saved between two syncs) resumed on 2 x 1: the warning, and the
    buffers every rank starts from."""
    import warnings

    class FirstStep(pl.Callback):
        def on_train_batch_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule, *args: Any) -> None:
            if not hasattr(self, "buffers"):
                self.buffers = flat_buffers(pl_module)

    first = FirstStep()
    trainer = pl.Trainer(accelerator="cpu", devices=world_size, max_steps=STEPS, logger=False,
                         enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False,
                         strategy=OnebitDiLoCoFSDPStrategy(sync_every=SYNC_EVERY, ranks_per_node=1,
                                                           shard_modules=torch.nn.Linear),
                         callbacks=[first], limit_val_batches=0)
    model = ShardedNormalizedRegressor(optimizer="adamw", seed=0, data_seed=7 + rank)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        trainer.fit(model, loader(rank, 20), ckpt_path=os.path.join(workdir, "buffers", f"step={SAVED_AT}.ckpt"))
    return {"buffers": first.buffers, "final": flat_buffers(model), "steps": trainer.global_step,
            "warnings": [str(w.message) for w in caught if "kept beside the checkpoint" in str(w.message)]}


def scenario_2x1_from_2x2(rank: int, world_size: int, workdir: str) -> dict[str, Any]:
    path = os.path.join(workdir, "2x2", f"step={SAVED_AT}.ckpt")
    resharded = _fit(rank, world_size, per_replica=1, ckpt_path=path, **_STREAMED)
    one_replica = _error(lambda: _fit(rank, world_size, per_replica=2, steps=1))
    # outside fit, a checkpoint loads the outer model (e.g. to validate it), resharded
    model = ValidatedLlama(100 + rank, optimizer=_adamw)
    trainer = pl.Trainer(accelerator="cpu", devices=world_size, logger=False, enable_progress_bar=False,
                         enable_model_summary=False, limit_val_batches=1,
                         strategy=OnebitDiLoCoFSDPStrategy(sync_every=SYNC_EVERY, ranks_per_node=1))
    trainer.validate(model, ckpt_path=path)
    whole = torch.cat([p.full_tensor().reshape(-1) for p in model.parameters()])
    ddp = pl.Trainer(accelerator="cpu", devices=world_size, max_steps=1, logger=False, enable_checkpointing=False,
                     enable_progress_bar=False, strategy=OnebitDiLoCoStrategy(ranks_per_node=1))
    folder_under_ddp = _error(lambda: ddp.fit(LlamaLM(100 + rank, optimizer=_adamw, shard=False), ckpt_path=path))
    return {"resharded": resharded, "one_replica": one_replica, "validated_model": whole,
            "folder_under_ddp": folder_under_ddp,
            "same_as_ddp": {fsdp: _one_rank_replicas(rank, world_size, fsdp) for fsdp in (True, False)}}


def _one_rank_replicas(rank: int, world_size: int, fsdp: bool) -> tuple[torch.Tensor, list[float]]:
    """A fit with replicas of one rank, under onebit_diloco_fsdp (the model sharded over one rank) or onebit_diloco."""
    strategy = (OnebitDiLoCoFSDPStrategy if fsdp else OnebitDiLoCoStrategy)(sync_every=SYNC_EVERY, ranks_per_node=1)
    trainer = pl.Trainer(accelerator="cpu", devices=world_size, strategy=strategy, max_steps=STEPS, logger=False,
                         enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False)
    model = LlamaLM(100 + rank, optimizer=_adamw, shard=fsdp)
    trainer.fit(model)
    return local_shards(model), model.losses


def scenario_other_replicas(rank: int, world_size: int, workdir: str) -> dict[str, Any]:
    """The 2 x 2 checkpoint on 4 ranks as 4 replicas of 1: refused."""
    path = os.path.join(workdir, "2x2", f"step={SAVED_AT}.ckpt")
    a_file = os.path.join(workdir, "ddp.ckpt")
    if rank == 0:
        torch.save({"state_dict": {}, "optimizer_states": [{}], "global_step": 3}, a_file)
    torch.distributed.barrier()
    onebit = LlamaLM(100 + rank)  # configure_optimizers returns OnebitAdam
    trainer = pl.Trainer(accelerator="cpu", devices=world_size, max_steps=1, logger=False, enable_checkpointing=False,
                         enable_progress_bar=False, strategy=OnebitDiLoCoFSDPStrategy(ranks_per_node=2))
    return {"error": _error(lambda: _fit(rank, world_size, per_replica=1, ckpt_path=path, **_STREAMED)),
            "uneven": _error(lambda: _fit(rank, world_size, per_replica=3, steps=1)),
            "compressed_inner": _error(lambda: trainer.fit(onebit)),
            "file": _error(lambda: _fit(rank, world_size, per_replica=2, ckpt_path=a_file))}


@pytest.fixture(scope="module")
def sessions(tmp_path_factory: pytest.TempPathFactory) -> dict[str, list[dict]]:
    workdir = str(tmp_path_factory.mktemp("diloco_fsdp"))
    four = run_distributed(run_scenarios, 4, (("2x2", scenario_2x2), ("features", scenario_features),
                                              ("buffers", scenario_buffers)), workdir, timeout_s=400)
    two = run_distributed(run_scenarios, 2, (("2x1", scenario_2x1_from_2x2), ("buffers_2x1", scenario_buffers_2x1)),
                          workdir, timeout_s=300)
    refused = run_distributed(run_scenarios, 4, (("refused", scenario_other_replicas),), workdir, timeout_s=300)
    three = run_distributed(run_scenarios, 3, (("3x1", scenario_3x1),), workdir, timeout_s=300)
    return {"2x2": four, "2x1": two, "refused": refused, "3x1": three}


def _replicas(ranks: list[dict], per_replica: int) -> list[list[dict]]:
    """Per shard index, that shard's results on every replica."""
    return [ranks[i::per_replica] for i in range(per_replica)]


def test_2x2_replicas_agree_at_the_end_and_learn(sessions: dict) -> None:
    runs = [r["full"] for r in scenario_results(sessions["2x2"], "2x2")]
    for same_shard in _replicas(runs, 2):
        first = same_shard[0]["final"]
        assert all(torch.equal(r["final"], first) for r in same_shard[1:])
        # between syncs the replicas differ (they train on different data)
        assert not torch.equal(same_shard[0]["shards"][1], same_shard[1]["shards"][1])
    for r in runs:
        assert r["inner_steps"] == STEPS and r["bytes"] > 0
        assert sum(r["losses"][-3:]) < sum(r["losses"][:3])


def test_buffers_are_rank_0s_on_every_rank_after_every_sync(sessions: dict) -> None:
    ranks = scenario_results(sessions["2x2"], "buffers")
    steps = ranks[0]["steps"]
    assert [i + 1 for i, s in enumerate(steps) if s["since_sync"] == 0] == [SYNC_EVERY, 2 * SYNC_EVERY]
    for i in range(len(steps)):
        buffers = [r["steps"][i]["buffers"] for r in ranks]
        if steps[i]["since_sync"] == 0:
            assert all(torch.equal(b, buffers[0]) for b in buffers), f"step {i + 1}: buffers differ after the sync"
        else:  # FSDP2 leaves buffers alone: every rank's own data moved its statistics
            assert not torch.equal(buffers[0], buffers[-1]), f"step {i + 1}: the buffers did not drift"
    assert all(torch.equal(r["final"], ranks[0]["final"]) for r in ranks)  # the sync at the end of fit


def test_a_resume_between_syncs_gives_every_rank_its_own_buffers_back(sessions: dict) -> None:
    ranks = scenario_results(sessions["2x2"], "buffers")
    assert ranks[0]["steps"][SAVED_AT - 1]["since_sync"] != 0  # saved between two syncs: the ranks' buffers differ
    assert not torch.equal(ranks[0]["steps"][SAVED_AT - 1]["buffers"], ranks[-1]["steps"][SAVED_AT - 1]["buffers"])
    for rank, r in enumerate(ranks):
        resumed = r["resumed"]["steps"]
        assert len(resumed) == STEPS - SAVED_AT
        for step, (before, after) in enumerate(zip(r["steps"][SAVED_AT:], resumed), start=SAVED_AT + 1):
            assert torch.equal(before["buffers"], after["buffers"]), f"rank {rank}: buffers at step {step}"
        assert torch.equal(r["final"], r["resumed"]["final"])


def test_at_another_layout_every_rank_starts_from_rank_0s_buffers_and_is_told(sessions: dict) -> None:
    ranks = scenario_results(sessions["2x1"], "buffers_2x1")
    saved = [r["steps"][SAVED_AT - 1]["buffers"] for r in scenario_results(sessions["2x2"], "buffers")]
    assert all(torch.equal(r["buffers"], saved[0]) for r in ranks)  # rank 0's, every tensor of them
    assert all(r["steps"] == STEPS and torch.isfinite(r["final"]).all() for r in ranks)
    (message,) = ranks[0]["warnings"]
    assert "(its buffers) was saved at 2 x 2 ranks and is not restored at 2 x 1" in message
    assert "every rank starts from rank 0's buffers" in message and "server error" not in message


def test_2x2_resume_mid_period_with_an_exchange_in_flight_is_bitwise(sessions: dict) -> None:
    for rank, r in enumerate(scenario_results(sessions["2x2"], "2x2")):
        full, resumed = r["full"], r["resumed"]
        assert resumed["restored"] is not None and resumed["inner_steps"] == STEPS
        for step, (a, b) in enumerate(zip(full["shards"][SAVED_AT:], resumed["shards"])):
            assert torch.equal(a, b), f"rank {rank}: step {SAVED_AT + step + 1} differs after resume"
        assert torch.equal(full["final"], resumed["final"])
        # the state read back is the state saved, tensor for tensor
        for key, saved in full["saved"].items():
            assert torch.equal(saved, resumed["restored"][key]), key
        assert full["saved"]["rebase_start"].numel() > 0  # an exchange was in flight at the save (overlap 1)
        assert full["saved"]["momentum"].numel() > 0


def test_3x1_two_phase_resume_is_bitwise_and_replicas_agree_after_every_sync(sessions: dict) -> None:
    runs = scenario_results(sessions["3x1"], "3x1")
    for step in range(SYNC_EVERY - 1, STEPS, SYNC_EVERY):  # after the inner steps 4 and 8
        assert all(torch.equal(r["full"]["shards"][step], runs[0]["full"]["shards"][step]) for r in runs[1:])
    for rank, r in enumerate(runs):
        assert not torch.equal(r["full"]["shards"][0], runs[(rank + 1) % 3]["full"]["shards"][0])
        for a, b in zip(r["full"]["shards"][SAVED_AT:], r["resumed"]["shards"]):
            assert torch.equal(a, b), f"rank {rank}"
        # the server error (the second compression's) is restored too: it is part of the state compared here
        assert r["full"]["saved"]["error_feedback"].abs().sum() > 0


def test_a_2x2_checkpoint_resumes_on_2x1_with_every_state_whole(sessions: dict) -> None:
    saved = [r["full"]["saved"] for r in scenario_results(sessions["2x2"], "2x2")]
    runs = scenario_results(sessions["2x1"], "2x1")
    for replica, r in enumerate(runs):  # replica k was ranks 2k and 2k+1; it is rank k now
        restored = r["resharded"]["restored"]
        # the whole tensors the saving replica held (the error feedback: its two ranks' shards side by side)
        for key in ("outer", "local", "error_feedback", "momentum", "rebase_start", "adam", "adam_step"):
            assert torch.equal(restored[key], saved[2 * replica][key]), (replica, key)
        # trainer.validate(ckpt_path=...) loaded the outer model, whole
        assert torch.equal(r["validated_model"], saved[0]["outer"])
    a, b = (r["resharded"] for r in runs)
    assert a["inner_steps"] == STEPS and torch.equal(a["final"], b["final"])
    assert all(torch.isfinite(torch.tensor(r["resharded"]["losses"])).all() for r in runs)


def test_with_one_rank_per_replica_it_trains_the_same_bits_as_onebit_diloco(sessions: dict) -> None:
    for r in scenario_results(sessions["2x1"], "2x1"):
        (fsdp, fsdp_losses), (ddp, ddp_losses) = r["same_as_ddp"][True], r["same_as_ddp"][False]
        assert fsdp_losses == ddp_losses and len(fsdp_losses) == STEPS
        assert torch.equal(fsdp, ddp)


def test_another_replica_count_one_replica_an_uneven_layout_and_a_compressed_inner_optimizer_are_refused(sessions: dict) -> None:
    refused = scenario_results(sessions["refused"], "refused")
    for r in refused:
        assert r["error"] is not None and "saved by 2 replicas and this run has 4" in r["error"], r["error"]
        assert r["uneven"] is not None and "ranks_per_node=3 does not divide the 4 ranks" in r["uneven"]
        assert r["compressed_inner"] is not None and "OnebitAdam exchanges compressed momenta" in r["compressed_inner"]
        # a single file (as strategy='ddp' writes) says what it is and what to do instead
        assert r["file"] is not None and "strategy='onebit_diloco_fsdp' cannot load the checkpoint" in r["file"]
        assert "is a single-file checkpoint (as strategy='ddp' writes)" in r["file"], r["file"]
    for r in scenario_results(sessions["2x1"], "2x1"):  # and onebit_diloco, given this strategy's folder
        message = r["folder_under_ddp"]
        assert message is not None and "strategy='onebit_diloco' cannot load the checkpoint" in message, message
        assert "is a onebit_diloco_fsdp checkpoint" in message and "resume it with strategy='onebit_diloco_fsdp'" in (
            message)
    for r in scenario_results(sessions["2x1"], "2x1"):
        assert r["one_replica"] is not None and "needs two replicas or more" in r["one_replica"]


def test_bf16_accumulation_clipping_strategy_sharding_validation_and_the_monitor(sessions: dict) -> None:
    runs = scenario_results(sessions["2x2"], "features")
    assert runs[0]["by_name"] == "OnebitDiLoCoFSDPStrategy"
    # an optimizer built before sharding was pointed at the sharded parameters, and stepped them all
    assert all(r["early_points_at_shards"] for r in runs)
    for same_shard in _replicas(runs, 2):
        for kind in ("plain", "validated"):
            assert torch.equal(same_shard[0][kind]["final"], same_shard[1][kind]["final"])
    for r in runs:
        plain, validated = r["plain"], r["validated"]
        # validation changes nothing in the training, and sees the outer model (not the replica's own shards)
        assert torch.equal(plain["final"], validated["final"])
        assert len(validated["validated"]) == 3  # after the optimizer steps 3, 6 and 9
        for seen, outer in validated["validated"]:
            assert torch.equal(seen, outer)
        # the default sync_every: a sync after every whole period and one at the end of fit for the steps left
        every = DEFAULTS.sync_every
        assert STEPS % every and plain["syncs"] == STEPS // every + 1
        # the monitor logs the strategy's bytes per step (the end of fit's sync comes after the last step's log)
        assert plain["logged"] and 0 < plain["logged"][-1] < plain["bytes"]
        assert plain["logged"][every - 2] == 0 < plain["logged"][every - 1]  # nothing crosses before the first sync
        assert sum(plain["losses"][-4:]) < sum(plain["losses"][:4])
