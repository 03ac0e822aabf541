"""``sparse_rows_allreduce_``: the exact average of row-sparse tensors (embedding gradients), sending only nonzero rows.

On 2 and 3 gloo ranks, with tensors of several shapes and dtypes where each rank touches different rows (one rank
none of some tensor, every rank none of another): every rank ends with the same bits, and those are the ranks' tensors
summed in rank order and divided by the world size; one host synchronisation per dtype; the bytes counted are the two all-gathers' (counts, then indices
and rows padded to the most rows any rank sent), far fewer than the dense allreduce of the same tensors.
"""

from __future__ import annotations

from typing import Any

import pytest
import torch

from lightning_onebit.comm import (
    CompressedAllreduceState,
    full_precision_allreduce_,
    ring_allreduce_bytes,
    sparse_rows_allreduce_,
)
from tests.detectors import count_host_syncs
from tests.distributed import run_distributed
from tests.tensors import same_bits, seed_of

# (shape, dtype, rows each rank touches: None = as many as the rank's index + 2, 0 = none)
TENSORS = (((50, 6), torch.float32, None), ((10, 2, 3), torch.float32, None), ((7,), torch.float32, None),
           ((20, 4), torch.bfloat16, None), ((30, 3), torch.float32, 0))


def local_tensors(rank: int) -> list[torch.Tensor]:
    """Row-sparse tensors, different on every rank; the last rank touches no row of the second tensor."""
    out = []
    for i, (shape, dtype, touched) in enumerate(TENSORS):
        g = torch.Generator().manual_seed(seed_of("sparse rows", rank, i))
        t = torch.zeros(shape, dtype=dtype)
        count = rank + 2 if touched is None else touched
        if i == 1 and rank == 2:
            count = 0
        rows = torch.randperm(shape[0], generator=g)[:count]
        t[rows] = torch.randn((len(rows), *shape[1:]), generator=g).to(dtype)
        out.append(t)
    return out


def _scenario(rank: int, world_size: int) -> dict[str, Any]:
    state = CompressedAllreduceState(None, "torch")
    tensors = local_tensors(rank)
    with count_host_syncs() as syncs:
        sparse_rows_allreduce_(state, tensors)
    dense_state = CompressedAllreduceState(None, "torch")
    full_precision_allreduce_(dense_state, local_tensors(rank))
    counters = state.counters
    return dict(result=tensors, bytes_sent=counters.bytes_sent, bytes_received=counters.bytes_received,
                bytes_uncompressed=counters.bytes_sent_uncompressed, inter=counters.bytes_sent_inter_node,
                fp32=counters.bytes_fp32_equivalent, collectives=counters.collectives, calls=counters.calls,
                dense_bytes=dense_state.counters.bytes_sent, dense_fp32=dense_state.counters.bytes_fp32_equivalent,
                syncs=[(e.what, e.where) for e in syncs.events])


@pytest.fixture(scope="module", params=[2, 3])
def session(request: pytest.FixtureRequest) -> tuple[int, list[dict[str, Any]]]:
    return request.param, run_distributed(_scenario, request.param, timeout_s=120)


def test_every_rank_gets_the_rank_order_sum_divided_by_the_world_size(session) -> None:
    world_size, ranks = session
    inputs = [local_tensors(r) for r in range(world_size)]
    for i in range(len(TENSORS)):
        expected = inputs[0][i].clone()
        for r in range(1, world_size):
            expected += inputs[r][i]
        expected /= world_size
        for r, out in enumerate(ranks):
            assert same_bits(out["result"][i], ranks[0]["result"][i]), f"tensor {i}: rank {r} differs from rank 0"
            assert torch.equal(out["result"][i], expected), f"tensor {i} on rank {r} is not the exact mean"


def test_bytes_are_the_two_all_gathers_padded_to_the_most_rows_any_rank_sent(session) -> None:
    world_size, ranks = session
    inputs = [local_tensors(r) for r in range(world_size)]
    payload = {torch.float32: 0, torch.bfloat16: 0}
    tensors_of = {torch.float32: 0, torch.bfloat16: 0}
    for i, (shape, dtype, _) in enumerate(TENSORS):
        rows = [t[i].reshape(shape[0], -1).ne(0).any(1).sum().item() for t in inputs]
        row_bytes = inputs[0][i].reshape(shape[0], -1).shape[1] * inputs[0][i].element_size()
        payload[dtype] += max(rows) * (8 + row_bytes)
        tensors_of[dtype] += 1
    expected = sum((world_size - 1) * (8 * tensors_of[d] + payload[d]) for d in payload)
    numel_of = {d: sum(torch.Size(shape).numel() for shape, dtype, _ in TENSORS if dtype == d) for d in payload}
    for out in ranks:
        assert out["bytes_sent"] == out["bytes_received"] == out["bytes_uncompressed"] == expected
        assert out["inter"] == expected  # no topology: every byte counts as inter-node
        assert out["collectives"] == 4 and out["calls"] == 2  # two kinds (fp32, bf16), two all-gathers each
        # what DDP would send: the same fp32 ring allreduce figure the dense path counts, per kind
        assert out["fp32"] == out["dense_fp32"] == sum(ring_allreduce_bytes(n, 4, world_size) for n in numel_of.values())
        assert out["bytes_sent"] < out["dense_bytes"] / 2


def test_one_host_synchronisation_per_kind_sizes_the_payload(session) -> None:
    """On CUDA each host read waits for the GPU: one per device and dtype (the gathered counts), none per tensor."""
    _, ranks = session
    for out in ranks:
        assert len(out["syncs"]) == 2, out["syncs"]  # fp32 and bf16
        assert all(what == "tolist" and "comm/full_precision.py" in where for what, where in out["syncs"])


def test_one_process_leaves_the_tensors_exactly_as_they_are() -> None:
    state = CompressedAllreduceState(None, "torch")
    tensors = local_tensors(0)
    before = [t.clone() for t in tensors]
    sparse_rows_allreduce_(state, tensors)
    assert all(same_bits(a, b) for a, b in zip(tensors, before))
    assert state.counters.bytes_sent == 0 and state.counters.collectives == 0
