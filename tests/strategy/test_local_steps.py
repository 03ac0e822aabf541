"""The ``onebit_diloco`` strategy (``OnebitDiLoCoStrategy``) under Lightning on 2, 3 and 4 gloo ranks, flat (a replica
per rank) and as 2 replicas of 2 ranks (``ranks_per_node=2``): replicas bitwise identical after every outer sync and
only then, the ranks of one replica identical always, a short run learns, resume is bitwise, validation sees the outer
model, the bytes per sync are the formula's, and every bad setting stops every rank before any collective.

One spawned session per world size runs all its scenarios (``run_scenarios``): ranks take seconds to start on 2 cores
and a fit of the 65-parameter ``Regressor`` a fraction of one.
"""

from __future__ import annotations

import os
from functools import partial
from typing import Any, Optional

import pytest
import torch
from torch import nn

import lightning.pytorch as pl
from lightning.pytorch.callbacks import ModelCheckpoint
from lightning_onebit import CommunicationMonitor, OnebitDiLoCoStrategy
from lightning_onebit.comm import BucketLayout, OuterCompression, ring_allreduce_bytes
from lightning_onebit.strategy.local_steps import DEFAULTS, OUTER_LR
from tests.distributed import run_sessions, scenario_results
from tests.lightning_models import Regressor, flat_params, held_out_loss, loader, trainer_kwargs
from tests.strategy.test_topology_lightning import RecordingLogger
from tests.tensors import identical

N_PARAMS = 65
SYNC_EVERY = 3


# ======================================================================================== in-rank helpers
class Recorder(pl.Callback):
    """After every optimizer step: the flat parameters, the inner step and the position in the outer period; in
    every validation, the parameters the validation saw."""

    def __init__(self) -> None:
        self.steps: list[dict[str, Any]] = []
        self.validated: list[torch.Tensor] = []

    def on_train_batch_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule, *args: Any) -> None:
        strategy = trainer.strategy
        self.steps.append({"step": trainer.global_step, "since_sync": strategy.steps_since_sync,
                           "params": flat_params(pl_module), "bytes": strategy.communication})

    def on_validation_batch_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule, *args: Any) -> None:
        self.validated.append(flat_params(pl_module))


class NormalizedRegressor(Regressor):
    """``Regressor`` with a BatchNorm after its first layer: buffers (running statistics) that each replica's own
    data change."""

    def __init__(self, **kwargs: Any) -> None:
        super().__init__(**kwargs)
        self.norm = nn.BatchNorm1d(self.l1.out_features)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.l2(torch.tanh(self.norm(self.l1(x))))


def flat_buffers(module: nn.Module) -> torch.Tensor:
    return torch.cat([b.detach().double().reshape(-1).clone() for b in module.buffers()])


class BufferRecorder(pl.Callback):
    """After every optimizer step: the flat buffers and the position in the outer period."""

    def __init__(self) -> None:
        self.steps: list[dict[str, Any]] = []

    def on_train_batch_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule, *args: Any) -> None:
        self.steps.append({"since_sync": trainer.strategy.steps_since_sync, "buffers": flat_buffers(pl_module)})


class ValidatedRegressor(Regressor):
    def validation_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        x, y = batch
        return nn.functional.mse_loss(self(x), y)


def _fit(rank: int, world_size: int, workdir: str, *, max_steps: int = 9, model: Optional[Regressor] = None,
         callbacks: Optional[list] = None, ckpt_path: Optional[str] = None, val: bool = False,
         **strategy_kwargs: Any) -> dict[str, Any]:
    strategy_kwargs.setdefault("sync_every", SYNC_EVERY)
    strategy = OnebitDiLoCoStrategy(**strategy_kwargs)
    model = model or Regressor(optimizer="adamw", seed=rank, data_seed=7 + rank)  # unseeded alike: rank 0's wins
    recorder = Recorder()
    extra = dict(limit_val_batches=1, val_check_interval=4) if val else dict(limit_val_batches=0)
    extra["enable_checkpointing"] = any(isinstance(c, ModelCheckpoint) for c in callbacks or [])
    trainer = pl.Trainer(**trainer_kwargs(world_size, max_steps, strategy=strategy,
                                          callbacks=[recorder] + (callbacks or []), **extra))
    trainer.fit(model, loader(rank, 20), loader(100, 1) if val else None, ckpt_path=ckpt_path)
    return {"steps": recorder.steps, "validated": recorder.validated, "final": flat_params(model),
            "losses": model.losses, "held_out": held_out_loss(model), "communication": strategy.communication,
            "last_sync": strategy.last_sync_communication, "inner_steps": strategy.inner_steps}


def _learns(rank: int, world_size: int, workdir: str, compressor: str, per_replica: int) -> dict:
    start = held_out_loss(Regressor(optimizer="adamw", seed=0))
    out = _fit(rank, world_size, workdir, max_steps=10, compressor=compressor, ranks_per_node=per_replica)
    return dict(out, start=start)


def _resume(rank: int, world_size: int, workdir: str, compressor: str, per_replica: int) -> dict:
    run = os.path.join(workdir, f"resume-{compressor}-{per_replica}")

    def fit(**kwargs: Any) -> dict:
        return _fit(rank, world_size, workdir, max_steps=10, compressor=compressor, ranks_per_node=per_replica,
                    outer_optimizer="nesterov", **kwargs)
    every_4 = ModelCheckpoint(dirpath=run, filename="{step}", every_n_train_steps=4, save_top_k=-1)
    full = fit(callbacks=[every_4])
    resumed = fit(ckpt_path=os.path.join(run, "step=4.ckpt"))
    saved = torch.load(os.path.join(run, "step=4.ckpt"), weights_only=False)["state_dict"]
    return {"full": full, "resumed": resumed, "saved_weights": torch.cat([t.reshape(-1) for t in saved.values()]),
            "sidecar": os.path.exists(os.path.join(run, f"step=4.ckpt.onebit-rank{rank}"))}


def _validation(rank: int, world_size: int, workdir: str) -> dict:
    model = lambda: ValidatedRegressor(optimizer="adamw", seed=0, data_seed=7 + rank)  # noqa: E731
    return {"with": _fit(rank, world_size, workdir, max_steps=10, model=model(), val=True, compressor="none",
                         ranks_per_node=1),
            "without": _fit(rank, world_size, workdir, max_steps=10, model=model(), compressor="none",
                            ranks_per_node=1)}


def _monitored(rank: int, world_size: int, workdir: str, compressor: str, per_replica: int) -> dict:
    logger, monitor = RecordingLogger(), CommunicationMonitor(prog_bar=False)
    strategy = OnebitDiLoCoStrategy(sync_every=SYNC_EVERY, compressor=compressor, ranks_per_node=per_replica)
    trainer = pl.Trainer(**trainer_kwargs(world_size, 7, strategy=strategy, callbacks=[monitor], logger=logger,
                                          log_every_n_steps=1, limit_val_batches=0))
    trainer.fit(Regressor(optimizer="adamw", seed=0), loader(rank, 20))
    rows = [r for r in logger.rows if "comm/bytes_sent_inter_node" in r]
    return {"rows": rows, "monitor": monitor.communication, "strategy": strategy.communication}


def _refused(rank: int, world_size: int, workdir: str, **strategy_kwargs: Any) -> dict:
    try:
        _fit(rank, world_size, workdir, **strategy_kwargs)
    except ValueError as error:
        return {"error": str(error)}
    return {"error": None}


def _refused_compressed(rank: int, world_size: int, workdir: str) -> dict:
    """OnebitAdam as the inner optimizer."""
    return _refused(rank, world_size, workdir, ranks_per_node=1, model=Regressor(optimizer="onebit", seed=0))


def _missing_sidecar(rank: int, world_size: int, workdir: str) -> dict:
    run = os.path.join(workdir, "missing")
    _fit(rank, world_size, workdir, max_steps=4, ranks_per_node=1, compressor="topk",
         callbacks=[ModelCheckpoint(dirpath=run, filename="{step}", every_n_train_steps=4, save_top_k=-1)])
    torch.distributed.barrier()
    if rank == 1:
        os.remove(os.path.join(run, "step=4.ckpt.onebit-rank1"))
    torch.distributed.barrier()
    try:
        _fit(rank, world_size, workdir, max_steps=8, ranks_per_node=1, compressor="topk",
             ckpt_path=os.path.join(run, "step=4.ckpt"))
    except RuntimeError as error:
        return {"error": str(error)}
    return {"error": None}


def _buffers(rank: int, world_size: int, workdir: str, per_replica: int) -> dict:
    """A BatchNorm model, 10 steps (syncs after 3, 6 and 9, one more at the end of fit); then the same run saved at
    step 4 (between two syncs) and resumed."""
    run = os.path.join(workdir, f"buffers-{per_replica}")

    def fit(**kwargs: Any) -> dict:
        recorder = BufferRecorder()
        model = NormalizedRegressor(optimizer="adamw", seed=0, data_seed=7 + rank)
        out = _fit(rank, world_size, workdir, max_steps=10, model=model, compressor="onebit",
                   ranks_per_node=per_replica, callbacks=[recorder] + kwargs.pop("callbacks", []), **kwargs)
        return dict(out, buffer_steps=recorder.steps, final_buffers=flat_buffers(model))
    every_4 = ModelCheckpoint(dirpath=run, filename="{step}", every_n_train_steps=4, save_top_k=-1)
    return {"full": fit(callbacks=[every_4]), "resumed": fit(ckpt_path=os.path.join(run, "step=4.ckpt"))}


SCENARIOS = {
    2: (("learns_onebit", partial(_learns, compressor="onebit", per_replica=1)),
        ("learns_topk", partial(_learns, compressor="topk", per_replica=1)),
        ("resume_onebit", partial(_resume, compressor="onebit", per_replica=1)),
        ("validation", _validation),
        ("monitored_onebit", partial(_monitored, compressor="onebit", per_replica=1)),
        ("one_replica", partial(_refused, ranks_per_node=2)),
        ("one_node", _refused),
        ("compressed_inner", _refused_compressed),
        ("missing_sidecar", _missing_sidecar),
        ("buffers", partial(_buffers, per_replica=1))),
    3: (("learns_bf16", partial(_learns, compressor="bf16", per_replica=1)),
        ("uneven", partial(_refused, ranks_per_node=2))),
    4: (("learns_none_2x2", partial(_learns, compressor="none", per_replica=2)),
        ("learns_onebit_2x2", partial(_learns, compressor="onebit", per_replica=2)),
        ("learns_topk_flat", partial(_learns, compressor="topk", per_replica=1)),
        ("resume_topk_2x2", partial(_resume, compressor="topk", per_replica=2)),
        ("monitored_none_2x2", partial(_monitored, compressor="none", per_replica=2)),
        ("buffers_2x2", partial(_buffers, per_replica=2))),
}


@pytest.fixture(scope="module")
def sessions(tmp_path_factory) -> dict[int, list[dict]]:
    return run_sessions(SCENARIOS, tmp_path_factory, "diloco")


# ======================================================================================== tests
LEARNS = [(2, "learns_onebit", 1), (2, "learns_topk", 1), (3, "learns_bf16", 1), (4, "learns_none_2x2", 2),
          (4, "learns_onebit_2x2", 2), (4, "learns_topk_flat", 1)]


@pytest.mark.parametrize("world_size, name, per_replica", LEARNS)
def test_replicas_are_identical_after_every_outer_sync_and_only_then(sessions, world_size, name, per_replica):
    results = scenario_results(sessions[world_size], name)
    steps = len(results[0]["steps"])
    assert steps == 10
    synced_at = [i + 1 for i in range(steps) if results[0]["steps"][i]["since_sync"] == 0]
    assert synced_at == [3, 6, 9]
    for i in range(steps):
        params = [results[r]["steps"][i]["params"] for r in range(world_size)]
        for replica in range(world_size // per_replica):  # inside a replica: DDP, identical always
            members = params[replica * per_replica : (replica + 1) * per_replica]
            assert identical(members), f"step {i + 1}: replica {replica}'s ranks differ"
        if results[0]["steps"][i]["since_sync"] == 0:
            assert identical(params), f"step {i + 1}: replicas differ right after the outer sync"
        else:
            firsts = params[::per_replica]
            assert not any(torch.equal(firsts[0], p) for p in firsts[1:]), f"step {i + 1}: replicas did not drift"
    # the last period was partial (step 10): fit ends with one more outer step, and every rank holds it
    assert identical([r["final"] for r in results])
    assert not torch.equal(results[0]["final"], results[0]["steps"][-1]["params"])
    assert all(r["inner_steps"] == 10 for r in results)


@pytest.mark.parametrize("world_size, name", [(2, "buffers"), (4, "buffers_2x2")])
def test_buffers_are_rank_0s_after_every_sync_and_resume_bitwise(sessions, world_size, name):
    results = scenario_results(sessions[world_size], name)
    full = [r["full"] for r in results]
    steps = full[0]["buffer_steps"]
    assert [i + 1 for i, s in enumerate(steps) if s["since_sync"] == 0] == [3, 6, 9]
    for i in range(len(steps)):
        buffers = [f["buffer_steps"][i]["buffers"] for f in full]
        if steps[i]["since_sync"] == 0:
            assert identical(buffers), f"step {i + 1}: the ranks' buffers differ right after the outer sync"
        else:  # each replica's own data moved its running statistics
            assert not torch.equal(buffers[0], buffers[-1]), f"step {i + 1}: the replicas' buffers did not drift"
    assert identical([f["final_buffers"] for f in full])  # the sync at the end of fit
    for rank, r in enumerate(results):  # the sidecar kept this rank's own buffers, saved between two syncs
        for before, after in zip(r["full"]["buffer_steps"][4:], r["resumed"]["buffer_steps"]):
            assert torch.equal(before["buffers"], after["buffers"]), f"rank {rank}: buffers after the resume"
        assert torch.equal(r["full"]["final"], r["resumed"]["final"])
        assert torch.equal(r["full"]["final_buffers"], r["resumed"]["final_buffers"])
    # the broadcasts are counted with the outer bytes: 4 syncs of the buffers (3 periods and the end of fit)
    buffer_bytes = sum(b.numel() * b.element_size() for b in NormalizedRegressor().buffers())
    for r in results:
        extra = r["full"]["communication"].bytes_sent_inter_node - _outer_bytes(r["full"])
        assert extra == 4 * (buffer_bytes * (world_size - 1) // world_size)


def _outer_bytes(out: dict) -> int:
    """The inter-node bytes of the outer exchanges alone: the last sync's times the syncs (every sync the same)."""
    return 4 * out["last_sync"].bytes_sent_inter_node


@pytest.mark.parametrize("world_size, name, per_replica", LEARNS)
def test_a_short_run_learns(sessions, world_size, name, per_replica):
    results = scenario_results(sessions[world_size], name)
    # the ranks' mean training loss (each rank's own batches: one rank's last 3 can sit above its first 3 under the
    # damped outer step, which pulls every replica part of the way back at each sync)
    first = sum(sum(r["losses"][:3]) for r in results) / (3 * len(results))
    last = sum(sum(r["losses"][-3:]) for r in results) / (3 * len(results))
    assert last < first
    for result in results:  # the synced model, on held-out data
        assert result["held_out"] < result["start"]


@pytest.mark.parametrize("world_size, name", [(2, "resume_onebit"), (4, "resume_topk_2x2")])
def test_an_interrupted_run_resumed_equals_the_uninterrupted_one_bit_for_bit(sessions, world_size, name):
    results = scenario_results(sessions[world_size], name)
    for r, result in enumerate(results):
        full, resumed = result["full"], result["resumed"]
        assert result["sidecar"]
        assert [s["step"] for s in resumed["steps"]] == list(range(5, 11))
        for a, b in zip(full["steps"][4:], resumed["steps"]):
            assert a["since_sync"] == b["since_sync"]
            assert torch.equal(a["params"], b["params"]), f"rank {r}: step {a['step']} differs after the resume"
        assert full["losses"][4:] == resumed["losses"]
        assert torch.equal(full["final"], resumed["final"])
    # the checkpoint's weights are the outer model (the parameters right after the sync at step 3), not a replica's
    assert torch.equal(results[0]["saved_weights"], results[0]["full"]["steps"][2]["params"])
    assert not torch.equal(results[0]["saved_weights"], results[0]["full"]["steps"][3]["params"])


def test_validation_sees_the_outer_model_and_leaves_training_unchanged(sessions):
    results = scenario_results(sessions[2], "validation")
    for result in results:
        with_val, without = result["with"], result["without"]
        # validation after steps 4 and 8: one and two inner steps after the syncs at 3 and 6
        assert len(with_val["validated"]) == 2
        assert torch.equal(with_val["validated"][0], with_val["steps"][2]["params"])
        assert torch.equal(with_val["validated"][1], with_val["steps"][5]["params"])
        assert not torch.equal(with_val["validated"][0], with_val["steps"][3]["params"])
        for a, b in zip(with_val["steps"], without["steps"]):
            assert torch.equal(a["params"], b["params"]), f"step {a['step']}: validation changed training"


def _onebit_bytes_per_sync(replicas: int) -> int:
    """One sync of the 65 parameters in one bucket, by hand. Two replicas: one payload to the peer, a float32 scale
    per piece (48, 8, 8, 1 and the padding) and the sign bits, to 4 bytes; more: the two-phase exchange's blocks of
    ``S_max`` scales and ``c / 8`` bytes, ``2 (M - 1)`` of them."""
    numel = -(-N_PARAMS // (8 * replicas)) * 8 * replicas
    if replicas == 2:
        return 4 * -(-(4 * 5 + numel // 8) // 4)
    cuts = {0, 48, 56, 64, 65, numel} | set(range(0, numel, numel // replicas))
    chunk = numel // replicas
    s_max = max(len([c for c in cuts if k * chunk < c <= (k + 1) * chunk]) for k in range(replicas))
    return 2 * (replicas - 1) * (4 * s_max + chunk // 8)


def test_bytes_per_sync_are_the_formula_and_the_monitor_logs_them(sessions):
    # flat, 2 replicas, 1 bit: nothing between syncs, the payload all-gathered at each (30 bytes to 32; the two-phase
    # exchange would send 50)
    results = scenario_results(sessions[2], "monitored_onebit")
    per_sync = _onebit_bytes_per_sync(2)
    assert per_sync == 32 < BucketLayout.build((48, 8, 8, 1, 15), 2).bytes_per_call() == 50
    for result in results:
        inter = [row["comm/bytes_sent_inter_node"] for row in result["rows"]]
        # syncs after steps 3 and 6, and at the end of fit (step 7, after the monitor's last row)
        assert inter == [0, 0, per_sync, 0, 0, per_sync, 0]
        assert result["strategy"].bytes_sent == 3 * per_sync
        assert result["monitor"].bytes_sent == 3 * per_sync  # read after fit: the final sync counts too
    # 2 replicas of 2 ranks, fp32: each rank sends its half (33 of 66 values) to its peer of the other replica, then
    # the new halves are gathered inside the replica; the inner DDP averages the 65 gradients every step
    results = scenario_results(sessions[4], "monitored_none_2x2")
    shard = 33
    inter_per_sync = ring_allreduce_bytes(shard, 4, 2)
    gather = (2 - 1) * shard * 4
    ddp = ring_allreduce_bytes(N_PARAMS, 4, 2)
    for result in results:
        inter = [row["comm/bytes_sent_inter_node"] for row in result["rows"]]
        intra = [row["comm/bytes_sent_intra_node"] for row in result["rows"]]
        assert inter == [0, 0, inter_per_sync, 0, 0, inter_per_sync, 0]
        assert intra == [ddp, ddp, ddp + gather, ddp, ddp, ddp + gather, ddp]
        assert result["strategy"].bytes_sent_inter_node == 3 * inter_per_sync


def test_learning_scenarios_count_bytes_only_at_syncs(sessions):
    for world_size, name, per_replica in LEARNS:
        for result in scenario_results(sessions[world_size], name):
            inter = [s["bytes"].bytes_sent_inter_node for s in result["steps"]]
            grew = [i + 1 for i in range(len(inter)) if inter[i] > (inter[i - 1] if i else 0)]
            assert grew == [3, 6, 9], (name, inter)


@pytest.mark.parametrize("world_size, name, match", [
    (2, "one_replica", "needs two replicas or more, but all 2 rank\\(s\\) form one replica"),
    (2, "one_node", "nothing to synchronise"),
    (2, "compressed_inner", "but OnebitAdam exchanges compressed momenta across all ranks at every step: return a "
                            "torch optimizer"),
    (3, "uneven", "ranks_per_node=2 does not divide the 3 ranks"),
])
def test_a_bad_replica_layout_or_a_compressed_inner_optimizer_stops_every_rank(sessions, world_size, name, match):
    import re

    for result in scenario_results(sessions[world_size], name):
        assert result["error"] is not None and re.search(match, result["error"]), result["error"]


def test_a_missing_sidecar_stops_every_rank_with_the_reason(sessions):
    for result in scenario_results(sessions[2], "missing_sidecar"):
        assert result["error"] is not None
        assert "cannot resume" in result["error"] and "onebit-rank1" in result["error"]
        assert "does not exist" in result["error"]


# ======================================================================================== arguments, one process
@pytest.mark.parametrize("kwargs, match", [
    (dict(sync_every=0), "sync_every must be an integer >= 1"),
    (dict(sync_every=2.5), "sync_every must be an integer >= 1"),
    (dict(compressor="fp8"), "compressor must be one of"),
    (dict(outer_optimizer="adam"), "outer_optimizer must be one of"),
    (dict(outer_lr=0.0), "outer_lr must be"),
    (dict(outer_momentum=1.0), "outer_momentum must be"),
    (dict(ranks_per_node=0), "ranks_per_node must be"),
    (dict(bucket_cap_mb=0), "bucket_cap_mb must be"),
    (dict(ddp_kwargs={"process_group": None}), "do not pass process_group"),
    (dict(ddp_kwargs={"bucket_cap_mb": 1}), "ddp_bucket_cap_mb"),
])
def test_bad_arguments_are_refused_where_they_are_given(kwargs, match):
    with pytest.raises(ValueError, match=match):
        OnebitDiLoCoStrategy(**kwargs)


def test_the_strategy_is_registered_with_the_measured_defaults():
    trainer = pl.Trainer(strategy="onebit_diloco", accelerator="cpu", devices=1, logger=False)
    strategy = trainer.strategy
    assert isinstance(strategy, OnebitDiLoCoStrategy)
    assert (strategy.sync_every, strategy.compression) == (4, OuterCompression("onebit")) == (
        DEFAULTS.sync_every, OuterCompression(DEFAULTS.compressor))
    assert (strategy.outer_optimizer, strategy.outer_lr, strategy.outer_momentum) == ("sgd", 0.7, 0.9)
    # outer_lr's default follows the outer optimizer: DiLoCo's Nesterov keeps its 0.7; a given one is kept
    assert OnebitDiLoCoStrategy(outer_optimizer="nesterov").outer_lr == 0.7 == OUTER_LR["nesterov"]
    assert OnebitDiLoCoStrategy(outer_optimizer="nesterov", outer_lr=0.5).outer_lr == 0.5
    topk = OnebitDiLoCoStrategy(compressor=OuterCompression("topk", keep=32))
    assert topk.compression.keep == 32
