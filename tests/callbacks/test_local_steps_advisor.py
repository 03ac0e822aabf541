"""Tests of "how often to sync?": LocalStepsAdvice (the average step with a sync every H steps, and the H that keeps it
within a bound of the no-communication floor), and the advice CommunicationMonitor gives under onebit_diloco.

The multi-rank fits make the outer sync slow by sleeping ``SYNC_DELAY_S`` at the start of every ``OuterStep.start``
(every rank, as a slow link between nodes would delay every replica's exchange)."""

from __future__ import annotations

import math
import os
import time
from contextlib import contextmanager
from functools import partial
from typing import Any, Iterator

import lightning.pytorch as pl
import pytest
import torch
from lightning.pytorch.loggers import CSVLogger
from torch import nn

from lightning_onebit import CommunicationMonitor, LocalStepsAdvice, OnebitDiLoCoStrategy
from lightning_onebit.optim.outer_step import OuterStep
from tests.capture import capture_logs, logged_columns
from tests.distributed import run_sessions, scenario_results
from tests.lightning_models import Regressor, loader, trainer_kwargs

SYNC_DELAY_S = 0.25  # added to every outer sync
SYNC_EVERY = 4
ADVISE_STEPS = 3
# steps 1-2 settle, the sync at step 4 lays buffers out: the syncs at steps 8 and 12 are the 2 timed ones
ADVISED_AT = 3 * SYNC_EVERY
VALIDATION_S = 1.0  # a validation loop's wall time, just before a sync step
ADVISOR_COLUMNS = ("advisor/inner_step_ms", "advisor/sync_ms", "advisor/expected_step_ms",
                   "advisor/suggested_sync_every")


# ======================================================================================== LocalStepsAdvice alone
def advice(**overrides: Any) -> LocalStepsAdvice:
    figures: dict[str, Any] = dict(inner_step_s=0.12, sync_s=2.4, sync_every=32, bytes_per_sync=1.1e6, steps_timed=20,
                                   syncs_timed=3)
    figures.update(overrides)
    return LocalStepsAdvice(**figures)


def test_the_average_step_adds_a_sync_every_sync_every_steps() -> None:
    a = advice()
    assert a.expected_step_s == pytest.approx(0.12 + 2.4 / 32)
    assert a.slowdown == pytest.approx((0.12 + 2.4 / 32) / 0.12)
    assert advice(sync_every=1).expected_step_s == pytest.approx(0.12 + 2.4)
    # ceil(2.4 / (0.15 x 0.12)) = ceil(133.3)
    assert a.suggested_sync_every() == 134
    assert a.suggested_sync_every(target=1.5) == math.ceil(2.4 / (0.5 * 0.12)) == 40
    assert a.metrics() == {"advisor/inner_step_ms": pytest.approx(120.0), "advisor/sync_ms": pytest.approx(2400.0),
                           "advisor/expected_step_ms": pytest.approx(195.0), "advisor/suggested_sync_every": 134.0}


def test_the_suggestion_is_the_smallest_sync_every_within_the_target_on_the_boundary_too() -> None:
    # 0.1 + 0.3 / 20 is exactly 1.15 x 0.1: 20 is within (a plain ceil of the float quotient gives 21), 19 is not
    on_the_boundary = advice(inner_step_s=0.1, sync_s=0.3)
    assert on_the_boundary.suggested_sync_every() == 20
    assert advice(inner_step_s=0.1, sync_s=0.3 * (1 + 1e-6)).suggested_sync_every() == 21
    assert advice(inner_step_s=0.1, sync_s=0.3 * (1 - 1e-6)).suggested_sync_every() == 20
    for inner, sync, target in ((0.12, 2.4, 1.15), (0.037, 0.8, 1.1), (1.3, 0.2, 1.05), (0.004, 0.25, 1.15)):
        h = advice(inner_step_s=inner, sync_s=sync).suggested_sync_every(target)
        assert inner + sync / h <= target * inner * (1 + 1e-9), (inner, sync, target, h)
        assert h == 1 or inner + sync / (h - 1) > target * inner, (inner, sync, target, h)
    # a sync cheaper than the allowed slowdown of one step: every step may sync
    assert advice(inner_step_s=1.0, sync_s=0.1).suggested_sync_every() == 1


def test_message_gives_the_figures_and_the_sync_every_that_keeps_the_step_within_the_target() -> None:
    text = advice().message()
    for figure in ("inner step 120 ms", "median of 20 steps", "an outer sync adds 2.40 s", "1.1 MB per rank",
                   "median of 3 syncs", "sync_every=32", "averages 195 ms", "1.63x the no-communication floor",
                   "sync_every >= 134 keeps it within 1.15x", "accuracy may drop",
                   "docs/guides/local-steps.md#how-often-to-sync-the-advisor"):
        assert figure in text, (figure, text)
    assert "sync_every >= 40 keeps it within 1.50x" in advice().message(target=1.5)


def test_message_says_plainly_when_the_current_sync_every_is_within_the_target() -> None:
    text = advice(sync_s=0.3).message()  # 120 ms + 300 ms / 32 = 129 ms, 1.08x
    assert "averages 129 ms, 1.08x" in text and "within 1.15x" in text, text
    assert "sync_every down to 17 would still be (more syncs are affordable)" in text, text  # ceil(16.7)
    assert ">=" not in text
    exactly = advice(inner_step_s=0.1, sync_s=0.3, sync_every=20).message()
    assert "within 1.15x" in exactly and "no smaller sync_every would be" in exactly, exactly


def test_a_sync_that_costs_nothing_allows_a_sync_every_step() -> None:
    free = advice(sync_s=0.0)
    assert free.expected_step_s == 0.12 and free.slowdown == 1.0
    assert free.suggested_sync_every() == 1
    text = free.message()
    assert "adds no measurable time" in text and "1.00x" in text and "sync_every down to 1" in text, text


def test_figures_and_target_are_checked() -> None:
    with pytest.raises(ValueError, match="inner_step_s must be a finite number > 0"):
        advice(inner_step_s=0.0)
    with pytest.raises(ValueError, match="sync_s must be a finite number >= 0"):
        advice(sync_s=-0.1)
    with pytest.raises(ValueError, match="sync_every must be an integer >= 1"):
        advice(sync_every=0)
    for bad in (1.0, 0.9, float("nan")):
        with pytest.raises(ValueError, match="target must be a finite number > 1"):
            advice().suggested_sync_every(bad)


# ======================================================================================== CommunicationMonitor's advice
@contextmanager
def slow_outer_sync(delay_s: float) -> Iterator[None]:
    """Every outer sync starts ``delay_s`` late (on every rank)."""
    real = OuterStep.start

    def start(self: OuterStep) -> None:
        time.sleep(delay_s)
        real(self)

    OuterStep.start = start  # type: ignore[method-assign]
    try:
        yield
    finally:
        OuterStep.start = real  # type: ignore[method-assign]


class SlowValidationRegressor(Regressor):
    def validation_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        time.sleep(VALIDATION_S)
        x, y = batch
        return nn.functional.mse_loss(self(x), y)


def _fit(rank: int, world_size: int, workdir: str, name: str, *, max_steps: int = ADVISED_AT, delay_s: float = 0.0,
         per_replica: int = 1, advise: bool = True, validate_before_sync: bool = False) -> dict[str, Any]:
    monitor = CommunicationMonitor(prog_bar=False, advise=advise, advise_steps=ADVISE_STEPS)
    strategy = OnebitDiLoCoStrategy(sync_every=SYNC_EVERY, compressor="onebit", ranks_per_node=per_replica)
    logger = CSVLogger(workdir, name=name, version=0)
    model_type = SlowValidationRegressor if validate_before_sync else Regressor
    # a validation after step 2 x SYNC_EVERY - 1: its time falls in the wall time of the first timed sync step
    extra = dict(limit_val_batches=1, val_check_interval=2 * SYNC_EVERY - 1) if validate_before_sync else dict(
        limit_val_batches=0)
    trainer = pl.Trainer(**trainer_kwargs(world_size, max_steps, strategy=strategy, callbacks=[monitor], logger=logger,
                                          log_every_n_steps=1, **extra))
    with capture_logs() as messages, slow_outer_sync(delay_s):
        trainer.fit(model_type(optimizer="adamw", seed=0), loader(rank, 20),
                    loader(100, 1) if validate_before_sync else None)
    return dict(advice=monitor.advice, messages=[m for m in messages if "advice" in m or "advisor" in m],
                csv=os.path.join(logger.log_dir, "metrics.csv"), syncs=strategy.outer_syncs,
                bytes_per_sync=strategy.last_sync_communication.bytes_sent_inter_node)


SCENARIOS = {
    2: (("slow_sync", partial(_fit, name="slow_sync", delay_s=SYNC_DELAY_S)),
        ("too_short", partial(_fit, name="too_short", max_steps=ADVISED_AT - 1, delay_s=SYNC_DELAY_S)),
        ("not_advised", partial(_fit, name="not_advised", advise=False)),
        ("validation", partial(_fit, name="validation", max_steps=ADVISED_AT + SYNC_EVERY, validate_before_sync=True))),
    4: (("slow_sync_2x2", partial(_fit, name="slow_sync_2x2", delay_s=SYNC_DELAY_S, per_replica=2)),),
}


@pytest.fixture(scope="module")
def sessions(tmp_path_factory: pytest.TempPathFactory) -> dict[int, list[dict[str, Any]]]:
    return run_sessions(SCENARIOS, tmp_path_factory, "local_steps_advisor", timeout_s=240.0)


@pytest.mark.parametrize("world_size, name", [(2, "slow_sync"), (4, "slow_sync_2x2")])
def test_a_slow_sync_is_measured_and_the_advice_asks_for_fewer_syncs(sessions, world_size: int, name: str) -> None:
    results = scenario_results(sessions[world_size], name)
    a = results[0]["advice"]
    assert isinstance(a, LocalStepsAdvice)
    assert all(r["advice"] == a for r in results)  # one advice, agreed by every rank
    assert a.sync_every == SYNC_EVERY and a.steps_timed == ADVISE_STEPS and a.syncs_timed == 2
    # every sync step slept SYNC_DELAY_S; the bounds leave room for a rank descheduled on a loaded machine (medians,
    # and the sync's cost is the least-waiting rank's)
    assert 0.8 * SYNC_DELAY_S <= a.sync_s < SYNC_DELAY_S + 1.5, a
    assert 0.0 < a.inner_step_s < 0.2, a
    assert a.expected_step_s == pytest.approx(a.inner_step_s + a.sync_s / SYNC_EVERY)
    suggested = a.suggested_sync_every()
    assert suggested == math.ceil(a.sync_s / (0.15 * a.inner_step_s) * (1 - 1e-9))
    assert suggested > SYNC_EVERY  # a sync costs far more than 15% of 4 inner steps
    assert a.bytes_per_sync == max(r["bytes_per_sync"] for r in results) > 0
    # said once, on rank 0 only, and logged once
    (message,) = results[0]["messages"]
    assert message.startswith("onebit_diloco advisor: ") and f"sync_every >= {suggested} keeps it" in message, message
    assert all(r["messages"] == [] for r in results[1:])
    logged = logged_columns(results[0]["csv"], "advisor/")
    assert set(logged) == set(ADVISOR_COLUMNS), logged
    assert logged["advisor/inner_step_ms"] == [pytest.approx(1000 * a.inner_step_s)]
    assert logged["advisor/sync_ms"] == [pytest.approx(1000 * a.sync_s)]
    assert logged["advisor/expected_step_ms"] == [pytest.approx(1000 * a.expected_step_s)]
    assert logged["advisor/suggested_sync_every"] == [suggested]


def test_a_fit_too_short_to_time_two_syncs_says_so(sessions) -> None:
    results = scenario_results(sessions[2], "too_short")
    assert all(r["advice"] is None and r["syncs"] == 3 for r in results)  # syncs at 4, 8 and the end of fit's
    (message,) = results[0]["messages"]
    assert "no local-steps advice" in message and "1 with one" in message and "sync_every=4" in message, message
    assert "at least 12 steps" in message, message
    assert results[1]["messages"] == []
    assert logged_columns(results[0]["csv"], "advisor/") == {}


def test_no_advice_without_advise(sessions) -> None:
    results = scenario_results(sessions[2], "not_advised")
    assert all(r["advice"] is None and r["messages"] == [] and r["syncs"] == ADVISED_AT // SYNC_EVERY for r in results)
    assert logged_columns(results[0]["csv"], "advisor/") == {}


def test_a_validation_loop_before_a_sync_step_is_not_counted_as_the_sync(sessions) -> None:
    results = scenario_results(sessions[2], "validation")
    a = results[0]["advice"]
    assert isinstance(a, LocalStepsAdvice) and all(r["advice"] == a for r in results)
    # the sync at step 8 came right after a validation of VALIDATION_S: its step is not timed, so the syncs at
    # 12 and 16 are (counted in the median, it would be at least VALIDATION_S / 2)
    assert a.syncs_timed == 2 and a.sync_s < 0.3 * VALIDATION_S, a
