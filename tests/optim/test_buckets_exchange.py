"""The momentum buckets and their exchange (lightning_onebit/optim/buckets.py, laid out by bucket_layout.py)
on their own, without an optimizer: plain tensors stand for the parameters and a plain dict for the optimizer state.

Single process:

* :meth:`MomentumBuckets.runs` packs in parameter order up to ``cap_bytes``, one device and dtype (of the momentum)
  per bucket; a plan's buckets come first with their own keys, the packed rest after the largest of them;
* :func:`checked_plan` drops untrainable parameters and emptied buckets, refuses mixed dtypes and a parameter named
  twice; :func:`same_plan` compares by identity;
* :meth:`MomentumBuckets.build` turns every ``state[p]["exp_avg"]`` into a view of its bucket's zero-padded flat buffer
  holding the old values, and groups its parameters by ``beta1`` for the fold; :meth:`MomentumBuckets.fits` follows
  the trainable set, the world size and the plan;
  :meth:`MomentumBucket.state_buffer` does the same for another state name;
* :func:`feedback_key` and :func:`stream_of` are inverse (the momentum stream keeps bare bucket keys).

Two gloo ranks, one spawn (tests/distributed.py):

* :class:`MomentumExchange`: buckets started one by one with a ``fill`` (the gradient folded into the momentum),
  advanced, taken and finished with the rest give, over two steps (so with error feedback), the same bits, outputs and
  error feedback alike, as one :func:`compressed_allreduce_buckets_` call of a fresh state on the same inputs, on
  every rank; so does :meth:`MomentumExchange.average_`, and another stream's error feedback stays its own;
* :func:`carry_error_feedback_` moves every coordinate's worker error (per rank) and server error (the chunks of all
  ranks together) from one bucket grouping to another exactly, for every stream, counts dropped parameters and stale
  buffers, and returns ``None`` (building nothing) when there is no error feedback of the old layout.
"""

from __future__ import annotations

from typing import Any

import pytest
import torch

from lightning_onebit.comm import (
    BucketLayout,
    CompressedAllreduceState,
    ExchangePhase,
    compressed_allreduce_buckets_,
)
from lightning_onebit.optim.buckets import (
    MomentumBucket,
    MomentumBuckets,
    MomentumExchange,
    carry_error_feedback_,
    checked_plan,
    feedback_key,
    same_plan,
    stream_of,
)
from tests.distributed import run_distributed, run_scenarios, scenario_results
from tests.tensors import same_bits, seed_of

WORLD_SIZE = 2
BACKEND = "torch"  # every rank runs the same kernels (the C Adam update is not involved, but keep it deterministic)


def _randn(shape, dtype, *seed: Any) -> torch.Tensor:
    return torch.randn(shape, generator=torch.Generator().manual_seed(seed_of(*seed)), dtype=torch.float64).to(dtype)


def _params(specs) -> list[torch.Tensor]:
    """Plain tensors standing for parameters (only their identity, shape, dtype and device matter)."""
    return [torch.zeros(shape, dtype=dtype) for shape, dtype in specs]


def _state(params, *seed: Any) -> dict:
    """An optimizer-like per-parameter state holding random momenta."""
    return {p: {"exp_avg": _randn(p.shape, p.dtype, *seed, i)} for i, p in enumerate(params)}


def _nbytes(t: torch.Tensor) -> int:
    return t.numel() * t.element_size()


# ================================================================================================ single process
def test_runs_pack_in_order_up_to_the_cap_one_dtype_per_bucket():
    f32, f64 = torch.float32, torch.float64
    # bytes:      40        80        20       32        24        8
    a, b, c, d, e, f = _params([((10,), f32), ((10,), f64), ((5,), f32), ((8,), f32), ((3,), f64), ((2,), f32)])
    trainable = [a, b, c, d, e, f]
    buckets = MomentumBuckets(cap_bytes=64)
    runs = buckets.runs(trainable, lambda p: p)
    # greedy, per kind in parameter order: a+c = 60 <= 64, +d would be 92; d+f = 40; b alone is over the cap already
    # (a bucket takes at least one tensor); b+e = 104 > 64. Kinds in order of first appearance, keys from 0.
    assert [(k, [id(p) for p in ps]) for k, ps in runs] == [
        (0, [id(a), id(c)]), (1, [id(d), id(f)]), (2, [id(b)]), (3, [id(e)])
    ]
    for _, ps in runs:
        assert len({(p.device, p.dtype) for p in ps}) == 1, "float32 and float64 momenta share a bucket"
        assert len(ps) == 1 or sum(map(_nbytes, ps)) <= buckets.cap_bytes
    # per kind, concatenating the buckets gives the parameters in order, each exactly once
    for dtype in (f32, f64):
        packed = [id(p) for _, ps in runs for p in ps if p.dtype == dtype]
        assert packed == [id(p) for p in trainable if p.dtype == dtype]

    # the momentum decides the kind and the size, not the parameter: d's momentum in float64 (64 bytes) leaves the
    # float32 run, so f follows a + c (68 > 64: a bucket of its own); b, d, e are each over the cap with the one before
    momenta = {id(p): p for p in trainable} | {id(d): torch.zeros(8, dtype=f64)}
    runs = buckets.runs(trainable, lambda p: momenta[id(p)])
    assert [[id(p) for p in ps] for _, ps in runs] == [[id(a), id(c)], [id(f)], [id(b)], [id(d)], [id(e)]]

    # a larger cap packs each kind into one bucket
    runs = MomentumBuckets(cap_bytes=10**6).runs(trainable, lambda p: p)
    assert [[id(p) for p in ps] for _, ps in runs] == [[id(a), id(c), id(d), id(f)], [id(b), id(e)]]


def test_runs_put_the_plan_first_then_pack_the_rest_after_its_keys():
    f32, f64 = torch.float32, torch.float64
    a, b, c, d, e, f, frozen = _params(
        [((10,), f32), ((10,), f64), ((5,), f32), ((8,), f32), ((3,), f64), ((2,), f32), ((4,), f32)]
    )
    trainable = [a, b, c, d, e, f]
    buckets = MomentumBuckets(cap_bytes=64)
    # bucket 1 is emptied (only an untrainable parameter): its key is not reused, bucket 2 keeps key 2
    buckets.plan = checked_plan([[c, a], [frozen], [f]], {id(p) for p in trainable})
    runs = buckets.runs(trainable, lambda p: p)
    keys = [k for k, _ in runs]
    assert [(k, [id(p) for p in ps]) for k, ps in runs[:2]] == [(0, [id(c), id(a)]), (2, [id(f)])]
    # the rest (b, d, e) packed as without a plan, kinds in order of first appearance (b: float64 first), keys after
    # the largest plan key
    assert [[id(p) for p in ps] for _, ps in runs[2:]] == [[id(b)], [id(e)], [id(d)]]
    assert keys[2:] == [3, 4, 5]
    assert len(set(keys)) == len(keys)
    # every trainable parameter exactly once
    assert sorted(id(p) for _, ps in runs for p in ps) == sorted(map(id, trainable))
    # planned parameters that are no longer trainable leave their bucket, the rest of the plan stays as it was
    runs = buckets.runs([a, b, d, e, f], lambda p: p)
    assert [(k, [id(p) for p in ps]) for k, ps in runs[:2]] == [(0, [id(a)]), (2, [id(f)])]


def test_checked_plan_drops_untrainable_and_empty_buckets_and_refuses_bad_ones():
    f32, f64 = torch.float32, torch.float64
    a, b, c, frozen, wide = _params([((3,), f32), ((4,), f32), ((5,), f32), ((6,), f32), ((2,), f64)])
    trainable = {id(a), id(b), id(c)}
    assert checked_plan(None, trainable) is None
    plan = checked_plan([[frozen], [b, frozen, a], [], [c]], trainable)
    assert [(k, [id(p) for p in ps]) for k, ps in plan] == [(1, [id(b), id(a)]), (3, [id(c)])]
    # an untrainable parameter of another dtype is dropped before the check
    assert [k for k, _ in checked_plan([[a, wide]], trainable)] == [0]
    with pytest.raises(ValueError, match="mixes devices or dtypes"):
        checked_plan([[a], [b, wide]], trainable | {id(wide)})
    with pytest.raises(ValueError, match="earlier bucket holds"):
        checked_plan([[a, b], [c, a]], trainable)
    # same_plan: keys and parameters by identity, in order
    assert same_plan(plan, checked_plan([[frozen], [b, a], [], [c]], trainable))
    assert not same_plan(plan, checked_plan([[b, a], [c]], trainable))  # other keys
    assert not same_plan(plan, checked_plan([[], [a, b], [], [c]], trainable))  # other order
    equal_values = torch.zeros(3)  # equal values, another tensor
    assert not same_plan([(0, [a])], [(0, [equal_values])])
    assert same_plan(None, None) and not same_plan(None, plan) and not same_plan([], None)


def test_checked_plan_refuses_a_parameter_named_twice_in_one_bucket():
    a, b = _params([((3,), torch.float32), ((4,), torch.float32)])
    with pytest.raises(ValueError):
        checked_plan([[a, b, a]], {id(a), id(b)})


def test_build_makes_the_momenta_views_of_zero_padded_flat_buffers():
    f32, f64 = torch.float32, torch.float64
    params = _params([((2, 3), f32), ((4,), f64), ((5,), f32), ((1, 7), f32)])
    state = _state(params, "build")
    before = {id(p): state[p]["exp_avg"].clone() for p in params}
    beta1 = {id(p): b for p, b in zip(params, (0.9, 0.9, 0.8, 0.9))}
    buckets = MomentumBuckets(cap_bytes=10**6)
    built_for = buckets.inputs(params, WORLD_SIZE)
    assert not buckets.fits(built_for)  # nothing built yet
    built = buckets.build(params, state, beta1, WORLD_SIZE)

    assert buckets.built is built and buckets.fits(built_for)
    assert buckets.by_key == {b.key: b for b in built}
    assert buckets.bucketed_ids == {id(p) for p in params}
    assert [[id(p) for p in b.params] for b in built] == [[id(p) for p in ps] for _, ps in buckets.runs(
        params, lambda p: state[p]["exp_avg"])]
    for bucket in built:
        layout = bucket.layout
        assert layout.tensor_numels == tuple(p.numel() for p in bucket.params)
        assert layout.world_size == WORLD_SIZE and layout.padded_numel % (8 * WORLD_SIZE) == 0
        assert bucket.flat.shape == (layout.padded_numel,) and bucket.flat.dtype == bucket.params[0].dtype
        assert bool((bucket.flat[layout.numel :] == 0).all()), "the padding must be zero"
        offset = 0
        for p in bucket.params:
            view = state[p]["exp_avg"]
            assert view.shape == p.shape and view.dtype == p.dtype
            assert torch.equal(view, before[id(p)]), "the momentum lost its value"
            assert torch.equal(bucket.flat[offset : offset + p.numel()], before[id(p)].reshape(-1))
            offset += p.numel()
        # the momenta are views: writing the flat buffer writes them
        bucket.flat.add_(1)
        for p in bucket.params:
            assert torch.equal(state[p]["exp_avg"], before[id(p)] + 1)
        bucket.flat.sub_(1)
    # one fold group per distinct beta1, indices into the bucket's parameters
    mixed = next(b for b in built if len(b.params) == 3)
    assert sorted(mixed.fold_groups) == [(0.8, [1]), (0.9, [0, 2])]

    # a rebuild is due when the trainable set, the world size or the plan changes
    assert buckets.fits(buckets.inputs(params, WORLD_SIZE))
    assert not buckets.fits(buckets.inputs(params[:-1], WORLD_SIZE))
    assert not buckets.fits(buckets.inputs(params[::-1], WORLD_SIZE))
    assert not buckets.fits(buckets.inputs(params, WORLD_SIZE + 1))
    buckets.plan = checked_plan([params[:1]], {id(p) for p in params})
    assert not buckets.fits(buckets.inputs(params, WORLD_SIZE))
    empty_for = buckets.inputs([], WORLD_SIZE)
    assert buckets.built_empty(WORLD_SIZE) == [] and buckets.fits(empty_for) and buckets.by_key == {}
    assert buckets.bucketed_ids == set()


def test_state_buffer_lays_another_state_out_like_the_momenta():
    params = _params([((2, 3), torch.float32), ((5,), torch.float32), ((4,), torch.float32)])
    state = _state(params, "state_buffer")
    old_sq = {id(p): _randn(p.shape, p.dtype, "sq", i) for i, p in enumerate(params)}
    for p in params[::2]:  # the middle parameter has none yet: zeros
        state[p]["exp_avg_sq"] = old_sq[id(p)].clone()
    buckets = MomentumBuckets(cap_bytes=10**6)
    (bucket,) = buckets.build(params, state, {id(p): 0.9 for p in params},
                              WORLD_SIZE)
    flat = bucket.state_buffer("exp_avg_sq", state)
    assert flat.shape == bucket.flat.shape and flat.dtype == bucket.flat.dtype
    assert flat.data_ptr() != bucket.flat.data_ptr()
    assert bool((flat[bucket.layout.numel :] == 0).all())
    offset = 0
    for i, p in enumerate(params):
        expected = old_sq[id(p)] if i != 1 else torch.zeros_like(p)
        assert torch.equal(state[p]["exp_avg_sq"], expected)
        assert torch.equal(flat[offset : offset + p.numel()], expected.reshape(-1))
        offset += p.numel()
    flat.mul_(2)
    for i, p in enumerate(params):
        assert torch.equal(state[p]["exp_avg_sq"], 2 * (old_sq[id(p)] if i != 1 else torch.zeros_like(p)))
    # made once: a second call returns the same buffer, the momenta are left alone
    assert bucket.state_buffer("exp_avg_sq", state) is flat and bucket.extra == {"exp_avg_sq": flat}
    assert state[params[0]]["exp_avg"].data_ptr() == bucket.flat.data_ptr()


def test_feedback_key_and_stream_of_round_trip():
    assert feedback_key("momentum", 3) == 3 and stream_of(3) == "momentum"
    for stream in ("momentum", "gradient", "update"):
        for key in (0, 1, 17):
            fkey = feedback_key(stream, key)
            assert stream_of(fkey) == stream
            assert fkey == (key if stream == "momentum" else (stream, key))
    assert len({feedback_key(s, 0) for s in ("momentum", "gradient", "update")}) == 3


# ================================================================================================ two gloo ranks
# The exchanged momenta: mixed shapes, one float64 parameter (a bucket of its own), two fold weights.
EXCHANGE_SPECS = [((3, 5), torch.float32), ((7,), torch.float32), ((40,), torch.float32), ((2, 2, 2), torch.float64),
                  ((100,), torch.float32), ((9,), torch.float32)]
EXCHANGE_CAP = 200  # bytes: buckets [0, 1], [2], [4], [5] (float32) and [3] (float64)
BETA1 = (0.9, 0.95, 0.9, 0.9, 0.95, 0.9)
# per step: the buckets started "during backward", in start order; the others are finished with them
STARTED = ([0, 4, 2], [3, 1])


def _fold(bucket: MomentumBucket, state: dict, grads: dict[int, torch.Tensor]) -> None:
    """What the optimizer's fill does: ``m = lerp(m, g, 1 - beta1)`` per fold group."""
    for beta1, indices in bucket.fold_groups:
        torch._foreach_lerp_(
            [state[bucket.params[i]]["exp_avg"] for i in indices], [grads[id(bucket.params[i])] for i in indices],
            1 - beta1,
        )


def _momentum_buckets(params, rank: int) -> tuple[dict, MomentumBuckets]:
    """Buckets over ``params`` holding this rank's initial momenta (the same on every call)."""
    state = _state(params, "momentum", rank)
    buckets = MomentumBuckets(EXCHANGE_CAP)
    buckets.build(params, state, {id(p): b for p, b in zip(params, BETA1)}, WORLD_SIZE)
    return state, buckets


def _grads(params, rank: int, step: int) -> dict[int, torch.Tensor]:
    return {id(p): _randn(p.shape, p.dtype, "grad", rank, step, i) for i, p in enumerate(params)}


def _record(compression: CompressedAllreduceState, buckets: MomentumBuckets, state: dict, params) -> dict:
    offsets = {}
    for b in buckets.built:
        offset = 0
        for p in b.params:
            offsets[id(p)] = (b, offset)
            offset += p.numel()
    return dict(
        flats={b.key: b.flat.clone() for b in buckets.built},
        errors=compression.error_feedback_state_dict()["buckets"],
        counters=dict(bytes_sent=compression.counters.bytes_sent, collectives=compression.counters.collectives,
                      calls=compression.counters.calls),
        # the momenta are still views of the flat buffers, now holding the average
        views_kept=all(
            state[p]["exp_avg"].data_ptr() == offsets[id(p)][0].flat[offsets[id(p)][1] :].data_ptr() for p in params
        ),
    )


def _scenario_exchange(rank: int, world_size: int, workdir: str) -> dict[str, Any]:
    assert world_size == WORLD_SIZE
    params = _params(EXCHANGE_SPECS)
    out: dict[str, Any] = {}

    # the reference: a fresh state, every bucket folded and reduced in one compressed_allreduce_buckets_ call
    reference = CompressedAllreduceState(None, BACKEND)
    state, buckets = _momentum_buckets(params, rank)
    out["keys"] = [b.key for b in buckets.built]
    out["layouts"] = [b.layout.tensor_numels for b in buckets.built]
    out["initial"] = {b.key: b.flat.clone() for b in buckets.built}
    out["reference"] = []
    for step in range(len(STARTED)):
        grads = _grads(params, rank, step)
        for b in buckets.built:
            _fold(b, state, grads)
        out.setdefault("folded", []).append({b.key: b.flat.clone() for b in buckets.built})
        compressed_allreduce_buckets_(reference, [(b.key, b.flat, b.layout) for b in buckets.built])
        out["reference"].append(_record(reference, buckets, state, params))

    # the exchange: some buckets started one by one (fill, start, advance), the rest finished with them;
    # with second-phase groups of its own (progress advances) and without (progress does nothing)
    for gather_groups in (True, False):
        compression = CompressedAllreduceState(None, BACKEND)
        if gather_groups:
            compression.create_gather_groups()
        exchange = MomentumExchange(compression)
        state, buckets = _momentum_buckets(params, rank)
        steps = []
        for step, started_keys in enumerate(STARTED):
            grads = _grads(params, rank, step)
            trace: dict[str, Any] = dict(in_flight=[], started=[], phases=[])
            for key in started_keys:
                bucket = buckets.by_key[key]
                exchange.start_(bucket, lambda b=bucket: _fold(b, state, grads))
                trace["in_flight"].append(exchange.in_flight)
                trace["started"].append({k: exchange.started(k) for k in buckets.by_key})
                trace["phases"].append([p.phase for p in exchange._pending])
            exchange.progress()
            trace["phases_after_progress"] = [p.phase for p in exchange._pending]
            exchange.join_side_stream()
            taken = exchange.take_started()
            trace["taken_keys"] = [p.key for p in taken]
            trace["taken_buffers_are_flats"] = all(p.buffer is buckets.by_key[p.key].flat for p in taken)
            trace["in_flight_after_take"] = exchange.in_flight
            trace["started_after_take"] = [k for k in buckets.by_key if exchange.started(k)]
            trace["take_again"] = len(exchange.take_started())
            rest = [b for b in buckets.built if b.key not in started_keys]
            for b in rest:
                _fold(b, state, grads)
            exchange.finish_(taken, rest)
            trace["all_done"] = all(p.done for p in taken)
            steps.append(_record(compression, buckets, state, params) | trace)
        out[("exchange", gather_groups)] = dict(steps=steps, hook_s=compression.counters.hook_s,
                                                exposed_s=compression.counters.exposed_s)

    # average_: every bucket folded, then reduced in the step
    compression = CompressedAllreduceState(None, BACKEND)
    exchange = MomentumExchange(compression)
    state, buckets = _momentum_buckets(params, rank)
    steps = []
    for step in range(len(STARTED)):
        grads = _grads(params, rank, step)
        for b in buckets.built:
            _fold(b, state, grads)
        exchange.average_([(b.key, b.flat, b.layout) for b in buckets.built])
        steps.append(_record(compression, buckets, state, params))
    # another stream on the same state: its error feedback is its own (a fresh state gives the same bits)
    other = {b.key: b.state_buffer("grad_sum", state) for b in buckets.built}
    for b in buckets.built:
        other[b.key].copy_(torch.cat([_randn(p.numel(), p.dtype, "other", rank, i) for i, p in enumerate(b.params)]
                                     + [other[b.key].new_zeros(b.layout.padded_numel - b.layout.numel)]))
    other_inputs = {k: v.clone() for k, v in other.items()}
    exchange.average_([(feedback_key("gradient", b.key), other[b.key], b.layout) for b in buckets.built])
    fresh = CompressedAllreduceState(None, BACKEND)
    other_reference = {k: v.clone() for k, v in other_inputs.items()}
    compressed_allreduce_buckets_(fresh, [(feedback_key("gradient", b.key), other_reference[b.key], b.layout)
                                          for b in buckets.built])
    out["average"] = dict(
        steps=steps,
        hook_s=compression.counters.hook_s,
        exposed_s=compression.counters.exposed_s,
        other=other,
        other_inputs=other_inputs,
        other_reference=other_reference,
        other_errors=compression.error_feedback_state_dict()["buckets"],
        other_reference_errors=fresh.error_feedback_state_dict()["buckets"],
    )
    return out


# carry_error_feedback_: the same parameters in two groupings (and a third without one of them)
CARRY_SPECS = [((5, 3), torch.float32), ((11,), torch.float32), ((4, 4), torch.float32), ((30,), torch.float32),
               ((2,), torch.float32)]
OLD_GROUPING = [[0, 1, 2], [3, 4]]
NEW_GROUPING = [[3, 0], [4], [2, 1]]
DROPPED = 1  # left out of the third layout (packed by size)
STREAMS = ("momentum", "gradient")


def _describe(buckets: list[MomentumBucket], params) -> list[tuple[int, list[int], tuple[int, ...]]]:
    """``(key, parameter indices, tensor sizes)`` per bucket."""
    index = {id(p): i for i, p in enumerate(params)}
    return [(b.key, [index[id(p)] for p in b.params], b.layout.tensor_numels) for b in buckets]


def _laid_out(grouping, params, state) -> tuple[MomentumBuckets, Any, list[int]]:
    """Buckets over ``params`` in ``grouping`` (a plan of parameter indices; ``None``: packed by size, without
    parameter ``DROPPED``), the ``build_new`` that builds them, and the list its calls are counted in."""
    buckets = MomentumBuckets(cap_bytes=10**6)
    trainable = params if grouping is not None else [p for i, p in enumerate(params) if i != DROPPED]
    if grouping is not None:
        buckets.plan = checked_plan([[params[i] for i in g] for g in grouping], {id(p) for p in params})
    calls: list[int] = []

    def build() -> list[MomentumBucket]:
        calls.append(1)
        return buckets.build(trainable, state,
                             {id(p): 0.9 for p in trainable}, WORLD_SIZE)

    return buckets, build, calls


def _scenario_carry(rank: int, world_size: int, workdir: str) -> dict[str, Any]:
    assert world_size == WORLD_SIZE
    params = _params(CARRY_SPECS)
    state = _state(params, "carry", rank)
    out: dict[str, Any] = {}

    # no error feedback at all: None, nothing built
    compression = CompressedAllreduceState(None, BACKEND)
    _, build_old, _ = _laid_out(OLD_GROUPING, params, state)
    old = build_old()
    _, build_new, calls = _laid_out(NEW_GROUPING, params, state)
    out["none_fresh"] = dict(result=carry_error_feedback_(compression, old, build_new), built=len(calls))
    # error feedback of another layout only (unknown keys, or a known key with other sizes): None, and reset
    like = old[0].flat
    compression.buffers(("gradient", 7), BucketLayout.build([3], WORLD_SIZE), like).worker_error.fill_(1)
    compression.buffers(("update", 0), BucketLayout.build([5], WORLD_SIZE), like).server_error.fill_(1)
    out["none_stale"] = dict(result=carry_error_feedback_(compression, old, build_new), built=len(calls),
                             left=list(compression.error_feedback_state_dict()["buckets"]))

    # one exchange of each stream in the old layout, plus two stale buffers
    compression = CompressedAllreduceState(None, BACKEND)
    compressed_allreduce_buckets_(compression, [(feedback_key("momentum", b.key), b.flat, b.layout) for b in old])
    grads = []
    for b in old:
        g = b.state_buffer("grad", state)
        g[: b.layout.numel].copy_(_randn(b.layout.numel, g.dtype, "carry grad", rank, b.key))
        grads.append((feedback_key("gradient", b.key), g, b.layout))
    compressed_allreduce_buckets_(compression, grads)
    compression.buffers(("gradient", 7), BucketLayout.build([3], WORLD_SIZE), like)
    compression.buffers(("update", 0), BucketLayout.build([5], WORLD_SIZE), like)
    out["old"] = dict(layout=_describe(old, params), errors=compression.error_feedback_state_dict()["buckets"])

    # into another grouping of the same parameters
    _, build_new, calls = _laid_out(NEW_GROUPING, params, state)
    new, lost, stale = carry_error_feedback_(compression, old, build_new)
    out["new"] = dict(layout=_describe(new, params), errors=compression.error_feedback_state_dict()["buckets"],
                      lost=lost, stale=stale, built=len(calls))

    # and into a layout without one parameter (packed by size): its error is dropped and counted
    _, build_third, calls = _laid_out(None, params, state)
    third, lost, stale = carry_error_feedback_(compression, new, build_third)
    out["third"] = dict(layout=_describe(third, params), errors=compression.error_feedback_state_dict()["buckets"],
                        lost=lost, stale=stale, built=len(calls))
    return out


SCENARIOS = (("exchange", _scenario_exchange), ("carry", _scenario_carry))


@pytest.fixture(scope="module")
def session(tmp_path_factory: pytest.TempPathFactory) -> list[dict]:
    # one spawn for every multi-rank test (process start-up is the slow part)
    return run_distributed(run_scenarios, WORLD_SIZE, SCENARIOS, str(tmp_path_factory.mktemp("buckets")),
                           timeout_s=240)


def _assert_same_errors(actual: dict, expected: dict, where: str) -> None:
    assert set(actual) == set(expected), where
    for key in expected:
        assert tuple(actual[key]["layout"]) == tuple(expected[key]["layout"]), (where, key)
        for which in ("worker_error", "server_error"):
            assert same_bits(actual[key][which], expected[key][which]), f"{where}: bucket {key!r} {which}"


def _assert_same_step(actual: dict, expected: dict, where: str) -> None:
    assert set(actual["flats"]) == set(expected["flats"]), where
    for key, flat in expected["flats"].items():
        assert same_bits(actual["flats"][key], flat), f"{where}: bucket {key} differs from the reference"
    _assert_same_errors(actual["errors"], expected["errors"], where)
    assert actual["counters"] == expected["counters"], where
    assert actual["views_kept"], f"{where}: a momentum is no longer a view of its bucket"


def test_reference_is_a_real_exchange(session):
    """Sanity of the comparison: every rank brought different momenta, the average changed them, left the padding
    zero and is identical on both ranks, and there is error feedback for the second step to use."""
    results = scenario_results(session, "exchange")
    assert results[0]["keys"] == [0, 1, 2, 3, 4] and results[0]["layouts"] == results[1]["layouts"]
    for step in range(len(STARTED)):
        for key in results[0]["keys"]:
            folded = [r["folded"][step][key] for r in results]
            averaged = [r["reference"][step]["flats"][key] for r in results]
            assert not torch.equal(folded[0], folded[1])
            assert same_bits(averaged[0], averaged[1]), f"step {step} bucket {key}: ranks differ"
            assert not torch.equal(averaged[0], folded[0]) and not torch.equal(averaged[1], folded[1])
            numel = sum(results[0]["layouts"][key])
            assert bool((averaged[0][numel:] == 0).all())
        errors = results[0]["reference"][step]["errors"]
        assert set(errors) == set(results[0]["keys"])
        assert all(float(e["worker_error"].abs().sum()) > 0 for e in errors.values())


@pytest.mark.parametrize("gather_groups", [True, False], ids=["gather_groups", "no_gather_groups"])
def test_exchange_started_progressed_and_finished_equals_one_pipelined_call(session, gather_groups):
    results = scenario_results(session, "exchange")
    for rank, result in enumerate(results):
        run = result[("exchange", gather_groups)]
        for step, (started_keys, actual) in enumerate(zip(STARTED, run["steps"])):
            where = f"rank {rank} step {step}"
            _assert_same_step(actual, result["reference"][step], where)
            for key, flat in actual["flats"].items():  # the same on every rank
                assert same_bits(flat, results[0][("exchange", gather_groups)]["steps"][step]["flats"][key]), where
            # bookkeeping of the exchanges in flight
            assert actual["in_flight"] == list(range(1, len(started_keys) + 1)), where
            for n, started in enumerate(actual["started"]):
                assert started == {k: k in started_keys[: n + 1] for k in result["keys"]}, where
            assert actual["taken_keys"] == started_keys, where
            assert actual["taken_buffers_are_flats"], where
            assert actual["in_flight_after_take"] == 0 and actual["started_after_take"] == [], where
            assert actual["take_again"] == 0, where
            assert actual["all_done"], where
            # each start advanced the earlier exchanges (own second-phase groups), progress() all of them
            if gather_groups:
                for n, phases in enumerate(actual["phases"]):
                    assert phases == [ExchangePhase.GATHER] * n + [ExchangePhase.ALL_TO_ALL], where
                assert actual["phases_after_progress"] == [ExchangePhase.GATHER] * len(started_keys), where
            else:
                assert actual["phases_after_progress"] == [ExchangePhase.ALL_TO_ALL] * len(started_keys), where
        assert run["hook_s"] > 0, "the work started during backward is timed as hook_s"
        assert run["exposed_s"] == 0, "finish_ alone is not timed (the caller wraps it in exposed())"


def test_average_equals_one_pipelined_call_and_streams_keep_their_own_error(session):
    results = scenario_results(session, "exchange")
    for rank, result in enumerate(results):
        run = result["average"]
        for step, actual in enumerate(run["steps"]):
            _assert_same_step(actual, result["reference"][step], f"rank {rank} step {step}")
        assert run["exposed_s"] > 0 and run["hook_s"] == 0
        # the "gradient" stream: error feedback keyed ("gradient", key), as a fresh state's, beside the momenta's
        keys = result["keys"]
        assert set(run["other_errors"]) == set(keys) | {("gradient", k) for k in keys}
        _assert_same_errors({k: v for k, v in run["other_errors"].items() if stream_of(k) == "gradient"},
                            run["other_reference_errors"], f"rank {rank}: gradient stream")
        for key in keys:
            assert not torch.equal(run["other"][key], run["other_inputs"][key])
            assert same_bits(run["other"][key], run["other_reference"][key]), f"rank {rank} bucket {key}"
            assert same_bits(run["other"][key], results[0]["average"]["other"][key])


def _per_parameter(errors: list[dict], layout, stream: str) -> dict[int, tuple[list[torch.Tensor], torch.Tensor]]:
    """Parameter index -> (its worker error on each rank, its server error: the ranks' chunks joined), from the
    per-rank ``error_feedback_state_dict()["buckets"]`` of the layout ``[(key, parameter indices, sizes), ...]``.
    Also checks that the padding holds no error."""
    out = {}
    for key, indices, sizes in layout:
        entries = [e[feedback_key(stream, key)] for e in errors]
        assert tuple(entries[0]["layout"][0]) == tuple(sizes)
        workers = [e["worker_error"] for e in entries]
        server = torch.cat([e["server_error"] for e in entries])  # flat: rank r serves chunk r
        assert all(w.numel() == server.numel() for w in workers)
        offset = 0
        for i, n in zip(indices, sizes):
            out[i] = ([w[offset : offset + n] for w in workers], server[offset : offset + n])
            offset += n
        assert all(bool((w[offset:] == 0).all()) for w in workers) and bool((server[offset:] == 0).all())
    return out


def test_carry_error_feedback_moves_every_coordinate_to_the_new_layout(session):
    results = scenario_results(session, "carry")
    old = [r["old"] for r in results]
    new = [r["new"] for r in results]
    third = [r["third"] for r in results]
    n_params = len(CARRY_SPECS)
    assert [ps for _, ps, _ in old[0]["layout"]] == OLD_GROUPING
    assert [ps for _, ps, _ in new[0]["layout"]] == NEW_GROUPING
    assert sorted(i for _, ps, _ in third[0]["layout"] for i in ps) == [i for i in range(n_params) if i != DROPPED]
    for r in range(WORLD_SIZE):
        assert new[r]["built"] == 1 and new[r]["lost"] == 0
        assert new[r]["stale"] == 2, "the buffers of another layout are counted"
        assert third[r]["built"] == 1 and third[r]["lost"] == 1 and third[r]["stale"] == 0
        # the new buffers replace the old ones (stale ones gone), one per stream and new bucket
        for run in (new[r], third[r]):
            assert set(run["errors"]) == {feedback_key(s, k) for s in STREAMS for k, _, _ in run["layout"]}
    for stream in STREAMS:
        before = _per_parameter([o["errors"] for o in old], old[0]["layout"], stream)
        assert sorted(before) == list(range(n_params))
        for i, (workers, _) in before.items():  # the comparison is not vacuous: there is error, per rank
            assert all(float(w.abs().sum()) > 0 for w in workers), (stream, i)
            assert not torch.equal(workers[0], workers[1])
        # server error: a tiny segment can compress without error (equal magnitudes), so per bucket
        for _, indices, _ in old[0]["layout"]:
            assert sum(float(before[i][1].abs().sum()) for i in indices) > 0, (stream, indices)
        for what, runs in (("new", new), ("third", third)):
            after = _per_parameter([x["errors"] for x in runs], runs[0]["layout"], stream)
            expected = [i for i in range(n_params) if what == "new" or i != DROPPED]
            assert sorted(after) == expected
            for i in expected:
                for r in range(WORLD_SIZE):
                    assert same_bits(after[i][0][r], before[i][0][r]), f"{what} {stream} param {i}: rank {r} worker"
                assert same_bits(after[i][1], before[i][1]), f"{what} {stream} param {i}: server error"


def test_carry_error_feedback_without_error_feedback_returns_none(session):
    for rank, result in enumerate(scenario_results(session, "carry")):
        assert result["none_fresh"] == dict(result=None, built=0), rank
        # only buffers of another layout: None, nothing built, and they are reset
        assert result["none_stale"] == dict(result=None, built=0, left=[]), rank
