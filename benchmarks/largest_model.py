"""The largest model that trains with 4 ranks on this machine: ``strategy="onebit_adam"`` (DDP, every rank holds the
whole model and its state) against ``strategy="onebit_fsdp"`` (2 simulated nodes x 2 ranks, each rank holds half).

A trial is one Lightning fit on 4 CPU processes (gloo) of a stack of ``Linear(W, W)`` + tanh blocks with about
``N`` fp32 parameters (under ``onebit_fsdp`` built on the meta device, ``trainer.init_module(empty_init=True)``, and
materialised shard by shard by the strategy), 2 warmup steps and 2 compressed steps of 1-bit Adam (batch 8 per rank), with the library's defaults
otherwise. The trial runs in a cgroup (v1 memory controller, this script creates and removes it) whose limit is the
memory the 4 ranks may use together (``--limit-gib``): a trial that needs more is killed by the kernel inside the
cgroup and counts as not training. Each trial reports whether the fit finished, the cgroup's peak usage
(``memory.max_usage_in_bytes``, all 4 processes together, page cache included) and every rank's peak resident set
(``ru_maxrss``).

The search, per strategy: two small trials give peak memory as a line in ``N``; the size where that line meets the
limit is tried, then sizes 8% apart, down until one trains or up until one does not. The result is the largest size
that trained and the smallest that did not. Results: ``results/largest_model.json``. Needs root (the cgroup) and a
quiet machine (another process's memory is not in the cgroup, but it is in the machine).

    python -m benchmarks.largest_model                  # both strategies, the limit: the machine's memory less 1.5 GiB
    python -m benchmarks.largest_model --limit-gib 20 --strategies onebit_fsdp
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any, Optional

from benchmarks.common import ROOT, argument_parser, module_command, write_results

STRATEGIES = ("onebit_adam", "onebit_fsdp")
CGROUP = Path("/sys/fs/cgroup/memory/lightning_onebit_largest_model")
WIDTH = 4096
DEVICES, RANKS_PER_NODE = 4, 2
FREEZE, STEPS, BATCH = 2, 4, 8
STEP_FACTOR = 1.08


def _layers(n_params: float) -> int:
    """``Linear(W, W)`` blocks of about ``n_params`` parameters (at least one)."""
    return max(1, round(n_params / (WIDTH * WIDTH + WIDTH)))


# ---------------------------------------------------------------------------------------------------------- a trial
def _trial(strategy_name: str, n_params: float, out_dir: str) -> None:
    """One fit (this process is rank 0; Lightning starts the others with the same command line)."""
    import torch
    from torch import nn
    from torch.utils.data import DataLoader, TensorDataset

    import lightning.pytorch as pl
    from lightning_onebit import OnebitAdam, OnebitFSDPStrategy

    class Block(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.linear = nn.Linear(WIDTH, WIDTH)

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return torch.tanh(self.linear(x))

    class Stack(pl.LightningModule):
        def __init__(self, layers: int) -> None:
            super().__init__()
            self.blocks = nn.Sequential(*[Block() for _ in range(layers)])

        def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
            (x,) = batch
            return self.blocks(x).square().mean()

        def configure_optimizers(self) -> Any:
            return OnebitAdam(self.parameters(), lr=1e-5, freeze_step=FREEZE)

        def train_dataloader(self) -> DataLoader:
            x = torch.randn(DEVICES * STEPS * BATCH, WIDTH, generator=torch.Generator().manual_seed(0))
            return DataLoader(TensorDataset(x), batch_size=BATCH)

    layers = _layers(n_params)
    strategy: Any = (OnebitFSDPStrategy(ranks_per_node=RANKS_PER_NODE, shard_modules=[Block])
                     if strategy_name == "onebit_fsdp" else strategy_name)
    trainer = pl.Trainer(accelerator="cpu", devices=DEVICES, strategy=strategy, max_steps=STEPS, logger=False,
                         enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False)
    # FSDP: built on the meta device and materialised shard by shard; DDP: every rank holds the whole model anyway
    with trainer.init_module(empty_init=strategy_name == "onebit_fsdp"):
        model = Stack(layers)
    start = time.perf_counter()
    trainer.fit(model)
    optimizer = trainer.strategy.onebit_optimizer
    record = dict(rank=trainer.global_rank, layers=layers, numel=layers * (WIDTH * WIDTH + WIDTH),
                  steps=optimizer.step_count, stage=optimizer.stage.value, fit_s=time.perf_counter() - start,
                  peak_rss_bytes=resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024)
    Path(out_dir, f"rank{trainer.global_rank}.json").write_text(json.dumps(record))


# ----------------------------------------------------------------------------------------------------- the cgroup
def _cgroup(limit_bytes: int) -> Path:
    if not CGROUP.parent.exists():
        raise SystemExit(f"no cgroup v1 memory controller at {CGROUP.parent}: this benchmark needs one (and root)")
    CGROUP.mkdir(exist_ok=True)
    (CGROUP / "memory.limit_in_bytes").write_text(str(limit_bytes))
    return CGROUP


def _remove_cgroup() -> None:
    if CGROUP.exists():
        for _ in range(50):  # the killed processes may take a moment to leave it
            try:
                CGROUP.rmdir()
                return
            except OSError:
                time.sleep(0.2)


def run_trial(strategy: str, n_params: float, limit_bytes: int, timeout_s: int) -> dict[str, Any]:
    """One trial in a fresh cgroup: whether it trained, the cgroup's peak, the ranks' records."""
    _remove_cgroup()
    group = _cgroup(limit_bytes)
    with tempfile.TemporaryDirectory() as out_dir:
        command = module_command(__spec__.name, "--trial", strategy, "--params", str(n_params), "--out", out_dir)
        env = dict(os.environ, OMP_NUM_THREADS="1")

        def enter_cgroup() -> None:
            (group / "cgroup.procs").write_text(str(os.getpid()))

        start = time.perf_counter()
        try:
            done = subprocess.run(command, cwd=ROOT, env=env, preexec_fn=enter_cgroup, timeout=timeout_s,
                                  capture_output=True, text=True)
            returncode, tail = done.returncode, (done.stdout + done.stderr)[-600:]
        except subprocess.TimeoutExpired:
            returncode, tail = None, f"timed out after {timeout_s} s"
            for pid in (group / "cgroup.procs").read_text().split():
                try:
                    os.kill(int(pid), 9)
                except ProcessLookupError:
                    pass
        wall_s = time.perf_counter() - start
        peak = int((group / "memory.max_usage_in_bytes").read_text())
        oom_kills = (group / "memory.oom_control").read_text()
        ranks = sorted((json.loads(p.read_text()) for p in Path(out_dir).glob("rank*.json")), key=lambda r: r["rank"])
    _remove_cgroup()
    trained = returncode == 0 and len(ranks) == DEVICES and all(r["steps"] == STEPS for r in ranks)
    layers = _layers(n_params)
    result = dict(strategy=strategy, layers=layers, numel=layers * (WIDTH * WIDTH + WIDTH), trained=trained,
                  returncode=returncode, wall_s=round(wall_s, 1), cgroup_peak_bytes=peak,
                  rss_peak_bytes=[r["peak_rss_bytes"] for r in ranks],
                  stage=[r["stage"] for r in ranks], oom_control=" ".join(oom_kills.split()))
    if not trained:
        result["output_tail"] = tail
    print(f"{strategy} {result['numel'] / 1e6:.0f}M params ({layers} layers): "
          f"{'trained' if trained else 'did not train'}, cgroup peak {peak / 2**30:.2f} GiB, {wall_s:.0f} s",
          flush=True)
    return result


# ----------------------------------------------------------------------------------------------------- the search
def search(strategy: str, limit_bytes: int, small: tuple[float, float], timeout_s: int, max_trials: int
           ) -> dict[str, Any]:
    """The largest size that trains under the limit, and the smallest that does not (see the module docstring)."""
    trials = [run_trial(strategy, n, limit_bytes, timeout_s) for n in small]
    (n0, p0), (n1, p1) = [(t["numel"], t["cgroup_peak_bytes"]) for t in trials]
    if not all(t["trained"] for t in trials) or n1 <= n0:
        return dict(trials=trials, largest_trained=None, smallest_failed=None, note="a small trial did not train")
    per_param = (p1 - p0) / (n1 - n0)
    predicted = n0 + (limit_bytes - p0) / per_param
    layers = _layers(predicted)
    tried: dict[int, dict[str, Any]] = {}
    while len(tried) < max_trials:
        trial = tried[layers] = run_trial(strategy, layers * (WIDTH * WIDTH + WIDTH), limit_bytes, timeout_s)
        trials.append(trial)
        good = [n for n, t in tried.items() if t["trained"]]
        bad = [n for n, t in tried.items() if not t["trained"]]
        if good and bad and min(bad) - max(good) == 1:
            break
        if trial["trained"]:
            step = max(1, round(layers * (STEP_FACTOR - 1)))
            layers = layers + step if not bad else min(layers + step, min(bad) - 1)
        else:
            step = max(1, round(layers * (1 - 1 / STEP_FACTOR)))
            layers = layers - step if not good else max(layers - step, max(good) + 1)
        if layers in tried or layers < 1:
            break
    good = [t for t in trials if t["trained"]]
    bad = [t for t in trials if not t["trained"] and t["numel"] > max((g["numel"] for g in good), default=0)]
    return dict(trials=trials, bytes_per_param=per_param, predicted_numel=predicted,
                largest_trained=max(good, key=lambda t: t["numel"]) if good else None,
                smallest_failed=min(bad, key=lambda t: t["numel"]) if bad else None)


def _memory_total() -> int:
    for line in Path("/proc/meminfo").read_text().splitlines():
        if line.startswith("MemTotal:"):
            return int(line.split()[1]) * 1024
    raise SystemExit("no MemTotal in /proc/meminfo")


def main(argv: Optional[list[str]] = None) -> None:
    parser = argument_parser(__spec__.name, __doc__)
    parser.add_argument("--strategies", nargs="+", choices=STRATEGIES, default=list(STRATEGIES))
    parser.add_argument("--limit-gib", type=float, default=None,
                        help="memory of the 4 ranks together (default: the machine's memory less 1.5 GiB)")
    parser.add_argument("--small", nargs=2, type=float, default=(50e6, 150e6),
                        help="the two sizes (parameters) that fit the memory line")
    parser.add_argument("--max-trials", type=int, default=6, help="trials per strategy after the two small ones")
    parser.add_argument("--timeout-s", type=int, default=900, help="per trial")
    parser.add_argument("--name", default="largest_model")
    parser.add_argument("--trial", choices=STRATEGIES, help=argparse.SUPPRESS)
    parser.add_argument("--params", type=float, help=argparse.SUPPRESS)
    parser.add_argument("--out", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.trial:
        _trial(args.trial, args.params, args.out)
        return
    total = _memory_total()
    limit = int(args.limit_gib * 2**30) if args.limit_gib else total - int(1.5 * 2**30)
    print(f"limit {limit / 2**30:.2f} GiB of {total / 2**30:.2f} GiB", flush=True)
    runs = {}
    try:
        for strategy in args.strategies:
            runs[strategy] = search(strategy, limit, tuple(args.small), args.timeout_s, args.max_trials)
    finally:
        _remove_cgroup()
    payload = dict(args=dict(vars(args), width=WIDTH, devices=DEVICES, ranks_per_node=RANKS_PER_NODE,
                             freeze_step=FREEZE, steps=STEPS, batch=BATCH),
                   limit_bytes=limit, memory_total_bytes=total, cpus=os.cpu_count(), runs=runs)
    print(f"wrote {write_results(args.name, payload)}")
    for strategy, run in runs.items():
        best = run["largest_trained"]
        print(f"{strategy}: largest trained {best['numel'] / 1e6:.0f}M parameters" if best else f"{strategy}: none")


if __name__ == "__main__":
    sys.exit(main())
