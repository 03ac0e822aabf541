"""``OnebitStrategy(overlap=...)`` in real Trainer runs on 2 gloo CPU ranks.

* Overlapped runs give the same parameters, bit for bit and at every step, as the same runs with the hook's exchange
  switched off (same momentum layout: DDP's buckets): ``32-true``, ``bf16-mixed``, accumulation 2,
  ``find_unused_parameters`` with parameters used on one rank only or on no rank in some steps, frozen parameters,
  clipping by value; and a run resumed mid-stage with ``ErrorFeedbackCheckpoint('keep')`` is bitwise the
  uninterrupted overlapped run.
* ``overlap=False`` packs the momenta by ``bucket_cap_mb`` instead: other segment boundaries, so other 1-bit scales;
  it stays within a stated tolerance.
* Every fallback case (clipping by norm, a ``configure_gradient_clipping`` override, ``16-mixed``, ``static_graph``
  with accumulation, manual optimization) logs its reason once under ``auto`` and gives exactly the ``overlap=False``
  result; ``overlap=True`` there is a ``ValueError`` at setup on every rank (manual optimization: a second backward
  pass before ``step`` is a ``RuntimeError``).
"""

from __future__ import annotations

import logging
import os
from typing import Any, Optional

import pytest
import torch
from torch import nn

import lightning.pytorch as pl
from lightning.pytorch.callbacks import ModelCheckpoint
from lightning.pytorch.plugins.precision import MixedPrecision
from lightning_onebit import ErrorFeedbackCheckpoint, OnebitStrategy
from tests.distributed import run_distributed, run_scenarios, scenario_results
from tests.lightning_models import HIDDEN, ManualRegressor, Regressor, flat_params, loader, trainer_kwargs

WORLD_SIZE = 2
FREEZE, STEPS = 3, 9
# DDP closes a bucket once it reaches the cap: (l2.bias, l2.weight, l1.bias), then l1.weight (and the extra layers)
BUCKET_CAP_MB = 40 / 2**20
_FALLBACK_LOG = "onebit_adam: momentum exchange not overlapped with backward"


class SometimesRegressor(Regressor):
    """``Regressor`` plus ``rank_layer`` (used on one rank per step: globally used, locally unused on the other) and
    ``rare_layer`` (used by every rank on every third step only: globally unused in the others)."""

    def __init__(self, **kwargs: Any) -> None:
        super().__init__(**kwargs)
        self.rank_layer = nn.Linear(HIDDEN, 1)
        self.rare_layer = nn.Linear(HIDDEN, 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = torch.tanh(self.l1(x))
        if self.frozen is not None:
            h = h + self.frozen(h)
        out = self.l2(h)
        step, rank = self.trainer.global_step, self.trainer.global_rank
        if (step + rank) % 2 == 0:
            out = out + self.rank_layer(h)
        if step % 3 == 0:
            out = out + self.rare_layer(h)
        return out


class ClippingOverride(Regressor):
    def configure_gradient_clipping(
        self, optimizer: Any, gradient_clip_val: Any = None, gradient_clip_algorithm: Any = None
    ) -> None:
        self.clip_gradients(optimizer, gradient_clip_val=0.5, gradient_clip_algorithm="norm")


class TwoBackwardManual(ManualRegressor):
    """Manual optimization with two backward passes (with gradient sync) per optimizer step."""

    def training_step(self, batch: Any, batch_idx: int) -> None:
        opt = self.optimizers()
        x, y = batch
        opt.zero_grad()
        for part in (slice(0, 4), slice(4, 8)):
            self.manual_backward(nn.functional.mse_loss(self(x[part]), y[part]))
        opt.step()


class InStepExchange(pl.Callback):
    """Keeps the overlap hook (and so DDP's momentum layout) but has it start nothing: every exchange runs in step."""

    def on_train_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        trainer.strategy.overlap_state.enabled = False


class ParamsEveryStep(pl.Callback):
    def __init__(self) -> None:
        self.params: list[torch.Tensor] = []

    def on_train_batch_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule, *args: Any) -> None:
        self.params.append(flat_params(pl_module))


class _Records(logging.Handler):
    def __init__(self) -> None:
        super().__init__()
        self.messages: list[str] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.messages.append(record.getMessage())


def _fit(
    rank: int,
    world_size: int,
    overlap: Any = "auto",
    in_step: bool = False,
    model_cls: type = Regressor,
    strategy_kwargs: Optional[dict[str, Any]] = None,
    model_kwargs: Optional[dict[str, Any]] = None,
    callbacks: tuple[pl.Callback, ...] = (),
    ckpt_path: Optional[str] = None,
    max_steps: int = STEPS,
    n_batches: int = STEPS,
    strategy_box: Optional[list] = None,
    **trainer_overrides: Any,
) -> dict[str, Any]:
    model = model_cls(freeze_step=FREEZE, **(model_kwargs or {}))
    strategy = OnebitStrategy(overlap=overlap, ddp_bucket_cap_mb=BUCKET_CAP_MB, **(strategy_kwargs or {}))
    if strategy_box is not None:
        strategy_box.append(strategy)
    every_step = ParamsEveryStep()
    extra = (InStepExchange(),) if in_step else ()
    trainer = pl.Trainer(
        **trainer_kwargs(world_size, max_steps, strategy=strategy, callbacks=[every_step, *extra, *callbacks],
                         **trainer_overrides)
    )
    handler = _Records()
    rank_zero_log = logging.getLogger("lightning.pytorch.utilities.rank_zero")
    rank_zero_log.addHandler(handler)
    try:
        trainer.fit(model, loader(rank, n_batches), ckpt_path=ckpt_path)
    finally:
        rank_zero_log.removeHandler(handler)
    state = strategy.overlap_state
    opt = strategy.onebit_optimizer
    return dict(
        final=flat_params(model),
        every_step=every_step.params,
        losses=model.losses,
        buckets_started=None if state is None else state.buckets_started,
        fallback=strategy.overlap_fallback_reason,
        fallback_logs=[m for m in handler.messages if _FALLBACK_LOG in m],
        n_buckets=len(opt.bucket_layouts()),
        exposed_s=opt.communication.exposed_s,
        hook_s=opt.communication.hook_s,
        plan=opt.bucket_plan is not None,
    )


def _pair(rank: int, world_size: int, **kwargs: Any) -> dict[str, Any]:
    return dict(overlapped=_fit(rank, world_size, **kwargs), in_step=_fit(rank, world_size, in_step=True, **kwargs))


# ------------------------------------------------------------------------------------------------ scenarios
def scenario_32(rank: int, world_size: int, workdir: str) -> dict[str, Any]:
    return dict(**_pair(rank, world_size), off=_fit(rank, world_size, overlap=False))


def scenario_bf16(rank: int, world_size: int, workdir: str) -> dict[str, Any]:
    return _pair(rank, world_size, precision="bf16-mixed")


def scenario_accumulation(rank: int, world_size: int, workdir: str) -> dict[str, Any]:
    return _pair(rank, world_size, accumulate_grad_batches=2, n_batches=2 * STEPS)


def scenario_unused(rank: int, world_size: int, workdir: str) -> dict[str, Any]:
    return _pair(
        rank, world_size, model_cls=SometimesRegressor, model_kwargs=dict(frozen_layer=True),
        strategy_kwargs=dict(find_unused_parameters=True),
    )


def scenario_clip_value(rank: int, world_size: int, workdir: str) -> dict[str, Any]:
    return _pair(rank, world_size, gradient_clip_val=0.05, gradient_clip_algorithm="value")


RES_BATCHES, RES_EPOCHS = 3, 3  # checkpoint after epoch 1 = step 6: two compressed steps done, three to go


def scenario_resume(rank: int, world_size: int, workdir: str) -> dict[str, Any]:
    def checkpoints(run: str) -> ModelCheckpoint:
        return ModelCheckpoint(dirpath=os.path.join(workdir, run), filename="{epoch}", every_n_epochs=1, save_top_k=-1)

    common = dict(max_steps=-1, max_epochs=RES_EPOCHS, n_batches=RES_BATCHES, model_kwargs=dict(data_seed=7),
                  enable_checkpointing=True)
    full = _fit(rank, world_size, callbacks=(ErrorFeedbackCheckpoint("keep"), checkpoints("full")), **common)
    path = os.path.join(workdir, "full", "epoch=1.ckpt")
    saved = torch.load(path, weights_only=False)["optimizer_states"][0]["onebit"]
    resumed = _fit(rank, world_size, callbacks=(ErrorFeedbackCheckpoint("keep"), checkpoints("resumed")),
                   ckpt_path=path, **common)
    return dict(full=full, resumed=resumed, saved_plan=saved.get("bucket_plan"))


def _fp16_plugin() -> MixedPrecision:
    return MixedPrecision("16-mixed", "cpu", scaler=torch.amp.GradScaler("cpu", init_scale=2.0**8))


FALLBACKS = {
    "clip_norm": (dict(trainer=dict(gradient_clip_val=0.05)), "clipping by norm"),
    "clip_override": (dict(model_cls=ClippingOverride), "configure_gradient_clipping"),
    # Lightning turns "16-mixed" into bf16-mixed on CPU; a MixedPrecision plugin with a GradScaler is real 16-mixed
    "fp16": (dict(trainer=dict(plugins=[_fp16_plugin])), "16-mixed"),
    "static_accum": (
        dict(strategy_kwargs=dict(static_graph=True), trainer=dict(accumulate_grad_batches=2), n_batches=2 * STEPS),
        "static_graph",
    ),
    "manual": (dict(model_cls=ManualRegressor), "manual optimization"),
}


def _fallback_kwargs(spec: dict[str, Any]) -> dict[str, Any]:
    """The _fit arguments of a FALLBACKS entry (plugins are built fresh for every run)."""
    kwargs = {k: v for k, v in spec.items() if k != "trainer"}
    kwargs.update(spec.get("trainer", {}))
    if "plugins" in kwargs:
        kwargs["plugins"] = [make() for make in kwargs["plugins"]]
    return kwargs


def _outcome(rank: int, world_size: int, **kwargs: Any) -> dict[str, Any]:
    """``_fit``'s result, or the error the run ended with (plain DDP itself fails with static_graph and no_sync,
    pytorch #143580: the fallback must then fail exactly as the non-overlapped run does)."""
    strategy_box: list[OnebitStrategy] = []
    try:
        return _fit(rank, world_size, strategy_box=strategy_box, **kwargs)
    except RuntimeError as err:
        strategy = strategy_box[0]
        return dict(error=f"{type(err).__name__}: {str(err).splitlines()[0]}", fallback=strategy.overlap_fallback_reason,
                    buckets_started=None if strategy.overlap_state is None else strategy.overlap_state.buckets_started)


def scenario_fallbacks(rank: int, world_size: int, workdir: str) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for name, (spec, _) in FALLBACKS.items():
        out[name] = dict(
            auto=_outcome(rank, world_size, **_fallback_kwargs(spec)),
            off=_outcome(rank, world_size, overlap=False, **_fallback_kwargs(spec)),
        )
        if name != "manual":
            try:
                _fit(rank, world_size, overlap=True, **_fallback_kwargs(spec))
            except ValueError as err:
                out[name]["explicit"] = str(err)
    out["manual_explicit"] = _pair(rank, world_size, overlap=True, model_cls=ManualRegressor)
    try:
        # find_unused_parameters: DDP's buckets are final from the start (with two backward passes per DDP forward,
        # DDP never rebuilds them otherwise, and the hook would never start an exchange)
        out["two_backward"] = _fit(rank, world_size, overlap=True, model_cls=TwoBackwardManual,
                                   strategy_kwargs=dict(find_unused_parameters=True))
    except RuntimeError as err:
        out["two_backward"] = str(err)
    return out


_SCENARIOS = (
    ("32", scenario_32),
    ("bf16", scenario_bf16),
    ("accumulation", scenario_accumulation),
    ("unused", scenario_unused),
    ("clip_value", scenario_clip_value),
    ("resume", scenario_resume),
    ("fallbacks", scenario_fallbacks),
)


@pytest.fixture(scope="module")
def session(tmp_path_factory: pytest.TempPathFactory) -> list[dict[str, Any]]:
    workdir = tmp_path_factory.mktemp("overlap")
    return run_distributed(run_scenarios, WORLD_SIZE, _SCENARIOS, str(workdir), timeout_s=600)


# ------------------------------------------------------------------------------------------------ tests
def _assert_pair_bitwise(results: list[dict[str, Any]], expected_steps: int = STEPS) -> None:
    for rank, r in enumerate(results):
        over, in_step = r["overlapped"], r["in_step"]
        assert over["fallback"] is None and over["plan"] and over["n_buckets"] >= 2
        # overlap from the second compressed step on, every momentum bucket started in its hook
        assert over["buckets_started"] == over["n_buckets"] * (expected_steps - FREEZE - 1) > 0
        assert in_step["buckets_started"] == 0 and in_step["hook_s"] == 0 and over["hook_s"] > 0
        assert len(over["every_step"]) == len(in_step["every_step"]) > 0
        for step, (a, b) in enumerate(zip(over["every_step"], in_step["every_step"])):
            assert torch.equal(a, b), f"rank {rank}, batch {step}: overlapped and in-step runs differ"
        assert over["losses"] == in_step["losses"]
    assert torch.equal(results[0]["overlapped"]["final"], results[1]["overlapped"]["final"]), "replicas differ"


@pytest.mark.parametrize("name", ["32", "bf16", "unused", "clip_value"])
def test_overlapped_runs_are_bitwise_the_in_step_runs(session: list[dict[str, Any]], name: str) -> None:
    _assert_pair_bitwise(scenario_results(session, name))


def test_overlap_with_gradient_accumulation(session: list[dict[str, Any]]) -> None:
    results = scenario_results(session, "accumulation")
    _assert_pair_bitwise(results)
    assert len(results[0]["overlapped"]["every_step"]) == 2 * STEPS  # micro-batches; hooks fire on every second


def test_find_unused_parameters_run_trains_and_leaves_the_frozen_layer_alone(session: list[dict[str, Any]]) -> None:
    results = scenario_results(session, "unused")
    initial = flat_params(SometimesRegressor(freeze_step=FREEZE, frozen_layer=True))
    final = results[0]["overlapped"]["final"]
    assert not torch.equal(final, initial)
    # the frozen layer (requires_grad=False) is in no DDP bucket and did not move
    frozen = SometimesRegressor(freeze_step=FREEZE, frozen_layer=True)
    offset = sum(p.numel() for p in (frozen.l1.weight, frozen.l1.bias, frozen.l2.weight, frozen.l2.bias))
    size = sum(p.numel() for p in frozen.frozen.parameters())
    assert torch.equal(final[offset : offset + size], initial[offset : offset + size])


def test_overlap_off_packs_by_bucket_cap_and_stays_within_one_bit_noise(session: list[dict[str, Any]]) -> None:
    for r in scenario_results(session, "32"):
        over, off = r["overlapped"], r["off"]
        assert off["buckets_started"] is None and not off["plan"] and off["fallback"] is None
        # Different segment boundaries (parameter order packed by bucket_cap_mb vs DDP's reverse-order buckets) give
        # different 1-bit scales, so the runs are not bitwise equal. Both start the compression stage from the same
        # warmup, and a compressed step moves a coordinate by lr / (1 - b1^t) * |m_hat / sqrt(v_hat)|, with Adam's
        # normalised update about 1 at most: the runs stay within the sum of both runs' step sizes.
        assert not torch.equal(over["final"], off["final"])
        b1, lr = 0.9, Regressor().lr
        bound = sum(2 * lr / (1 - b1**t) for t in range(FREEZE + 1, STEPS + 1))
        torch.testing.assert_close(over["final"], off["final"], rtol=0, atol=bound)


def test_resume_mid_stage_with_keep_is_bitwise_the_uninterrupted_overlapped_run(session: list[dict[str, Any]]) -> None:
    results = scenario_results(session, "resume")
    for rank, r in enumerate(results):
        full, resumed = r["full"], r["resumed"]
        assert r["saved_plan"] and all(isinstance(k, int) and ids for k, ids in r["saved_plan"])  # layout recorded
        assert full["buckets_started"] > 0 and resumed["buckets_started"] > 0
        assert torch.equal(resumed["final"], full["final"]), f"rank {rank}: the resumed run differs"
        assert resumed["losses"] == full["losses"][-len(resumed["losses"]):]


@pytest.mark.parametrize("name", list(FALLBACKS))
def test_fallbacks_say_why_once_and_give_the_non_overlapped_result(session: list[dict[str, Any]], name: str) -> None:
    results = scenario_results(session, "fallbacks")
    phrase = FALLBACKS[name][1]
    for rank, r in enumerate(results):
        auto, off = r[name]["auto"], r[name]["off"]
        assert auto["buckets_started"] is None and phrase in auto["fallback"]
        assert off["fallback"] is None
        if "error" in off:  # static_graph + accumulation: plain DDP fails, and the fallback fails the same way
            assert name == "static_accum" and auto.get("error") == off["error"], (auto.get("error"), off["error"])
        else:
            logged = f"{_FALLBACK_LOG}: {auto['fallback']}; see docs/guides/overlap.md"
            assert auto["fallback_logs"] == ([logged] if rank == 0 else [])
            assert off["fallback_logs"] == []
            assert torch.equal(auto["final"], off["final"]) and auto["losses"] == off["losses"]
        if name != "manual":
            assert "overlap=True" in r[name]["explicit"] and phrase in r[name]["explicit"]


def test_manual_optimization_with_explicit_overlap(session: list[dict[str, Any]]) -> None:
    results = scenario_results(session, "fallbacks")
    _assert_pair_bitwise([r["manual_explicit"] for r in results])
    for r in results:
        assert "ready twice before optimizer.step()" in r["two_backward"]
