"""Gradient clipping by norm where each rank holds its own gradient (the compression stage): one factor on every rank.

* ``onebit_adam`` on 3 gloo ranks with different data: in every compressed step each rank's gradient is scaled by the
  same factor, ``min(1, clip / (||mean_r g_r|| + 1e-6))`` (the gradients read before clipping; this model has fewer
  coordinates than the sketch has bins, so the estimate is exact); the
  warmup steps clip as Lightning's ``clip_grad_norm_`` does, bit for bit (against a run with a plain ``Precision``
  subclass, which keeps the old per-rank clipping); replicas stay bitwise identical; clipping costs one all-reduce per
  compressed step and none in the warmup; a NaN on one rank gives NaN on every rank, without a hang.
* :func:`~lightning_onebit.strategy.clipping.clip_local_gradients_by_norm_` alone: one all-reduce of 257 floats (two
  with a shard group), no host synchronisation; :func:`~lightning_onebit.strategy.clipping.gradient_sketch` estimates
  a squared norm without bias, exactly for a few elements.
* ``onebit_fsdp`` on 4 ranks as 2 nodes x 2: the factor is the same on every rank, from the nodes' whole gradients
  (each node's shards sketched and summed over the node) agreed across the nodes; same-shard ranks stay bitwise
  identical.
"""

from __future__ import annotations

import math
import warnings
from typing import Any, Optional

import pytest
import torch
import torch.distributed as dist
from lightning.pytorch.plugins.precision import Precision
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

import lightning.pytorch as pl
from lightning_onebit import OnebitAdam, OnebitFSDPStrategy, OnebitStrategy, ZeroOneAdam
from lightning_onebit.strategy.clipping import SKETCH_BINS, clip_local_gradients_by_norm_, gradient_sketch
from tests.detectors import CountCollectives, count_host_syncs
from tests.distributed import run_distributed, run_scenarios, scenario_results
from tests.lightning_models import Regressor, flat_params, loader, trainer_kwargs
from tests.tensors import identical

FREEZE, STEPS, CLIP = 3, 8, 0.05  # CLIP well below this model's gradient norms: every step clips


class RecordingOnebitAdam(OnebitAdam):
    """Records the flat gradient every step reads, after clipping (the closure ran before the stage's step)."""

    def _record(self) -> None:
        grads = [(p.grad if p.grad is not None else torch.zeros_like(p)).detach().reshape(-1).clone()
                 for group in self.param_groups for p in group["params"]]
        self.__dict__.setdefault("clipped", []).append(torch.cat(grads))

    def _warmup_step(self) -> Any:
        self._record()
        return super()._warmup_step()

    def _compressed_step(self) -> Any:
        self._record()
        return super()._compressed_step()


class ClippedRegressor(Regressor):
    def configure_optimizers(self) -> Any:
        return RecordingOnebitAdam(self.parameters(), lr=self.lr, freeze_step=self.freeze_step)


class ZeroOneRegressor(Regressor):
    def configure_optimizers(self) -> Any:
        return ZeroOneAdam(self.parameters(), lr=self.lr, var_freeze_step=4, var_update_scaler=2, local_step_scaler=2,
                           local_step_clipper=2)


class PlainPrecision(Precision):
    """Lightning's ``Precision`` under another type: the strategy keeps it, so it clips each rank by its own norm."""


def _fit(rank: int, world_size: int, steps: int = STEPS, clip: Optional[float] = CLIP, plugin: Any = None,
         **model_kwargs: Any) -> dict[str, Any]:
    model = ClippedRegressor(freeze_step=FREEZE, **model_kwargs)
    calls = {"all_reduce": 0}
    original = dist.all_reduce

    def counting(*args: Any, **kwargs: Any) -> Any:
        calls["all_reduce"] += 1
        return original(*args, **kwargs)

    trainer = pl.Trainer(**trainer_kwargs(world_size, steps, strategy=OnebitStrategy(overlap=False),
                                          gradient_clip_val=clip, plugins=[plugin] if plugin else None))
    dist.all_reduce = counting
    try:
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            trainer.fit(model, loader(rank, steps))
    finally:
        dist.all_reduce = original
    optimizer = trainer.strategy.onebit_optimizer
    return dict(
        before=[r["grad"] for r in model.records], after=optimizer.clipped, stages=[r["stage"] for r in model.records],
        params_after=[r["params_after"] for r in model.records], final=flat_params(model),
        all_reduce=calls["all_reduce"], plugin=type(trainer.precision_plugin).__name__,
        warnings=[str(w.message) for w in caught if "clipping" in str(w.message)],
    )


def _clip_alone(rank: int, world_size: int) -> dict[str, Any]:
    """``clip_local_gradients_by_norm_`` on two parameters: the collectives it issues and the host syncs it makes."""
    params = [nn.Parameter(torch.zeros(5)), nn.Parameter(torch.zeros(3, 2))]
    for i, p in enumerate(params):
        p.grad = torch.full_like(p, float(rank + 1 + i))
    before = [p.grad.clone() for p in params]
    with CountCollectives() as collectives, count_host_syncs() as syncs:
        norm = clip_local_gradients_by_norm_(params, 0.5, None, seed=11)
    after = [p.grad.clone() for p in params]
    shard_group = dist.new_group(list(range(world_size)))
    with CountCollectives() as sharded:
        clip_local_gradients_by_norm_(params, 0.5, None, seed=11, shard_group=shard_group)
    return dict(calls=collectives.calls, sharded_calls=[name for name, _ in sharded.calls], syncs=syncs.count,
                norm=norm, before=before, after=after)


def scenario_compression(rank: int, world_size: int, workdir: str) -> dict[str, Any]:
    return _fit(rank, world_size)


def scenario_old_clipping(rank: int, world_size: int, workdir: str) -> dict[str, Any]:
    return _fit(rank, world_size, plugin=PlainPrecision())


def scenario_counts(rank: int, world_size: int, workdir: str) -> dict[str, Any]:
    return dict(clipped=_fit(rank, world_size)["all_reduce"], unclipped=_fit(rank, world_size, clip=None)["all_reduce"],
                warmup_clipped=_fit(rank, world_size, steps=FREEZE)["all_reduce"],
                warmup_unclipped=_fit(rank, world_size, steps=FREEZE, clip=None)["all_reduce"])


def scenario_nan_on_one_rank(rank: int, world_size: int, workdir: str) -> dict[str, Any]:
    return _fit(rank, world_size, inf_at_step=FREEZE + 2, inf_rank=1)


def scenario_zeroone(rank: int, world_size: int, workdir: str) -> dict[str, Any]:
    model = ZeroOneRegressor(freeze_step=FREEZE)
    trainer = pl.Trainer(**trainer_kwargs(world_size, 12, gradient_clip_val=CLIP))
    trainer.fit(model, loader(rank, 12))
    optimizer = trainer.strategy.onebit_optimizer
    return dict(kinds=dict(optimizer.steps_by_kind), final=flat_params(model),
                grads=[r["grad"] for r in model.records])


def scenario_clip_alone(rank: int, world_size: int, workdir: str) -> dict[str, Any]:
    return _clip_alone(rank, world_size)


_DDP = (("compression", scenario_compression), ("old_clipping", scenario_old_clipping), ("counts", scenario_counts),
        ("nan", scenario_nan_on_one_rank), ("clip_alone", scenario_clip_alone), ("zeroone", scenario_zeroone))


@pytest.fixture(scope="module")
def ddp_session(tmp_path_factory: pytest.TempPathFactory) -> list[dict[str, Any]]:
    return run_distributed(run_scenarios, 3, _DDP, str(tmp_path_factory.mktemp("clipping")), timeout_s=300)


def _factor(before: torch.Tensor, after: torch.Tensor) -> float:
    return float((after.double() @ before.double()) / (before.double() @ before.double()))


def test_every_rank_scales_its_local_gradient_by_one_factor_from_the_agreed_norm(ddp_session: list) -> None:
    ranks = scenario_results(ddp_session, "compression")
    assert all(r["plugin"] == "AgreedClippingPrecision" for r in ranks)
    stages = ranks[0]["stages"]
    assert stages == ["warmup"] * FREEZE + ["compression"] * (STEPS - FREEZE)
    for step in range(FREEZE, STEPS):
        before = [r["before"][step] for r in ranks]
        assert not identical(before)  # local gradients: every rank its own
        factors = [_factor(r["before"][step], r["after"][step]) for r in ranks]
        for r in ranks:  # a scaling: the clipped gradient is a multiple of the local one
            assert torch.allclose(r["after"][step], factors[0] * r["before"][step], rtol=1e-6, atol=1e-9)
        agreed = float((sum(b.double() for b in before) / len(ranks)).norm())  # ||mean_r g_r||, what DDP clips
        rms = math.sqrt(sum(float(b.double().square().sum()) for b in before) / len(ranks))
        assert 2 * CLIP < agreed < rms
        assert factors == pytest.approx([CLIP / (agreed + 1e-6)] * len(ranks), rel=1e-5)
        # each rank's own norm would give other factors (the behaviour before)
        own = [CLIP / float(b.double().norm()) for b in before]
        assert max(own) - min(own) > 1e-3 * max(own)
    assert identical([r["final"] for r in ranks])
    assert not any(r["warnings"] for r in ranks)  # told at info level, not warned


def test_the_warmup_clips_as_before_bit_for_bit_and_the_compression_stage_differs(ddp_session: list) -> None:
    new, old = scenario_results(ddp_session, "compression"), scenario_results(ddp_session, "old_clipping")
    for n, o in zip(new, old):
        assert o["plugin"] == "PlainPrecision"
        for step in range(FREEZE):  # DDP's averaged gradient clipped by clip_grad_norm_, as before
            assert torch.equal(n["after"][step], o["after"][step])
            assert torch.equal(n["params_after"][step], o["params_after"][step])
        factors = [_factor(o["before"][s], o["after"][s]) for s in range(FREEZE, STEPS)]
        assert factors == pytest.approx([CLIP / float(o["before"][s].double().norm()) for s in range(FREEZE, STEPS)],
                                        rel=1e-5)  # a plugin the strategy does not know: each rank its own norm
        assert not torch.equal(n["final"], o["final"])
    assert identical([o["final"] for o in old])
    assert len(old[0]["warnings"]) == 1 and "PlainPrecision" in old[0]["warnings"][0]
    assert not old[1]["warnings"]  # rank zero only


def test_clipping_costs_one_all_reduce_per_compressed_step_and_none_in_the_warmup(ddp_session: list) -> None:
    for r in scenario_results(ddp_session, "counts"):
        assert r["clipped"] - r["unclipped"] == STEPS - FREEZE
        assert r["warmup_clipped"] == r["warmup_unclipped"]


def test_a_nan_gradient_on_one_rank_reaches_every_rank_without_a_hang(ddp_session: list) -> None:
    ranks = scenario_results(ddp_session, "nan")
    bad_step = FREEZE + 2
    assert not torch.isfinite(ranks[1]["before"][bad_step]).all()
    assert torch.isfinite(ranks[0]["before"][bad_step]).all()
    for r in ranks:  # the agreed norm is NaN everywhere, as DDP's average would be: every rank's factor is NaN
        assert torch.isnan(r["after"][bad_step]).all()
        assert len(r["after"]) == STEPS  # the run went on to the end on every rank
    assert all(torch.equal(ranks[0]["final"].isnan(), r["final"].isnan()) for r in ranks)


def test_zeroone_adam_clips_its_local_and_compressed_steps_by_one_factor_and_ends_in_sync(ddp_session: list) -> None:
    ranks = scenario_results(ddp_session, "zeroone")
    kinds = ranks[0]["kinds"]
    assert kinds.get("local", 0) > 0 and kinds.get("sync", 0) > 0, kinds  # steps on local gradients were clipped
    assert all(torch.isfinite(r["final"]).all() for r in ranks)
    assert identical([r["final"] for r in ranks])  # synced at the end of fit


def test_the_clip_alone_issues_one_scalar_all_reduce_and_no_host_sync(ddp_session: list) -> None:
    ranks = scenario_results(ddp_session, "clip_alone")
    # 11 elements, fewer than the sketch's bins: the estimate is the exact norm of the mean gradient
    agreed = math.sqrt(sum(float((sum(r["before"][i] for r in ranks) / len(ranks)).double().square().sum())
                           for i in range(2)))
    for r in ranks:
        assert r["calls"] == [("all_reduce", [4 * (SKETCH_BINS + 1)])]
        assert r["sharded_calls"] == ["all_reduce", "all_reduce"]
        assert r["syncs"] == 0
        assert float(r["norm"]) == pytest.approx(agreed, rel=1e-6)
        for b, a in zip(r["before"], r["after"]):
            assert torch.allclose(a, b * min(1.0, 0.5 / (agreed + 1e-6)), rtol=1e-6)


def test_the_sketch_estimates_a_squared_norm_without_bias_and_exactly_for_few_elements() -> None:
    g = torch.Generator().manual_seed(0)
    tensors = [torch.randn(300, 200, generator=g), torch.randn(1000, generator=g) * 3, torch.randn(7, generator=g)]
    true = sum(float(t.double().square().sum()) for t in tensors)
    estimates = [float(gradient_sketch(tensors, seed).double().square().sum()) / true for seed in range(100)]
    assert sum(estimates) / len(estimates) == pytest.approx(1.0, abs=0.03)  # 100 draws of relative sd ~ 0.09
    assert all(0.6 < e < 1.4 for e in estimates)
    assert gradient_sketch(tensors, 5).tolist() == gradient_sketch(tensors, 5).tolist()  # the seed fixes the signs
    assert gradient_sketch(tensors, 5).tolist() != gradient_sketch(tensors, 6).tolist()
    few = [torch.randn(10, 5, generator=g), torch.randn(20, generator=g)]  # 70 elements, each in a bin of its own
    assert float(gradient_sketch(few, 3).double().square().sum()) == pytest.approx(
        sum(float(t.double().square().sum()) for t in few), rel=1e-6)
    halves = [t * 0.5 for t in tensors]  # linear: the sketch of a mean is the mean of the sketches
    assert torch.allclose(gradient_sketch(halves, 9), gradient_sketch(tensors, 9) * 0.5, rtol=1e-5, atol=1e-5)


# ============================================================================================ onebit_fsdp, 2 nodes x 2
class Block(nn.Module):
    def __init__(self, width_in: int, width_out: int) -> None:
        super().__init__()
        self.linear = nn.Linear(width_in, width_out)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.tanh(self.linear(x))


class ShardedModel(pl.LightningModule):
    """Two sharded blocks and a head; records each step's local gradient shards before clipping."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.blocks = nn.Sequential(Block(6, 16), Block(16, 16))
        self.head = nn.Linear(16, 2)
        self.before: list[torch.Tensor] = []

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.blocks(x))

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        x, y = batch
        return nn.functional.mse_loss(self(x), y)

    def on_before_optimizer_step(self, optimizer: Any) -> None:
        self.before.append(torch.cat([p.grad.to_local().detach().reshape(-1).clone() for p in self.parameters()]))

    def configure_optimizers(self) -> Any:
        return RecordingOnebitAdam(self.parameters(), lr=1e-2, freeze_step=FREEZE)

    def train_dataloader(self) -> DataLoader:
        g = torch.Generator().manual_seed(7)
        x = torch.randn(4 * 8 * STEPS, 6, generator=g)
        return DataLoader(TensorDataset(x, torch.stack([x.sum(1).sin(), x[:, 0] * x[:, 1]], 1)), batch_size=8)


def _fsdp_fit(rank: int, world_size: int) -> dict[str, Any]:
    model = ShardedModel()
    strategy = OnebitFSDPStrategy(ranks_per_node=2, shard_modules=[Block])
    trainer = pl.Trainer(accelerator="cpu", devices=world_size, strategy=strategy, max_steps=STEPS, logger=False,
                         enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False,
                         gradient_clip_val=CLIP)
    trainer.fit(model)
    optimizer = strategy.onebit_optimizer
    return dict(before=model.before, after=optimizer.clipped, stage=optimizer.stage.value,
                shards=torch.cat([p.to_local().detach().reshape(-1) for p in model.parameters()]))


@pytest.fixture(scope="module")
def fsdp_runs() -> list[dict[str, Any]]:
    return run_distributed(_fsdp_fit, 4, timeout_s=300)


def test_onebit_fsdp_scales_every_rank_by_one_factor_from_the_nodes_whole_gradients(fsdp_runs: list) -> None:
    assert all(r["stage"] == "compression" for r in fsdp_runs)
    nodes = [(0, 1), (2, 3)]
    for step in range(STEPS):
        squares = [float(r["before"][step].double().square().sum()) for r in fsdp_runs]
        node_squares = [squares[a] + squares[b] for a, b in nodes]
        factors = [_factor(r["before"][step], r["after"][step]) for r in fsdp_runs]
        if step < FREEZE:  # averaged across nodes: both nodes hold the same gradient, clipped to CLIP
            assert node_squares[0] == pytest.approx(node_squares[1], rel=1e-6)
            assert factors == pytest.approx([CLIP / (math.sqrt(node_squares[0]) + 1e-6)] * 4, rel=1e-5), step
        else:  # each node its own gradient: one factor, from an estimate of the norm of the nodes' mean gradient
            assert node_squares[0] != pytest.approx(node_squares[1], rel=1e-3)
            assert factors == pytest.approx([factors[0]] * 4, rel=1e-6), (step, factors)  # float32 scaling's rounding
            mean = [(fsdp_runs[a]["before"][step].double() + fsdp_runs[b]["before"][step].double()) / 2
                    for a, b in ((0, 2), (1, 3))]  # the two shards of the mean of the nodes' gradients
            exact = math.sqrt(sum(float(m.square().sum()) for m in mean))
            rms = math.sqrt(sum(node_squares) / len(nodes))
            estimate = CLIP / factors[0] - 1e-6
            assert exact < rms and 0.75 * exact < estimate <= rms * (1 + 1e-6), (step, exact, estimate, rms)
    for a, b in ((0, 2), (1, 3)):  # ranks that hold the same shard on the two nodes
        assert torch.equal(fsdp_runs[a]["shards"], fsdp_runs[b]["shards"])
