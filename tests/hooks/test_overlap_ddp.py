"""The overlapped exchange (``OverlapState`` + ``overlapped_exchange_hook``) on plain DDP, gloo CPU ranks.

* DDP behaviour it relies on, pinned: the private ``_has_rebuilt_buckets`` flips after the first iteration; hooks
  fire in bucket order; ``no_sync`` fires no hook.
* Starting each bucket's exchange in its hook gives the same bits as exchanging everything in ``step`` with the same
  momentum layout, on 2 and 3 ranks (flat) and 4 ranks as 2 nodes x 2 (hierarchical), every replica identical.
* The momenta are laid out like DDP's rebuilt buckets; a second backward pass before ``step`` is a clear error on
  every rank, raised before any collective.
"""

from __future__ import annotations

from typing import Any

import pytest
import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel as DDP

from lightning_onebit import OnebitAdam, Topology
from lightning_onebit.hooks import OverlapState, overlapped_exchange_hook
from tests.distributed import run_distributed
from tests.optim_models import token_batch

FREEZE, STEPS, VOCAB, DIM = 3, 9, 40, 16


class DeepNet(torch.nn.Module):
    """An embedding, six tanh layers and a head: several DDP buckets at a small ``bucket_cap_mb``."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.emb = torch.nn.Embedding(VOCAB, DIM)
        self.layers = torch.nn.ModuleList(torch.nn.Linear(DIM, DIM) for _ in range(6))
        self.head = torch.nn.Linear(DIM, 2)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.emb(x).mean(1)
        for layer in self.layers:
            h = torch.tanh(layer(h))
        return self.head(h)


def _train(rank: int, world_size: int, enabled: bool, ranks_per_node: int | None = None) -> dict[str, Any]:
    net = DeepNet()
    ddp = DDP(net, bucket_cap_mb=0.002)
    opt = OnebitAdam(ddp.parameters(), lr=1e-2, freeze_step=FREEZE, dead_coordinates="ignore")
    if ranks_per_node is not None:
        opt.topology = Topology.build(rank // ranks_per_node, rank % ranks_per_node, "hierarchical", ranks_per_node)
    state = OverlapState(ddp, opt, enabled=enabled)
    ddp.register_comm_hook(state, overlapped_exchange_hook)
    rebuilt, started = [], []
    for step in range(STEPS):
        rebuilt.append(bool(ddp._has_rebuilt_buckets))
        x, y = token_batch(rank, step, VOCAB)
        torch.nn.functional.cross_entropy(ddp(x), y).backward()
        started.append(opt.exchanges_in_flight)
        opt.step()
        opt.zero_grad()
    return dict(
        params=[p.detach().clone() for p in net.parameters()],
        rebuilt=rebuilt,
        in_flight_at_step=started,
        buckets_started=state.buckets_started,
        plan=[[tuple(p.shape) for p in bucket] for bucket in opt.bucket_plan or []],
        ddp_bucket_numels=[layout.numel for layout in opt.bucket_layouts().values()],
        exposed_s=opt.communication.exposed_s,
        hook_s=opt.communication.hook_s,
        has_gather_groups=opt.compression.has_gather_groups,
    )


def scenario_pair(rank: int, world_size: int, ranks_per_node: int | None = None) -> dict[str, Any]:
    """The same training overlapped, then with the hook's exchange switched off (same momentum layout)."""
    return dict(
        overlapped=_train(rank, world_size, True, ranks_per_node),
        in_step=_train(rank, world_size, False, ranks_per_node),
    )


def _check_pair(results: list[dict[str, Any]], world_size: int) -> None:
    n_buckets = len(results[0]["overlapped"]["plan"])
    assert n_buckets >= 3, results[0]["overlapped"]["plan"]  # the model really spans several DDP buckets
    for rank, r in enumerate(results):
        over, in_step = r["overlapped"], r["in_step"]
        # pinned private DDP attribute: False until DDP rebuilt its buckets in its second iteration, then True
        assert over["rebuilt"] == [False, False] + [True] * (STEPS - 2)
        # the first compressed step lays the momenta out (no overlap yet); every later one starts every bucket
        assert over["in_flight_at_step"] == [0] * (FREEZE + 1) + [n_buckets] * (STEPS - FREEZE - 1)
        assert over["buckets_started"] == n_buckets * (STEPS - FREEZE - 1)
        assert in_step["buckets_started"] == 0 and in_step["in_flight_at_step"] == [0] * STEPS
        assert over["has_gather_groups"] and not in_step["has_gather_groups"]
        assert over["hook_s"] > 0 and in_step["hook_s"] == 0
        # the momenta are laid out like DDP's buckets: reverse parameter order, the head first
        assert over["plan"] == in_step["plan"] and over["plan"][0][0] == (2,)
        for a, b in zip(over["params"], in_step["params"]):
            assert torch.equal(a, b), f"rank {rank}: overlapped and in-step exchanges differ"
    for r in results[1:]:
        for a, b in zip(results[0]["overlapped"]["params"], r["overlapped"]["params"]):
            assert torch.equal(a, b), "replicas differ"
    assert any(not torch.equal(a, b) for a, b in zip(results[0]["overlapped"]["params"], DeepNet().parameters()))


@pytest.mark.parametrize("world_size", [2, 3])
def test_overlapped_exchange_is_bitwise_the_in_step_exchange(world_size: int) -> None:
    _check_pair(run_distributed(scenario_pair, world_size, timeout_s=180), world_size)


def test_overlapped_hierarchical_exchange_is_bitwise_the_in_step_exchange() -> None:
    _check_pair(run_distributed(scenario_pair, 4, 2, timeout_s=240), 4)


def scenario_hooks_and_errors(rank: int, world_size: int) -> dict[str, Any]:
    net = DeepNet()
    ddp = DDP(net, bucket_cap_mb=0.002)
    opt = OnebitAdam(ddp.parameters(), lr=1e-2, freeze_step=1, dead_coordinates="ignore")
    state = OverlapState(ddp, opt)
    order: list[int] = []

    def recording_hook(state, bucket):  # no annotations: DDP checks them as objects, this module's are strings
        order.append(bucket.index())
        return overlapped_exchange_hook(state, bucket)

    ddp.register_comm_hook(state, recording_hook)
    out: dict[str, Any] = {}
    for step in range(3):
        x, y = token_batch(rank, step, VOCAB)
        torch.nn.functional.cross_entropy(ddp(x), y).backward()
        out.setdefault("orders", []).append(list(order))
        order.clear()
        opt.step()
        opt.zero_grad()
    x, y = token_batch(rank, 10, VOCAB)
    with ddp.no_sync():
        torch.nn.functional.cross_entropy(ddp(x), y).backward()
    out["hooks_under_no_sync"] = len(order)
    torch.nn.functional.cross_entropy(ddp(x), y).backward()
    out["in_flight"] = opt.exchanges_in_flight
    try:
        torch.nn.functional.cross_entropy(ddp(x), y).backward()
    except RuntimeError as err:
        out["second_backward"] = str(err)
    # no collective of the refused bucket was issued: the ranks still agree on a barrier and a sum
    dist.barrier()
    total = torch.ones(1)
    dist.all_reduce(total)
    out["sum_after"] = float(total)
    return out


def test_hooks_fire_in_bucket_order_no_sync_fires_none_and_a_second_backward_is_refused() -> None:
    results = run_distributed(scenario_hooks_and_errors, 2, timeout_s=120)
    for r in results:
        n = len(r["orders"][-1])
        assert n >= 3 and all(order == list(range(len(order))) for order in r["orders"])
        assert r["hooks_under_no_sync"] == 0
        assert r["in_flight"] == n
        assert "ready twice before optimizer.step()" in r["second_backward"] and "no_sync" in r["second_backward"]
        assert r["sum_after"] == 2.0


def scenario_cuda(rank: int, world_size: int) -> dict[str, Any]:
    """One rank on a GPU (gloo with CUDA tensors, no collective is needed at world size 1): the hook folds on a side
    stream, ``step`` waits for it; the result must be the in-step one, bit for bit."""
    out = {}
    for enabled in (True, False):
        net = DeepNet().cuda()
        ddp = DDP(net, device_ids=[0], bucket_cap_mb=0.002)
        opt = OnebitAdam(ddp.parameters(), lr=1e-2, freeze_step=FREEZE, dead_coordinates="ignore")
        state = OverlapState(ddp, opt, enabled=enabled)
        ddp.register_comm_hook(state, overlapped_exchange_hook)
        for step in range(STEPS):
            x, y = token_batch(rank, step, VOCAB)
            torch.nn.functional.cross_entropy(ddp(x.cuda()), y.cuda()).backward()
            opt.step()
            opt.zero_grad()
        out[enabled] = dict(params=[p.detach().cpu() for p in net.parameters()], started=state.buckets_started,
                            side_stream=opt.exchange.side_stream is not None)
    return out


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU (the side-stream path is CUDA only)")
def test_cuda_side_stream_gives_the_in_step_bits() -> None:
    (r,) = run_distributed(scenario_cuda, 1, timeout_s=180)
    assert r[True]["started"] > 0 and r[True]["side_stream"]
    assert r[False]["started"] == 0 and not r[False]["side_stream"]
    for a, b in zip(r[True]["params"], r[False]["params"]):
        assert torch.equal(a, b)
