"""Launch a short multi-process training many times and count abnormal exits (issue 12, finding 11).

Each launch is ``python -m torch.distributed.run --nproc-per-node R`` of this script in worker mode: a tiny
LightningModule trained by ``Trainer(strategy=OnebitAdamStrategy(...), devices=R)`` on CPU/gloo through warmup into
the compression stage (``--ranks 4 --ranks-per-node 2`` exercises the hierarchical exchange and its subgroups).
torchrun reports every rank's exit code, so an abort at interpreter exit after training finished (``terminate called
without an active exception``, exit code 134) fails the launch. Per launch: the launcher's exit code, whether any
output contains "terminate called", and the wall time.

``--plain`` runs a plain torch.distributed worker instead (gloo, a few async collectives on the default group and
on two subgroups, like the hierarchical exchange), with ``--destroy`` deciding whether it destroys the process group
before exiting: the control experiment for the cause.

    python benchmarks/launch_soak.py --launches 20                        # 2 ranks, the onebit_adam strategy
    python benchmarks/launch_soak.py --launches 20 --ranks 4 --ranks-per-node 2
    python benchmarks/launch_soak.py --launches 40 --plain                # plain gloo, process group left alive
    python benchmarks/launch_soak.py --launches 40 --plain --destroy
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

SCRIPT = Path(__file__).resolve()


def _lightning_worker(ranks_per_node: int) -> None:
    import torch
    from torch import nn
    from torch.utils.data import DataLoader, TensorDataset

    import lightning.pytorch as pl
    from lightning_onebit import OnebitAdam, OnebitAdamStrategy

    class Tiny(pl.LightningModule):
        def __init__(self) -> None:
            super().__init__()
            self.net = nn.Sequential(nn.Linear(16, 32), nn.Tanh(), nn.Linear(32, 1))

        def training_step(self, batch, batch_idx):
            x, y = batch
            return nn.functional.mse_loss(self.net(x), y)

        def configure_optimizers(self):
            return OnebitAdam(self.parameters(), lr=1e-2, freeze_step=3)

    torch.set_num_threads(1)
    g = torch.Generator().manual_seed(int(os.environ.get("RANK", 0)))
    data = TensorDataset(torch.randn(64, 16, generator=g), torch.randn(64, 1, generator=g))
    strategy = OnebitAdamStrategy(ranks_per_node=ranks_per_node or None)
    trainer = pl.Trainer(
        strategy=strategy, accelerator="cpu", devices=int(os.environ["LOCAL_WORLD_SIZE"]), max_steps=8, logger=False,
        enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False,
    )
    trainer.fit(Tiny(), DataLoader(data, batch_size=8))


def _plain_worker(destroy: bool) -> None:
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


def _launch(args: argparse.Namespace, port: int) -> tuple[int, bool, float, str]:
    worker = ["--worker"] + (["--plain"] if args.plain else []) + (["--destroy"] if args.destroy else [])
    worker += ["--ranks-per-node", str(args.ranks_per_node)]
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", str(args.ranks),
           "--master-addr", "127.0.0.1", "--master-port", str(port), str(SCRIPT)] + worker
    # PYTHONFAULTHANDLER: an abort prints every Python thread's stack, i.e. where the process was when it died
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONWARNINGS="ignore", PYTHONFAULTHANDLER="1")
    started = time.perf_counter()
    try:
        done = subprocess.run(cmd, capture_output=True, text=True, timeout=args.timeout, env=env)
        code, output = done.returncode, done.stdout + done.stderr
    except subprocess.TimeoutExpired as err:
        code, output = -1, f"timed out after {args.timeout} s\n{err.stdout or ''}{err.stderr or ''}"
    return code, "terminate called" in output, time.perf_counter() - started, output


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--launches", type=int, default=20)
    parser.add_argument("--ranks", type=int, default=2)
    parser.add_argument("--ranks-per-node", type=int, default=0, help="strategy ranks_per_node (0: from the env)")
    parser.add_argument("--plain", action="store_true", help="plain torch.distributed worker (control experiment)")
    parser.add_argument("--destroy", action="store_true", help="with --plain: destroy the process group at the end")
    parser.add_argument("--timeout", type=float, default=180.0, help="seconds per launch")
    parser.add_argument("--save-failures", metavar="DIR", help="write the whole output of each abnormal launch here")
    parser.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.worker:
        _plain_worker(args.destroy) if args.plain else _lightning_worker(args.ranks_per_node)
        return
    what = (f"plain gloo, process group {'destroyed' if args.destroy else 'left alive'}" if args.plain
            else f"onebit_adam strategy (ranks_per_node={args.ranks_per_node or 'env'})")
    print(f"{args.launches} launches of {args.ranks} ranks: {what}")
    failures, aborts, times = [], 0, []
    for i in range(args.launches):
        code, aborted, seconds, output = _launch(args, 29700 + (os.getpid() % 200) + i % 50)
        times.append(seconds)
        aborts += aborted
        if code != 0 or aborted:
            failures.append((i, code, aborted))
            tail = "\n".join(output.strip().splitlines()[-8:])
            print(f"  launch {i}: exit code {code}, 'terminate called' {'seen' if aborted else 'not seen'}\n{tail}")
            if args.save_failures:
                os.makedirs(args.save_failures, exist_ok=True)
                Path(args.save_failures, f"launch{i}.log").write_text(output)
    print(f"abnormal launches: {len(failures)} of {args.launches} (exit code != 0: "
          f"{sum(1 for _, c, _ in failures if c != 0)}, 'terminate called' seen: {aborts}); "
          f"median launch {sorted(times)[len(times) // 2]:.1f} s")
    sys.exit(1 if failures else 0)


if __name__ == "__main__":
    main()
