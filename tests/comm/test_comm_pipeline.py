"""The pipelined multi-bucket allreduce (``compressed_allreduce_buckets_``) and the native kernels inside the full
compressed allreduce, on real gloo process groups of 3 ranks and of 2 (a subgroup), see tests/distributed.py.

* pipelining several buckets gives the same bits, outputs and error feedback alike, as reducing them one by one;
* the "cpu" (native) and "torch" kernel backends give the same bits through the whole allreduce, even when the ranks
  use different backends;
* every rank ends with the same result, and it is the right one (single-process simulation of tests/reference.py);
* a bad bucket raises ValueError on every rank before any collective, leaves the state alone, and the ranks can go
  on with correct calls afterwards (a half-issued collective would hang until the harness timeout, or corrupt them).
"""

from __future__ import annotations

import dataclasses
from typing import Any, Hashable

import pytest
import torch
import torch.distributed as dist

from lightning_onebit.comm import (
    BucketLayout,
    CompressedAllreduceState,
    compressed_allreduce_,
    compressed_allreduce_buckets_,
)
from lightning_onebit.kernels import cpu_kernels
from tests.detectors import CountCollectives
from tests.distributed import run_distributed
from tests.reference import reference_allreduce
from tests.tensors import bucket_buffer, same_bits, seed_of

CALLS = 5
# Three buckets of different layouts: many tensors with padding and a zero-size tensor; one tensor that is all zeros
# in every call (scale-0 segments); fewer elements than 8P. Keys of different types.
BUCKETS: dict[Hashable, tuple[tuple[int, ...], tuple[float, ...]]] = {
    "mixed": ((37, 200, 0, 5, 1, 100, 1500), (1e-3, 1.0, 1.0, 10.0, 0.1, 3.0, 0.5)),
    ("zeros", 1): ((64, 130, 811), (2.0, 0.0, 0.01)),
    7: ((3,), (1.0,)),
}


def _inputs(layouts: dict, rank: int, t: int) -> dict[Hashable, torch.Tensor]:
    return {
        key: bucket_buffer(layouts[key], mags, seed_of(31, t, rank, k))
        for k, (key, (_, mags)) in enumerate(BUCKETS.items())
    }


def _errors(state: CompressedAllreduceState) -> dict[Hashable, tuple[torch.Tensor, torch.Tensor]]:
    return {key: (b.worker_error.clone(), b.server_error.clone()) for key, b in state._buckets.items()}


def _backends() -> list[str]:
    return ["torch", "cpu"] if cpu_kernels.is_available() else ["torch"]


# ------------------------------------------------------------------------------------------------ rank-side scenarios
def _run_calls(rank: int, world_size: int, group, state_for, pipelined: bool) -> list[dict]:
    """``CALLS`` consecutive reductions of all buckets; per call the inputs, outputs and error feedback."""
    layouts = {key: BucketLayout.build(sizes, world_size) for key, (sizes, _) in BUCKETS.items()}
    state = state_for(group)
    records = []
    for t in range(CALLS):
        inputs = _inputs(layouts, rank, t)
        buffers = {key: x.clone() for key, x in inputs.items()}
        if pipelined:
            compressed_allreduce_buckets_(state, [(key, buffers[key], layouts[key]) for key in BUCKETS])
        else:
            for key in BUCKETS:
                assert compressed_allreduce_(state, key, buffers[key], layouts[key]) is buffers[key]
        records.append(dict(inputs=inputs, outputs=buffers, errors=_errors(state),
                            counters=dataclasses.asdict(state.counters)))
    return records


def _scenario(rank: int, world_size: int, group) -> dict[str, Any]:
    assert dist.get_world_size(group) == world_size and dist.get_rank(group) == rank
    out: dict[str, Any] = {"backends": _backends()}

    # (a) and (b): pipelined and bucket-by-bucket, with each backend; then with the backend differing between ranks.
    runs = {}
    for backend in out["backends"]:
        for pipelined in (True, False):
            runs[(backend, pipelined)] = _run_calls(
                rank, world_size, group, lambda g, b=backend: CompressedAllreduceState(g, b), pipelined
            )
    if "cpu" in out["backends"]:
        mixed = "cpu" if rank % 2 == 0 else "torch"
        runs[("mixed", True)] = _run_calls(
            rank, world_size, group, lambda g: CompressedAllreduceState(g, mixed), True
        )
    out["runs"] = runs

    # (d) bad buckets: ValueError on every rank before any collective; the state and buffers are left alone.
    layouts = {key: BucketLayout.build(sizes, world_size) for key, (sizes, _) in BUCKETS.items()}
    keys = list(BUCKETS)
    state, control = CompressedAllreduceState(group), CompressedAllreduceState(group)
    for s in (state, control):  # warm up: error feedback is non-zero from here on
        warm = _inputs(layouts, rank, 100)
        compressed_allreduce_buckets_(s, [(key, warm[key], layouts[key]) for key in keys])
    errors_before = _errors(state)
    counters_before = dataclasses.asdict(state.counters)

    def good(t: int) -> list[tuple[Hashable, torch.Tensor, BucketLayout]]:
        inputs = _inputs(layouts, rank, t)
        return [(key, inputs[key], layouts[key]) for key in keys]

    last = keys[-1]
    bad_cases = {
        "buffer_too_long": good(200)[:2] + [(last, torch.zeros(layouts[last].padded_numel + 8), layouts[last])],
        "buffer_too_short": good(201)[:2] + [(last, torch.zeros(layouts[last].padded_numel - 8), layouts[last])],
        "buffer_unpadded_first": [(keys[0], torch.zeros(layouts[keys[0]].numel), layouts[keys[0]])] + good(202)[1:],
        "duplicate_keys": good(203) + [(keys[0], torch.zeros(layouts[keys[0]].padded_numel), layouts[keys[0]])],
        "duplicate_keys_other_layout": good(204)[:1] + [(keys[0], good(204)[1][1], layouts[keys[1]])],
        "layout_for_other_world_size": good(205)[:2] + [
            (last, torch.zeros(BucketLayout.build(BUCKETS[last][0], world_size + 1).padded_numel),
             BucketLayout.build(BUCKETS[last][0], world_size + 1))
        ],
    }
    raised, collectives, untouched = {}, {}, {}
    for name, buckets in bad_cases.items():
        before = [buffer.clone() for _, buffer, _ in buckets]
        with CountCollectives() as counter:
            try:
                compressed_allreduce_buckets_(state, buckets)
                raised[name] = "no error"
            except ValueError:
                raised[name] = "ValueError"
            except Exception as e:  # noqa: BLE001 - reported to the parent
                raised[name] = f"{type(e).__name__}: {e}"
        collectives[name] = len(counter.calls)
        untouched[name] = all(torch.equal(b, a) for (_, b, _), a in zip(buckets, before))
    errors_after = _errors(state)
    out["bad"] = dict(
        raised=raised,
        collectives=collectives,
        buffers_untouched=untouched,
        errors_untouched=set(errors_after) == set(errors_before) and all(
            torch.equal(errors_after[k][i], errors_before[k][i]) for k in errors_before for i in (0, 1)
        ),
        counters_untouched=dataclasses.asdict(state.counters) == counters_before,
    )
    # ... and the group still works: the next call matches a state that never saw the bad buckets.
    after = {}
    for name, s in (("state", state), ("control", control)):
        buckets = good(300)
        compressed_allreduce_buckets_(s, buckets)
        after[name] = {key: buffer for key, buffer, _ in buckets}
    out["bad"]["after"] = after
    return out


def _dist_main(rank: int, world_size: int) -> dict[int, dict]:
    """One spawn of 3 ranks (process start-up is the slow part): the default group (P = 3), then the subgroup of
    ranks 0 and 1 (P = 2, through ``CompressedAllreduceState(process_group=...)``)."""
    assert world_size == 3
    pair = dist.new_group([0, 1])  # every rank takes part in creating it
    results = {3: _scenario(rank, 3, None)}
    if rank < 2:
        results[2] = _scenario(rank, 2, pair)
    dist.barrier()
    return results


# ------------------------------------------------------------------------------------------------ parent side
@pytest.fixture(scope="module")
def session() -> list[dict[int, dict]]:
    # a hang (a rank waiting on a collective that another rank never issues) fails here instead of blocking
    return run_distributed(_dist_main, 3, timeout_s=120)


def _per_rank(session, world_size: int) -> list[dict]:
    results = [by_size[world_size] for by_size in session if world_size in by_size]
    assert len(results) == world_size
    return results


def _assert_records_identical(actual: list[dict], expected: list[dict], what: str) -> None:
    assert len(actual) == len(expected) == CALLS
    for t, (a, e) in enumerate(zip(actual, expected)):
        assert set(a["outputs"]) == set(e["outputs"]) == set(BUCKETS)
        for key in BUCKETS:
            assert same_bits(a["inputs"][key], e["inputs"][key]), f"{what}: call {t}, {key!r}: inputs differ"
            assert same_bits(a["outputs"][key], e["outputs"][key]), f"{what}: call {t}, bucket {key!r}: output"
            assert same_bits(a["errors"][key][0], e["errors"][key][0]), f"{what}: call {t}, {key!r}: worker error"
            assert same_bits(a["errors"][key][1], e["errors"][key][1]), f"{what}: call {t}, {key!r}: server error"


@pytest.mark.parametrize("P", [2, 3])
def test_pipelined_buckets_equal_bucket_by_bucket(session, P):
    for rank, result in enumerate(_per_rank(session, P)):
        for backend in result["backends"]:
            pipelined, sequential = result["runs"][(backend, True)], result["runs"][(backend, False)]
            _assert_records_identical(pipelined, sequential, f"P={P} rank {rank} backend {backend}")
            # same accounting: two collectives and one call per bucket, whichever way they were issued
            for t in range(CALLS):
                assert pipelined[t]["counters"] | {"time_s": 0} == sequential[t]["counters"] | {"time_s": 0}
                assert pipelined[t]["counters"]["collectives"] == 2 * len(BUCKETS) * (t + 1)
                assert pipelined[t]["counters"]["calls"] == len(BUCKETS) * (t + 1)


@pytest.mark.parametrize("P", [2, 3])
def test_cpu_and_torch_backends_give_identical_bits(session, P):
    results = _per_rank(session, P)
    if "cpu" not in results[0]["backends"]:
        pytest.skip("the native CPU kernels did not build on the ranks")
    for rank, result in enumerate(results):
        runs = result["runs"]
        _assert_records_identical(runs[("cpu", True)], runs[("torch", True)], f"P={P} rank {rank}: cpu vs torch")
        _assert_records_identical(runs[("cpu", False)], runs[("torch", True)], f"P={P} rank {rank}: cpu sequential")
        # ranks on different backends (even ranks native, odd ones torch) still agree with the all-torch run
        _assert_records_identical(runs[("mixed", True)], runs[("torch", True)], f"P={P} rank {rank}: mixed backends")


def _assert_close_per_tensor(actual, expected, layout: BucketLayout, mags, where: str) -> None:
    """Close to the float32 single-process reference, within float32 rounding of each tensor's own magnitude (its
    scales are computed differently there), and exactly zero in the padding."""
    offset = 0
    for n, mag in zip(layout.tensor_numels, mags):
        torch.testing.assert_close(actual[offset : offset + n], expected[offset : offset + n], rtol=1e-6,
                                   atol=2e-6 * mag, msg=lambda m: f"{where}, tensor at {offset}: {m}")
        offset += n
    assert bool((actual[offset:] == 0).all()) and bool((expected[offset:] == 0).all()), f"{where}: padding"


@pytest.mark.parametrize("P", [2, 3])
def test_result_identical_on_every_rank_and_correct(session, P):
    results = _per_rank(session, P)
    layouts = {key: BucketLayout.build(sizes, P) for key, (sizes, _) in BUCKETS.items()}
    for run in results[0]["runs"]:
        for t in range(CALLS):
            for key in BUCKETS:
                outputs = [results[r]["runs"][run][t]["outputs"][key] for r in range(P)]
                for r in range(1, P):
                    assert same_bits(outputs[r], outputs[0]), f"run {run}, call {t}, bucket {key!r}: rank {r}"
                n = layouts[key].numel
                assert bool((outputs[0][n:] == 0).all()), f"{key!r}: the padding must stay zero"
                assert bool(torch.isfinite(outputs[0]).all()) and float(outputs[0][:n].abs().max()) > 0
    # every rank brought different data, and the (pipelined, torch) result is the right one
    for key, (_, mags) in BUCKETS.items():
        layout = layouts[key]
        worker_errors = [torch.zeros(layout.padded_numel) for _ in range(P)]
        server_errors = [torch.zeros(layout.chunk_numel) for _ in range(P)]
        for t in range(CALLS):
            records = [results[r]["runs"][("torch", True)][t] for r in range(P)]
            inputs = [rec["inputs"][key] for rec in records]
            assert len({float(x.abs().sum()) for x in inputs}) == P
            expected, worker_errors, server_errors = reference_allreduce(inputs, worker_errors, server_errors, layout)
            server = torch.cat([rec["errors"][key][1] for rec in records])
            _assert_close_per_tensor(server, torch.cat(server_errors), layout, mags, f"{key!r} call {t}: server errors")
            for r, rec in enumerate(records):
                where = f"bucket {key!r}, call {t}, rank {r}"
                _assert_close_per_tensor(rec["outputs"][key], expected, layout, mags, f"{where}: output")
                worker_error = rec["errors"][key][0]
                _assert_close_per_tensor(worker_error, worker_errors[r], layout, mags, f"{where}: worker error")
    # the all-zero tensor of bucket ("zeros", 1) is sent with scale 0: its part of the result is exactly zero
    a, b = 64, 64 + 130
    for r in range(P):
        for t in range(CALLS):
            assert bool((results[r]["runs"][("torch", True)][t]["outputs"][("zeros", 1)][a:b] == 0).all())


@pytest.mark.parametrize("P", [2, 3])
def test_bad_bucket_raises_on_every_rank_before_any_collective(session, P):
    results = _per_rank(session, P)
    for rank, result in enumerate(results):
        bad = result["bad"]
        assert len(bad["raised"]) == 6
        assert bad["raised"] == {name: "ValueError" for name in bad["raised"]}, (rank, bad["raised"])
        assert bad["collectives"] == {name: 0 for name in bad["raised"]}, (rank, bad["collectives"])
        assert all(bad["buffers_untouched"].values()), (rank, bad["buffers_untouched"])
        assert bad["errors_untouched"], f"rank {rank}: a refused call changed the error feedback"
        assert bad["counters_untouched"], f"rank {rank}: a refused call was counted"
        # the next good call gives what a state that never saw the bad buckets gives, on every rank
        for key in BUCKETS:
            assert same_bits(bad["after"]["state"][key], bad["after"]["control"][key]), (rank, key)
            assert same_bits(bad["after"]["state"][key], results[0]["bad"]["after"]["state"][key]), (rank, key)
