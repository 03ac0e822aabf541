"""``onebit_fsdp`` checkpoints saved whole or not at all, verified before use, and refused clearly when they are of the
other strategy, on 4 gloo ranks as 2 simulated nodes x 2 (``ranks_per_node=2``).

What a hostile run found on the code before (each below asserts the new behaviour):

* A save that died inside DCP's write of an existing name (``ModelCheckpoint(save_last=True)`` re-saves
  ``last.ckpt``) left a folder mixing two saves (the new shards, the old ``meta.pt`` and sidecars), and a resume
  trained on it with only "error feedback reset ... the file belongs to another checkpoint". Now a save writes a
  temporary sibling folder that is put in place once every rank has written: the interrupted save leaves the
  previous checkpoint intact, and a resume from it restores everything.
* Bits flipped inside a shard that still parses were loaded and trained on; a truncated or random shard ended in a
  bare ``EOFError`` or a ``weights_only`` message naming no file; a folder assembled from two saves was loaded. Now
  the manifest's SHA-256 of every file is verified before any tensor is read, and every rank raises the same error
  naming the folder and the file, before any training step.
* A ``onebit_adam`` checkpoint resumed under ``onebit_fsdp`` died with ``KeyError: tensor([[...]])``, and the other
  way round with a bare ``IsADirectoryError``; now a ``ValueError`` says which strategy resumes it.
* A checkpoint written before manifests (sidecars next to the folder) still resumes, unverified, with a warning.
"""

from __future__ import annotations

import io
import os
import shutil
import zipfile
from contextlib import contextmanager
from typing import Any, Iterator, Optional

import pytest
import torch
import torch.distributed as dist
from torch.distributed.checkpoint import CheckpointException

import lightning.pytorch as pl
from lightning.pytorch.callbacks import ModelCheckpoint
from lightning_onebit import OnebitFSDPStrategy, OnebitStrategy
from tests.capture import capture_logs, capture_warnings
from tests.distributed import run_distributed, run_scenarios, scenario_results
from tests.strategy.test_fsdp_strategy import FREEZE, Block, Model, RecordStart

WORLD_SIZE = 4


class CountSteps(pl.Callback):
    def __init__(self) -> None:
        self.steps = 0

    def on_train_batch_end(self, *args: Any) -> None:
        self.steps += 1


def _trainer(strategy: Any, steps: int, callbacks: Optional[list] = None, **kwargs: Any) -> pl.Trainer:
    kwargs.setdefault("enable_checkpointing", False)
    return pl.Trainer(accelerator="cpu", devices=WORLD_SIZE, strategy=strategy, max_steps=steps, logger=False,
                      enable_progress_bar=False, enable_model_summary=False, callbacks=callbacks or [], **kwargs)


def _fsdp() -> OnebitFSDPStrategy:
    return OnebitFSDPStrategy(ranks_per_node=2, shard_modules=[Block])


def _full(model: pl.LightningModule) -> list[torch.Tensor]:
    return [p.full_tensor().detach().clone() for p in model.parameters()]


def _run(steps: int, resume: Optional[str] = None, save_to: Optional[str] = None, strategy: Any = None,
         callbacks: Optional[list] = None, **kwargs: Any) -> dict[str, Any]:
    """A fit (resumed from ``resume``), then a save to ``save_to``; what it did, or the error it raised (type name,
    text)."""
    model = Model(data_by_step=True)
    strategy = strategy if strategy is not None else _fsdp()
    counter = CountSteps()
    recorders = [counter, RecordStart()] if isinstance(strategy, OnebitFSDPStrategy) else [counter]
    trainer = _trainer(strategy, steps, recorders + (callbacks or []), **kwargs)
    error = None
    with capture_logs() as logs, capture_warnings() as warnings:
        try:
            trainer.fit(model, ckpt_path=resume)
        except (Exception, CheckpointException) as err:  # noqa: BLE001 - the tests check the type and the text
            error = (type(err).__name__, str(err))
    out = dict(error=error, steps=counter.steps, logs=logs, warnings=warnings, first=getattr(model, "first_full", None),
               restored=getattr(strategy, "error_feedback_restored", None), trainer=trainer, model=model)
    if error is None and isinstance(strategy, OnebitFSDPStrategy):
        out["full"] = _full(model)
    if error is None and save_to is not None:
        trainer.save_checkpoint(save_to)
    return out


def _public(result: dict[str, Any]) -> dict[str, Any]:
    return {k: v for k, v in result.items() if k not in ("trainer", "model")}


@contextmanager
def _crash_after_dcp_writes() -> Iterator[None]:
    """``torch.distributed.checkpoint.save`` writes every rank's shards and ``.metadata``, then every rank dies (as a
    killed rank would leave the folder: the save does not finish)."""
    import torch.distributed.checkpoint as dcp

    original = dcp.save

    def save_then_crash(*args: Any, **kwargs: Any) -> Any:
        original(*args, **kwargs)
        raise RuntimeError("simulated crash after DCP wrote the shards")

    dcp.save = save_then_crash
    try:
        yield
    finally:
        dcp.save = original


def _on_rank0(how: Any) -> None:
    if dist.get_rank() == 0:
        how()
    dist.barrier()


def scenario_atomic(rank: int, world_size: int, workdir: str) -> dict[str, Any]:
    last = os.path.join(workdir, "atomic", "last.ckpt")
    first = _run(6, save_to=last)
    _on_rank0(lambda: shutil.copytree(last, os.path.join(workdir, "step6.ckpt")))  # for the damage scenario
    second = _run(8, resume=last)
    crash = None
    with _crash_after_dcp_writes():
        try:
            second["trainer"].save_checkpoint(last)
        except RuntimeError as err:
            crash = str(err)
    dist.barrier()
    listing_after_crash = sorted(os.listdir(os.path.dirname(last)))
    resumed = _run(10, resume=last, save_to=os.path.join(workdir, "step10.ckpt"))
    return dict(first=_public(first), second=_public(second), crash=crash, listing_after_crash=listing_after_crash,
                resumed=_public(resumed))


def scenario_model_checkpoint(rank: int, world_size: int, workdir: str) -> dict[str, Any]:
    """``ModelCheckpoint(save_last=True)`` re-saves ``last.ckpt`` every 2 steps and keeps the best 1 other."""
    folder = os.path.join(workdir, "rotating")
    checkpoint = ModelCheckpoint(dirpath=folder, every_n_train_steps=2, save_top_k=1, save_last=True)
    _run(8, callbacks=[checkpoint], enable_checkpointing=True)
    dist.barrier()
    listing = {name: sorted(os.listdir(os.path.join(folder, name))) for name in sorted(os.listdir(folder))}
    resumed = _run(10, resume=os.path.join(folder, "last.ckpt"))
    return dict(listing=listing, resumed=_public(resumed))


# ------------------------------------------------------------------------------------------------- damaged folders
def _largest_tensor_data(folder: str, file: str) -> tuple[int, int]:
    """Where the raw bytes of the largest tensor DCP wrote to ``file`` lie in it: (start, length)."""
    import torch.distributed.checkpoint as dcp

    metadata = dcp.FileSystemReader(folder).read_metadata()
    items = [info for info in metadata.storage_data.values() if info.relative_path == file]
    item = max(items, key=lambda info: info.length)
    with open(os.path.join(folder, file), "rb") as f:
        f.seek(item.offset)
        blob = f.read(item.length)
    with zipfile.ZipFile(io.BytesIO(blob)) as archive:  # the item is a torch.save archive: its data record
        info = max((i for i in archive.infolist() if "/data/" in i.filename), key=lambda i: i.file_size)
        header = blob[info.header_offset:info.header_offset + 30]
        start = info.header_offset + 30 + int.from_bytes(header[26:28], "little") + int.from_bytes(header[28:30],
                                                                                                    "little")
    return item.offset + start, info.file_size


def _flip_sign_bits(folder: str) -> None:
    start, length = _largest_tensor_data(folder, "__0_0.distcp")
    with open(os.path.join(folder, "__0_0.distcp"), "r+b") as f:
        for k in range(3, length, 4 * 7):  # the top byte of every seventh float32: its sign
            f.seek(start + k)
            byte = f.read(1)[0]
            f.seek(start + k)
            f.write(bytes([byte ^ 0x80]))


def _truncate(folder: str, name: str) -> None:
    path = os.path.join(folder, name)
    with open(path, "r+b") as f:
        f.truncate(os.path.getsize(path) // 2)


def _random(folder: str, name: str) -> None:
    with open(os.path.join(folder, name), "wb") as f:
        f.write(os.urandom(3000))


DAMAGES = {
    "sign_bits": _flip_sign_bits,
    "truncated_shard": lambda d: _truncate(d, "__1_0.distcp"),
    "random_shard": lambda d: _random(d, "__2_0.distcp"),
    "random_dcp_metadata": lambda d: _random(d, ".metadata"),
    "random_meta": lambda d: _random(d, "meta.pt"),
    "missing_shard": lambda d: os.remove(os.path.join(d, "__3_0.distcp")),
}


def scenario_damaged(rank: int, world_size: int, workdir: str) -> dict[str, Any]:
    good, later = os.path.join(workdir, "step6.ckpt"), os.path.join(workdir, "step10.ckpt")
    out: dict[str, Any] = {}
    for name, how in DAMAGES.items():
        folder = os.path.join(workdir, name)
        _on_rank0(lambda: (shutil.copytree(good, folder), how(folder)))
        out[name] = _public(_run(10, resume=folder))

    mixed = os.path.join(workdir, "mixed.ckpt")  # the step-10 save with two files of the step-6 save

    def assemble() -> None:
        shutil.copytree(later, mixed)
        for name in ("__1_0.distcp", ".metadata"):
            shutil.copyfile(os.path.join(good, name), os.path.join(mixed, name))

    _on_rank0(assemble)
    out["mixed"] = _public(_run(12, resume=mixed))
    return out


# ------------------------------------------------------------------------------------- the other strategy's checkpoints
def scenario_other_strategy(rank: int, world_size: int, workdir: str) -> dict[str, Any]:
    ddp_file = os.path.join(workdir, "ddp.ckpt")
    _run(6, save_to=ddp_file, strategy=OnebitStrategy(), use_distributed_sampler=True)
    return dict(
        ddp_under_fsdp=_public(_run(8, resume=ddp_file)),
        fsdp_under_ddp=_public(_run(8, resume=os.path.join(workdir, "step6.ckpt"), strategy=OnebitStrategy())),
    )


# ------------------------------------------------------------------------------------- written before manifests
def _save_as_before(trainer: pl.Trainer, path: str) -> None:
    """What ``OnebitFSDPStrategy.save_checkpoint`` did before manifests: the sidecars next to the folder, then
    Lightning's distributed checkpoint written in place."""
    from lightning.pytorch.strategies import ModelParallelStrategy

    from lightning_onebit.strategy.checkpoint import save_per_rank_state
    from lightning_onebit.strategy.sidecar import sidecar_path

    strategy = trainer.strategy
    checkpoint = trainer._checkpoint_connector.dump_checkpoint()
    strategy._error_feedback.save(checkpoint, strategy.onebit_optimizer)
    save_per_rank_state(checkpoint, sidecar_path(path, strategy.global_rank), "before/1", strategy.global_rank,
                        strategy.world_size, None)
    ModelParallelStrategy.save_checkpoint(strategy, checkpoint, path)
    trainer.strategy.barrier()


def scenario_legacy(rank: int, world_size: int, workdir: str) -> dict[str, Any]:
    legacy = os.path.join(workdir, "legacy.ckpt")
    saved = _run(6)
    _save_as_before(saved["trainer"], legacy)
    out = dict(saved=_public(saved), files=sorted(os.listdir(workdir)), resumed=_public(_run(8, resume=legacy)))
    damaged = os.path.join(workdir, "legacy_truncated.ckpt")

    def copy_and_truncate() -> None:
        shutil.copytree(legacy, damaged)
        for r in range(world_size):
            shutil.copyfile(f"{legacy}.onebit-rank{r}", f"{damaged}.onebit-rank{r}")
        _truncate(damaged, "__1_0.distcp")

    _on_rank0(copy_and_truncate)
    out["truncated"] = _public(_run(8, resume=damaged))
    return out


class NormalizedModel(Model):
    """``Model`` with a BatchNorm before its head: FSDP2 leaves every rank the running statistics of its own batches."""

    def __init__(self) -> None:
        super().__init__(data_by_step=True)
        self.norm = torch.nn.BatchNorm1d(16)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.norm(self.blocks(x)))


class BuffersAtStart(pl.Callback):
    def on_train_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        self.buffers = [b.detach().clone() for b in pl_module.buffers()]


def scenario_buffers(rank: int, world_size: int, workdir: str) -> dict[str, Any]:
    """A BatchNorm model saved after 6 steps, and resumed: the buffers each rank had at the save, and at the resume."""
    path = os.path.join(workdir, "buffers.ckpt")
    model = NormalizedModel()
    trainer = _trainer(_fsdp(), 6)
    trainer.fit(model)
    saved = [b.detach().clone() for b in model.buffers()]
    trainer.save_checkpoint(path)
    unchanged = all(torch.equal(a, b) for a, b in zip(saved, model.buffers()))
    at_start = BuffersAtStart()
    _trainer(_fsdp(), 8, [at_start]).fit(NormalizedModel(), ckpt_path=path)
    # the consolidated weights (rank 0 writes them alone; every rank takes part in the buffers' broadcast)
    weights = os.path.join(workdir, "buffers_weights.ckpt")
    consolidated = _trainer(OnebitFSDPStrategy(ranks_per_node=2, shard_modules=[Block],
                                               save_distributed_checkpoint=False), 6)
    model = NormalizedModel()
    consolidated.fit(model)
    consolidated.save_checkpoint(weights, weights_only=True)
    dist.barrier()
    written = torch.load(weights, weights_only=True)["state_dict"]
    return {"saved": saved, "unchanged": unchanged, "resumed": at_start.buffers,
            "consolidated_own": [b.detach().clone() for b in model.buffers()],
            "consolidated_written": [written[f"norm.{name}"] for name in ("running_mean", "running_var",
                                                                           "num_batches_tracked")]}


SCENARIOS = (("atomic", scenario_atomic), ("model_checkpoint", scenario_model_checkpoint),
             ("damaged", scenario_damaged), ("other_strategy", scenario_other_strategy), ("legacy", scenario_legacy),
             ("buffers", scenario_buffers))


@pytest.fixture(scope="module")
def session(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    workdir = str(tmp_path_factory.mktemp("fsdp_checkpoints"))
    return dict(ranks=run_distributed(run_scenarios, WORLD_SIZE, SCENARIOS, workdir, timeout_s=600), workdir=workdir)


def _results(session: dict[str, Any], name: str) -> list[dict[str, Any]]:
    return scenario_results(session["ranks"], name)


def _refused(run: dict[str, Any], kind: str, *phrases: str) -> None:
    assert run["error"] is not None, f"loaded and trained {run['steps']} steps: {run['logs'][-3:]}"
    assert run["error"][0] == kind, run["error"]
    for phrase in phrases:
        assert phrase in run["error"][1], run["error"][1]
    assert run["steps"] == 0 and run["first"] is None  # before any training step


# ------------------------------------------------------------------------------------------------------------ tests
def test_a_save_interrupted_before_it_is_put_in_place_leaves_the_previous_checkpoint_intact(
        session: dict[str, Any]) -> None:
    """Before: the second save's shards were written into ``last.ckpt`` in place, next to the first save's
    ``meta.pt`` and sidecars; the resume trained on the second save's parameters and reset the error feedback."""
    ranks = _results(session, "atomic")
    for r in ranks:
        assert r["crash"] is not None and "simulated crash" in r["crash"], r["crash"]
        resumed = r["resumed"]
        assert resumed["error"] is None, resumed["error"]
        # the parameters the first save holds, not the interrupted second save's
        first = ranks[0]["first"]["full"]
        assert all(torch.equal(a, b) for a, b in zip(resumed["first"], first))
        assert not all(torch.equal(a, b) for a, b in zip(resumed["first"], ranks[0]["second"]["full"]))
        assert resumed["restored"] is True and resumed["steps"] == 4  # from step 6 to 10, error feedback restored
        assert not any("error feedback reset" in w for w in resumed["warnings"]), resumed["warnings"]
        # the partial folder of the interrupted save does not stay
        assert r["listing_after_crash"] == ["last.ckpt"], r["listing_after_crash"]
    assert "onebit_fsdp: compression error feedback restored on every rank (4 ranks)" in ranks[0]["resumed"]["logs"]


def test_a_resumed_run_names_the_step_the_compression_stage_began_at(session: dict[str, Any]) -> None:
    """Before: the run resumed at step 6 (the stage began at step 5) logged "compression stage from optimizer step 7"
    (and the buckets' "compression stage from step 7")."""
    logs = _results(session, "atomic")[0]["second"]["logs"]
    began = [m for m in logs if "compression stage from" in m]
    assert began == [f"onebit_fsdp: compression stage from optimizer step {FREEZE + 1} (this run continues it from "
                     f"step 7): momenta averaged in 1 bit, variance frozen; see docs/guides/freeze-step.md"], began
    assert not any("from step 7" in m.replace("continues it from step 7", "") for m in logs), logs


def test_model_checkpoint_re_saves_and_rotates_whole_folders(session: dict[str, Any]) -> None:
    ranks = _results(session, "model_checkpoint")
    listing = ranks[0]["listing"]
    assert sorted(listing) == ["epoch=0-step=8.ckpt", "last.ckpt"], listing  # no partial folder, no sidecar beside them
    for files in listing.values():
        assert files == sorted([".metadata", "meta.pt", "onebit-manifest.json"]
                               + [f"__{r}_0.distcp" for r in range(WORLD_SIZE)]
                               + [f"onebit-rank{r}" for r in range(WORLD_SIZE)]), files
    for r in ranks:
        assert r["resumed"]["error"] is None and r["resumed"]["restored"] is True, r["resumed"]["error"]
        assert not any("Detected an existing checkpoint" in w for w in r["resumed"]["warnings"])


@pytest.mark.parametrize("name, file, what", [
    # before: loaded and trained on ("error feedback restored")
    ("sign_bits", "__0_0.distcp", "does not match the SHA-256 the manifest records"),
    # before: a bare EOFError, or a weights_only message naming no file
    ("truncated_shard", "__1_0.distcp", "bytes where the manifest records"),
    ("random_shard", "__2_0.distcp", "bytes where the manifest records"),
    ("random_dcp_metadata", ".metadata", "bytes where the manifest records"),
    ("random_meta", "meta.pt", "bytes where the manifest records"),
    ("missing_shard", "__3_0.distcp", "is missing"),
])
def test_a_damaged_folder_is_refused_on_every_rank_naming_the_file(session: dict[str, Any], name: str, file: str,
                                                                    what: str) -> None:
    folder = os.path.join(session["workdir"], name)
    for r in _results(session, "damaged"):
        _refused(r[name], "CheckpointIntegrityError", f"the checkpoint {folder} cannot be loaded: {file} ", what,
                 "resume from another checkpoint")


def test_a_folder_assembled_from_two_saves_is_refused(session: dict[str, Any]) -> None:
    """Before: loaded (the step-10 save's parameters with one shard of the step-6 save's)."""
    folder = os.path.join(session["workdir"], "mixed.ckpt")
    for r in _results(session, "damaged"):
        _refused(r["mixed"], "CheckpointIntegrityError", f"the checkpoint {folder} cannot be loaded", "__1_0.distcp",
                 ".metadata", "files of two saves were put together")


def test_a_onebit_adam_checkpoint_under_onebit_fsdp_says_which_strategy_resumes_it(session: dict[str, Any]) -> None:
    """Before: ``KeyError: tensor([[...]])`` (a parameter's values as the message)."""
    path = os.path.join(session["workdir"], "ddp.ckpt")
    for r in _results(session, "other_strategy"):
        _refused(r["ddp_under_fsdp"], "ValueError",
                 f"strategy='onebit_fsdp' cannot load the checkpoint: {path} is a onebit_adam checkpoint",
                 "resume it with strategy='onebit_adam'", "fit without ckpt_path")
    # the advice works: the model loads the file's weights
    Model().load_state_dict(torch.load(path, weights_only=False)["state_dict"])


def test_a_onebit_fsdp_checkpoint_under_onebit_adam_says_which_strategy_resumes_it(session: dict[str, Any]) -> None:
    """Before: a bare ``IsADirectoryError``."""
    path = os.path.join(session["workdir"], "step6.ckpt")
    for r in _results(session, "other_strategy"):
        _refused(r["fsdp_under_ddp"], "ValueError",
                 f"strategy='onebit_adam' cannot load the checkpoint: {path} is a onebit_fsdp checkpoint",
                 "resume it with strategy='onebit_fsdp'", "dcp_to_torch_save(folder, file)")
    # the advice works: one file with the weights the 4 ranks saved, which the plain model loads
    from torch.distributed.checkpoint.format_utils import dcp_to_torch_save

    weights = os.path.join(session["workdir"], "step6_weights.pt")
    dcp_to_torch_save(path, weights)
    model = Model()
    model.load_state_dict(torch.load(weights, weights_only=False)["state_dict"])
    saved = _results(session, "atomic")[0]["first"]["full"]
    assert all(torch.equal(a, b) for a, b in zip(model.parameters(), saved))


def test_a_checkpoint_written_before_manifests_resumes_unverified(session: dict[str, Any]) -> None:
    ranks = _results(session, "legacy")
    assert [f"legacy.ckpt.onebit-rank{r}" for r in range(WORLD_SIZE)] == [
        f for f in ranks[0]["files"] if f.startswith("legacy.ckpt.")]
    for r in ranks:
        resumed = r["resumed"]
        assert resumed["error"] is None and resumed["restored"] is True and resumed["steps"] == 2, resumed["error"]
        assert all(torch.equal(a, b) for a, b in zip(resumed["first"], ranks[0]["saved"]["full"]))
        # damaged, it cannot say which file is: it names the folder and what could not be read
        folder = os.path.join(session["workdir"], "legacy_truncated.ckpt")
        _refused(r["truncated"], "CheckpointIntegrityError", f"the checkpoint {folder} could not be read",
                 "records no digests")
    assert any("records no digests of its files" in w for w in ranks[0]["resumed"]["warnings"])


def test_the_checkpoint_holds_rank_0s_buffers_every_one_of_them(session: dict[str, Any]) -> None:
    """Before: ``torch.distributed.checkpoint`` wrote each buffer from one rank chosen per tensor, so a BatchNorm's
    running mean and variance came from different ranks."""
    ranks = _results(session, "buffers")
    assert not torch.equal(ranks[0]["saved"][0], ranks[-1]["saved"][0])  # each rank's own statistics at the save
    for rank, r in enumerate(ranks):
        assert r["unchanged"], f"rank {rank}: the save changed the model's buffers"
        for name, got, want in zip(("running_mean", "running_var", "num_batches_tracked"), r["resumed"],
                                   ranks[0]["saved"]):
            assert torch.equal(got, want), f"rank {rank}: {name} resumed is not rank 0's"
    # save_distributed_checkpoint=False: the one file holds rank 0's too
    assert all(torch.equal(a, b) for a, b in zip(ranks[0]["consolidated_written"], ranks[0]["consolidated_own"]))
    assert not torch.equal(ranks[0]["consolidated_own"][0], ranks[-1]["consolidated_own"][0])
