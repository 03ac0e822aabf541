"""``onebit_diloco`` under the precisions, gradient accumulation and clipping, on 2 gloo ranks (flat: a replica per
rank) and 4 (2 replicas of 2 ranks): ``bf16-mixed``, ``16-mixed`` with a step skipped by the loss scaler on one
replica, ``accumulate_grad_batches=2`` and ``gradient_clip_val`` by norm and by value.

Every fit asserts that it learns, that the ranks of a replica are identical after every inner step and the replicas
after every outer sync, that an outer sync runs after every ``sync_every`` optimizer steps (an inner step is an
optimizer step: not a batch under accumulation, and still one when the loss scaler skips it), that the outer
parameters and the pseudo-gradient exchange stay fp32 and outside autocast, and that an exchange under autocast
gives the same bits as without it. One spawned session per world size runs every scenario (``run_scenarios``).
"""

from __future__ import annotations

import os
from functools import partial
from typing import Any, Optional

import pytest
import torch

import lightning.pytorch as pl
from lightning.pytorch.callbacks import ModelCheckpoint
from lightning.pytorch.plugins.precision import MixedPrecision
from lightning_onebit import OnebitDiLoCoStrategy
from lightning_onebit.comm import OUTER_COMPRESSIONS, OuterCompression, make_outer_compressor
from lightning_onebit.optim.outer_step import OuterStep
from lightning_onebit.strategy.local_steps import OUTER_LR
from tests.distributed import run_sessions, scenario_results
from tests.lightning_models import Regressor, flat_params, held_out_loss, loader, trainer_kwargs
from tests.tensors import identical, seed_of

SYNC_EVERY = 3
STEPS = 20  # inner steps: a sync after every third, and one more at the end of fit (steps 19 and 20: a partial period)
SYNCED_AT = list(range(SYNC_EVERY, STEPS + 1, SYNC_EVERY))
FP16_INIT_SCALE = 2.0**10  # GradScaler's default 2**16 overflows this model's first steps by itself
INF_AT_STEP = 5  # global step 5 is the 6th inner step: the one that ends the second outer period
RESUME_AT = 8  # a checkpoint after the skip (step 6), two inner steps into the third outer period
CLIP_NORM, CLIP_VALUE = 0.05, 0.01  # below the model's usual gradient norm / largest gradient: clipping is active


# ======================================================================================== in-rank helpers
class GradientRegressor(Regressor):
    """``Regressor`` that also records the gradients after Lightning's clipping (unscaled under 16-mixed), which the
    inner optimizer steps on; ``Regressor.records[i]["grad"]`` holds them as ``on_before_optimizer_step`` saw them,
    before clipping."""

    def __init__(self, **kwargs: Any) -> None:
        super().__init__(**kwargs)
        self.clipped_grads: list[torch.Tensor] = []

    def configure_gradient_clipping(self, optimizer: Any, gradient_clip_val: Any = None,
                                    gradient_clip_algorithm: Any = None) -> None:
        super().configure_gradient_clipping(optimizer, gradient_clip_val, gradient_clip_algorithm)
        self.clipped_grads.append(torch.cat([p.grad.detach().reshape(-1).clone() for p in self.parameters()]))


class StepRecorder(pl.Callback):
    """After every optimizer step (not every batch: accumulation), the parameters and the strategy's counts; around
    every outer sync, the local parameters it starts from and whether autocast was on; in every exchange, the
    dtypes of the pseudo-gradient buckets and whether autocast was on."""

    def __init__(self) -> None:
        self.steps: list[dict[str, Any]] = []
        self.syncs: list[dict[str, Any]] = []
        self.exchanges: list[dict[str, Any]] = []

    def on_train_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        strategy = trainer.strategy
        (fragment,) = strategy.outer_step.fragments  # one fragment, no overlap: the defaults
        start, compressor = fragment.start, fragment.compressor
        average = compressor.start_average_  # every exchange starts here

        def recorded_start() -> None:
            self.syncs.append({"inner_steps": strategy.inner_steps, "local": flat_params(pl_module),
                               "outer": torch.cat([v.reshape(-1).clone()
                                                   for v in strategy.outer_step.outer_values().values()]),
                               "autocast": torch.is_autocast_enabled("cpu")})
            start()

        def recorded_average(buckets: Any) -> Any:
            self.exchanges.append({"dtypes": {b.values.dtype for b in buckets},
                                   "autocast": torch.is_autocast_enabled("cpu")})
            return average(buckets)
        fragment.start = recorded_start
        compressor.start_average_ = recorded_average

    def on_train_batch_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule, *args: Any) -> None:
        if trainer.global_step == (self.steps[-1]["step"] if self.steps else 0):
            return  # an accumulating batch: no optimizer step
        strategy = trainer.strategy
        scaler = getattr(trainer.precision_plugin, "scaler", None)
        self.steps.append({"step": trainer.global_step, "inner_steps": strategy.inner_steps,
                           "outer_syncs": strategy.outer_syncs, "since_sync": strategy.steps_since_sync,
                           "params": flat_params(pl_module), "scale": None if scaler is None else scaler.get_scale(),
                           "param_dtypes": {p.dtype for p in pl_module.parameters()},
                           "outer_dtypes": {v.dtype for v in strategy.outer_step.outer_values().values()}})


def _fit(rank: int, world_size: int, workdir: str, *, per_replica: int, accumulate: int = 1,
         precision: Optional[str] = None, fp16: bool = False, clip: Optional[tuple[str, float]] = None,
         inf_at_step: Optional[int] = None, inf_rank: int = 1, compressor: str = "onebit",
         data_follow_the_step: bool = False, callbacks: Optional[list] = None,
         ckpt_path: Optional[str] = None, eps: float = 1e-8) -> dict[str, Any]:
    strategy = OnebitDiLoCoStrategy(sync_every=SYNC_EVERY, compressor=compressor, ranks_per_node=per_replica)
    model = GradientRegressor(optimizer="adamw", seed=rank, inf_at_step=inf_at_step, inf_rank=inf_rank,
                              data_seed=7 + rank if data_follow_the_step else None, eps=eps)
    extra: dict[str, Any] = {"accumulate_grad_batches": accumulate, "limit_val_batches": 0,
                             "enable_checkpointing": bool(callbacks)}
    if precision is not None:
        extra["precision"] = precision
    if fp16:
        scaler = torch.amp.GradScaler("cpu", init_scale=FP16_INIT_SCALE)
        extra["plugins"] = [MixedPrecision("16-mixed", "cpu", scaler=scaler)]
    if clip is not None:
        extra.update(gradient_clip_algorithm=clip[0], gradient_clip_val=clip[1])
    recorder = StepRecorder()
    callbacks = [recorder] + (callbacks or [])
    trainer = pl.Trainer(**trainer_kwargs(world_size, STEPS, strategy=strategy, callbacks=callbacks, **extra))
    trainer.fit(model, loader(rank, STEPS * accumulate), ckpt_path=ckpt_path)
    inner = trainer.optimizers[0]
    return {"steps": recorder.steps, "syncs": recorder.syncs, "exchanges": recorder.exchanges,
            "losses": model.losses, "held_out": held_out_loss(model), "final": flat_params(model),
            "inner_steps": strategy.inner_steps,
            "outer_syncs": strategy.outer_syncs, "batches": len(model.losses),
            "adamw_steps": int(inner.state[next(model.parameters())]["step"]),
            "unclipped_grads": [r["grad"] for r in model.records], "clipped_grads": model.clipped_grads}


def _fp16_resume(rank: int, world_size: int, workdir: str, per_replica: int) -> dict[str, Any]:
    """16-mixed, with a step skipped by the scaler of the replica of rank ``world_size - 1`` (not rank 0's): a fit
    with a checkpoint at step RESUME_AT, and a fit resumed from it."""
    run = os.path.join(workdir, "fp16_resume")
    fit = partial(_fit, rank, world_size, workdir, per_replica=per_replica, fp16=True, inf_at_step=INF_AT_STEP,
                  inf_rank=world_size - 1, data_follow_the_step=True)
    every = ModelCheckpoint(dirpath=run, filename="{step}", every_n_train_steps=RESUME_AT, save_top_k=-1)
    full = fit(callbacks=[every])
    resumed = fit(ckpt_path=os.path.join(run, f"step={RESUME_AT}.ckpt"))
    return {"full": full, "resumed": resumed}


def _diverged_replica(rank: int, world_size: int, workdir: str, per_replica: int) -> dict[str, Any]:
    """32-true (no loss scaler), the loss of rank 1 times inf at global step INF_AT_STEP: its replica's parameters
    turn NaN, and the outer sync that ends that period must stop every rank before anything is exchanged."""
    strategy = OnebitDiLoCoStrategy(sync_every=SYNC_EVERY, ranks_per_node=per_replica)
    model = GradientRegressor(optimizer="adamw", seed=rank, inf_at_step=INF_AT_STEP, inf_rank=1)
    kept: dict[str, Any] = {}

    class Keep(pl.Callback):
        def on_train_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
            kept["outer_step"] = trainer.strategy.outer_step

        def on_train_batch_end(self, trainer: pl.Trainer, *args: Any) -> None:
            if trainer.strategy.steps_since_sync == 0:  # right after a sync: the outer model every replica holds
                kept["outer_after_sync"] = torch.cat([v.reshape(-1).clone() for v in
                                                      kept["outer_step"].outer_values().values()])

    trainer = pl.Trainer(**trainer_kwargs(world_size, STEPS, strategy=strategy, callbacks=[Keep()],
                                          limit_val_batches=0, enable_checkpointing=False))
    try:
        trainer.fit(model, loader(rank, STEPS))
        error = None
    except RuntimeError as caught:
        error = str(caught)
    outer_step = kept["outer_step"]
    return {"error": error, "syncs": outer_step.syncs, "outer_after_sync": kept["outer_after_sync"],
            "outer_now": torch.cat([v.reshape(-1).clone() for v in outer_step.outer_values().values()]),
            "batches": len(model.losses)}


def _exchange_under_autocast(rank: int, world_size: int, workdir: str) -> dict[str, Any]:
    """Two outer syncs of every compressor over all ranks (a replica per rank), once inside a bf16 autocast region
    and once outside, from the same parameters: the outer parameters after each, per compressor and region."""
    out: dict[str, Any] = {}
    for kind in OUTER_COMPRESSIONS:
        for region in ("autocast", "plain"):
            torch.manual_seed(seed_of("outer", kind))
            params = [torch.randn(40), torch.randn(7, 3)]  # the same start on every rank
            step = OuterStep(params, make_outer_compressor(OuterCompression(kind)), "nesterov", 0.7, 0.9)
            outers = []
            for sync in range(2):
                generator = torch.Generator().manual_seed(seed_of(kind, rank, sync))
                with torch.no_grad():
                    for p in params:
                        p.add_(torch.randn(p.shape, generator=generator), alpha=0.1)  # this replica's inner steps
                with torch.autocast("cpu", dtype=torch.bfloat16, enabled=region == "autocast"):
                    step.sync()
                outers.append(torch.cat([p.reshape(-1).clone() for p in params]))
            out[(kind, region)] = outers
    return out


def _scenarios(per_replica: int) -> tuple:
    fit = partial(_fit, per_replica=per_replica)
    return (("bf16", partial(fit, precision="bf16-mixed")),
            ("bf16_none", partial(fit, precision="bf16-mixed", compressor="none")),
            ("fp16_skip", partial(fit, fp16=True, inf_at_step=INF_AT_STEP)),
            ("accumulate", partial(fit, accumulate=2)),
            ("clip_norm", partial(fit, clip=("norm", CLIP_NORM))),
            ("clip_value", partial(fit, clip=("value", CLIP_VALUE))),
            ("clip_norm_fp16", partial(fit, fp16=True, clip=("norm", CLIP_NORM))),
            ("fp16_resume", partial(_fp16_resume, per_replica=per_replica)),
            ("bf16_true", partial(fit, precision="bf16-true")),
            # AdamW's eps 1e-8 is 0 in fp16 (a zero second moment then divides by zero): 1e-4, as fp16 Adam takes
            ("fp16_true", partial(fit, precision="16-true", eps=1e-4)),
            ("diverged", partial(_diverged_replica, per_replica=per_replica)))


SCENARIOS = {2: _scenarios(1) + (("exchange_under_autocast", _exchange_under_autocast),), 4: _scenarios(2)}
PER_REPLICA = {2: 1, 4: 2}


@pytest.fixture(scope="module")
def sessions(tmp_path_factory) -> dict[int, list[dict]]:
    return run_sessions(SCENARIOS, tmp_path_factory, "diloco_precision")


# ======================================================================================== tests
FITS = ["bf16", "bf16_none", "fp16_skip", "accumulate", "clip_norm", "clip_value", "clip_norm_fp16", "bf16_true",
        "fp16_true"]
CASES = [(world_size, name) for world_size in SCENARIOS for name in FITS]
#: the fits whose parameters are fp32 (mixed precision keeps fp32 master weights; bf16-true and 16-true have none)
FP32_CASES = [(world_size, name) for world_size, name in CASES if name not in ("bf16_true", "fp16_true")]


def _replicas(results: list[dict], per_replica: int) -> list[list[dict]]:
    return [results[k : k + per_replica] for k in range(0, len(results), per_replica)]


@pytest.mark.parametrize("world_size, name", CASES)
def test_replicas_are_identical_after_every_outer_sync_and_syncs_follow_the_optimizer_steps(
        sessions, world_size, name):
    results, per_replica = scenario_results(sessions[world_size], name), PER_REPLICA[world_size]
    for result in results:
        steps = result["steps"]
        # an inner step is an optimizer step: STEPS of them whatever the batches (twice as many under accumulation)
        assert [s["step"] for s in steps] == list(range(1, STEPS + 1))
        assert result["batches"] == STEPS * (2 if name == "accumulate" else 1)
        assert [s["inner_steps"] for s in steps] == list(range(1, STEPS + 1))
        assert [s["outer_syncs"] for s in steps] == [s["inner_steps"] // SYNC_EVERY for s in steps]
        assert [s["inner_steps"] for s in result["syncs"]] == SYNCED_AT + [STEPS]  # + the end of fit's
        assert result["inner_steps"] == STEPS and result["outer_syncs"] == len(SYNCED_AT) + 1
    for i in range(STEPS):
        params = [r["steps"][i]["params"] for r in results]
        for k, replica in enumerate(_replicas(params, per_replica)):
            assert identical(replica), f"step {i + 1}: replica {k}'s ranks differ"
        if i + 1 in SYNCED_AT:
            assert identical(params), f"step {i + 1}: replicas differ right after the outer sync"
        else:
            firsts = params[::per_replica]
            assert not torch.equal(firsts[0], firsts[1]), f"step {i + 1}: replicas did not drift"
    assert identical([r["final"] for r in results])


@pytest.mark.parametrize("world_size, name", CASES)
def test_it_learns(sessions, world_size, name):
    start = held_out_loss(Regressor(optimizer="adamw", seed=0))  # rank 0's model, which every rank starts from
    for result in scenario_results(sessions[world_size], name):
        losses = result["losses"]
        assert sum(losses[-5:]) / 5 < 0.7 * sum(losses[:5]) / 5, losses
        assert result["held_out"] < 0.7 * start, (result["held_out"], start)


@pytest.mark.parametrize("world_size, name", FP32_CASES)
def test_the_outer_step_stays_fp32_and_outside_autocast(sessions, world_size, name):
    for result in scenario_results(sessions[world_size], name):
        for step in result["steps"]:  # mixed precision keeps fp32 parameters: the outer ones are fp32 master weights
            assert step["param_dtypes"] == step["outer_dtypes"] == {torch.float32}
        assert len(result["exchanges"]) == len(result["syncs"]) == len(SYNCED_AT) + 1
        for call in result["syncs"] + result["exchanges"]:
            assert call["autocast"] is False
        for exchange in result["exchanges"]:
            assert exchange["dtypes"] == {torch.float32}


@pytest.mark.parametrize("world_size", list(SCENARIOS))
@pytest.mark.parametrize("name, dtype", [("bf16_true", torch.bfloat16), ("fp16_true", torch.float16)])
def test_under_true_half_precision_the_outer_step_and_its_exchange_are_in_the_models_dtype(sessions, world_size, name,
                                                                                          dtype):
    """bf16-true and 16-true have no fp32 copy of the parameters: the outer parameters and the exchanged
    pseudo-gradient are in the model's dtype (the outer step keeps what the model holds)."""
    for result in scenario_results(sessions[world_size], name):
        for step in result["steps"]:
            assert step["param_dtypes"] == step["outer_dtypes"] == {dtype}
        assert len(result["exchanges"]) == len(result["syncs"]) == len(SYNCED_AT) + 1
        for exchange in result["exchanges"]:
            assert exchange["dtypes"] == {dtype}


@pytest.mark.parametrize("world_size", list(SCENARIOS))
def test_under_bf16_mixed_the_fp32_outer_step_is_the_average_of_the_replicas_bit_for_bit(sessions, world_size):
    """compressor "none", outer SGD at its default lr: ``outer - lr ((outer - local_a) + (outer - local_b)) / 2`` in
    fp32, exactly what the ranks computed (the pseudo-gradient is neither rounded to bf16 nor averaged under autocast)."""
    results, per_replica = scenario_results(sessions[world_size], "bf16_none"), PER_REPLICA[world_size]
    firsts = results[::per_replica]
    for s, synced_at in enumerate(SYNCED_AT):
        outer = firsts[0]["syncs"][s]["outer"]
        assert all(torch.equal(r["syncs"][s]["outer"], outer) for r in results)
        a, b = (r["syncs"][s]["local"] for r in firsts)
        assert a.dtype == b.dtype == outer.dtype == torch.float32
        expected = outer.add(((outer - a) + (outer - b)) / 2, alpha=-OUTER_LR["sgd"])
        got = firsts[0]["steps"][synced_at - 1]["params"]
        assert torch.equal(got, expected), f"sync {s + 1}"
        rounded = [(outer - local).bfloat16().float() for local in (a, b)]  # what a bf16 pseudo-gradient would give
        assert not torch.equal(got, outer.add((rounded[0] + rounded[1]) / 2, alpha=-OUTER_LR["sgd"]))


def test_an_exchange_under_autocast_gives_the_same_bits_as_without(sessions):
    for result in scenario_results(sessions[2], "exchange_under_autocast"):
        for kind in OUTER_COMPRESSIONS:
            under, plain = result[(kind, "autocast")], result[(kind, "plain")]
            assert len(under) == len(plain) == 2
            for a, b in zip(under, plain):
                assert a.dtype == torch.float32 and torch.equal(a, b), kind


@pytest.mark.parametrize("world_size", list(SCENARIOS))
def test_a_step_the_loss_scaler_skips_on_one_replica_still_counts_and_the_outer_sync_stays_in_step(
        sessions, world_size):
    """Rank 1's loss is inf at global step 5 (the 6th inner step, the last of the second outer period). Under the
    replica's DDP the inf reaches every rank of rank 1's replica, whose scalers all skip that step and halve their
    scale; the other replica steps. Every rank still counts it as an inner step and syncs right after it."""
    results, per_replica = scenario_results(sessions[world_size], "fp16_skip"), PER_REPLICA[world_size]
    skipping = 1 // per_replica  # rank 1's replica
    sixth = INF_AT_STEP  # index of the 6th inner step
    for k, replica in enumerate(_replicas(results, per_replica)):
        for result in replica:
            skipped = k == skipping
            sync = result["syncs"][1]
            assert sync["inner_steps"] == 6
            # the local parameters the sync started from: those after step 5 when the 6th step was skipped
            assert torch.equal(sync["local"], result["steps"][sixth - 1]["params"]) == skipped
            scales = [s["scale"] for s in result["steps"]]
            assert scales == [FP16_INIT_SCALE] * sixth + [FP16_INIT_SCALE / (2 if skipped else 1)] * (STEPS - sixth)
            assert result["adamw_steps"] == STEPS - skipped


@pytest.mark.parametrize("world_size", list(SCENARIOS))
@pytest.mark.parametrize("name, algorithm, limit", [("clip_norm", "norm", CLIP_NORM),
                                                    ("clip_value", "value", CLIP_VALUE),
                                                    ("clip_norm_fp16", "norm", CLIP_NORM)])
def test_clipping_applies_to_the_inner_steps_alike_on_every_rank_of_a_replica(
        sessions, world_size, name, algorithm, limit):
    results, per_replica = scenario_results(sessions[world_size], name), PER_REPLICA[world_size]
    for result in results:
        assert len(result["clipped_grads"]) == len(result["unclipped_grads"]) == STEPS
        clipped = 0
        for before, after in zip(result["unclipped_grads"], result["clipped_grads"]):
            size = before.norm() if algorithm == "norm" else before.abs().max()
            stepped = after.norm() if algorithm == "norm" else after.abs().max()
            assert stepped <= limit * (1 + 1e-5)
            if size > limit:
                clipped += 1
                assert not torch.equal(before, after)
            else:
                assert torch.equal(before, after)
        assert clipped >= STEPS // 2, "clipping was not active"
    for replica in _replicas(results, per_replica):  # the replica's DDP-averaged gradients, clipped alike
        for i in range(STEPS):
            assert identical([r["clipped_grads"][i] for r in replica])


@pytest.mark.parametrize("world_size", list(SCENARIOS))
def test_a_run_resumed_under_16_mixed_keeps_each_replicas_loss_scale_and_continues_bit_for_bit(sessions, world_size):
    """Replicas skip different steps, so their loss scalers differ (the replica that skipped halved its scale); the
    checkpoint's main file is rank 0's, so each rank's scaler must come back from its own sidecar."""
    results, per_replica = scenario_results(sessions[world_size], "fp16_resume"), PER_REPLICA[world_size]
    scales = {r["full"]["steps"][RESUME_AT - 1]["scale"] for r in results}
    assert scales == {FP16_INIT_SCALE, FP16_INIT_SCALE / 2}  # the replicas' scales differ at the checkpoint
    for rank, result in enumerate(results):
        full, resumed = result["full"], result["resumed"]
        assert [s["step"] for s in resumed["steps"]] == list(range(RESUME_AT + 1, STEPS + 1))
        for a, b in zip(full["steps"][RESUME_AT:], resumed["steps"]):
            assert (a["scale"], a["since_sync"]) == (b["scale"], b["since_sync"]), f"rank {rank}, step {a['step']}"
            assert torch.equal(a["params"], b["params"]), f"rank {rank}: step {a['step']} differs after the resume"
        assert torch.equal(full["final"], resumed["final"])


@pytest.mark.parametrize("world_size", list(SCENARIOS))
def test_a_diverged_replica_stops_every_rank_before_the_exchange_with_the_outer_model_intact(sessions, world_size):
    for result in scenario_results(sessions[world_size], "diverged"):
        # the sync after inner step 6 (global step 5 diverged) is the second: the first one, after step 3, ran
        assert result["error"] is not None and "outer step 2: the pseudo-gradient" in result["error"], result["error"]
        assert "inf or NaN" in result["error"] and "gradient_clip_val" in result["error"]
        assert result["syncs"] == 1 and result["batches"] == 6
        assert torch.equal(result["outer_now"], result["outer_after_sync"])  # nothing applied
        assert bool(result["outer_now"].isfinite().all())
