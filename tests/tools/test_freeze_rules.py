"""benchmarks/freeze_rules.py: the replayed figures on traces whose gradients are known in closed form."""

from __future__ import annotations

import math

import pytest

from benchmarks.freeze_rules import Trace, decide

BETA2 = 0.999


def make_trace(grad_sq, steps: int, loss=lambda t: 1.0) -> dict:
    """A VarianceTrace-shaped dict for two tensors whose squared gradients at step t are ``grad_sq(t)`` and
    ``4 * grad_sq(t)``, recorded every 10 steps (the raw EMA ``v`` computed step by step, as Adam does)."""
    v = [0.0, 0.0]
    trace = dict(steps=[], mean_v=[], loss=[])
    for t in range(1, steps + 1):
        g2 = grad_sq(t)
        v = [BETA2 * v[0] + (1 - BETA2) * g2, BETA2 * v[1] + (1 - BETA2) * 4 * g2]
        if t % 10 == 0:
            trace["steps"].append(t)
            trace["mean_v"].append(list(v))
            trace["loss"].append(loss(t))
    return trace


def test_constant_gradients_show_no_change() -> None:
    trace = Trace(make_trace(lambda t: 2.0, 400), run_steps=400, beta2=BETA2)
    figures = trace.figures(200, 40)
    for name in ("excess", "ratio", "drift", "horizon"):
        assert figures[name][0] == pytest.approx(0.0, abs=1e-9) and figures[name][1] == pytest.approx(0.0, abs=1e-9)


def test_shrinking_gradients_are_seen_by_the_two_sided_figures_only() -> None:
    # squared gradients halve every 100 steps: the window's mean is below the variance of a window ago
    trace = Trace(make_trace(lambda t: 2.0 ** (-t / 100), 600), run_steps=600, beta2=BETA2)
    figures = trace.figures(200, 60)
    assert figures["excess"][1] == 0.0  # the shipped rule's figure counts growth only
    assert figures["ratio"][0] > 0.2 and figures["drift"][0] > 0.05 and figures["horizon"][0] > 0.05
    # the window moment is exact: E of squared gradients 2^(-t/100) weighted as the EMA weights them
    a = BETA2**60
    weights = [(1 - BETA2) * BETA2 ** (200 - s) for s in range(141, 201)]
    moment = sum(w * 2.0 ** (-s / 100) for w, s in zip(weights, range(141, 201))) / (1 - a)
    v_old = sum((1 - BETA2) * BETA2 ** (140 - s) * 2.0 ** (-s / 100) for s in range(1, 141)) / (1 - BETA2**140)
    assert figures["ratio"][0] == pytest.approx(abs(0.5 * math.log(moment / v_old)), rel=1e-9)


def test_decide_waits_for_the_loss_guard_and_patience_and_falls_back_to_max_step() -> None:
    # constant gradients (every figure 0) but a loss that drops by 10% only after step 150
    trace = Trace(make_trace(lambda t: 1.0, 400, loss=lambda t: 1.0 if t <= 150 else 0.5), run_steps=400, beta2=BETA2)
    step, reason = decide(trace, "ratio", 0, 0.1, window=40, check_every=10, patience=3, min_step=40, max_step=200,
                          loss_drop=0.1)
    # the mean loss of the records in the last 40 steps is at most 0.9 of the first from step 160 on (records 130..160:
    # 1, 1, 1, 0.5 -> 0.875): three passing checks end at 180
    assert (step, reason) == (180, "settled")
    step, reason = decide(trace, "ratio", 0, 0.1, window=40, check_every=10, patience=3, min_step=40, max_step=200,
                          loss_drop=None)
    assert (step, reason) == (70, "settled")  # a record 40 steps before from step 50 on: 50, 60, 70 pass
    shrinking = Trace(make_trace(lambda t: 2.0 ** (-t / 100), 400), run_steps=400, beta2=BETA2)
    assert decide(shrinking, "ratio", 0, 0.05, 40, 10, 3, 40, 200, None) == (200, "max_step")
