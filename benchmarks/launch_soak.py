"""Launch short multi-process trainings many times and count abnormal exits (issue 12 finding 11, issue 24 part 4).

Each launch is ``python -m torch.distributed.run --nproc-per-node R ... -m benchmarks.launch_soak --worker ...`` (this
module in worker mode, from the repository root), trained through warmup into the compression stage on CPU/gloo,
along one of these paths:

* ``torch-ddp``: plain torch, no Lightning: ``DistributedDataParallel`` + :class:`~lightning_onebit.OnebitAdam` +
  :class:`~lightning_onebit.hooks.OverlapState` / :func:`~lightning_onebit.hooks.overlapped_exchange_hook` (several
  DDP buckets, the second phase in its own process group), 3 ranks, torn down the way the ``OverlapState`` docstring
  tells users to: the training function returns (DDP, optimizer and hook state freed by reference counting) and the
  script calls ``dist.destroy_process_group()``. No ``gc.collect()`` anywhere.
* ``lightning-flat``: ``Trainer(strategy=OnebitStrategy())``, 2 ranks, flat exchange, overlapped.
* ``lightning-hierarchical``: the same on 4 ranks with ``ranks_per_node=2`` (2 simulated nodes x 2 ranks: the
  intra- and inter-node groups and their second-phase copies).
* ``lightning-fp16``: ``lightning-flat`` with ``precision="16-mixed"`` (the rank-synced GradScaler; the exchange then
  runs in ``step``, not overlapped): the path of the one abort at exit seen in the test suite since the clean-exit
  work, not part of the default three.
* ``gloo``: the control experiment: a few async collectives on the default group and two subgroups, with
  ``--destroy`` deciding whether the process group is destroyed before exiting.

The Lightning workers call ``trainer.fit`` twice on one trainer (a new model and optimizer the second time; the
strategy reuses its process groups) and let the interpreter exit with the trainer still referenced from a global, as
a script does.

torchrun reports every rank's exit code, so an abort at interpreter exit after training finished (``terminate called
without an active exception``, SIGABRT, exit code 134) fails the launch. Per launch: the path, the launcher's exit
code, whether any output contains "terminate called", and the wall time. ``--name`` writes ``results/NAME.json``.

    python -m benchmarks.launch_soak --launches 200 --name launch_soak   # the three training paths, round robin
    python -m benchmarks.launch_soak --launches 20 --paths lightning-hierarchical
    python -m benchmarks.launch_soak --launches 40 --paths gloo            # process group left alive
    python -m benchmarks.launch_soak --launches 40 --paths gloo --destroy
"""

from __future__ import annotations

import argparse
import os
import platform
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

from benchmarks.common import ROOT, argument_parser, module_command

#: path -> (ranks, ranks_per_node): the training paths of the default run
PATHS: dict[str, tuple[int, int]] = {
    "torch-ddp": (3, 0),
    "lightning-flat": (2, 0),
    "lightning-hierarchical": (4, 2),
    "lightning-fp16": (2, 0),
    "gloo": (2, 0),
}
TRAINING_PATHS = ("torch-ddp", "lightning-flat", "lightning-hierarchical")
FREEZE_STEP, STEPS = 3, 8


def _lightning_worker(ranks_per_node: int, precision: str = "32-true") -> None:
    import torch
    from torch import nn
    from torch.utils.data import DataLoader, TensorDataset

    import lightning.pytorch as pl
    from lightning_onebit import OnebitAdam, OnebitStrategy

    class Tiny(pl.LightningModule):
        def __init__(self) -> None:
            super().__init__()
            self.net = nn.Sequential(nn.Linear(16, 32), nn.Tanh(), nn.Linear(32, 1))

        def training_step(self, batch, batch_idx):
            x, y = batch
            return nn.functional.mse_loss(self.net(x), y)

        def configure_optimizers(self):
            return OnebitAdam(self.parameters(), lr=1e-2, freeze_step=FREEZE_STEP)

    torch.set_num_threads(1)
    g = torch.Generator().manual_seed(int(os.environ.get("RANK", 0)))
    data = TensorDataset(torch.randn(64, 16, generator=g), torch.randn(64, 1, generator=g))
    # several DDP buckets (tiny cap), so the overlapped exchange runs its second phase between bucket hooks
    strategy = OnebitStrategy(ranks_per_node=ranks_per_node or None, ddp_bucket_cap_mb=2000 / 2**20)
    global _TRAINER  # kept alive until interpreter exit, as a script's module-level trainer is
    _TRAINER = pl.Trainer(
        strategy=strategy, accelerator="cpu", devices=int(os.environ["LOCAL_WORLD_SIZE"]), max_steps=STEPS,
        precision=precision, logger=False, enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False,
    )
    _TRAINER.fit(Tiny(), DataLoader(data, batch_size=8))
    _TRAINER.fit_loop.epoch_loop.max_steps = 2 * STEPS  # a second fit (a new model and optimizer) on the same strategy
    _TRAINER.fit(Tiny(), DataLoader(data, batch_size=8))
    assert _TRAINER.global_step == 2 * STEPS
    if precision == "32-true":
        assert strategy.overlap_state is not None and strategy.overlap_state.buckets_started > 0, (
            "the soak is meant to exercise the overlapped exchange"
        )


def _torch_ddp_train() -> None:
    """Plain DDP + OnebitAdam + the overlapped hook through warmup into the compression stage."""
    import torch
    from torch import nn
    from torch.nn.parallel import DistributedDataParallel

    from lightning_onebit import OnebitAdam
    from lightning_onebit.hooks import OverlapState, overlapped_exchange_hook

    rank = int(os.environ["RANK"])
    torch.manual_seed(0)
    net = nn.Sequential(*(m for _ in range(4) for m in (nn.Linear(16, 16), nn.Tanh())), nn.Linear(16, 1))
    ddp = DistributedDataParallel(net, bucket_cap_mb=2000 / 2**20)
    optimizer = OnebitAdam(ddp.parameters(), lr=1e-2, freeze_step=FREEZE_STEP, dead_coordinates="ignore")
    state = OverlapState(ddp, optimizer)
    ddp.register_comm_hook(state, overlapped_exchange_hook)
    g = torch.Generator().manual_seed(rank)
    for _ in range(STEPS):
        x, y = torch.randn(8, 16, generator=g), torch.randn(8, 1, generator=g)
        nn.functional.mse_loss(ddp(x), y).backward()
        optimizer.step()
        optimizer.zero_grad()
    assert state.buckets_started > 0, "the overlapped exchange never started a bucket"


def _torch_ddp_worker() -> None:
    import datetime

    import torch
    import torch.distributed as dist

    torch.set_num_threads(1)
    dist.init_process_group("gloo", timeout=datetime.timedelta(seconds=60))
    try:
        _torch_ddp_train()  # returning frees DDP, optimizer and hook state (no reference cycles)
    finally:
        dist.destroy_process_group()


def _gloo_worker(destroy: bool) -> None:
    import datetime

    import torch
    import torch.distributed as dist

    torch.set_num_threads(1)
    dist.init_process_group("gloo", timeout=datetime.timedelta(seconds=60))
    rank, world = dist.get_rank(), dist.get_world_size()
    half = [dist.new_group([r for r in range(world) if r % 2 == k]) for k in range(2)]
    x = torch.randn(1 << 16)
    works = [dist.all_reduce(x.clone(), async_op=True)]
    out = torch.empty(world * x.numel())
    works.append(dist.all_gather_into_tensor(out, x, async_op=True))
    sub = half[rank % 2]
    works.append(dist.all_reduce(x.clone(), group=sub, async_op=True))
    for work in works:
        work.wait()
    if destroy:
        dist.destroy_process_group()


def _launch(path: str, ranks: int, ranks_per_node: int, destroy: bool, timeout: float,
            port: int) -> tuple[int, bool, float, str]:
    worker = ["--worker", "--paths", path, "--ranks-per-node", str(ranks_per_node)] + (["--destroy"] if destroy else [])
    cmd = module_command("torch.distributed.run", "--nproc-per-node", str(ranks), "--master-addr", "127.0.0.1",
                         "--master-port", str(port), "-m", __spec__.name, *worker)
    # PYTHONFAULTHANDLER: an abort prints every Python thread's stack, i.e. where the process was when it died
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONWARNINGS="ignore", PYTHONFAULTHANDLER="1")
    started = time.perf_counter()
    try:
        done = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, env=env, cwd=ROOT)
        code, output = done.returncode, done.stdout + done.stderr
    except subprocess.TimeoutExpired as err:
        code, output = -1, f"timed out after {timeout} s\n{err.stdout or ''}{err.stderr or ''}"
    aborted = "terminate called" in output or "SIGABRT" in output or "Signal 6" in output
    return code, aborted, time.perf_counter() - started, output


def _summary(rows: list[dict[str, Any]]) -> dict[str, Any]:
    times = sorted(r["seconds"] for r in rows)
    return {
        "ranks": rows[0]["ranks"],
        "ranks_per_node": rows[0]["ranks_per_node"] or None,
        "launches": len(rows),
        "process_exits": len(rows) * rows[0]["ranks"],
        "nonzero_exit": sum(r["exit_code"] != 0 for r in rows),
        "aborts": sum(r["aborted"] for r in rows),
        "timeouts": sum(r["exit_code"] == -1 for r in rows),
        "median_launch_s": round(times[len(times) // 2], 2),
        "failed_launches": [r["launch"] for r in rows if r["exit_code"] != 0 or r["aborted"]],
    }


def main() -> None:
    parser = argument_parser(__spec__.name, __doc__)
    parser.add_argument("--launches", type=int, default=30, help="launches in total, shared round robin by --paths")
    parser.add_argument("--paths", nargs="+", choices=sorted(PATHS), default=list(TRAINING_PATHS))
    parser.add_argument("--ranks", type=int, help="ranks per launch (default: per path, see PATHS)")
    parser.add_argument("--ranks-per-node", type=int, help="the strategy's ranks_per_node (0: from the env)")
    parser.add_argument("--destroy", action="store_true", help="gloo path: destroy the process group at the end")
    parser.add_argument("--timeout", type=float, default=300.0, help="seconds per launch")
    parser.add_argument("--save-failures", metavar="DIR", help="write the whole output of each abnormal launch here")
    parser.add_argument("--name", help="write the figures to results/NAME.json")
    parser.add_argument("--note", help="recorded in results/NAME.json (e.g. which code was soaked)")
    parser.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.worker:
        path = args.paths[0]
        if path == "gloo":
            _gloo_worker(args.destroy)
        elif path == "torch-ddp":
            _torch_ddp_worker()
        else:
            _lightning_worker(args.ranks_per_node or 0, "16-mixed" if path == "lightning-fp16" else "32-true")
        return
    print(f"{args.launches} launches, round robin over {', '.join(args.paths)}", flush=True)
    rows: list[dict[str, Any]] = []
    for i in range(args.launches):
        path = args.paths[i % len(args.paths)]
        ranks = args.ranks or PATHS[path][0]
        per_node = PATHS[path][1] if args.ranks_per_node is None else args.ranks_per_node
        code, aborted, seconds, output = _launch(path, ranks, per_node, args.destroy, args.timeout,
                                                 29700 + (os.getpid() % 200) + i % 50)
        rows.append(dict(launch=i, path=path, ranks=ranks, ranks_per_node=per_node, exit_code=code, aborted=aborted,
                         seconds=round(seconds, 2)))
        if code != 0 or aborted:
            tail = "\n".join(output.strip().splitlines()[-12:])
            print(f"  launch {i} ({path}): exit code {code}, abort {'seen' if aborted else 'not seen'}\n{tail}",
                  flush=True)
            if args.save_failures:
                os.makedirs(args.save_failures, exist_ok=True)
                Path(args.save_failures, f"launch{i}_{path}.log").write_text(output)
        elif (i + 1) % 10 == 0:
            print(f"  {i + 1} launches done", flush=True)
    per_path = {path: _summary([r for r in rows if r["path"] == path]) for path in args.paths
                if any(r["path"] == path for r in rows)}
    for path, s in per_path.items():
        print(f"{path}: {s['launches']} launches of {s['ranks']} ranks, exit code != 0: {s['nonzero_exit']}, "
              f"aborts: {s['aborts']}, median launch {s['median_launch_s']:.1f} s")
    if args.name:
        import torch

        from benchmarks.common import write_results

        payload = dict(
            args={k: v for k, v in vars(args).items() if k not in ("worker", "save_failures", "note")},
            note=args.note,
            environment=dict(torch=torch.__version__, python=platform.python_version(), cpus=os.cpu_count()),
            launches=len(rows),
            nonzero_exit=sum(r["exit_code"] != 0 for r in rows),
            aborts=sum(r["aborted"] for r in rows),
            paths=per_path,
            rows=rows,
        )
        print(f"written to {write_results(args.name, payload)}")
    sys.exit(1 if any(r["exit_code"] != 0 or r["aborted"] for r in rows) else 0)


if __name__ == "__main__":
    main()
