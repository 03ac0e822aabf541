"""``freeze_step="auto"`` (``AutoFreeze``): the warmup ends when the variance has stopped moving.

* A synthetic problem whose gradient scale grows until a known step and is constant after it: no freeze before that
  step, a freeze within a few windows after it, and both bounds respected.
* 2 and 3 gloo ranks with different data decide the same step; when one rank's figures are forced to disagree, the
  ``all_reduce(MAX)`` makes every rank wait for it, and the DDP hook switches at the decided step on every rank.
* A resume before the decision goes on measuring and decides the same step; a resume after it keeps the step.
"""

from __future__ import annotations

import copy
from typing import Any, Optional

import pytest
import torch
from torch import nn
from torch.nn.parallel import DistributedDataParallel as DDP

from lightning_onebit import AutoFreeze, GradientSyncState, OnebitAdam, OnebitLamb, switchable_allreduce_hook
from tests.distributed import run_distributed

GROWS_UNTIL = 60  # the gradient scale grows 10% per step until this step, then stays constant


def _params() -> list[nn.Parameter]:
    torch.manual_seed(0)
    return [nn.Parameter(torch.randn(40, 30)), nn.Parameter(torch.randn(30)), nn.Parameter(torch.randn(5))]


def _synthetic_gradients(params: list[nn.Parameter], t: int) -> None:
    scale = 1.1 ** min(t, GROWS_UNTIL)
    for i, p in enumerate(params):
        pattern = torch.randn(p.shape, generator=torch.Generator().manual_seed(i))
        p.grad = scale * pattern * (1 + 0.01 * (-1) ** t)  # a little wobble, as real gradients have


def _run(optimizer_class: type, steps: int, state: Optional[dict] = None, start: int = 1, **auto: Any) -> dict:
    params = _params()
    config = AutoFreeze(**{"max_step": 400, **auto})
    opt = optimizer_class(params, lr=1e-3, betas=(0.9, 0.9), freeze_step="auto", auto_freeze=config,
                          warn_dead_coordinates=False)
    if state is not None:
        for p, value in zip(params, state["params"]):
            p.data.copy_(value)
        opt.load_state_dict(state["optimizer"])
    out: dict[str, Any] = dict(saved={})
    for t in range(start, steps + 1):
        _synthetic_gradients(params, t)
        opt.step()
        if t in (70, 120):
            out["saved"][t] = dict(params=[p.detach().clone() for p in params],
                                   optimizer=copy.deepcopy(opt.state_dict()))
    out.update(freeze_step=opt.freeze_step, detector=opt.freeze_detector, params=[p.detach().clone() for p in params],
               stage=opt.stage.value)
    return out


@pytest.mark.parametrize("optimizer_class", [OnebitAdam, OnebitLamb])
def test_freezes_after_the_statistics_stop_changing_and_not_before(optimizer_class: type) -> None:
    result = _run(optimizer_class, 200)
    detector = result["detector"]
    # beta2 0.9: window 10 steps, a check every 2
    assert detector.window == 10 and detector.check_every == 2 and detector.reason == "settled"
    assert GROWS_UNTIL < result["freeze_step"] <= GROWS_UNTIL + 6 * detector.window, result["freeze_step"]
    assert result["stage"] == "compression"
    last = detector.last
    assert last["streak"] >= 3 and max(last["sample_change"], last["norm_change"]) < 0.05
    assert "relative change of sqrt(v) over 10 steps" in detector.describe()


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
        (dict(freeze_step=10, auto_freeze=AutoFreeze()), "drop auto_freeze"),
        (dict(freeze_step="sometime"), "'auto'"),
    ],
)
def test_bad_arguments_are_refused(kwargs: dict[str, Any], message: str) -> None:
    with pytest.raises(ValueError, match=message):
        OnebitAdam(_params(), **kwargs)


@pytest.mark.parametrize(
    "kwargs, message",
    [
        (dict(window=10, check_every=3), "multiple of check_every"),
        (dict(threshold=0), "threshold"),
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
        return torch.tensor([1.5**self._step if moving else 1.0])


def _train(rank: int, world_size: int, until: int) -> dict[str, Any]:
    net = Net()
    ddp = DDP(net)
    StubbornOnebitAdam.until = until
    opt = StubbornOnebitAdam(net.parameters(), lr=1e-3, betas=(0.9, 0.9), freeze_step="auto",
                             # a loose threshold: this test is about agreement, the synthetic ones about detection
                             auto_freeze=AutoFreeze(threshold=0.4, max_step=300), warn_dead_coordinates=False)
    sync = GradientSyncState(sync_predicate=lambda: opt.needs_gradient_allreduce)
    ddp.register_comm_hook(sync, switchable_allreduce_hook)
    synced_steps = []
    for t in range(1, 151):
        # different data on every rank, the same batch every step: the averaged gradient changes slowly
        x = torch.randn(16, 6, generator=torch.Generator().manual_seed(1000 * rank)) * (1 + 0.01 * (-1) ** t)
        skipped = sync.skipped_buckets
        opt.zero_grad()
        nn.functional.mse_loss(ddp(x), torch.sin(x.sum(1, keepdim=True))).backward()
        if sync.skipped_buckets == skipped:
            synced_steps.append(t)
        opt.step()
    return dict(freeze_step=opt.freeze_step, last_synced=max(synced_steps),
                params=torch.cat([p.detach().reshape(-1) for p in net.parameters()]))


def scenario_agreement(rank: int, world_size: int) -> dict[str, Any]:
    return dict(agreeing=_train(rank, world_size, until=0), forced=_train(rank, world_size, until=110))


@pytest.mark.parametrize("world_size", [2, 3])
def test_ranks_decide_the_same_step_even_when_their_figures_disagree(world_size: int) -> None:
    results = run_distributed(scenario_agreement, world_size, timeout_s=240)
    for name in ("agreeing", "forced"):
        steps = {r[name]["freeze_step"] for r in results}
        assert len(steps) == 1 and None not in steps, (name, steps)
        step = steps.pop()
        # the DDP hook averaged gradients exactly up to the decided step, on every rank
        assert all(r[name]["last_synced"] == step for r in results)
        assert all(torch.equal(results[0][name]["params"], r[name]["params"]) for r in results[1:])
    agreeing, forced = results[0]["agreeing"]["freeze_step"], results[0]["forced"]["freeze_step"]
    # rank 1's figure moved until step 110: every rank waited for it to settle
    assert agreeing < 110 <= forced


# ------------------------------------------------------------------------------------------------ Lightning
def _lightning_auto(rank: int, world_size: int, workdir: str) -> dict[str, Any]:
    import logging

    import lightning.pytorch as pl

    from lightning_onebit import CommunicationMonitor
    from tests.lightning_models import Regressor, flat_params, loader, trainer_kwargs

    class AutoRegressor(Regressor):
        def configure_optimizers(self) -> Any:
            return OnebitAdam(self.parameters(), lr=self.lr, freeze_step="auto", warn_dead_coordinates=False)

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
                metrics={k: float(v) for k, v in trainer.callback_metrics.items()}, final=flat_params(model),
                messages=records, progress_bar=dict(trainer.progress_bar_metrics))


def test_lightning_defaults_the_bound_logs_and_announces_the_decided_step(tmp_path: Any) -> None:
    results = run_distributed(_lightning_auto, 2, str(tmp_path), timeout_s=240)
    for r in results:
        # 40 steps: max_step defaults to 25% of them; the default window (1000 steps) cannot settle that soon
        assert r["max_step"] == 10 and r["freeze_step"] == 10 and r["reason"] == "max_step"
        assert r["metrics"]["onebit/freeze_step"] == 10.0 and r["progress_bar"]["freeze"] == 10.0
    assert torch.equal(results[0]["final"], results[1]["final"])
    text = "\n".join(results[0]["messages"])
    assert "ends the warmup at step 10 at the latest (25% of 40 steps)" in text
    assert "until the variance settles (freeze_step='auto'" in text
    assert "freeze_step='auto' decided 10: max_step 10 reached" in text
