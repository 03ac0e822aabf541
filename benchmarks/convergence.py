"""Convergence curves: validation accuracy and loss against the optimizer step for DDP + AdamW and the three 1-bit
optimizers on the BERT example, each run's freeze step marked.

Runs, one after another, ``examples/bert_finetune.py fit`` on 2 CPU processes (gloo, offline: synthetic reviews, a
fresh 4-layer BERT of hidden 128) once per config of :mod:`benchmarks.bert_parity` (its ``run_example`` and
``CONFIGS``):

  ddp_adamw     examples/configs/bert_adamw.yaml     DDP + AdamW (the fp32 baseline)
  onebit_adam   examples/configs/bert_onebit.yaml    1-bit Adam, freeze_step auto
  zeroone_adam  examples/configs/bert_zeroone.yaml   0/1 Adam (variance steps, then local steps)
  onebit_lamb   examples/configs/bert_lamb.yaml      1-bit LAMB, freeze_step auto

each with the arguments ``--summary_json RUN.json --trainer.enable_progress_bar false`` (added by ``run_example``) and

  --trainer.val_check_interval 31 --trainer.check_val_every_n_epoch 1

so that the 10 epochs of 62 steps (620 optimizer steps) are validated every 31 steps: 20 validations per run, at steps
31, 62, ..., 620. The seed is the configs' ``seed_everything`` (42 in all four), so every run sees the same data in
the same order; the validations themselves draw from the global RNG (each DataLoader iterator draws a seed), so a run
is not step-for-step the run ``benchmarks.bert_parity`` makes with one validation per epoch. ``--val-every N`` changes
the interval (N must divide into the 62 steps of an epoch to stay regular); other arguments are passed to every run
made (e.g. ``--trainer.max_epochs 2`` for a short try) and recorded with each run (``arguments``).

The configs log with a ``lightning.pytorch.loggers.CSVLogger`` (``lightning_logs/NAME/version_N/metrics.csv`` in the
run's directory); the validation rows of that file are read back (:func:`read_val_metrics`). Lightning logs a
validation at the count of batches that stepped *before* the current one, so a row's ``step`` is one less than the
optimizer steps done when it was taken: the curves use ``step + 1``.

Cost: 4 runs of 1.5-4 minutes each on a quiet 2-core machine; with another benchmark on the same 2 cores they took
4.5-6 minutes each (wall_s 266-365 s, about 22 minutes in all). Outputs:

  results/convergence.json   per run: steps, val_acc, val_loss (lists), the freeze step and why it was chosen, final
                             accuracy and loss, the whole-run bytes sent by a rank and their fp32 equivalent (from
                             the run's summary), the bytes ratio against the DDP fp32 run, wall time
  results/convergence.png    two panels stacked (accuracy, loss), 830 px wide, one colour per optimizer, freeze steps
                             as dashed vertical lines in the run's colour

    python -m benchmarks.convergence                      # all four runs, then the picture
    python -m benchmarks.convergence --runs onebit_lamb   # rerun one, keep the others' results in the JSON
    python -m benchmarks.convergence --plot-only          # redraw results/convergence.png from the JSON
    python -m benchmarks.convergence --keep-logs /tmp/conv   # keep each run's directory (logs, metrics.csv)
"""

from __future__ import annotations

import csv
import json
import tempfile
import textwrap
from pathlib import Path
from typing import Any, Optional

import yaml

from benchmarks.bert_parity import CONFIGS, RUN_ARGS, run_example
from benchmarks.common import (
    EXAMPLE_CONFIGS,
    RESULTS_DIR,
    argument_parser,
    merge_runs,
    previous_results,
    write_results,
)

NAME = "convergence"
RUNS = ("ddp_adamw", "onebit_adam", "zeroone_adam", "onebit_lamb")  # a subset of bert_parity.CONFIGS
BASELINE = "ddp_adamw"  # the DDP fp32 run the bytes ratios are taken against
LABELS = {"ddp_adamw": "AdamW (DDP)", "onebit_adam": "1-bit Adam", "zeroone_adam": "0/1 Adam",
          "onebit_lamb": "1-bit LAMB"}
COLOURS = {"ddp_adamw": "black", "onebit_adam": "tab:blue", "zeroone_adam": "tab:green", "onebit_lamb": "tab:orange"}
VAL_EVERY = 31  # optimizer steps between validations: half an epoch of the example (62 steps per epoch on 2 ranks)
WIDTH_IN, DPI = 8.3, 100  # 830 px wide


# ---------------------------------------------------------------------------------------------------------------------
# the runs
def val_args(every: int) -> list[str]:
    """The arguments that validate every ``every`` optimizer steps (within each epoch, every epoch)."""
    return ["--trainer.val_check_interval", str(every), "--trainer.check_val_every_n_epoch", "1"]


def find_metrics(workdir: Path, logger_name: str) -> Path:
    """The CSVLogger file of a run made in ``workdir``: ``lightning_logs/LOGGER_NAME/version_N/metrics.csv`` with
    the highest N."""
    versions = sorted((workdir / "lightning_logs" / logger_name).glob("version_*/metrics.csv"),
                      key=lambda p: int(p.parent.name.split("_")[-1]))
    if not versions:
        raise FileNotFoundError(f"no lightning_logs/{logger_name}/version_*/metrics.csv under {workdir}")
    return versions[-1]


def read_val_metrics(path: Path) -> dict[str, list]:
    """The validation rows of a CSVLogger ``metrics.csv``: ``{"steps", "val_acc", "val_loss"}``, by step.

    Rows without ``val_acc`` (training rows) are skipped; a step logged twice keeps its last row. ``steps`` are
    optimizer steps done at the validation (the file's ``step`` + 1, see the module docstring)."""
    by_step: dict[int, tuple[float, float]] = {}
    with open(path, newline="") as f:
        for row in csv.DictReader(f):
            acc, loss = row.get("val_acc") or "", row.get("val_loss") or ""
            if acc.strip() and loss.strip():
                by_step[int(float(row["step"])) + 1] = (float(acc), float(loss))
    steps = sorted(by_step)
    return dict(steps=steps, val_acc=[by_step[s][0] for s in steps], val_loss=[by_step[s][1] for s in steps])


def _run_config(workdir: Path, logger_name: str, config: str) -> dict[str, Any]:
    """The configuration the run used: LightningCLI's ``config.yaml`` beside its metrics (command-line overrides
    included), else the config file."""
    saved = sorted((workdir / "lightning_logs" / logger_name).glob("version_*/config.yaml"))
    return yaml.safe_load((saved[-1] if saved else EXAMPLE_CONFIGS / config).read_text())


def freeze_of(summary: dict[str, Any], optimizer_args: dict[str, Any]) -> dict[str, Any]:
    """The step the run stopped exchanging full-precision data every step, and why: ``freeze_step`` (None for
    DDP), ``freeze_kind`` (``auto`` / ``auto, max_step bound`` / ``fixed`` / ``0/1 Adam warmup``),
    ``freeze_reason`` (the auto-freeze decision as the optimizer describes it), and for 0/1 Adam
    ``var_freeze_step`` (variance frozen, local steps after)."""
    step = summary.get("freeze_step")
    if step is None:
        return dict(freeze_step=None, freeze_kind=None, freeze_reason="no compression: DDP averages the fp32 "
                    "gradient every step", var_freeze_step=None)
    if summary.get("optimizer") == "ZeroOneAdam":
        # the run's own value (scaled to the run when the config leaves it out), else the config's
        var_freeze = summary.get("var_freeze_step", optimizer_args.get("var_freeze_step"))
        # the run's own all-variance start (var_update_scaler, scaled to the run when the config leaves it out)
        reason = (f"every step a variance step up to var_update_scaler={optimizer_args.get('var_update_scaler') or step}, "
                  f"then 1-bit steps with variance steps at doubling intervals up to var_freeze_step={var_freeze}, "
                  "then local steps synced at doubling intervals")
        return dict(freeze_step=step, freeze_kind="0/1 Adam warmup", freeze_reason=reason, var_freeze_step=var_freeze)
    described = summary.get("auto_freeze")
    if described is None:
        return dict(freeze_step=step, freeze_kind="fixed", freeze_reason="freeze_step set in the config",
                    var_freeze_step=None)
    bound = summary.get("auto_freeze_reason") == "max_step"
    return dict(freeze_step=step, freeze_kind="auto, max_step bound" if bound else "auto", freeze_reason=described,
                var_freeze_step=None)


def run_record(name: str, config: str, summary: dict[str, Any], metrics: dict[str, list],
               used: dict[str, Any]) -> dict[str, Any]:
    """One run's entry in results/convergence.json."""
    optimizer_args = ((used.get("optimizer") or {}).get("init_args")) or {}
    return dict(
        config=config,
        label=LABELS.get(name, name),
        optimizer=summary.get("optimizer"),
        strategy=summary.get("strategy"),
        seed=used.get("seed_everything"),
        lr=optimizer_args.get("lr"),
        **metrics,
        **freeze_of(summary, optimizer_args),
        total_steps=summary.get("steps"),
        final_val_acc=summary.get("val_acc"),
        final_val_loss=summary.get("val_loss"),
        bytes_sent=summary.get("bytes_sent"),
        bytes_fp32_equivalent=summary.get("bytes_fp32_equivalent"),
        rounds_per_100_steps=summary.get("rounds_per_100_steps"),
        wall_s=summary.get("wall_s"),
    )


def add_bytes_ratios(runs: dict[str, dict[str, Any]]) -> None:
    """``bytes_ratio_vs_ddp_fp32``: the DDP run's whole-run bytes over each run's (None without a DDP run)."""
    base = (runs.get(BASELINE) or {}).get("bytes_sent")
    for run in runs.values():
        run["bytes_ratio_vs_ddp_fp32"] = base / run["bytes_sent"] if base and run.get("bytes_sent") else None


def run_one(name: str, extra: list[str], workdir: Path) -> dict[str, Any]:
    """Run ``name``'s config with ``extra`` arguments in ``workdir``; its record, with the arguments it had."""
    config = CONFIGS[name]
    workdir.mkdir(parents=True, exist_ok=True)
    arguments = [*RUN_ARGS.get(name, []), *extra]
    summary = run_example(config, arguments, workdir, log=workdir / f"{name}.log")
    logger_name = yaml.safe_load((EXAMPLE_CONFIGS / config).read_text())["trainer"]["logger"]["init_args"]["name"]
    metrics = read_val_metrics(find_metrics(workdir, logger_name))
    return dict(run_record(name, config, summary, metrics, _run_config(workdir, logger_name, config)),
                arguments=arguments)


# ---------------------------------------------------------------------------------------------------------------------
# the picture
def legend_label(name: str, run: dict[str, Any]) -> str:
    """``1-bit Adam: 99.7%, 2.7x fewer bytes; freeze 220 (auto)``."""
    text = f"{run.get('label', name)}: "
    if run.get("final_val_acc") is not None:
        text += f"{100 * run['final_val_acc']:.1f}%"
    ratio = run.get("bytes_ratio_vs_ddp_fp32")
    if name == BASELINE:
        text += ", fp32 bytes (baseline)"
    elif ratio:
        text += f", {ratio:.1f}x fewer bytes"
    step = run.get("freeze_step")
    if step is not None:
        kind = run.get("freeze_kind") or ""
        if run.get("var_freeze_step") is not None:
            text += f"; warmup {step}, variance frozen {run['var_freeze_step']}"
        else:
            text += f"; freeze {step}" + (f" ({kind})" if kind else "")
    return text


def plot(results: dict[str, Any], path: Path) -> Optional[Path]:
    """Accuracy (top) and loss (bottom, log scale) against the optimizer step; a dashed vertical line in the run's
    colour at each freeze step (0/1 Adam: dashed at the end of its warmup, dotted where its variance froze)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from matplotlib.lines import Line2D

    runs = {name: run for name, run in results.get("runs", {}).items() if run.get("steps")}
    if not runs:
        return None
    fig, (acc_ax, loss_ax) = plt.subplots(2, 1, figsize=(WIDTH_IN, 9.8), dpi=DPI, sharex=True, layout="constrained")
    for name, run in runs.items():
        colour = COLOURS.get(name, None)
        acc_ax.plot(run["steps"], [100 * a for a in run["val_acc"]], marker="o", ms=3.5, lw=1.6, color=colour,
                    label=legend_label(name, run))
        loss_ax.plot(run["steps"], run["val_loss"], marker="o", ms=3.5, lw=1.6, color=colour)
        for ax in (acc_ax, loss_ax):
            if run.get("freeze_step") is not None:
                ax.axvline(run["freeze_step"], color=colour, ls="--", lw=1.2, alpha=0.8)
            if run.get("var_freeze_step") is not None:
                ax.axvline(run["var_freeze_step"], color=colour, ls=":", lw=1.4, alpha=0.8)
    last = max(max(run["steps"]) for run in runs.values())
    acc_ax.set_xlim(0, last * 1.02)
    acc_ax.set_ylabel("validation accuracy (%)", fontsize=11)
    loss_ax.set_yscale("log")
    loss_ax.set_ylabel("validation loss (log scale)", fontsize=11)
    loss_ax.set_xlabel("optimizer step", fontsize=11)
    for ax in (acc_ax, loss_ax):
        ax.grid(alpha=0.3)
        ax.tick_params(labelsize=10)

    # the legend below the panels, where it covers no data
    handles, labels = acc_ax.get_legend_handles_labels()
    handles.append(Line2D([], [], color="0.3", ls="--", lw=1.2))
    labels.append("freeze step, in the run's colour (end of the full-precision warmup)")
    if any(run.get("var_freeze_step") is not None for run in runs.values()):
        handles.append(Line2D([], [], color="0.3", ls=":", lw=1.4))
        labels.append("0/1 Adam: variance frozen, local steps after")
    fig.legend(handles, labels, loc="outside lower center", fontsize=9.5, frameon=False,
               title="final accuracy; whole-run bytes sent per rank vs DDP fp32", title_fontsize=10)

    first = next(iter(runs.values()))
    every = results.get("val_every")
    seeds = sorted({str(run.get("seed")) for run in runs.values()})
    fig.suptitle("BERT example: validation accuracy and loss, DDP + AdamW and the 1-bit optimizers", fontsize=12.5)
    note = (f"examples/bert_finetune.py (synthetic reviews, 4-layer BERT, hidden 128), 2 CPU ranks on gloo, "
            f"{first.get('total_steps')} steps, seed {', '.join(seeds)}"
            + (f", validated every {every} steps" if every else "") + "; python -m benchmarks.convergence")
    acc_ax.set_title("\n".join(textwrap.wrap(note, 110)), fontsize=9, color="0.25")
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=DPI)
    plt.close(fig)
    return path


# ---------------------------------------------------------------------------------------------------------------------
def main() -> None:
    parser = argument_parser(__spec__.name, __doc__)
    parser.add_argument("--runs", nargs="+", choices=list(RUNS), default=list(RUNS),
                        help="runs to make (default all four); the others keep their results in "
                             "results/convergence.json")
    parser.add_argument("--val-every", type=int, default=VAL_EVERY,
                        help=f"optimizer steps between validations (default {VAL_EVERY}: 20 per 620-step run)")
    parser.add_argument("--plot-only", action="store_true",
                        help="redraw results/convergence.png from results/convergence.json; run nothing")
    parser.add_argument("--keep-logs", type=Path, default=None,
                        help="make each run in DIR/RUN and keep it (default: a temporary directory)")
    parser.add_argument("--name", default=NAME, help=f"results/NAME.json and .png (default {NAME})")
    args, extra = parser.parse_known_args()
    json_path, png_path = RESULTS_DIR / f"{args.name}.json", RESULTS_DIR / f"{args.name}.png"
    if args.plot_only:
        if extra:
            parser.error(f"--plot-only runs nothing: unexpected {' '.join(extra)}")
        print(f"written to {plot(json.loads(json_path.read_text()), png_path)}")
        return

    previous = previous_results(args.name, args.runs, list(RUNS))
    run_extra = [*val_args(args.val_every), *extra]
    with tempfile.TemporaryDirectory() as tmp:
        base = args.keep_logs or Path(tmp)
        fresh = {name: run_one(name, run_extra, base / name) for name in args.runs}
    runs = merge_runs(previous, fresh, list(RUNS))
    add_bytes_ratios(runs)
    # each run keeps its own arguments (runs kept from an earlier invocation may have had others)
    results = dict(val_every=args.val_every, extra_args=extra, runs=runs)
    print(f"\n{'run':14s}{'final acc':>10s}{'loss':>9s}{'freeze':>8s}{'bytes sent':>16s}{'vs DDP':>8s}{'wall s':>8s}")
    for name, run in runs.items():
        ratio = run.get("bytes_ratio_vs_ddp_fp32")
        print(f"{name:14s}{100 * run['final_val_acc']:>9.2f}%{run['final_val_loss']:>9.4f}"
              f"{run['freeze_step'] if run['freeze_step'] is not None else '-':>8}{run['bytes_sent']:>16,d}"
              f"{(f'{ratio:.2f}x' if ratio else '-'):>8s}{run['wall_s']:>8.1f}")
    print(f"written to {write_results(args.name, results)}")
    print(f"written to {plot(results, png_path)}")


if __name__ == "__main__":
    main()
