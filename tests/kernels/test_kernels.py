"""Sign packing and 1-bit compression kernels, checked against numpy and a naive per-segment reference."""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch

from lightning_onebit import kernels
from lightning_onebit.kernels import Segments, cpu_kernels, cupy_kernels
from lightning_onebit.kernels.segments import NORM_CHUNK
from tests.reference import reference_compress
from tests.tensors import exact_sqrt, same_bits

FLOAT_DTYPES = [torch.float32, torch.float64, torch.bfloat16, torch.float16]
PACK_LENGTHS = [0, 8, 16, 24, 32, 40, 56, 64, 72, 120, 128, 136, 248, 256, 264, 1000, 4096, 8 * 12345]


def _cuda_and_cupy() -> bool:
    return torch.cuda.is_available() and cupy_kernels.is_available()


requires_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
requires_cupy = pytest.mark.skipif(not _cuda_and_cupy(), reason="needs a CUDA GPU and an importable cupy")


def signed_data(n: int, seed: int, dtype: torch.dtype = torch.float32, device: str = "cpu") -> torch.Tensor:
    """Random normal data with +0.0, -0.0 and +-inf mixed in at random positions."""
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(n, generator=g, dtype=torch.float64)
    if n:
        kind = torch.randint(0, 10, (n,), generator=g)
        x[kind == 0] = 0.0
        x[kind == 1] = -0.0
        x[(kind == 2) & (torch.rand(n, generator=g) < 0.05)] = math.inf
        x[(kind == 3) & (torch.rand(n, generator=g) < 0.05)] = -math.inf
    return x.to(dtype=dtype, device=device)


def numpy_signs_bytes(x: torch.Tensor) -> np.ndarray:
    return np.packbits(x.detach().double().cpu().numpy() >= 0)


# --------------------------------------------------------------------------------------------------- sign packing
@pytest.mark.parametrize("dtype", FLOAT_DTYPES)
def test_pack_signs_matches_numpy_packbits(dtype):
    for i, n in enumerate(PACK_LENGTHS):
        x = signed_data(n, seed=1000 + i, dtype=dtype)
        if n:  # the special values really are there (and -0.0 really is negative zero)
            assert bool((x == 0).any())
            assert bool(torch.signbit(x[x == 0]).any()) and bool((~torch.signbit(x[x == 0])).any())
        packed = kernels.pack_signs(x)
        assert packed.dtype == torch.uint8 and packed.shape == (n // 8,)
        np.testing.assert_array_equal(packed.numpy(), numpy_signs_bytes(x), err_msg=f"n={n}")
        np.testing.assert_array_equal(kernels.pack_signs(x, backend="torch").numpy(), packed.numpy())


def test_zero_and_negative_zero_pack_as_plus_one():
    x = torch.tensor([0.0, -0.0, 1.0, -1.0, -0.0, 0.0, -1e-30, 1e-30])
    packed = kernels.pack_signs(x)
    assert packed.tolist() == [0b11101101]
    assert kernels.unpack_signs(packed).tolist() == [1, 1, 1, -1, 1, 1, -1, 1]
    assert kernels.pack_signs(torch.zeros(64)).tolist() == [255] * 8
    assert kernels.pack_signs(torch.full((64,), -0.0)).tolist() == [255] * 8
    assert kernels.pack_signs(torch.full((16,), -2.0)).tolist() == [0, 0]


def test_pack_signs_into_out():
    x = signed_data(800, seed=7)
    out = torch.full((100,), 0xAA, dtype=torch.uint8)
    result = kernels.pack_signs(x, out=out)
    assert result.data_ptr() == out.data_ptr()
    np.testing.assert_array_equal(out.numpy(), numpy_signs_bytes(x))


@pytest.mark.parametrize("dtype", FLOAT_DTYPES)
def test_unpack_signs_round_trip(dtype):
    for i, n in enumerate(PACK_LENGTHS):
        x = signed_data(n, seed=2000 + i)
        signs = kernels.unpack_signs(kernels.pack_signs(x), dtype=dtype)
        assert signs.dtype == dtype and signs.shape == (n,)
        expected = torch.where(x >= 0, 1.0, -1.0).to(dtype)
        assert torch.equal(signs, expected), f"n={n}"


def test_unpack_signs_matches_numpy_unpackbits_for_every_byte():
    g = torch.Generator().manual_seed(3)
    data = torch.cat([torch.arange(256, dtype=torch.uint8), torch.randint(0, 256, (999,), generator=g, dtype=torch.uint8)])
    signs = kernels.unpack_signs(data, dtype=torch.float64)
    expected = 2.0 * np.unpackbits(data.numpy()).astype(np.float64) - 1.0
    np.testing.assert_array_equal(signs.numpy(), expected)
    # and packing those signs gives the bytes back
    assert torch.equal(kernels.pack_signs(signs), data)
    assert kernels.unpack_signs(torch.empty(0, dtype=torch.uint8)).shape == (0,)


@pytest.mark.parametrize("n", [1, 2, 3, 4, 5, 6, 7, 9, 12, 15, 17, 803])
def test_pack_signs_rejects_lengths_not_multiple_of_8(n):
    with pytest.raises(ValueError):
        kernels.pack_signs(torch.randn(n))
    with pytest.raises(ValueError):
        kernels.pack_signs(torch.randn(n), backend="torch")


def test_pack_signs_rejects_non_1d():
    with pytest.raises(ValueError):
        kernels.pack_signs(torch.randn(8, 8))


# --------------------------------------------------------------------------------------------------- compression
def segment_scale_per_element(scales: torch.Tensor, offsets: list[int]) -> torch.Tensor:
    lengths = torch.tensor([b - a for a, b in zip(offsets[:-1], offsets[1:])])
    return torch.repeat_interleave(scales.double(), lengths)


def segmentations(n: int, seed: int) -> dict[str, list[int]]:
    g = torch.Generator().manual_seed(seed)
    inner = sorted(set(torch.randint(1, n, (max(1, n // 10),), generator=g).tolist())) if n > 1 else []
    cases = {
        "one": [0, n],
        "length1": list(range(n + 1)),
        "random": [0, *inner, n],
        "aligned8": list(range(0, n + 1, 8)),
    }
    if n >= 64:
        cases["unaligned"] = [0, 1, 3, 11, 12, 29, 40, 41, 63, n]
        cases["many_equal"] = list(range(0, n, n // 16)) + [n]
    return {k: sorted(set(v)) for k, v in cases.items()}


def magnitudes_for(offsets: list[int], seed: int) -> torch.Tensor:
    """Per-element magnitude: each segment gets its own scale between 1e-3 and 1e2."""
    g = torch.Generator().manual_seed(seed)
    mags = 10.0 ** (torch.rand(len(offsets) - 1, generator=g, dtype=torch.float64) * 5 - 3)
    return segment_scale_per_element(mags, offsets)


@pytest.mark.parametrize(
    "dtype, backend", [(torch.float32, "torch"), (torch.float32, "auto"), (torch.float64, "torch")]
)
@pytest.mark.parametrize("n", [8, 64, 1000, 4104])
def test_compress_with_error_feedback_matches_reference(dtype, backend, n):
    """Against a float64 re-implementation; "auto" takes the native kernels for float32 where they build."""
    for name, offsets in segmentations(n, seed=n).items():
        segments = Segments(offsets)
        mags = magnitudes_for(offsets, seed=n + 1)
        g = torch.Generator().manual_seed(n + 2)
        x = (torch.randn(n, generator=g, dtype=torch.float64) * mags).to(dtype)
        x[:: 7] = 0.0  # exact zeros inside segments
        error = (torch.randn(n, generator=g, dtype=torch.float64) * mags * 0.5).to(dtype)
        if len(offsets) > 2:  # one segment whose y is exactly zero: scale 0, error stays 0
            a, b = offsets[1], offsets[2]
            x[a:b] = 0.0
            error[a:b] = 0.0
        x_before, error_before = x.clone(), error.clone()

        ref_scales, ref_q, ref_error, y64 = reference_compress(x, error, offsets)
        scales, packed = kernels.compress_with_error_feedback(x, error, segments, backend=backend)

        assert torch.equal(x, x_before), "x must not be modified"
        assert scales.dtype == torch.float32 and scales.shape == (len(segments),)
        assert packed.dtype == torch.uint8 and packed.shape == (n // 8,)
        scale_rtol = 1e-6 if dtype == torch.float32 else 2e-7  # float32 scales; float32 sums for float32 data
        torch.testing.assert_close(scales.double(), ref_scales, rtol=scale_rtol, atol=0, msg=f"{name}: scales")
        np.testing.assert_array_equal(packed.numpy(), np.packbits(y64.numpy() >= 0), err_msg=f"{name}: packed")
        assert error.dtype == dtype
        # Error relative to its segment's scale: only float32 rounding of the scale/subtraction separates them.
        per_element = segment_scale_per_element(ref_scales, offsets).clamp_min(1e-300)
        rel = ((error.double() - ref_error).abs() / per_element).max().item()
        tol = 3e-6 if dtype == torch.float32 else 2e-7
        assert rel < tol, f"{name}: error differs from the reference by {rel} (relative to the segment scale)"
        if len(offsets) > 2:
            assert float(scales[1]) == 0.0 and bool((error[offsets[1] : offsets[2]] == 0).all())

        # decompress reproduces q = scale * sgn(y)
        out = torch.full((n,), float("nan"), dtype=dtype)
        result = kernels.decompress(packed, scales, segments, out, backend=backend)
        assert result.data_ptr() == out.data_ptr()
        rel_q = ((out.double() - ref_q).abs() / per_element).max().item()
        assert rel_q < tol, f"{name}: decompress differs from scale*sgn by {rel_q}"
        # invariant: decompressed + new error == x + old error
        lhs = out.double() + error.double()
        rhs = x_before.double() + error_before.double()
        rel_inv = ((lhs - rhs).abs() / per_element).max().item()
        assert rel_inv < (1e-6 if dtype == torch.float32 else 1e-14), f"{name}: q + e_new != x + e_old ({rel_inv})"

        # accumulate=True adds to out
        base = torch.randn(n, generator=g, dtype=torch.float64).to(dtype)
        acc = kernels.decompress(packed, scales, segments, base.clone(), accumulate=True, backend=backend)
        torch.testing.assert_close(acc, base + out, rtol=0, atol=0)


def test_compress_repeated_calls_follow_reference():
    """Error feedback carries over call after call exactly like the naive recurrence."""
    offsets = [0, 5, 40, 41, 96, 200]
    segments = Segments(offsets)
    g = torch.Generator().manual_seed(11)
    error = torch.zeros(200)
    ref_error = torch.zeros(200, dtype=torch.float64)
    for _ in range(20):
        x = torch.randn(200, generator=g)
        ref_scales, _, ref_new_error, _ = reference_compress(x.double(), ref_error, offsets)
        scales, packed = kernels.compress_with_error_feedback(x, error, segments)
        torch.testing.assert_close(scales.double(), ref_scales, rtol=1e-5, atol=1e-7)
        torch.testing.assert_close(error.double(), ref_new_error, rtol=1e-5, atol=1e-5)
        ref_error = ref_new_error


def test_decompress_zeroes_tail_when_not_accumulating():
    segments = Segments([0, 3, 16])
    x = torch.randn(16)
    scales, packed = kernels.compress_with_error_feedback(x, torch.zeros(16), segments)
    out = torch.full((24,), 5.0)
    kernels.decompress(packed, scales, segments, out)
    assert bool((out[16:] == 0).all())
    assert bool((out[:16].abs() > 0).all())
    out = torch.full((24,), 5.0)
    kernels.decompress(packed, scales, segments, out, accumulate=True)
    assert bool((out[16:] == 5.0).all())


def test_compress_and_decompress_validate_inputs():
    segments = Segments([0, 8, 16])
    with pytest.raises(ValueError):  # segments do not cover the buffer
        kernels.compress_with_error_feedback(torch.randn(24), torch.zeros(24), segments)
    with pytest.raises(ValueError):  # error of another length
        kernels.compress_with_error_feedback(torch.randn(16), torch.zeros(24), segments)
    with pytest.raises(ValueError):  # error of another dtype
        kernels.compress_with_error_feedback(torch.randn(16), torch.zeros(16, dtype=torch.float64), segments)
    with pytest.raises(ValueError):  # not a multiple of 8
        kernels.compress_with_error_feedback(torch.randn(12), torch.zeros(12), Segments([0, 12]))
    with pytest.raises(ValueError):  # wrong number of packed bytes
        kernels.decompress(torch.zeros(3, dtype=torch.uint8), torch.ones(2), segments, torch.empty(16))
    with pytest.raises(ValueError):  # wrong number of scales
        kernels.decompress(torch.zeros(2, dtype=torch.uint8), torch.ones(3), segments, torch.empty(16))


def test_segments_validation():
    assert Segments.from_lengths([3, 5, 8]).offsets == (0, 3, 8, 16)
    with pytest.raises(ValueError):
        Segments([1, 8])
    with pytest.raises(ValueError):
        Segments([0, 8, 8, 16])
    with pytest.raises(ValueError):
        Segments([])


# --------------------------------------------------------------------------------------------------- backends
def test_resolve_backend_auto_on_cpu(restore_default_backend):
    x = torch.zeros(8)
    native = "cpu" if cpu_kernels.is_available() else "torch"
    assert kernels.resolve_backend(x) == native
    assert kernels.resolve_backend(x, "auto") == native
    assert kernels.resolve_backend(x.double(), "auto") == "torch", "the native kernels take float32 only"
    assert kernels.resolve_backend(x, "torch") == "torch"
    assert "torch" in kernels.available_backends()
    assert ("cpu" in kernels.available_backends()) == cpu_kernels.is_available()


def test_cupy_backend_on_cpu_tensor_raises():
    x = torch.randn(64)
    with pytest.raises(ValueError):
        kernels.resolve_backend(x, "cupy")
    with pytest.raises(ValueError):
        kernels.pack_signs(x, backend="cupy")
    with pytest.raises(ValueError):
        kernels.compress_with_error_feedback(x, torch.zeros(64), Segments([0, 64]), backend="cupy")


@pytest.mark.parametrize("name", ["numpy", "CUDA", "Torch", "", None, "cuda"])
def test_unknown_backend_raises(name):
    x = torch.randn(8)
    with pytest.raises(ValueError):
        kernels.resolve_backend(x, name)
    with pytest.raises(ValueError):
        kernels.pack_signs(x, backend=name)


def test_set_default_backend_validates_and_applies(restore_default_backend):
    x = torch.randn(64)
    kernels.set_default_backend("torch")
    assert kernels._default_backend == "torch"
    assert kernels.resolve_backend(x, "auto") == "torch"
    with pytest.raises(ValueError):
        kernels.set_default_backend("numpy")
    assert kernels._default_backend == "torch", "a rejected name must leave the default unchanged"
    # a default of cupy is honoured by "auto": on a CPU tensor that is an error, while explicit "torch" still works
    kernels.set_default_backend("cupy")
    with pytest.raises(ValueError):
        kernels.resolve_backend(x, "auto")
    assert kernels.resolve_backend(x, "torch") == "torch"
    kernels.set_default_backend("auto")
    assert kernels.resolve_backend(x.double(), "auto") == "torch"


# --------------------------------------------------------------------------------------------------- CUDA / cupy
@pytest.mark.gpu
@requires_cuda
def test_torch_kernels_on_cuda_match_numpy():
    for i, n in enumerate(PACK_LENGTHS):
        x = signed_data(n, seed=3000 + i, device="cuda")
        packed = kernels.pack_signs(x, backend="torch")
        np.testing.assert_array_equal(packed.cpu().numpy(), numpy_signs_bytes(x))
        assert torch.equal(kernels.unpack_signs(packed, backend="torch").cpu(), torch.where(x.cpu() >= 0, 1.0, -1.0))


@pytest.mark.gpu
@requires_cupy
def test_cupy_pack_unpack_bytes_equal_torch(restore_default_backend):
    kernels.set_default_backend("auto")
    # "auto" keeps the torch kernels on CUDA where cupy imports: on an H200 they compressed as fast or faster and ran a
    # whole simulated step 1.6-1.9x faster (results/gpu_kernels.json); cupy runs when asked for
    assert kernels.resolve_backend(torch.zeros(8, device="cuda")) == "torch"
    for dtype in FLOAT_DTYPES:
        for i, n in enumerate(PACK_LENGTHS):
            x = signed_data(n, seed=4000 + i, dtype=dtype, device="cuda")
            by_cupy = kernels.pack_signs(x, backend="cupy")
            by_torch = kernels.pack_signs(x, backend="torch")
            assert by_cupy.is_cuda
            assert torch.equal(by_cupy, by_torch), f"{dtype} n={n}"
            np.testing.assert_array_equal(by_cupy.cpu().numpy(), numpy_signs_bytes(x))
            assert torch.equal(
                kernels.unpack_signs(by_cupy, dtype=dtype, backend="cupy"),
                kernels.unpack_signs(by_torch, dtype=dtype, backend="torch"),
            )


@pytest.mark.gpu
@requires_cupy
@pytest.mark.parametrize("dtype", [torch.float32, torch.float64, torch.float16, torch.bfloat16])
def test_cupy_compress_identical_to_torch(dtype):
    n = 8 * 4099
    for name, offsets in segmentations(n, seed=5).items():
        if name == "length1":
            continue  # 32k one-element segments: correct but slow on the per-segment loop
        segments = Segments(offsets)
        g = torch.Generator().manual_seed(6)
        x = torch.randn(n, generator=g).to(dtype=dtype, device="cuda")
        e0 = (0.3 * torch.randn(n, generator=g)).to(dtype=dtype, device="cuda")
        e_cupy, e_torch = e0.clone(), e0.clone()
        s_cupy, p_cupy = kernels.compress_with_error_feedback(x, e_cupy, segments, backend="cupy")
        s_torch, p_torch = kernels.compress_with_error_feedback(x, e_torch, segments, backend="torch")
        torch.cuda.synchronize()
        assert torch.equal(p_cupy, p_torch), name
        assert torch.equal(s_cupy, s_torch), name
        assert torch.equal(e_cupy, e_torch), name
        np.testing.assert_array_equal(p_cupy.cpu().numpy(), numpy_signs_bytes(x + e0))
        out_cupy = kernels.decompress(p_cupy, s_cupy, segments, torch.empty_like(x), backend="cupy")
        out_torch = kernels.decompress(p_torch, s_torch, segments, torch.empty_like(x), backend="torch")
        assert torch.equal(out_cupy, out_torch), name


def test_scales_stay_accurate_for_long_segments():
    # torch's float32 norm drifts on long vectors (~3e-5 relative at 2M elements on CPU); chunked norms combined in
    # float64 keep the scale at float32 resolution.
    y = torch.randn(2_000_000, generator=torch.Generator().manual_seed(0)) * 0.3 + 0.01
    segments = Segments([0, 3, 1_500_000, y.numel()])
    expected = torch.stack([torch.linalg.vector_norm(y[a:b].double()) / (b - a) ** 0.5 for a, b in segments.bounds])
    error = torch.empty_like(y)
    scales, _ = kernels.compress_with_error_feedback(y, error.zero_(), segments, backend="torch")
    assert ((scales.double() - expected).abs() / expected).max() < 1e-6


class _RecordOps(torch.utils._python_dispatch.TorchDispatchMode):
    def __init__(self) -> None:
        super().__init__()
        self.ops: list[str] = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.ops.append(str(func.overloadpacket))
        return func(*args, **(kwargs or {}))


def test_torch_kernels_on_cuda_have_no_atomics_and_no_host_reads(monkeypatch):
    """On (fake) CUDA tensors the torch kernels run with a fixed number of launches: no op reads a value back to the
    host (fake tensors raise on those, e.g. the old per-segment ``scales.tolist()``), and the per-segment sums avoid
    ``index_add_`` (float64 atomics on CUDA: run-to-run bits)."""
    from tests.detectors import fake_cuda

    monkeypatch.setattr(kernels.cupy_kernels, "is_available", lambda: True)  # "auto" still picks torch on CUDA
    layout_segments = Segments.from_lengths([100_000, 37, 70_000, 5, 200_000 + 6])
    n = layout_segments.total
    with fake_cuda():
        x = torch.randn(n, device="cuda")
        assert kernels.resolve_backend(x) == "torch"
        error = torch.zeros(n, device="cuda")
        with _RecordOps() as recorder:
            scales, packed = kernels.compress_with_error_feedback(x, error, layout_segments)
            out = kernels.decompress(packed, scales, layout_segments, torch.empty(n, device="cuda"))
            kernels.add_mean_of_signs_(torch.zeros(n, device="cuda"), [packed, packed], [scales, scales],
                                       layout_segments)
        assert out.device.type == "cuda" and scales.device.type == "cuda"
    assert recorder.ops, "the dispatch mode saw nothing"
    assert not [op for op in recorder.ops if "index_add" in op or "_local_scalar_dense" in op], recorder.ops


def test_means_divide_on_the_device_not_by_a_reciprocal():
    """torch's CUDA kernels divide by a Python number as ``x * (1 / n)`` (an H200 gave the mean of 3 and of 5 ranks'
    signs one ulp off the CPU's in 30-40% of the elements); ``kernels.divide_`` divides by a 0-dim tensor made on
    the device, which takes the division kernel, and on the CPU (the reference's bits) by the number as before."""
    from torch.utils._python_dispatch import TorchDispatchMode

    from tests.detectors import fake_cuda

    class Divisions(TorchDispatchMode):
        def __init__(self):
            super().__init__()
            self.divisors = []

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            if func.overloadpacket is torch.ops.aten.div_:
                self.divisors.append(args[1])
            return func(*args, **(kwargs or {}))

    segments = Segments.from_lengths([4096, 37 + 3])
    n = segments.total
    with fake_cuda():
        x = torch.randn(n, device="cuda")
        scales, packed = kernels.compress_with_error_feedback(x, torch.zeros(n, device="cuda"), segments)
        for sources, by_tensor in ((3, True), (5, True), (4, False)):
            with Divisions() as seen:
                kernels.add_mean_of_signs_(torch.zeros(n, device="cuda"), [packed] * sources, [scales] * sources,
                                           segments)
            [divisor] = seen.divisors
            if by_tensor:  # 1/3, 1/5 are not exact: a tensor divisor on the device, holding the count exactly
                assert isinstance(divisor, torch.Tensor) and divisor.dim() == 0 and divisor.device.type == "cuda"
            else:  # a power of two: x * (1/4) is the quotient, the number stays
                assert divisor == sources
    with Divisions() as seen:  # the CPU divides by the number, as the recorded behaviour did
        kernels.divide_(torch.ones(8), 3)
    assert seen.divisors == [3]


def test_segment_sums_are_pairwise_in_a_fixed_order():
    """``Segments.sum_per_segment`` adds each segment's chunks by halving (same order on every device and run)."""
    segments = Segments.from_lengths([5 * NORM_CHUNK + 3, 7, 3 * NORM_CHUNK])
    per_chunk = torch.tensor([1e16, 1.0, -1e16, 1.0, 3.0, 2.0, 4.0, 8.0, 16.0, 32.0], dtype=torch.float64)
    assert len(segments.chunk_bounds) == per_chunk.numel()
    sums = segments.sum_per_segment(per_chunk)
    # segment 0 holds chunks 0..5, padded to 8: ((c0+c1)+(c2+c3)) + ((c4+c5)+(0+0)); sequential order would lose the 1s
    expected0 = ((1e16 + 1.0) + (-1e16 + 1.0)) + ((3.0 + 2.0) + 0.0)
    assert sums.tolist() == [expected0, 4.0, (8.0 + 16.0) + (32.0 + 0.0)]


# ------------------------------------------------------------------------------------------------ square roots
@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
@pytest.mark.parametrize("layout", ["contiguous", "strided", "in place"])
def test_sqrt_is_correctly_rounded(dtype: torch.dtype, layout: str) -> None:
    """``kernels.sqrt_into`` gives the IEEE square root's bits (numpy's, correctly rounded), special values included,
    through the native loop (contiguous), numpy (strided) and in place. torch's own CPU ``sqrt`` does not: about one
    float32 element in five is one unit in the last place off, by an amount that depends on the processor."""
    g = torch.Generator().manual_seed(0)
    special = [0.0, -0.0, float("inf"), float("nan"), -1.0, torch.finfo(dtype).tiny / 4]  # the last: subnormal
    x = torch.cat([torch.rand(50_000, generator=g, dtype=dtype) * 1e-3,
                   torch.rand(50_000, generator=g, dtype=dtype) * 1e6, torch.tensor(special, dtype=dtype)])
    expected = exact_sqrt(x)
    if layout == "strided":
        source = torch.empty(2 * x.numel(), dtype=dtype)[::2]
        source.copy_(x)
        out = torch.empty(2 * x.numel(), dtype=dtype)[::2]
    else:
        source = x.clone()
        out = source if layout == "in place" else torch.empty_like(x)
    version = out._version
    assert kernels.sqrt_into(source, out) is out
    assert same_bits(out.contiguous(), expected)
    assert out._version > version  # the frozen-variance caches see the write


def test_sqrt_of_other_dtypes_and_lists() -> None:
    x = torch.rand(1000, generator=torch.Generator().manual_seed(1)) * 100
    for dtype in (torch.bfloat16, torch.float16):
        low = x.to(dtype)
        assert same_bits(kernels.sqrt_into(low, torch.empty_like(low)), exact_sqrt(low.float()).to(dtype))
    tensors = [x[:10].clone(), x[10:].clone()]
    roots = kernels.foreach_sqrt(tensors)
    assert all(same_bits(r, exact_sqrt(t)) for r, t in zip(roots, tensors))
    kernels.foreach_sqrt_(tensors)
    assert all(same_bits(r, t) for r, t in zip(roots, tensors))
    with pytest.raises(ValueError, match="shape"):
        kernels.sqrt_into(x, torch.empty(3))
