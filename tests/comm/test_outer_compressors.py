"""The compressed averages of the outer pseudo-gradient (``lightning_onebit.comm.outer``) and the top-k codec
(``lightning_onebit.comm.topk``): bits against straightforward references written from the formulas, on 2, 3 and 4
gloo ranks; every replica the same bits; bytes counted as computed by hand; and the error-feedback identity
``sent + e_new == x + decay * e_old``.

One bucket of 768 values: tensor pieces of 500, 200 and 50 values, then 18 values of padding (zeros); two calls, so
that the second one starts from the error feedback the first left. Top-k runs with chunks of 256 values, 8 kept.
"""

from __future__ import annotations

import math

import pytest
import torch

from lightning_onebit.comm import BucketLayout, OuterBucket, OuterCompression, make_outer_compressor
from lightning_onebit.comm.topk import topk_decode_add_, topk_encode, topk_payload_bytes
from tests.distributed import run_distributed
from tests.reference import reference_allreduce
from tests.tensors import same_bits, seed_of

PIECES = (500, 200, 50, 18)
REAL = 750
NUMEL = sum(PIECES)
CALLS = 2
CHUNK, KEEP = 256, 8
CONFIGS = {
    "none": OuterCompression("none"),
    "bf16": OuterCompression("bf16"),
    "onebit": OuterCompression("onebit"),
    "topk": OuterCompression("topk", chunk=CHUNK, keep=KEEP),
    "topk_decay": OuterCompression("topk", chunk=CHUNK, keep=KEEP, error_decay=0.5),
}


def pseudo_gradient(name: str, rank: int, call: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed_of(name, rank, call))
    x = torch.randn(NUMEL, generator=g)
    x[:500] *= 3.0  # pieces of different magnitudes
    x[700:750] *= 0.01
    x[REAL:] = 0.0
    return x


# ======================================================================================== in the ranks
def _compress_everything(rank: int, world_size: int) -> dict:
    results = {}
    for name, config in CONFIGS.items():
        compressor = make_outer_compressor(config)
        calls = []
        for call in range(CALLS):
            x = pseudo_gradient(name, rank, call)
            before = compressor.counters.snapshot()
            values = x.clone()
            compressor.average_([OuterBucket("bucket", values, PIECES, REAL)])
            error = compressor.error_feedback("bucket")
            calls.append({"input": x, "output": values, "error": None if error is None else error.clone(),
                          "counted": compressor.counters - before,
                          "expected_bytes": compressor.bytes_per_call(OuterBucket("bucket", values, PIECES, REAL))})
        results[name] = calls
    return results


@pytest.fixture(scope="module", params=[2, 3, 4])
def ranks(request) -> tuple[int, list[dict]]:
    return request.param, run_distributed(_compress_everything, request.param)


# ======================================================================================== references
def _bf16_reference(inputs: list[torch.Tensor], errors: list[torch.Tensor]):
    """bf16 with error feedback: each rank rounds ``x + e`` to bf16 (the residual stays), divides by M, and the bf16
    values are summed; returns the sum in float64 (its order is gloo's), the sent values and the new errors."""
    sent = [(x + e).to(torch.bfloat16) for x, e in zip(inputs, errors)]
    new_errors = [(x + e) - s.float() for x, e, s in zip(inputs, errors, sent)]
    wire = [s / len(inputs) for s in sent]
    return sum(w.double() for w in wire), sent, wire, new_errors


def _topk_reference(y: torch.Tensor, chunk: int, keep: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Chunked top-k + 2-bit, written out chunk by chunk: the dense values sent, and the kept mask."""
    sent, kept_mask = torch.zeros_like(y), torch.zeros(y.numel(), dtype=torch.bool)
    for start in range(0, y.numel(), chunk):
        part = y[start : start + chunk]
        order = sorted(range(chunk), key=lambda i: -abs(float(part[i])))[:keep]
        magnitudes = part[order].abs()
        lo, hi = magnitudes.min(), magnitudes.max()
        levels = (lo + (hi - lo) * 0.25, lo + (hi - lo) * 0.75)
        for i in order:
            level = levels[1] if part[i].abs() >= (lo + hi) * 0.5 else levels[0]
            sent[start + i] = -level if part[i] < 0 else level
            kept_mask[start + i] = True
    return sent, kept_mask


def _topk_payload_hand(numel: int, chunk: int, keep: int) -> int:
    chunks = numel // chunk
    return 4 * math.ceil((8 * chunks + 2 * chunks * keep + math.ceil(chunks * keep / 4)) / 4)


# ======================================================================================== tests
@pytest.mark.parametrize("name", list(CONFIGS))
def test_every_replica_gets_the_same_bits(ranks, name):
    world_size, results = ranks
    for call in range(CALLS):
        outputs = [results[r][name][call]["output"] for r in range(world_size)]
        assert all(same_bits(outputs[0], o) for o in outputs[1:]), f"{name}, call {call}"
        assert float(outputs[0][:REAL].abs().max()) > 0
        assert bool((outputs[0][REAL:] == 0).all()), "the padding must stay zero"


def test_none_is_the_exact_mean(ranks):
    world_size, results = ranks
    for call in range(CALLS):
        inputs = [results[r]["none"][call]["input"] for r in range(world_size)]
        expected = sum(inputs[1:], inputs[0].clone()) / world_size
        output = results[0]["none"][call]["output"]
        if world_size == 2:  # a + b is a + b in any order
            assert same_bits(output, expected)
        # else gloo's order of the sum: M - 1 roundings of partial sums, and the division's
        bound = world_size * torch.finfo(torch.float32).eps * sum(x.abs() for x in inputs) / world_size
        assert bool(((output - expected).abs() <= bound).all())
        assert results[0]["none"][call]["error"] is None  # no error feedback


def test_bf16_against_its_reference_with_exact_error_feedback(ranks):
    world_size, results = ranks
    errors = [torch.zeros(NUMEL) for _ in range(world_size)]
    for call in range(CALLS):
        inputs = [results[r]["bf16"][call]["input"] for r in range(world_size)]
        total, sent, wire, new_errors = _bf16_reference(inputs, errors)
        output = results[0]["bf16"][call]["output"]
        if world_size == 2:
            assert same_bits(output, (wire[0] + wire[1]).float())
        # a sum of M bf16 values in bf16, in gloo's order: M - 1 roundings of a partial sum, each within 2**-8 of
        # it, and every partial sum at most the sum of the magnitudes
        bound = (world_size - 1) * 2.0**-8 * sum(w.double().abs() for w in wire)
        assert bool(((output.double() - total).abs() <= bound).all())
        for r in range(world_size):
            got = results[r]["bf16"][call]["error"]
            assert same_bits(got, new_errors[r]), f"rank {r} call {call}: error feedback"
            # the identity, exactly: sent (bf16) + e_new == x + e_old
            assert torch.equal(sent[r].float() + got, inputs[r] + errors[r])
        errors = new_errors


def _onebit_gather_reference(y: torch.Tensor) -> torch.Tensor:
    """What one rank sends over two replicas: per piece (the padding its own), ``||y_s|| / sqrt(len_s)`` times the
    sign of every element, ``sgn(0) = +1``."""
    sent, start = torch.empty_like(y), 0
    for length in PIECES:
        part = y[start : start + length].double()
        scale = part.norm() / math.sqrt(length)
        sent[start : start + length] = torch.where(part >= 0, scale, -scale).float()
        start += length
    return sent


def test_onebit_against_its_reference(ranks):
    """Two replicas: each rank compresses once and every rank decodes both payloads (the all-gather); more: the
    two-phase exchange (workers compress, each rank serves the mean of one chunk and compresses it again)."""
    world_size, results = ranks
    layout = BucketLayout.build(PIECES, world_size)
    assert layout.padded_numel == NUMEL  # the outer step sizes buckets so that the layout adds no padding
    worker_errors = [torch.zeros(NUMEL) for _ in range(world_size)]
    server_errors = [torch.zeros(layout.chunk_numel) for _ in range(world_size)]
    for call in range(CALLS):
        inputs = [results[r]["onebit"][call]["input"] for r in range(world_size)]
        old = [e.clone() for e in worker_errors]
        if world_size == 2:
            sent = [_onebit_gather_reference(x + e) for x, e in zip(inputs, old)]
            expected = (sent[0] + sent[1]) / 2
            worker_errors = [x + e - s for x, e, s in zip(inputs, old, sent)]
        else:
            expected, worker_errors, server_errors = reference_allreduce(inputs, worker_errors, server_errors, layout)
        torch.testing.assert_close(results[0]["onebit"][call]["output"], expected, rtol=1e-5, atol=1e-6)
        for r in range(world_size):
            got = results[r]["onebit"][call]["error"]
            torch.testing.assert_close(got, worker_errors[r], rtol=1e-5, atol=1e-6)
            # sent = x + e_old - e_new is one scale times a sign per piece
            sent = inputs[r] + old[r] - got
            for a, b in zip(layout.segments.offsets[:-1], layout.segments.offsets[1:]):
                magnitude = sent[a:b].abs()
                torch.testing.assert_close(magnitude, magnitude.mean().expand_as(magnitude), rtol=1e-5, atol=1e-6)


def test_onebit_error_state_of_one_exchange_is_refused_by_the_other():
    from lightning_onebit.comm.outer import OnebitAverage, OnebitGatherAverage

    bucket = OuterBucket("bucket", torch.zeros(NUMEL), PIECES, REAL)
    gather, two_phase = OnebitGatherAverage(OuterCompression("onebit")), OnebitAverage(OuterCompression("onebit"))
    with pytest.raises(ValueError, match="two-phase exchange of more than two replicas"):
        gather.load_error_state_dict(two_phase.error_state_dict(), [bucket])
    with pytest.raises(ValueError, match="all-gather of two replicas"):
        two_phase.load_error_state_dict(gather.error_state_dict(), [bucket])
    gather.load_error_state_dict(gather.error_state_dict(), [bucket])  # its own is taken


@pytest.mark.parametrize("name", ["topk", "topk_decay"])
def test_topk_against_the_chunk_by_chunk_reference_bit_for_bit(ranks, name):
    world_size, results = ranks
    decay = CONFIGS[name].error_decay
    errors = [torch.zeros(NUMEL) for _ in range(world_size)]
    for call in range(CALLS):
        inputs = [results[r][name][call]["input"] for r in range(world_size)]
        total = torch.zeros(NUMEL)
        for r in range(world_size):
            y = errors[r] * decay + inputs[r] if decay != 1.0 else errors[r] + inputs[r]
            sent, kept = _topk_reference(y, CHUNK, KEEP)
            total = total + sent  # rank order
            new_error = torch.where(kept, y - sent, y)
            new_error[REAL:] = 0.0
            got = results[r][name][call]["error"]
            assert same_bits(got, new_error), f"rank {r} call {call}: error feedback"
            # the identity: exact off the kept elements, to one rounding of a subtraction on them
            identity = (sent + got - y)[:REAL]
            assert torch.equal(identity[~kept[:REAL]], torch.zeros(int((~kept[:REAL]).sum())))
            ulp = torch.finfo(torch.float32).eps * torch.maximum(y.abs(), sent.abs())[:REAL]
            assert bool((identity.abs() <= ulp).all())
            errors[r] = new_error
        expected = total / world_size
        assert same_bits(results[0][name][call]["output"], expected), f"call {call}"


@pytest.mark.parametrize("name", list(CONFIGS))
def test_bytes_counted_are_the_hand_computation(ranks, name):
    world_size, results = ranks
    m = world_size
    if name == "none":
        hand = 2 * (m - 1) * NUMEL * 4 // m
    elif name == "bf16":
        hand = 2 * (m - 1) * NUMEL * 2 // m
    elif name == "onebit" and m == 2:  # one payload: a scale per piece, then the signs, to 4 bytes
        hand = 4 * math.ceil((4 * len(PIECES) + NUMEL // 8) / 4)
    elif name == "onebit":
        chunk = NUMEL // m
        s_max = max(len(s) for s in BucketLayout.build(PIECES, m).chunk_segments)
        hand = 2 * (m - 1) * (4 * s_max + chunk // 8)
    else:
        hand = (m - 1) * _topk_payload_hand(NUMEL, CHUNK, KEEP)
    for r in range(world_size):
        for call in results[r][name]:
            counted = call["counted"]
            assert counted.bytes_sent == counted.bytes_received == counted.bytes_sent_inter_node == hand
            assert call["expected_bytes"] == hand
            assert counted.bytes_sent_intra_node == 0
            assert counted.bytes_fp32_equivalent == 2 * (m - 1) * NUMEL * 4 // m


# ======================================================================================== the codec, one process
def test_topk_payload_is_aligned_and_round_trips():
    assert topk_payload_bytes(4096 * 3, 4096, 64) == _topk_payload_hand(4096 * 3, 4096, 64) == 3 * (8 + 128 + 16)
    assert topk_payload_bytes(256, 256, 3) % 4 == 0  # 8 + 6 + 1 = 15 -> 16
    with pytest.raises(ValueError, match="multiple of the chunk"):
        topk_payload_bytes(300, 256, 3)
    y = torch.randn(3 * 256, generator=torch.Generator().manual_seed(5))
    y[256:512] = 0.0  # an all-zero chunk is sent as zeros
    y[600] = 7.0
    payload = torch.full((topk_payload_bytes(y.numel(), 256, 5),), 255, dtype=torch.uint8)
    indices, sent = topk_encode(y, 256, 5, payload)
    assert bool((indices.diff(dim=1) > 0).all())  # sorted, distinct
    decoded = torch.zeros_like(y)
    topk_decode_add_(decoded, payload, 256, 5)
    expected, kept = _topk_reference(y, 256, 5)
    assert same_bits(decoded, expected)
    assert bool((decoded[256:512] == 0).all())
    assert decoded[600] == 7.0 or decoded[600] > 0  # the largest value of its chunk is kept, at its sign
    assert int(kept.sum()) == 15 and same_bits(decoded.view(3, 256).gather(1, indices), sent)


def test_a_chunk_of_equal_magnitudes_is_sent_exactly():
    y = torch.tensor([2.0, -2.0, 0.5, 2.0] * 4)
    payload = torch.empty(topk_payload_bytes(16, 16, 3), dtype=torch.uint8)
    _, sent = topk_encode(y, 16, 3, payload)
    assert torch.equal(sent.abs(), torch.full_like(sent, 2.0))


@pytest.mark.parametrize("bad, match", [
    (dict(kind="fp8"), "compressor must be one of"),
    (dict(kind="topk", chunk=1), "chunk"),
    (dict(kind="topk", chunk=65536), "chunk"),
    (dict(kind="topk", chunk=256, keep=0), "keep"),
    (dict(kind="topk", chunk=256, keep=257), "keep"),
    (dict(kind="onebit", error_decay=0.0), "error_decay"),
    (dict(kind="onebit", error_decay=1.5), "error_decay"),
    (dict(kind="none", error_decay=0.9), "keeps no error feedback"),
])
def test_bad_compression_options_are_refused_with_the_fix(bad, match):
    with pytest.raises(ValueError, match=match):
        OuterCompression(**bad)


def test_a_name_or_an_outer_compression_is_taken():
    assert OuterCompression.of("topk") == OuterCompression("topk")
    config = OuterCompression("topk", keep=3)
    assert OuterCompression.of(config) is config
    with pytest.raises(ValueError, match="compressor must be one of"):
        OuterCompression.of(None)
