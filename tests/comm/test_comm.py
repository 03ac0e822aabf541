"""The two-phase compressed allreduce: layout, a single-process simulation of every rank, error feedback, byte
accounting and the number of collectives, on real gloo process groups (tests/distributed.py)."""

from __future__ import annotations

import dataclasses
import itertools
import math
from typing import Any

import pytest
import torch
import torch.distributed as dist

from lightning_onebit.comm import (
    BucketLayout,
    CommunicationCounters,
    CompressedAllreduceState,
    compressed_allreduce_,
    simulate_compressed_allreduce_,
)
from tests.detectors import CountCollectives
from tests.distributed import run_distributed
from tests.reference import reference_allreduce
from tests.tensors import bucket_buffer, seed_of

# ------------------------------------------------------------------------------------------------ shared scenario data
# Buckets run through the real allreduce and the reference (sizes, per-tensor magnitude). Bucket "pad" has N = 343, not
# a multiple of 8P for P = 2 or 3; "exact" has N = 96 = 6 * 16 = 4 * 24; "tiny" has fewer than 8P elements.
REF_BUCKETS: dict[str, tuple[tuple[int, ...], tuple[float, ...]]] = {
    "pad": ((37, 200, 0, 5, 1, 100), (1e-3, 1.0, 1.0, 10.0, 0.1, 3.0)),
    "exact": ((64, 32), (2.0, 0.01)),
    "tiny": ((3,), (1.0,)),
}
REF_CALLS = 6
EF_CALLS = 200
EF_SIZES = (1200, 800)
COUNT_BUCKETS = {"two": (300, 17), "many": tuple(1 + (7 * i) % 23 for i in range(200))}
COUNT_CALLS = 3


def _rms(t: torch.Tensor) -> float:
    return float(t.double().square().mean().sqrt())


def _dist_main(rank: int, world_size: int) -> dict[int, dict]:
    """One spawn of 3 ranks (processes are slow to start): the scenario on the default group (P = 3), then on a
    subgroup of ranks 0 and 1 (P = 2, which also exercises ``CompressedAllreduceState(process_group=...)``)."""
    assert world_size == 3
    pair = dist.new_group([0, 1])  # every rank must take part in creating it
    results = {3: _scenario(rank, 3, None, run_error_feedback=False)}
    if rank < 2:
        results[2] = _scenario(rank, 2, pair, run_error_feedback=True)
    dist.barrier()
    return results


def _scenario(rank: int, world_size: int, group, run_error_feedback: bool) -> dict:
    """Everything this module checks on a process group of ``world_size`` ranks."""
    out: dict[str, Any] = {}
    assert dist.get_world_size(group) == world_size and dist.get_rank(group) == rank

    # 1. Several buckets through consecutive calls; record inputs, outputs, errors and the collectives of each call.
    state = CompressedAllreduceState(process_group=group)
    layouts = {key: BucketLayout.build(sizes, world_size) for key, (sizes, _) in REF_BUCKETS.items()}
    records: dict[str, list[dict]] = {key: [] for key in REF_BUCKETS}
    with CountCollectives() as counter:
        for t in range(REF_CALLS):
            for k, (key, (_, mags)) in enumerate(REF_BUCKETS.items()):
                layout = layouts[key]
                buffer = bucket_buffer(layout, mags, seed_of(1, t, rank, k))
                before_in, n_before = buffer.clone(), len(counter.calls)
                result = compressed_allreduce_(state, key, buffer, layout)
                assert result is buffer
                bufs = state._buckets[key]
                records[key].append(
                    dict(
                        input=before_in,
                        output=buffer.clone(),
                        worker_error=bufs.worker_error.clone(),
                        server_error=bufs.server_error.clone(),
                        collectives=counter.calls[n_before:],
                    )
                )
    out["records"] = records
    out["counters"] = dataclasses.asdict(state.counters)

    # 2. Collectives per call for a bucket of 2 tensors and one of 200 tensors.
    state = CompressedAllreduceState(process_group=group)
    counts: dict[str, list[list[str]]] = {}
    with CountCollectives() as counter:
        for key, sizes in COUNT_BUCKETS.items():
            layout = BucketLayout.build(sizes, world_size)
            counts[key] = []
            for t in range(COUNT_CALLS):
                buffer = bucket_buffer(layout, [1.0] * len(sizes), seed_of(2, t, rank))
                n_before = len(counter.calls)
                compressed_allreduce_(state, key, buffer, layout)
                counts[key].append([name for name, _ in counter.calls[n_before:]])
    out["collective_counts"] = counts

    # 3. Invalid layouts and buffers fail with ValueError before any collective (and count nothing).
    state = CompressedAllreduceState(process_group=group)
    good = BucketLayout.build([50, 31], world_size)  # N = 81, N_pad = 96 for P = 2 and 3
    invalid = {
        "layout_for_more_ranks": (BucketLayout.build([50, 31], world_size + 1), None),
        "layout_for_one_rank": (BucketLayout.build([50, 31], 1), None),
        "buffer_too_long": (good, good.padded_numel + 8 * world_size),
        "buffer_too_short": (good, good.padded_numel - 1),
        "buffer_unpadded": (good, good.numel),
    }
    raised: dict[str, str] = {}
    with CountCollectives() as counter:
        for name, (layout, length) in invalid.items():
            buffer = torch.zeros(layout.padded_numel if length is None else length)
            try:
                compressed_allreduce_(state, name, buffer, layout)
                raised[name] = "no error"
            except ValueError:
                raised[name] = "ValueError"
            except Exception as e:  # noqa: BLE001 - reported to the parent
                raised[name] = type(e).__name__
    out["invalid"] = dict(raised=raised, collectives=len(counter.calls), counters=dataclasses.asdict(state.counters),
                          buckets=len(state._buckets))

    # 4. Error feedback over many calls, against a baseline that drops the errors every call.
    if run_error_feedback:
        layout = BucketLayout.build(EF_SIZES, world_size)
        n = layout.numel
        bias = [torch.randn(n, generator=torch.Generator().manual_seed(seed_of(4, j)), dtype=torch.float64) * 0.3
                for j in range(world_size)]
        ef_state = CompressedAllreduceState(process_group=group)
        plain_state = CompressedAllreduceState(process_group=group)
        cum_true = torch.zeros(n, dtype=torch.float64)
        cum_ef = torch.zeros(n, dtype=torch.float64)
        cum_plain = torch.zeros(n, dtype=torch.float64)
        trace = []
        for t in range(1, EF_CALLS + 1):
            xs = [(bias[j] + torch.randn(n, generator=torch.Generator().manual_seed(seed_of(5, t, j)),
                                         dtype=torch.float64)).float() for j in range(world_size)]
            cum_true += torch.stack([x.double() for x in xs]).mean(0)
            mine = torch.zeros(layout.padded_numel)
            mine[:n] = xs[rank]
            ef_buf, plain_buf = mine.clone(), mine.clone()
            compressed_allreduce_(ef_state, "ef", ef_buf, layout)
            plain_state.reset_error_feedback()
            compressed_allreduce_(plain_state, "ef", plain_buf, layout)
            cum_ef += ef_buf[:n].double()
            cum_plain += plain_buf[:n].double()
            trace.append(dict(
                t=t,
                ef_max=float((cum_ef - cum_true).abs().max()),
                ef_rms=_rms(cum_ef - cum_true),
                plain_max=float((cum_plain - cum_true).abs().max()),
                plain_rms=_rms(cum_plain - cum_true),
                output_rms=_rms(ef_buf[:n]),
            ))
        bufs = ef_state._buckets["ef"]
        out["error_feedback"] = dict(
            trace=trace,
            cum_diff=(cum_ef - cum_true),
            worker_error=bufs.worker_error.clone(),
            server_error=bufs.server_error.clone(),
            padding_zero=bool((ef_buf[n:] == 0).all()),
            layout=layout,
        )
    return out


_RUN: dict[str, Any] = {}


def _all_results() -> list[dict[int, dict]]:
    """Spawn the scenario once per pytest process; a failed spawn is remembered too, not retried by every test."""
    if "results" not in _RUN and "error" not in _RUN:
        try:
            _RUN["results"] = run_distributed(_dist_main, 3)
        except Exception as e:  # noqa: BLE001 - re-raised below for every test that needs the results
            _RUN["error"] = e
    if "error" in _RUN:
        raise RuntimeError("the distributed scenario failed (see the first failing test for its traceback)") from _RUN["error"]
    return _RUN["results"]


def distributed_results(world_size: int) -> list[dict]:
    """Per-rank results of the scenario run with ``world_size`` ranks (2 or 3)."""
    results = [by_size[world_size] for by_size in _all_results() if world_size in by_size]
    assert len(results) == world_size
    return results


# ------------------------------------------------------------------------------------------------ expected layout
def _expected_offsets(sizes, P):
    n = sum(sizes)
    n_pad = 8 * P * math.ceil(n / (8 * P))
    c = n_pad // P
    tensor_bounds = set(itertools.accumulate(sizes, initial=0))
    chunk_bounds = {r * c for r in range(P + 1)}
    return n, n_pad, c, sorted(tensor_bounds | chunk_bounds | {n, n_pad})


# ------------------------------------------------------------------------------------------------ layout
LAYOUT_SIZES = [
    [1],
    [5],
    [1, 0, 1],
    [0, 13],
    [7, 0],
    [100, 0, 7, 1],
    [8 * 7 * 3],
    [1000, 1, 2, 3, 999],
    [3] * 50,
    [10007],
    [55, 56, 57, 0, 9999, 1],
]


@pytest.mark.parametrize("P", [1, 2, 3, 4, 7])
@pytest.mark.parametrize("sizes", LAYOUT_SIZES, ids=lambda s: "-".join(map(str, s[:6])))
def test_bucket_layout(P, sizes):
    layout = BucketLayout.build(sizes, P)
    n, n_pad, c, offsets = _expected_offsets(sizes, P)
    assert layout.numel == n == sum(sizes)
    assert layout.world_size == P
    assert layout.tensor_numels == tuple(sizes)
    # smallest multiple of 8P that is >= N
    assert layout.padded_numel % (8 * P) == 0
    assert n <= layout.padded_numel < n + 8 * P
    assert layout.padded_numel == n_pad
    assert layout.chunk_numel * P == layout.padded_numel
    assert layout.chunk_numel % 8 == 0
    # segments: tensor boundaries, chunk boundaries, N and N_pad; nothing else
    assert list(layout.segments.offsets) == offsets
    assert layout.segments.total == n_pad
    assert all(length > 0 for length in layout.segments.lengths)
    # chunk segments tile each chunk and together give exactly the buffer's segments
    assert len(layout.chunk_segments) == P
    absolute = set()
    for r, cs in enumerate(layout.chunk_segments):
        assert cs.offsets[0] == 0 and cs.total == c
        absolute.update(r * c + o for o in cs.offsets)
        assert list(cs.offsets) == [o - r * c for o in offsets if r * c <= o <= (r + 1) * c]
    assert sorted(absolute) == offsets
    assert sum(len(cs) for cs in layout.chunk_segments) == len(layout.segments)  # no segment spans two chunks
    s_max = max(len(cs) for cs in layout.chunk_segments)
    assert layout.max_chunk_segments == s_max
    # bytes
    assert layout.bytes_per_call() == 2 * (P - 1) * (4 * s_max + c // 8)
    assert layout.fp32_equivalent_bytes() == (2 * (P - 1) * 4 * n) // P
    if P == 1:
        assert layout.bytes_per_call() == 0 and layout.fp32_equivalent_bytes() == 0
    # deterministic: every rank derives the same layout
    assert BucketLayout.build(list(sizes), P) == layout


@pytest.mark.parametrize(
    "sizes, P",
    [([5], 0), ([5], -1), ([], 2), ([0], 2), ([0, 0, 0], 3), ([-1, 9], 2)],
)
def test_bucket_layout_rejects_invalid(sizes, P):
    with pytest.raises(ValueError):
        BucketLayout.build(sizes, P)


@pytest.mark.parametrize("P", [2, 3])
def test_large_bucket_is_at_least_30x_lighter_than_fp32(P):
    for sizes in ([10_000_000], [10_000] * 1000, [10_000_000 - 7, 7]):
        layout = BucketLayout.build(sizes, P)
        assert layout.bytes_per_call() / layout.fp32_equivalent_bytes() <= 1 / 30, sizes


# ------------------------------------------------------------------------------------------------ world size 1
def test_world_size_one_is_identity_and_counts_nothing():
    if dist.is_initialized():
        pytest.skip("a default process group exists in this pytest process")
    state = CompressedAllreduceState()
    layout = BucketLayout.build([5, 6], 1)
    assert layout.padded_numel == 16
    buffer = torch.zeros(16)
    buffer[:11] = torch.randn(11, generator=torch.Generator().manual_seed(0))
    before = buffer.clone()
    for _ in range(3):
        assert compressed_allreduce_(state, "b", buffer, layout) is buffer
        assert torch.equal(buffer, before)
    assert state.counters == CommunicationCounters()
    assert state._buckets == {}
    assert state.error_feedback_norm() == 0.0


def test_world_size_one_rejects_wrong_layout_and_buffer():
    if dist.is_initialized():
        pytest.skip("a default process group exists in this pytest process")
    state = CompressedAllreduceState()
    with pytest.raises(ValueError):
        compressed_allreduce_(state, "b", torch.zeros(16), BucketLayout.build([16], 2))
    layout = BucketLayout.build([11], 1)
    for bad in (torch.zeros(11), torch.zeros(24), torch.zeros(2, 8), torch.zeros(32)[::2], torch.zeros(16, dtype=torch.int32)):
        with pytest.raises(ValueError):
            compressed_allreduce_(state, "b", bad, layout)
    assert state.counters == CommunicationCounters()


# ------------------------------------------------------------------------------------------------ multi-rank
@pytest.mark.parametrize("P", [2, 3])
def test_matches_single_process_reference(P):
    results = distributed_results(P)
    for key, (sizes, _) in REF_BUCKETS.items():
        layout = BucketLayout.build(sizes, P)
        c = layout.chunk_numel
        worker_errors = [torch.zeros(layout.padded_numel) for _ in range(P)]
        server_errors = [torch.zeros(c) for _ in range(P)]
        for t in range(REF_CALLS):
            recs = [results[r]["records"][key][t] for r in range(P)]
            inputs = [rec["input"] for rec in recs]
            assert len({float(x.abs().sum()) for x in inputs}) == P, "every rank must bring different data"
            expected, worker_errors, server_errors = reference_allreduce(inputs, worker_errors, server_errors, layout)
            for r, rec in enumerate(recs):
                where = f"bucket {key!r}, call {t}, rank {r}"
                torch.testing.assert_close(rec["output"], expected, rtol=1e-6, atol=1e-7, msg=f"{where}: output")
                torch.testing.assert_close(rec["worker_error"], worker_errors[r], rtol=1e-6, atol=1e-7,
                                           msg=f"{where}: worker error")
                torch.testing.assert_close(rec["server_error"], server_errors[r], rtol=1e-6, atol=1e-7,
                                           msg=f"{where}: server error")


@pytest.mark.parametrize("P", [2, 3])
def test_single_process_simulation_is_the_distributed_exchange_bit_for_bit(P):
    """``simulate_compressed_allreduce_`` (the GPU suite's and GPU benchmark's stand-in for P ranks on one device)
    gives exactly the outputs and error feedback of the real exchange on P gloo ranks, call after call."""
    results = distributed_results(P)
    for key, (sizes, _) in REF_BUCKETS.items():
        layout = BucketLayout.build(sizes, P)
        states = None
        for t in range(REF_CALLS):
            recs = [results[r]["records"][key][t] for r in range(P)]
            buffers = [rec["input"].clone() for rec in recs]
            states = simulate_compressed_allreduce_(buffers, layout, states)
            for r, rec in enumerate(recs):
                where = f"bucket {key!r}, call {t}, rank {r}"
                assert torch.equal(buffers[r], rec["output"]), f"{where}: output"
                assert torch.equal(states[r].worker_error, rec["worker_error"]), f"{where}: worker error"
                assert torch.equal(states[r].server_error, rec["server_error"]), f"{where}: server error"


@pytest.mark.parametrize("P", [2, 3])
def test_output_identical_on_all_ranks_and_padding_zero(P):
    results = distributed_results(P)
    for key, (sizes, _) in REF_BUCKETS.items():
        n = sum(sizes)
        for t in range(REF_CALLS):
            outputs = [results[r]["records"][key][t]["output"] for r in range(P)]
            for r in range(1, P):
                assert torch.equal(outputs[0].view(torch.int32), outputs[r].view(torch.int32)), (key, t, r)
            assert bool((outputs[0][n:] == 0).all()), f"padding of {key!r} not zero after call {t}"
            assert bool(torch.isfinite(outputs[0]).all())
            assert float(outputs[0][:n].abs().max()) > 0
            # the padding of the inputs was zero too, and stays zero in the worker error
            for r in range(P):
                assert bool((results[r]["records"][key][t]["worker_error"][n:] == 0).all())


@pytest.mark.parametrize("P", [2, 3])
def test_byte_accounting(P):
    results = distributed_results(P)
    layouts = {key: BucketLayout.build(sizes, P) for key, (sizes, _) in REF_BUCKETS.items()}
    k = REF_CALLS
    expected_sent = 0
    expected_fp32 = 0
    for layout in layouts.values():
        s_max = max(len(cs) for cs in layout.chunk_segments)
        expected_sent += k * 2 * (P - 1) * (4 * s_max + layout.chunk_numel // 8)
        expected_fp32 += k * ((2 * (P - 1) * 4 * layout.numel) // P)
    for r in range(P):
        counters = results[r]["counters"]
        assert counters["calls"] == k * len(layouts)
        assert counters["collectives"] == 2 * k * len(layouts)
        assert counters["bytes_sent"] == expected_sent
        assert counters["bytes_received"] == expected_sent
        assert counters["bytes_fp32_equivalent"] == expected_fp32
        assert counters["bytes_sent"] == sum(k * layout.bytes_per_call() for layout in layouts.values())
        assert counters["bytes_fp32_equivalent"] == sum(k * layout.fp32_equivalent_bytes() for layout in layouts.values())
        assert counters["time_s"] > 0
        # The accounting agrees with what actually went to the collectives: of the all_to_all send buffer, the
        # (P-1)/P destined to other ranks; of the all_gather input, one copy to each of the P-1 other ranks.
        for key, layout in layouts.items():
            for rec in results[r]["records"][key]:
                (a2a_name, a2a_bytes), (ag_name, ag_bytes) = rec["collectives"]
                assert a2a_name == "all_to_all_single"
                assert ag_name in ("all_gather_single", "all_gather_into_tensor")
                recv_bytes, send_bytes = a2a_bytes[:2]
                gather_out, gather_in = ag_bytes[:2]
                assert send_bytes == recv_bytes and send_bytes % P == 0 and gather_out == P * gather_in
                wire = (P - 1) * send_bytes // P + (P - 1) * gather_in
                assert wire == layout.bytes_per_call(), key


@pytest.mark.parametrize("P", [2, 3])
def test_two_collectives_per_call_regardless_of_tensor_count(P):
    results = distributed_results(P)
    for r in range(P):
        counts = results[r]["collective_counts"]
        assert set(counts) == {"two", "many"}
        for key, per_call in counts.items():
            assert len(per_call) == COUNT_CALLS
            for names in per_call:
                assert len(names) == 2, (key, names)
                assert names[0] == "all_to_all_single"
                assert names[1] in ("all_gather_single", "all_gather_into_tensor")
        assert [len(n) for n in counts["two"]] == [len(n) for n in counts["many"]]
    # and the 200-tensor bucket really has (about) one segment per tensor
    assert len(BucketLayout.build(COUNT_BUCKETS["many"], P).segments) >= 200


@pytest.mark.parametrize("P", [2, 3])
def test_invalid_layout_or_buffer_raises_before_any_collective(P):
    results = distributed_results(P)
    for r in range(P):
        invalid = results[r]["invalid"]
        assert invalid["raised"] == {name: "ValueError" for name in invalid["raised"]}, invalid["raised"]
        assert len(invalid["raised"]) == 5
        assert invalid["collectives"] == 0
        assert invalid["counters"] == dataclasses.asdict(CommunicationCounters())
        assert invalid["buckets"] == 0


def test_error_feedback_keeps_cumulative_error_bounded():
    results = distributed_results(2)
    ef = results[0]["error_feedback"]
    trace = {row["t"]: row for row in ef["trace"]}
    assert len(trace) == EF_CALLS
    # both ranks saw the same outputs, hence the same cumulative error
    torch.testing.assert_close(results[1]["error_feedback"]["cum_diff"], ef["cum_diff"], rtol=0, atol=0)
    assert ef["padding_zero"]

    per_call = sum(row["output_rms"] for row in trace.values()) / EF_CALLS  # typical per-call scale
    at50, at200 = trace[50], trace[EF_CALLS]
    # With error feedback the cumulative error does not grow with the number of calls ...
    assert at200["ef_rms"] < 1.5 * max(row["ef_rms"] for t, row in trace.items() if t <= 50)
    assert at200["ef_max"] < 6 * per_call
    # ... while without it, it grows like a random walk (~ sqrt(t): x2 from 50 to 200 calls) ...
    assert at200["plain_rms"] > 1.6 * at50["plain_rms"]
    # ... and ends far above the error-feedback version.
    assert at200["plain_rms"] > 5 * at200["ef_rms"]
    assert at200["plain_max"] > 3 * at200["ef_max"]

    # Exact bookkeeping: sum(outputs) - sum(true means) = -(mean_j e_w_j + e_s) (errors start at zero).
    layout = ef["layout"]
    n, c = layout.numel, layout.chunk_numel
    worker_mean = (results[0]["error_feedback"]["worker_error"].double()
                   + results[1]["error_feedback"]["worker_error"].double()) / 2
    server = torch.cat([results[r]["error_feedback"]["server_error"].double() for r in range(2)])
    assert server.numel() == layout.padded_numel and c * 2 == layout.padded_numel
    torch.testing.assert_close(ef["cum_diff"], -(worker_mean + server)[:n], rtol=0, atol=1e-4)
