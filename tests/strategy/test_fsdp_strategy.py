"""``Trainer(strategy="onebit_fsdp")`` on 4 gloo ranks as 2 simulated nodes x 2 (``ranks_per_node=2``).

* A fit through warmup and compressed steps: ranks that hold the same shard (0 and 2, 1 and 3) end bitwise identical,
  the replica all-reduce runs in warmup only, the compressed exchange runs after it, the mesh has the dimensions
  ``("replicate", "shard")`` and the momentum buckets follow the FSDP groups; with gradient accumulation too.
* The same run sharded by ``shard_modules`` and by the LightningModule's ``configure_model`` is the same run.
* 1-bit LAMB fits too (its per-tensor figures reduced over the shard group): same-shard ranks end bitwise identical.
* Activation checkpointing gives the same run, bit for bit.
* Errors, raised on every rank before training: one node, uneven nodes, a model that is not sharded (or only partly:
  the unsharded parameters named), a shard mesh that spans nodes.
* Checkpoints: the error feedback is kept by default (no callback), and a resume continues bitwise; a 4-rank checkpoint
  loads resharded on 2 ranks and resets it; the ``error_feedback`` argument is checked and passed through.
"""

from __future__ import annotations

from typing import Any, Optional

import pytest
import torch
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

import lightning.pytorch as pl
from lightning_onebit import OnebitAdam, OnebitFSDPStrategy, OnebitLamb
from lightning_onebit.hooks import leaves_gradients_unchanged
from lightning_onebit.strategy.fsdp import node_mesh_ranks
from tests.distributed import run_distributed

FREEZE = 4
CLIP = 0.05  # well below the gradient norms of this model and data


class Block(nn.Module):
    def __init__(self, width_in: int, width_out: int, checkpointing: bool = False) -> None:
        super().__init__()
        self.linear = nn.Linear(width_in, width_out)
        self.checkpointing = checkpointing

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.checkpointing:  # activation checkpointing: the forward runs again in backward
            return torch.utils.checkpoint.checkpoint(lambda t: torch.tanh(self.linear(t)), x, use_reentrant=False)
        return torch.tanh(self.linear(x))


class RecordingOnebitAdam(OnebitAdam):
    """Records the squared norm of the gradients (this rank's shards) that each warmup step reads."""

    def _warmup_step(self) -> Any:
        grads = [p.grad for group in self.param_groups for p in group["params"] if p.grad is not None]
        self.__dict__.setdefault("grad_sq", []).append(sum(float(g.double().pow(2).sum()) for g in grads))
        return super()._warmup_step()


class Model(pl.LightningModule):
    def __init__(self, optimizer: str = "onebit_adam", shard_in_configure_model: Any = False,
                 samples: int = 4 * 8 * 12, data_by_step: bool = False, checkpointing: bool = False) -> None:
        super().__init__()
        self.samples = samples
        self.data_by_step = data_by_step
        torch.manual_seed(0)
        self.blocks = nn.Sequential(Block(6, 16, checkpointing), Block(16, 16, checkpointing))
        self.head = nn.Linear(16, 2)
        self.optimizer_name = optimizer
        self.shard_in_configure_model = shard_in_configure_model

    def configure_model(self) -> None:
        if not self.shard_in_configure_model:
            return
        from torch.distributed.device_mesh import init_device_mesh
        from torch.distributed.fsdp import fully_shard

        # True: as users are told; "world": over every rank (across nodes); "blocks": the root left unsharded
        mesh = init_device_mesh("cpu", (4,)) if self.shard_in_configure_model == "world" else self.device_mesh["shard"]
        for block in self.blocks:
            fully_shard(block, mesh=mesh)
        if self.shard_in_configure_model != "blocks":
            fully_shard(self, mesh=mesh)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.blocks(x))

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        x, y = batch
        if self.data_by_step:  # a function of the step and rank only: a resumed run sees what an uninterrupted one did
            g = torch.Generator().manual_seed(1000 * self.global_step + self.global_rank)
            x = torch.randn(x.shape, generator=g)
            y = torch.stack([x.sum(1).sin(), x[:, 0] * x[:, 1]], 1)
        return nn.functional.mse_loss(self(x), y)

    def configure_optimizers(self) -> Any:
        cls = {"onebit_lamb": OnebitLamb, "recording": RecordingOnebitAdam}.get(self.optimizer_name, OnebitAdam)
        return cls(self.parameters(), lr=1e-2, freeze_step=FREEZE)

    def train_dataloader(self) -> DataLoader:
        g = torch.Generator().manual_seed(7)
        x = torch.randn(self.samples, 6, generator=g)
        y = torch.stack([x.sum(1).sin(), x[:, 0] * x[:, 1]], 1)
        return DataLoader(TensorDataset(x, y), batch_size=8)


def _fit(shard_modules: Optional[list[type]] = (Block,), accumulate: int = 1, steps: int = 10,
         ranks_per_node: int = 2, devices: int = 4, save_to: Optional[str] = None, resume_from: Optional[str] = None,
         callbacks: Optional[list[Any]] = None, clip: Optional[float] = None, bf16: bool = False,
         overlap: Any = "auto", clip_by: str = "norm", **model_kwargs: Any) -> dict[str, Any]:
    from torch.distributed.fsdp import MixedPrecisionPolicy

    model = Model(**model_kwargs)
    policy = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32) if bf16 else None
    strategy = OnebitFSDPStrategy(ranks_per_node=ranks_per_node,
                                  shard_modules=list(shard_modules) if shard_modules else None,
                                  mixed_precision=policy, overlap=overlap)
    trainer = pl.Trainer(accelerator="cpu", devices=devices, strategy=strategy, max_steps=steps, logger=False,
                         enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False,
                         accumulate_grad_batches=accumulate, callbacks=callbacks, gradient_clip_val=clip,
                         gradient_clip_algorithm=clip_by)
    trainer.fit(model, ckpt_path=resume_from)
    optimizer = strategy.onebit_optimizer
    if save_to is not None:
        trainer.save_checkpoint(save_to)
    return dict(
        full=[p.full_tensor().detach().clone() for p in model.parameters()],
        first_full=getattr(model, "first_full", None),
        grad_sq=getattr(optimizer, "grad_sq", None),
        dtypes={p.dtype for p in model.parameters()},
        metrics={k: float(v) for k, v in trainer.callback_metrics.items() if k.startswith(("comm/", "onebit/"))},
        shards=torch.cat([p.to_local().detach().reshape(-1) for p in model.parameters()]),
        mesh_dims=strategy.device_mesh.mesh_dim_names,
        buckets=[len(b) for b in optimizer.bucket_plan],
        steps=optimizer.step_count, stage=optimizer.stage.value,
        skipped=strategy.replica_sync.skipped, replica_bytes=strategy.replica_sync.counters.bytes_sent,
        compressed_bytes=optimizer.communication.bytes_sent,
        buckets_started=None if strategy.overlap_state is None else strategy.overlap_state.buckets_started,
        overlap_fallback=None if strategy.overlap_fallback_reason is None else strategy.overlap_fallback_reason.cause,
        in_flight_after_backward=[c.in_flight for c in callbacks or [] if isinstance(c, InFlight)],
    )


class InFlight(pl.Callback):
    """Records, after every backward, how many exchanges the overlapped hooks started (and left in flight)."""

    def __init__(self) -> None:
        self.in_flight: list[int] = []

    @leaves_gradients_unchanged
    def on_after_backward(self, trainer: pl.Trainer, module: pl.LightningModule) -> None:
        self.in_flight.append(trainer.strategy.onebit_optimizer.exchanges_in_flight)


def scenario_fits(rank: int, world_size: int) -> dict[str, Any]:
    from lightning_onebit import CommunicationMonitor

    return dict(by_strategy=_fit(callbacks=[CommunicationMonitor(prog_bar=False), InFlight()]),
                in_step=_fit(overlap=False), lamb_in_step=_fit(optimizer="onebit_lamb", overlap=False),
                clip_by_value=_fit(clip=CLIP / 10, clip_by="value", overlap=True),
                clip_by_value_in_step=_fit(clip=CLIP / 10, clip_by="value", overlap=False),
                by_configure_model=_fit(shard_modules=None, shard_in_configure_model=True),
                accumulated=_fit(accumulate=2, steps=8),
                unclipped=_fit(steps=FREEZE, optimizer="recording"),
                clipped=_fit(steps=FREEZE, optimizer="recording", clip=CLIP),
                bf16=_fit(bf16=True, accumulate=2, steps=8), checkpointed=_fit(checkpointing=True), lamb=_fit(optimizer="onebit_lamb"), errors=_errors())


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
        # CommunicationMonitor counts the strategy's bytes: the last step was a compressed one
        # (a compression ratio well below 32: in these small buckets the scales weigh)
        assert r["metrics"]["comm/stage"] == 1.0 and r["metrics"]["comm/compression_ratio"] > 4, r["metrics"]
        assert r["metrics"]["comm/bytes_sent_total"] == r["replica_bytes"] + r["compressed_bytes"]


def test_the_overlapped_exchange_starts_in_backward_and_gives_the_bits_of_the_exchange_in_step(
        fits: list[dict[str, Any]]) -> None:
    for f in fits:
        run = f["by_strategy"]
        assert run["overlap_fallback"] is None
        # the first compressed step lays the momenta out; each later one starts all 3 buckets during backward
        assert run["buckets_started"] == 3 * (10 - FREEZE - 1)
        assert run["in_flight_after_backward"] == [[0] * (FREEZE + 1) + [3] * (10 - FREEZE - 1)]
        assert f["in_step"]["buckets_started"] is None and f["in_step"]["overlap_fallback"] is None
        assert torch.equal(run["shards"], f["in_step"]["shards"])
        assert run["compressed_bytes"] == f["in_step"]["compressed_bytes"]
        assert f["lamb"]["buckets_started"] == 3 * (10 - FREEZE - 1)
        assert torch.equal(f["lamb"]["shards"], f["lamb_in_step"]["shards"])
        # clipping by value runs in the hook, elementwise: the same run as clipping in step
        assert f["clip_by_value"]["buckets_started"] == 3 * (10 - FREEZE - 1)
        assert torch.equal(f["clip_by_value"]["shards"], f["clip_by_value_in_step"]["shards"])
        assert not torch.equal(f["clip_by_value"]["shards"], run["shards"])
        # clipping by norm needs the whole gradient after backward: the exchange stays in step
        assert f["clipped"]["overlap_fallback"] == "clip_by_norm" and f["clipped"]["buckets_started"] is None


def test_sharding_by_configure_model_is_the_same_run(fits: list[dict[str, Any]]) -> None:
    for f in fits:
        assert torch.equal(f["by_strategy"]["shards"], f["by_configure_model"]["shards"])


def test_gradient_accumulation_reduces_once_per_step(fits: list[dict[str, Any]]) -> None:
    runs = [f["accumulated"] for f in fits]
    _same_shard_ranks_identical(runs)
    # one reduce-scatter (and hook call) per FSDP group per optimizer step, not per micro-batch
    assert all(r["skipped"] == 3 * (8 - FREEZE) for r in runs)


def test_a_lamb_fit_keeps_same_shard_ranks_identical_and_compresses_after_the_warmup(fits: list[dict[str, Any]]
                                                                                      ) -> None:
    runs = [f["lamb"] for f in fits]
    _same_shard_ranks_identical(runs)
    for r in runs:
        assert r["buckets"] == [1 * 2, 1 * 2, 2]
        assert (r["steps"], r["stage"]) == (10, "compression")
        assert r["skipped"] == 3 * 6 and r["replica_bytes"] > 0 and r["compressed_bytes"] > 0
    assert not torch.equal(runs[0]["shards"], fits[0]["by_strategy"]["shards"])  # LAMB, not 1-bit Adam
    for r in runs[1:]:  # every rank gathers the same whole parameters
        assert all(torch.equal(a, b) for a, b in zip(r["full"], runs[0]["full"]))


def test_bf16_compute_with_fp32_master_shards_keeps_same_shard_ranks_identical(fits: list[dict[str, Any]]) -> None:
    runs = [f["bf16"] for f in fits]
    _same_shard_ranks_identical(runs)
    assert all(r["dtypes"] == {torch.float32} for r in runs)  # the optimizer steps fp32 master shards
    # bf16 forward and backward give other parameters than fp32 (the policy was applied)
    assert not torch.equal(runs[0]["shards"], fits[0]["accumulated"]["shards"])
    assert (runs[0]["shards"] - fits[0]["accumulated"]["shards"]).abs().max() < 5e-2


def test_clipping_by_norm_clips_the_whole_gradient_not_one_shard(fits: list[dict[str, Any]]) -> None:
    for name in ("unclipped", "clipped"):
        runs = [f[name] for f in fits]
        # the whole gradient's norm: the two shards of a node (in warmup every node holds the same average)
        norms = [(a + b) ** 0.5 for a, b in zip(runs[0]["grad_sq"], runs[1]["grad_sq"])]
        assert len(norms) == FREEZE
        if name == "unclipped":
            assert min(norms) > 2 * CLIP, norms
        else:
            # clip_grad_norm_ over the DTensors: the whole gradient scaled to CLIP (one shard alone would be smaller)
            assert all(abs(n - CLIP) < 1e-4 * CLIP for n in norms), norms
            assert all(a < CLIP**2 for a in runs[0]["grad_sq"])


def _errors() -> dict[str, str]:
    out = {}
    for name, kwargs in (("one_node", dict(ranks_per_node=4)), ("uneven", dict(ranks_per_node=3)),
                         ("unsharded", dict(shard_modules=None)),
                         ("spanning", dict(shard_modules=None, shard_in_configure_model="world")),
                         ("partly", dict(shard_modules=None, shard_in_configure_model="blocks")),
                         ("overlap_and_clip_by_norm", dict(clip=CLIP, overlap=True))):
        try:
            _fit(**kwargs)
            out[name] = "no error"
        except (ValueError, TypeError) as error:
            out[name] = str(error)
    return out


def test_bad_setups_are_refused_on_every_rank_before_training(fits: list[dict[str, Any]]) -> None:
    for r in (f["errors"] for f in fits):
        assert "several nodes" in r["one_node"] and "ModelParallelStrategy" in r["one_node"], r["one_node"]
        assert "divide" in r["uneven"], r["uneven"]
        assert "configure_model" in r["unsharded"] and "shard_modules" in r["unsharded"], r["unsharded"]
        assert "spans nodes" in r["spanning"] and "blocks.0.linear.weight" in r["spanning"], r["spanning"]
        assert "not sharded" in r["partly"] and "head.weight" in r["partly"], r["partly"]
        assert "blocks.0" not in r["partly"], r["partly"]
        message = r["overlap_and_clip_by_norm"]
        assert "OnebitFSDPStrategy(overlap=True) cannot overlap" in message and "clipping by norm" in message, message


def test_activation_checkpointing_gives_the_same_run(fits: list[dict[str, Any]]) -> None:
    for f in fits:  # the forward recomputed in backward: the same bits on CPU
        assert torch.equal(f["checkpointed"]["shards"], f["by_strategy"]["shards"])


def test_the_mesh_rows_are_nodes_from_the_placements() -> None:
    # torchrun-style placements: the ranks of a node need not be contiguous
    placements = [(0, 0), (1, 0), (0, 1), (1, 1)]
    assert node_mesh_ranks(placements, None) == [[0, 2], [1, 3]]
    assert node_mesh_ranks([(0, r) for r in range(6)], 3) == [[0, 1, 2], [3, 4, 5]]
    with pytest.raises(ValueError, match="several nodes"):
        node_mesh_ranks([(0, r) for r in range(4)], None)
    with pytest.raises(ValueError, match="uneven"):
        node_mesh_ranks([(0, 0), (0, 1), (1, 0)], None)
    assert node_mesh_ranks([(r, 0) for r in range(3)], None) == [[0], [1], [2]]  # one rank per node: allowed


class RecordStart(pl.Callback):
    """Records the whole parameters when training starts (after a resume loaded them)."""

    def on_train_start(self, trainer: pl.Trainer, module: pl.LightningModule) -> None:
        # clone: with one rank per shard, full_tensor() is the parameter itself, which training goes on changing
        module.first_full = [p.full_tensor().detach().clone() for p in module.parameters()]


def _consolidated(folder: str) -> dict[str, Any]:
    """``save_distributed_checkpoint=False``: a fit, its consolidated weights saved, a full save and a fit with a
    ModelCheckpoint that saves the training state refused."""
    def trainer(strategy: OnebitFSDPStrategy, **kwargs: Any) -> pl.Trainer:
        return pl.Trainer(accelerator="cpu", devices=4, strategy=strategy, max_steps=4, logger=False,
                          enable_progress_bar=False, enable_model_summary=False, **kwargs)

    model = Model()
    fit = trainer(OnebitFSDPStrategy(ranks_per_node=2, shard_modules=[Block], save_distributed_checkpoint=False),
                  enable_checkpointing=False)
    fit.fit(model)
    fit.save_checkpoint(f"{folder}/weights.ckpt", weights_only=True)
    errors = {}
    try:
        fit.save_checkpoint(f"{folder}/full.ckpt")
    except ValueError as err:
        errors["full_save"] = str(err)
    try:
        trainer(OnebitFSDPStrategy(ranks_per_node=2, shard_modules=[Block], save_distributed_checkpoint=False),
                default_root_dir=folder).fit(Model())
    except ValueError as err:
        errors["model_checkpoint"] = str(err)
    return dict(full=[p.full_tensor().detach().clone() for p in model.parameters()], errors=errors)


def scenario_resume(rank: int, world_size: int, folder: str) -> dict[str, Any]:
    # no ErrorFeedbackCheckpoint: the strategy keeps the error feedback by default (the callback used to be needed)
    whole = _fit(steps=10, data_by_step=True)
    saved = _fit(steps=6, data_by_step=True, save_to=f"{folder}/step6.ckpt")
    resumed = _fit(steps=10, data_by_step=True, resume_from=f"{folder}/step6.ckpt")
    return dict(whole=whole, saved=saved, resumed=resumed, consolidated=_consolidated(folder))


def scenario_resharded(rank: int, world_size: int, folder: str) -> dict[str, Any]:
    from lightning_onebit import ErrorFeedbackCheckpoint

    callback = ErrorFeedbackCheckpoint(policy="keep")
    run = _fit(steps=8, ranks_per_node=1, devices=2, callbacks=[callback, RecordStart()], data_by_step=True,
               resume_from=f"{folder}/step6.ckpt")
    return dict(run, restored=callback.restored)


@pytest.fixture(scope="module")
def resumes(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    folder = str(tmp_path_factory.mktemp("onebit_fsdp_checkpoints"))
    four = run_distributed(scenario_resume, 4, folder, timeout_s=400)
    two = run_distributed(scenario_resharded, 2, folder, timeout_s=300)
    return dict(four=four, two=two, folder=folder)


def test_a_resume_with_kept_error_feedback_continues_bitwise(resumes: dict[str, Any]) -> None:
    """Saved and resumed without ``ErrorFeedbackCheckpoint("keep")`` (which it used to take): the strategy's default."""
    import os

    four = resumes["four"]
    assert os.path.isdir(os.path.join(resumes["folder"], "step6.ckpt"))  # a distributed checkpoint: a folder
    for r in four:
        assert torch.equal(r["whole"]["shards"], r["resumed"]["shards"])
        assert r["resumed"]["steps"] == 10 and r["resumed"]["stage"] == "compression"
    _same_shard_ranks_identical([r["resumed"] for r in four])


def test_a_checkpoint_of_4_ranks_loads_resharded_on_2_and_resets_the_error_feedback(resumes: dict[str, Any]) -> None:
    four, two = resumes["four"], resumes["two"]
    for r in two:
        # the whole parameters at the resume are those the 4-rank run saved at step 6, resharded from 2 shards to 1
        for loaded, saved in zip(r["first_full"], four[0]["saved"]["full"]):
            assert torch.equal(loaded, saved), float((loaded - saved).abs().max())
        # the optimizer state came along: the step count, and the compression stage from step 5 on
        assert (r["steps"], r["stage"]) == (8, "compression")
        # the sidecars were written for world size 4: every rank resets its error feedback (and says why, once)
        assert r["restored"] is False


def test_consolidated_weights_load_into_the_plain_model(resumes: dict[str, Any]) -> None:
    """``save_distributed_checkpoint=False`` with ``weights_only=True``: one file (no folder, no per-rank files)
    holding the whole tensors, which the unsharded model loads for inference, equal to the trained parameters. Saving
    the training state that way, or a ModelCheckpoint that would, is refused with the way out."""
    import os

    path = os.path.join(resumes["folder"], "weights.ckpt")
    assert os.path.isfile(path) and not any(f.startswith("weights.ckpt.") for f in os.listdir(resumes["folder"]))
    plain = Model()
    plain.load_state_dict(torch.load(path, weights_only=True)["state_dict"])
    for r in resumes["four"]:
        consolidated = r["consolidated"]
        assert all(torch.equal(a, b) for a, b in zip(plain.parameters(), consolidated["full"]))
        assert "trainer.save_checkpoint(path, weights_only=True)" in consolidated["errors"]["full_save"]
        assert "ModelCheckpoint saves the training state: give it save_weights_only=True" in \
            consolidated["errors"]["model_checkpoint"]
    with pytest.raises(ValueError, match="save_distributed_checkpoint must be True or False"):
        OnebitFSDPStrategy(save_distributed_checkpoint="no")


@pytest.mark.parametrize("overlap", ["yes", 1, None])
def test_a_bad_overlap_argument_is_refused(overlap: Any) -> None:
    with pytest.raises(ValueError, match="overlap must be 'auto', True or False"):
        OnebitFSDPStrategy(overlap=overlap)


def test_the_error_feedback_argument_is_checked_and_passed_through() -> None:
    from lightning_onebit import ErrorFeedbackCheckpoint

    assert OnebitFSDPStrategy().error_feedback == "keep"
    for policy in ("reset", "require", "keep"):
        strategy = OnebitFSDPStrategy(ranks_per_node=2, error_feedback=policy)
        assert strategy.error_feedback == policy and strategy.error_feedback_restored is None
    with pytest.raises(ValueError, match=r"OnebitFSDPStrategy\(error_feedback=...\) must be one of \('reset', 'keep', "
                                         r"'require'\), got 'bogus'"):
        OnebitFSDPStrategy(error_feedback="bogus")  # type: ignore[arg-type]
    # the callback sets the policy it chose on the strategy at setup, and reads the strategy's outcome
    strategy = OnebitFSDPStrategy(ranks_per_node=2, error_feedback="reset")
    trainer = pl.Trainer(accelerator="cpu", devices=1, strategy=strategy, logger=False, enable_progress_bar=False,
                         enable_model_summary=False, enable_checkpointing=False)
    callback = ErrorFeedbackCheckpoint("require")
    callback.setup(trainer, Model(), "fit")
    assert strategy.error_feedback == "require" and callback.restored is None
    # saved with "reset": no per-rank state, only the policy and the norm in the main checkpoint
    strategy.set_error_feedback("reset")
    strategy._onebit_optimizer = OnebitAdam(nn.Linear(2, 2).parameters(), freeze_step=1)
    checkpoint: dict[str, Any] = {"optimizer_states": []}
    strategy._error_feedback.save(checkpoint, strategy.onebit_optimizer)
    assert checkpoint == {"optimizer_states": [], "onebit_error_feedback": {"policy": "reset", "error_norm_rank0": 0.0}}


@pytest.mark.parametrize(
    "policy, message",
    [
        (dict(param_dtype=torch.int8), "mixed_precision's param_dtype must be a floating-point torch.dtype or None "
                                       "(no cast), got torch.int8"),
        (dict(reduce_dtype=torch.bool), "mixed_precision's reduce_dtype must be a floating-point torch.dtype"),
        (dict(output_dtype=torch.int64), "mixed_precision's output_dtype must be a floating-point torch.dtype"),
        (dict(param_dtype=torch.complex64), "mixed_precision's param_dtype must be a floating-point torch.dtype"),
        (dict(param_dtype="bfloat16"), "mixed_precision's param_dtype must be a floating-point torch.dtype"),
        (dict(cast_forward_inputs="yes"), "mixed_precision's cast_forward_inputs must be True or False, got 'yes'"),
    ],
)
def test_a_mixed_precision_policy_with_a_dtype_that_is_not_floating_is_refused(policy: dict, message: str) -> None:
    """Used to: ``MixedPrecisionPolicy(param_dtype=torch.int8)`` was taken and failed at the first forward, on every
    rank, inside FSDP. Now a ``ValueError`` naming the field at construction; floating dtypes and ``None`` pass."""
    import re

    from torch.distributed.fsdp import MixedPrecisionPolicy

    with pytest.raises(ValueError, match=re.escape(message)):
        OnebitFSDPStrategy(shard_modules=[Block], mixed_precision=MixedPrecisionPolicy(**policy))
    good = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32, output_dtype=torch.float16)
    assert OnebitFSDPStrategy(shard_modules=[Block], mixed_precision=good).mixed_precision is good


def test_shard_modules_take_one_class_or_a_list_of_classes() -> None:
    """Used to: ``shard_modules=nn.Linear`` (one class) raised "'type' object is not iterable", and a class's name
    (``"torch.nn.Linear"``) was refused as a list of its characters. One class is now a list of one; names are refused
    with the way to pass classes (the LightningCLI case is in tests/strategy/test_cli.py)."""
    import re

    assert OnebitFSDPStrategy(shard_modules=Block).shard_modules == (Block,)
    assert OnebitFSDPStrategy(shard_modules=[Block, nn.Linear]).shard_modules == (Block, nn.Linear)
    for names in ("torch.nn.Linear", ["torch.nn.Linear"]):
        with pytest.raises(ValueError, match=re.escape(f"shard_modules takes module classes, not their names: got "
                                                       f"{names!r}. Pass the classes (e.g. shard_modules=")):
            OnebitFSDPStrategy(shard_modules=names)
    for bad, shown in (([], "[]"), ([nn.Linear(2, 2)], "[Linear(in_features=2"), ((int,), "[<class 'int'>]")):
        message = (f"shard_modules must be a non-empty list of torch.nn.Module classes (e.g. "
                   f"shard_modules=[TransformerBlock]), got {shown}")
        with pytest.raises(ValueError, match=re.escape(message)):
            OnebitFSDPStrategy(shard_modules=bad)
    with pytest.raises(ValueError, match="shard_modules must be a torch.nn.Module class or a list of them"):
        OnebitFSDPStrategy(shard_modules=nn.Linear(2, 2))


@pytest.mark.parametrize(
    "kwargs, message",
    [
        (dict(timeout=60), "timeout must be a datetime.timedelta > 0 or None (torch's default), got 60"),
        (dict(process_group_backend=1), "process_group_backend must be a torch.distributed backend name"),
        (dict(save_distributed_checkpoint=1), "save_distributed_checkpoint must be True or False, got 1"),
    ],
)
def test_other_bad_constructor_arguments_are_refused(kwargs: dict, message: str) -> None:
    """Used to: an int ``timeout`` or a backend that is no string reached ``init_process_group`` at setup."""
    import re

    with pytest.raises(ValueError, match=re.escape(message)):
        OnebitFSDPStrategy(**kwargs)
