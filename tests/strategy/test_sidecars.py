"""Per-rank checkpoint files that cannot lie (issue 12, findings 1-5), on 2 gloo ranks, and the error feedback kept
across checkpoints by default (the strategy's ``error_feedback``, no callback needed).

One training run writes a checkpoint with per-rank sidecars every epoch (``ModelCheckpoint(save_last="link")``; the
run has no callback since the strategy keeps the error feedback by default: it used to need
``ErrorFeedbackCheckpoint("keep")``). Each scenario copies its checkpoint directory, damages it the way a user or a
failing disk would, and resumes. What used to happen is in each test's docstring; the new behaviour: every rank
validates its own file, the ranks agree, and either every rank restores (and says so) or every rank resets (and the
warning names the rank, the file and the reason), or under ``policy="require"`` every rank raises at once. The same
checkpoints resumed without the callback: the strategy's default restores, ``OnebitStrategy(error_feedback="reset")``
resets, ``"require"`` raises, and a callback overrides the strategy's argument; a checkpoint written before the
strategy kept the error feedback still loads.
"""

from __future__ import annotations

import os
import re
import shutil
import time
from typing import Any, Optional

import pytest
import torch
import torch.distributed as dist

import lightning.pytorch as pl
from lightning.pytorch.callbacks import ModelCheckpoint
from lightning_onebit import ErrorFeedbackCheckpoint, OnebitAdam, OnebitStrategy
from lightning_onebit.strategy.checkpoint import NO_PER_RANK_FILES, PER_RANK_STATUS_KEY
from lightning_onebit.strategy.error_feedback import ERROR_FEEDBACK_KEY, ErrorFeedbackKeeper
from lightning_onebit.strategy.sidecar import SIDECAR_RECORD_KEY, read_sidecar, sidecar_path, write_sidecar
from tests.callback_models import TokenRegressor, token_loader
from tests.capture import capture_logs, capture_warnings
from tests.distributed import run_distributed, run_scenarios, scenario_results
from tests.lightning_models import flat_params, trainer_kwargs

WORLD_SIZE = 2
FREEZE, BATCHES, EPOCHS, RESUME_EPOCH = 4, 3, 4, 1  # the epoch-1 checkpoint is after 2 compressed steps
_RESET = "ErrorFeedbackCheckpoint(policy='keep'): error feedback reset on every rank because"
_STRATEGY_RESET = "OnebitStrategy(error_feedback='keep'): error feedback reset on every rank because"


def _base_dir(workdir: str) -> str:
    return os.path.join(workdir, "base")


def _ckpt(directory: str, epoch: int) -> str:
    return os.path.join(directory, f"epoch={epoch}.ckpt")


def _damage(workdir: str, name: str, how) -> str:
    """Rank 0 copies the base checkpoints to ``workdir/name`` and damages them; every rank waits for it."""
    directory = os.path.join(workdir, name)
    if dist.get_rank() == 0:
        shutil.copytree(_base_dir(workdir), directory, symlinks=True)
        how(directory)
    dist.barrier()
    return directory


def _resume(rank: int, path: str, policy: Optional[str] = "keep", max_epochs: int = EPOCHS,
            strategy: Optional[OnebitStrategy] = None) -> dict[str, Any]:
    """Resume from ``path`` with ``ErrorFeedbackCheckpoint(policy)`` (``policy=None``: no callback) and ``strategy``
    (``None``: ``"onebit_adam"`` with its defaults)."""
    model = TokenRegressor(freeze_step=FREEZE, seed=1000)  # another init: the weights must come from the checkpoint
    callbacks = [] if policy is None else [ErrorFeedbackCheckpoint(policy)]
    trainer = pl.Trainer(**trainer_kwargs(WORLD_SIZE, -1, max_epochs=max_epochs, callbacks=callbacks,
                                          strategy=strategy or "onebit_adam"))
    started = time.perf_counter()
    error = None
    with capture_logs() as logs, capture_warnings() as warned:
        try:
            trainer.fit(model, token_loader(rank, BATCHES), ckpt_path=path)
        except RuntimeError as err:
            error = str(err)
    restored = trainer.strategy.error_feedback_restored
    assert not callbacks or callbacks[0].restored is restored  # the callback reads the strategy's
    return dict(
        restored=restored, final=flat_params(model), losses=model.losses, logs=logs, warnings=warned,
        error=error, seconds=time.perf_counter() - started,
    )


def scenario_sidecars(rank: int, world_size: int, workdir: str) -> dict[str, Any]:
    out: dict[str, Any] = {}
    # ---- the uninterrupted run, a checkpoint with sidecars at every epoch end, last.ckpt a link to the newest
    model = TokenRegressor(freeze_step=FREEZE)
    checkpoint = ModelCheckpoint(
        dirpath=_base_dir(workdir), filename="{epoch}", every_n_epochs=1, save_top_k=-1, save_last="link"
    )
    trainer = pl.Trainer(
        **trainer_kwargs(world_size, -1, max_epochs=EPOCHS, callbacks=[checkpoint], enable_checkpointing=True)
    )
    trainer.fit(model, token_loader(rank, BATCHES))
    out["uninterrupted"] = dict(final=flat_params(model), losses=model.losses)
    dist.barrier()
    out["files"] = sorted(os.listdir(_base_dir(workdir)))
    out["last_is_link"] = os.path.islink(os.path.join(_base_dir(workdir), "last.ckpt"))

    base = _ckpt(_base_dir(workdir), RESUME_EPOCH)
    out["saved"] = torch.load(base, weights_only=False)[ERROR_FEEDBACK_KEY]
    out["intact"] = _resume(rank, base)
    out["require_intact"] = _resume(rank, base, policy="require")
    # ---- no callback: the strategy's default keeps; its argument "reset" resets; a callback overrides the argument
    out["default"] = _resume(rank, base, policy=None)
    out["strategy_reset"] = _resume(rank, base, policy=None, strategy=OnebitStrategy(error_feedback="reset"))
    out["override"] = _resume(rank, base, policy="keep", strategy=OnebitStrategy(error_feedback="reset"))

    def delete_rank1(d: str) -> None:
        os.remove(sidecar_path(_ckpt(d, RESUME_EPOCH), 1))

    def random_rank1(d: str) -> None:
        with open(sidecar_path(_ckpt(d, RESUME_EPOCH), 1), "wb") as f:
            f.write(os.urandom(4096))

    def truncate_rank1(d: str) -> None:
        path = sidecar_path(_ckpt(d, RESUME_EPOCH), 1)
        size = os.path.getsize(path)
        with open(path, "r+b") as f:
            f.truncate(size // 2)

    def flip_payload_rank0(d: str) -> None:  # a readable file whose state bytes were altered (bit rot)
        path = sidecar_path(_ckpt(d, RESUME_EPOCH), 0)
        payload = torch.load(path)
        data = payload["state_bytes"]
        data[len(data) // 2] ^= 0xFF
        torch.save(payload, path)

    def stale(d: str) -> None:  # the files of a later checkpoint of the same run under this checkpoint's names
        for r in range(WORLD_SIZE):
            shutil.copyfile(sidecar_path(_ckpt(d, RESUME_EPOCH + 1), r), sidecar_path(_ckpt(d, RESUME_EPOCH), r))

    def swap(d: str) -> None:
        a, b = (sidecar_path(_ckpt(d, RESUME_EPOCH), r) for r in range(2))
        os.rename(a, a + ".tmp-swap")
        os.rename(b, a)
        os.rename(a + ".tmp-swap", b)

    for name, how in (
        ("deleted", delete_rank1), ("random", random_rank1), ("truncated", truncate_rank1),
        ("bitrot", flip_payload_rank0), ("stale", stale), ("swapped", swap),
    ):
        out[name] = _resume(rank, _ckpt(_damage(workdir, name, how), RESUME_EPOCH))
        out[f"require_{name}"] = _resume(rank, _ckpt(os.path.join(workdir, name), RESUME_EPOCH), policy="require")
    # the strategy's own messages, without the callback: a missing sidecar under the default, and under "require"
    deleted = _ckpt(os.path.join(workdir, "deleted"), RESUME_EPOCH)
    out["default_deleted"] = _resume(rank, deleted, policy=None)
    out["strategy_require_deleted"] = _resume(rank, deleted, policy=None,
                                              strategy=OnebitStrategy(error_feedback="require"))

    def written_before_the_strategy_kept_it(d: str) -> None:  # the old default: reset, no sidecars, nothing recorded
        path = _ckpt(d, RESUME_EPOCH)
        checkpoint = torch.load(path, weights_only=False)
        del checkpoint[ERROR_FEEDBACK_KEY], checkpoint[SIDECAR_RECORD_KEY]
        torch.save(checkpoint, path)
        for r in range(WORLD_SIZE):
            os.remove(sidecar_path(path, r))

    legacy = _ckpt(_damage(workdir, "legacy", written_before_the_strategy_kept_it), RESUME_EPOCH)
    out["legacy"] = _resume(rank, legacy, policy=None)

    # ---- last.ckpt is a link to epoch=3.ckpt: resuming through it restores the target's sidecars
    out["via_link"] = _resume(rank, os.path.join(_base_dir(workdir), "last.ckpt"), max_epochs=EPOCHS + 1)
    out["via_target"] = _resume(rank, _ckpt(_base_dir(workdir), EPOCHS - 1), max_epochs=EPOCHS + 1)
    return out


@pytest.fixture(scope="module")
def session(tmp_path_factory: pytest.TempPathFactory) -> list[dict[str, Any]]:
    workdir = str(tmp_path_factory.mktemp("onebit_sidecars"))
    return run_distributed(run_scenarios, WORLD_SIZE, (("sidecars", scenario_sidecars),), workdir, timeout_s=420)


@pytest.fixture(scope="module")
def ranks(session: list[dict[str, Any]]) -> list[dict[str, Any]]:
    return scenario_results(session, "sidecars")


def _sidecar_name(epoch: int, rank: int) -> str:
    return os.path.basename(sidecar_path(f"epoch={epoch}.ckpt", rank))


def test_intact_sidecars_restore_on_every_rank_and_say_so(ranks: list[dict[str, Any]]) -> None:
    resumed_from = (RESUME_EPOCH + 1) * BATCHES
    for policy in ("intact", "require_intact"):
        for rank, r in enumerate(ranks):
            assert r[policy]["restored"] is True and r[policy]["error"] is None, r[policy]
            # bitwise the uninterrupted run
            assert torch.equal(r[policy]["final"], r["uninterrupted"]["final"])
            assert r[policy]["losses"] == r["uninterrupted"]["losses"][resumed_from:]
            assert not any(_RESET in w for w in r[policy]["warnings"])
        assert any("restored on every rank (2 ranks)" in m for m in ranks[0][policy]["logs"]), ranks[0][policy]["logs"]


def test_every_epoch_keeps_its_sidecars_and_writes_leave_no_temporary_files(ranks: list[dict[str, Any]]) -> None:
    """Moving the last.ckpt link every epoch removes the old link; before, that removal would also have removed
    the sidecars of the file the link pointed to (its path resolves to the target's)."""
    expected = ["last.ckpt"]
    for epoch in range(EPOCHS):
        expected += [f"epoch={epoch}.ckpt"] + [_sidecar_name(epoch, r) for r in range(WORLD_SIZE)]
    assert ranks[0]["files"] == sorted(expected)
    assert ranks[0]["last_is_link"]


@pytest.mark.parametrize(
    "name, bad_rank, why",
    [
        # 1. used to: rank 0 logged "restored on every rank" while rank 1 silently reset (its warning was rank-zero)
        ("deleted", 1, "the file does not exist"),
        # 2. used to: rank 1 died with a raw unpickling / zip error naming no file, rank 0 with "Connection closed"
        ("random", 1, "the file is unreadable"),
        ("truncated", 1, "the file is unreadable"),
        ("bitrot", 0, "the file is corrupt (its checksum does not match its contents)"),
        # 3. used to: loaded silently as "restored" (a sidecar carried no identity of its checkpoint)
        ("stale", 0, "the file belongs to another checkpoint (written at step 9"),
        # 4. used to: warned "no per-rank file for rank 0" while the real reason was logged at info level
        ("swapped", 0, "the file was written by rank 1 of 2, this is rank 0 of 2"),
    ],
)
def test_a_bad_sidecar_resets_every_rank_with_the_rank_file_and_reason(
    ranks: list[dict[str, Any]], name: str, bad_rank: int, why: str
) -> None:
    for r in ranks:
        run = r[name]
        assert run["error"] is None and run["restored"] is False, run
        assert len(run["losses"]) == (EPOCHS - RESUME_EPOCH - 1) * BATCHES  # trained on
        assert all(torch.isfinite(torch.tensor(run["losses"])))
    (warning,) = [w for w in ranks[0][name]["warnings"] if _RESET in w]
    assert f"rank {bad_rank} (" in warning and _sidecar_name(RESUME_EPOCH, bad_rank) in warning, warning
    assert why in warning, warning
    # the replicas still agree after the reset
    assert torch.equal(ranks[0][name]["final"], ranks[1][name]["final"])


@pytest.mark.parametrize("name", ["deleted", "random", "truncated", "bitrot", "stale", "swapped"])
def test_require_raises_on_every_rank_naming_the_file(ranks: list[dict[str, Any]], name: str) -> None:
    for r in ranks:
        run = r[f"require_{name}"]
        assert run["error"] is not None, run
        assert run["error"].startswith("ErrorFeedbackCheckpoint(policy='require'): compression error feedback cannot")
        assert ".onebit-rank" in run["error"] and f"epoch={RESUME_EPOCH}.ckpt" in run["error"]
        assert run["losses"] == []  # before any training step
        assert run["seconds"] < 60


def test_a_checkpoint_reached_through_a_link_finds_its_targets_sidecars(ranks: list[dict[str, Any]]) -> None:
    """5. used to: looked for ``last.ckpt.onebit-rank<r>`` next to the link, found nothing, and reset."""
    for r in ranks:
        assert r["via_link"]["restored"] is True, r["via_link"]["warnings"]
        assert torch.equal(r["via_link"]["final"], r["via_target"]["final"])
        assert r["via_link"]["losses"] == r["via_target"]["losses"]


# ------------------------------------------------------------------------------------- kept by default, no callback
def test_without_any_callback_the_strategy_keeps_the_error_feedback_and_resumes_bitwise(
    ranks: list[dict[str, Any]],
) -> None:
    """The run that saved had no callback and neither has the resume: every rank restores its error feedback and the
    resumed run is bitwise the uninterrupted one (it used to reset: ``ErrorFeedbackCheckpoint("keep")`` was needed)."""
    resumed_from = (RESUME_EPOCH + 1) * BATCHES
    assert resumed_from > FREEZE  # a compression-stage checkpoint
    assert ranks[0]["saved"]["policy"] == "keep" and ranks[0]["saved"]["error_norm_rank0"] > 0
    for r in ranks:
        run = r["default"]
        assert run["restored"] is True and run["error"] is None, run
        assert torch.equal(run["final"], r["uninterrupted"]["final"])
        assert run["losses"] == r["uninterrupted"]["losses"][resumed_from:]
        assert not any("error feedback reset" in w for w in run["warnings"]), run["warnings"]
    logs = ranks[0]["default"]["logs"]
    assert "onebit_adam: compression error feedback restored on every rank (2 ranks)" in logs, logs
    # the stage began at step FREEZE + 1, not at the resumed run's first step (which the log used to name)
    began = [m for m in logs if "compression stage from" in m]
    assert len(began) == 1 and began[0].startswith(
        f"onebit_adam: compression stage from optimizer step {FREEZE + 1} (this run continues it from step "
        f"{resumed_from + 1}):"), began


def test_the_strategy_argument_reset_resets_every_rank_and_logs_the_dropped_norm(ranks: list[dict[str, Any]]) -> None:
    resumed_from = (RESUME_EPOCH + 1) * BATCHES
    for r in ranks:
        run = r["strategy_reset"]
        assert run["restored"] is False and run["error"] is None, run
        assert len(run["losses"]) == (EPOCHS - RESUME_EPOCH - 1) * BATCHES
        assert run["losses"][0] == r["uninterrupted"]["losses"][resumed_from]  # the same weights and batch
        assert not torch.equal(run["final"], r["uninterrupted"]["final"])  # but not the same run
        assert not any("error feedback reset on every rank" in w for w in run["warnings"]), run["warnings"]
    assert torch.equal(ranks[0]["strategy_reset"]["final"], ranks[1]["strategy_reset"]["final"])
    norm = ranks[0]["saved"]["error_norm_rank0"]
    logs = ranks[0]["strategy_reset"]["logs"]
    assert f"onebit_adam: compression error feedback reset (rank 0 norm at save: {norm:.4g})" in logs, logs


def test_the_callback_overrides_the_strategy_argument_and_says_so(ranks: list[dict[str, Any]]) -> None:
    """``OnebitStrategy(error_feedback="reset")`` with ``ErrorFeedbackCheckpoint("keep")``: the callback wins."""
    for r in ranks:
        run = r["override"]
        assert run["restored"] is True and torch.equal(run["final"], r["uninterrupted"]["final"]), run
    logs = ranks[0]["override"]["logs"]
    assert ("onebit_adam: ErrorFeedbackCheckpoint(policy='keep') overrides the strategy's error_feedback='reset': "
            "compression error feedback is handled with 'keep'") in logs, logs
    assert "ErrorFeedbackCheckpoint: compression error feedback restored on every rank (2 ranks)" in logs, logs


def test_without_the_callback_the_strategy_names_itself_in_the_warning_and_the_error(
    ranks: list[dict[str, Any]],
) -> None:
    for r in ranks:
        run = r["default_deleted"]
        assert run["error"] is None and run["restored"] is False, run
        error = r["strategy_require_deleted"]["error"]
        assert error is not None and error.startswith(
            "OnebitStrategy(error_feedback='require'): compression error feedback cannot be restored: rank 1 ("
        ), error
        assert "the file does not exist" in error and "use error_feedback='keep' to reset instead" in error, error
        assert r["strategy_require_deleted"]["losses"] == []  # before any training step
    (warning,) = [w for w in ranks[0]["default_deleted"]["warnings"] if _STRATEGY_RESET in w]
    assert "rank 1 (" in warning and "the file does not exist" in warning, warning


def test_a_checkpoint_written_before_the_strategy_kept_the_error_feedback_resumes_and_resets(
    ranks: list[dict[str, Any]],
) -> None:
    """No ``onebit_error_feedback`` record, no sidecars (the old default): every rank resets, says why, and the dropped
    norm is unknown."""
    for r in ranks:
        run = r["legacy"]
        assert run["error"] is None and run["restored"] is False, run
        assert len(run["losses"]) == (EPOCHS - RESUME_EPOCH - 1) * BATCHES
    (warning,) = [w for w in ranks[0]["legacy"]["warnings"] if _STRATEGY_RESET in w]
    assert "rank 0 (" in warning and "rank 1 (" in warning, warning
    assert f"{NO_PER_RANK_FILES} (it was saved before error feedback was kept by default" in warning, warning
    logs = ranks[0]["legacy"]["logs"]
    assert "onebit_adam: compression error feedback reset (rank 0 norm at save: unknown)" in logs, logs


# ------------------------------------------------------------------------------------- without ranks or Lightning
def test_a_sidecar_costs_the_bytes_of_its_tensors(tmp_path: Any) -> None:
    """Before: the state's serialised bytes were stored as a ``bytes`` object, which ``torch.save``'s pickle
    protocol 2 writes as text (each byte above 0x7f takes two): 15.2 MB of file for 10.2 MB of error feedback."""
    g = torch.Generator().manual_seed(0)
    state = {"buckets": {k: {"worker_error": torch.randn(400_000, generator=g),
                             "server_error": torch.randn(100_000, generator=g)} for k in range(5)}}
    tensor_bytes = sum(t.numel() * t.element_size() for b in state["buckets"].values() for t in b.values())
    assert tensor_bytes == 10_000_000
    path = str(tmp_path / "a.ckpt.onebit-rank0")
    meta = {"checkpoint_id": "run/1", "rank": 0, "world_size": 1}
    write_sidecar(path, meta, state)
    assert os.path.getsize(path) < tensor_bytes * 1.01, os.path.getsize(path) / tensor_bytes
    loaded, reason = read_sidecar(path, meta)
    assert reason is None and all(torch.equal(loaded["buckets"][k][n], state["buckets"][k][n])
                                  for k in range(5) for n in ("worker_error", "server_error"))


def test_a_sidecar_of_the_previous_format_still_loads(tmp_path: Any) -> None:
    """Format 2 (the state's bytes as a ``bytes`` object) is read as before; damaged, it is still refused."""
    import hashlib
    import io

    state = {"v": torch.arange(6.0)}
    buffer = io.BytesIO()
    torch.save(state, buffer)
    data = buffer.getvalue()
    meta = {"checkpoint_id": "run/1", "rank": 0, "world_size": 1}
    path = str(tmp_path / "old.ckpt.onebit-rank0")
    torch.save(dict(meta, format=2, sha256=hashlib.sha256(data).hexdigest(), state_bytes=data), path)
    loaded, reason = read_sidecar(path, meta)
    assert reason is None and torch.equal(loaded["v"], state["v"])
    torch.save(dict(meta, format=2, sha256=hashlib.sha256(data).hexdigest(), state_bytes=data[:-1] + b"x"), path)
    assert read_sidecar(path, meta) == (None, "the file is corrupt (its checksum does not match its contents)")


def _keeper(policy: str) -> tuple[ErrorFeedbackKeeper, OnebitAdam]:
    net = torch.nn.Linear(4, 2)
    return ErrorFeedbackKeeper(policy, "onebit_adam", "OnebitStrategy"), OnebitAdam(net.parameters(), freeze_step=1)


@pytest.mark.parametrize(
    "old_callback_state, norm",
    [(None, "unknown"), ({"policy": "keep", "error_norm_rank0": 0.25, "world_size": 2}, "0.25")],
)
def test_an_old_checkpoint_reports_the_norm_its_callback_state_holds_or_unknown(
    old_callback_state: Optional[dict[str, Any]], norm: str
) -> None:
    """A checkpoint without ``onebit_error_feedback``: the norm comes from ``ErrorFeedbackCheckpoint``'s old state
    under ``checkpoint["callbacks"]`` if there is one, else it is unknown; the callback accepts its old state."""
    keeper, optimizer = _keeper("reset")
    checkpoint: dict[str, Any] = {PER_RANK_STATUS_KEY: {"file": "a.ckpt.onebit-rank0", "reason": NO_PER_RANK_FILES}}
    if old_callback_state is not None:
        checkpoint["callbacks"] = {"ErrorFeedbackCheckpoint": old_callback_state}
        ErrorFeedbackCheckpoint().load_state_dict(old_callback_state)
    keeper.load(checkpoint)
    with capture_logs() as logs:
        keeper.on_train_start(optimizer, 0)
    assert keeper.restored is False
    assert f"onebit_adam: compression error feedback reset (rank 0 norm at save: {norm})" in logs, logs


def test_a_checkpoint_loaded_by_validate_is_not_restored_by_a_later_fit() -> None:
    """``teardown`` (after every run) forgets a loaded checkpoint that no training start used."""
    keeper, optimizer = _keeper("keep")
    keeper.load({PER_RANK_STATUS_KEY: {"file": "a.ckpt.onebit-rank0", "reason": NO_PER_RANK_FILES}})
    keeper.end_run()
    keeper.on_train_start(optimizer, 0)
    assert keeper.restored is None


@pytest.mark.parametrize("value", ["bogus", "Keep", None, True])
def test_a_bad_error_feedback_value_is_refused_at_construction(value: Any) -> None:
    allowed = "OnebitStrategy(error_feedback=...) must be one of ('reset', 'keep', 'require'), got "
    with pytest.raises(ValueError, match=re.escape(allowed + repr(value))):
        OnebitStrategy(error_feedback=value)
    assert OnebitStrategy().error_feedback == "keep" and OnebitStrategy().error_feedback_restored is None
    strategy = OnebitStrategy(error_feedback="require")
    assert strategy.error_feedback == "require"
    with pytest.raises(ValueError, match="ErrorFeedbackCheckpoint policy must be one of"):
        strategy.set_error_feedback(value, chosen_by="ErrorFeedbackCheckpoint")
    assert strategy.error_feedback == "require"
