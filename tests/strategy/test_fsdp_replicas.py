"""``onebit_fsdp`` keeps the replicas of every shard identical, on 4 gloo ranks as 2 simulated nodes x 2
(``ranks_per_node=2``; replicas: ranks 0 and 2, 1 and 3):

* processes that build the model from different random states (no ``seed_everything``) start training from the same
  weights on every node: each parameter's local shard is broadcast over its replicate group at setup (one broadcast
  per flat buffer), the module's buffers over every rank; sharded by ``shard_modules`` and by ``configure_model``;
* ``ReplicaCheck`` works under ``onebit_fsdp`` (it compares each rank's local shards with its replicas') and fails on
  every rank when one shard is corrupted;
* tied weights (an embedding shared with the output layer, both children of the LightningModule) stay one parameter
  when the strategy shards the model with ``shard_modules``, and train;
* a ``DTensor`` parameter on the shard mesh that no FSDP group manages is refused at setup, naming it;
* 0/1 Adam trains a model with an empty shard (a ``Linear(16, 1)``: no row on the second rank of a node) through its
  local steps and syncs.
"""

from __future__ import annotations

from typing import Any

import pytest
import torch
from torch import nn

import lightning.pytorch as pl
from lightning_onebit import OnebitFSDPStrategy, ReplicaCheck, ZeroOneAdam
from tests.capture import capture_logs
from tests.distributed import run_distributed, run_scenarios, scenario_results
from tests.llama_models import DIM, VOCAB, LlamaBlock, LlamaLM, RMSNorm, local_shards, rotary_tables, token_batch
from tests.llama_models import whole_parameters

STEPS = 6


def _trainer(strategy: OnebitFSDPStrategy, steps: int = STEPS, callbacks: Any = None) -> pl.Trainer:
    return pl.Trainer(accelerator="cpu", devices=4, strategy=strategy, max_steps=steps, logger=False,
                      enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False,
                      callbacks=callbacks)


class RecordStart(pl.Callback):
    """Each rank's local shards and buffers when training starts."""

    def on_train_start(self, trainer: pl.Trainer, module: pl.LightningModule) -> None:
        self.shards = local_shards(module)
        self.buffers = torch.cat([b.detach().reshape(-1).clone() for b in module.buffers()])


class WithRandomBuffer(LlamaLM):
    """:class:`LlamaLM` with a persistent buffer drawn from the process's own random state."""

    def __init__(self, init_seed: int, **kwargs: Any) -> None:
        super().__init__(init_seed, **kwargs)
        self.register_buffer("calibration", torch.randn(4, generator=torch.Generator().manual_seed(init_seed)))


def scenario_unseeded(rank: int, world_size: int, workdir: str) -> dict[str, Any]:
    """Every process builds its own random weights (seed 100 + rank), sharded by configure_model and by
    shard_modules; ReplicaCheck after every step."""
    out: dict[str, Any] = {}
    for route, kwargs in (("configure_model", {}), ("shard_modules", dict(shard_modules=[LlamaBlock]))):
        model = WithRandomBuffer(100 + rank, shard=route == "configure_model")
        start, check = RecordStart(), ReplicaCheck(every_n_steps=1)
        strategy = OnebitFSDPStrategy(ranks_per_node=2, **kwargs)
        try:
            _trainer(strategy, callbacks=[start, check]).fit(model)
            error = None
        except Exception as failure:  # noqa: BLE001 - the test says what it was
            error = f"{type(failure).__name__}: {failure}"
        out[route] = dict(start=start.shards, buffers=start.buffers, end=local_shards(model), checks=check.checks,
                          stage=strategy.stage.value, built=local_shards(WithRandomBuffer(100 + rank)), error=error)
    return out


def scenario_broadcast_count(rank: int, world_size: int, workdir: str) -> dict[str, Any]:
    """The setup's broadcast on a sharded model of 16 parameters and three buffers."""
    from lightning_onebit.strategy.sharding import broadcast_from_first_replica

    model = WithRandomBuffer(100 + rank)
    strategy = OnebitFSDPStrategy(ranks_per_node=2)
    _trainer(strategy, steps=1).fit(model)
    replicate = strategy.device_mesh["replicate"].get_group()
    return dict(parameters=len(list(model.parameters())),
                broadcasts=broadcast_from_first_replica(model, replicate),
                broadcasts_small=broadcast_from_first_replica(model, replicate, bucket_bytes=4096))


class CorruptShard(pl.Callback):
    """On rank 2, after optimizer step 3, adds 1 to the first element of the local shard of ``lm_head``'s weight
    (the tied embedding's)."""

    def on_train_batch_end(self, trainer: pl.Trainer, module: pl.LightningModule, *args: Any) -> None:
        if trainer.global_step == 3 and trainer.global_rank == 2:
            with torch.no_grad():
                module.llama.lm_head.weight.to_local().view(-1)[0] += 1.0


def scenario_corrupted(rank: int, world_size: int, workdir: str) -> dict[str, Any]:
    model = LlamaLM(100 + rank)
    check = ReplicaCheck(every_n_steps=1)
    try:
        _trainer(OnebitFSDPStrategy(ranks_per_node=2), callbacks=[CorruptShard(), check]).fit(model)
    except RuntimeError as error:
        return dict(error=str(error), checks=check.checks)
    return dict(error=None, checks=check.checks)


class EmbedHead(pl.LightningModule):
    """An embedding tied to the output layer, both children of the LightningModule (``shard_modules=[LlamaBlock]``
    leaves them to the strategy's pass over the children), a Llama block between them, and a value head of one row
    (``Linear(DIM, 1)``: the second rank of each node holds an empty shard of it)."""

    def __init__(self, optimizer: str = "onebit_adam", tie: bool = True) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.embed = nn.Embedding(VOCAB, DIM)
        self.block = LlamaBlock(DIM, 2)
        self.norm = RMSNorm(DIM)
        self.lm_head = nn.Linear(DIM, VOCAB, bias=False)
        self.value = nn.Linear(DIM, 1)
        if tie:
            self.lm_head.weight = self.embed.weight
        cos, sin = rotary_tables(16, DIM // 2)
        self.register_buffer("cos", cos, persistent=False)
        self.register_buffer("sin", sin, persistent=False)
        self.optimizer_name = optimizer

    def forward(self, tokens: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        x = self.norm(self.block(self.embed(tokens), self.cos, self.sin))
        return self.lm_head(x), self.value(x)

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        tokens = token_batch(self.global_step, self.global_rank)
        logits, value = self(tokens[:, :-1])
        loss = nn.functional.cross_entropy(logits.reshape(-1, VOCAB), tokens[:, 1:].reshape(-1))
        return loss + 0.1 * value.pow(2).mean()

    def configure_optimizers(self) -> Any:
        if self.optimizer_name == "zeroone_adam":
            return ZeroOneAdam(self.parameters(), lr=3e-3, var_freeze_step=3, var_update_scaler=2,
                               local_step_scaler=2, local_step_clipper=2)
        from lightning_onebit import OnebitAdam

        return OnebitAdam(self.parameters(), lr=3e-3, freeze_step=2)

    def train_dataloader(self) -> Any:
        return torch.utils.data.DataLoader(torch.utils.data.TensorDataset(torch.zeros(64, 1)), batch_size=1)


def scenario_tied(rank: int, world_size: int, workdir: str) -> dict[str, Any]:
    model = EmbedHead()
    before = model.embed.weight.detach().clone()
    with capture_logs() as logs:
        _trainer(OnebitFSDPStrategy(ranks_per_node=2, shard_modules=[LlamaBlock])).fit(model)
    embed = model.embed.weight
    return dict(tied=embed is model.lm_head.weight, whole=embed.full_tensor().detach().clone(), before=before,
                names=[name for name, _ in model.named_parameters()], logs=logs,
                stand_ins=sum(1 for g in model.trainer.strategy.onebit_optimizer.param_groups for _ in g["params"]))


class LateParameter(LlamaLM):
    """Adds a parameter sharded over the shard mesh after ``fully_shard`` of the whole model: in no FSDP group."""

    def configure_model(self) -> None:
        from torch.distributed.tensor import Shard, distribute_tensor

        super().configure_model()
        self.scale = nn.Parameter(distribute_tensor(torch.ones(4, DIM), self.device_mesh["shard"], [Shard(0)]))

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        return super().forward(tokens) * self.scale.to_local().mean()


def scenario_late_parameter(rank: int, world_size: int, workdir: str) -> dict[str, Any]:
    try:
        _trainer(OnebitFSDPStrategy(ranks_per_node=2)).fit(LateParameter(0))
    except ValueError as error:
        return dict(error=str(error))
    return dict(error=None)


def scenario_zeroone_empty_shard(rank: int, world_size: int, workdir: str) -> dict[str, Any]:
    model = EmbedHead(optimizer="zeroone_adam", tie=False)
    strategy = OnebitFSDPStrategy(ranks_per_node=2, shard_modules=[LlamaBlock])
    try:
        _trainer(strategy, steps=10).fit(model)
    except Exception as failure:  # noqa: BLE001 - the test says what it was (a peer's failure, on the others)
        return dict(error=f"{type(failure).__name__}: {failure}")
    optimizer = strategy.onebit_optimizer
    return dict(error=None, kinds={kind.name: n for kind, n in optimizer.steps_by_kind.items()},
                value_rows=model.value.weight.to_local().shape[0], shards=local_shards(model),
                whole=whole_parameters(model))


_SCENARIOS = (("unseeded", scenario_unseeded), ("broadcast_count", scenario_broadcast_count),
              ("corrupted", scenario_corrupted), ("tied", scenario_tied),
              ("late_parameter", scenario_late_parameter), ("zeroone_empty_shard", scenario_zeroone_empty_shard))


@pytest.fixture(scope="module")
def session(tmp_path_factory: pytest.TempPathFactory) -> list[dict[str, Any]]:
    workdir = str(tmp_path_factory.mktemp("fsdp_replicas"))
    return run_distributed(run_scenarios, 4, _SCENARIOS, workdir, timeout_s=300)


def _replicas_equal(values: list[torch.Tensor]) -> bool:
    return torch.equal(values[0], values[2]) and torch.equal(values[1], values[3])


def test_unseeded_processes_start_from_the_same_weights_on_every_node(session: list[dict[str, Any]]) -> None:
    results = scenario_results(session, "unseeded")
    for route in ("configure_model", "shard_modules"):
        runs = [r[route] for r in results]
        # each process built other weights ...
        assert not torch.equal(runs[0]["built"], runs[2]["built"])
        # ... and trained from its replica's first rank's shards, and its buffers from rank 0's
        assert _replicas_equal([r["start"] for r in runs]), route
        assert all(torch.equal(r["buffers"], runs[0]["buffers"]) for r in runs), route
        assert all(r["error"] is None for r in runs), [r["error"] for r in runs]
        assert _replicas_equal([r["end"] for r in runs]), route
        assert not torch.equal(runs[0]["start"], runs[0]["end"])  # trained
        assert all(r["stage"] == "compression" for r in runs)
        # ReplicaCheck compared the local shards after every step and found them identical
        assert all(r["checks"] == STEPS for r in runs), [r["checks"] for r in runs]


def test_the_setup_broadcast_sends_flat_buffers_not_one_tensor_at_a_time(session: list[dict[str, Any]]) -> None:
    for r in scenario_results(session, "broadcast_count"):
        assert r["parameters"] == 16
        assert r["broadcasts"] == 2  # the shards in one buffer, the buffers in another
        assert 3 <= r["broadcasts_small"] < r["parameters"], r["broadcasts_small"]


def test_replica_check_fails_on_every_rank_when_one_shard_is_corrupted(session: list[dict[str, Any]]) -> None:
    for r in scenario_results(session, "corrupted"):
        assert r["checks"] == 2  # steps 1 and 2 passed
        error = r["error"]
        assert error is not None and "replicas diverged" in error, error
        assert "llama.embed.weight" in error and "ranks [2]" in error, error


def test_tied_weights_stay_one_parameter_under_shard_modules_and_train(session: list[dict[str, Any]]) -> None:
    results = scenario_results(session, "tied")
    for r in results:
        assert r["tied"], "the embedding and the output layer were untied"
        assert "lm_head.weight" not in r["names"] and "embed.weight" in r["names"]
        assert r["stand_ins"] == len(r["names"])  # the optimizer holds the tied weight once
        assert not torch.equal(r["whole"], r["before"])  # it trained
        assert torch.equal(r["whole"], results[0]["whole"])
    assert any("tied weights: embed.weight = lm_head.weight" in line for line in results[0]["logs"]), results[0]["logs"]


def test_a_sharded_parameter_in_no_fsdp_group_is_refused_at_setup(session: list[dict[str, Any]]) -> None:
    for r in scenario_results(session, "late_parameter"):
        error = r["error"]
        assert error is not None, "a parameter no FSDP group manages was trained"
        assert "parameters scale are sharded over the shard mesh, but no FSDP group manages them" in error, error
        assert "averaged across nodes" in error and "before the fully_shard call" in error, error


def test_zeroone_adam_takes_local_steps_with_an_empty_shard(session: list[dict[str, Any]]) -> None:
    results = scenario_results(session, "zeroone_empty_shard")
    assert all(r["error"] is None for r in results), [r["error"] for r in results]
    assert [r["value_rows"] for r in results] == [1, 0, 1, 0]
    for r in results:
        assert r["kinds"].get("LOCAL", 0) > 0 and r["kinds"].get("SYNC", 0) > 0, r["kinds"]
        # fit ends synchronised: every rank gathers the same whole parameters
        assert all(torch.equal(a, b) for a, b in zip(r["whole"], results[0]["whole"]))
    assert _replicas_equal([r["shards"] for r in results])
