"""Issue 26's study: replay candidate ``freeze_step="auto"`` rules on the variance traces of ``freeze_sweep.py``.

Every run of ``python -m benchmarks.freeze_sweep`` records a variance trace
(:class:`benchmarks.freeze_sweep.VarianceTrace`): every 10 optimizer steps, per parameter tensor, ``mean(v)`` and
``mean(sqrt(v))`` of the raw variance, and the mean training loss. An AdamW run's trace is the variance a 1-bit
optimizer's warmup would have had at every step (the warmup is that optimizer's full-precision update on averaged
gradients), so a rule that reads per-tensor figures can be replayed on it offline: at which step would it have ended
the warmup? Set against the accuracy of fixed freeze steps on the same task and seed, that says which rule freezes
where freezing stops costing accuracy.

Per tensor ``T``, at a check ``t`` with the record ``W`` steps before (``a = beta2^W``, ``c_t = 1 - beta2^t``):

* ``v_hat_T(t) = mean_v_T(t) / c_t``: the variance an update at ``t`` divides by (its mean over the tensor);
* ``E_T = (mean_v_T(t) - a mean_v_T(t - W)) / (1 - a)``: the mean squared gradient of the window;
* ``excess``: ``max(0, sqrt(E_T / v_hat_T(t - W)) - 1)``, the shipped rule's per-tensor figure (gradients of the last
  window above the ``sqrt(v_hat)`` frozen a window ago; only growth counts);
* ``ratio``: ``|log sqrt(E_T / v_hat_T(t - W))|``, the same two-sided (shrinking gradients count too: a variance
  frozen while gradients still shrink is too large for the rest of the run, and its steps too small);
* ``drift``: ``|log sqrt(v_hat_T(t) / v_hat_T(t - W))|``, how much Adam's own ``sqrt(v_hat)`` moved over the window;
* ``horizon``: ``|log sqrt(v_hat_T(end) / v_hat_T(t))|`` with ``v_hat_T(end)`` the variance Adam would reach at the
  run's last step if the window's ``E_T`` went on: ``(beta2^R mean_v_T(t) + (1 - beta2^R) E_T) / c_end`` with ``R``
  the steps left. The mismatch a freeze now would leave at the end of the run.

Each figure is summarised over the tensors whose variance is not numerically zero (``v_hat`` above 1e-8 of the median
tensor's) as the median and the 90th percentile. A candidate rule passes a check when its summary is below a threshold
and the training loss of the last window is at least ``loss_drop`` below that of the first record (the shipped loss
guard); it decides at the first check from ``min_step`` on that ends ``patience`` passing checks in a row, and at
``max_step`` otherwise.

    python -m benchmarks.freeze_rules                      # every AdamW trace in results/freeze_sweep.json
    python -m benchmarks.freeze_rules --windows 40 60 --figures ratio horizon --curves
"""

from __future__ import annotations

import json
import math
import statistics
from pathlib import Path
from typing import Any, Iterator, Optional

from benchmarks.common import RESULTS_DIR, argument_parser

FIGURES = ("excess", "ratio", "drift", "horizon")
_NEGLIGIBLE_VARIANCE = 1e-8


def _quantile(values: list[float], q: float) -> float:
    ordered = sorted(values)
    position = q * (len(ordered) - 1)
    low, high = math.floor(position), math.ceil(position)
    return ordered[low] + (ordered[high] - ordered[low]) * (position - low)


class Trace:
    """One run's variance trace (the ``trace`` of a ``freeze_sweep.json`` record) and the run's length."""

    def __init__(self, trace: dict[str, Any], run_steps: int, beta2: float) -> None:
        if not trace.get("mean_v"):
            raise ValueError("the trace has no mean_v (recorded before freeze_sweep.py traced it): rerun the run")
        self.steps: list[int] = trace["steps"]
        self.mean_v: list[list[Optional[float]]] = trace["mean_v"]
        self.loss: list[Optional[float]] = trace["loss"]
        self.run_steps, self.beta2 = run_steps, beta2
        self.at = {step: i for i, step in enumerate(self.steps)}

    def v_hat(self, i: int) -> list[Optional[float]]:
        correction = 1 - self.beta2 ** self.steps[i]
        return [None if v is None else v / correction for v in self.mean_v[i]]

    def figures(self, t: int, window: int) -> Optional[dict[str, tuple[float, float]]]:
        """``{figure: (median, p90)}`` over live tensors at step ``t``; ``None`` without a record ``window`` before."""
        if t not in self.at or t - window not in self.at:
            return None
        i, j = self.at[t], self.at[t - window]
        a = self.beta2**window
        left = self.run_steps - t
        decay_left = self.beta2**left
        end_correction = 1 - self.beta2**self.run_steps
        old_hat, new_hat = self.v_hat(j), self.v_hat(i)
        live_old = [v for v in old_hat if v is not None and v > 0]
        if not live_old:
            return None
        floor = _NEGLIGIBLE_VARIANCE * statistics.median(live_old)
        values: dict[str, list[float]] = {name: [] for name in FIGURES}
        for v_old_raw, v_new_raw, h_old, h_new in zip(self.mean_v[j], self.mean_v[i], old_hat, new_hat):
            if None in (v_old_raw, v_new_raw, h_old, h_new) or h_old <= floor or h_new <= 0:
                continue
            moment = max((v_new_raw - a * v_old_raw) / (1 - a), 1e-300)
            values["excess"].append(max(0.0, math.sqrt(moment / h_old) - 1))
            values["ratio"].append(abs(0.5 * math.log(moment / h_old)))
            values["drift"].append(abs(0.5 * math.log(h_new / h_old)))
            end_hat = (decay_left * v_new_raw + (1 - decay_left) * moment) / end_correction
            values["horizon"].append(abs(0.5 * math.log(end_hat / h_new)))
        if not values["excess"]:
            return None
        return {name: (_quantile(v, 0.5), _quantile(v, 0.9)) for name, v in values.items()}

    def loss_ratio(self, t: int, window: int) -> Optional[float]:
        """Mean training loss over the records in ``(t - window, t]`` over the first record's."""
        initial = next((x for x in self.loss if x is not None), None)
        recent = [x for s, x in zip(self.steps, self.loss) if t - window < s <= t and x is not None]
        if initial is None or not recent or initial <= 0:
            return None
        return statistics.mean(recent) / initial


def decide(trace: Trace, figure: str, quantile: int, threshold: float, window: int, check_every: int,
           patience: int, min_step: int, max_step: int, loss_drop: Optional[float]) -> tuple[int, str]:
    """The step a rule decides on ``trace`` and why (``"settled"`` or ``"max_step"``)."""
    streak = 0
    for t in range(check_every, max_step + 1, check_every):
        figures = trace.figures(t, window)
        if figures is None:
            continue
        ratio = trace.loss_ratio(t, window)
        drop_ok = loss_drop is None or (ratio is not None and ratio <= 1 - loss_drop)
        streak = streak + 1 if figures[figure][quantile] < threshold and drop_ok else 0
        if streak >= patience and t >= min_step:
            return t, "settled"
    return max_step, "max_step"


def adamw_traces(runs: dict[str, Any]) -> Iterator[tuple[str, int, Trace]]:
    """``(task, seed, trace)`` for every AdamW run of a ``freeze_sweep.json``'s ``runs``."""
    for key, record in sorted(runs.items()):
        task, run, seed = key.split("/")
        if run == "adamw" and record.get("trace"):
            yield task, int(seed), Trace(record["trace"], record["steps"], beta2=0.999)


def fixed_freeze_accuracy(runs: dict[str, Any]) -> dict[tuple[str, int], list[tuple[int, float, float]]]:
    """``{(task, seed): [(freeze step, 1-bit Adam accuracy, AdamW accuracy)]}`` from the same ``runs``."""
    adamw = {(k.split("/")[0], int(k.split("/")[2])): r["val_acc"] for k, r in runs.items() if k.split("/")[1] == "adamw"}
    out: dict[tuple[str, int], list[tuple[int, float, float]]] = {}
    for key, record in runs.items():
        task, run, seed = key.split("/")
        reference = adamw.get((task, int(seed)))
        if run.startswith("onebit_adam@") and run != "onebit_adam@auto" and reference is not None:
            out.setdefault((task, int(seed)), []).append((record["freeze_step"], record["val_acc"], reference))
    return {k: sorted(v) for k, v in out.items()}


def main() -> None:
    parser = argument_parser(__spec__.name, __doc__)
    parser.add_argument("--results", default=str(RESULTS_DIR / "freeze_sweep.json"))
    parser.add_argument("--windows", type=int, nargs="+", default=[40, 60, 100], help="W, multiples of 10 (the trace's)")
    parser.add_argument("--figures", nargs="+", choices=FIGURES, default=list(FIGURES))
    parser.add_argument("--thresholds", type=float, nargs="+", default=[0.05, 0.1, 0.2, 0.3])
    parser.add_argument("--patience", type=int, default=3)
    parser.add_argument("--loss-drop", type=float, default=0.1, help="negative: no loss guard")
    parser.add_argument("--max-share", type=float, default=0.5, help="max_step as a share of the run")
    parser.add_argument("--curves", action="store_true", help="also print every figure at every check (W = first)")
    args = parser.parse_args()
    runs = json.loads(Path(args.results).read_text())["runs"]
    loss_drop = None if args.loss_drop < 0 else args.loss_drop
    fixed = fixed_freeze_accuracy(runs)
    for task, seed, trace in adamw_traces(runs):
        max_step = int(args.max_share * trace.run_steps)
        print(f"\n== {task} seed {seed}: {trace.run_steps} steps, max_step {max_step}")
        for step, acc, reference in fixed.get((task, seed), []):
            print(f"   fixed freeze {step}: {100 * acc:.2f} (AdamW {100 * reference:.2f}, {100 * (acc - reference):+.2f})")
        if args.curves:
            window = args.windows[0]
            print("   step  loss/start  " + "  ".join(f"{f:>13}" for f in FIGURES) + f"   (median/p90, W={window})")
            for t in trace.steps:
                figures = trace.figures(t, window)
                if figures is None:
                    continue
                ratio = trace.loss_ratio(t, window)
                cells = "  ".join(f"{figures[f][0]:6.3f}/{figures[f][1]:6.3f}" for f in FIGURES)
                print(f"   {t:4d}  {ratio if ratio is not None else float('nan'):10.3f}  {cells}")
        header = "   rule".ljust(28) + "".join(f"W={w:<5}" + " " * 6 for w in args.windows)
        print(header)
        for figure in args.figures:
            for quantile, qname in ((0, "median"), (1, "p90")):
                for threshold in args.thresholds:
                    cells = []
                    for window in args.windows:
                        step, reason = decide(trace, figure, quantile, threshold, window, max(10, window // 4 // 10 * 10),
                                              args.patience, window, max_step, loss_drop)
                        cells.append(f"{step:4d}{'*' if reason == 'max_step' else ' '}".ljust(12))
                    print(f"   {figure} {qname} < {threshold:g}".ljust(28) + "".join(cells))
        print("   (* = max_step reached)")


if __name__ == "__main__":
    main()
