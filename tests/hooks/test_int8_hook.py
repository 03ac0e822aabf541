"""int8_allreduce_hook on plain DDP (2 and 3 gloo ranks, several buckets, several steps): every rank's averaged
bucket is the same bits, those of a one-process reference of the 8-bit exchange with its error feedback (written here
parameter by parameter, segment by segment: the error feedback follows a parameter across DDP's bucket rebuild),
close to the exact mean; the bytes are the two-phase exchange's, by hand."""

from __future__ import annotations

from typing import Any

import pytest
import torch
import torch.distributed as dist
from torch import nn
from torch.nn.parallel import DistributedDataParallel

from lightning_onebit.hooks import Int8AllreduceState, int8_allreduce_hook
from tests.distributed import run_distributed

STEPS = 4
SEGMENT = 24  # small, so that long tensors are cut into several scale segments


class _Recording:
    """The int8 hook's state, and what each call saw: the bucket's index, tensor sizes, input and output."""

    def __init__(self, state: Int8AllreduceState) -> None:
        self.state = state
        self.calls: list[dict[str, Any]] = []


def _recording_hook(recording, bucket):  # type: ignore[no-untyped-def]
    call = dict(params=list(recording.state.parameter_indices(bucket)), numels=[g.numel() for g in bucket.gradients()],
                input=bucket.buffer().clone())
    recording.calls.append(call)

    def done(future):  # type: ignore[no-untyped-def]
        call["output"] = future.value().clone()
        return future.value()

    return int8_allreduce_hook(recording.state, bucket).then(done)


def _model() -> nn.Module:
    torch.manual_seed(0)
    # an embedding (rows of very different gradients), a wide layer and vectors; ~1.1k parameters
    return nn.Sequential(nn.Embedding(20, 16), nn.Flatten(), nn.Linear(48, 16), nn.Tanh(), nn.Linear(16, 3))


def _train(rank: int, world_size: int, segment_numel: int) -> dict[str, Any]:
    model = DistributedDataParallel(_model(), bucket_cap_mb=0.002)  # 2 kB buckets: several of them
    recording = _Recording(Int8AllreduceState(segment_numel=segment_numel))
    recording.state.bind(model)
    model.register_comm_hook(recording, _recording_hook)
    generator = torch.Generator().manual_seed(1000 + rank)
    for _ in range(STEPS):
        tokens = torch.randint(0, 20, (5, 3), generator=generator)
        loss = model(tokens).pow(2).sum() * (1 + rank)  # ranks of different gradient sizes
        model.zero_grad()
        loss.backward()
    counters = recording.state.counters
    return dict(calls=recording.calls, bytes_sent=counters.bytes_sent, bytes_fp32=counters.bytes_fp32_equivalent,
                collectives=counters.collectives, call_count=counters.calls, world=dist.get_world_size(),
                state=recording.state.state_dict())


# ---------------------------------------------------------------------------------------------------------------------
# the reference: one process, every rank's input, parameter by parameter and segment by segment
def _quantize(y: torch.Tensor, segment_numel: int) -> tuple[list[torch.Tensor], list[torch.Tensor], torch.Tensor]:
    """One parameter's chunk ``y`` quantized in pieces of ``segment_numel`` elements from its start."""
    scales, qs, error = [], [], torch.empty_like(y)
    for a in range(0, y.numel(), segment_numel):
        part = y[a:a + segment_numel]
        scale = part.abs().max() / 127
        q = torch.zeros_like(part) if scale == 0 else torch.round(part / scale).clamp(-127, 127)
        error[a:a + part.numel()] = part - q * scale
        scales.append(scale)
        qs.append(q)
    return scales, qs, error


def _decode(scales: list[torch.Tensor], qs: list[torch.Tensor]) -> torch.Tensor:
    return torch.cat([q * s for s, q in zip(scales, qs)])


def _reference_call(inputs: list[torch.Tensor], numels: list[int], params: list[int], errors: dict,
                    segment_numel: int) -> torch.Tensor:
    """The averaged bucket; ``errors[(param, rank)]`` the error feedback kept per parameter (updated)."""
    world_size = len(inputs)
    result, start = [], 0
    for n, param in zip(numels, params):
        chunk = -(-n // world_size)
        decoded = []  # decoded[j][r]: rank j's quantized chunk r of this parameter
        for j, x in enumerate(inputs):
            worker, _ = errors.setdefault((param, j), (torch.zeros(world_size * chunk), torch.zeros(chunk)))
            y = torch.zeros(world_size * chunk)
            y[:n] = x[start:start + n]
            y += worker
            per_chunk = []
            for r in range(world_size):
                scales, qs, worker[r * chunk:(r + 1) * chunk] = _quantize(y[r * chunk:(r + 1) * chunk], segment_numel)
                per_chunk.append(_decode(scales, qs))
            decoded.append(per_chunk)
        average = torch.empty(world_size * chunk)
        for r in range(world_size):
            mean = decoded[0][r]
            for j in range(1, world_size):
                mean = mean + decoded[j][r]
            server = errors[(param, r)][1]
            scales, qs, error = _quantize(mean / world_size + server, segment_numel)
            server.copy_(error)
            average[r * chunk:(r + 1) * chunk] = _decode(scales, qs)
        result.append(average[:n])
        start += n
    return torch.cat(result)


@pytest.mark.parametrize("world_size", [2, 3])
def test_int8_hook_matches_the_reference_bit_for_bit_on_every_rank(world_size: int) -> None:
    results = run_distributed(_train, world_size, SEGMENT, timeout_s=120)
    calls = [r["calls"] for r in results]
    # one bucket in the first step, several once DDP rebuilt them (in the order gradients became ready)
    assert len({len(c) for c in calls}) == 1 and len(calls[0]) > STEPS
    errors: dict = {}  # per (parameter, rank): its error feedback, whatever bucket the parameter is in
    for i in range(len(calls[0])):
        params, numels = calls[0][i]["params"], calls[0][i]["numels"]
        assert all(c[i]["params"] == params and c[i]["numels"] == numels for c in calls)
        expected = _reference_call([c[i]["input"] for c in calls], numels, params, errors, SEGMENT)
        for rank, c in enumerate(calls):
            assert torch.equal(c[i]["output"], expected), f"call {i} rank {rank}"
        exact = torch.stack([c[i]["input"] for c in calls]).mean(0)
        assert not torch.equal(expected, exact)  # 8 bits really round
        # one step's rounding: at most a 127th of the largest magnitude, plus the error fed back
        assert torch.allclose(expected, exact, atol=0.05 * float(exact.abs().max()) + 1e-6), i
    # the buckets changed (DDP rebuilt them), the parameters' error feedback went on
    assert len({tuple(c["params"]) for c in calls[0]}) > 1
    assert any(float(worker.abs().sum()) > 0 for worker, _ in errors.values())
    # what the state keeps is the reference's, parameter by parameter
    for rank, r in enumerate(results):
        for param, kept in r["state"]["parameters"].items():
            worker, server = errors[(param, rank)]
            assert torch.equal(kept["worker_error"].reshape(-1), worker) and torch.equal(kept["server_error"], server)


def _one_bucket(rank: int, world_size: int) -> dict[str, Any]:
    torch.manual_seed(0)
    model = DistributedDataParallel(nn.Linear(3, 4, bias=False))  # one bucket of 12 elements
    state = Int8AllreduceState()
    state.bind(model)
    model.register_comm_hook(state, int8_allreduce_hook)
    for _ in range(2):
        model(torch.randn(4, 3)).sum().backward()
    return dict(bytes_sent=state.counters.bytes_sent, bytes_fp32=state.counters.bytes_fp32_equivalent,
                collectives=state.counters.collectives, calls=state.counters.calls)


@pytest.mark.parametrize(
    ("world_size", "block_bytes"),
    [
        # the 12-element weight in 2 chunks of 6: blocks of one scale and 6 values
        (2, 4 + 6),
        # in 3 chunks of 4
        (3, 4 + 4),
    ],
)
def test_int8_hook_counts_the_two_phase_bytes(world_size: int, block_bytes: int) -> None:
    for r in run_distributed(_one_bucket, world_size, timeout_s=60):
        # two calls, each an all_to_all and an all_gather of P - 1 blocks from this rank
        assert r["bytes_sent"] == 2 * 2 * (world_size - 1) * block_bytes, r
        # what an fp32 ring allreduce of the 12 elements sends: 2 (P - 1) / P * 48 bytes per call
        assert r["bytes_fp32"] == 2 * (2 * (world_size - 1) * 48 // world_size), r
        assert r["collectives"] == 4 and r["calls"] == 2, r


def test_bad_arguments_are_refused_with_their_name() -> None:
    with pytest.raises(ValueError, match="segment_numel must be an integer >= 1, got 0"):
        Int8AllreduceState(segment_numel=0)
    with pytest.raises(ValueError, match="error_feedback must be True or False"):
        Int8AllreduceState(error_feedback="yes")
