"""ordered_powersgd_hook on plain DDP (gloo): torch's PowerSGD, its buckets compressed in order, its bytes counted as
the all-reduces it issues (checked by hand on a small model and against every ``dist.all_reduce`` it makes, the
ones from its future callbacks included), the same gradients on every rank."""

from __future__ import annotations

import sys
import threading
import time
from typing import Any

import pytest
import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.algorithms.ddp_comm_hooks.powerSGD_hook import PowerSGDState
from torch.nn.parallel import DistributedDataParallel

from lightning_onebit.comm import ring_allreduce_bytes
from lightning_onebit.hooks import OrderedPowerSGDState, ordered_powersgd_hook
from lightning_onebit.hooks.powersgd import powersgd_allreduce_numels
from tests.distributed import wait_until_group_released, run_distributed

STEPS, START = 5, 2


class _AllReduceSpy:
    """Every ``torch.distributed.all_reduce`` call while active, from any thread: its ring bytes per rank."""

    def __init__(self, world_size: int) -> None:
        self.world_size, self.bytes_sent, self.calls = world_size, 0, 0
        self._lock = threading.Lock()

    def __enter__(self) -> "_AllReduceSpy":
        self._original = original = dist.all_reduce

        def counted(tensor, *args, **kwargs):  # type: ignore[no-untyped-def]
            with self._lock:
                self.bytes_sent += ring_allreduce_bytes(tensor.numel(), tensor.element_size(), self.world_size)
                self.calls += 1
            return original(tensor, *args, **kwargs)

        dist.all_reduce = counted
        return self

    def __exit__(self, *exc: Any) -> None:
        dist.all_reduce = self._original


def _train(rank: int, world_size: int, layers: tuple[int, ...], bucket_cap_mb: float, rank_r: int) -> dict[str, Any]:
    torch.manual_seed(0)
    modules: list[nn.Module] = []
    for a, b in zip(layers, layers[1:]):
        modules += [nn.Linear(a, b), nn.Tanh()]
    model = DistributedDataParallel(nn.Sequential(*modules[:-1]), bucket_cap_mb=bucket_cap_mb)
    state = OrderedPowerSGDState(PowerSGDState(None, matrix_approximation_rank=rank_r, start_powerSGD_iter=START))
    model.register_comm_hook(state, ordered_powersgd_hook)
    generator = torch.Generator().manual_seed(rank)
    grads = []
    world = dist.group.WORLD
    references = sys.getrefcount(world)  # the group's references before any hook ran
    with _AllReduceSpy(world_size) as spy:
        for _ in range(STEPS):
            model.zero_grad()
            model(torch.randn(8, layers[0], generator=generator)).pow(2).sum().backward()
            grads.append(torch.cat([p.grad.reshape(-1) for p in model.parameters()]))
    wait_until_group_released(world, references)
    c = state.counters
    return dict(bytes_sent=c.bytes_sent, bytes_fp32=c.bytes_fp32_equivalent, collectives=c.collectives,
                calls=c.calls, spy_bytes=spy.bytes_sent, spy_calls=spy.calls, grads=grads,
                vanilla=state.vanilla_buckets, compressed=state.compressed_buckets, iter=state.powersgd.iter)


def test_bytes_of_a_small_model_by_hand() -> None:
    """Linear(16, 8), Linear(8, 4), rank 2, 2 ranks, one bucket (172 elements). The 8 x 16 weight is compressed
    ((8 + 16) 2 * 2 = 96 < 128): P 16, Q 32 elements; the 4 x 8 weight is not ((4 + 8) 2 * 2 = 48 >= 32), nor the
    biases (8 x 1 and 4 x 1 at rank 1): 44 elements sent uncompressed. A ring allreduce over 2 ranks sends 4 bytes
    per fp32 element. Steps 1-2 vanilla (start_powerSGD_iter 2), then 3 compressed."""
    for r in run_distributed(_train, 2, (16, 8, 4), 25.0, 2, timeout_s=60):
        assert r["vanilla"] == START and r["compressed"] == STEPS - START and r["iter"] == STEPS
        assert r["bytes_sent"] == START * 4 * 172 + (STEPS - START) * 4 * (44 + 16 + 32), r
        assert r["collectives"] == START + 3 * (STEPS - START) and r["calls"] == STEPS
        assert r["bytes_fp32"] == STEPS * 4 * 172


@pytest.mark.parametrize("world_size", [2, 3])
def test_counted_bytes_are_the_all_reduces_issued_with_several_buckets(world_size: int) -> None:
    # 64 -> 48 -> 32 -> 8 in 4 kB buckets: several buckets, compressed one after another (gloo would refuse
    # collectives issued in different orders on different ranks)
    results = run_distributed(_train, world_size, (64, 48, 32, 8), 0.004, 4, timeout_s=120)
    for r in results:
        assert r["compressed"] > STEPS - START  # several buckets per compressed step
        assert r["bytes_sent"] == r["spy_bytes"] and r["collectives"] == r["spy_calls"], r
        assert r["bytes_sent"] < r["bytes_fp32"]
    for step in range(STEPS):  # every rank applies the same averaged (and decompressed) gradient
        assert all(torch.equal(r["grads"][step], results[0]["grads"][step]) for r in results), step


def test_numels_follow_torchs_choice_of_tensors_to_compress() -> None:
    state = PowerSGDState(None, matrix_approximation_rank=4, min_compression_rate=2)
    # 3 x 5 at rank 3: (3 + 5) 3 * 2 = 48 >= 15, sent as it is; 64 x 32 at rank 4: 384 < 2048; a conv kernel 16 x 27
    assert powersgd_allreduce_numels(state, [(3, 5), (64, 32), (16, 3, 3, 3), (7,)]) == (
        15 + 7, 64 * 4 + 16 * 4, 32 * 4 + 27 * 4)


def test_the_state_takes_torchs_powersgd_state() -> None:
    with pytest.raises(ValueError, match="takes torch's PowerSGDState"):
        OrderedPowerSGDState(dict(matrix_approximation_rank=4))
