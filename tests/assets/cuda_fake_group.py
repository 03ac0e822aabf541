"""Compression-stage steps of every optimizer on one CUDA device, as rank 0 of a 2-rank *fake* process group.

A one-GPU machine cannot run two NCCL ranks. torch's fake backend accepts every collective and moves no data, so this
process runs the whole compressed path (folding, compression, serving, decoding, the overlap hook's side stream) on
real CUDA tensors; only the received bytes are meaningless. Used by ``tests/gpu/test_gpu.py`` in a subprocess, twice:

* ``--sync-debug``: steady steps under ``torch.cuda.set_sync_debug_mode("error")``: any host synchronisation raises;
* under ``TORCH_CUDA_SANITIZER=1`` (set by the caller): CSAN reports unsynchronised access across streams.

Prints one ``OK <case>`` line per case and exits 0, or raises.
"""

from __future__ import annotations

import argparse
import sys

import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.testing._internal.distributed.fake_pg import FakeStore

from lightning_onebit import OnebitAdam, OnebitLamb, ZeroOneAdam
from lightning_onebit.hooks import GradientSyncState, OverlapState, overlapped_exchange_hook, switchable_allreduce_hook
from tests.optim_models import EmbeddingNet

FREEZE = 3


def make_optimizer(name: str, net: EmbeddingNet, uncompressed_embedding: bool):
    groups = (
        [{"params": [net.emb.weight], "compress": False},
         {"params": [p for n, p in net.named_parameters() if not n.startswith("emb")]}]
        if uncompressed_embedding else net.parameters()
    )
    common = dict(lr=1e-3, kernel_backend="torch")
    if name == "onebit_adam":
        return OnebitAdam(groups, freeze_step=FREEZE, dead_coordinates="ignore", **common)
    if name == "onebit_lamb":
        return OnebitLamb(groups, freeze_step=FREEZE, dead_coordinates="ignore", **common)
    return ZeroOneAdam(groups, var_freeze_step=FREEZE, var_update_scaler=1, local_step_scaler=2,
                       local_step_clipper=2, **common)


def run_case(name: str, overlap: bool, uncompressed_embedding: bool, sync_debug: bool, steps: int = 12) -> None:
    device = torch.device("cuda", 0)
    net = EmbeddingNet().to(device)
    ddp = DDP(net, device_ids=[0], bucket_cap_mb=0.004)
    opt = make_optimizer(name, net, uncompressed_embedding)
    # the fake group gathers no objects: every "rank" runs the torch kernels, as agree_kernel_backend would decide
    opt.compression.backend, opt._backend_agreed = "torch", True
    if overlap and opt.overlap_unsupported_reason is None:
        ddp.register_comm_hook(OverlapState(ddp, opt), overlapped_exchange_hook)
    else:
        sync = GradientSyncState(sync_predicate=lambda: opt.needs_gradient_allreduce)
        ddp.register_comm_hook(sync, switchable_allreduce_hook)
    g = torch.Generator(device=device).manual_seed(0)
    batches = [(torch.randint(0, EmbeddingNet.vocab, (16, 6), device=device, generator=g),
                torch.randint(0, 2, (16,), device=device, generator=g)) for _ in range(steps)]
    torch.cuda.synchronize()
    for step, (x, y) in enumerate(batches):
        steady = step >= FREEZE + 3  # past the first compressed steps (bucket building, one-time reports)
        if sync_debug and steady:
            torch.cuda.set_sync_debug_mode("error")
        try:
            torch.nn.functional.cross_entropy(ddp(x), y).backward()
            opt.step()
            opt.zero_grad(set_to_none=False)
        finally:
            torch.cuda.set_sync_debug_mode("default")
    torch.cuda.synchronize()
    print(f"OK {name} overlap={overlap} uncompressed_embedding={uncompressed_embedding} "
          f"kinds={dict(opt.steps_by_kind)}", flush=True)


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--sync-debug", action="store_true")
    parser.add_argument("--optimizers", nargs="+", default=["onebit_adam", "zeroone_adam", "onebit_lamb"])
    args = parser.parse_args()
    dist.init_process_group("fake", rank=0, world_size=2, store=FakeStore())
    try:
        for name in args.optimizers:
            for overlap in (False, True):
                for uncompressed_embedding in (False, True):
                    run_case(name, overlap, uncompressed_embedding, args.sync_debug)
    finally:
        dist.destroy_process_group()


if __name__ == "__main__":
    sys.exit(main())
