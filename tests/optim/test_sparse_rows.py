"""Param groups with ``compress=False, sparse_rows=True``: an embedding table averaged exactly as sparse rows.

On 2 and 3 gloo ranks with different data and a table of which each step looks up a few rows (rows past
``SEEN_ROWS`` only after the freeze): the table follows ``torch.optim.AdamW`` fed the ranks' gradients summed in rank
order and divided by the world size, bit for bit, so rows first seen after the freeze train with a live variance;
replicas stay bitwise identical; each compression step sends far fewer bytes than the dense full-precision average
of the same group (and on 2 ranks the two give the same bits); under ZeroOneAdam the table is identical on every
rank after every step, local steps included.
Validation of the option.
"""

from __future__ import annotations

from typing import Any

import pytest
import torch
from torch import nn
from torch.nn.parallel import DistributedDataParallel as DDP

from lightning_onebit import OnebitAdam, ZeroOneAdam
from lightning_onebit.comm import replica_checksums, ring_allreduce_bytes
from lightning_onebit.hooks import GradientSyncState, switchable_allreduce_hook
from tests.distributed import run_distributed, run_scenarios, scenario_results

VOCAB, SEEN_ROWS, DIM = 200, 40, 4
FREEZE, STEPS, LR, WD = 3, 8, 1e-2, 0.01


class TableNet(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.emb = nn.Embedding(VOCAB, DIM)
        self.head = nn.Linear(DIM, 1)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        return self.head(torch.tanh(self.emb(ids).mean(1)))


def batch(rank: int, step: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Different on every rank and step: 12 lookups, of rows ``< SEEN_ROWS`` up to the freeze."""
    g = torch.Generator().manual_seed(1000 * rank + step)
    ids = torch.randint(0, SEEN_ROWS if step <= FREEZE else VOCAB, (4, 3), generator=g)
    return ids, torch.randn(4, 1, generator=g)


def _train(rank: int, make_optimizer: Any, sparse_rows: bool, steps: int = STEPS) -> dict[str, Any]:
    net = TableNet()
    opt = make_optimizer([{"params": [net.emb.weight], "weight_decay": WD, "compress": False,
                           "sparse_rows": sparse_rows},
                          {"params": list(net.head.parameters())}])
    ddp = DDP(net)
    ddp.register_comm_hook(GradientSyncState(sync_predicate=lambda: opt.needs_gradient_allreduce),
                           switchable_allreduce_hook)
    out: dict[str, Any] = {k: [] for k in ("averaged", "grads", "emb", "checksums", "emb_checksum", "bytes_unc")}
    for t in range(1, steps + 1):
        opt.zero_grad()
        out["averaged"].append(opt.needs_gradient_allreduce)
        ids, y = batch(rank, t)
        nn.functional.mse_loss(ddp(ids), y).backward()
        out["grads"].append(net.emb.weight.grad.clone())
        opt.step()
        out["emb"].append(net.emb.weight.detach().clone())
        out["checksums"].append(replica_checksums(list(net.parameters())))
        out["emb_checksum"].append(replica_checksums([net.emb.weight]))
        out["bytes_unc"].append(opt.communication.bytes_sent_uncompressed)
    return out


def _adam(groups: Any) -> OnebitAdam:
    return OnebitAdam(groups, lr=LR, freeze_step=FREEZE)


def _zeroone(groups: Any) -> ZeroOneAdam:
    return ZeroOneAdam(groups, lr=LR, var_freeze_step=4, var_update_scaler=2, local_step_scaler=2,
                       local_step_clipper=4)


def scenario_adam(rank: int, world_size: int, workdir: str) -> dict[str, Any]:
    return dict(sparse=_train(rank, _adam, True), dense=_train(rank, _adam, False))


def scenario_zeroone(rank: int, world_size: int, workdir: str) -> dict[str, Any]:
    return dict(sparse=_train(rank, _zeroone, True, steps=12))


@pytest.fixture(scope="module", params=[2, 3])
def session(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory):
    scenarios = (("adam", scenario_adam), ("zeroone", scenario_zeroone))
    return request.param, run_distributed(run_scenarios, request.param, scenarios,
                                          str(tmp_path_factory.mktemp("sparse")), timeout_s=300)


def _reference(ranks: list[dict[str, Any]]) -> list[torch.Tensor]:
    """The table after each step of torch's AdamW fed the averaged gradient: DDP's where it averaged, else the ranks'
    local gradients summed in rank order and divided by the world size."""
    weight = nn.Parameter(TableNet().emb.weight.detach().clone())
    adamw = torch.optim.AdamW([weight], lr=LR, weight_decay=WD, fused=True)  # the kernel the optimizer's step runs
    after = []
    for t, averaged in enumerate(ranks[0]["averaged"]):
        grad = ranks[0]["grads"][t].clone()
        if not averaged:
            for r in ranks[1:]:
                grad += r["grads"][t]
            grad /= len(ranks)
        weight.grad = grad
        adamw.step()
        after.append(weight.detach().clone())
    return after


def test_sparse_rows_group_is_adamw_on_the_exact_average_and_late_rows_train(session) -> None:
    world_size, results = session
    ranks = [r["sparse"] for r in scenario_results(results, "adam")]
    assert ranks[0]["averaged"] == [True] * FREEZE + [False] * (STEPS - FREEZE)
    reference = _reference(ranks)
    for t in range(STEPS):
        assert torch.equal(ranks[0]["emb"][t], reference[t]), f"step {t + 1}: not AdamW on the exact average"
        assert all(torch.equal(ranks[0]["checksums"][t], r["checksums"][t]) for r in ranks[1:]), t
    # rows first looked up after the freeze moved by Adam-sized steps (a live variance), bounded
    late = ranks[0]["emb"][-1][SEEN_ROWS:] - TableNet().emb.weight.detach()[SEEN_ROWS:]
    touched_late = late.ne(0).any(1)
    assert touched_late.sum() > 10
    assert float(late.abs().max()) < 10 * LR * STEPS


def test_sparse_rows_send_far_fewer_bytes_than_the_dense_average(session) -> None:
    world_size, results = session
    both = scenario_results(results, "adam")
    for sparse, dense in ((r["sparse"], r["dense"]) for r in both):
        per_step = [b - a for a, b in zip([0] + sparse["bytes_unc"], sparse["bytes_unc"])][FREEZE:]
        dense_per_step = [b - a for a, b in zip([0] + dense["bytes_unc"], dense["bytes_unc"])][FREEZE:]
        assert all(d == ring_allreduce_bytes(VOCAB * DIM, 4, world_size) for d in dense_per_step)
        # at most 12 lookups per rank: 12 rows of 4 floats plus an index each, to every other rank, and the count
        assert all(0 < s <= (world_size - 1) * (12 * (DIM * 4 + 8) + 8) for s in per_step), per_step
        if world_size == 2:  # a + b in either order: the dense ring and the sparse rank-order sum agree bit for bit
            assert all(torch.equal(a, b) for a, b in zip(sparse["emb"], dense["emb"]))


def test_zeroone_adam_sparse_rows_group_is_identical_on_every_rank_after_every_step(session) -> None:
    """Through 0/1 Adam's local steps too, where the compressed parameters differ between ranks by design."""
    world_size, results = session
    ranks = [r["sparse"] for r in scenario_results(results, "zeroone")]
    assert False in ranks[0]["averaged"]
    for t in range(len(ranks[0]["emb_checksum"])):
        assert all(torch.equal(ranks[0]["emb_checksum"][t], r["emb_checksum"][t]) for r in ranks[1:]), t


@pytest.mark.parametrize("value", ["yes", 1, None])
def test_sparse_rows_must_be_a_bool(value: Any) -> None:
    net = TableNet()
    with pytest.raises(ValueError, match="sparse_rows must be True or False"):
        OnebitAdam([{"params": [net.emb.weight], "compress": False, "sparse_rows": value}], freeze_step=3)


def test_sparse_rows_needs_compress_false() -> None:
    net = TableNet()
    with pytest.raises(ValueError, match='sparse_rows=True applies to a group with compress=False.*"compress": False'):
        OnebitAdam([{"params": [net.emb.weight], "sparse_rows": True}], freeze_step=3)
