"""Tests of the Lightning callbacks MomentumMask, ErrorFeedbackCheckpoint and CommunicationMonitor.

As in ``test_strategy.py``, spawning ranks costs far more than the tiny fits, so the multi-rank scenarios run as a
sequence of ``Trainer.fit`` calls inside one spawned 2-rank session (a module-scoped fixture), plus one 1-rank session
that resumes a 2-rank checkpoint (world size changed). Every test asserts on the per-rank results of its scenario; a
scenario that raises is reported by the test that owns it, with the rank's traceback.

The model (``tests/callback_models.py``) is an ``Embedding(20, 8)`` whose rows 10..19 are never looked up, mean-pooled
into a ``Linear(8, 1)``: 169 parameters, one DDP gradient bucket, one compressed momentum bucket. CommunicationMonitor's
plain-DDP baseline runs ``tests/lightning_models.py``'s ``Regressor`` with AdamW under ``strategy="ddp"``.
"""

from __future__ import annotations

import csv
import io
import math
import os
import re
from typing import Any, Callable

import pytest
import torch

import lightning.pytorch as pl
import lightning_onebit  # noqa: F401  (registers the strategies)
from lightning.pytorch.callbacks import ModelCheckpoint
from lightning.pytorch.loggers import CSVLogger
from torch.distributed.algorithms.ddp_comm_hooks import default_hooks
from lightning_onebit import CommunicationMonitor, ErrorFeedbackCheckpoint, MomentumMask, OnebitAdam, OnebitStrategy
from lightning_onebit.comm import BucketLayout, ring_allreduce_bytes
from lightning_onebit.strategy.sidecar import sidecar_path
from tests.callback_models import (
    BATCH,
    DIM,
    USED_ROWS,
    VOCAB,
    GrownVocabRegressor,
    TokenRegressor,
    token_data,
    token_loader,
    unused_rows_mask,
)
from tests.capture import capture_logs, capture_warnings
from tests.distributed import run_distributed, run_scenarios, scenario_results
from tests.lightning_models import Regressor, flat_params, loader, trainer_kwargs

WORLD_SIZE = 2
N_PARAMS = VOCAB * DIM + DIM + 1  # emb.weight, head.weight, head.bias
_KEEP_WARNING = "ErrorFeedbackCheckpoint(policy='keep'): error feedback reset on every rank because"


# ======================================================================================== in-rank helpers


class DDPBucketProbe(pl.Callback):
    """Reads DDP's gradient bucket sizes (bytes, after the first iteration's rebuild) while the model is wrapped."""

    def on_train_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        data = trainer.strategy.model._get_ddp_logging_data()
        self.bucket_sizes = data.get("rebuilt_bucket_sizes") or data.get("bucket_sizes")


def _run_fit_expecting_error(trainer: pl.Trainer, model: TokenRegressor, loader: Any, **fit_kwargs: Any) -> dict:
    try:
        trainer.fit(model, loader, **fit_kwargs)
    except Exception as error:  # noqa: BLE001 - the type is what the tests check
        return dict(error_type=type(error).__name__, message=str(error), steps=len(model.losses))
    return dict(error_type=None, message="", steps=len(model.losses))


# ======================================================================================== scenarios (run on each rank)
MASK_FREEZE, MASK_STEPS = 4, 14


def scenario_mask(rank: int, world_size: int, workdir: str) -> dict[str, Any]:
    """The same model, data and seeds without any mask (``dead_coordinates="ignore"``, and ``cap_update=False``:
    DeepSpeed's update), with the optimizer's default (``"mask"``), with an explicit mask (glob + callable) and with
    auto=True."""
    callbacks: dict[str, Callable[[], list[pl.Callback]]] = {
        "none": lambda: [],
        "default": lambda: [],
        "explicit": lambda: [MomentumMask({"emb.*": lambda p: unused_rows_mask()})],
        "auto": lambda: [MomentumMask(auto=True)],
    }
    out: dict[str, Any] = {}
    for name, make in callbacks.items():
        model = TokenRegressor(freeze_step=MASK_FREEZE, dead_coordinates="ignore" if name == "none" else "mask",
                               cap_update=name != "none")
        init = model.emb.weight.detach().clone()
        cbs = make()
        trainer = pl.Trainer(**trainer_kwargs(world_size, MASK_STEPS, callbacks=cbs))
        with capture_logs() as logs:
            trainer.fit(model, token_loader(rank, MASK_STEPS))
        out[name] = dict(
            init=init,
            trace=model.emb_trace,
            losses=model.losses,
            final=flat_params(model),
            eval_loss=model.eval_loss(token_loader(rank, MASK_STEPS)),
            masked=getattr(cbs[0], "masked_coordinates", None) if cbs else None,
            logs=logs,
        )
    return out


TOG_FREEZE, TOG_BATCHES, TOG_EPOCHS, TOG_RESUME_EPOCH = 4, 3, 4, 1  # resume after step 6: two compressed steps done
TOG_STEPS = TOG_BATCHES * TOG_EPOCHS


def together_ckpt(workdir: str, epoch: int) -> str:
    return os.path.join(workdir, "together_ckpt", f"epoch={epoch}.ckpt")


def _resume(
    rank: int, world_size: int, workdir: str, epoch: int, callbacks: list[pl.Callback], **kwargs: Any
) -> tuple[pl.Trainer, TokenRegressor, list[str], list[str]]:
    """Resume the 'together' run from its checkpoint of ``epoch`` with a different init (the weights must come from
    the checkpoint) and the same per-epoch data."""
    rows = kwargs.pop("rows", USED_ROWS)
    model = TokenRegressor(freeze_step=TOG_FREEZE, seed=1000)
    trainer = pl.Trainer(
        **trainer_kwargs(world_size, -1, max_epochs=TOG_EPOCHS, callbacks=callbacks, **kwargs)
    )
    with capture_logs() as logs, capture_warnings() as warned:
        trainer.fit(model, token_loader(rank, TOG_BATCHES, rows), ckpt_path=together_ckpt(workdir, epoch))
    return trainer, model, logs, warned


def scenario_together(rank: int, world_size: int, workdir: str) -> dict[str, Any]:
    """Run A: all three callbacks in one Trainer (auto mask, keep, monitor with a CSVLogger), a checkpoint at every
    epoch end. Then resumes from A's compression-stage checkpoint: keep, reset, explicit masks from the code; a resume
    from A's warmup checkpoint; and a resume into a model whose embedding grew."""
    out: dict[str, Any] = {}
    # ---- A: uninterrupted
    model = TokenRegressor(freeze_step=TOG_FREEZE)
    mask, keep, monitor = MomentumMask(auto=True), ErrorFeedbackCheckpoint("keep"), CommunicationMonitor()
    probe = DDPBucketProbe()
    checkpoint = ModelCheckpoint(
        dirpath=os.path.join(workdir, "together_ckpt"), filename="{epoch}", every_n_epochs=1, save_top_k=-1
    )
    logger = CSVLogger(save_dir=os.path.join(workdir, "logs"), name="together", version=0)
    trainer = pl.Trainer(
        **trainer_kwargs(
            world_size,
            -1,
            max_epochs=TOG_EPOCHS,
            callbacks=[mask, keep, monitor, checkpoint, probe],
            logger=logger,
            log_every_n_steps=1,
            enable_checkpointing=True,
        )
    )
    trainer.fit(model, token_loader(rank, TOG_BATCHES))
    onebit = trainer.strategy.onebit_optimizer
    out["A"] = dict(
        final=flat_params(model),
        losses=model.losses,
        trace=model.emb_trace,
        step_count=onebit.step_count,
        masked=mask.masked_coordinates,
        layouts=[(l.tensor_numels, l.world_size, l.bytes_per_call()) for l in onebit.bucket_layouts().values()],
        ddp_bucket_sizes=probe.bucket_sizes,
        communication=trainer.strategy.communication,
        progress_bar=dict(trainer.progress_bar_metrics),
        csv=os.path.join(logger.log_dir, "metrics.csv"),
        files=sorted(os.listdir(os.path.join(workdir, "together_ckpt"))),
    )
    # ---- B: resume with keep; a second ModelCheckpoint keeps only the latest checkpoint (sidecars removed too)
    keep = ErrorFeedbackCheckpoint("keep")
    latest_dir = os.path.join(workdir, "latest_ckpt")
    latest = ModelCheckpoint(dirpath=latest_dir, filename="{epoch}", every_n_epochs=1, save_top_k=1)
    trainer, model, logs, warned = _resume(
        rank, world_size, workdir, TOG_RESUME_EPOCH, [MomentumMask(auto=True), keep, CommunicationMonitor(), latest],
        enable_checkpointing=True,
    )
    out["B_keep"] = dict(
        final=flat_params(model),
        losses=model.losses,
        trace=model.emb_trace,
        restored=keep.restored,
        step_count=trainer.strategy.onebit_optimizer.step_count,
        latest_files=sorted(os.listdir(latest_dir)),
        warnings=warned,
        logs=logs,
    )
    # ---- C: resume with reset
    reset = ErrorFeedbackCheckpoint("reset")
    trainer, model, logs, warned = _resume(
        rank,
        world_size,
        workdir,
        TOG_RESUME_EPOCH,
        [MomentumMask(auto=True), reset, CommunicationMonitor(prog_bar=False)],
    )
    out["C_reset"] = dict(
        final=flat_params(model),
        losses=model.losses,
        restored=reset.restored,
        progress_bar=dict(trainer.progress_bar_metrics),
        logs=logs,
    )
    # ---- D: explicit masks come from the code on resume (here: also row 0, which the data use)
    code_mask = unused_rows_mask()
    code_mask[0] = 0
    explicit = MomentumMask({"emb.weight": code_mask})
    trainer, model, logs, warned = _resume(
        rank, world_size, workdir, TOG_RESUME_EPOCH, [explicit, ErrorFeedbackCheckpoint("keep")]
    )
    out["D_explicit"] = dict(trace=model.emb_trace, masked=explicit.masked_coordinates)
    # ---- E: resume from the warmup checkpoint of epoch 0 (steps 1..3) with data that never contain token 9 again:
    # row 9 had gradients in steps 1..3, so the auto mask must not mask it
    auto = MomentumMask(auto=True)
    trainer, model, logs, warned = _resume(
        rank, world_size, workdir, 0, [auto, ErrorFeedbackCheckpoint("keep")], rows=USED_ROWS - 1
    )
    out["E_warmup_resume"] = dict(masked=getattr(auto, "masked_coordinates", None), steps=len(model.losses))
    # ---- F: the embedding grew since the checkpoint: the saved auto mask no longer fits
    grown = GrownVocabRegressor(freeze_step=TOG_FREEZE, seed=1000, vocab=VOCAB + 10)
    trainer = pl.Trainer(
        **trainer_kwargs(world_size, -1, max_epochs=TOG_EPOCHS, callbacks=[MomentumMask(auto=True)])
    )
    out["F_grown"] = _run_fit_expecting_error(
        trainer, grown, token_loader(rank, TOG_BATCHES), ckpt_path=together_ckpt(workdir, TOG_RESUME_EPOCH)
    )
    return out


DDP_STEPS = 6


class ForeignCommHook(pl.Callback):
    """Gives DDP a communication hook of the user's before the monitor starts, as ``DDPStrategy(ddp_comm_hook=...)``
    does on CUDA (Lightning registers it there only)."""

    def on_fit_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        trainer.strategy.model.register_comm_hook(None, default_hooks.allreduce_hook)


def scenario_ddp_monitor(rank: int, world_size: int, workdir: str) -> dict[str, Any]:
    """CommunicationMonitor under plain strategy='ddp' (AdamW): counted with a CSVLogger; then two fits, with the same
    monitor, of a run whose DDP already has a comm hook of the user's."""
    out: dict[str, Any] = {}
    model = Regressor(optimizer="adamw")
    monitor, probe = CommunicationMonitor(), DDPBucketProbe()
    logger = CSVLogger(save_dir=os.path.join(workdir, "logs"), name="ddp", version=0)
    trainer = pl.Trainer(
        **trainer_kwargs(world_size, DDP_STEPS, strategy="ddp", callbacks=[monitor, probe], logger=logger,
                         log_every_n_steps=1)
    )
    with capture_warnings() as warned:
        trainer.fit(model, loader(rank, DDP_STEPS))
    out["counted"] = dict(
        communication=monitor.communication,
        gradient_numel=sum(p.numel() for p in model.parameters() if p.requires_grad),
        ddp_bucket_sizes=probe.bucket_sizes,
        steps=trainer.global_step,
        csv=os.path.join(logger.log_dir, "metrics.csv"),
        progress_bar=dict(trainer.progress_bar_metrics),
        warnings=warned,
    )
    monitor = CommunicationMonitor()
    with capture_warnings() as warned:
        for _ in range(2):
            trainer = pl.Trainer(
                **trainer_kwargs(world_size, DDP_STEPS, strategy="ddp", callbacks=[ForeignCommHook(), monitor])
            )
            trainer.fit(Regressor(optimizer="adamw"), loader(rank, DDP_STEPS))
    out["foreign"] = dict(communication=monitor.communication, steps=trainer.global_step, warnings=warned)
    return out


def scenario_refusals(rank: int, world_size: int, workdir: str) -> dict[str, Any]:
    """Errors at setup: MomentumMask and ErrorFeedbackCheckpoint under strategy='ddp'; a mask of the wrong shape; a
    glob that matches nothing."""
    out: dict[str, Any] = {}
    for name, callback in (
        ("mask_ddp", MomentumMask(auto=True)),
        ("keep_ddp", ErrorFeedbackCheckpoint("keep")),
    ):
        model = TokenRegressor()
        trainer = pl.Trainer(**trainer_kwargs(world_size, 6, strategy="ddp", callbacks=[callback]))
        out[name] = _run_fit_expecting_error(trainer, model, token_loader(rank, 6))
    for name, callback in (
        ("wrong_shape", MomentumMask({"emb.weight": torch.ones(USED_ROWS, DIM)})),
        ("wrong_shape_callable", MomentumMask({"head.*": lambda p: torch.ones(3)})),
        ("no_match", MomentumMask({"encoder.*": torch.ones(1)})),
    ):
        model = TokenRegressor()
        trainer = pl.Trainer(**trainer_kwargs(world_size, 6, callbacks=[callback]))
        out[name] = _run_fit_expecting_error(trainer, model, token_loader(rank, 6))
    return out


def scenario_one_rank_resume(rank: int, world_size: int, workdir: str) -> dict[str, Any]:
    """Resume the 2-rank 'together' checkpoint (compression stage) in a single-process Trainer with keep."""
    keep = ErrorFeedbackCheckpoint("keep")
    mask = MomentumMask(auto=True)
    trainer, model, logs, warned = _resume(
        rank, world_size, workdir, TOG_RESUME_EPOCH, [mask, keep], strategy=OnebitStrategy()
    )
    return dict(
        restored=keep.restored,
        warnings=warned,
        losses=model.losses,
        trace=model.emb_trace,
        final=flat_params(model),
        step_count=trainer.strategy.onebit_optimizer.step_count,
        world_size=trainer.world_size,
        masked=mask.masked_coordinates,
    )


# ---------------------------------------------------------------------------------------- session runner
_SCENARIOS: dict[str, Callable[[int, int, str], dict[str, Any]]] = {
    "mask": scenario_mask,
    "together": scenario_together,
    "refusals": scenario_refusals,
    "ddp_monitor": scenario_ddp_monitor,
    "one_rank_resume": scenario_one_rank_resume,
}


def _pick(*names: str) -> tuple[tuple[str, Callable[[int, int, str], dict[str, Any]]], ...]:
    return tuple((name, _SCENARIOS[name]) for name in names)


@pytest.fixture(scope="module")
def workdir(tmp_path_factory: pytest.TempPathFactory) -> str:
    return str(tmp_path_factory.mktemp("onebit_callbacks"))


@pytest.fixture(scope="module")
def session(workdir: str) -> list[dict[str, Any]]:
    # the refusals run last: a fit that fails at setup must not be able to disturb the others
    return run_distributed(
        run_scenarios, WORLD_SIZE, _pick("mask", "together", "ddp_monitor", "refusals"), workdir, timeout_s=300
    )


@pytest.fixture(scope="module")
def one_rank_session(session: list[dict[str, Any]], workdir: str) -> dict[str, Any]:
    together_ok = all("__error__" not in ranks["together"] for ranks in session)
    if not together_ok or not os.path.exists(together_ckpt(workdir, TOG_RESUME_EPOCH)):
        pytest.fail("the 2-rank 'together' scenario did not write its checkpoints")
    return run_distributed(run_scenarios, 1, _pick("one_rank_resume"), workdir, timeout_s=150)[0]["one_rank_resume"]


def _read_csv(path: str) -> list[dict[str, float]]:
    """The CSV rows that hold the comm/* metrics, by step."""
    with open(path, newline="") as f:
        rows = [r for r in csv.DictReader(f) if r.get("comm/bytes_sent")]
    return [{k: float(v) for k, v in r.items() if v != ""} for r in rows]


# ======================================================================================== constructor checks
def test_constructor_errors() -> None:
    """ErrorFeedbackCheckpoint's default policy is now ``"keep"`` (it was ``"reset"``): keep is the default, with or
    without the callback."""
    with pytest.raises(ValueError, match="masks.*auto"):
        MomentumMask()
    with pytest.raises(ValueError, match="masks.*auto"):
        MomentumMask(masks={})
    with pytest.raises(ValueError, match="'reset', 'keep', 'require'.*'bogus'"):
        ErrorFeedbackCheckpoint("bogus")  # type: ignore[arg-type]
    assert ErrorFeedbackCheckpoint().policy == "keep"
    assert MomentumMask(auto=True).auto


def test_setup_refusals(session: list[dict[str, Any]]) -> None:
    for result in scenario_results(session, "refusals"):
        for name in ("mask_ddp", "keep_ddp"):
            r = result[name]
            assert r["error_type"] == "ValueError", (name, r)
            assert "onebit_adam" in r["message"] and "DDPStrategy" in r["message"], (name, r["message"])
            assert r["steps"] == 0, name  # refused at setup, before any training step
        r = result["wrong_shape"]
        assert r["error_type"] == "ValueError" and r["steps"] == 0, r
        assert "'emb.weight'" in r["message"] and "(10, 8)" in r["message"] and "(20, 8)" in r["message"], r["message"]
        r = result["wrong_shape_callable"]
        assert r["error_type"] == "ValueError" and r["steps"] == 0, r
        assert "'head.weight'" in r["message"] and "(3,)" in r["message"], r["message"]
        r = result["no_match"]
        assert r["error_type"] == "ValueError" and r["steps"] == 0, r
        assert "'encoder.*'" in r["message"] and "matches no parameter" in r["message"], r["message"]


# ======================================================================================== MomentumMask
def test_unused_rows_drift_without_mask_and_stay_put_by_default_or_with_a_mask(session: list[dict[str, Any]]) -> None:
    results = scenario_results(session, "mask")
    for rank, result in enumerate(results):
        for name in ("none", "default", "explicit", "auto"):
            run = result[name]
            assert len(run["trace"]) == MASK_STEPS
            # warmup: a zero gradient gives a zero Adam update, with or without a mask (weight_decay 0)
            for step in range(MASK_FREEZE):
                assert torch.equal(run["trace"][step][USED_ROWS:], run["init"][USED_ROWS:]), (name, step)
        none = result["none"]
        # compression without a mask: +-scale in the momentum over a variance of exactly 0 -> updates of ~lr*scale/eps
        drift = [(t[USED_ROWS:] - none["init"][USED_ROWS:]).abs().max().item() for t in none["trace"][MASK_FREEZE:]]
        assert min(drift) > 1.0, drift
        for name in ("default", "explicit", "auto"):
            run = result[name]
            for t in run["trace"]:
                assert torch.equal(t[USED_ROWS:], run["init"][USED_ROWS:]), name  # bitwise: not moved at all
            assert not torch.equal(run["trace"][-1][:USED_ROWS], run["init"][:USED_ROWS])  # the used rows train
        # the auto mask found exactly the never-used rows; it equals the explicit mask, so both runs are bitwise equal
        assert result["explicit"]["masked"] == {"emb.weight": (VOCAB - USED_ROWS) * DIM}
        assert result["auto"]["masked"] == {"emb.weight": (VOCAB - USED_ROWS) * DIM}
        assert torch.equal(result["explicit"]["final"], result["auto"]["final"])
        assert result["explicit"]["losses"] == result["auto"]["losses"]
        # the optimizer's default masks the same coordinates (found from the frozen variance): the same run
        assert torch.equal(result["explicit"]["final"], result["default"]["final"])
        assert result["explicit"]["losses"] == result["default"]["losses"]
        # counts per parameter in the log
        logs = result["auto"]["logs"]
        assert "MomentumMask: emb.weight: 80 of 160 coordinates masked" in logs, logs
        # Fully used parameters get no mask (an all-ones mask would only cost a multiply per step).
        assert not any("head.weight" in m for m in result["auto"]["logs"]), result["auto"]["logs"]
        if rank == 0:
            assert any("80 momentum coordinates masked" in m for m in result["explicit"]["logs"])
    # replicas stay bit-identical in every run
    for name in ("none", "default", "explicit", "auto"):
        assert torch.equal(results[0][name]["final"], results[1][name]["final"]), name


def test_mask_does_not_change_what_the_model_learns(session: list[dict[str, Any]]) -> None:
    """What the loss comparison can promise: the mask acts only in the compression stage, and only on the masked
    coordinates' momentum, but the 1-bit scale of a tensor is ||x||/sqrt(n) over the whole tensor (masked rows'
    error feedback included), so the used rows see slightly different scales: their trajectory is not bitwise that
    of the unmasked run. The meaningful claims are therefore (1) the warmup is bitwise identical, and (2) the final
    loss (only the used rows enter it) differs from the unmasked run's by a small fraction (5%) of the loss reduction
    that training achieved, i.e. the mask costs no measurable training progress."""
    results = scenario_results(session, "mask")
    for result in results:
        none, masked = result["none"], result["explicit"]
        # losses up to and including the first compressed step's forward are computed before any masked update
        assert none["losses"][: MASK_FREEZE + 1] == masked["losses"][: MASK_FREEZE + 1]
        assert none["losses"][MASK_FREEZE + 1 :] != masked["losses"][MASK_FREEZE + 1 :]  # (the mask did act)
    initial = sum(r["none"]["losses"][0] for r in results) / WORLD_SIZE
    final_none = sum(r["none"]["eval_loss"] for r in results) / WORLD_SIZE
    final_mask = sum(r["explicit"]["eval_loss"] for r in results) / WORLD_SIZE
    progress = initial - final_none
    assert progress > 0.3 * initial, (initial, final_none)  # the model did learn something to compare
    assert abs(final_mask - final_none) < 0.05 * progress, (initial, final_none, final_mask)


def test_auto_mask_is_saved_in_the_checkpoint_and_restored(session: list[dict[str, Any]], workdir: str) -> None:
    results = scenario_results(session, "together")
    ckpt = torch.load(together_ckpt(workdir, TOG_RESUME_EPOCH), weights_only=False)
    saved = ckpt["callbacks"]["MomentumMask"]["auto_masks"]
    expected = unused_rows_mask().to(torch.bool)
    assert torch.equal(saved["emb.weight"], expected)
    assert saved["head.weight"].all() and saved["head.bias"].all()
    for result in results:
        assert result["A"]["masked"] == {"emb.weight": (VOCAB - USED_ROWS) * DIM}
        # the resumed run starts in the compression stage, so it could not re-detect: the mask is the saved one
        resumed = result["B_keep"]
        assert "MomentumMask: emb.weight: 80 of 160 coordinates masked" in resumed["logs"], resumed["logs"]
        init_unused = result["A"]["trace"][0][USED_ROWS:]
        for t in resumed["trace"]:
            assert torch.equal(t[USED_ROWS:], init_unused)


def test_explicit_mask_comes_from_the_code_on_resume(session: list[dict[str, Any]], workdir: str) -> None:
    ckpt = torch.load(together_ckpt(workdir, TOG_RESUME_EPOCH), weights_only=False)
    at_checkpoint = ckpt["state_dict"]["emb.weight"]
    for result in scenario_results(session, "together"):
        run = result["D_explicit"]
        assert run["masked"] == {"emb.weight": (VOCAB - USED_ROWS + 1) * DIM}
        assert len(run["trace"]) == TOG_STEPS - (TOG_RESUME_EPOCH + 1) * TOG_BATCHES
        for t in run["trace"]:
            assert torch.equal(t[0], at_checkpoint[0])  # row 0 is used by the data, but masked by the code
            assert torch.equal(t[USED_ROWS:], at_checkpoint[USED_ROWS:])
        assert not torch.equal(run["trace"][-1][1:USED_ROWS], at_checkpoint[1:USED_ROWS])


def test_auto_mask_statistics_survive_a_warmup_resume(session: list[dict[str, Any]]) -> None:
    """Row 9 had gradients in warmup steps 1..3 (before the epoch-0 checkpoint); the resumed run never sees token 9.
    Detection covers the whole warmup, so row 9 is not masked."""
    for rank, result in enumerate(scenario_results(session, "together")):
        tokens, _ = token_data(rank, TOG_BATCHES * BATCH)
        assert (tokens == USED_ROWS - 1).any()  # the precondition: epoch 0 used row 9 on this rank
        run = result["E_warmup_resume"]
        assert run["steps"] == TOG_STEPS - TOG_BATCHES
        assert run["masked"] is not None and run["masked"]["emb.weight"] == (VOCAB - USED_ROWS) * DIM, run["masked"]


def test_changed_parameter_shape_on_resume_is_a_clear_error(session: list[dict[str, Any]]) -> None:
    for result in scenario_results(session, "together"):
        r = result["F_grown"]
        assert r["error_type"] == "ValueError", r
        assert "'emb.weight'" in r["message"] and "(20, 8)" in r["message"] and "(30, 8)" in r["message"], r["message"]
        assert r["steps"] == 1  # the first compressed step after the resume, before the optimizer used the mask


# ======================================================================================== ErrorFeedbackCheckpoint
def test_keep_resume_is_bitwise_an_uninterrupted_run_and_reset_is_not(session: list[dict[str, Any]]) -> None:
    results = scenario_results(session, "together")
    resumed_from = (TOG_RESUME_EPOCH + 1) * TOG_BATCHES  # optimizer steps in the checkpoint
    assert resumed_from > TOG_FREEZE  # a compression-stage checkpoint with non-zero error feedback
    for result in results:
        a, keep, reset = result["A"], result["B_keep"], result["C_reset"]
        assert a["step_count"] == keep["step_count"] == TOG_STEPS
        assert keep["restored"] is True and reset["restored"] is False
        # the resumed runs saw the same batches from the same parameters: the first resumed loss is A's
        assert keep["losses"] == a["losses"][resumed_from:]
        assert reset["losses"][0] == a["losses"][resumed_from]
        assert torch.equal(keep["final"], a["final"])
        assert not torch.equal(reset["final"], a["final"])
        assert not any(_KEEP_WARNING in w for w in keep["warnings"])
    for name in ("A", "B_keep", "C_reset"):
        assert torch.equal(results[0][name]["final"], results[1][name]["final"]), name


def test_keep_writes_one_sidecar_per_rank_and_removes_them_with_the_checkpoint(
    session: list[dict[str, Any]], workdir: str
) -> None:
    """The norm recorded for the reset log is now in the main checkpoint under the strategy's key
    ``onebit_error_feedback`` (with the policy), no longer in the callback's state, which the callback no longer
    saves: the strategy saves the error feedback."""
    results = scenario_results(session, "together")
    expected = []
    for epoch in range(TOG_EPOCHS):
        path = together_ckpt(workdir, epoch)
        expected += [os.path.basename(path)] + [os.path.basename(sidecar_path(path, r)) for r in range(2)]
    assert results[0]["A"]["files"] == sorted(expected)
    # the rank-0 checkpoint itself carries no per-rank state
    ckpt = torch.load(together_ckpt(workdir, TOG_RESUME_EPOCH), weights_only=False)
    assert "onebit_per_rank" not in ckpt
    sidecars = [torch.load(sidecar_path(together_ckpt(workdir, TOG_RESUME_EPOCH), r)) for r in range(2)]
    for rank, payload in enumerate(sidecars):
        assert payload["rank"] == rank and payload["world_size"] == 2
        assert payload["checkpoint_id"] == ckpt["onebit_sidecars"]["checkpoint_id"]
        assert payload["global_step"] == ckpt["global_step"]
        payload["state"] = torch.load(io.BytesIO(payload["state_bytes"].numpy().tobytes()))  # format 3: a uint8 tensor
        (bucket,) = payload["state"]["error_feedback"]["buckets"].values()
        assert bucket["worker_error"].abs().sum() > 0  # two compressed steps were taken: real error feedback
    w0 = sidecars[0]["state"]["error_feedback"]["buckets"]
    w1 = sidecars[1]["state"]["error_feedback"]["buckets"]
    assert not torch.equal(next(iter(w0.values()))["worker_error"], next(iter(w1.values()))["worker_error"])
    # the norm recorded for the reset log is rank 0's at that save
    norm = math.sqrt(
        sum(float(b["worker_error"].square().sum() + b["server_error"].square().sum()) for b in w0.values())
    )
    assert ckpt["onebit_error_feedback"]["error_norm_rank0"] == pytest.approx(norm, rel=1e-6)
    assert ckpt["onebit_error_feedback"]["policy"] == "keep" and "ErrorFeedbackCheckpoint" not in ckpt["callbacks"]
    assert norm > 0
    assert any(f"reset (rank 0 norm at save: {norm:.4g})" in m for m in results[0]["C_reset"]["logs"])
    # ModelCheckpoint(save_top_k=1) removed the older checkpoints and, on every rank, their sidecars
    final_epoch = os.path.join(workdir, "latest_ckpt", f"epoch={TOG_EPOCHS - 1}.ckpt")
    kept = (final_epoch, sidecar_path(final_epoch, 0), sidecar_path(final_epoch, 1))
    assert results[0]["B_keep"]["latest_files"] == sorted(os.path.basename(p) for p in kept)


def test_keep_with_a_different_world_size_warns_and_trains_on(one_rank_session: dict[str, Any], workdir: str) -> None:
    r = one_rank_session
    if "__error__" in r:
        pytest.fail(r["__error__"])
    assert r["world_size"] == 1
    assert r["restored"] is False
    (warning,) = [w for w in r["warnings"] if _KEEP_WARNING in w]
    assert "world size" in warning and re.search(r"\b2\b", warning) and re.search(r"\b1\b", warning), warning
    resumed_from = (TOG_RESUME_EPOCH + 1) * TOG_BATCHES
    assert r["step_count"] == TOG_STEPS and len(r["losses"]) == TOG_STEPS - resumed_from
    assert all(math.isfinite(x) for x in r["losses"]) and torch.isfinite(r["final"]).all()
    # it kept training from the checkpoint (the auto mask, restored from the callback state, still holds)
    at_checkpoint = torch.load(together_ckpt(workdir, TOG_RESUME_EPOCH), weights_only=False)["state_dict"]["emb.weight"]
    assert r["masked"]["emb.weight"] == (VOCAB - USED_ROWS) * DIM
    assert torch.equal(r["trace"][-1][USED_ROWS:], at_checkpoint[USED_ROWS:])
    assert not torch.equal(r["trace"][-1][:USED_ROWS], at_checkpoint[:USED_ROWS])


# ======================================================================================== CommunicationMonitor
def test_logged_bytes_match_the_analytic_formula_in_both_stages(session: list[dict[str, Any]]) -> None:
    results = scenario_results(session, "together")
    a0 = results[0]["A"]
    # warmup: DDP's fp32 ring allreduce of its gradient buckets; this model fits one bucket holding every parameter
    ddp_buckets = [int(b) for b in re.findall(r"\d+", str(a0["ddp_bucket_sizes"]))]  # DDP reports "676" or "a, b"
    assert ddp_buckets == [N_PARAMS * 4], a0["ddp_bucket_sizes"]  # bytes
    warmup_bytes = sum(ring_allreduce_bytes(b // 4, 4, WORLD_SIZE) for b in ddp_buckets)
    # compression: one 1-bit compressed allreduce per momentum bucket; with the overlapped exchange (the strategy's
    # default) the momenta are laid out like DDP's gradient bucket: reverse parameter order
    layout = BucketLayout.build([1, DIM, VOCAB * DIM], WORLD_SIZE)
    expected_layout = ((1, DIM, VOCAB * DIM), WORLD_SIZE, layout.bytes_per_call())
    assert [r["A"]["layouts"] for r in results] == [[expected_layout]] * WORLD_SIZE
    compressed_bytes = layout.bytes_per_call()
    fp32 = ring_allreduce_bytes(N_PARAMS, 4, WORLD_SIZE)
    assert (warmup_bytes, compressed_bytes, fp32) == (676, 46, 676)  # the numbers, for the record

    rows = _read_csv(a0["csv"])
    assert [int(r["step"]) for r in rows] == list(range(TOG_STEPS))
    total = 0.0
    for i, row in enumerate(rows):
        compressed = i >= TOG_FREEZE
        expected = compressed_bytes if compressed else warmup_bytes
        assert row["comm/stage"] == (1.0 if compressed else 0.0), (i, row)
        assert row["comm/bytes_sent"] == expected, (i, row)
        assert row["comm/bytes_received"] == expected, (i, row)
        assert row["comm/bytes_fp32_equivalent"] == fp32, (i, row)
        assert row["comm/compression_ratio"] == pytest.approx(fp32 / expected), (i, row)
        total += expected
        assert row["comm/bytes_sent_total"] == total, (i, row)
        assert 0.0 < row["comm/time_ms"] < 10_000.0, (i, row)
        # the exchange time not hidden behind backward: in warmup from the last gradient bucket's allreduce launch to
        # its completion, in the compression stage inside step; from the second compressed step on the overlapped
        # hook started the exchange during backward
        assert 0.0 < row["comm/exposed_ms"] < 10_000.0, (i, row)
        assert (row["comm/hook_ms"] > 0.0) is (i > TOG_FREEZE), (i, row)
    # the monitor's totals are the strategy's counters, the same on both ranks
    for result in results:
        assert result["A"]["communication"].bytes_sent == total
        assert result["A"]["communication"].bytes_received == total
    # stage and ratio in the progress bar under short names, the full names in the logger only; prog_bar=False keeps
    # them out
    bar = a0["progress_bar"]
    assert bar["stage"] == 1.0 and bar["1bit_x"] == pytest.approx(fp32 / compressed_bytes)
    assert not any(k.startswith("comm/") for k in bar) and len(max(bar, key=len)) <= 8
    assert not {"stage", "1bit_x"} & set(results[0]["C_reset"]["progress_bar"])


def test_ddp_baseline_bytes_are_the_ring_allreduce_formula_times_the_steps(session: list[dict[str, Any]]) -> None:
    """strategy='ddp': the monitor's counting hook gives, per step, the fp32 ring allreduce of the model's gradients
    (one DDP bucket here), logged under the warmup's metric names; nothing about the compression stage."""
    results = scenario_results(session, "ddp_monitor")
    counted = results[0]["counted"]
    numel = counted["gradient_numel"]
    assert [int(b) for b in re.findall(r"\d+", str(counted["ddp_bucket_sizes"]))] == [numel * 4]  # one bucket
    per_step = ring_allreduce_bytes(numel, 4, WORLD_SIZE)
    assert per_step == 260  # 65 parameters, for the record
    for result in results:
        r = result["counted"]
        assert r["steps"] == DDP_STEPS and not any("comm hook" in w for w in r["warnings"]), r["warnings"]
        c = r["communication"]
        assert c.bytes_sent == c.bytes_received == c.bytes_fp32_equivalent == per_step * DDP_STEPS, c
        # both ranks on one node: a ring allreduce sends to a rank of the same node
        assert (c.bytes_sent_intra_node, c.bytes_sent_inter_node) == (per_step * DDP_STEPS, 0), c
        assert c.collectives == c.calls == DDP_STEPS and c.time_s > 0, c
    rows = _read_csv(counted["csv"])
    assert [int(r["step"]) for r in rows] == list(range(DDP_STEPS))
    for i, row in enumerate(rows):
        assert row["comm/bytes_sent"] == row["comm/bytes_fp32_equivalent"] == per_step, (i, row)
        assert row["comm/bytes_sent_intra_node"] == per_step and row["comm/bytes_sent_inter_node"] == 0, (i, row)
        assert row["comm/bytes_sent_total"] == per_step * (i + 1), (i, row)
        assert row["comm/compression_ratio"] == 1.0 and 0.0 < row["comm/time_ms"] < 10_000.0, (i, row)
        assert not {"comm/stage", "comm/hook_ms", "comm/bytes_sent_uncompressed"} & set(row), (i, row)
    assert not {"stage", "1bit_x", "freeze"} & set(counted["progress_bar"])


def test_ddp_with_a_comm_hook_of_its_own_warns_once_and_counts_nothing(session: list[dict[str, Any]]) -> None:
    for rank, result in enumerate(scenario_results(session, "ddp_monitor")):
        r = result["foreign"]
        assert r["steps"] == DDP_STEPS and r["communication"] is None, r  # trained; nothing counted
        warned = [w for w in r["warnings"] if "already has a communication hook" in w]
        assert len(warned) == (1 if rank == 0 else 0), r["warnings"]  # once over two fits, on rank 0


def test_monitor_refuses_a_strategy_other_than_onebit_or_ddp() -> None:
    trainer = pl.Trainer(accelerator="cpu", devices=1, logger=False, enable_progress_bar=False)
    with pytest.raises(ValueError, match=r"'onebit_adam', 'onebit_fsdp', 'onebit_diloco' or 'onebit_diloco_fsdp' .* or plain DDP .* "
                       r"SingleDeviceStrategy"):
        CommunicationMonitor().setup(trainer, TokenRegressor(), "fit")


def test_momentum_mask_reports_and_warns_about_heavily_masked_parameters(caplog: pytest.LogCaptureFixture) -> None:
    """An embedding whose rows 3.. no warmup batch looked up: the table names it, and the warning its share, cause
    and remedies; a head masked below the share is reported but not warned about."""
    import logging

    class Model(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.emb = torch.nn.Embedding(100, 4)
            self.head = torch.nn.Linear(4, 1)

    model = Model()
    opt = OnebitAdam(model.parameters(), lr=1e-3, freeze_step=1)
    seen_rows = torch.zeros(100, 4, dtype=torch.bool)
    seen_rows[:3] = True
    head_seen = torch.ones(1, 4, dtype=torch.bool)
    callback = MomentumMask(auto=True)
    callback._seen_nonzero = {"emb.weight": seen_rows, "head.weight": head_seen,
                              "head.bias": torch.ones(1, dtype=torch.bool)}
    with caplog.at_level(logging.INFO), pytest.warns(UserWarning, match=r"emb\.weight 97\.0% \(388 of 400\)") as caught:
        callback._install(opt, model)
    message = str(caught[0].message)
    assert "rows no warmup batch looked up" in message and "head" not in message  # the parameter and the cause
    # the remedy, and the page with the others (a later freeze, explicit masks, ZeroOneAdam, warn_share)
    assert '"compress": False' in message and message.endswith("see docs/guides/freeze-step.md#embedding-tables")
    assert callback.masked_coordinates == {"emb.weight": 388}
    assert "emb.weight: 388 of 400 (97.0%)" in caplog.text
    quiet = MomentumMask(auto=True, warn_share=1.0)
    quiet._seen_nonzero = dict(callback._seen_nonzero, **{"emb.weight": seen_rows})
    import warnings

    with warnings.catch_warnings():
        warnings.simplefilter("error")
        quiet._install(OnebitAdam(model.parameters(), lr=1e-3, freeze_step=1), model)
    with pytest.raises(ValueError, match="warn_share"):
        MomentumMask(auto=True, warn_share=2)


def test_keep_warning_names_every_failing_rank_and_file_once_per_reason() -> None:
    """A node without its sidecars: one reason for its ranks, not the same sentence once per rank (the warning stays
    short); each rank and its file is still named. (The text is the strategy's now: the mechanics moved down from the
    callback to :mod:`lightning_onebit.strategy.error_feedback`.)"""
    from lightning_onebit.strategy.error_feedback import failures_text as _failures_text

    missing, corrupt = "the file does not exist", "the file is corrupt"
    text = _failures_text([(1, "a.onebit-rank1", missing), (2, "a.onebit-rank2", corrupt), (3, "a.onebit-rank3", missing)])
    assert text == ("rank 1 (a.onebit-rank1), rank 3 (a.onebit-rank3): the file does not exist; "
                    "rank 2 (a.onebit-rank2): the file is corrupt")


@pytest.mark.parametrize(
    "kwargs, message",
    [
        (dict(auto="yes"), "MomentumMask auto must be True or False, got 'yes' (str)"),
        (dict(auto=1), "MomentumMask auto must be True or False, got 1"),
        (dict(masks=[torch.ones(2)]), "MomentumMask masks must be a dict {parameter name or glob: mask tensor, or "
                                      "callable(parameter) -> mask tensor}, e.g. {'emb.weight': mask}; got a list"),
        (dict(masks={"emb.weight": 3}), "MomentumMask masks must be a dict {parameter name or glob: mask tensor, or "
                                        "callable(parameter) -> mask tensor}, e.g. {'emb.weight': mask}; got the entry "
                                        "'emb.weight': int"),
        (dict(masks={0: torch.ones(2)}), "got the entry 0: Tensor"),
        (dict(auto=True, log_level="INFO"), "MomentumMask log_level must be a logging level, an int, got 'INFO' (str); "
                                            "e.g. logging.INFO (20)"),
        (dict(auto=True, log_level=None), "MomentumMask log_level must be a logging level, an int, got None"),
        (dict(auto=True, warn_share=float("nan")),
         "MomentumMask warn_share must be a finite number in [0, 1], got nan"),
    ],
)
def test_momentum_mask_arguments_are_checked_at_construction(kwargs: dict[str, Any], message: str) -> None:
    """Used to: ``auto="yes"`` and ``auto=1`` were read as truth values; ``masks=[...]`` gave a bare "dictionary update
    sequence" error; a mask that is no tensor or callable (``{"emb.weight": 3}``) or a key that is no name was taken
    and refused only at setup; ``log_level="INFO"`` was taken and raised ``TypeError: level must be an integer`` in
    ``logging`` at the first compressed step, with the masks half installed. Now a ``ValueError`` at construction."""
    with pytest.raises(ValueError, match=re.escape(message)):
        MomentumMask(**kwargs)
