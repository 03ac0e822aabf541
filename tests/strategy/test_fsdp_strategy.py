"""``Trainer(strategy="onebit_fsdp")`` on 4 gloo ranks as 2 simulated nodes x 2 (``ranks_per_node=2``).

* A fit through warmup and compressed steps: ranks that hold the same shard (0 and 2, 1 and 3) end bitwise identical,
  the replica all-reduce runs in warmup only, the compressed exchange runs after it, the mesh has the dimensions
  ``("replicate", "shard")`` and the momentum buckets follow the FSDP groups; with gradient accumulation too.
* The same run sharded by ``shard_modules`` and by the LightningModule's ``configure_model`` is the same run.
* Errors, raised on every rank before training: one node, a model that is not sharded, 1-bit LAMB.
"""

from __future__ import annotations

from typing import Any, Optional

import pytest
import torch
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

import lightning.pytorch as pl
from lightning_onebit import OnebitAdam, OnebitFSDPStrategy, OnebitLamb
from lightning_onebit.strategy.fsdp import node_mesh_ranks
from tests.distributed import run_distributed

FREEZE = 4


class Block(nn.Module):
    def __init__(self, width_in: int, width_out: int) -> None:
        super().__init__()
        self.linear = nn.Linear(width_in, width_out)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.tanh(self.linear(x))


class Model(pl.LightningModule):
    def __init__(self, optimizer: str = "onebit_adam", shard_in_configure_model: bool = False) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.blocks = nn.Sequential(Block(6, 16), Block(16, 16))
        self.head = nn.Linear(16, 2)
        self.optimizer_name = optimizer
        self.shard_in_configure_model = shard_in_configure_model

    def configure_model(self) -> None:
        if not self.shard_in_configure_model:
            return
        from torch.distributed.fsdp import fully_shard

        for block in self.blocks:
            fully_shard(block, mesh=self.device_mesh["shard"])
        fully_shard(self, mesh=self.device_mesh["shard"])

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.blocks(x))

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        x, y = batch
        return nn.functional.mse_loss(self(x), y)

    def configure_optimizers(self) -> Any:
        cls = OnebitLamb if self.optimizer_name == "onebit_lamb" else OnebitAdam
        return cls(self.parameters(), lr=1e-2, freeze_step=FREEZE)

    def train_dataloader(self) -> DataLoader:
        g = torch.Generator().manual_seed(7)
        x = torch.randn(4 * 8 * 12, 6, generator=g)
        y = torch.stack([x.sum(1).sin(), x[:, 0] * x[:, 1]], 1)
        return DataLoader(TensorDataset(x, y), batch_size=8)


def _fit(shard_modules: Optional[list[type]] = (Block,), accumulate: int = 1, steps: int = 10,
         ranks_per_node: int = 2, **model_kwargs: Any) -> dict[str, Any]:
    model = Model(**model_kwargs)
    strategy = OnebitFSDPStrategy(ranks_per_node=ranks_per_node,
                                  shard_modules=list(shard_modules) if shard_modules else None)
    trainer = pl.Trainer(accelerator="cpu", devices=4, strategy=strategy, max_steps=steps, logger=False,
                         enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False,
                         accumulate_grad_batches=accumulate)
    trainer.fit(model)
    optimizer = strategy.onebit_optimizer
    return dict(
        shards=torch.cat([p.to_local().detach().reshape(-1) for p in model.parameters()]),
        mesh_dims=strategy.device_mesh.mesh_dim_names,
        buckets=[len(b) for b in optimizer.bucket_plan],
        steps=optimizer.step_count, stage=optimizer.stage.value,
        skipped=strategy.replica_sync.skipped, replica_bytes=strategy.replica_sync.counters.bytes_sent,
        compressed_bytes=optimizer.communication.bytes_sent,
    )


def scenario_fits(rank: int, world_size: int) -> dict[str, Any]:
    return dict(by_strategy=_fit(), by_configure_model=_fit(shard_modules=None, shard_in_configure_model=True),
                accumulated=_fit(accumulate=2, steps=8))


@pytest.fixture(scope="module")
def fits() -> list[dict[str, Any]]:
    return run_distributed(scenario_fits, 4, timeout_s=400)


def _same_shard_ranks_identical(results: list[dict[str, Any]]) -> None:
    assert torch.equal(results[0]["shards"], results[2]["shards"])
    assert torch.equal(results[1]["shards"], results[3]["shards"])
    assert not torch.equal(results[0]["shards"][:8], results[1]["shards"][:8])  # other coordinates


def test_a_fit_keeps_same_shard_ranks_identical_and_compresses_after_the_warmup(fits: list[dict[str, Any]]) -> None:
    runs = [f["by_strategy"] for f in fits]
    _same_shard_ranks_identical(runs)
    for r in runs:
        assert r["mesh_dims"] == ("replicate", "shard")
        assert r["buckets"] == [1 * 2, 1 * 2, 2]  # each Block's weight and bias, then the root's head
        assert (r["steps"], r["stage"]) == (10, "compression")
        # 3 FSDP groups: averaged across nodes for the 4 warmup steps, left alone for the 6 compressed ones
        assert r["skipped"] == 3 * 6 and r["replica_bytes"] > 0 and r["compressed_bytes"] > 0


def test_sharding_by_configure_model_is_the_same_run(fits: list[dict[str, Any]]) -> None:
    for f in fits:
        assert torch.equal(f["by_strategy"]["shards"], f["by_configure_model"]["shards"])


def test_gradient_accumulation_reduces_once_per_step(fits: list[dict[str, Any]]) -> None:
    runs = [f["accumulated"] for f in fits]
    _same_shard_ranks_identical(runs)
    # one reduce-scatter (and hook call) per FSDP group per optimizer step, not per micro-batch
    assert all(r["skipped"] == 3 * (8 - FREEZE) for r in runs)


def scenario_errors(rank: int, world_size: int) -> dict[str, str]:
    out = {}
    for name, kwargs in (("one_node", dict(ranks_per_node=4)), ("unsharded", dict(shard_modules=None)),
                         ("lamb", dict(optimizer="onebit_lamb"))):
        try:
            _fit(**kwargs)
            out[name] = "no error"
        except (ValueError, TypeError) as error:
            out[name] = str(error)
    return out


def test_bad_setups_are_refused_on_every_rank_before_training() -> None:
    for r in run_distributed(scenario_errors, 4, timeout_s=300):
        assert "several nodes" in r["one_node"] and "ModelParallelStrategy" in r["one_node"], r["one_node"]
        assert "configure_model" in r["unsharded"] and "shard_modules" in r["unsharded"], r["unsharded"]
        assert "OnebitLamb" in r["lamb"] and "yet" in r["lamb"] and "onebit_adam" in r["lamb"], r["lamb"]


def test_the_mesh_rows_are_nodes_from_the_placements() -> None:
    # torchrun-style placements: the ranks of a node need not be contiguous
    placements = [(0, 0), (1, 0), (0, 1), (1, 1)]
    assert node_mesh_ranks(placements, None) == [[0, 2], [1, 3]]
    assert node_mesh_ranks([(0, r) for r in range(6)], 3) == [[0, 1, 2], [3, 4, 5]]
    with pytest.raises(ValueError, match="several nodes"):
        node_mesh_ranks([(0, r) for r in range(4)], None)
    with pytest.raises(ValueError, match="several nodes"):
        node_mesh_ranks([(0, 0), (0, 1), (1, 0)], None)  # uneven nodes
