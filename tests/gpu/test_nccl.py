"""Multi-rank NCCL checks: one process per GPU. They need at least two CUDA GPUs and skip otherwise (the single-GPU
checks are in ``tests/gpu/test_gpu.py``; the GPU machines this project has used so far have one GPU).

* the compressed allreduce on NCCL gives, bit for bit, what the single-process simulation computes on the CPU;
* the overlapped exchange gives the in-step bits, with a ``compress=False`` embedding bucket that starts no exchange;
* random host delays in the hooks of some ranks, with ``CUDA_DEVICE_MAX_CONNECTIONS=1``, neither hang nor change the
  bits (the launch order of collectives is a function of the bucket schedule);
* resume with the error feedback kept continues the uninterrupted run bit for bit;
* replicas stay identical over a long run of each optimizer.

Run with ``python -m pytest -m gpu tests/gpu/test_nccl.py`` (``LIGHTNING_ONEBIT_NCCL_RANKS`` picks the rank count,
default every GPU, at most 8).
"""

from __future__ import annotations

import datetime
import os
import random
import tempfile
import time
from typing import Any, Callable

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from lightning_onebit import OnebitAdam, OnebitLamb, ZeroOneAdam
from lightning_onebit.hooks import OverlapState, overlapped_exchange_hook
from lightning_onebit.comm import (
    BucketLayout,
    CompressedAllreduceState,
    assert_replicas_identical,
    compressed_allreduce_buckets_,
    simulate_compressed_allreduce_,
)
from lightning_onebit.kernels import torch_kernels
from tests.distributed import free_port
from tests.gpu_scenarios import overlap_scenario, resume_scenario

GPUS = torch.cuda.device_count() if torch.cuda.is_available() else 0
pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(GPUS < 2 or not dist.is_nccl_available(), reason="needs 2 or more CUDA GPUs and NCCL"),
]
RANKS = min(int(os.environ.get("LIGHTNING_ONEBIT_NCCL_RANKS", GPUS)), 8)


def _entry(rank: int, world_size: int, port: int, fn: Callable, args: tuple, out: str) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.cuda.set_device(rank)
    dist.init_process_group("nccl", rank=rank, world_size=world_size, device_id=torch.device("cuda", rank),
                            timeout=datetime.timedelta(seconds=120))
    try:
        result = fn(rank, world_size, *args)
    finally:
        dist.destroy_process_group()
    torch.save(result, os.path.join(out, f"{rank}.pt"))


def run_nccl(fn: Callable[..., Any], world_size: int, *args: Any) -> list[Any]:
    with tempfile.TemporaryDirectory() as out:
        mp.start_processes(_entry, args=(world_size, free_port(), fn, args, out), nprocs=world_size, join=True,
                           start_method="spawn")
        return [torch.load(os.path.join(out, f"{r}.pt"), weights_only=False) for r in range(world_size)]


def _inputs(layout: BucketLayout, rank: int, step: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(1000 * step + rank)
    x = torch.zeros(layout.padded_numel)
    x[: layout.numel] = torch.randn(layout.numel, generator=g) * (1 + rank)
    return x


SIZES = ([300_001, 17, 4096], [1_000_000, 8, 77])


def exchange_scenario(rank: int, world_size: int) -> list[list[torch.Tensor]]:
    state = CompressedAllreduceState(backend="torch")
    layouts = [BucketLayout.build(s, world_size) for s in SIZES]
    outputs = []
    for step in range(3):
        buffers = [_inputs(layout, rank, step).cuda() for layout in layouts]
        compressed_allreduce_buckets_(state, [(k, b, layout) for k, (b, layout) in enumerate(zip(buffers, layouts))])
        outputs.append([b.cpu() for b in buffers])
    return outputs


def test_nccl_exchange_is_the_simulation_bit_for_bit(monkeypatch):
    results = run_nccl(exchange_scenario, RANKS)
    monkeypatch.setitem(torch_kernels.NORM_ACCUMULATE_DTYPE, "cpu", torch.float64)
    layouts = [BucketLayout.build(s, RANKS) for s in SIZES]
    states = [None] * len(layouts)
    for step in range(3):
        for k, layout in enumerate(layouts):
            buffers = [_inputs(layout, r, step) for r in range(RANKS)]
            states[k] = simulate_compressed_allreduce_(buffers, layout, states[k], backend="torch")
            for r in range(RANKS):
                assert torch.equal(results[r][step][k], buffers[r]), f"step {step} bucket {k} rank {r}"


def test_nccl_overlap_gives_the_in_step_bits():
    results = run_nccl(overlap_scenario, RANKS, "cuda")
    for rank, r in enumerate(results):
        assert r["started"] > 0
        for a, b in zip(r["overlapped"], r["in_step"]):
            assert torch.equal(a, b), f"rank {rank}"


def delayed_overlap_scenario(rank: int, world_size: int, steps: int) -> list[torch.Tensor]:
    """Many small buckets, random host delays in the hooks of odd ranks: must neither hang nor change the bits."""
    from tests.optim_models import EmbeddingNet

    rng = random.Random(rank)
    net = EmbeddingNet().cuda()
    ddp = torch.nn.parallel.DistributedDataParallel(net, device_ids=[rank], bucket_cap_mb=0.0005)
    opt = OnebitAdam(net.parameters(), lr=1e-3, freeze_step=3, dead_coordinates="ignore")
    state = OverlapState(ddp, opt)

    def hook(s, bucket):
        if rank % 2:
            time.sleep(rng.uniform(0, 0.003))
        return overlapped_exchange_hook(s, bucket)

    ddp.register_comm_hook(state, hook)
    for step in range(steps):
        g = torch.Generator().manual_seed(step * 100 + rank)
        x, y = torch.randint(0, 40, (8, 5), generator=g).cuda(), torch.randint(0, 2, (8,), generator=g).cuda()
        torch.nn.functional.cross_entropy(ddp(x), y).backward()
        opt.step()
        opt.zero_grad()
    assert_replicas_identical(list(net.named_parameters()))
    return [p.detach().cpu() for p in net.parameters()]


def test_nccl_random_delays_neither_hang_nor_diverge(monkeypatch):
    monkeypatch.setenv("CUDA_DEVICE_MAX_CONNECTIONS", "1")
    steps = int(os.environ.get("LIGHTNING_ONEBIT_STRESS_STEPS", "300"))
    results = run_nccl(delayed_overlap_scenario, RANKS, steps)
    assert all(torch.isfinite(p).all() for p in results[0])


def test_nccl_keep_resume_continues_bitwise(tmp_path):
    results = run_nccl(resume_scenario, RANKS, "cuda", str(tmp_path))
    for r in results:
        assert r["restored_device"] == "cuda"
        for name in ("params", "worker_error", "server_error"):
            for a, b in zip(r["resumed"][name], r["uninterrupted"][name]):
                assert torch.equal(a, b), name


def long_run_scenario(rank: int, world_size: int, name: str, steps: int) -> bool:
    from tests.optim_models import Net, rank_batch

    net = Net().cuda()
    ddp = torch.nn.parallel.DistributedDataParallel(net, device_ids=[rank])
    if name == "zeroone_adam":
        opt = ZeroOneAdam(net.parameters(), lr=1e-3, var_freeze_step=50, local_step_scaler=20, local_step_clipper=4)
    else:
        cls = OnebitAdam if name == "onebit_adam" else OnebitLamb
        opt = cls(net.parameters(), lr=1e-3, freeze_step=50, dead_coordinates="ignore")
    from lightning_onebit.hooks import GradientSyncState, switchable_allreduce_hook

    ddp.register_comm_hook(GradientSyncState(sync_predicate=lambda: opt.needs_gradient_allreduce),
                           switchable_allreduce_hook)
    for step in range(steps):
        x, y = (t.cuda() for t in rank_batch(rank, step))
        torch.nn.functional.mse_loss(ddp(x), y).backward()
        opt.step()
        opt.zero_grad()
        if step % 50 == 49:
            opt.synchronize()
            assert_replicas_identical(list(net.named_parameters()))
    return True


@pytest.mark.parametrize("name", ["onebit_adam", "zeroone_adam", "onebit_lamb"])
def test_nccl_replicas_stay_identical_over_a_long_run(name):
    assert all(run_nccl(long_run_scenario, RANKS, name, 1000))
