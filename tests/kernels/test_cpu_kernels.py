"""The native ("cpu") kernels: bit-for-bit equal to the torch reference, dispatch, and the build and its fallbacks.

The compression kernels must give exactly the bits of the torch backend (ranks may run different backends, and the
error feedback of one call feeds the next), so every comparison here is on the raw bytes of the tensors, not on
values within a tolerance. The frozen-Adam update is compared bit for bit with a numpy float32 sequence of correctly
rounded operations, and only within a tolerance with the torch backend (torch's vectorised sqrt is not always
correctly rounded).
"""

from __future__ import annotations

import json
import math
import shutil
import subprocess
import sys
import textwrap
from pathlib import Path
from typing import Optional

import numpy as np
import pytest
import torch

from lightning_onebit import kernels
from lightning_onebit.kernels import Segments, cpu_kernels, native
from tests.paths import ROOT as REPO_ROOT, script_env

BLOCK = 4096  # elements per block of the fused C loops (cpu_native.c)

requires_native = pytest.mark.skipif(
    not cpu_kernels.is_available(), reason="the native CPU kernels did not build here (no working C compiler?)"
)


# ------------------------------------------------------------------------------------------------------- helpers
def raw(t: torch.Tensor) -> torch.Tensor:
    """The bytes of a tensor (so -0.0 differs from +0.0 and NaNs compare by payload)."""
    return t.detach().contiguous().view(torch.uint8)


def assert_same_bits(actual: torch.Tensor, expected: torch.Tensor, what: str) -> None:
    assert actual.dtype == expected.dtype and actual.shape == expected.shape, (
        f"{what}: {actual.dtype}{tuple(actual.shape)} vs {expected.dtype}{tuple(expected.shape)}"
    )
    if torch.equal(raw(actual), raw(expected)):
        return
    if actual.dtype == torch.uint8:
        where = (actual != expected).nonzero().flatten()
    else:
        where = (raw(actual).view(-1, actual.element_size()) != raw(expected).view(-1, actual.element_size()))
        where = where.any(dim=1).nonzero().flatten()
    i = int(where[0])
    pytest.fail(
        f"{what}: {where.numel()} of {actual.numel()} elements differ in their bits; first at [{i}]: "
        f"{actual.flatten()[i].item()!r} vs {expected.flatten()[i].item()!r}"
    )


def lengths_to_offsets(lengths) -> list[int]:
    offsets = [0]
    for n in lengths:
        offsets.append(offsets[-1] + int(n))
    return offsets


def random_lengths(total: int, low: int, high: int, seed: int) -> list[int]:
    """Random segment lengths in [low, high] that add up to ``total`` (the last one may be shorter)."""
    g = torch.Generator().manual_seed(seed)
    lengths, left = [], total
    while left:
        n = min(left, int(torch.randint(low, high + 1, (1,), generator=g)))
        lengths.append(n)
        left -= n
    return lengths


def segmentations(n: int, seed: int) -> dict[str, Segments]:
    """Many ways to cut ``n`` elements (``n`` a multiple of 8) into segments."""
    cases: dict[str, list[int]] = {
        "single": [0, n],
        "lengths_1_to_7": lengths_to_offsets(random_lengths(n, 1, 7, seed)),  # boundaries inside bytes
        "random_short_and_long": lengths_to_offsets(random_lengths(n, 1, 300, seed + 1)),
        "first_last_1": sorted({0, 1, n - 1, n}) if n > 1 else [0, n],
    }
    if n <= 600:
        cases["all_length_1"] = list(range(n + 1))
    if n > BLOCK:
        # segments longer than a block, and boundaries just around the block edges
        cases["longer_than_block"] = lengths_to_offsets(random_lengths(n, BLOCK + 1, 3 * BLOCK, seed + 2))
        edges = {o for k in range(1, n // BLOCK + 1) for o in (k * BLOCK - 1, k * BLOCK, k * BLOCK + 3)}
        cases["around_block_edges"] = sorted({0, n} | {o for o in edges if 0 < o < n})
    return {name: Segments(offsets) for name, offsets in cases.items()}


def per_segment_magnitudes(segments: Segments, seed: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    mags = 10.0 ** (torch.rand(len(segments), generator=g, dtype=torch.float64) * 6 - 3)
    return torch.repeat_interleave(mags, torch.tensor(segments.lengths)).float()


def specials_mixed_in(x: torch.Tensor, seed: int, inf: bool = True) -> torch.Tensor:
    """+0.0, -0.0 (and, with ``inf``, a few +-inf) at random positions; never NaN."""
    g = torch.Generator().manual_seed(seed)
    kind = torch.randint(0, 40, (x.numel(),), generator=g)
    kind[torch.randperm(x.numel(), generator=g)[:4]] = torch.arange(4)[: x.numel()]  # each special at least once
    x = x.clone()
    x[kind == 0] = 0.0
    x[kind == 1] = -0.0
    if inf:
        x[kind == 2] = math.inf
        x[kind == 3] = -math.inf
    return x


def compress_inputs(segments: Segments, seed: int, zero_segment: bool, special: bool, inf: bool = True):
    n = segments.total
    g = torch.Generator().manual_seed(seed)
    mags = per_segment_magnitudes(segments, seed + 1)
    x = torch.randn(n, generator=g) * mags
    error = torch.randn(n, generator=g) * mags * 0.5
    if special:
        x = specials_mixed_in(x, seed + 2, inf=inf)
        error = specials_mixed_in(error, seed + 3, inf=False)
    if zero_segment and len(segments) > 1:
        a, b = segments.bounds[len(segments) // 2]
        x[a:b] = 0.0
        error[a:b] = 0.0
    return x, error


# ------------------------------------------------------------------------------------------------------- compression
# Multiples of 8 but (except 4096) not of 32: the scalar tails after the AVX2 loops (4 bytes = 32 elements per step).
COMPRESS_SIZES = [8, 16, 24, 40, 56, 72, 200, 1000, 4096, 4104, 3 * BLOCK + 8 * 5, 20008]


@requires_native
@pytest.mark.parametrize("n", COMPRESS_SIZES)
@pytest.mark.parametrize("data", ["plain", "zero_segment", "specials"])
def test_compress_with_error_feedback_bits_equal_torch(n, data):
    checked = 0
    for name, segments in segmentations(n, seed=n).items():
        x, error = compress_inputs(segments, seed=7 * n + len(segments), zero_segment=data == "zero_segment",
                                   special=data == "specials")
        x_before = x.clone()
        e_cpu, e_torch = error.clone(), error.clone()
        s_cpu, p_cpu = kernels.compress_with_error_feedback(x, e_cpu, segments, backend="cpu")
        s_torch, p_torch = kernels.compress_with_error_feedback(x, e_torch, segments, backend="torch")
        where = f"n={n} {name} ({len(segments)} segments)"
        assert_same_bits(x, x_before, f"{where}: x must not be modified")
        assert_same_bits(s_cpu, s_torch, f"{where}: scales")
        assert_same_bits(p_cpu, p_torch, f"{where}: packed")
        assert_same_bits(e_cpu, e_torch, f"{where}: error")
        # and both are the right answer: numpy's bits of y = x + error
        y = (x_before + error).numpy()
        np.testing.assert_array_equal(p_cpu.numpy(), np.packbits(y >= 0), err_msg=where)
        if data == "zero_segment" and len(segments) > 1:
            k = len(segments) // 2
            a, b = segments.bounds[k]
            assert float(s_cpu[k]) == 0.0, where
            assert bool((e_cpu[a:b] == 0).all()), where
        if data == "specials":
            assert bool((x == math.inf).any()) and bool((x == -math.inf).any()), where
            assert bool(torch.signbit(x[x == 0]).any()) and bool((~torch.signbit(x[x == 0])).any()), where
        checked += 1
    assert checked >= 4


@requires_native
@pytest.mark.parametrize("n", [8, 24, 1000, 4104, 12296])
def test_compress_in_place_bits_equal_torch(n):
    for name, segments in segmentations(n, seed=n + 1).items():
        x, _ = compress_inputs(segments, seed=3 * n + len(segments), zero_segment=True, special=True, inf=False)
        y_cpu, y_torch = x.clone(), x.clone()
        packed_out = torch.full((n // 8,), 0xA5, dtype=torch.uint8)
        s_cpu, p_cpu = kernels.compress_in_place(y_cpu, segments, packed_out=packed_out, backend="cpu")
        s_torch, p_torch = kernels.compress_in_place(y_torch, segments, backend="torch")
        assert p_cpu.data_ptr() == packed_out.data_ptr(), "packed_out must be written and returned"
        assert_same_bits(s_cpu, s_torch, f"n={n} {name}: scales")
        assert_same_bits(p_cpu, p_torch, f"n={n} {name}: packed")
        assert_same_bits(y_cpu, y_torch, f"n={n} {name}: compression error left in y")
        assert not torch.equal(raw(y_cpu), raw(x)), "y must be modified in place"


@requires_native
@pytest.mark.parametrize("n", [40, 1000, 8200])
def test_error_feedback_identical_over_ten_calls(n):
    for name, segments in segmentations(n, seed=n + 2).items():
        e_cpu = torch.zeros(n)
        e_torch = torch.zeros(n)
        for t in range(10):
            x, _ = compress_inputs(segments, seed=1000 * t + n, zero_segment=t % 3 == 0, special=True, inf=False)
            s_cpu, p_cpu = kernels.compress_with_error_feedback(x, e_cpu, segments, backend="cpu")
            s_torch, p_torch = kernels.compress_with_error_feedback(x, e_torch, segments, backend="torch")
            where = f"n={n} {name} call {t}"
            assert_same_bits(s_cpu, s_torch, f"{where}: scales")
            assert_same_bits(p_cpu, p_torch, f"{where}: packed")
            assert_same_bits(e_cpu, e_torch, f"{where}: error")
        if max(segments.lengths) > 1:  # (a one-element segment is sent exactly: no error)
            assert float(e_cpu.abs().max()) > 0, f"{name}: the error feedback must carry something over"


@requires_native
def test_segment_of_inf_gives_identical_bits():
    """A segment holding +-inf has an infinite scale; its error becomes inf - inf = NaN and -+inf on both backends."""
    segments = Segments([0, 5, 16, 37, 40, 48])
    x = torch.randn(48, generator=torch.Generator().manual_seed(1))
    x[7], x[20] = math.inf, -math.inf
    e_cpu, e_torch = torch.zeros(48), torch.zeros(48)
    s_cpu, p_cpu = kernels.compress_with_error_feedback(x, e_cpu, segments, backend="cpu")
    s_torch, p_torch = kernels.compress_with_error_feedback(x, e_torch, segments, backend="torch")
    assert math.isinf(float(s_cpu[1])) and math.isinf(float(s_cpu[2]))
    assert_same_bits(s_cpu, s_torch, "scales")
    assert_same_bits(p_cpu, p_torch, "packed")
    assert bool(torch.isnan(e_cpu[7])) and bool(torch.isnan(e_torch[7]))
    assert_same_bits(e_cpu, e_torch, "error (NaN from inf - inf included)")


@requires_native
@pytest.mark.parametrize("n", [16, 1000, 8200])
def test_nan_gives_nan_scale_and_identical_packed_bytes(n):
    for name, segments in segmentations(n, seed=n + 3).items():
        x, error = compress_inputs(segments, seed=n, zero_segment=False, special=True, inf=False)
        k = len(segments) // 2
        a, b = segments.bounds[k]
        nan_at = (a + b) // 2
        x[nan_at] = math.nan
        e_cpu, e_torch = error.clone(), error.clone()
        s_cpu, p_cpu = kernels.compress_with_error_feedback(x, e_cpu, segments, backend="cpu")
        s_torch, p_torch = kernels.compress_with_error_feedback(x, e_torch, segments, backend="torch")
        where = f"n={n} {name}"
        assert math.isnan(float(s_cpu[k])) and math.isnan(float(s_torch[k])), where
        others = torch.ones(len(segments), dtype=torch.bool)
        others[k] = False
        assert not bool(torch.isnan(s_cpu[others]).any()), where
        assert_same_bits(s_cpu[others], s_torch[others], f"{where}: scales of the other segments")
        assert_same_bits(p_cpu, p_torch, f"{where}: packed")
        assert (int(p_cpu[nan_at // 8]) >> (7 - nan_at % 8)) & 1 == 0, "NaN packs as bit 0 (NaN >= 0 is false)"
        outside = torch.ones(n, dtype=torch.bool)
        outside[a:b] = False
        assert_same_bits(e_cpu[outside], e_torch[outside], f"{where}: error outside the NaN segment")
        assert bool(torch.isnan(e_cpu[a:b]).all()) and bool(torch.isnan(e_torch[a:b]).all()), where


# ------------------------------------------------------------------------------------------------------- decompress
def random_scales(count: int, seed: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    scales = (10.0 ** (torch.rand(count, generator=g, dtype=torch.float64) * 8 - 4)).float()
    specials = torch.tensor([0.0, math.inf, 1e-40, 3.0e38])  # zero, inf, subnormal, near the float32 maximum
    take = torch.randint(0, 6, (count,), generator=g)
    for i, value in enumerate(specials):
        scales[take == i] = value
    return scales


def arbitrary_contents(n: int, seed: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    out = torch.randn(n, generator=g) * 10.0 ** torch.randint(-3, 4, (n,), generator=g)
    return specials_mixed_in(out, seed + 1, inf=True)


@requires_native
@pytest.mark.parametrize("n", [8, 24, 56, 1000, 4104, 12296])
@pytest.mark.parametrize("accumulate", [False, True])
def test_decompress_bits_equal_torch(n, accumulate):
    extra = 24
    for name, segments in segmentations(n, seed=n + 4).items():
        g = torch.Generator().manual_seed(n + len(segments))
        packed = torch.randint(0, 256, (n // 8,), generator=g, dtype=torch.uint8)
        scales = random_scales(len(segments), seed=n + len(segments))
        prior = arbitrary_contents(n + extra, seed=n)
        out_cpu, out_torch = prior.clone(), prior.clone()
        r_cpu = kernels.decompress(packed, scales, segments, out_cpu, accumulate=accumulate, backend="cpu")
        kernels.decompress(packed, scales, segments, out_torch, accumulate=accumulate, backend="torch")
        assert r_cpu.data_ptr() == out_cpu.data_ptr()
        where = f"n={n} {name} accumulate={accumulate}"
        assert_same_bits(out_cpu, out_torch, where)
        if accumulate:
            assert_same_bits(out_cpu[n:], prior[n:], f"{where}: past segments.total, left alone")
        else:
            assert_same_bits(out_cpu[n:], torch.zeros(extra), f"{where}: past segments.total, zeroed (+0.0)")
            # the values themselves: +-scale from the bits
            signs = torch.from_numpy(np.unpackbits(packed.numpy()).astype(np.float32) * 2 - 1)
            per_element = torch.repeat_interleave(scales, torch.tensor(segments.lengths))
            expected = torch.where(signs > 0, per_element, -per_element)
            assert_same_bits(out_cpu[:n], expected, f"{where}: values")


# ------------------------------------------------------------------------------------------------------- mean of signs
@requires_native
@pytest.mark.parametrize("sources", [1, 2, 3, 5])
@pytest.mark.parametrize("n", [8, 40, 1000, 4104, 9000])
def test_add_mean_of_signs_bits_equal_torch(sources, n):
    for name, segments in segmentations(n, seed=n + sources).items():
        g = torch.Generator().manual_seed(10 * n + sources)
        packed = [torch.randint(0, 256, (n // 8,), generator=g, dtype=torch.uint8) for _ in range(sources)]
        # scales of the same magnitude, so that the sums cancel in places; a zero scale in some sources
        scales = [torch.rand(len(segments), generator=g) * 2 for _ in range(sources)]
        scales[0][:: 3] = 0.0
        target = specials_mixed_in(torch.randn(n, generator=g), seed=n, inf=False)
        t_cpu, t_torch = target.clone(), target.clone()
        r = kernels.add_mean_of_signs_(t_cpu, packed, scales, segments, backend="cpu")
        kernels.add_mean_of_signs_(t_torch, packed, scales, segments, backend="torch")
        assert r.data_ptr() == t_cpu.data_ptr()
        assert_same_bits(t_cpu, t_torch, f"n={n} {name} sources={sources}")
        assert not torch.equal(raw(t_cpu), raw(target))
        # loosely, the mean itself (float64 reference)
        per_element = [torch.repeat_interleave(s.double(), torch.tensor(segments.lengths)) for s in scales]
        signs = [torch.from_numpy(np.unpackbits(p.numpy()).astype(np.float64) * 2 - 1) for p in packed]
        mean = sum(s * v for s, v in zip(per_element, signs)) / sources
        torch.testing.assert_close(t_cpu.double(), target.double() + mean, rtol=1e-6, atol=1e-6)


# ------------------------------------------------------------------------------------------------------- frozen Adam
ADAM_SIZES = [1, 7, 8, 9, 63, 64, 65, 100003]


def adam_tensors(n: int, seed: int):
    g = torch.Generator().manual_seed(seed)
    p = torch.randn(n, generator=g)
    m = torch.randn(n, generator=g) * 1e-2
    v = (torch.randn(n, generator=g) * 1e-2).square()
    v[:: 11] = 0.0  # d = eps exactly
    p[:: 13] = -0.0
    return p, m, v


ADAM_HYPER = dict(bias_correction2_sqrt=math.sqrt(1 - 0.999 ** 7), eps=1e-8, step=-1e-3 / (1 - 0.9 ** 7))


def numpy_frozen_adam(p, m, v, decay: Optional[float], bias_correction2_sqrt: float, eps: float, step: float,
                      limit: Optional[float] = None):
    p, m, v = p.numpy().copy(), m.numpy(), v.numpy()
    if decay is not None:
        p = p * np.float32(decay)
    d = np.sqrt(v) / np.float32(bias_correction2_sqrt) + np.float32(eps)
    if limit is None:
        p = p + (np.float32(step) * m) / d
    else:  # m / d clipped to [-limit, limit]; NaN stays NaN
        ratio, bound = m / d, np.float32(limit)
        p = p + np.float32(step) * np.where(ratio > bound, bound, np.where(ratio < -bound, -bound, ratio))
    assert p.dtype == np.float32
    return torch.from_numpy(p)


#: clips about a fifth of adam_tensors' coordinates (the ones with |m| / d above it), every eleventh (v = 0) among them
ADAM_LIMIT = 0.5


@requires_native
@pytest.mark.parametrize("limit", [None, ADAM_LIMIT])
@pytest.mark.parametrize("decay", [None, 0.999])
def test_frozen_adam_update_bits_equal_numpy_float32(decay, limit):
    params, exp_avgs, exp_avg_sqs = zip(*(adam_tensors(n, seed=n) for n in ADAM_SIZES))
    before = [p.clone() for p in params]
    versions = [p._version for p in params]
    kernels.frozen_adam_update_(list(params), list(exp_avgs), list(exp_avg_sqs), decay, backend="cpu", limit=limit,
                                **ADAM_HYPER)
    clipped = 0
    for n, p, p0, m, v, version in zip(ADAM_SIZES, params, before, exp_avgs, exp_avg_sqs, versions):
        expected = numpy_frozen_adam(p0, m, v, decay, **ADAM_HYPER, limit=limit)
        assert_same_bits(p, expected, f"size {n}, decay {decay}")
        assert p._version > version, f"size {n}: the autograd version counter must move"
        assert not torch.equal(p, p0)
        if limit is not None:
            clipped += int(torch.ne(p, numpy_frozen_adam(p0, m, v, decay, **ADAM_HYPER)).sum())
    if limit is not None:
        assert clipped > 1000  # the limit bound, on both the vector and the scalar paths' sizes


@requires_native
@pytest.mark.parametrize("limit", [None, ADAM_LIMIT])
@pytest.mark.parametrize("decay", [None, 0.999])
def test_frozen_adam_update_close_to_torch_backend(decay, limit):
    cpu_state = [adam_tensors(n, seed=n + 1) for n in ADAM_SIZES]
    torch_state = [tuple(t.clone() for t in group) for group in cpu_state]
    for state, backend in ((cpu_state, "cpu"), (torch_state, "torch")):
        params, exp_avgs, exp_avg_sqs = (list(x) for x in zip(*state))
        kernels.frozen_adam_update_(params, exp_avgs, exp_avg_sqs, decay, backend=backend, limit=limit, **ADAM_HYPER)
    for n, (p_cpu, m, v), (p_torch, m2, v2) in zip(ADAM_SIZES, cpu_state, torch_state):
        torch.testing.assert_close(p_cpu, p_torch, rtol=1e-6, atol=1e-9, msg=f"size {n}, decay {decay}")
        assert torch.equal(m, m2) and torch.equal(v, v2), "the Adam state is read only"


@pytest.mark.parametrize("backend", ["cpu", "torch"])
def test_frozen_adam_update_limit_keeps_nan_and_the_unclipped_update(backend):
    """A NaN momentum stays NaN through the clip (it is not turned into a bound); where the limit does not bind the
    update is the unclipped one to the last bit (``s (m / d)`` against ``(s m) / d``), where it binds the parameter
    moves by exactly ``|step| * limit``, cached denominators (``frozen``) or not."""
    if backend == "cpu" and not kernels.cpu_kernels.is_available():
        pytest.skip("no C compiler")
    p, m, v = adam_tensors(1003, seed=5)
    m[::7] = float("nan")
    ratio = (m.double().abs() / (v.double().sqrt() / ADAM_HYPER["bias_correction2_sqrt"] + ADAM_HYPER["eps"]))
    inside = ratio < ADAM_LIMIT  # False at NaN
    for frozen in (False, True):
        clipped, plain = p.clone(), p.clone()
        kernels.frozen_adam_update_([clipped], [m], [v], 0.999, backend=backend, limit=ADAM_LIMIT, frozen=frozen,
                                    **ADAM_HYPER)
        kernels.frozen_adam_update_([plain], [m], [v], 0.999, backend=backend, frozen=frozen, **ADAM_HYPER)
        assert bool(clipped[::7].isnan().all())
        torch.testing.assert_close(clipped[inside], plain[inside], rtol=2e-7, atol=0, msg=f"{backend}, {frozen}")
        bound = ~inside & ~m.isnan()
        decayed = p[bound] * 0.999
        moved = (clipped[bound] - decayed).abs().double()
        torch.testing.assert_close(moved, torch.full_like(moved, abs(ADAM_HYPER["step"]) * ADAM_LIMIT), rtol=1e-3,
                                   atol=0)
        assert not torch.equal(clipped[bound], plain[bound])


@requires_native
def test_frozen_adam_update_bumps_version_for_autograd():
    leaf = torch.randn(9, requires_grad=True)
    loss = (leaf * leaf).sum()  # saves leaf for backward
    m, v = torch.randn(9), torch.rand(9)
    version = leaf._version
    with torch.no_grad():
        kernels.frozen_adam_update_([leaf], [m], [v], None, backend="cpu", **ADAM_HYPER)
    assert leaf._version == version + 1
    with pytest.raises(RuntimeError, match="modified by an inplace operation"):
        loss.backward()


@requires_native
def test_frozen_adam_update_cpu_rejects_other_tensors():
    p, m, v = adam_tensors(16, seed=0)
    for bad in (p.double(), torch.randn(32)[::2], p.to(torch.bfloat16)):
        with pytest.raises(ValueError):
            kernels.frozen_adam_update_([bad], [m], [v], None, backend="cpu", **ADAM_HYPER)
    # auto falls back to torch for them, and still updates
    q = p.double()
    kernels.frozen_adam_update_([q], [m.double()], [v.double()], None, backend="auto", **ADAM_HYPER)
    assert not torch.equal(q, p.double())


# ------------------------------------------------------------------------------------------------------- dispatch
@requires_native
def test_backend_resolution(restore_default_backend):
    kernels.set_default_backend("auto")
    assert "cpu" in kernels.available_backends()
    assert kernels.resolve_backend(torch.zeros(8)) == "cpu"
    assert kernels.resolve_backend(torch.zeros(8), "auto") == "cpu"
    assert kernels.resolve_backend(torch.zeros(8), "cpu") == "cpu"
    assert kernels.resolve_backend(torch.zeros(8), "torch") == "torch"
    for dtype in (torch.float64, torch.bfloat16, torch.float16):
        assert kernels.resolve_backend(torch.zeros(8, dtype=dtype)) == "torch", dtype
        with pytest.raises(ValueError):
            kernels.resolve_backend(torch.zeros(8, dtype=dtype), "cpu")


@pytest.mark.parametrize("dtype", [torch.float64, torch.bfloat16])
def test_explicit_cpu_backend_on_other_dtype_raises_before_touching_error(dtype):
    segments = Segments([0, 3, 16])
    x = torch.randn(16).to(dtype)
    error = torch.randn(16).to(dtype)
    error_before = error.clone()
    with pytest.raises(ValueError):
        kernels.compress_with_error_feedback(x, error, segments, backend="cpu")
    assert torch.equal(raw(error), raw(error_before)), "error must be unchanged when the call is refused"
    y = error.clone()
    with pytest.raises(ValueError):
        kernels.compress_in_place(y, segments, backend="cpu")
    assert torch.equal(raw(y), raw(error_before))
    packed = torch.zeros(2, dtype=torch.uint8)
    with pytest.raises(ValueError):
        kernels.decompress(packed, torch.ones(2), segments, torch.zeros(16, dtype=dtype), backend="cpu")
    with pytest.raises(ValueError):
        kernels.add_mean_of_signs_(torch.zeros(16, dtype=dtype), [packed], [torch.ones(2)], segments, backend="cpu")


@requires_native
def test_cpu_backend_runs_the_native_kernels(monkeypatch):
    """Guard for the comparisons above: backend="cpu" (and "auto" on float32) really calls the C functions."""
    calls: list[str] = []
    library = native.library()

    class Spy:
        def __getattr__(self, name):
            calls.append(name)
            return getattr(library, name)

    monkeypatch.setattr(cpu_kernels, "_lib", lambda: Spy())
    segments = Segments([0, 5, 24])
    x, e = torch.randn(24), torch.zeros(24)
    scales, packed = kernels.compress_with_error_feedback(x, e, segments)
    kernels.decompress(packed, scales, segments, torch.empty(24), backend="cpu")
    kernels.add_mean_of_signs_(torch.zeros(24), [packed], [scales], segments, backend="cpu")
    p, m, v = adam_tensors(8, seed=1)
    kernels.frozen_adam_update_([p], [m], [v], None, **ADAM_HYPER)
    assert calls == [
        "onebit_pack_and_subtract", "onebit_decode", "onebit_add_mean_of_signs", "onebit_frozen_adam_update"
    ]
    calls.clear()
    kernels.compress_with_error_feedback(x, e, segments, backend="torch")
    kernels.compress_with_error_feedback(x.double(), e.double(), segments)
    assert calls == []


# ------------------------------------------------------------------------------------------------ build, fallbacks
# Each probe runs in a fresh interpreter (``native.library`` is cached per process). It imports the ``kernels`` subpackage
# without running ``lightning_onebit/__init__.py``, which imports Lightning (several seconds per process); the kernels
# depend on torch only.
_IMPORT_KERNELS = textwrap.dedent(
    f"""
    import sys, types
    _package = types.ModuleType("lightning_onebit")
    _package.__path__ = [{str(REPO_ROOT / "lightning_onebit")!r}]
    sys.modules["lightning_onebit"] = _package
    """
)

_PROBE = _IMPORT_KERNELS + textwrap.dedent(
    """
    import json, logging, os
    import torch
    records = []

    class Keep(logging.Handler):
        def emit(self, record):
            records.append([record.levelname, record.getMessage()])

    logging.getLogger("lightning_onebit").addHandler(Keep())
    logging.getLogger("lightning_onebit").setLevel(logging.DEBUG)
    from lightning_onebit import kernels
    from lightning_onebit.kernels import Segments, cpu_kernels, native

    segments = Segments([0, 3, 40])
    x = torch.randn(40, generator=torch.Generator().manual_seed(0))
    e_auto, e_torch = torch.zeros(40), torch.zeros(40)
    s_auto, p_auto = kernels.compress_with_error_feedback(x, e_auto, segments)
    s_torch, p_torch = kernels.compress_with_error_feedback(x, e_torch, segments, backend="torch")
    same = all(torch.equal(a.view(torch.uint8), b.view(torch.uint8))
               for a, b in ((s_auto, s_torch), (p_auto, p_torch), (e_auto, e_torch)))
    try:
        kernels.resolve_backend(x, "cpu")
        explicit_cpu = "ok"
    except Exception as error:
        explicit_cpu = type(error).__name__
    cache = native.cache_dir()
    print(json.dumps(dict(
        available=cpu_kernels.is_available(),
        backends=list(kernels.available_backends()),
        auto=kernels.resolve_backend(x),
        explicit_cpu=explicit_cpu,
        same_as_torch=same,
        compressed=bool(p_auto.numel() == 5 and float(s_auto[1]) > 0),
        cache_dir=str(cache),
        cache_files=sorted(os.listdir(cache)) if cache.exists() else None,
        records=records,
    )))
    """
)


def probe_env(**env_changes: Optional[str]) -> dict[str, str]:
    env = script_env()
    env.pop("LIGHTNING_ONEBIT_NATIVE", None)
    for key, value in env_changes.items():
        if value is None:
            env.pop(key, None)
        else:
            env[key] = value
    return env


def start_probe(tmp_path: Path, **env_changes: Optional[str]) -> subprocess.Popen:
    return subprocess.Popen(
        [sys.executable, "-c", _PROBE], env=probe_env(**env_changes), cwd=tmp_path, stdout=subprocess.PIPE,
        stderr=subprocess.PIPE, text=True,
    )


def probe_result(process: subprocess.Popen) -> dict:
    stdout, stderr = process.communicate(timeout=180)
    assert process.returncode == 0, stderr
    return json.loads(stdout.strip().splitlines()[-1])


def run_probe(tmp_path: Path, **env_changes: Optional[str]) -> dict:
    return probe_result(start_probe(tmp_path, **env_changes))


def _assert_torch_fallback(out: dict) -> None:
    """The probe saw no native library: only torch is offered, auto resolves to it, explicit "cpu" refuses."""
    assert out["available"] is False
    assert out["backends"] == ["torch"]
    assert out["auto"] == "torch"
    assert out["explicit_cpu"] == "RuntimeError"


def test_native_disabled_by_environment(tmp_path):
    cache = tmp_path / "cache"
    out = run_probe(tmp_path, LIGHTNING_ONEBIT_NATIVE="0", LIGHTNING_ONEBIT_CACHE_DIR=str(cache))
    _assert_torch_fallback(out)
    assert out["same_as_torch"] is True and out["compressed"] is True
    assert out["cache_dir"] == str(cache)
    assert out["cache_files"] is None, "nothing may be built when the native kernels are disabled"


def test_failing_compiler_falls_back_to_torch_with_a_warning(tmp_path):
    false = shutil.which("false")
    if false is None:
        pytest.skip("no `false` program on PATH")
    cache = tmp_path / "cache"
    cache.mkdir()
    out = run_probe(tmp_path, CC=false, LIGHTNING_ONEBIT_CACHE_DIR=str(cache))
    _assert_torch_fallback(out)
    assert out["same_as_torch"] is True and out["compressed"] is True, "compression must still work through torch"
    warnings = [message for level, message in out["records"] if level == "WARNING"]
    assert len(warnings) == 1 and "could not build" in warnings[0], out["records"]
    assert out["cache_files"] == [], "a failed build must leave no library and no temporary file"


def test_missing_compiler_falls_back_to_torch(tmp_path):
    cache = tmp_path / "cache"
    out = run_probe(tmp_path, CC="/nonexistent/cc", LIGHTNING_ONEBIT_CACHE_DIR=str(cache))
    _assert_torch_fallback(out)
    assert out["same_as_torch"] is True and out["compressed"] is True
    assert not [level for level, _ in out["records"] if level in ("WARNING", "ERROR")], out["records"]
    assert not cache.exists() or not any(cache.iterdir())


@requires_native
def test_fresh_build_writes_one_library_and_no_temporary_files(tmp_path):
    cache = tmp_path / "cache"  # does not exist yet
    out = run_probe(tmp_path, LIGHTNING_ONEBIT_CACHE_DIR=str(cache))
    assert out["available"] is True
    assert out["backends"][:2] == ["torch", "cpu"]
    assert out["auto"] == "cpu" and out["explicit_cpu"] == "ok"
    assert out["same_as_torch"] is True and out["compressed"] is True
    files = sorted(p.name for p in cache.iterdir())
    assert len(files) == 1 and files[0].startswith("onebit_cpu_") and files[0].endswith(".so"), files
    assert out["cache_files"] == files
    # a second process loads the cached library instead of building it again
    library = cache / files[0]
    stamp = library.stat().st_mtime_ns
    again = run_probe(tmp_path, LIGHTNING_ONEBIT_CACHE_DIR=str(cache))
    assert again["available"] is True and again["auto"] == "cpu"
    assert sorted(p.name for p in cache.iterdir()) == files
    assert library.stat().st_mtime_ns == stamp


@requires_native
def test_concurrent_builds_leave_one_library(tmp_path):
    """Ranks starting together build into one cache directory: one library, no temporary leftovers, all load it."""
    cache = tmp_path / "cache"
    processes = [start_probe(tmp_path, LIGHTNING_ONEBIT_CACHE_DIR=str(cache)) for _ in range(2)]
    for out in [probe_result(p) for p in processes]:
        assert out["available"] is True and out["auto"] == "cpu" and out["same_as_torch"] is True
    files = sorted(p.name for p in cache.iterdir())
    assert len(files) == 1 and files[0].startswith("onebit_cpu_") and files[0].endswith(".so"), files


# --------------------------------------------------------------------------------------------------- sizes
@requires_native
def test_native_kernels_reject_wrong_sizes_without_touching_memory():
    """Every size mismatch raises before the C code runs, so no byte outside the tensors is read or written."""
    segments = Segments([0, 64])
    x, parent = torch.randn(64), torch.full((16,), 0xAA, dtype=torch.uint8)
    for packed_out in (parent[:4], parent):  # too small, too large
        with pytest.raises(ValueError):
            kernels.compress_with_error_feedback(x, torch.zeros(64), segments, packed_out=packed_out, backend="cpu")
    assert bool((parent == 0xAA).all())

    _, packed = kernels.compress_with_error_feedback(x, torch.zeros(64), segments, backend="cpu")
    out_parent = torch.full((64,), 7.0)
    for accumulate in (False, True):
        with pytest.raises(ValueError):
            cpu_kernels.decompress(packed, torch.ones(1), segments, out_parent[:56], accumulate=accumulate)
    assert bool((out_parent == 7.0).all())

    p, m, v = torch.zeros(16), torch.ones(16), torch.ones(16)
    with pytest.raises(ValueError):
        kernels.frozen_adam_update_([p], [m[:8]], [v], None, 1.0, 1e-8, -0.1, backend="cpu")
    with pytest.raises(ValueError):
        kernels.frozen_adam_update_([p, p.clone()], [m], [v], None, 1.0, 1e-8, -0.1, backend="cpu")
    with pytest.raises(ValueError):  # the torch path checks the list lengths too
        kernels.frozen_adam_update_([p, p.clone()], [m], [v], None, 1.0, 1e-8, -0.1, backend="torch")
    assert bool((p == 0).all())


def _lamb_run(backend: str, weight_decay: float, bias_correction: bool, steps: int = 8) -> tuple[torch.Tensor, list]:
    from lightning_onebit import OnebitLamb

    torch.manual_seed(0)
    # 29 * 37 and 5 * 29 elements: tails after the 8-wide vector loop
    net = torch.nn.Sequential(torch.nn.Linear(37, 29), torch.nn.Tanh(), torch.nn.Linear(29, 5))
    opt = OnebitLamb(net.parameters(), lr=1e-2, weight_decay=weight_decay, freeze_step=3, kernel_backend=backend,
                     dead_coordinates="ignore", bias_correction=bias_correction)
    for i in range(steps):
        x = torch.randn(16, 37, generator=torch.Generator().manual_seed(i))
        opt.zero_grad()
        net(x).pow(2).mean().backward()
        opt.step()
    factors = [float(opt.state[p]["lamb_last_factor"]) for p in net.parameters()]
    return torch.cat([p.detach().flatten() for p in net.parameters()]), factors


@requires_native
@pytest.mark.parametrize("weight_decay", [0.0, 0.01])
@pytest.mark.parametrize("bias_correction", [True, False])
def test_lamb_compression_stage_c_kernels_match_the_torch_ops(weight_decay: float, bias_correction: bool) -> None:
    """1-bit LAMB's fused C update (five compressed steps) against its torch ops: the same arithmetic per element, the
    norms summed in another order, so within float32 rounding; and it really ran (the factors moved off 1)."""
    torch_params, torch_factors = _lamb_run("torch", weight_decay, bias_correction)
    c_params, c_factors = _lamb_run("cpu", weight_decay, bias_correction)
    torch.testing.assert_close(c_params, torch_params, rtol=0, atol=1e-6)
    assert c_factors == pytest.approx(torch_factors, rel=1e-6, abs=1e-6)
    assert any(abs(f - 1.0) > 1e-3 for f in c_factors), "the compression-stage factor never moved: nothing was tested"


@requires_native
def test_lamb_prepare_reports_a_nan_ratio_and_the_float64_norms() -> None:
    n = 21  # a vector block and a tail of 5
    m, p = torch.linspace(-1, 1, n), torch.linspace(0.5, 2, n)
    last, fresh = torch.full((n,), 0.25), torch.full((n,), 4.0)
    root, denominator = torch.full((n,), 2.0), torch.full((n,), 0.5)
    b1, b2, eps, bc1, wd = 0.9, 0.999, 1e-8, 0.5, 0.1
    g = (last * b1 - m) / -(1 - b1)
    f = fresh * b2 + (1 - b2) * g * g
    u0 = (m / bc1) / denominator
    u = u0 + wd * p
    expected = torch.tensor([float((root / (f.sqrt() + eps)).max()), float(u0.double().pow(2).sum()),
                             float(u.double().pow(2).sum())], dtype=torch.float64)
    out = kernels.lamb_prepare_([m], [last], [fresh], [root], [denominator], [p], (b1, b2), eps, bc1, wd)
    torch.testing.assert_close(out[0], expected, rtol=1e-6, atol=0)
    torch.testing.assert_close(last, u, rtol=1e-6, atol=0)  # u written into the scratch
    torch.testing.assert_close(fresh, f, rtol=1e-6, atol=0)
    # a NaN ratio (a NaN in the fresh variance) in the tail or in a vector block makes the largest ratio NaN
    for where in (3, n - 1):
        bad_fresh = torch.full((n,), 4.0)
        bad_fresh[where] = float("nan")
        out = kernels.lamb_prepare_([m], [torch.full((n,), 0.25)], [bad_fresh], [root], [denominator], [p],
                                    (b1, b2), eps, bc1, wd)
        assert math.isnan(float(out[0, 0])), f"NaN at {where} not reported"
