"""Plot issue 46's measurements to results/local_steps.png: accuracy (the example from scratch, and the fine-tuning
tasks where measured) and validation loss (the byte-level GPT) against whole-run bytes per rank, log scale, a panel
per task, every method and seed, AdamW-DDP marked. It re-plots the results files only
(``results/local_steps_sweep.json`` with the reference runs ``result_tables`` completes it with, and
``results/lm_local_steps.json``); it runs nothing.

    python -m benchmarks.plot_local_steps
"""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any, Optional

from benchmarks.common import RESULTS_DIR, argument_parser

#: the families of runs, in the legend's order: (test on the run name, label, colour, marker)
FAMILIES = (
    (lambda n: n == "adamw", "AdamW-DDP", "black", "*"),
    (lambda n: n.startswith("ddp_powersgd"), "DDP + PowerSGD", "tab:purple", "v"),
    (lambda n: n == "ddp_bf16", "DDP + bf16", "tab:olive", "<"),
    (lambda n: n.startswith("onebit_adam"), "1-bit Adam (auto)", "tab:blue", "s"),
    (lambda n: n.startswith("zeroone_adam"), "0/1 Adam", "tab:cyan", "h"),
    (lambda n: n.startswith("torchft"), "torchft DiLoCo (fp32)", "tab:brown", "X"),
    (lambda n: n.startswith("diloco_none"), "onebit_diloco, none (fp32)", "tab:red", "o"),
    (lambda n: n.startswith("diloco_bf16"), "onebit_diloco, bf16", "tab:pink", "o"),
    (lambda n: n.startswith("diloco_onebit"), "onebit_diloco, 1-bit", "tab:green", "D"),
    (lambda n: n.startswith("diloco_topk"), "onebit_diloco, top-k + 2-bit", "tab:orange", "^"),
)


def family_of(name: str) -> tuple[str, str, str]:
    """``(label, colour, marker)`` of a run name; the outer step without momentum (``_sgd``) keeps its compressor's
    colour with a plus for a marker at lr 1 and a pentagon at another lr (``_sgdL``)."""
    from benchmarks.freeze_sweep import diloco_outer_lr

    lr = diloco_outer_lr(name) if name.startswith("diloco") else None
    for test, label, colour, marker in FAMILIES:
        if test(name):
            if lr is None:
                return label, colour, marker
            return f"{label}, outer SGD lr {lr:g}", colour, "P" if lr == 1 else "p"
    return name, "tab:gray", "."


def points(runs: dict[str, Any], value: str) -> list[dict[str, Any]]:
    """One point per run: its name, seed, whole-run bytes per rank and ``value`` (``val_acc`` or ``val_loss``)."""
    return [dict(run=r["run"], seed=int(r["seed"]), bytes=r["bytes_sent"], value=r[value]) for r in runs.values()
            if r.get("bytes_sent") and r.get(value) is not None]


def _panel(ax: Any, pts: list[dict[str, Any]], ylabel: str, title: str, percent: bool) -> None:
    seen = set()
    for p in sorted(pts, key=lambda p: (p["run"], p["seed"])):
        label, colour, marker = family_of(p["run"])
        adamw = p["run"] == "adamw"
        # local steps: hollow at a period of 8 (streamed or not), filled at others; seeds share a colour
        hollow = re.search(r"@8(f[0-9]+)?(o[0-9]+)?$", p["run"]) is not None
        ax.scatter([p["bytes"]], [100 * p["value"] if percent else p["value"]], marker=marker,
                   s=220 if adamw else 55, facecolor="none" if hollow else colour, edgecolor=colour, linewidth=1.3,
                   zorder=5 if adamw else 3, label=None if label in seen else label)
        seen.add(label)
        if adamw:
            ax.axvline(p["bytes"], color="0.6", lw=0.8, ls="--", zorder=1)
    ax.set_xscale("log")
    ax.set_xlabel("whole-run bytes sent per rank (log scale; dashed: AdamW-DDP)")
    ax.set_ylabel(ylabel)
    ax.set_title(title, fontsize=10)
    ax.grid(alpha=0.3, which="both")
    ax.legend(fontsize=6.5, loc="best", framealpha=0.6)


def plot(synthetic: Optional[dict[str, Any]], lm: Optional[dict[str, Any]], path: Path) -> Path:
    """A panel per task measured (a missing results file leaves its panels out) to ``path``, 830 px wide."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    titles = {"synthetic": "the example from scratch (synthetic reviews, 620 steps)",
              "mail": "the mail corpus (pretrained MiniLM, 600 steps)", "agnews": "AG News (pretrained MiniLM, 600 steps)"}
    panels = []
    for task, title in titles.items():
        runs = {k: r for k, r in (synthetic or {}).get("runs", {}).items() if r.get("task") == task}
        if runs:
            panels.append((runs, "val_acc", "validation accuracy (%)", f"{title}: every seed", True))
    if lm is not None:
        panels.append((lm["runs"], "val_loss", "validation loss (nats per byte)", "byte-level GPT on the standard "
                       "library (320 steps, equal tokens): every seed", False))
    fig, axes = plt.subplots(len(panels), 1, figsize=(8.3, 3.6 * len(panels)), dpi=100, squeeze=False)
    for ax, (runs, value, ylabel, title, percent) in zip(axes[:, 0], panels):
        _panel(ax, points(runs, value), ylabel, title, percent)
    fig.text(0.01, 0.003, "local steps: hollow = a sync every 8 inner steps, filled = another period (4, 16 or 32); "
             "outer Nesterov (0.7, 0.9) unless the legend says SGD", fontsize=7)
    fig.tight_layout(rect=(0, 0.02, 1, 1))
    fig.savefig(path)
    plt.close(fig)
    return path


def main() -> None:
    import json

    from benchmarks.result_tables import LM_LOCAL_STEPS, LOCAL_STEPS, local_steps_runs

    parser = argument_parser(__spec__.name, __doc__)
    parser.add_argument("--output", default=str(RESULTS_DIR / "local_steps.png"))
    args = parser.parse_args()
    synthetic = local_steps_runs() if (RESULTS_DIR / f"{LOCAL_STEPS}.json").exists() else None
    lm_path = RESULTS_DIR / f"{LM_LOCAL_STEPS}.json"
    lm = json.loads(lm_path.read_text()) if lm_path.exists() else None
    print(f"picture: {plot(synthetic, lm, Path(args.output))}")


if __name__ == "__main__":
    main()
