"""Regenerate the result tables of the documentation (``docs/**/*.md``) and README.md from the benchmark outputs in
results/.

Each table sits between ``<!-- results:NAME -->`` and ``<!-- /results:NAME -->`` in one of those pages; this script
renders every NAME from its results file and rewrites the pages in place. ``--check`` only compares (exit status 1 when
a page is stale); the test suite runs that check, so a table cannot drift from the figures it claims.

    python -m benchmarks.result_tables            # rewrite the pages
    python -m benchmarks.result_tables --check    # verify only
"""

from __future__ import annotations

import json
import re
import statistics
import sys
from pathlib import Path
from collections.abc import Iterable
from typing import Any, Callable, Optional

from benchmarks.common import RESULTS_DIR, ROOT, argument_parser

RESULTS = RESULTS_DIR
README = ROOT / "README.md"
DOCS = ROOT / "docs"


def pages() -> list[Path]:
    """The pages that may hold result blocks: README.md and the documentation's Markdown sources."""
    return [README, *sorted(DOCS.rglob("*.md"))]


MIB = 2**20


def _load(name: str) -> dict[str, Any]:
    return json.loads((RESULTS / f"{name}.json").read_text())


def _s(seconds: float) -> str:
    return f"{seconds:.3f} s"


def _table(header: list[str], rows: list[list[str]]) -> str:
    lines = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    lines += ["| " + " | ".join(row) + " |" for row in rows]
    return "\n".join(lines)


def kernels_table() -> str:
    data = _load("kernels")
    by_kernel: dict[str, dict[str, dict]] = {}
    for r in data["rows"]:
        by_kernel.setdefault(r["kernel"], {})[r["backend"]] = r
    backends = [b for b in ("torch", "cpu") if any(b in v for v in by_kernel.values())]
    header = ["kernel"] + [f"{b} ({'C' if b == 'cpu' else 'pure torch'})" for b in backends]
    rows = []
    for kernel, per_backend in by_kernel.items():
        rows.append([kernel] + [f"{per_backend[b]['ms']:.1f} ms = {per_backend[b]['copies']:.2f}x copy"
                                for b in backends])
    intro = (f"One float32 buffer of {data['numel']:,} elements in {data['segments']} segments (a BERT-like momentum "
             f"bucket), one thread, best of {data['args']['repeats']}; a plain copy of it takes {data['copy_ms']:.1f} "
             "ms (the Adam update covers all parameters, its copy figure is scaled to their count):\n\n")
    return intro + _table(header, rows)


def bytes_table() -> str:
    rows = []
    for world_size in (2, 3):
        data = _load(f"compressed_step_P{world_size}_10000000")
        r = data["per_rank"][0]
        rows.append([
            str(world_size),
            f"{r['bytes_sent_per_step']:,} B",
            f"{r['fp32_allreduce_bytes']:,} B",
            f"1/{r['fp32_allreduce_bytes'] / r['bytes_sent_per_step']:.1f}",
            f"{r['collectives_per_step']} ({r['collectives_per_step'] // r['buckets']} per bucket)",
        ])
    r = _load("compressed_step_P2_10000000")["per_rank"][0]
    intro = (f"A BERT-like model of {r['numel'] / 1e6:.1f}M parameters ({r['tensors']} tensors, {r['buckets']} momentum "
             "buckets), bytes each rank sends per step:\n\n")
    return intro + _table(["ranks", "compressed step", "fp32 ring allreduce", "ratio", "collectives per compressed step"], rows)


def allreduce_table() -> str:
    data = _load("allreduce_sweep_P2")
    torch_rows = {r["numel"]: r for r in _load("allreduce_sweep_P2_torch")["rows"]}
    rows = [
        [f"{r['numel']:,}", _s(r["fp32_s"]), _s(r["onebit_s"]), f"{r['fp32_s'] / r['onebit_s']:.2f}",
         _s(torch_rows[r["numel"]]["onebit_s"]), f"{torch_rows[r['numel']]['fp32_s'] / torch_rows[r['numel']]['onebit_s']:.2f}",
         f"{r['fp32_bytes'] / r['onebit_bytes']:.1f}"]
        for r in data["rows"]
    ]
    header = ["elements", "fp32 `all_reduce`", "compressed (C kernels)", "speed ratio", "compressed (torch kernels)",
              "speed ratio", "bytes ratio"]
    return f"{data['args']['world_size']} ranks, median of {data['args']['repeats']}:\n\n" + _table(header, rows)


def loopback_step_table() -> str:
    rows = []
    for world_size, params in ((2, 25_000_000), (2, 10_000_000), (3, 10_000_000)):
        data = _load(f"compressed_step_P{world_size}_{params}")
        base, onebit = data["max_baseline_s"], data["max_compressed_s"]
        rows.append([f"{params / 1e6:.0f}M", str(world_size), _s(base), _s(onebit), f"{base / onebit:.2f}x"])
    header = ["parameters", "ranks", "fp32 allreduce + AdamW(foreach)", "OnebitAdam compressed step",
              "speed ratio (goal >= 1 at 25M, 2 ranks)"]
    return _table(header, rows)


_SLOW_LINK_ROWS = (
    ("ddp_fp32", "DDP fp32 + AdamW"),
    ("ddp_bf16", "DDP + bf16_compress_hook + AdamW"),
    ("ddp_powersgd", "DDP + PowerSGD rank 4 + AdamW"),
    ("onebit_adam:warmup", "onebit_adam, warmup"),
    ("onebit_adam:compression", "**onebit_adam, compression stage**"),
    ("onebit_overlap:warmup", "onebit_adam overlapped with backward, warmup"),
    ("onebit_overlap:compression", "**onebit_adam overlapped with backward, compression stage**"),
    ("zeroone_adam:warmup", "zeroone_adam, variance steps (full precision)"),
    ("zeroone_adam:local", "**zeroone_adam, local steps, syncs every 16 (mean)**"),
    ("onebit_lamb:warmup", "onebit_lamb, warmup"),
    ("onebit_lamb:compression", "**onebit_lamb, compression stage**"),
    ("local_2proc", "2 processes, no communication"),
    ("floor", "compute floor (1 process, no communication)"),
)


def _ratio(value: Any) -> str:
    return "-" if value is None else f"{value:.2f}x"


def _goal_line(rate: str, goal: dict[str, Any]) -> str:
    """One goal of a slow_link run. Goals that carry their ``rate`` (newer runs) are judged only at that rate; at
    other rates their value is shown for reference."""
    if goal.get("met") is None and "rate" in goal:
        verdict = f"reference (the goal is set at {goal['rate']})"
    else:
        verdict = "met" if goal["met"] else "**not met**"
    return f"- {rate}: {goal['goal']} = **{goal['value']:.2f}** (goal {goal['target']}): {verdict}"


def slow_link_table(name: str = "slow_link", goals: bool = True) -> str:
    data = _load(name)
    rates = list(data["rates"])
    cfg = data["config"]
    model = data.get("model", {})
    header = ["method", "bytes per rank per step"]
    for rate in rates:
        header += [f"{rate} step", "vs onebit"]
    rows = []
    for key, label in _SLOW_LINK_ROWS:
        first = data["rates"][rates[0]]["rows"].get(key)
        if first is None:
            continue
        row = [label, f"{int(first['bytes_per_step']):,}"]
        for rate in rates:
            r = data["rates"][rate]["rows"][key]
            row += [_s(r["step_s"]), _ratio(r["ratio_to_onebit_compression"])]
        rows.append(row)
    params = model.get("params")
    described = f"{params / 1e6:.1f}M parameters, " if params else ""
    intro = (f"BERT {cfg['layers']} layers / hidden {cfg['hidden']} ({described}batch {cfg['batch']} x sequence "
             f"{cfg['seq']} per rank), {data['environment']['world_size']} ranks, median of {cfg['steps']} steps "
             f"(slower rank) after {cfg['warmup_steps']} warmup steps:\n\n")
    if not goals:  # e.g. the family run: the goals slow_link.py judges belong to other issues' runs
        return intro + _table(header, rows)
    goals = [_goal_line(rate, g) for rate in rates for g in data["rates"][rate]["goals"]]
    if all("rate" in g for rate in rates for g in data["rates"][rate]["goals"]):  # newer runs: goals carry their rate
        return (intro + _table(header, rows) + "\n\nGoals (each judged at the link rate its issue sets):\n\n"
                + "\n".join(goals))
    others = [rate for rate in rates if rate != "1gbit"]
    scope = f"; {', '.join(others)} shown for reference" if others else ""
    return intro + _table(header, rows) + f"\n\nGoals (defined at 1 Gbit/s{scope}):\n\n" + "\n".join(goals)


_OVERLAP_RUNS = ("slow_link_overlap_minilm", "slow_link_overlap_deep", "slow_link_overlap_deep_batch8")


def overlap_table(names: tuple[str, ...] = _OVERLAP_RUNS) -> str:
    """Issue 13 (the compressed momentum exchange overlapped with backward): per model preset, from
    ``slow_link.py --model PRESET --name slow_link_overlap_PRESET`` runs, step time against the 2-process
    no-communication row, bytes, and the exchange time left exposed after backward (and spent in the DDP hooks)."""
    parts = []
    for name in names:
        if not (RESULTS / f"{name}.json").exists():
            continue
        data = _load(name)
        cfg, model = data["config"], data["model"]
        preset = cfg.get("model", "minilm") + ("" if cfg.get("model_is_preset", True) else ", modified")
        parts.append(
            f"**{preset}**: BERT {cfg['layers']} layers / hidden {cfg['hidden']} / vocabulary {cfg['vocab']} "
            f"({model['params'] / 1e6:.1f}M parameters, embeddings {model['embedding_share']:.0%}; batch "
            f"{cfg['batch']} x sequence {cfg['seq']} per rank), {data['environment']['world_size']} ranks, median of "
            f"{cfg['steps']} steps (slower rank) after {cfg['warmup_steps']} warmup steps. DDP's "
            f"{len(model['ddp_buckets']['elements'])} gradient buckets: the last holds "
            f"{model['last_bucket_share']:.1%} of the gradient elements, {model['outside_last_bucket_share']:.1%} "
            "lie outside it.")
        for rate, run in data["rates"].items():
            rows = []
            for key, label in _SLOW_LINK_ROWS:
                r = run["rows"].get(key)
                if r is None:
                    continue
                ms = lambda field: "-" if r.get(field) is None else f"{r[field]:.1f}"  # noqa: E731
                rows.append([label, _s(r["step_s"]), _ratio(r.get("ratio_to_local_2proc")),
                             f"{int(r['bytes_per_step']):,}", ms("exposed_ms_per_step"), ms("hook_ms_per_step")])
            header = ["method", f"{rate} step", "vs 2 processes", "bytes per rank per step", "exposed ms per step",
                      "hook ms per step"]
            parts.append(_table(header, rows))
            lines = []
            exposed = run.get("exposed_reduction")
            if exposed:
                lines.append(f"- {rate}: exposed exchange per step {exposed['onebit_adam_ms']:.1f} ms (onebit_adam) "
                             f"-> {exposed['onebit_overlap_ms']:.1f} ms (overlapped): reduction "
                             f"**{exposed['reduction']:.2f}**, share outside DDP's last bucket "
                             f"{exposed['outside_last_bucket_share']:.2f}")
            lines += [_goal_line(rate, g) for g in run["goals"]]
            if lines:
                parts.append("\n".join(lines))
    return "\n\n".join(parts)


def bucket_sweep_table() -> str:
    """Compression-stage step time per bucket size, from the slow_link_onebit_bucket*.json runs."""
    runs = {}
    for path in sorted(RESULTS.glob("slow_link_onebit_bucket*.json")):
        data = json.loads(path.read_text())
        runs[float(data["config"]["onebit_bucket_cap_mb"])] = data
    rates = list(next(iter(runs.values()))["rates"])
    header = ["bucket_cap_mb", "collectives per step"] + [f"{rate} step" for rate in rates]
    rows = []
    for cap in sorted(runs):
        data = runs[cap]
        first = data["rates"][rates[0]]["rows"]["onebit_adam:compression"]
        row = [f"{cap:g}" + (" (default)" if cap == 25.0 else ""), f"{first['collectives_per_step']:g}"]
        for rate in rates:
            row.append(_s(data["rates"][rate]["rows"]["onebit_adam:compression"]["step_s"]))
        rows.append(row)
    return _table(header, rows)


def memory_table() -> str:
    data = _load("memory")
    adamw, onebit = data["per_rank"]["adamw"][0], data["per_rank"]["onebit"][0]
    rows = [["optimizer state (momentum, variance)", f"{adamw['optimizer_bytes'] / MIB:.0f} MiB",
             f"{onebit['breakdown']['state (momentum, variance)'] / MIB:.0f} MiB"]]
    for key, value in onebit["breakdown"].items():
        if key != "state (momentum, variance)":
            rows.append([key, "-", f"{value / MIB:.0f} MiB"])
    rows.append(["**optimizer total**", f"**{adamw['optimizer_bytes'] / MIB:.0f} MiB**",
                 f"**{onebit['optimizer_bytes'] / MIB:.0f} MiB**"])
    rows.append(["peak resident memory of the process", f"{adamw['peak_rss_bytes'] / MIB:.0f} MiB",
                 f"{onebit['peak_rss_bytes'] / MIB:.0f} MiB"])
    intro = (f"{data['args']['params'] / 1e6:.0f}M fp32 parameters, {data['args']['world_size']} ranks, rank 0 "
             f"(parameters themselves: {adamw['param_bytes'] / MIB:.0f} MiB):\n\n")
    table = _table(["", "AdamW", "OnebitAdam"], rows)
    a = onebit.get("step_allocations")
    if a:
        table += (f"\n\nOne more steady-state OnebitAdam step (torch profiler) allocates {a['own_count']} small tensors "
                  f"of its own, {a['own_bytes'] / 1024:.1f} KiB in all (largest {a['own_largest_bytes'] / 1024:.1f} "
                  f"KiB: per-segment scales and norms), plus {a['collective_bytes'] / MIB:.1f} MiB that gloo "
                  f"allocates inside its collectives.")
    return intro + table


def largest_model_table() -> str:
    data = _load("largest_model")
    args = data["args"]
    gib = 2**30
    rows = []
    for name, run in data["runs"].items():
        best, failed = run["largest_trained"], run["smallest_failed"]
        rows.append([
            f"`{name}`",
            f"**{best['numel'] / 1e6:.0f}M** ({best['layers']} layers), peak {best['cgroup_peak_bytes'] / gib:.1f} GiB"
            if best else "none",
            f"{failed['numel'] / 1e6:.0f}M ({failed['layers']} layers)" if failed else "not reached",
            f"{run['bytes_per_param']:.1f} B" if run.get("bytes_per_param") else "-",
        ])
    runs = data["runs"]
    ratio = ""
    if all(runs.get(n, {}).get("largest_trained") for n in ("onebit_adam", "onebit_fsdp")):
        times = runs["onebit_fsdp"]["largest_trained"]["numel"] / runs["onebit_adam"]["largest_trained"]["numel"]
        ratio = f" `onebit_fsdp` trains a model {times:.2f}x as large."
    intro = (f"{args['devices']} CPU ranks ({args['devices'] // args['ranks_per_node']} simulated nodes x "
             f"{args['ranks_per_node']} under `onebit_fsdp`), a stack of `Linear({args['width']}, {args['width']})` "
             f"blocks, 1-bit Adam, {args['freeze_step']} warmup and {args['steps'] - args['freeze_step']} compressed "
             f"steps at batch {args['batch']}, the 4 processes capped together at "
             f"{data['limit_bytes'] / gib:.1f} GiB (a memory cgroup; the machine has {data['memory_total_bytes'] / gib:.1f}"
             f" GiB). Peak: the cgroup's, all 4 processes together. Memory per parameter: the slope of the peak between"
             f" the two small trials, all 4 ranks together.{ratio}\n\n")
    return intro + _table(["strategy", "largest that trained", "smallest that did not", "memory per parameter"],
                          rows)


def parity_table() -> str:
    data = _load("bert_parity")
    a = data["runs"]["ddp_adamw"]
    compressed = {name: run for name, run in data["runs"].items() if name != "ddp_adamw"}
    rows = [
        ["validation accuracy", f"{a['val_acc']:.2%}", *(f"{o['val_acc']:.2%}" for o in compressed.values())],
        ["validation macro F1", f"{a['val_f1']:.4f}", *(f"{o['val_f1']:.4f}" for o in compressed.values())],
        ["bytes sent per rank, whole run", f"{a['bytes_sent']:,}",
         *(f"{o['bytes_sent']:,} ({a['bytes_sent'] / o['bytes_sent']:.1f}x less)" for o in compressed.values())],
        ["communication rounds per 100 steps", _rounds(a), *(_rounds(o) for o in compressed.values())],
        ["bytes per rank per round", f"{a['bytes_sent'] / a['steps']:,.0f}",
         *(_per_round(o) for o in compressed.values())],
        ["wall time (loopback, validation included)", f"{a['wall_s']:.1f} s",
         *(f"{o['wall_s']:.1f} s" for o in compressed.values())],
    ]
    intro = f"{a['steps']} steps, " + ", ".join(_schedule(name, o) for name, o in compressed.items()) + ":\n\n"
    table = _table(["", "DDP + AdamW", *compressed], rows)
    if "bag_of_words_val_acc" in data:
        table += (f"\n\nA bag-of-words logistic regression reaches {data['bag_of_words_val_acc']:.1%} on the same task "
                  "(chance is 50%): the task needs word order.")
    return intro + table


def _full_precision_steps(run: dict[str, Any]) -> int:
    kinds = run.get("steps_by_kind")
    return run["freeze_step"] if kinds is None else kinds.get("warmup", 0) + kinds.get("variance", 0)


def _schedule(name: str, run: dict[str, Any]) -> str:
    kinds = run.get("steps_by_kind") or {}
    if "local" in kinds or "sync" in kinds:
        return (f"{name} updated the variance on {_full_precision_steps(run)} steps and took "
                f"{kinds.get('local', 0)} local steps without communication")
    how = " (freeze_step='auto')" if run.get("auto_freeze") else ""
    return f"{name} froze at step {run['freeze_step']}{how}"


def _rounds(run: dict[str, Any]) -> str:
    """Steps that communicated, per 100 steps (every step of DDP, 1-bit Adam and 1-bit LAMB)."""
    return f"{run['rounds_per_100_steps']:.1f}"


def _per_round(run: dict[str, Any]) -> str:
    full = _full_precision_steps(run)
    rounds = round(run["rounds_per_100_steps"] * run["steps"] / 100) - full
    warm = run["bytes_sent_warmup"] / full
    comp = run["bytes_sent_compression"] / rounds
    return f"{warm:,.0f} full precision, {comp:,.0f} compressed ({warm / comp:.1f}x less)"


def freeze_sweep_table() -> str:
    """Per seed: validation accuracy of each fixed freeze_step and of freeze_step='auto', and the issue's goals."""
    data = _load("freeze_step_sweep")
    rows, args = data["rows"], data["args"]
    fixed = sorted({r["freeze_step"] for r in rows if r["freeze_step"] != "auto"})
    header = ["seed", *(f"freeze {f}" for f in fixed), "auto (decided step)", "loss before the decision",
              "detector ms / warmup step"]
    table = []
    for seed in sorted({r["seed"] for r in rows}):
        by = {r["freeze_step"]: r for r in rows if r["seed"] == seed}
        a = by.get("auto")
        table.append([str(seed), *(f"{by[f]['val_acc']:.1%}" if f in by else "-" for f in fixed),
                      "-" if a is None else f"{a['val_acc']:.1%} ({a['decided_step']}, {a['reason']})",
                      "-" if a is None else f"{a['loss_before_decision']:.3f}",
                      "-" if a is None else f"{a['detector_ms_per_warmup_step']:.2f}"])
    goals = []
    for g in data.get("summary", []):
        close = g["accuracy_points"] >= -0.5
        short = g["warmup_ratio"] <= 1.5
        goals.append(
            f"- seed {g['seed']}: best fixed step {g['best_fixed_step']} ({g['best_fixed_acc']:.1%}); auto "
            f"{g['auto_step']} ({g['auto_acc']:.1%}): {g['accuracy_points']:+.1f} points "
            f"({'met' if close else '**not met**'}: within 0.5), warmup x{g['warmup_ratio']:.2f} "
            f"({'met' if short else '**not met**'}: at most x1.5)"
        )
    intro = (f"{args['steps']} steps, lr {args['lr']:g}, one process per run; validation accuracy (chance is 50%). "
             f"auto: window {args['auto_window']}, check every {args['auto_check_every']}, threshold "
             f"{args['auto_threshold']:g}"
             + (f", tensor threshold {args['auto_tensor_threshold']:g}" if "auto_tensor_threshold" in args else "")
             + (f", loss drop {args['auto_loss_drop']:g}" if args.get("auto_loss_drop") is not None else "")
             + f", patience {args['auto_patience']}, max step {args['auto_max_step']}:\n\n")
    return intro + _table(header, table) + ("\n\n" + "\n".join(goals) if goals else "")


_MULTINODE_ROWS = (
    ("ddp_fp32", "DDP fp32 allreduce + AdamW"),
    ("onebit_flat", "onebit_adam, flat 1-bit"),
    ("onebit_hierarchical", "**onebit_adam, hierarchical 1-bit**"),
    ("local_4proc", "4 processes, no communication"),
)


def _mb(value: float) -> str:
    return f"{value / 1e6:,.2f} MB"


def _multinode_goals(data: dict[str, Any]) -> list[str]:
    """The issue's goals, from one run: bytes per node (counters and veth) and step-time ratios per rate."""
    n = data["model"]["params"]
    lines = []

    def verdict(ok: bool) -> str:
        return "met" if ok else "**not met**"

    first = data["rates"][next(iter(data["rates"]))]["rows"]
    hier, flat = first.get("onebit_hierarchical"), first.get("onebit_flat")
    if hier is not None:
        for source, key in (("counters", "counters_bytes_per_node"), ("veth", "veth_bytes_per_node")):
            ratio = hier[key] / n
            lines.append(f"- hierarchical bytes leaving a node per step ({source}) = **N/{1 / ratio:.2f}** "
                         f"(goal <= N/7): {verdict(ratio <= 1 / 7)}")
        if flat is not None:
            for source, key in (("counters", "counters_bytes_per_node"), ("veth", "veth_bytes_per_node")):
                ratio = hier[key] / flat[key]
                lines.append(f"- hierarchical / flat bytes ({source}) = **{ratio:.3f}** (goal <= 0.55): "
                             f"{verdict(ratio <= 0.55)}")
    for rate, run in data["rates"].items():
        rows = run["rows"]
        if "onebit_hierarchical" not in rows:
            continue
        h = rows["onebit_hierarchical"]["step_s"]
        if rate == "50mbit" and "onebit_flat" in rows:
            f = rows["onebit_flat"]["step_s"]
            lines.append(f"- {rate}: flat / hierarchical step = **{f / h:.2f}** (goal > 1): {verdict(f > h)}")
        if rate == "200mbit" and "ddp_fp32" in rows:
            d = rows["ddp_fp32"]["step_s"]
            lines.append(f"- {rate}: DDP fp32 / hierarchical step = **{d / h:.2f}** (goal >= 4): {verdict(d >= 4 * h)}")
    return lines


def multinode_table(name: str = "multinode", with_formulas: bool = True) -> str:
    """Simulated 2 nodes x 2 ranks (``python -m benchmarks.multinode``): step time per link rate, bytes leaving each
    node per step from the counters, the veth and the formula; then the formula at 2, 4 and 16 nodes x 8 ranks, and
    the goals."""
    data = _load(name)
    rates = list(data["rates"])
    cfg, env = data["config"], data["environment"]
    first = data["rates"][rates[0]]
    header = ["method", "counters", "on the veth", "difference", "formula"]
    for rate in rates:
        header += [f"{rate} step", "vs hierarchical"]
    rows = []
    for key, label in _MULTINODE_ROWS:
        r0 = first["rows"].get(key)
        if r0 is None:
            continue
        analytic = " (analytic)" if r0["counters_source"].startswith("analytic") else ""
        diff = "-" if r0["rel_diff"] is None else f"{r0['rel_diff']:+.1%}"
        row = [label, _mb(r0["counters_bytes_per_node"]) + analytic, _mb(r0["veth_bytes_per_node"]), diff,
               _mb(r0["formula_bytes_per_node"])]
        for rate in rates:
            r = data["rates"][rate]["rows"][key]
            ratio = r.get("ratio_to_hierarchical")
            row += [_s(r["step_s"]), f"{ratio:.2f}x" if ratio else "-"]
        rows.append(row)
    n = data["model"]["params"]
    barrier = statistics.fmean(b["qdisc_bytes"] for b in first["barrier_bytes_per_node"])
    intro = (f"BERT {cfg['layers']} layers / hidden {cfg['hidden']} ({n / 1e6:.1f}M parameters, batch {cfg['batch']} "
             f"x sequence {cfg['seq']} per rank) on {env['nodes']} simulated nodes x {env['ranks_per_node']} ranks "
             f"(network namespaces joined by a veth pair, both ends shaped with tbf), gloo, one thread per rank; "
             f"median of {cfg['steps']} steps (slowest rank), the 1-bit methods in the compression stage. Bytes "
             f"leaving each node per step at {rates[0]}: the ranks' `bytes_sent_inter_node` counters (payload), the "
             f"veth's tbf qdisc (TCP/IP headers and ACKs included, the window's barriers of ~{barrier:,.0f} B each "
             "subtracted) and the formula:\n\n")
    formula_rows = []
    for f in data["formulas"]["table"]:
        p = f["per_parameter"]
        formula_rows.append([f"{f['nodes']} x {f['ranks_per_node']}"]
                            + [f"{p[k]:.3g}N = {_mb(f['bytes'][k])}" for k in ("fp32_ring", "onebit_flat",
                                                                                  "onebit_hierarchical")]
                            + [f"{p['onebit_flat'] / p['onebit_hierarchical']:.1f}x"])
    formulas = _table(["nodes x ranks", "fp32 ring", "flat 1-bit", "hierarchical 1-bit", "flat / hierarchical"],
                      formula_rows)
    goals = "\n\nGoals:\n\n" + "\n".join(_multinode_goals(data))
    if not with_formulas:
        return intro + _table(header, rows) + goals
    return (intro + _table(header, rows) + f"\n\nBytes leaving each node per step by formula for this model "
            f"(N = {n:,}):\n\n" + formulas + goals)


def intra_reduce_table() -> str:
    data = _load("intra_reduce_P2")
    rows = [
        [f"{r['numel']:,}", _s(r["reduce_scatter_tensor_s"]), _s(r["all_to_all_sum_s"]), _s(r["gather_fp32_s"]),
         _s(r["gather_packed_s"])]
        for r in data["rows"]
    ]
    intro = (f"{data['world_size']} ranks of one node, loopback, one thread per rank, median of {data['repeats']} "
             "(slower rank):\n\n")
    header = ["elements", "`reduce_scatter_tensor`", "`all_to_all` + sum (used)", "gather fp32 shards",
              "gather packed blocks (used)"]
    return intro + _table(header, rows)


# A real node for the time model: per-rank intra-node bandwidth and per-node inter-node bandwidth, bytes/s.
_TIME_MODEL_PARAMS = 340e6  # BERT-Large
_TIME_MODEL_LINKS = (("NVLink, 150 GB/s", 150e9), ("PCIe, 25 GB/s", 25e9))
_TIME_MODEL_NICS = (("100 Gbit/s", 12.5e9), ("10 Gbit/s", 1.25e9))


def topology_model_table() -> str:
    """The README's time model, evaluated (pure formulas, lightning_onebit.comm.bytes_leaving_node)."""
    from lightning_onebit.comm import bytes_leaving_node

    n, per_node = _TIME_MODEL_PARAMS, 8
    crossover_rows, time_rows = [], []
    for nodes in (2, 4, 16):
        flat = bytes_leaving_node(1, nodes, per_node, "flat")
        hier = bytes_leaving_node(1, nodes, per_node, "hierarchical")
        intra = (per_node - 1) / per_node * (4 + 1 / 8)  # reduce-scatter in fp32 + gather of packed blocks, per N
        crossover_rows.append([f"{nodes} x {per_node}", f"{bytes_leaving_node(1, nodes, per_node, 'fp32_ring'):.3g}N",
                               f"{flat:.3g}N", f"{hier:.3g}N", f"{intra / (flat - hier):.1f}"])
        for link, b_intra in _TIME_MODEL_LINKS:
            row = [f"{nodes} x {per_node}", link]
            for _, b_inter in _TIME_MODEL_NICS:
                t_flat = flat * n / b_inter
                t_hier = intra * n / b_intra + hier * n / b_inter
                row += [f"{1e3 * t_flat:.0f} ms", f"{1e3 * t_hier:.0f} ms"]
            time_rows.append(row)
    crossover = _table(["nodes x ranks", "fp32 ring", "flat 1-bit", "hierarchical 1-bit",
                        "hierarchical wins above B_intra / B_inter ="], crossover_rows)
    header = ["nodes x ranks", "intra-node link"]
    for nic, _ in _TIME_MODEL_NICS:
        header += [f"flat, {nic}", f"hierarchical, {nic}"]
    return ("Bytes leaving each node per step (N parameters) and the bandwidth ratio above which hierarchical is "
            "faster:\n\n" + crossover + f"\n\nModelled exchange time per step for BERT-Large "
            f"({n / 1e6:.0f}M parameters):\n\n" + _table(header, time_rows))


def advisor_table() -> str:
    data = _load("advisor")
    cfg = data["config"]
    rows = []
    for r in data["rows"]:
        share = r["exposed_s"] / r["step_s"]
        verdict = "helps" if r["step_s"] - r["expected_step_s"] >= 0.05 * r["step_s"] else "cannot help"
        rows.append([
            r["rate"], _s(r["step_s"]), f"{_s(r['exposed_s'])} ({share:.0%})",
            f"{r['warmup_bytes'] / r['compressed_bytes']:.1f}x", f"{_s(r['expected_step_s'])} ({verdict})",
            _s(r["measured_step_s"]), f"{r['measured_step_s'] / r['expected_step_s'] - 1:+.0%}",
        ])
    header = ["link", "warmup step", "allreduce exposed", "fewer bytes", "advice: expected step",
              "measured compression step", "measured vs expected"]
    return (f"The example (`{cfg['example']}`), {cfg['ranks']} ranks, freeze_step {cfg['freeze_step']}, "
            f"{cfg['steps']} steps; medians of the last 20 warmup steps and of 20 compression-stage steps, slowest "
            "rank:\n\n" + _table(header, rows))


def own_data_table() -> str:
    """The new-user run (``python -m benchmarks.own_data``): a pretrained model and TSV files, AdamW against 1-bit
    Adam, and 1-bit Adam with the word embeddings averaged in full precision."""
    data = _load("own_data")
    names = [n for n in ("adamw", "onebit_adam", "onebit_adam_full_precision_embeddings") if n in data["runs"]]
    runs = [data["runs"][n] for n in names]
    adamw = data["runs"]["adamw"]
    counts = data["counts"]
    size = f", {counts['train']:,} training and {counts['dev']:,} validation rows" if counts else ""

    def froze(run: dict[str, Any]) -> str:
        return f"{run['steps']} (froze at step {run['freeze_step']})" if run.get("freeze_step") else str(run["steps"])

    rows = [
        ["validation accuracy"] + [f"{r['val_acc']:.2%}" for r in runs],
        ["validation macro F1"] + [f"{r['val_f1']:.4f}" for r in runs],
        ["optimizer steps"] + [froze(r) for r in runs],
        ["bytes sent per rank, whole run"] + [
            f"{r['bytes_sent']:,}" + ("" if r is adamw else f" ({adamw['bytes_sent'] / r['bytes_sent']:.1f}x less)")
            for r in runs],
        ["wall time (loopback, validation included)"] + [f"{r['wall_s']:.1f} s" for r in runs],
    ]
    header = {"adamw": "DDP + AdamW", "onebit_adam": "1-bit Adam",
              "onebit_adam_full_precision_embeddings": "1-bit Adam, word embeddings in full precision"}
    model = Path(data["model"])
    text = (f"{data['data']}{size}; model `{model.parent.name}/{model.name}`; 2 CPU processes; every run with "
            f"`{' '.join(data['args'])}`; the 1-bit Adam runs also with "
            + ", ".join(f"`{' '.join(data['runs'][n]['args'])}`" for n in names if n != "adamw")
            + ":\n\n" + _table([""] + [header[n] for n in names], rows))
    for name, run in zip(names, runs):
        if not run.get("log"):
            continue
        text += f"\n\n{header[name]}:"
        advice = run.get("advice")
        if advice and advice.get("measured_step_s"):
            text += (f" the advisor at the freeze expected {_s(advice['expected_step_s'])} per compression-stage step "
                     f"(warmup step {_s(advice['step_s'])}, allreduce exposed {_s(advice['exposed_s'])}); measured "
                     f"{_s(advice['measured_step_s'])}, median of {advice['measured_steps']} steps.")
        text += " What it logged:\n\n```text\n" + "\n".join(run["log"]) + "\n```"
    return text


def headline_figures() -> str:
    """The README's figures: 1-bit Adam with its defaults on the example and the real fine-tuning tasks (accuracy,
    whole-run bytes), local steps, and step time on a slow link."""
    lines = _defaults_headline(defaults_runs())
    runs = _load(FREEZE_CAPPED)["runs"]
    lines += _local_steps_headline(runs)
    link = _load("slow_link")
    rows = link["rates"].get("200mbit", {}).get("rows", {})
    if "ddp_fp32" in rows and "onebit_adam:compression" in rows:
        onebit, fp32 = rows["onebit_adam:compression"]["step_s"], rows["ddp_fp32"]["step_s"]
        bf16 = rows.get("ddp_bf16", {}).get("step_s")
        lines.append(
            f"- **On a 200 Mbit/s link** (a {link['config']['layers']}-layer BERT of "
            f"{link['model']['params'] / 1e6:.1f}M parameters, 2 ranks): a compression-stage step takes "
            f"{onebit:.2f} s against {fp32:.2f} s for DDP in fp32 (**{fp32 / onebit:.1f}x faster**)"
            + (f" and {bf16:.2f} s for DDP with bf16 gradients" if bf16 else "") + ".")
    return "\n".join(lines)


def _defaults_headline(runs: dict[tuple[str, str, int], dict[str, Any]]) -> list[str]:
    """The README's figure for 1-bit Adam with every default (the PowerSGD warmup, ``freeze_step="auto"``): accuracy
    per task and seed against AdamW-DDP, and the whole-run bytes against AdamW-DDP and DDP + PowerSGD rank 4."""
    names = {"synthetic": "the example", "mail": "mail", "agnews": "AG News"}
    parts, fewer, fewer_powersgd = [], [], []
    for task, label in names.items():
        got = [(runs.get((task, DEFAULTS_CANDIDATE["1-bit Adam"], s)), runs.get((task, "adamw", s)),
                runs.get((task, "ddp_powersgd_r4@0.1", s))) for s in (0, 1)]
        got = [g for g in got if all(g)]
        if not got:
            continue
        parts.append(f"{label} " + " / ".join(f"{run['val_acc']:.1%}" for run, _, _ in got) + " (AdamW-DDP "
                     + " / ".join(f"{ref['val_acc']:.1%}" for _, ref, _ in got) + ")")
        fewer += [ref["bytes_sent"] / run["bytes_sent"] for run, ref, _ in got]
        fewer_powersgd += [powersgd["bytes_sent"] / run["bytes_sent"] for run, _, powersgd in got]
    if not parts:
        return []
    return [
        f"- **1-bit Adam with its defaults** (a PowerSGD warmup, `freeze_step=\"auto\"`; 2 ranks; seeds 0 / 1): "
        + "; ".join(parts) + f", with **{min(fewer):.0f}-{max(fewer):.0f}x fewer bytes over the whole run** than "
        f"AdamW-DDP and {min(fewer_powersgd):.1f}-{max(fewer_powersgd):.1f}x fewer than DDP + PowerSGD rank 4 "
        "([every run](docs/benchmarks.md))."
    ]


def _span(values: list[float]) -> str:
    """``"254x"``, or ``"254-256x"`` when the values round apart."""
    low, high = f"{min(values):.0f}", f"{max(values):.0f}"
    return f"{low}x" if low == high else f"{low}-{high}x"


def _local_steps_headline(capped: dict[str, Any]) -> list[str]:
    """The README's local-steps figures: ``onebit_diloco`` with its defaults (the 1-bit outer step every 8 inner steps,
    outer SGD at its default lr: the run named after them) on the example and on the byte-level language model, both
    seeds, against AdamW-DDP."""
    from benchmarks.freeze_sweep import canonical_run
    from lightning_onebit.strategy.local_steps_run import DEFAULTS, OUTER_LR

    if not (RESULTS / "local_steps_sweep.json").exists() or not (RESULTS / "lm_local_steps.json").exists():
        return []
    assert DEFAULTS.outer_optimizer == "sgd", "the headline names the outer SGD's runs"
    lr = OUTER_LR["sgd"]
    name = canonical_run(f"diloco_{DEFAULTS.compressor}_sgd{float(lr)}@{DEFAULTS.sync_every}")
    example = _load("local_steps_sweep")["runs"]
    lm = _load("lm_local_steps")["runs"]
    pairs = [(example.get(f"synthetic/{name}/{s}"), capped.get(f"synthetic/adamw/{s}")) for s in (0, 1)]
    lm_pairs = [(lm.get(f"lm/{name}/{s}"), lm.get(f"lm/adamw/{s}")) for s in (0, 1)]
    if not all(a and b for a, b in pairs + lm_pairs):
        return []
    accs = " / ".join(f"{run['val_acc']:.1%}" for run, _ in pairs)
    refs = " / ".join(f"{ref['val_acc']:.1%}" for _, ref in pairs)
    fewer = statistics.fmean(ref["bytes_sent"] / run["bytes_sent"] for run, ref in pairs)
    losses = " / ".join(f"{100 * (run['val_loss'] / ref['val_loss'] - 1):+.1f}%" for run, ref in lm_pairs)
    lm_fewer = statistics.fmean(ref["bytes_sent"] / run["bytes_sent"] for run, ref in lm_pairs)
    tasks, ratios = [], [fewer]
    for task, label in (("mail", "mail"), ("agnews", "AG News")):  # the fine-tuning tasks, where both seeds ran
        task_pairs = [(example.get(f"{task}/{name}/{s}"), capped.get(f"{task}/adamw/{s}")) for s in (0, 1)]
        if all(a and b for a, b in task_pairs):
            ratios.append(statistics.fmean(ref["bytes_sent"] / run["bytes_sent"] for run, ref in task_pairs))
            mine = " / ".join(f"{run['val_acc']:.1%}" for run, _ in task_pairs)
            theirs = " / ".join(f"{ref['val_acc']:.1%}" for _, ref in task_pairs)
            tasks.append(f"{label} {mine} (AdamW-DDP {theirs})")
    fine_tuning = f"; fine-tuning, {'; '.join(tasks)}" if tasks else ""
    return [
        f"- **Local steps** (`strategy=\"onebit_diloco\"`, its defaults: a 1-bit outer step every "
        f"{DEFAULTS.sync_every} inner AdamW steps, outer SGD at lr {lr:g}): the example reaches {accs} (AdamW-DDP {refs}, seeds 0 / 1){fine_tuning}, with "
        f"**{_span(ratios)} fewer bytes**; a byte-level language model trained from scratch ends {losses} above AdamW-DDP's validation loss "
        f"with {lm_fewer:.0f}x fewer bytes ([local steps](docs/guides/local-steps.md))."
    ]


#: The library-defaults matrix of freeze_step="auto" (issue 26) as it was before the update's cap (``cap_update``),
#: from several libraries, and the reference runs it reuses from earlier files (same task, seed, steps and settings;
#: the reference optimizers do not depend on the freeze rule). The 0/1 Adam settings table still compares with its
#: AdamW runs; the freeze table is :data:`FREEZE_CAPPED`'s.
FREEZE_DEFAULTS = "freeze_sweep_defaults"
FREEZE_REFERENCES = {
    "freeze_sweep": ("adamw", "lamb_uncompressed"),
    "freeze_sweep_synthetic_defaults": ("adamw", "lamb_uncompressed"),
    "freeze_sweep_sparse_rows": ("onebit_adam@0.25",),  # the word embeddings as a sparse_rows group, as now
}


#: Runs with a later library that replace the same task/run/seed of :data:`FREEZE_DEFAULTS`, or add to them, later
#: files winning: 1-bit LAMB with the compression stage's trust-ratio cap (``OnebitLamb(cap_trust_ratio=True)``, the
#: default since it was measured); its ``auto`` runs with the rule that needs only the loss guard and the averaged
#: trust-ratio change under the cap; 0/1 Adam with its schedule scaled to the run (``var_update_scaler`` a tenth of
#: it); every synthetic run again with one library, 829e63a (results of the same settings had moved
#: with the library since the first runs: AdamW seed 0 99.8% then, 99.6% now; the same library gives the same bits),
#: with 1-bit Adam frozen at 20% of the run besides.
FREEZE_SUPERSEDING = ("freeze_sweep_lamb_cap", "freeze_sweep_lamb_capped_rule", "freeze_sweep_zeroone",
                      "freeze_sweep_synthetic_rerun")


def freeze_defaults_runs() -> dict[str, Any]:
    """The runs of :data:`FREEZE_DEFAULTS`, those of :data:`FREEZE_SUPERSEDING` in place of the same keys, completed
    with the reference runs of :data:`FREEZE_REFERENCES` it lacks."""
    data = _load(FREEZE_DEFAULTS)
    runs = dict(data["runs"])
    # 1-bit LAMB runs made before its trust-ratio cap (DeepSpeed's update), unless a later run replaces them
    runs = {key: dict(run, no_cap=True) if run["run"].startswith("onebit_lamb") else run for key, run in runs.items()}
    for name in FREEZE_SUPERSEDING:
        if (RESULTS / f"{name}.json").exists():
            runs.update({key: dict(run, source=f"results/{name}.json") for key, run in _load(name)["runs"].items()})
    for name, kinds in FREEZE_REFERENCES.items():
        for key, run in _load(name)["runs"].items():
            if run["run"] in kinds and key not in runs:
                runs[key] = dict(run, source=f"results/{name}.json")
    return dict(data, runs=runs)


#: Issue 26's matrix with the library as it is now (the update's cap, ``cap_update=True``): every task, both seeds, one
#: library, references included
FREEZE_CAPPED = "freeze_sweep_capped"
#: The example from scratch over six seeds (0 and 1 from :data:`FREEZE_CAPPED`, 2-5 beside them), with the update's
#: cap (the default), and without it (``cap_update=False``, the same runs otherwise)
FREEZE_SEEDS = {True: (FREEZE_CAPPED, "freeze_sweep_seeds"), False: ("freeze_sweep_seeds_uncapped",)}
#: accuracy at or under this is a collapse (the tasks have 2 to 4 classes; chance is 25-50%)
COLLAPSED = 0.6


def _decided_at_bound(run: dict[str, Any]) -> bool:
    """Whether ``freeze_step="auto"`` reached its bound (``max_step``) rather than deciding before it."""
    return (run.get("freeze") or {}).get("reason") == "max_step"


def freeze_defaults_table() -> str:
    """Per task and run (:data:`FREEZE_CAPPED`): accuracy per seed, the difference to the same-seed reference, the
    freeze step per seed (auto: the decided step, starred where the bound decided) and the whole-run bytes against
    the same task's DDP run."""
    from benchmarks.freeze_sweep import table_rows

    results = _load(FREEZE_CAPPED)
    rows = table_rows(results)
    seeds = list(rows[0]["acc"]) if rows else []
    bound = {(r["task"], r["run"], int(r["seed"])) for r in results["runs"].values() if _decided_at_bound(r)}
    header = ["task", "run", *(f"seed {s}" for s in seeds), "vs reference (points)", "freeze step", "DDP bytes / run's"]
    table = []
    for r in rows:
        cells = ["-" if r["acc"][s] is None else f"{r['acc'][s]:.2%}" for s in seeds]
        diff = ("" if r["diff"] is None else
                " / ".join("-" if r["diff"][s] is None else f"{r['diff'][s]:+.2f}" for s in seeds)
                + f" ({r['reference']})")
        freeze = " / ".join("-" if r["freeze"][s] is None
                            else f"{r['freeze'][s]}{'*' if (r['task'], r['run'], s) in bound else ''}" for s in seeds)
        ratio = "-" if r["bytes_ratio"] is None else f"{r['bytes_ratio']:.2f}x"
        table.append([r["task"], r["run"], *cells, diff, freeze, ratio])
    return (
        "Each run is the example (`python -m benchmarks.freeze_sweep --name freeze_sweep_capped`, 2 CPU ranks; "
        "`--val-checks 2` on the real tasks) with the library's defaults: `@auto` sets no AutoFreeze field (bounded "
        "at half the run, window 1/12 of it), `@0.25` and `@0.2` freeze at that share of the run; the word embeddings "
        "of the 1-bit runs are a `sparse_rows` group; `zeroone_adam` is 0/1 Adam with its schedule scaled to the run "
        "(its freeze step is the last of the all-variance steps at the start, a tenth of the run). Differences per "
        "seed are in points against the same-seed reference (AdamW-DDP; for 1-bit LAMB, LAMB that never freezes); "
        "`*`: the bound decided; bytes are the whole run's, the same task's AdamW-DDP bytes over the run's (mean over "
        "seeds); `-`: not run. " + _library_note(results["runs"].values()) + "\n\n" + _table(header, table)
    )


def _library_note(runs: Iterable[dict[str, Any]]) -> str:
    """Which library made the runs of :data:`FREEZE_CAPPED`, and which reference runs were copied into it from
    earlier files (their ``source``) rather than rerun."""
    runs = list(runs)
    own = sorted({r["library"] for r in runs if r.get("library") and not r.get("source")})
    copied = sorted((r["task"], r["run"], int(r["seed"]), r["source"], r.get("library", "?"))
                    for r in runs if r.get("source"))
    note = f"Library {', '.join(own)} for every run (`results/{FREEZE_CAPPED}.json`)"
    if not copied:
        return note + "."
    return note + ", except these references, copied from earlier runs of the same settings (AdamW-DDP and LAMB " \
        "that never freezes run neither the freeze rule nor the update's cap): " + "; ".join(
            f"{task} {run} seed {seed} (`{source}`, library {library})" for task, run, seed, source, library in copied) \
        + "."


def _seed_runs() -> dict[bool, dict[tuple[str, int], dict[str, Any]]]:
    """The synthetic runs of :data:`FREEZE_SEEDS` by cap and (run, seed)."""
    out: dict[bool, dict[tuple[str, int], dict[str, Any]]] = {}
    for cap, names in FREEZE_SEEDS.items():
        out[cap] = {}
        for name in names:
            if (RESULTS / f"{name}.json").exists():
                for run in _load(name)["runs"].values():
                    if run["task"] == "synthetic":
                        out[cap][(run["run"], int(run["seed"]))] = run
    return out


def freeze_seeds_table() -> str:
    """The example from scratch over six seeds: 1-bit Adam frozen at 20% and 25% of the run and by ``auto``, 1-bit
    LAMB at 25% and by ``auto``, with the update's cap and without: the difference to the same-seed reference per seed,
    the runs within 0.5 point of it, the collapses, and the freeze step and bytes (means over seeds)."""
    from benchmarks.freeze_sweep import ddp_bytes_ratio, reference_of

    runs = _seed_runs()
    seeds = sorted({seed for by_run in runs.values() for _, seed in by_run})
    references = {key: run for key, run in runs[True].items() if key[0] in ("adamw", "lamb_uncompressed")}
    reference_runs = {"runs": {str(key): run for key, run in references.items()}}  # ddp_bytes_ratio's form
    header = ["run", "cap_update", *(f"seed {s}" for s in seeds), "within 0.5", "collapsed", "freeze step (mean)",
              "DDP bytes / run's"]
    names = ["onebit_adam@0.2", "onebit_adam@0.25", "onebit_adam@auto", "onebit_lamb@0.25", "onebit_lamb@auto"]
    table = []
    for name in names:
        for cap in (True, False):
            got = {s: runs[cap].get((name, s)) for s in seeds}
            if not any(got.values()):
                continue
            cells, within, collapsed, bound, freezes, ratios = [], 0, 0, 0, [], []
            for s in seeds:
                run, ref = got[s], references.get((reference_of(name), s))
                if run is None or ref is None:
                    cells.append("-")
                    continue
                diff = round(100 * (run["val_acc"] - ref["val_acc"]), 6)  # -0.5 is within, float noise aside
                cells.append(f"{diff:+.1f}" if diff >= -0.5 else f"**{diff:+.1f}**")
                within += diff >= -0.5
                collapsed += run["val_acc"] <= COLLAPSED
                freezes.append(run["freeze_step"])
                bound += _decided_at_bound(run)
                ratios.append(ddp_bytes_ratio(reference_runs, run))
            done = sum(c != "-" for c in cells)
            table.append([name, str(cap), *cells, f"{within} of {done}", str(collapsed),
                          (f"{statistics.fmean(freezes):.0f}" + (f" ({bound} at the bound)" if bound else ""))
                          if freezes else "-",
                          f"{statistics.fmean(ratios):.2f}x" if ratios else "-"])
    for ref_name in ("adamw", "lamb_uncompressed"):
        accs = [references.get((ref_name, s)) for s in seeds]
        table.append([ref_name, "", *("-" if r is None else f"{r['val_acc']:.1%}" for r in accs), "", "", "", "1.00x"])
    libraries = sorted({r["library"] for by_run in runs.values() for r in by_run.values() if r.get("library")})
    return (
        "The example from scratch (a fresh 4-layer BERT, 620 steps, 2 CPU ranks), seeds 0-5: points against the "
        "same-seed reference (AdamW-DDP; for 1-bit LAMB, LAMB that never freezes; their accuracies in the last two "
        "rows), bold where more than 0.5 point under it; `collapsed`: runs that ended at or under "
        f"{COLLAPSED:.0%}. `cap_update=False` runs are the same runs with `-- --optimizer.init_args.cap_update false` "
        "(the paper's update). Sources: `results/freeze_sweep_capped.json` (seeds 0 and 1), "
        "`results/freeze_sweep_seeds.json` (2-5), `results/freeze_sweep_seeds_uncapped.json`; library "
        + ", ".join(libraries) + ".\n\n" + _table(header, table)
    )


def clipped_share_table() -> str:
    """How often ``cap_update`` binds: per task and 1-bit run of :data:`FREEZE_CAPPED`, the share of the compressed
    coordinates above the bound (mean over the compression-stage records of the trace) and the tensor with the largest
    share at any record."""
    results = _load(FREEZE_CAPPED)
    header = ["task", "run", "seed", "freeze step", "coordinates clipped per step (mean)",
              "largest share of one tensor", "that tensor"]
    table = []
    for key, run in results["runs"].items():
        trace = run.get("trace") or {}
        shares = trace.get("clip_share") or []
        if not shares:
            continue
        top = max(range(len(shares)), key=lambda i: trace["clip_share_max"][i])
        table.append([run["task"], run["run"], str(run["seed"]), str(run["freeze_step"]),
                      f"{statistics.fmean(shares):.3%}", f"{trace['clip_share_max'][top]:.2%}",
                      f"`{(trace['clip_share_max_name'][top] or '').removeprefix('bert.')}`"])
    return (
        "The coordinates `cap_update` clipped in the runs above: the share of the compressed coordinates whose "
        "`|m_hat| / (sqrt(v_hat) + eps)` is above `B` (7.27 for betas (0.9, 0.999)), read every 10 steps and at each "
        "of the 10 steps after the freeze by the sweep's trace (`clip_share`), and the largest share of one tensor at "
        f"any of those steps (`results/{FREEZE_CAPPED}.json`).\n\n" + _table(header, table)
    )


#: 0/1 Adam on the example and the real tasks: the library's defaults, and the settings ``bert_zeroone.yaml`` gave it
#: before they were scaled to the run (given on the command line, with the library of the same run)
ZEROONE_SETTINGS = {"library defaults": "freeze_sweep_zeroone", "settings before": "freeze_sweep_zeroone_before"}


def zeroone_settings_table() -> str:
    """0/1 Adam with the library's defaults against the settings before, on the example and the real tasks: accuracy
    per seed against the same-seed AdamW, and the whole-run bytes against DDP's."""
    from benchmarks.freeze_sweep import TASKS, table_rows

    adamw = {key: run for key, run in freeze_defaults_runs()["runs"].items() if run["run"] == "adamw"}
    loaded = {label: _load(name) for label, name in ZEROONE_SETTINGS.items()}
    # the sweep's own rows (accuracy, difference to the same-seed AdamW, bytes against its DDP run), one file at a time
    rows_of = {label: {r["task"]: r for r in table_rows({"runs": {**adamw, **data["runs"]}})
                       if r["run"] == "zeroone_adam"} for label, data in loaded.items()}
    seeds = sorted({int(r["seed"]) for data in loaded.values() for r in data["runs"].values()})
    header = ["task", "0/1 Adam", *(f"seed {s}" for s in seeds), "vs AdamW (points)", "DDP bytes / run's"]
    rows, commands = [], []
    for task in TASKS:
        for label, by_task in rows_of.items():
            if task not in by_task:
                continue
            r = by_task[task]
            acc = ["-" if r["acc"].get(s) is None else f"{r['acc'][s]:.2%}" for s in seeds]
            diff = " / ".join("-" if r["diff"].get(s) is None else f"{r['diff'][s]:+.2f}" for s in seeds)
            rows.append([task, label, *acc, diff, f"{r['bytes_ratio']:.2f}x"])
    for label, data in loaded.items():
        run = next(iter(data["runs"].values()))
        extra = " ".join(run["settings"]["extra"])
        commands.append(f"{label}: `bert_zeroone.yaml`" + (f" with `{extra}`" if extra else ""))
    return (
        "The example's fresh 4-layer BERT on its synthetic reviews (620 steps) and the pretrained MiniLM on mail and "
        "AG News (600 steps), 2 CPU ranks (`python -m benchmarks.freeze_sweep --runs zeroone_adam --val-checks 2`; "
        + "; ".join(commands) + "). AdamW: the same seed's run of the freeze-step sweep; bytes: the "
        "whole run's against that AdamW-DDP run's, mean over seeds (they depend on the schedule, not the seed); `-`: "
        "not run.\n\n"
        + _table(header, rows)
    )


#: 1-bit LAMB frozen at step 300 on mail, 400 steps, without and with the compression stage's trust-ratio cap
LAMB_STEP_SIZE = {"DeepSpeed's update (cap_trust_ratio=False)": "lamb_step_size_deepspeed",
                  "with the cap (the default)": "lamb_step_size_capped"}


def lamb_step_size_table() -> str:
    """The size of 1-bit LAMB's steps before and after its freeze, from the sweep's step-size trace: the whole
    model's ``||dp|| / ||p||`` (mean over the records of a stretch) and the largest tensor's (its maximum there)."""
    rows, runs = [], []
    for label, name in LAMB_STEP_SIZE.items():
        (run,) = _load(name)["runs"].values()
        runs.append(run)
        lr = float(run["settings"]["lamb_lr"])
        t, freeze = run["trace"], run["freeze_step"]
        stretches = (("last 50 warmup steps", freeze - 50, freeze), ("10 steps after the freeze", freeze, freeze + 10),
                     (f"steps {freeze + 11}-{run['steps']}", freeze + 10, run["steps"]))
        for stretch, start, end in stretches:
            picked = [i for i, step in enumerate(t["update_steps"]) if start < step <= end]
            whole = statistics.fmean(t["update_rel"][i] for i in picked)
            top = max(picked, key=lambda i: t["update_rel_max"][i])
            rows.append([label, stretch, f"{whole:.2e} ({whole / lr:.1f} lr)",
                         f"{t['update_rel_max'][top]:.2e} ({t['update_rel_max'][top] / lr:.1f} lr), "
                         f"`{t['update_rel_max_name'][top].removeprefix('bert.')}`"])
    header = ["1-bit LAMB", "steps", "whole model: step norm / parameter norm (mean)", "largest tensor's (max)"]
    return (
        f"1-bit LAMB fine-tuning MiniLM on the mail corpus, variance frozen at step {runs[0]['freeze_step']} of "
        f"{runs[0]['steps']}, seed {runs[0]['seed']}, lr {lr:g} "
        "(`python -m benchmarks.freeze_sweep --tasks mail --runs onebit_lamb@0.75 --steps 400`, the step size "
        "recorded every 10 steps and at each of the 10 steps after the freeze as `norm(p_after - p_before) / "
        "norm(p_before)`; results "
        + ", ".join(f"`{name}.json`" for name in LAMB_STEP_SIZE.values()) + "). LAMB's warmup step is `lr` in "
        "these units.\n\n" + _table(header, rows)
    )


#: Issue 44's first measurements: the DDP baselines (bf16, PowerSGD) and 1-bit Adam's compressed warmups
WARMUP_SWEEP = "warmup_sweep"


def warmup_sweep_table() -> str:
    """Per task and run of :data:`WARMUP_SWEEP`: accuracy per seed, the difference to the same-seed AdamW-DDP run,
    the freeze step per seed (``*`` where ``auto`` reached its bound), the share of the run's bytes sent averaging
    gradients (the warmup), and the whole-run bytes against the same task's AdamW-DDP run, every seed shown."""
    from benchmarks.freeze_sweep import table_rows

    results = _load(WARMUP_SWEEP)
    rows = table_rows(results)
    seeds = list(rows[0]["acc"]) if rows else []
    bound = {(r["task"], r["run"], int(r["seed"])) for r in results["runs"].values() if _decided_at_bound(r)}
    header = ["task", "run", *(f"seed {s}" for s in seeds), "vs AdamW-DDP (points)", "freeze step",
              "warmup share of bytes", "DDP bytes / run's"]
    table = []
    for r in rows:
        cells = ["-" if r["acc"][s] is None else f"{r['acc'][s]:.2%}" for s in seeds]
        diff = "" if r["diff"] is None else " / ".join("-" if r["diff"][s] is None else f"{r['diff'][s]:+.2f}"
                                                       for s in seeds)
        freeze = " / ".join("-" if r["freeze"][s] is None
                            else f"{r['freeze'][s]}{'*' if (r['task'], r['run'], s) in bound else ''}" for s in seeds)
        share = "-" if r["warmup_share"] is None else f"{r['warmup_share']:.0%}"
        ratio = "-" if r["bytes_ratio"] is None else f"{r['bytes_ratio']:.2f}x"
        table.append([r["task"], r["run"], *cells, diff, freeze if any(f is not None for f in r["freeze"].values())
                      else "-", share, ratio])
    libraries = sorted({r["library"] for r in results["runs"].values() if r.get("library")})
    return (
        "Each run is the example on 2 CPU ranks (`python -m benchmarks.freeze_sweep --name warmup_sweep`, the "
        "runs named in the table), every optimizer argument but the freeze at its default: `adamw` is AdamW-DDP; "
        "`ddp_bf16` AdamW on DDP with torch's `bf16_compress_hook`; `ddp_powersgd_rR@F` AdamW on DDP with torch's "
        "PowerSGD of rank R (error feedback, warm start) after F of the run in plain allreduce; `onebit_adam@auto` "
        "1-bit Adam with `freeze_step=\"auto\"`, its warmup averaging gradients in fp32, or with `+bf16` (torch's "
        "`bf16_compress_hook`), `+powersgd4` (PowerSGD rank 4 after 10 plain steps) or `+int8` "
        "(`lightning_onebit.hooks.int8_allreduce_hook`: 8 bits a value, per-segment scales, error feedback). "
        "Differences per seed in points against the same-seed AdamW-DDP run; `*`: `auto` reached its bound; bytes "
        "are each rank's over the whole run, counted on the ring model of `lightning_onebit.comm.accounting` (the "
        "hooks' own counters for bf16, PowerSGD and int8), the same task's AdamW-DDP bytes over the run's (mean over "
        f"seeds). Library {', '.join(libraries)} (`results/{WARMUP_SWEEP}.json`).\n\n" + _table(header, table)
    )


#: Issue 44's done-when sweep: 1-bit Adam with the candidate default warmup (PowerSGD rank 4) against the same-seed
#: AdamW-DDP and DDP + PowerSGD rank 4, 0/1 Adam and 1-bit LAMB beside it
DEFAULTS_SWEEP = "defaults_sweep"
#: where the same-seed references come from when the sweep itself has none (same harness, task, seed and steps; DDP's
#: runs do not depend on the library's 1-bit code), earlier files first: later ones win
DEFAULTS_REFERENCES = {FREEZE_CAPPED: ("adamw",),
                       WARMUP_SWEEP: ("ddp_powersgd_r4@0.1", "ddp_powersgd_r1@0.1", "ddp_bf16"),
                       "warmup_real": ("ddp_powersgd_r4@0.1",)}
#: the other DDP baselines, shown beside PowerSGD rank 4 (accuracy and bytes)
DEFAULTS_BASELINES = {"DDP + bf16": "ddp_bf16", "DDP + PowerSGD r1": "ddp_powersgd_r1@0.1"}
#: the candidate's runs: 1-bit Adam, 0/1 Adam and 1-bit LAMB with every argument at its default and the warmup
#: averaging gradients by PowerSGD rank 4 (after 10 plain steps)
DEFAULTS_CANDIDATE = {"1-bit Adam": "onebit_adam@auto+powersgd4", "0/1 Adam": "zeroone_adam+powersgd4",
                      "1-bit LAMB": "onebit_lamb@auto+powersgd4"}


def _accuracy_against(run: Optional[dict[str, Any]], reference: Optional[dict[str, Any]], bytes_too: bool = False
                      ) -> str:
    """``run``'s accuracy, with its difference to ``reference`` in points (none for the reference itself) and, with
    ``bytes_too``, the reference's whole-run bytes over the run's; ``-`` for a run not made."""
    if run is None:
        return "-"
    if reference is None or run is reference:
        return f"{run['val_acc']:.2%}"
    fewer = f", {reference['bytes_sent'] / run['bytes_sent']:.1f}x" if bytes_too and run.get("bytes_sent") else ""
    return f"{run['val_acc']:.2%} ({100 * (run['val_acc'] - reference['val_acc']):+.2f}{fewer})"


def defaults_runs() -> dict[tuple[str, str, int], dict[str, Any]]:
    """``(task, run, seed) -> run`` of :data:`DEFAULTS_SWEEP` and its references (:data:`DEFAULTS_REFERENCES`), each
    with its ``source`` file."""
    runs: dict[tuple[str, str, int], dict[str, Any]] = {}
    for name, kinds in DEFAULTS_REFERENCES.items():
        if (RESULTS / f"{name}.json").exists():
            for run in _load(name)["runs"].values():
                if run["run"] in kinds:
                    runs[(run["task"], run["run"], int(run["seed"]))] = dict(run, source=name)
    for run in _load(DEFAULTS_SWEEP)["runs"].values():
        runs[(run["task"], run["run"], int(run["seed"]))] = dict(run, source=DEFAULTS_SWEEP)
    return runs


def defaults_sweep_table() -> str:
    """Per task and seed: AdamW-DDP, the DDP baselines (:data:`DEFAULTS_BASELINES`), DDP + PowerSGD rank 4 and the
    candidate's runs (:data:`DEFAULTS_CANDIDATE`), each with its bytes against AdamW-DDP's, and
    the issue's test for 1-bit Adam: within 0.5 point of AdamW-DDP, at least as accurate as DDP + PowerSGD rank 4,
    and at least 1.5x fewer whole-run bytes than it."""
    runs = defaults_runs()
    header = ["task", "seed", "AdamW-DDP", *DEFAULTS_BASELINES, "DDP + PowerSGD r4", *DEFAULTS_CANDIDATE,
              "1-bit Adam: fewer bytes than AdamW-DDP / PowerSGD r4", "issue 44's test"]
    table = []
    for task in ("synthetic", "mail", "agnews"):
        # the seeds, and any other seed the candidate ran
        seeds = sorted({0, 1} | {s for t, name, s in runs if t == task and name == DEFAULTS_CANDIDATE["1-bit Adam"]})
        for seed in seeds:
            adamw, powersgd = runs.get((task, "adamw", seed)), runs.get((task, "ddp_powersgd_r4@0.1", seed))
            got = {label: runs.get((task, name, seed)) for label, name in DEFAULTS_CANDIDATE.items()}
            baselines = [runs.get((task, name, seed)) for name in DEFAULTS_BASELINES.values()]
            if not any(got.values()) and powersgd is None:
                continue
            onebit, verdict, ratios = got["1-bit Adam"], "-", "-"
            if onebit is not None and adamw is not None and powersgd is not None:
                ratios = (f"{adamw['bytes_sent'] / onebit['bytes_sent']:.1f}x / "
                          f"{powersgd['bytes_sent'] / onebit['bytes_sent']:.2f}x")
                failed = [what for what, ok in (
                    ("0.5 point", onebit["val_acc"] >= adamw["val_acc"] - 0.005),
                    ("PowerSGD's accuracy", onebit["val_acc"] >= powersgd["val_acc"]),
                    ("1.5x PowerSGD's bytes", powersgd["bytes_sent"] >= 1.5 * onebit["bytes_sent"]))
                    if not ok]
                verdict = "met" if not failed else "not met: " + ", ".join(failed)
            table.append([task, str(seed), *(_accuracy_against(r, adamw, bytes_too=r is not adamw)
                                             for r in (adamw, *baselines, powersgd, *got.values())), ratios, verdict])
    sources = sorted({f"`results/{r['source']}.json`" for r in runs.values()})
    libraries = sorted({r["library"] for r in runs.values() if r.get("library") and r["source"] == DEFAULTS_SWEEP})
    return (
        "Each run is the example (`python -m benchmarks.freeze_sweep --name defaults_sweep --val-checks 2`, 2 CPU "
        "ranks, 600 steps on the real tasks, 620 on the example) with every optimizer argument at its default and the "
        "warmup averaging gradients by the library's PowerSGD, rank 4 after 10 plain steps (`+powersgd4`), the "
        "default since these runs chose it (0/1 Adam's variance steps and 1-bit LAMB's warmup take it too). Accuracy at the last step, in brackets the difference to the same-seed AdamW-DDP run in "
        "points and AdamW-DDP's whole-run bytes over the run's; DDP + PowerSGD rank R is torch's hook after 10% of "
        "the run in plain allreduce (PyTorch's advice), DDP + bf16 torch's `bf16_compress_hook`; "
        "bytes are each rank's over the whole run. The test: within 0.5 point of AdamW-DDP, at least as accurate as "
        "DDP + PowerSGD rank 4, at least 1.5x fewer bytes than it (the example validates on 1,000 reviews: "
        "0.1 point is one review). `-`: not run yet. From "
        + ", ".join(sources) + f"; the candidate's runs with library {', '.join(libraries) or '-'}.\n\n"
        + _table(header, table)
    )


#: Issue 46's step times on two simulated nodes (``benchmarks.multinode`` with ``local_steps``)
LOCAL_STEPS_LINK = "multinode_local_steps"
#: the same on two simulated nodes of one rank each (``--ranks-per-node 1``)
LOCAL_STEPS_LINK_FLAT = "multinode_local_steps_flat"
_LINK_METHODS = {"ddp_fp32": "AdamW-DDP (fp32)", "ddp_powersgd": "DDP + PowerSGD r4",
                 "onebit_hierarchical": "1-bit Adam (hierarchical)", "onebit_flat": "1-bit Adam",
                 "local_steps": "local steps (`onebit_diloco`)",
                 "local_steps_overlap": "local steps, overlapped",
                 "local_4proc": "no communication (the floor)"}


#: Issue 44 on the example over more seeds: the same runs as :data:`DEFAULTS_SWEEP`'s example rows, seeds 0-5, with
#: 1-bit Adam also frozen later (half and three quarters of the run), all its runs with one library
EXAMPLE_SEEDS = "example_seeds"
#: the columns of :func:`example_seeds_table`: label -> run name (the references come from :func:`defaults_runs`
#: where :data:`EXAMPLE_SEEDS` has none)
EXAMPLE_SEEDS_RUNS = {"AdamW-DDP": "adamw", "DDP + PowerSGD r4": "ddp_powersgd_r4@0.1",
                      "1-bit Adam (defaults)": DEFAULTS_CANDIDATE["1-bit Adam"],
                      "frozen at 1/2": "onebit_adam@0.5+powersgd4", "frozen at 3/4": "onebit_adam@0.75+powersgd4"}


def example_seeds_table() -> str:
    """Per seed of the example: accuracy and validation loss at the last step of every run of
    :data:`EXAMPLE_SEEDS_RUNS`, and per run how many seeds are at least as accurate as DDP + PowerSGD rank 4 and as
    AdamW-DDP (same seed), every seed shown."""
    runs = {key: run for key, run in defaults_runs().items() if key[0] == "synthetic"}
    for run in _load(EXAMPLE_SEEDS)["runs"].values():
        runs[(run["task"], run["run"], int(run["seed"]))] = dict(run, source=EXAMPLE_SEEDS)
    seeds = sorted({seed for _, _, seed in runs if (("synthetic", "adamw", seed) in runs)})
    table = []
    for seed in seeds:
        cells = []
        for name in EXAMPLE_SEEDS_RUNS.values():
            run = runs.get(("synthetic", name, seed))
            cells.append("-" if run is None else
                         f"{run['val_acc']:.1%} / {run['validations'][-1]['val_loss']:.4f}")
        table.append([str(seed), *cells])
    means = []
    for name in EXAMPLE_SEEDS_RUNS.values():
        got = [runs[("synthetic", name, s)] for s in seeds if ("synthetic", name, s) in runs]
        means.append(f"{statistics.mean(r['val_acc'] for r in got):.2%} / "
                     f"{statistics.mean(r['validations'][-1]['val_loss'] for r in got):.4f}" if got else "-")
    table.append(["mean", *means])
    counts = []
    for label, name in EXAMPLE_SEEDS_RUNS.items():
        pairs = [(runs[("synthetic", name, s)], runs.get(("synthetic", "ddp_powersgd_r4@0.1", s)),
                  runs.get(("synthetic", "adamw", s))) for s in seeds if ("synthetic", name, s) in runs]
        pairs = [p for p in pairs if p[1] is not None and p[2] is not None]
        counts.append(f"{label}: {sum(r['val_acc'] >= psgd['val_acc'] for r, psgd, _ in pairs)} / "
                      f"{sum(r['val_acc'] >= ref['val_acc'] for r, _, ref in pairs)} of {len(pairs)}")
    own = sorted({r["library"] for r in runs.values() if r.get("source") == EXAMPLE_SEEDS})
    copied = sorted({r["source"] for r in runs.values()
                     if r.get("source") != EXAMPLE_SEEDS and r["run"] in EXAMPLE_SEEDS_RUNS.values()})
    return (
        "Each run is the example on 2 CPU ranks (`python -m benchmarks.freeze_sweep --name example_seeds "
        "--val-checks 2 --tasks synthetic`, the runs and seeds named): 1-bit Adam with its defaults "
        f"(`{DEFAULTS_CANDIDATE['1-bit Adam']}`) and with the variance frozen at half and three quarters of the run "
        "(`onebit_adam@0.5+powersgd4`, `onebit_adam@0.75+powersgd4`; the same PowerSGD warmup), AdamW-DDP and DDP + "
        "PowerSGD rank 4 as in the table above. Each cell: accuracy on the 1,000 validation reviews / validation "
        "loss, at the last step (620); the last row their means over the seeds run. At least as accurate as DDP + "
        "PowerSGD rank 4 / as AdamW-DDP, same seed: "
        + "; ".join(counts) + f". The 1-bit runs with library {', '.join(own)} (`results/{EXAMPLE_SEEDS}.json`), "
        "the references of seeds 0 and 1 from " + ", ".join(f"`results/{name}.json`" for name in copied) + ".\n\n"
        + _table(["seed", *EXAMPLE_SEEDS_RUNS], table)
    )


def local_steps_link_table(name: str = LOCAL_STEPS_LINK) -> str:
    """Per link rate: each method's mean and median step, the mean over the floor's mean, and the bytes that crossed
    the veth per node per step (``name``: the results file, 2 ranks per node or 1)."""
    from benchmarks.multinode import slowest_median

    data = _load(name)
    config = data["config"]
    per_node = data["environment"]["ranks_per_node"]
    rates = ",".join(data["rates"])
    rows = []
    for rate, result in data["rates"].items():
        methods = result["rows"]
        floor = methods.get("local_4proc", {}).get("mean_step_s")
        for name, label in _LINK_METHODS.items():
            row = methods.get(name)
            if row is None:
                continue
            mean = row.get("mean_step_s", row["step_s"])
            median = slowest_median(result["per_rank"], name)
            rows.append([rate, label, f"{mean:.3f}", f"{median:.3f}", f"{mean / floor:.2f}x" if floor else "-",
                         f"{row['veth_bytes_per_node'] / 1e6:.3f}"])
    return (
        f"Two simulated nodes of {per_node} rank{'s' if per_node > 1 else ''} each (`python -m benchmarks.multinode "
        f"--rates {rates}" + (" --ranks-per-node 1" if per_node == 1 else "") + f" --methods "
        f"{' '.join(config['methods'])} --sync-every {config['sync_every']}"
        + (f" --overlap-steps {config['overlap_steps']} --fragments {config['fragments']}"
           if "local_steps_overlap" in config["methods"] else "")
        + "`: two network namespaces joined by a veth "
        f"pair shaped at the rate; the BERT of `benchmarks.slow_link`, {data['model']['params'] / 1e6:.1f}M "
        f"parameters, batch {config['batch']} x {config['seq']} per rank), {config['steps']} timed steps per method "
        f"({-(-config['steps'] // config['sync_every']) * config['sync_every']} for local steps: whole periods), each "
        "step the slowest rank's. Local steps: "
        + ("DDP inside the node, " if per_node > 1 else "each rank a replica, ")
        + "the 1-bit outer step across nodes every "
        f"{config['sync_every']} steps, outer SGD (the strategy's defaults); its mean includes the sync"
        + (f"; overlapped: `overlap_steps={config['overlap_steps']}`, `fragments={config['fragments']}`"
           if "local_steps_overlap" in config["methods"] else "") + ". The "
        "floor: every process trains alone. "
        + ("One host: 4 processes on 2 cores, so the in-node work is CPU-bound here." if per_node > 1 else
           "One host: 2 processes on 2 cores, a core each.") + "\n\n"
        + _table(["link", "method", "mean step (s)", "median step (s)", "mean / floor's mean", "MB leaving a node per "
                  "step (veth)"], rows)
    )


#: Issue 46's first measurements: local steps (``onebit_diloco``) on the example from scratch, and the language model
LOCAL_STEPS = "local_steps_sweep"
LM_LOCAL_STEPS = "lm_local_steps"
#: the runs of other sweeps shown beside the local-steps runs, with the same settings (the same harness and seeds)
LOCAL_STEPS_REFERENCES = (WARMUP_SWEEP, FREEZE_CAPPED, DEFAULTS_SWEEP)
_REFERENCE_RUN = re.compile(r"adamw|ddp_bf16|ddp_powersgd_r[0-9]+@[0-9.]+|onebit_adam@auto(\+powersgd4)?"
                            r"|zeroone_adam(\+powersgd4)?")


def local_steps_runs() -> dict[str, Any]:
    """The runs of :data:`LOCAL_STEPS`, completed by the AdamW-DDP, DDP + PowerSGD and 1-bit Adam (``auto``) runs of
    :data:`LOCAL_STEPS_REFERENCES` made with the same settings, for a seed the file holds, for a key the file does not
    hold (those made before the bits per parameter per step were recorded get them over the parameters of the same
    task's model)."""
    from benchmarks.freeze_sweep import bits_per_parameter_step

    results = _load(LOCAL_STEPS)
    runs = dict(results["runs"])
    settings = [r["settings"] for r in runs.values()]
    seeds = {int(r["seed"]) for r in runs.values()}
    parameters = {r["task"]: r["trainable_parameters"] for r in runs.values() if r.get("trainable_parameters")}
    for name in LOCAL_STEPS_REFERENCES:
        if not (RESULTS / f"{name}.json").exists():
            continue
        for key, run in _load(name)["runs"].items():
            if (key not in runs and _REFERENCE_RUN.fullmatch(run["run"]) and run["settings"] in settings
                    and int(run["seed"]) in seeds):
                copied = dict(run, copied_from=name)
                if copied.get("bits_per_parameter_step") is None and run["task"] in parameters:
                    copied["bits_per_parameter_step"] = bits_per_parameter_step(
                        run["bytes_sent"], parameters[run["task"]], run["steps"])
                runs[key] = copied
    return dict(results, runs=runs)


def _bytes_row(r: dict[str, Any], values: dict[Any, Any], seeds: list[Any], value_format: str) -> list[str]:
    """A local-steps table row: the run, its value per seed, the difference to AdamW-DDP per seed, MB sent per rank,
    AdamW-DDP's bytes over the run's and bits per parameter per step."""
    diff = "" if r["diff"] is None else " / ".join(_cells(r["diff"], seeds, "+.2f"))
    return [f"`{r['run']}`", *_cells(values, seeds, value_format), diff, _megabytes(r["bytes_sent"]),
            "-" if r["bytes_ratio"] is None else f"{r['bytes_ratio']:,.1f}x",
            "-" if r["bits_per_parameter_step"] is None else f"{r['bits_per_parameter_step']:.3g}"]


def _megabytes(value: Optional[float]) -> str:
    """Bytes as MB, three significant figures (whole MB from 100 on)."""
    if value is None:
        return "-"
    mb = value / 1e6
    return f"{mb:,.0f}" if mb >= 100 else f"{mb:.3g}"


def _cells(values: dict[int, Any], seeds: list[int], fmt: str) -> list[str]:
    return ["-" if values.get(s) is None else format(values[s], fmt) for s in seeds]


def local_steps_table() -> str:
    """Per run of :func:`local_steps_runs` (the example from scratch) and of :data:`LM_LOCAL_STEPS` (the byte-level
    GPT): every seed's accuracy (loss), its difference to the same-seed AdamW-DDP run, the whole-run bytes per rank,
    AdamW-DDP's bytes over them and the bits per parameter per step."""
    from benchmarks import lm_local_steps
    from benchmarks.freeze_sweep import table_rows

    results = local_steps_runs()
    rows = table_rows(results)
    seeds = list(rows[0]["acc"]) if rows else []
    header = ["task", "run", *(f"seed {s}" for s in seeds), "vs AdamW-DDP (points)", "MB sent per rank",
              "DDP bytes / run's", "bits per parameter per step"]
    table = [[r["task"], *_bytes_row(r, r["acc"], seeds, ".2%")] for r in rows]
    copied = sorted({f"{r['task']} `{r['run']}` seed {r['seed']}" for r in results["runs"].values()
                     if r.get("copied_from")})
    libraries = sorted({r["library"].split()[0] for r in results["runs"].values() if r.get("library")})
    text = (
        "**The example from scratch** (`synthetic`: the fresh 4-layer BERT on the synthetic reviews, 620 steps, 2 CPU "
        "ranks) **and real fine-tuning kept aside to check the defaults** (`mail`, `agnews`: the pretrained MiniLM, "
        f"600 steps, `--val-checks 2`; `python -m benchmarks.freeze_sweep --tasks ... --name {LOCAL_STEPS} --runs "
        "...`, the runs named in the table): `adamw` is AdamW-DDP, `ddp_powersgd_rR@F` AdamW on DDP with torch's PowerSGD of rank R after F of "
        "the run in plain allreduce, `onebit_adam@auto` 1-bit Adam with the library's defaults, `diloco_C@H` "
        "`onebit_diloco` with compressor C and an outer step every H inner steps (`bert_diloco.yaml`: 2 replicas of "
        "one rank, inner AdamW, outer Nesterov lr 0.7 momentum 0.9), `diloco_C_sgd@H` the same with the outer step "
        "without momentum at lr 1, `diloco_C_sgdL@H` at lr L (`diloco_none_sgd@H`: plain model averaging; a suffix "
        "`fF` streams F fragments, "
        "`oT` overlaps T inner steps with each exchange). Accuracy at the last step (for local "
        "steps on the outer model of the last sync up to it: 620 is a multiple of 4, not of 8 or 32), its difference "
        "in points to the same seed's AdamW-DDP; bytes per rank over the whole run, counted on the ring model of "
        "`lightning_onebit.comm.accounting` (the strategies' and hooks' own counters), the same task's AdamW-DDP "
        "bytes over the run's (mean over seeds); bits per trainable parameter per optimizer step. `-`: not run. "
        + (f"Copied from {', '.join(f'`results/{name}.json`' for name in LOCAL_STEPS_REFERENCES)} (same harness "
           f"and settings): {', '.join(copied)}. " if copied else "")
        + f"Library {', '.join(libraries)} (`results/{LOCAL_STEPS}.json`).\n\n" + _table(header, table)
    )
    lm = _load(LM_LOCAL_STEPS)
    lm_rows = lm_local_steps.table_rows(lm)
    lm_seeds = list(lm_rows[0]["loss"]) if lm_rows else []
    corpus = lm["corpus"]
    first = next(iter(lm["runs"].values()))
    s = first["settings"]
    header = ["run", *(f"seed {x}" for x in lm_seeds), "vs AdamW-DDP (%)", "MB sent per rank", "DDP bytes / run's",
              "bits per parameter per step"]
    table = [_bytes_row(r, r["loss"], lm_seeds, ".4f") for r in lm_rows]
    lm_libraries = sorted({r["library"].split()[0] for r in lm["runs"].values() if r.get("library")})
    text += (
        f"\n\n**A language model from scratch** (`python -m benchmarks.lm_local_steps`): a byte-level GPT "
        f"({s['layers']} layers, width {s['width']}, {s['heads']} heads, context {s['context']}, "
        f"{first['trainable_parameters']:,} parameters) on the Python standard library's top-level modules "
        f"({corpus['files']} files of Python {corpus['python']}, {corpus['bytes']:,} bytes, SHA-256 "
        f"`{corpus['sha256'][:16]}...`; every tenth file held out: {corpus['val_bytes']:,} bytes), "
        f"{s['steps']} steps of {s['batch_size']} windows per rank on 2 CPU ranks ({first['tokens']:,} tokens, the "
        f"same windows for every run of a seed), AdamW lr {s['lr']:g}. Validation loss (nats per byte) on "
        f"{s['val_windows']} held-out windows at the last step (a multiple of every period: the synced model), its "
        "difference to the same seed's AdamW-DDP in percent; `torchft_diloco@H` is torchft's own `DiLoCo` on the same "
        "model and data (fp32 allreduce of the pseudo-gradient; its bytes on the ring model, which torchft does not "
        f"count). Library {', '.join(lm_libraries)} (`results/{LM_LOCAL_STEPS}.json`).\n\n" + _table(header, table)
    )
    return text


SECTIONS: dict[str, Callable[[], str]] = {
    "lamb_step_size": lamb_step_size_table,
    "kernels": kernels_table,
    "bytes": bytes_table,
    "allreduce_sweep": allreduce_table,
    "loopback_step": loopback_step_table,
    "slow_link": slow_link_table,
    "slow_link_batch8": lambda: slow_link_table("slow_link_batch8"),
    "slow_link_family": lambda: slow_link_table("slow_link_family", goals=False),
    "bucket_sweep": bucket_sweep_table,
    "overlap": overlap_table,
    "memory": memory_table,
    "bert_parity": parity_table,
    "freeze_sweep": freeze_sweep_table,
    "multinode": multinode_table,
    "multinode_batch8": lambda: multinode_table("multinode_batch8", with_formulas=False),
    "intra_reduce": intra_reduce_table,
    "topology_model": topology_model_table,
    "advisor": advisor_table,
    "own_data": own_data_table,
    "headline": headline_figures,
    "freeze_defaults": freeze_defaults_table,
    "freeze_seeds": freeze_seeds_table,
    "clipped_share": clipped_share_table,
    "largest_model": largest_model_table,
    "zeroone_settings": zeroone_settings_table,
    "warmup_sweep": warmup_sweep_table,
    "local_steps": local_steps_table,
    "local_steps_link": local_steps_link_table,
    "local_steps_link_flat": lambda: local_steps_link_table(LOCAL_STEPS_LINK_FLAT),
    "defaults_sweep": defaults_sweep_table,
    "example_seeds": example_seeds_table,
}


# Sections whose results files are not measured yet: no page has a block for them until one of the files exists.
AWAITING_RESULTS: dict[str, tuple[str, ...]] = {"overlap": _OVERLAP_RUNS, "largest_model": ("largest_model",),
                                                "warmup_sweep": (WARMUP_SWEEP,),
                                                "local_steps": (LOCAL_STEPS, LM_LOCAL_STEPS),
                                                "local_steps_link": (LOCAL_STEPS_LINK,),
                                                "local_steps_link_flat": (LOCAL_STEPS_LINK_FLAT,),
                                                "defaults_sweep": (DEFAULTS_SWEEP,),
                                                "example_seeds": (EXAMPLE_SEEDS,)}


def _block(name: str) -> re.Pattern[str]:
    return re.compile(rf"(<!-- results:{name} -->\n)(?:.*?\n)?(<!-- /results:{name} -->)", re.S)


def render(texts: dict[str, str]) -> dict[str, str]:
    """``texts`` (page name -> Markdown) with every marked block replaced by its rendering from results/. Every
    section must have a block in at least one page (unless it awaits results)."""
    texts = dict(texts)
    for name, build in SECTIONS.items():
        pattern = _block(name)
        holders = [page for page, text in texts.items() if pattern.search(text)]
        if not holders:
            awaiting = AWAITING_RESULTS.get(name, ())
            if awaiting and not any((RESULTS / f"{n}.json").exists() for n in awaiting):
                continue  # nothing measured yet, nothing to render
            raise SystemExit(f"no page has a <!-- results:{name} --> ... <!-- /results:{name} --> block")
        body = build()
        for page in holders:
            texts[page] = pattern.sub(lambda m: m.group(1) + body + "\n" + m.group(2), texts[page])
    return texts


def main() -> None:
    parser = argument_parser(__spec__.name, __doc__)
    parser.add_argument("--check", action="store_true", help="exit 1 if a page differs from the results")
    args = parser.parse_args()
    current = {str(path.relative_to(ROOT)): path.read_text() for path in pages()}
    updated = render(current)
    stale = [page for page in current if updated[page] != current[page]]
    if args.check:
        if stale:
            print(f"stale result tables in {', '.join(stale)}: run python -m benchmarks.result_tables",
                  file=sys.stderr)
            sys.exit(1)
        print("result tables match results/")
        return
    for page in stale:
        (ROOT / page).write_text(updated[page])
    print(f"result tables regenerated from results/ ({len(stale)} page(s) changed)")


if __name__ == "__main__":
    main()
