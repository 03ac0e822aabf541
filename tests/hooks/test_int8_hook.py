"""int8_allreduce_hook on plain DDP (2 and 3 gloo ranks, several buckets, several steps): every rank's averaged
bucket is the same bits, those of a one-process reference of the 8-bit exchange with its error feedback (written here
segment by segment), close to the exact mean; the bytes are the two-phase exchange's, by hand."""

from __future__ import annotations

from typing import Any, Optional

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
    call = dict(index=bucket.index(), numels=[g.numel() for g in bucket.gradients()], input=bucket.buffer().clone())
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
    model.register_comm_hook(recording, _recording_hook)
    generator = torch.Generator().manual_seed(1000 + rank)
    for _ in range(STEPS):
        tokens = torch.randint(0, 20, (5, 3), generator=generator)
        loss = model(tokens).pow(2).sum() * (1 + rank)  # ranks of different gradient sizes
        model.zero_grad()
        loss.backward()
    counters = recording.state.counters
    return dict(calls=recording.calls, bytes_sent=counters.bytes_sent, bytes_fp32=counters.bytes_fp32_equivalent,
                collectives=counters.collectives, call_count=counters.calls, world=dist.get_world_size())


# ---------------------------------------------------------------------------------------------------------------------
# the reference: one process, every rank's input, segment by segment
def _reference_segments(numels: list[int], world_size: int, segment_numel: int) -> tuple[int, int, list[list[int]]]:
    """``(padded, chunk, offsets per chunk)``: padded to a multiple of 8 P; cuts at tensor ends, chunk boundaries and
    the end of the real elements, then every ``segment_numel`` elements from each segment's start."""
    n = sum(numels)
    padded = -(-n // (8 * world_size)) * 8 * world_size
    chunk = padded // world_size
    cuts = {0, n, padded, *range(0, padded, chunk)}
    total = 0
    for m in numels:
        total += m
        cuts.add(total)
    cuts = sorted(cuts)
    fine = set()
    for a, b in zip(cuts, cuts[1:]):
        fine.update(range(a, b, segment_numel))
    fine.add(padded)
    fine = sorted(fine)
    return padded, chunk, [[o - r * chunk for o in fine if r * chunk <= o <= (r + 1) * chunk]
                           for r in range(world_size)]


def _quantize(y: torch.Tensor, offsets: list[int]) -> tuple[list[torch.Tensor], list[torch.Tensor], torch.Tensor]:
    scales, qs, error = [], [], torch.empty_like(y)
    for a, b in zip(offsets, offsets[1:]):
        part = y[a:b]
        scale = part.abs().max() / 127
        q = torch.zeros_like(part) if scale == 0 else torch.round(part / scale).clamp(-127, 127)
        error[a:b] = part - q * scale
        scales.append(scale)
        qs.append(q)
    return scales, qs, error


def _decode(scales: list[torch.Tensor], qs: list[torch.Tensor]) -> torch.Tensor:
    return torch.cat([q * s for s, q in zip(scales, qs)])


def _reference_call(inputs: list[torch.Tensor], numels: list[int], errors: Optional[dict], segment_numel: int):
    world_size = len(inputs)
    padded, chunk, chunk_offsets = _reference_segments(numels, world_size, segment_numel)
    n = sum(numels)
    workers = errors["worker"] if errors else [torch.zeros(padded) for _ in range(world_size)]
    servers = errors["server"] if errors else [torch.zeros(chunk) for _ in range(world_size)]
    blocks = []  # blocks[j][r]: rank j's quantized chunk r
    for j, x in enumerate(inputs):
        y = torch.zeros(padded)
        y[:n] = x
        y += workers[j]
        per_chunk = []
        for r in range(world_size):
            scales, qs, error = _quantize(y[r * chunk:(r + 1) * chunk], chunk_offsets[r])
            workers[j][r * chunk:(r + 1) * chunk] = error
            per_chunk.append((scales, qs))
        blocks.append(per_chunk)
    result = torch.empty(padded)
    for r in range(world_size):
        mean = _decode(*blocks[0][r])
        for j in range(1, world_size):
            mean = mean + _decode(*blocks[j][r])
        z = mean / world_size + servers[r]
        scales, qs, servers[r] = _quantize(z, chunk_offsets[r])
        result[r * chunk:(r + 1) * chunk] = _decode(scales, qs)
    return result[:n], dict(worker=workers, server=servers)


@pytest.mark.parametrize("world_size", [2, 3])
def test_int8_hook_matches_the_reference_bit_for_bit_on_every_rank(world_size: int) -> None:
    results = run_distributed(_train, world_size, SEGMENT, timeout_s=120)
    calls = [r["calls"] for r in results]
    # one bucket in the first step, several once DDP rebuilt them (in the order gradients became ready)
    assert len({len(c) for c in calls}) == 1 and len(calls[0]) > STEPS
    errors: dict[int, tuple[list[int], dict]] = {}  # per bucket index: its tensor sizes and the error feedback
    for i in range(len(calls[0])):
        index, numels = calls[0][i]["index"], calls[0][i]["numels"]
        assert all(c[i]["index"] == index and c[i]["numels"] == numels for c in calls)
        kept = errors.get(index)
        state = kept[1] if kept is not None and kept[0] == numels else None  # a rebuilt bucket starts from zero
        expected, state = _reference_call([c[i]["input"] for c in calls], numels, state, SEGMENT)
        errors[index] = (numels, state)
        for rank, c in enumerate(calls):
            assert torch.equal(c[i]["output"], expected), f"call {i} rank {rank}"
        exact = torch.stack([c[i]["input"] for c in calls]).mean(0)
        assert not torch.equal(expected, exact)  # 8 bits really round
        # one step's rounding: at most a 127th of the largest magnitude, plus the error fed back
        assert torch.allclose(expected, exact, atol=0.05 * float(exact.abs().max()) + 1e-6), i
    # the error feedback was in use: a second call of a bucket differs from the call without it
    assert any(float(e[1]["worker"][0].abs().sum()) > 0 for e in errors.values())


def _one_bucket(rank: int, world_size: int) -> dict[str, Any]:
    torch.manual_seed(0)
    model = DistributedDataParallel(nn.Linear(3, 4, bias=False))  # one bucket of 12 elements
    state = Int8AllreduceState()
    model.register_comm_hook(state, int8_allreduce_hook)
    for _ in range(2):
        model(torch.randn(4, 3)).sum().backward()
    return dict(bytes_sent=state.counters.bytes_sent, bytes_fp32=state.counters.bytes_fp32_equivalent,
                collectives=state.counters.collectives, calls=state.counters.calls)


@pytest.mark.parametrize(
    ("world_size", "block_bytes"),
    [
        # 12 elements padded to 16 (a multiple of 8 P), chunks of 8: chunk 0 one segment, chunk 1 the weight's last 4
        # and the padding: 2 scales at most, so blocks of 2 * 4 + 8 bytes
        (2, 2 * 4 + 8),
        # padded to 24, chunks of 8: chunk 1 again the weight's last 4 and padding, chunk 2 all padding
        (3, 2 * 4 + 8),
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
