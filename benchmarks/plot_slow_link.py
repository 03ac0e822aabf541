"""Plot results/slow_link.json (from ``python -m benchmarks.slow_link``) to results/slow_link.png; re-plots from the
JSON only (it runs nothing: the measurement needs root network namespaces and a quiet machine).

Three panels, stacked, 830 px wide (readable at that width, as the docs show it):
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
import textwrap
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
LINE_NAMES = ("solid", "dashed", "dotted", "dash-dot")
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


WIDTH_IN, DPI = 8.3, 100  # 830 px wide: the width the README and the docs show it at
SHORT_RATES = {"1gbit": "1 Gbit/s", "200mbit": "200 Mbit/s", "100mbit": "100 Mbit/s", "10gbit": "10 Gbit/s",
               "loopback": "loopback"}


def _rate(rate: str) -> str:
    return SHORT_RATES.get(rate, rate)


def plot(data: dict, output: Path, total_steps: int = 1000, warmup_fraction: float = 0.2) -> Path:
    """Draw the three panels of ``data`` (results/slow_link.json) to ``output``, stacked, :data:`WIDTH_IN` x
    :data:`DPI` pixels wide; the derived run has ``total_steps`` steps, the first ``warmup_fraction`` of them warmup."""
    rates = list(data["rates"])
    cfg = data["config"]
    model = data.get("model") or {}
    warmup = round(warmup_fraction * total_steps)

    fig, axes = plt.subplots(3, 1, figsize=(WIDTH_IN, 13.0), dpi=DPI, height_ratios=(1.15, 1, 1))
    # 1. measured step times
    ax = axes[0]
    present = [(key, label, colour) for key, label, colour in BARS if any(key in data["rates"][r]["rows"] for r in rates)]
    width = 0.84 / max(1, len(present))
    tallest = 0.0
    for i, (key, label, colour) in enumerate(present):
        xs, heights = [], []
        for j, rate in enumerate(rates):
            row = data["rates"][rate]["rows"].get(key)
            if row:
                xs.append(j - 0.42 + width * (i + 0.5))
                heights.append(row["step_s"])
        tallest = max([tallest, *heights])
        bars = ax.bar(xs, heights, width, label=label, color=colour)
        ax.bar_label(bars, fmt="%.2f", fontsize=9, padding=1)
    floor = (data.get("floor") or {}).get("step_s")
    if floor:
        ax.axhline(floor, color="k", linestyle="--", linewidth=1, label=f"compute floor, 1 process ({floor:.2f} s)")
        ax.axhline(1.15 * floor, color="k", linestyle=":", linewidth=1, label="1.15 x floor (goal)")
    ax.set_ylim(0, 1.75 * max(tallest, floor or 0, 1e-9))  # room for the legend above the bars
    ax.set_xticks(range(len(rates)), [f"link {_rate(r)}" for r in rates], fontsize=10)
    ax.tick_params(axis="y", labelsize=10)
    ax.set_ylabel("median step time (s),\nslower rank", fontsize=10)
    ax.set_title("Measured: step time (forward + backward + optimizer)", fontsize=11)
    ax.legend(fontsize=9, loc="upper left", ncol=2, framealpha=0.95)

    # 2. derived cumulative bytes (bytes do not depend on the rate: taken from the first rate)
    ax = axes[1]
    rows0 = data["rates"][rates[0]]["rows"]
    for method, (w_key, s_key) in RUN_STAGES.items():
        w, s = _stage(rows0, w_key), _stage(rows0, s_key)
        if w is None or s is None:
            continue
        steps, values = _cumulative(w[1], s[1], total_steps, warmup)
        ax.plot(steps, [v / 1e9 for v in values], color=COLOURS[method], linestyle=BYTE_STYLES.get(method, "-"),
                linewidth=1.6, label=f"{method}: {values[-1] / 1e9:.1f} GB")
    if warmup and warmup < total_steps:
        ax.axvline(warmup, color="gray", linestyle=":", linewidth=1)
    ax.set_ylabel("bytes sent per rank,\ncumulative (GB)", fontsize=10)
    ax.tick_params(labelsize=10)
    ax.set_title(f"Derived: bytes over a {total_steps}-step run ({warmup} warmup steps, dotted)", fontsize=11)
    ax.legend(fontsize=9, loc="upper left", framealpha=0.95)

    # 3. derived cumulative wall time per rate: colour = method, line style = rate; one legend entry per method with
    # its totals at each rate
    ax = axes[2]
    totals: dict[str, list[str]] = {}
    for k, rate in enumerate(rates):
        rows = data["rates"][rate]["rows"]
        for method, (w_key, s_key) in RUN_STAGES.items():
            w, s = _stage(rows, w_key), _stage(rows, s_key)
            if w is None or s is None:
                continue
            steps, values = _cumulative(w[0], s[0], total_steps, warmup)
            ax.plot(steps, [v / 60 for v in values], color=COLOURS[method], linestyle=LINESTYLES[k % len(LINESTYLES)],
                    linewidth=1.6, label=method if method not in totals else None)
            totals.setdefault(method, []).append(f"{values[-1] / 60:.0f}")
    if floor:
        ax.plot([0, total_steps], [0, floor * total_steps / 60], color="k", linewidth=1.2, label="compute floor")
        totals["compute floor"] = [f"{floor * total_steps / 60:.0f}"]
    if warmup and warmup < total_steps:
        ax.axvline(warmup, color="gray", linestyle=":", linewidth=1)
    ax.set_ylim(0, 1.3 * ax.get_ylim()[1])
    ax.set_xlabel("training step", fontsize=10)
    ax.set_ylabel("wall time,\ncumulative (min)", fontsize=10)
    ax.tick_params(labelsize=10)
    ax.set_title(f"Derived: wall time of the {total_steps}-step run (measured step time per stage)", fontsize=11)
    handles, labels = ax.get_legend_handles_labels()
    labels = [f"{label}: {' / '.join(totals[label])} min" for label in labels]
    styles = " / ".join(f"{_rate(rate)} ({LINE_NAMES[k % len(LINE_NAMES)]})" for k, rate in enumerate(rates))
    ax.legend(handles, labels, fontsize=9, loc="upper left", framealpha=0.95, title=f"total at {styles}",
              title_fontsize=9)
    for ax in axes[1:]:
        ax.set_xlim(0, total_steps)
        ax.grid(alpha=0.3)

    params = f"{model['params'] / 1e6:.1f}M params, " if model else ""
    preset = f"{cfg['model']} preset, " if "model" in cfg else ""  # runs before the --model option have none
    fig.suptitle("slow_link: training step time and bytes on a bandwidth-limited link", fontsize=13, y=0.995)
    note = (f"BERT {cfg['layers']} layers / hidden {cfg['hidden']} ({preset}{params}batch {cfg['batch']} x seq "
            f"{cfg['seq']} per rank), 2 gloo CPU ranks, 1 thread each, tbf-shaped loopback (the rate is the 2 ranks' "
            "aggregate). Derived panels: measured per-step bytes and median step times of each stage x steps; warmup "
            "= OnebitAdam's freeze_step = PowerSGD's start_powerSGD_iter. Preliminary timings on a shared 2-core "
            "machine.")
    note = "\n".join(textwrap.wrap(note, 112, break_on_hyphens=False))
    fig.text(0.5, 0.972, note, ha="center", va="top", fontsize=9, color="0.25")
    fig.tight_layout(rect=(0, 0, 1, 0.925), h_pad=1.2)
    output.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(output, dpi=DPI)
    plt.close(fig)
    return output


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
    print(f"written to {plot(data, args.output, args.total_steps, args.warmup_fraction)}")


if __name__ == "__main__":
    main()
