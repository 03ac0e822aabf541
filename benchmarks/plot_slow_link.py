"""Plot results/slow_link.json (from ``python -m benchmarks.slow_link``) to results/slow_link.png.

Three panels:
  1. measured: median step time per method at each link rate (onebit_adam's warmup and compression stages as separate
     bars; the one-process compute floor and 1.15x of it as lines);
  2. derived: cumulative bytes each rank sends over a training run of ``--total-steps`` steps whose first
     ``--warmup-fraction`` are warmup (OnebitAdam's freeze_step, PowerSGD's start_powerSGD_iter), computed from the
     measured per-step bytes of each stage;
  3. derived: cumulative wall time of the same run at each rate, from the measured median step times.

    python -m benchmarks.plot_slow_link
    python -m benchmarks.plot_slow_link --total-steps 1000 --warmup-fraction 0.2
"""

from __future__ import annotations

import json
from pathlib import Path

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402

from benchmarks.common import RESULTS_DIR, argument_parser  # noqa: E402

BARS = (  # row key in the results, label, colour
    ("ddp_fp32", "DDP fp32 + AdamW", "tab:red"),
    ("ddp_bf16", "DDP bf16 hook + AdamW", "tab:orange"),
    ("ddp_powersgd", "DDP PowerSGD r=4 + AdamW", "tab:purple"),
    ("onebit_adam:warmup", "onebit_adam, warmup", "tab:cyan"),
    ("onebit_adam:compression", "onebit_adam, compression", "tab:blue"),
    ("onebit_overlap:compression", "onebit_adam overlapped, compression", "tab:green"),
    ("local_2proc", "2 processes, no comm", "tab:gray"),
)
# method -> (warmup row, steady row): the per-step (bytes, time) of each stage of a training run
RUN_STAGES = {
    "DDP fp32 + AdamW": ("ddp_fp32", "ddp_fp32"),
    "DDP bf16 hook + AdamW": ("ddp_bf16", "ddp_bf16"),
    "DDP PowerSGD r=4 + AdamW": ("ddp_powersgd:warmup", "ddp_powersgd"),
    "onebit_adam": ("onebit_adam:warmup", "onebit_adam:compression"),
    "onebit_adam overlapped": ("onebit_overlap:warmup", "onebit_overlap:compression"),
}
COLOURS = {"DDP fp32 + AdamW": "tab:red", "DDP bf16 hook + AdamW": "tab:orange",
           "DDP PowerSGD r=4 + AdamW": "tab:purple", "onebit_adam": "tab:blue", "onebit_adam overlapped": "tab:green"}
LINESTYLES = ("-", "--", ":", "-.")
BYTE_STYLES = {"DDP PowerSGD r=4 + AdamW": "--"}  # PowerSGD and onebit_adam can nearly coincide


def _stage(rows: dict, key: str) -> tuple[float, float] | None:
    """(step seconds, bytes per rank per step) of a row; ``ddp_powersgd:warmup`` is PowerSGD's allreduce phase."""
    if key == "ddp_powersgd:warmup":
        row = rows.get("ddp_powersgd")
        return None if row is None else (row["warmup_step_s"], row["warmup_bytes_per_step"])
    row = rows.get(key)
    return None if row is None else (row["step_s"], row["bytes_per_step"])


def _cumulative(per_step_warmup: float, per_step_steady: float, total: int, warmup: int) -> tuple[list, list]:
    steps = list(range(total + 1))
    values = [per_step_warmup * min(t, warmup) + per_step_steady * max(0, t - warmup) for t in steps]
    return steps, values


def main() -> None:
    parser = argument_parser(__spec__.name, __doc__)
    parser.add_argument("--input", type=Path, default=RESULTS_DIR / "slow_link.json")
    parser.add_argument("--output", type=Path, default=RESULTS_DIR / "slow_link.png")
    parser.add_argument("--total-steps", type=int, default=1000, help="steps of the derived training run (1000)")
    parser.add_argument("--warmup-fraction", type=float, default=0.2,
                        help="fraction of the run in warmup: freeze_step / start_powerSGD_iter (default 0.2; the "
                             "1-bit Adam paper uses 15-25%% for BERT)")
    args = parser.parse_args()
    if not 0 <= args.warmup_fraction <= 1:
        parser.error("--warmup-fraction must be in [0, 1]")
    data = json.loads(args.input.read_text())
    rates = list(data["rates"])
    cfg = data["config"]
    model = data.get("model") or {}
    warmup = round(args.warmup_fraction * args.total_steps)

    fig, axes = plt.subplots(1, 3, figsize=(18, 5.6))
    # 1. measured step times
    ax = axes[0]
    present = [(key, label, colour) for key, label, colour in BARS if any(key in data["rates"][r]["rows"] for r in rates)]
    width = 0.8 / max(1, len(present))
    for i, (key, label, colour) in enumerate(present):
        xs, heights = [], []
        for j, rate in enumerate(rates):
            row = data["rates"][rate]["rows"].get(key)
            if row:
                xs.append(j - 0.4 + width * (i + 0.5))
                heights.append(row["step_s"])
        bars = ax.bar(xs, heights, width, label=label, color=colour)
        ax.bar_label(bars, fmt="%.2f", fontsize=7, padding=1)
    floor = (data.get("floor") or {}).get("step_s")
    if floor:
        ax.axhline(floor, color="k", linestyle="--", linewidth=1, label=f"compute floor, 1 process ({floor:.2f} s)")
        ax.axhline(1.15 * floor, color="k", linestyle=":", linewidth=1, label="1.15 x floor (goal)")
    ax.set_ylim(top=1.6 * max(ax.get_ylim()[1], 1e-9))  # room for the legend above the bars
    ax.set_xticks(range(len(rates)), [f"link {r}" for r in rates])
    ax.set_ylabel("median step time (s), slower rank")
    ax.set_title("measured: step time (forward + backward + optimizer)")
    ax.legend(fontsize=7, loc="upper left", ncol=2)

    # 2. derived cumulative bytes (bytes do not depend on the rate: taken from the first rate)
    ax = axes[1]
    rows0 = data["rates"][rates[0]]["rows"]
    for method, (w_key, s_key) in RUN_STAGES.items():
        w, s = _stage(rows0, w_key), _stage(rows0, s_key)
        if w is None or s is None:
            continue
        steps, values = _cumulative(w[1], s[1], args.total_steps, warmup)
        ax.plot(steps, [v / 1e9 for v in values], color=COLOURS[method], linestyle=BYTE_STYLES.get(method, "-"),
                label=f"{method}: {values[-1] / 1e9:.1f} GB")
    if warmup and warmup < args.total_steps:
        ax.axvline(warmup, color="gray", linestyle=":", linewidth=1)
    ax.set_xlabel("training step")
    ax.set_ylabel("cumulative bytes sent per rank (GB)")
    ax.set_title(f"DERIVED: bytes over a {args.total_steps}-step run, {warmup} warmup steps\n"
                 f"(measured bytes/step per stage x steps; warmup = freeze_step = start_powerSGD_iter)", fontsize=9)
    ax.legend(fontsize=7)

    # 3. derived cumulative wall time per rate
    ax = axes[2]
    for k, rate in enumerate(rates):
        rows = data["rates"][rate]["rows"]
        for method, (w_key, s_key) in RUN_STAGES.items():
            w, s = _stage(rows, w_key), _stage(rows, s_key)
            if w is None or s is None:
                continue
            steps, values = _cumulative(w[0], s[0], args.total_steps, warmup)
            ax.plot(steps, [v / 60 for v in values], color=COLOURS[method], linestyle=LINESTYLES[k % len(LINESTYLES)],
                    label=f"{method} @ {rate}: {values[-1] / 60:.1f} min")
    if floor:
        ax.plot([0, args.total_steps], [0, floor * args.total_steps / 60], color="k", linewidth=1,
                label=f"compute floor: {floor * args.total_steps / 60:.1f} min")
    if warmup and warmup < args.total_steps:
        ax.axvline(warmup, color="gray", linestyle=":", linewidth=1)
    ax.set_xlabel("training step")
    ax.set_ylabel("cumulative wall time (min)")
    ax.set_title(f"DERIVED: wall time of the {args.total_steps}-step run\n(measured median step time per stage x steps)",
                 fontsize=9)
    ax.legend(fontsize=6)

    params = f"{model['params'] / 1e6:.1f}M params, " if model else ""
    preset = f"{cfg['model']} preset, " if "model" in cfg else ""  # runs before the --model option have none
    fig.suptitle(f"slow_link: BERT {cfg['layers']} layers / hidden {cfg['hidden']} ({preset}{params}batch "
                 f"{cfg['batch']} x seq {cfg['seq']} per rank), 2 gloo CPU ranks, 1 thread each, tbf-shaped loopback (aggregate rate); "
                 f"preliminary timings on a shared 2-core machine", fontsize=10)
    fig.tight_layout()
    args.output.parent.mkdir(exist_ok=True)
    fig.savefig(args.output, dpi=110)
    print(f"written to {args.output}")


if __name__ == "__main__":
    main()
