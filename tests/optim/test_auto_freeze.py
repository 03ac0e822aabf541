"""``freeze_step="auto"`` (``AutoFreeze``): the warmup ends when the frozen variance would cover the gradients and the
training loss has left its initial plateau.

* A synthetic problem whose gradient scale grows until a known step and is constant after it: no freeze before that
  step, a freeze within a few windows after it, and both bounds respected.
* A synthetic loss plateau: steady gradients look settled from the start, but the warmup waits for the loss to fall;
  without a loss the detector refuses to guess (unless ``loss_drop=None``); ``step(closure)`` records the loss.
* 2 and 3 gloo ranks with different data decide the same step; when one rank's figures (variance or loss) are forced to
  disagree, the ``all_reduce(MAX)`` makes every rank wait for it, and the DDP hook switches at the decided step on
  every rank.
* A resume before the decision goes on measuring (snapshots and losses) and decides the same step; a resume after it
  keeps the step.
"""

from __future__ import annotations

import copy
import functools
from typing import Any, Optional

import pytest
import torch
from torch import nn
from torch.nn.parallel import DistributedDataParallel as DDP

from lightning_onebit import AutoFreeze, OnebitAdam, OnebitLamb
from lightning_onebit.hooks import GradientSyncState, switchable_allreduce_hook
from tests.distributed import run_distributed

GROWS_UNTIL = 60  # the gradient scale grows 10% per step until this step, then stays constant


def _params() -> list[nn.Parameter]:
    torch.manual_seed(0)
    return [nn.Parameter(torch.randn(40, 30)), nn.Parameter(torch.randn(30)), nn.Parameter(torch.randn(5))]


def _synthetic_gradients(params: list[nn.Parameter], t: int, grows_until: int = GROWS_UNTIL) -> None:
    scale = 1.1 ** min(t, grows_until)
    for i, p in enumerate(params):
        pattern = torch.randn(p.shape, generator=torch.Generator().manual_seed(i))
        p.grad = scale * pattern * (1 + 0.01 * (-1) ** t)  # a little wobble, as real gradients have


def _falling_loss(t: int, plateau_until: int = 0) -> float:
    """1.0 (with a wobble) until ``plateau_until``, then halving every 20 steps."""
    return (1.0 + 0.02 * (-1) ** t) * 0.5 ** (max(0, t - plateau_until) / 20)


def _run(optimizer_class: type, steps: int, state: Optional[dict] = None, start: int = 1, grows_until: int = GROWS_UNTIL,
         plateau_until: int = 0, loss: bool = True, **auto: Any) -> dict:
    params = _params()
    config = AutoFreeze(**{"max_step": 400, **auto})
    opt = optimizer_class(params, lr=1e-3, betas=(0.9, 0.9), freeze_step="auto", auto_freeze=config,
                          dead_coordinates="ignore")
    if state is not None:
        for p, value in zip(params, state["params"]):
            p.data.copy_(value)
        opt.load_state_dict(state["optimizer"])
    out: dict[str, Any] = dict(saved={})
    for t in range(start, steps + 1):
        _synthetic_gradients(params, t, grows_until)
        if loss:
            opt.observe_loss(torch.tensor(_falling_loss(t, plateau_until)))
        opt.step()
        if t in (70, 120):
            out["saved"][t] = dict(params=[p.detach().clone() for p in params],
                                   optimizer=copy.deepcopy(opt.state_dict()))
    out.update(freeze_step=opt.freeze_step, detector=opt.freeze_detector, params=[p.detach().clone() for p in params],
               stage=opt.stage.value)
    return out


# 1-bit LAMB without the trust-ratio cap (DeepSpeed's update): its compressed steps grow with the gradients, as Adam's
UNCAPPED_LAMB = functools.partial(OnebitLamb, cap_trust_ratio=False)


@pytest.mark.parametrize("optimizer_class", [OnebitAdam, UNCAPPED_LAMB], ids=["OnebitAdam", "OnebitLamb-uncapped"])
def test_freezes_after_the_statistics_stop_changing_and_not_before(optimizer_class: type) -> None:
    result = _run(optimizer_class, 200)
    detector = result["detector"]
    # beta2 0.9: window 10 steps, a check every 2
    assert detector.window == 10 and detector.check_every == 2 and detector.reason == "settled"
    assert GROWS_UNTIL < result["freeze_step"] <= GROWS_UNTIL + 6 * detector.window, result["freeze_step"]
    assert result["stage"] == "compression"
    last = detector.last
    assert last["streak"] >= 3 and last["sample_excess"] < 0.3 and last["tensor_excess"] < 1.0
    assert last["loss_ratio"] <= 0.9
    assert "10-step gradient excess" in detector.describe()  # the window the figures compare over
    # the figures the rule uses were failing while the scale grew: the decision is not min_step's
    grown = _run(optimizer_class, GROWS_UNTIL)
    assert grown["freeze_step"] is None and grown["detector"].last["sample_excess"] > 0.3


def test_capped_lamb_does_not_wait_for_growing_gradients() -> None:
    """With the trust-ratio cap no compressed step can exceed LAMB's, so gradients that keep outgrowing the variance
    (a uniform 10% a step here, which leaves the trust ratio unchanged) do not hold the warmup; the loss guard and the
    trust ratio still do. The excess is measured and reported as not required."""
    capped = _run(OnebitLamb, GROWS_UNTIL)
    detector = capped["detector"]
    assert capped["freeze_step"] is not None and capped["freeze_step"] < GROWS_UNTIL and detector.reason == "settled"
    last = detector.last
    assert last["sample_excess"] > 0.3 and not last["largest_required"]
    assert "(not required: steps capped)" in detector.describe()
    # the same gradients on a loss plateau: the loss guard still holds it
    plateau = _run(OnebitLamb, 100, plateau_until=80)
    assert 80 < plateau["freeze_step"] <= 80 + 3 * plateau["detector"].window, plateau["freeze_step"]


class OneRatioMovingLamb(OnebitLamb):
    """The trust ratio of the smallest tensor (5 of 1235 coordinates) keeps growing 20% a step (or, with
    ``all_moving``, every tensor's); the other figures are OnebitLamb's."""

    all_moving = False

    def _settling_figures(self) -> torch.Tensor:
        figures = super()._settling_figures()
        moving = torch.ones_like(figures, dtype=torch.bool) if self.all_moving else torch.arange(len(figures)) == 2
        return torch.where(moving, figures * 1.2**self._step, figures)


@pytest.mark.parametrize("cap_trust_ratio", [True, False])
def test_one_small_tensors_trust_ratio_holds_only_uncapped_lamb(cap_trust_ratio: bool) -> None:
    """Under the cap a tensor whose frozen ratio ends up below its live one only steps less than LAMB's, so one small
    tensor still moving does not hold the warmup (the ratio-weighted mean does); DeepSpeed's update waits for it."""
    optimizer = functools.partial(OneRatioMovingLamb, cap_trust_ratio=cap_trust_ratio)
    run = _run(optimizer, 200, grows_until=0)
    last = run["detector"].last
    assert last["coeff_change"] > 1.0 and last["coeff_change_mean"] < 0.3
    if cap_trust_ratio:
        assert run["freeze_step"] < 40 and "(largest tensor, not required)" in run["detector"].describe()
    else:
        assert run["freeze_step"] is None
    # every tensor moving holds the capped optimizer too
    everything = functools.partial(type("AllRatiosMovingLamb", (OneRatioMovingLamb,), {"all_moving": True}),
                                   cap_trust_ratio=cap_trust_ratio)
    held = _run(everything, 200, grows_until=0)
    assert held["freeze_step"] is None and held["detector"].last["coeff_change_mean"] > 0.3


@pytest.mark.parametrize("optimizer_class", [OnebitAdam, OnebitLamb])
def test_a_loss_plateau_holds_the_warmup_although_the_variance_looks_settled(optimizer_class: type) -> None:
    # constant gradients from step 1: the variance is settled at once; the loss stays at 1.0 until step 100
    plateau = _run(optimizer_class, 200, grows_until=0, plateau_until=100)
    assert 100 < plateau["freeze_step"] <= 100 + 3 * plateau["detector"].window, plateau["freeze_step"]
    unguarded = _run(optimizer_class, 200, grows_until=0, plateau_until=100, loss_drop=None)
    assert unguarded["freeze_step"] < 40 and unguarded["detector"].last["loss_ratio"] is None


def test_the_loss_guard_needs_a_loss_and_step_closure_gives_it() -> None:
    with pytest.raises(ValueError, match=r"observe_loss\(loss\).*loss_drop=None"):
        _run(OnebitAdam, 40, grows_until=0, loss=False)
    assert _run(OnebitAdam, 40, grows_until=0, loss=False, loss_drop=None)["freeze_step"] is not None
    params = _params()
    opt = OnebitAdam(params, lr=1e-3, betas=(0.9, 0.9), freeze_step="auto", dead_coordinates="ignore",
                     auto_freeze=AutoFreeze(max_step=400))
    for t in range(1, 201):
        def closure(t: int = t) -> torch.Tensor:
            _synthetic_gradients(params, t, 0)
            return torch.tensor(_falling_loss(t, plateau_until=100))

        opt.step(closure)
    assert 100 < opt.freeze_step <= 130
    with pytest.raises(ValueError, match="scalar"):
        OnebitAdam(_params(), freeze_step="auto").observe_loss(torch.ones(3))


def test_bounds_win_over_the_detector() -> None:
    early = _run(OnebitAdam, 200, max_step=30)
    assert early["freeze_step"] == 30 and early["detector"].reason == "max_step"
    assert "max_step 30 reached" in early["detector"].describe()
    settled = _run(OnebitAdam, 200)["freeze_step"]
    late = _run(OnebitAdam, 250, min_step=settled + 25)
    assert late["freeze_step"] == settled + 26  # the first check (every 2 steps) at or after min_step
    with pytest.raises(ValueError, match="max_step"):
        _run(OnebitAdam, 5, max_step=None)


def test_resume_before_and_after_the_decision() -> None:
    full = _run(OnebitAdam, 200)
    assert 70 < full["freeze_step"] < 120
    before = _run(OnebitAdam, 200, state=full["saved"][70], start=71)  # still measuring at 70
    assert before["freeze_step"] == full["freeze_step"]
    after = _run(OnebitAdam, 200, state=full["saved"][120], start=121)
    assert after["freeze_step"] == full["freeze_step"] and after["detector"].reason == "settled"
    for a, b, c in zip(full["params"], before["params"], after["params"]):
        assert torch.equal(a, b) and torch.equal(a, c)


@pytest.mark.parametrize(
    "kwargs, message",
    [
        (dict(freeze_step="sometime"), "'auto'"),
        (dict(freeze_step="auto", auto_freeze={"window": 10}), "must be a lightning_onebit.AutoFreeze"),
    ],
)
def test_bad_arguments_are_refused(kwargs: dict[str, Any], message: str) -> None:
    with pytest.raises(ValueError, match=message):
        OnebitAdam(_params(), **kwargs)


@pytest.mark.parametrize("optimizer", [OnebitAdam, OnebitLamb])
def test_an_integer_freeze_step_overrides_auto_freeze_settings_with_a_warning(optimizer: type) -> None:
    """A config that ships ``auto_freeze`` settings, overridden with ``freeze_step=3`` on the command line: the
    integer wins (it used to raise "drop auto_freeze"), and one warning says the settings are not used."""
    with pytest.warns(UserWarning, match=r"freeze_step=3 is used and the auto_freeze settings given with it are not"):
        opt = optimizer(_params(), freeze_step=3, auto_freeze=AutoFreeze(max_step=50))
    assert opt.freeze_step == 3 and opt.auto_freeze is None


@pytest.mark.parametrize(
    "kwargs, message",
    [
        (dict(window=10, check_every=3), "multiple of check_every"),
        (dict(threshold=0), "threshold"),
        (dict(tensor_threshold=float("inf")), "tensor_threshold"),
        (dict(loss_drop=1.0), "loss_drop"),
        (dict(loss_drop="10%"), "loss_drop"),
        (dict(patience=0), "patience"),
        (dict(min_step=50, max_step=10), "after max_step"),
    ],
)
def test_bad_auto_freeze_settings_are_refused(kwargs: dict[str, Any], message: str) -> None:
    with pytest.raises(ValueError, match=message):
        AutoFreeze(**kwargs)


# ------------------------------------------------------------------------------------------------ distributed
class Net(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.l1 = nn.Linear(6, 16)
        self.head = nn.Linear(16, 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(torch.tanh(self.l1(x)))


class StubbornOnebitAdam(OnebitAdam):
    """Rank 1 reports an extra figure that keeps changing until step ``until``: only the agreement makes rank 0 wait."""

    until = 0

    def _settling_figures(self) -> Optional[torch.Tensor]:
        moving = self.compression.rank() == 1 and self._step < self.until
        tensors = sum(len(group["params"]) for group in self.param_groups)  # one figure per measured tensor
        return torch.full((tensors,), 1.5**self._step if moving else 1.0, dtype=torch.float64)


def _train(rank: int, world_size: int, until: int, loss_flat_until: int = 0) -> dict[str, Any]:
    net = Net()
    ddp = DDP(net)
    StubbornOnebitAdam.until = until
    opt = StubbornOnebitAdam(net.parameters(), lr=1e-3, betas=(0.9, 0.9), freeze_step="auto",
                             # a loose threshold: this test is about agreement, the synthetic ones about detection
                             auto_freeze=AutoFreeze(threshold=0.4, max_step=300), dead_coordinates="ignore")
    sync = GradientSyncState(sync_predicate=lambda: opt.needs_gradient_allreduce)
    ddp.register_comm_hook(sync, switchable_allreduce_hook)
    synced_steps = []
    first_loss = 0.0  # the loss of step 1, set there
    for t in range(1, 151):
        # different data on every rank, the same batch every step: the averaged gradient changes slowly
        x = torch.randn(16, 6, generator=torch.Generator().manual_seed(1000 * rank)) * (1 + 0.01 * (-1) ** t)
        skipped = sync.skipped_buckets
        opt.zero_grad()
        loss = nn.functional.mse_loss(ddp(x), torch.sin(x.sum(1, keepdim=True)))
        loss.backward()
        if t == 1:
            first_loss = loss.item()
        # rank 1 may report a loss stuck at its first value (a plateau) until step loss_flat_until
        opt.observe_loss(first_loss if rank == 1 and t < loss_flat_until else loss)
        if sync.skipped_buckets == skipped:
            synced_steps.append(t)
        opt.step()
    return dict(freeze_step=opt.freeze_step, last_synced=max(synced_steps),
                params=torch.cat([p.detach().reshape(-1) for p in net.parameters()]))


def scenario_agreement(rank: int, world_size: int) -> dict[str, Any]:
    return dict(agreeing=_train(rank, world_size, until=0), forced=_train(rank, world_size, until=110),
                forced_loss=_train(rank, world_size, until=0, loss_flat_until=110))


@pytest.mark.parametrize("world_size", [3])  # one all_reduce(MAX) for any size; 2-rank runs decide in the Lightning tests
def test_ranks_decide_the_same_step_even_when_their_figures_disagree(world_size: int) -> None:
    results = run_distributed(scenario_agreement, world_size, timeout_s=240)
    for name in ("agreeing", "forced", "forced_loss"):
        steps = {r[name]["freeze_step"] for r in results}
        assert len(steps) == 1 and None not in steps, (name, steps)
        step = steps.pop()
        # the DDP hook averaged gradients exactly up to the decided step, on every rank
        assert all(r[name]["last_synced"] == step for r in results)
        assert all(torch.equal(results[0][name]["params"], r[name]["params"]) for r in results[1:])
    agreeing, forced = results[0]["agreeing"]["freeze_step"], results[0]["forced"]["freeze_step"]
    forced_loss = results[0]["forced_loss"]["freeze_step"]
    # rank 1's figure moved (or its loss stayed flat) until step 110: every rank waited for it
    assert agreeing < 110 <= forced and 110 <= forced_loss, (agreeing, forced, forced_loss)


# ------------------------------------------------------------------------------------------------ Lightning
def _lightning_auto(rank: int, world_size: int, workdir: str) -> dict[str, Any]:
    import logging

    import lightning.pytorch as pl

    from lightning_onebit import CommunicationMonitor
    from tests.lightning_models import Regressor, flat_params, loader, trainer_kwargs

    class AutoRegressor(Regressor):
        def configure_optimizers(self) -> Any:
            # a short window, so that checks run within the 20 steps; a threshold nothing meets: max_step decides
            return OnebitAdam(self.parameters(), lr=self.lr, freeze_step="auto", dead_coordinates="ignore",
                              auto_freeze=AutoFreeze(window=4, check_every=2, threshold=1e-12))

    records: list[str] = []

    class Keep(logging.Handler):
        def emit(self, record: logging.LogRecord) -> None:
            records.append(record.getMessage())

    handler = Keep()
    logging.getLogger("lightning.pytorch.utilities.rank_zero").addHandler(handler)
    model = AutoRegressor()
    trainer = pl.Trainer(**trainer_kwargs(world_size, 40, callbacks=[CommunicationMonitor()]))
    trainer.fit(model, loader(rank, 40))
    logging.getLogger("lightning.pytorch.utilities.rank_zero").removeHandler(handler)
    opt = trainer.strategy.onebit_optimizer
    return dict(freeze_step=opt.freeze_step, reason=opt.freeze_detector.reason, max_step=opt.freeze_detector.max_step,
                last=opt.freeze_detector.last,
                metrics={k: float(v) for k, v in trainer.callback_metrics.items()}, final=flat_params(model),
                messages=records, progress_bar=dict(trainer.progress_bar_metrics))


def test_lightning_defaults_the_bound_logs_and_announces_the_decided_step(tmp_path: Any) -> None:
    results = run_distributed(_lightning_auto, 2, str(tmp_path), timeout_s=240)
    for r in results:
        # 40 steps: max_step defaults to half of them
        assert r["max_step"] == 20 and r["freeze_step"] == 20 and r["reason"] == "max_step"
        # the strategy fed the training loss to the detector (its pre_backward), so the loss guard had figures
        assert r["last"]["step"] == 20 and 0 < r["last"]["loss_ratio"] < float("inf")
        assert r["metrics"]["onebit/freeze_step"] == 20.0 and r["progress_bar"]["freeze"] == 20.0
    assert torch.equal(results[0]["final"], results[1]["final"])
    text = "\n".join(results[0]["messages"])
    assert "ends the warmup at step 20 at the latest (50% of 40 steps)" in text
    assert "until the variance settles (freeze_step='auto'" in text
    assert "freeze_step='auto' decided 20: max_step 20 reached" in text


@pytest.mark.parametrize(
    "max_step, beta2, window, check_every",
    [(150, 0.999, 24, 6), (300, 0.999, 48, 12), (30, 0.999, 4, 1), (5, 0.999, 4, 1), (6000, 0.999, 1000, 250),
     (400, 0.9, 10, 2)],
)
def test_the_default_window_is_a_sixth_of_the_bound_at_most_the_variance_time_constant(
    max_step: int, beta2: float, window: int, check_every: int
) -> None:
    """The window follows the run: a sixth of max_step (a multiple of 4, at least 4), at most 1 / (1 - beta2)."""
    from lightning_onebit.optim.auto_freeze import FreezeDetector

    given = FreezeDetector(AutoFreeze(max_step=max_step), beta2)
    assert (given.window, given.check_every, given.min_step) == (window, check_every, window)
    # without max_step the schedule waits for the bound the Lightning strategy derives from the run's length
    waiting = FreezeDetector(AutoFreeze(), beta2)
    assert waiting.window is None and "set when the run's length is known" in waiting.rule()
    assert waiting.bound_by_run(2 * max_step) == max_step
    assert (waiting.window, waiting.check_every, waiting.min_step) == (window, check_every, window)
    assert f"window {window}, " in waiting.rule() and f"check_every {check_every}, " in waiting.rule()
    # a window given explicitly is kept whatever the bound
    assert FreezeDetector(AutoFreeze(window=20, max_step=max_step), beta2).window == 20


def test_resume_with_other_measured_parameters_measures_afresh() -> None:
    """A resume during the warmup with a group switched to compress=False (its variance is no longer measured): the
    saved snapshots no longer fit, so the detector measures afresh instead of failing or comparing other
    coordinates, and still decides."""

    def make(params: list[nn.Parameter], last_compressed: bool) -> OnebitAdam:
        groups = [{"params": params[:2]}, {"params": params[2:], "compress": last_compressed}]
        return OnebitAdam(groups, lr=1e-3, betas=(0.9, 0.9), freeze_step="auto", dead_coordinates="ignore",
                          auto_freeze=AutoFreeze(max_step=400))

    params = _params()
    opt = make(params, True)
    for t in range(1, 71):
        _synthetic_gradients(params, t)
        opt.observe_loss(torch.tensor(_falling_loss(t)))
        opt.step()
    assert opt.freeze_step is None and opt.freeze_detector.last is not None  # still measuring, with comparisons
    resumed = make(params, False)
    resumed.load_state_dict(opt.state_dict())
    for t in range(71, 201):
        _synthetic_gradients(params, t)
        resumed.observe_loss(torch.tensor(_falling_loss(t)))
        resumed.step()
    detector = resumed.freeze_detector
    assert detector.reason == "settled"
    # the first comparison after the resume needs a full new window: not before step 72 + W
    assert resumed.freeze_step >= 72 + detector.window


@pytest.mark.parametrize(
    ("freeze_step", "max_step", "total", "warns"),
    [(50, None, 30, True), (30, None, 30, True), (29, None, 30, False), ("auto", 400, 320, True),
     ("auto", 80, 320, False), (50, None, float("inf"), False),
     (50, None, -1, False)],  # an iterable dataset without max_steps: Lightning estimates -1, the length is unknown
)
def test_a_run_that_would_end_in_the_warmup_is_warned_about(freeze_step: Any, max_step: Optional[int], total: float,
                                                             warns: bool) -> None:
    """freeze_step (or AutoFreeze's max_step) at or past the run's last step: the whole run would be plain DDP, which
    a user fine-tuning briefly with the example's max_step 400 would not notice without the warning."""
    import warnings
    from types import SimpleNamespace

    from lightning_onebit.strategy import OnebitStrategy

    auto = dict(auto_freeze=AutoFreeze(max_step=max_step)) if freeze_step == "auto" else {}
    opt = OnebitAdam(_params(), lr=1e-3, freeze_step=freeze_step, **auto)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        OnebitStrategy._warn_if_run_ends_in_warmup(SimpleNamespace(estimated_stepping_batches=total), opt)
    messages = [str(w.message) for w in caught if "compression never starts" in str(w.message)]
    assert len(messages) == int(warns), messages
    if warns:
        assert f"run has {int(total)} optimizer steps" in messages[0]
        assert ("AutoFreeze(max_step=400)" if freeze_step == "auto" else f"freeze_step={freeze_step}") in messages[0]


@pytest.mark.parametrize("total", [-1, float("inf")])
def test_the_default_bound_refuses_a_run_of_unknown_length(total: float) -> None:
    """Half of an unknown length (no max_steps/max_epochs, or an iterable dataset without max_steps, which Lightning
    estimates as -1) is an error naming the fixes, not a bound of step 1."""
    from types import SimpleNamespace

    from lightning_onebit.strategy import OnebitStrategy

    opt = OnebitAdam(_params(), lr=1e-3, freeze_step="auto")
    with pytest.raises(ValueError, match="length is unknown.*AutoFreeze\\(max_step=...\\)"):
        OnebitStrategy._default_auto_freeze_bound(SimpleNamespace(estimated_stepping_batches=total), opt)
    assert opt.freeze_detector.max_step is None


@pytest.mark.parametrize("name", ["onebit_adam", "onebit_fsdp"])
def test_the_bound_and_the_warmup_warning_speak_in_the_strategys_name(name: str, caplog: Any) -> None:
    """Under ``onebit_fsdp`` the bound and the run-ends-in-warmup warning named ``onebit_adam``, a strategy the user
    did not choose."""
    import logging
    import warnings
    from types import SimpleNamespace

    from lightning_onebit.strategy.auto_freeze import default_auto_freeze_bound, warn_if_run_ends_in_warmup

    trainer = SimpleNamespace(estimated_stepping_batches=40)
    with caplog.at_level(logging.INFO):
        default_auto_freeze_bound(trainer, OnebitAdam(_params(), lr=1e-3, freeze_step="auto"), name=name)
    assert f"{name}: freeze_step='auto' ends the warmup at step 20 at the latest" in caplog.text
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        warn_if_run_ends_in_warmup(trainer, OnebitAdam(_params(), lr=1e-3, freeze_step=40), name=name)
    assert [str(w.message).split(":")[0] for w in caught if "compression never starts" in str(w.message)] == [name]


def test_the_loss_sum_stays_on_the_losses_device_after_a_resume() -> None:
    """A resumed detector holds its pending loss sum as a number and adds it on the device of the next loss: with a
    CPU tensor there, every micro-batch on a GPU copied its loss to the host (a synchronisation) until the next check.
    The device is seen with FakeTensorMode, whose tensors live on "cuda" without a GPU."""
    from torch._subclasses.fake_tensor import FakeTensorMode

    from lightning_onebit.optim.auto_freeze import FreezeDetector

    saved = FreezeDetector(AutoFreeze(max_step=100), 0.999)
    saved.record_loss(torch.tensor(1.25))
    saved.record_loss(0.5)
    state = saved.state_dict()
    assert state["losses"]["sum"] == 1.75 and state["losses"]["count"] == 2
    detector = FreezeDetector(AutoFreeze(max_step=100), 0.999)
    detector.load_state_dict(copy.deepcopy(state))
    with FakeTensorMode():
        loss = torch.empty((), device="cuda")
        for _ in range(3):
            detector.record_loss(loss)
            assert detector._loss_sum.device.type == "cuda"
        detector.record_loss(0.25)  # a number joins the sum where it is
        assert detector._loss_sum.device.type == "cuda" and detector._loss_count == 6
    # on real tensors the carried sum is counted once
    detector = FreezeDetector(AutoFreeze(max_step=100), 0.999)
    detector.load_state_dict(copy.deepcopy(state))
    detector.record_loss(torch.tensor(2.0))
    assert float(detector._loss_sum) == 3.75 and detector.state_dict()["losses"]["count"] == 3


@pytest.mark.parametrize("optimizer_class", [OnebitAdam, OnebitLamb])
def test_a_check_reads_the_device_once_not_per_tensor(optimizer_class: type) -> None:
    """The figures of a check (variance sums and sample, LAMB's trust-ratio EMAs, the loss sum) are gathered on the
    device and read with one copy per device; before, each tensor's sum and sample were read on their own (about 2
    host synchronisations per tensor on a GPU)."""
    from tests.detectors import count_host_syncs

    torch.manual_seed(0)
    params = [nn.Parameter(torch.randn(7, 5)) for _ in range(12)]
    opt = optimizer_class(params, lr=1e-3, freeze_step="auto", auto_freeze=AutoFreeze(max_step=400, window=8),
                          dead_coordinates="ignore")
    for t in range(1, 4):
        _synthetic_gradients(params, t)
        opt.observe_loss(torch.tensor(_falling_loss(t)))
        opt.step()
    with count_host_syncs() as syncs:
        snapshot, loss = opt.freeze_detector._snapshot(opt._variance_reading())
    # one device-to-host copy of everything (it was 12 reads: one float(v.sum()) per tensor); the counter also sees
    # the float() of the loss sum, which reads that host copy (CPU memory, no device involved)
    assert sorted(e.what for e in syncs.events) in (["cpu"], ["__float__", "cpu"]), syncs.summary()
    assert [e.where for e in syncs.events if e.what == "cpu"][0].endswith("read_on_host"), syncs.summary()
    assert loss == float(torch.tensor(_falling_loss(3)))  # the losses since the check at step 2 (check_every 2)
    assert snapshot[1].shape == (12,) and (snapshot[2].shape == (12,)) == (optimizer_class is OnebitLamb)


def _settled_snapshot(coefficients: list[float]) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """A snapshot whose variance figures are steady (so only the trust ratios can fail the check)."""
    sums = torch.ones(len(coefficients), dtype=torch.float64)
    return torch.ones(4, dtype=torch.float64), sums, torch.tensor(coefficients, dtype=torch.float64)


@pytest.mark.parametrize(
    "numels, before, after, passes",
    [
        # a 5-coordinate tensor's ratio swings by 66% while the big tensor's holds: the coordinates' average has
        # settled (as on AG News, where the largest tensor's change alone held 1-bit LAMB until its bound)
        ([1000, 5], [1.0, 1.0], [1.05, 1.66], True),
        # the big tensor's ratio still moves by 40%: the average is above 0.3
        ([1000, 5], [1.0, 1.0], [1.4, 1.0], False),
        # any tensor's ratio more than doubling (a change above tensor_threshold 1.0) holds the warmup
        ([1000, 5], [1.0, 1.0], [1.0, 2.5], False),
    ],
)
def test_trust_ratios_are_read_like_the_variance_averaged_over_coordinates_and_per_tensor(
    numels: list[int], before: list[float], after: list[float], passes: bool
) -> None:
    from lightning_onebit.optim.auto_freeze_figures import excesses

    config = AutoFreeze()
    decays = [(0.9**4, 1.0)] * len(numels)  # no bias correction: a steady variance gives no excess
    sample, tensor, mean, largest = excesses(
        _settled_snapshot(before), _settled_snapshot(after), decays, torch.tensor([4, 0]), numels
    )
    assert sample == pytest.approx(0) and tensor == pytest.approx(0)
    assert mean == pytest.approx(sum(n * abs(a - b) / b for n, a, b in zip(numels, after, before)) / sum(numels))
    assert largest == pytest.approx(max(abs(a - b) / b for a, b in zip(after, before)))
    assert (mean < config.threshold and largest < config.tensor_threshold) is passes


def test_settling_figures_must_give_one_value_per_measured_tensor() -> None:
    from lightning_onebit.optim.auto_freeze_figures import excesses

    with pytest.raises(ValueError, match="one per tensor"):
        excesses(_settled_snapshot([1.0]), _settled_snapshot([1.0]), [(0.5, 1.0)] * 2, torch.tensor([4, 0]), [3, 3])
