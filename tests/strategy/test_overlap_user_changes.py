"""Issue 25, faults 2-5: what a realistic user does to the overlapped exchange, on 2 gloo CPU ranks through Lightning.

* A layer frozen (``requires_grad_(False)``) and unfrozen again during the compression stage, and a layer frozen from
  the start unfrozen there, with ``find_unused_parameters=True``, under ``overlap="auto"`` and ``overlap=True``: the
  run trains to the end. In the step where the set of trainable parameters changed, no exchange starts in the hooks
  (every rank sees the same ``requires_grad`` before its first collective) and ``step`` rebuilds the buckets and
  exchanges them all; overlap resumes at the next step. The runs are bitwise, at every step, the same run with the
  hook's exchange switched off (DDP's momentum layout) and the same run with ``overlap=False``: the model (``Wide``)
  makes every tensor a momentum bucket of its own both ways, so the layouts agree (``overlap=False`` otherwise packs
  by ``bucket_cap_mb``: other segment boundaries, other 1-bit scales, and only one-bit-noise closeness).
* Gradients edited after backward: an ``on_after_backward`` / ``on_before_optimizer_step`` override of the
  LightningModule or of a user callback makes ``overlap="auto"`` exchange in ``step`` (reason logged once, structured
  ``cause``), so the edit is honoured: bitwise the ``overlap=False`` run. ``overlap=True`` with such an override is a
  ``ValueError`` on every rank at setup, before any collective (DDP has not wrapped the model yet). A hook marked
  ``@leaves_gradients_unchanged`` keeps overlap; Lightning's and this package's callbacks do not count.
"""

from __future__ import annotations

import types
from typing import Any

import pytest
import torch
from torch import nn
from torch.nn.parallel import DistributedDataParallel

import lightning.pytorch as pl
from lightning_onebit import MomentumMask, OnebitAdam, OnebitStrategy
from lightning_onebit.hooks import OverlapFallbackReason, leaves_gradients_unchanged
from tests.distributed import run_distributed, run_scenarios, scenario_results
from tests.lightning_models import N_IN, Regressor, flat_params
from tests.strategy.test_overlap_lightning import _FALLBACK_LOG, FREEZE, STEPS, _fit

WORLD_SIZE = 2
WIDE, OUT = 16, 12


class Wide(Regressor):
    """``Regressor`` with every tensor at least 40 bytes, so that each is a DDP bucket of its own
    (``BUCKET_CAP_MB``), and ``bucket_cap_mb`` so small that without overlap each is a momentum bucket of its own
    too: ``overlap=False`` then has the overlapped runs' momentum layout and can be compared bit for bit."""

    def __init__(self, **kwargs: Any) -> None:
        super().__init__(**kwargs)
        self.l1 = nn.Linear(N_IN, WIDE)
        self.l2 = nn.Linear(WIDE, OUT)
        if self.frozen is not None:
            self.frozen = nn.Linear(WIDE, WIDE).requires_grad_(False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = torch.tanh(self.l1(x))
        if self.frozen is not None:
            h = h + self.frozen(h)
        return self.l2(h).mean(-1, keepdim=True)

    def configure_optimizers(self) -> Any:
        return OnebitAdam(self.parameters(), lr=self.lr, freeze_step=self.freeze_step, bucket_cap_mb=1e-9)


# where each layer's parameters are in Wide's flat parameters (l1, l2, then the layer built frozen)
_L1 = slice(0, N_IN * WIDE + WIDE)
_L2 = slice(_L1.stop, _L1.stop + WIDE * OUT + OUT)
_FROZEN = slice(_L2.stop, _L2.stop + WIDE * WIDE + WIDE)


class SetRequiresGrad(pl.Callback):
    """``requires_grad_(flag)`` on a submodule at the start of given global steps (before that step's forward), on
    every rank: ``changes`` maps a global step to ``(attribute name, flag)``."""

    def __init__(self, changes: dict[int, tuple[str, bool]]) -> None:
        self.changes = changes

    def on_train_batch_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule, *args: Any) -> None:
        change = self.changes.get(trainer.global_step)
        if change is not None:
            getattr(pl_module, change[0]).requires_grad_(change[1])


class HalfGradients(Regressor):
    """Scales every gradient by 0.5 in ``on_after_backward`` from the compression stage on."""

    def on_after_backward(self) -> None:
        if self.trainer.global_step >= FREEZE:
            for p in self.parameters():
                if p.grad is not None:
                    p.grad.mul_(0.5)


class HalfGradientsCallback(pl.Callback):
    """The same edit from a user callback."""

    def on_after_backward(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        if trainer.global_step >= FREEZE:
            for p in pl_module.parameters():
                if p.grad is not None:
                    p.grad.mul_(0.5)


class ScaleBeforeStep(Regressor):
    """Edits gradients in an (unmarked) ``on_before_optimizer_step``."""

    def on_before_optimizer_step(self, optimizer: Any) -> None:
        super().on_before_optimizer_step(optimizer)
        for p in self.parameters():
            if p.grad is not None:
                p.grad.mul_(0.5)


class ReadsGradients(pl.Callback):
    """Reads gradients only, and says so."""

    def __init__(self) -> None:
        self.norms: list[float] = []

    @leaves_gradients_unchanged
    def on_before_optimizer_step(self, trainer: pl.Trainer, pl_module: pl.LightningModule, optimizer: Any) -> None:
        self.norms.append(sum(float(p.grad.norm()) for p in pl_module.parameters() if p.grad is not None))


# ------------------------------------------------------------------------------------------------ scenarios
_UNUSED = dict(find_unused_parameters=True)
# l2 frozen at step 5 and unfrozen at step 7 (compression starts at step FREEZE = 3, overlap at step 4). The layer
# changed is the last in parameter order, so that overlap=False, which numbers its buckets in that order, keeps the
# other buckets' numbers (and so their error feedback) as DDP's buckets do.
_FREEZE_L2 = {5: ("l2", False), 7: ("l2", True)}
# the layer built frozen (so outside DDP's buckets) is unfrozen at step 6
_UNFREEZE = {6: ("frozen", True)}


def _runs(rank: int, world_size: int, changes: dict, overlaps: tuple, **kwargs: Any) -> dict[str, Any]:
    def fit(**more: Any) -> dict[str, Any]:
        return _fit(rank, world_size, model_cls=Wide, strategy_kwargs=_UNUSED, callbacks=(SetRequiresGrad(changes),),
                    **kwargs, **more)

    out = {f"overlap={o}": fit(overlap=o) for o in overlaps}
    out["in_step"] = fit(in_step=True)  # the hook starts nothing: every exchange in step, DDP's momentum layout
    out["off"] = fit(overlap=False)
    return out


def scenario_freeze(rank: int, world_size: int, workdir: str) -> dict[str, Any]:
    return _runs(rank, world_size, _FREEZE_L2, ("auto", True))


def scenario_unfreeze(rank: int, world_size: int, workdir: str) -> dict[str, Any]:
    return _runs(rank, world_size, _UNFREEZE, ("auto", True), model_kwargs=dict(frozen_layer=True))


def scenario_edits(rank: int, world_size: int, workdir: str) -> dict[str, Any]:
    out = {
        "module_auto": _fit(rank, world_size, model_cls=HalfGradients),
        "module_off": _fit(rank, world_size, model_cls=HalfGradients, overlap=False),
        "callback_auto": _fit(rank, world_size, callbacks=(HalfGradientsCallback(),)),
        "callback_off": _fit(rank, world_size, callbacks=(HalfGradientsCallback(),), overlap=False),
        # marked read-only: overlap stays on
        "reads_auto": _fit(rank, world_size, callbacks=(ReadsGradients(),)),
    }
    for name, kwargs in (("module_explicit", dict(model_cls=HalfGradients)),
                         ("callback_explicit", dict(callbacks=(HalfGradientsCallback(),)))):
        box: list[OnebitStrategy] = []
        try:
            _fit(rank, world_size, overlap=True, strategy_box=box, **kwargs)
            out[name] = dict(error=None)
        except ValueError as err:
            strategy = box[0]
            # raised before DDP wrapped the model (its constructor broadcasts parameters) and before the topology's
            # and the run id's collectives
            out[name] = dict(error=str(err), wrapped=isinstance(strategy.model, DistributedDataParallel),
                             topology=strategy.topology is not None, run_id=strategy._run_id)
    return out


_SCENARIOS = (("freeze", scenario_freeze), ("unfreeze", scenario_unfreeze), ("edits", scenario_edits))


@pytest.fixture(scope="module")
def session(tmp_path_factory: pytest.TempPathFactory) -> list[dict[str, Any]]:
    return run_distributed(run_scenarios, WORLD_SIZE, _SCENARIOS, str(tmp_path_factory.mktemp("hostile")),
                           timeout_s=600)


# ------------------------------------------------------------------------------------------------ tests
def _assert_trains_like_without_overlap(results: list[dict[str, Any]], started: int) -> None:
    """Every run trained to the end, and the overlapped ones are bitwise, at every step, the in-step run (the hook
    starts nothing, DDP's momentum layout) and the ``overlap=False`` run (the same layout here, see ``Wide``)."""
    for rank, r in enumerate(results):
        in_step, off = r["in_step"], r["off"]
        assert in_step["buckets_started"] == 0 and in_step["fallback"] is None and in_step["plan"]
        assert off["buckets_started"] is None and off["fallback"] is None and not off["plan"]
        for overlap in ("auto", True):
            run = r[f"overlap={overlap}"]
            assert run["fallback"] is None and run["plan"], run["fallback"]
            assert len(run["every_step"]) == STEPS  # trained to the end
            # overlapped from the second compressed step on, except in the steps where requires_grad changed
            assert run["buckets_started"] == started, run["buckets_started"]
            for other in (in_step, off):
                for step, (a, b) in enumerate(zip(run["every_step"], other["every_step"])):
                    assert torch.equal(a, b), f"rank {rank}, overlap={overlap}, batch {step}: differs"
                assert run["losses"] == other["losses"]
    for overlap in ("auto", True):
        assert torch.equal(results[0][f"overlap={overlap}"]["final"], results[1][f"overlap={overlap}"]["final"])


def test_freezing_and_unfreezing_a_layer_in_the_compression_stage_trains_under_overlap(
    session: list[dict[str, Any]],
) -> None:
    results = scenario_results(session, "freeze")
    # one DDP bucket per tensor, 4 of them: all start at steps 4, 6 and 8 (at step 6, l2 frozen since step 5, the 2
    # buckets of l1), none at steps 5 and 7, where requires_grad changed
    _assert_trains_like_without_overlap(results, started=4 + 2 + 4)
    # l2 did not move while frozen (steps 5 and 6) and moved after it was unfrozen; l1 moved all along
    every = results[0]["overlap=auto"]["every_step"]
    assert torch.equal(every[4][_L2], every[5][_L2]) and torch.equal(every[5][_L2], every[6][_L2])
    assert not torch.equal(every[6][_L2], every[7][_L2])
    assert all(not torch.equal(every[k][_L1], every[k + 1][_L1]) for k in range(4, 7))


def test_unfreezing_a_layer_frozen_from_the_start_trains_under_overlap(session: list[dict[str, Any]]) -> None:
    results = scenario_results(session, "unfreeze")
    # DDP's 4 buckets start at steps 4, 5, 7 and 8; none at step 6, where the layer was unfrozen (its momenta, in
    # no DDP bucket, are packed in buckets of their own and exchanged in step)
    _assert_trains_like_without_overlap(results, started=4 * 4)
    # the layer had no gradient in warmup, so no variance estimate: as without overlap, it stays where it was
    # (OnebitAdam logs that such parameters stay frozen in the compression stage)
    initial = flat_params(Wide(freeze_step=FREEZE, frozen_layer=True))
    for r in results:
        assert torch.equal(r["overlap=auto"]["final"][_FROZEN], initial[_FROZEN])


@pytest.mark.parametrize("where", ["module", "callback"])
def test_gradient_edit_after_backward_is_honoured_under_auto(session: list[dict[str, Any]], where: str) -> None:
    for rank, r in enumerate(scenario_results(session, "edits")):
        auto, off = r[f"{where}_auto"], r[f"{where}_off"]
        assert auto["buckets_started"] is None and "on_after_backward" in auto["fallback"]
        assert auto["fallback"].cause == "gradient_hook"
        logged = f"{_FALLBACK_LOG}: {auto['fallback']}; see docs/guides/overlap.md"
        assert auto["fallback_logs"] == ([logged] if rank == 0 else [])
        assert torch.equal(auto["final"], off["final"]) and auto["losses"] == off["losses"]


@pytest.mark.parametrize("where", ["module", "callback"])
def test_explicit_overlap_with_a_gradient_hook_is_refused_before_any_collective(
    session: list[dict[str, Any]], where: str
) -> None:
    for r in scenario_results(session, "edits"):
        out = r[f"{where}_explicit"]
        assert out["error"] is not None, "overlap=True accepted a gradient-editing hook"
        assert "overlap=True" in out["error"] and "on_after_backward" in out["error"]
        assert "leaves_gradients_unchanged" in out["error"] and "overlap='auto'" in out["error"]
        assert not out["wrapped"] and not out["topology"] and out["run_id"] == "unset"


def test_a_hook_marked_read_only_keeps_overlap(session: list[dict[str, Any]]) -> None:
    for r in scenario_results(session, "edits"):
        run = r["reads_auto"]
        assert run["fallback"] is None and run["buckets_started"] > 0


# ------------------------------------------------------------------------------------------------ in-process
def _reason(model: pl.LightningModule, callbacks: tuple = (), overlap: Any = "auto") -> Any:
    strategy = OnebitStrategy(overlap=overlap)
    strategy._lightning_module = model
    trainer = types.SimpleNamespace(callbacks=list(callbacks), gradient_clip_val=None,
                                    gradient_clip_algorithm=None, accumulate_grad_batches=1)
    return strategy.overlap_unsupported_reason(trainer)


def test_which_hooks_count() -> None:
    # the test model's recording hook is marked read-only
    assert _reason(Regressor()) is None
    reason = _reason(ScaleBeforeStep())
    assert isinstance(reason, OverlapFallbackReason) and reason.cause == "gradient_hook"
    assert "ScaleBeforeStep.on_before_optimizer_step" in reason and "leaves_gradients_unchanged" in reason
    reason = _reason(Regressor(), callbacks=(HalfGradientsCallback(),))
    assert reason.cause == "gradient_hook" and "HalfGradientsCallback.on_after_backward" in reason
    # this package's callbacks (MomentumMask reads gradients in on_before_optimizer_step) and Lightning's do not count
    from lightning.pytorch.callbacks import LearningRateMonitor, ModelCheckpoint

    assert _reason(Regressor(), callbacks=(MomentumMask(auto=True), ModelCheckpoint(), LearningRateMonitor(),
                                           ReadsGradients())) is None
    # a user subclass of a package callback that overrides the hook counts
    class MyMask(MomentumMask):
        def on_before_optimizer_step(self, *args: Any) -> None:
            super().on_before_optimizer_step(*args)

    assert _reason(Regressor(), callbacks=(MyMask(auto=True),)).cause == "gradient_hook"


def test_fallback_reason_pickles_with_its_cause() -> None:
    import pickle

    reason = OverlapFallbackReason("gradient_hook", "some text")
    back = pickle.loads(pickle.dumps(reason))
    assert back == "some text" and back.cause == "gradient_hook" and isinstance(back, OverlapFallbackReason)
