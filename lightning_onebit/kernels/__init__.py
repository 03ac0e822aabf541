"""Sign-packing and 1-bit compression kernels ("bits on a device").

Three implementations give identical bits:

* ``"torch"``: pure torch, any device and floating dtype; the reference.
* ``"cpu"``: fused C kernels (AVX2 where available) for float32 tensors in CPU memory, compiled on first use (see
  :mod:`lightning_onebit.kernels.native`); one pass over memory where the torch path makes several.
* ``"cupy"``: sign packing for CUDA tensors with cupy (only when asked for).

Every entry point takes ``backend="auto" | "torch" | "cpu" | "cupy"``; ``"auto"`` follows :func:`set_default_backend`
(itself ``"auto"`` unless changed), which picks ``"cpu"`` for float32 CPU tensors when the native library builds, and
``"torch"`` otherwise (CUDA tensors included: see :func:`resolve_backend`).

The fused entry points that performance work optimises: :func:`compress_with_error_feedback` (and
:func:`compress_in_place`), :func:`decompress`, :func:`add_mean_of_signs_` and :func:`frozen_adam_update_`. The torch
versions take an optional :class:`Workspace` so that per-step calls reuse their scratch memory (the C kernels need
none).
"""

from __future__ import annotations

from typing import Literal, Optional, Sequence

import torch

from lightning_onebit.kernels import cpu_kernels, cupy_kernels, native, torch_kernels
from lightning_onebit.kernels.frozen import cached as _cached_frozen
from lightning_onebit.kernels.segments import Segments
from lightning_onebit.kernels.workspace import Workspace

Backend = Literal["auto", "torch", "cpu", "cupy"]
_BACKENDS = ("auto", "torch", "cpu", "cupy")
_default_backend: str = "auto"

__all__ = [
    "Backend",
    "Segments",
    "Workspace",
    "add_mean_of_signs_",
    "available_backends",
    "compress_in_place",
    "compress_with_error_feedback",
    "decompress",
    "divide_",
    "effective_backend",
    "frozen_adam_denominators",
    "frozen_adam_update_",
    "foreach_sqrt",
    "foreach_sqrt_",
    "pack_signs",
    "resolve_backend",
    "set_default_backend",
    "sqrt_into",
    "unpack_signs",
]

divide_ = torch_kernels.divide_  # the correctly rounded quotient on the CPU and on CUDA alike
# correctly rounded square roots (the same bits on every machine; see kernels.native)
sqrt_into = native.sqrt_into
foreach_sqrt = native.foreach_sqrt
foreach_sqrt_ = native.foreach_sqrt_


def set_default_backend(backend: Backend) -> None:
    """Choose the backend used when a call passes ``backend="auto"`` (process-wide)."""
    global _default_backend
    if backend not in _BACKENDS:
        raise ValueError(f"unknown kernel backend {backend!r}; choose one of {_BACKENDS}")
    _default_backend = backend


def effective_backend(backend: Backend = "auto") -> str:
    """``backend`` with ``"auto"`` replaced by the process-wide default of :func:`set_default_backend`."""
    if backend not in _BACKENDS:
        raise ValueError(f"unknown kernel backend {backend!r}; choose one of {_BACKENDS}")
    return _default_backend if backend == "auto" else backend


def available_backends() -> tuple[str, ...]:
    """The backends usable in this process (``"torch"`` always)."""
    found = ["torch"]
    if cpu_kernels.is_available():
        found.append("cpu")
    if cupy_kernels.is_available():
        found.append("cupy")
    return tuple(found)


def resolve_backend(tensor: torch.Tensor, backend: Backend = "auto") -> str:
    """The backend a call on ``tensor`` runs with: ``"torch"``, ``"cpu"`` or ``"cupy"``."""
    if backend not in _BACKENDS:
        raise ValueError(f"unknown kernel backend {backend!r}; choose one of {_BACKENDS}")
    if backend == "auto":
        backend = _default_backend
    if backend == "auto":
        if tensor.is_cuda:
            # The torch kernels: one launch sequence with no host synchronisation and a single table lookup to unpack,
            # in torch's own allocator. The cupy path unpacks in about five passes and keeps a memory pool of its own;
            # it is used only when asked for (kernel_backend="cupy"): on an H200 (results/gpu_kernels.json, two runs)
            # it compressed no faster and took 1.6-1.9x as long for a whole simulated step.
            return "torch"
        return "cpu" if cpu_kernels.supports(tensor) and cpu_kernels.is_available() else "torch"
    if backend == "cpu":
        if not cpu_kernels.supports(tensor):
            raise ValueError(f"backend='cpu' needs float32 CPU tensors, got {tensor.dtype} on {tensor.device}")
        if not cpu_kernels.is_available():
            raise RuntimeError(
                "backend='cpu' was requested but the native kernels could not be built: install a C compiler "
                "(or set CC), unset LIGHTNING_ONEBIT_NATIVE=0, or use backend='torch'"
            )
    if backend == "cupy":
        if not tensor.is_cuda:
            raise ValueError(f"backend='cupy' needs CUDA tensors, got a tensor on {tensor.device}")
        if not cupy_kernels.is_available():
            raise RuntimeError(
                "backend='cupy' was requested but cupy is not importable: pip install 'lightning-onebit[cuda]'"
            )
    return backend


def _bit_kernels(backend: str):
    # pack/unpack of bool bits: the cpu backend has no separate bit kernels (its fused kernels do not need them)
    module = cupy_kernels if backend == "cupy" else torch_kernels
    return module.pack_bool, module.unpack_signs_into


def pack_signs(x: torch.Tensor, out: Optional[torch.Tensor] = None, backend: Backend = "auto") -> torch.Tensor:
    """Pack the signs of a 1-D tensor into bytes: bit 1 for ``x >= 0`` (so 0 -> +1), most significant bit first.

    The bytes equal ``numpy.packbits(x >= 0)``. ``x.numel()`` must be a multiple of 8.
    """
    pack_bool, _ = _bit_kernels(resolve_backend(x, backend))
    torch_kernels.check_packable(x)
    return pack_bool(torch.ge(x, 0), out=out)


def unpack_signs(packed: torch.Tensor, dtype: torch.dtype = torch.float32, backend: Backend = "auto") -> torch.Tensor:
    """Unpack bytes to +1/-1 values of ``dtype``; the result has ``8 * packed.numel()`` elements."""
    _, signs_into = _bit_kernels(resolve_backend(packed, backend))
    return signs_into(packed, torch.empty(8 * packed.numel(), dtype=dtype, device=packed.device))


def compress_with_error_feedback(
    x: torch.Tensor,
    error: torch.Tensor,
    segments: Segments,
    packed_out: Optional[torch.Tensor] = None,
    backend: Backend = "auto",
    workspace: Optional[Workspace] = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Error-compensated 1-bit compression of ``x``; updates ``error`` in place.

    With ``y = x + error``, for every segment ``s``: ``scale_s = ||y_s||_2 / sqrt(len_s)`` and
    ``error_s <- y_s - scale_s * sgn(y_s)``, ``sgn(0) = +1``. Returns ``(scales, packed)``: float32 scales (one per
    segment) and the packed sign bits of ``y`` (``x.numel() / 8`` bytes). ``x`` and ``error`` are 1-D, same dtype and
    length (a multiple of 8, equal to ``segments.total``).
    """
    if x.shape != error.shape or x.dtype != error.dtype:
        raise ValueError(f"x and error must match: {x.dtype}{tuple(x.shape)} vs {error.dtype}{tuple(error.shape)}")
    if segments.total != x.numel():
        raise ValueError(f"segments cover {segments.total} elements but the buffer has {x.numel()}")
    torch_kernels.check_packable(x)
    resolved = resolve_backend(x, backend)  # raises before `error` is touched
    error.add_(x)
    return compress_in_place(error, segments, packed_out=packed_out, backend=resolved, workspace=workspace)


def compress_in_place(
    y: torch.Tensor,
    segments: Segments,
    packed_out: Optional[torch.Tensor] = None,
    backend: Backend = "auto",
    workspace: Optional[Workspace] = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """1-bit compression of ``y`` that leaves the compression error in ``y``.

    Per segment ``scale_s = ||y_s||_2 / sqrt(len_s)``; ``packed = bits(y >= 0)``; ``y_s <- y_s - scale_s sgn(y_s)``.
    Returns ``(scales, packed)`` as :func:`compress_with_error_feedback` does (which is ``error += x`` followed by
    this).
    """
    if segments.total != y.numel():
        raise ValueError(f"segments cover {segments.total} elements but the buffer has {y.numel()}")
    torch_kernels.check_packable(y)
    resolved = resolve_backend(y, backend)
    if resolved == "cpu":
        return cpu_kernels.compress_in_place(y, segments, packed_out=packed_out)
    pack_bool, signs_into = _bit_kernels(resolved)
    return torch_kernels.compress_in_place(
        y, segments, packed_out=packed_out, pack=pack_bool, signs_into=signs_into, workspace=workspace
    )


def decompress(
    packed: torch.Tensor,
    scales: torch.Tensor,
    segments: Segments,
    out: torch.Tensor,
    accumulate: bool = False,
    backend: Backend = "auto",
    workspace: Optional[Workspace] = None,
) -> torch.Tensor:
    """Write (or with ``accumulate=True`` add) ``scale_s * sgn`` into ``out`` for every segment; returns ``out``.

    ``packed`` holds ``segments.total / 8`` bytes; elements of ``out`` past ``segments.total`` are zeroed when not
    accumulating.
    """
    if packed.numel() * 8 != segments.total:
        raise ValueError(f"{packed.numel()} packed bytes cannot hold {segments.total} signs")
    if scales.numel() != len(segments):
        raise ValueError(f"got {scales.numel()} scales for {len(segments)} segments")
    resolved = resolve_backend(out, backend)
    if resolved == "cpu":
        return cpu_kernels.decompress(packed, scales, segments, out, accumulate=accumulate)
    _, signs_into = _bit_kernels(resolved)
    return torch_kernels.decompress(
        packed, scales, segments, out, accumulate=accumulate, signs_into=signs_into, workspace=workspace
    )


def add_mean_of_signs_(
    target: torch.Tensor,
    packed: Sequence[torch.Tensor],
    scales: Sequence[torch.Tensor],
    segments: Segments,
    backend: Backend = "auto",
    workspace: Optional[Workspace] = None,
) -> torch.Tensor:
    """``target += (sum_j scale_{j,s} * sgn_j) / J``: the mean of ``J`` packed sign vectors (each with per-segment
    scales over ``segments``) added to ``target``; the sum runs over ``j`` in order. Returns ``target``."""
    if not packed or len(packed) != len(scales):
        raise ValueError(f"need one scale tensor per packed source, got {len(packed)} and {len(scales)}")
    if target.numel() != segments.total:
        raise ValueError(f"target has {target.numel()} elements but the segments cover {segments.total}")
    for p, s in zip(packed, scales):
        if p.numel() * 8 != segments.total or s.numel() != len(segments):
            raise ValueError("every source needs segments.total / 8 packed bytes and one scale per segment")
    resolved = resolve_backend(target, backend)
    if resolved == "cpu":
        return cpu_kernels.add_mean_of_signs_(target, packed, scales, segments)
    _, signs_into = _bit_kernels(resolved)
    return torch_kernels.add_mean_of_signs_(target, packed, scales, segments, signs_into=signs_into,
                                            workspace=workspace)


def frozen_adam_update_(
    params: Sequence[torch.Tensor],
    exp_avgs: Sequence[torch.Tensor],
    exp_avg_sqs: Sequence[torch.Tensor],
    decay: Optional[float],
    bias_correction2_sqrt: float,
    eps: float,
    step: float,
    backend: Backend = "auto",
    frozen: bool = False,
    limit: Optional[float] = None,
) -> None:
    """The parameter update of Adam with a frozen variance, in place on ``params``::

        p <- p * decay                                  (skipped when decay is None)
        d = sqrt(v) / bias_correction2_sqrt + eps
        p <- p + (step * m) / d                         (limit None)
        p <- p + step * clip(m / d, -limit, limit)      (with a limit; the stored momentum is not changed)

    ``step`` is ``-lr / bias_correction1``, so ``limit / bias_correction1`` bounds ``|m_hat| / d``, the size of every
    coordinate of the update in units of ``lr`` (:func:`~lightning_onebit.optim.functional.adam_update_` passes the
    bound times ``bias_correction1``). The two forms round differently (``(s m) / d`` against ``s (m / d)``), so
    with a limit the update is the unclipped one to the last bit where the limit does not bind.

    The ``"cpu"`` backend makes one pass per parameter (all tensors float32 and contiguous in CPU memory); otherwise
    the ``torch._foreach`` sequence of AdamW runs. Both take correctly rounded square roots (:func:`sqrt_into`: torch's
    own CPU ``sqrt`` is not correctly rounded, and its bits depend on the processor), so the bits do not depend on the
    machine; every rank runs the same backend, so replicas stay identical.

    ``frozen=True`` says that ``exp_avg_sqs`` will not change before the next call (the compression stage): the
    torch path then caches the denominators (:func:`frozen_adam_denominators`, one tensor per variance while it
    lives) and updates in two passes instead of five (five with a limit, two of them the clip's), with the same
    bits. The C kernel ignores it: its one pass reads ``v`` where a cached denominator would be read instead, the
    same memory traffic (``python -m benchmarks.kernels`` measures both), so it keeps no cache and no extra memory.
    """
    if not len(params) == len(exp_avgs) == len(exp_avg_sqs):
        raise ValueError(f"got {len(params)} params, {len(exp_avgs)} exp_avgs and {len(exp_avg_sqs)} exp_avg_sqs")
    if not params:
        return
    if _uses_native_adam(params, exp_avgs, exp_avg_sqs, backend):
        cpu_kernels.frozen_adam_update_(params, exp_avgs, exp_avg_sqs, decay, bias_correction2_sqrt, eps, step, limit)
        return
    denominators = frozen_adam_denominators(exp_avg_sqs, bias_correction2_sqrt, eps) if frozen else None
    torch_kernels.frozen_adam_update_(
        params, exp_avgs, exp_avg_sqs, decay, bias_correction2_sqrt, eps, step, denominators=denominators, limit=limit
    )


def _uses_native_adam(
    params: Sequence[torch.Tensor], exp_avgs: Sequence[torch.Tensor], exp_avg_sqs: Sequence[torch.Tensor],
    backend: Backend,
) -> bool:
    """Whether :func:`frozen_adam_update_` runs the C kernel for these tensors (raises for ``backend="cpu"`` on
    tensors it cannot take)."""
    return uses_native_update((params, exp_avgs, exp_avg_sqs), backend)


def uses_native_update(tensor_lists: Sequence[Sequence[torch.Tensor]], backend: Backend) -> bool:
    """Whether an optimizer update over these tensors runs the C kernels (:func:`frozen_adam_update_`,
    :func:`lamb_prepare_`): ``backend`` resolves to ``"cpu"`` and every tensor is contiguous float32 in CPU memory.
    Raises for ``backend="cpu"`` on tensors the C kernels cannot take."""
    tensors = [t for group in tensor_lists for t in group]
    if not tensors:
        return False
    native = all(t.is_contiguous() and cpu_kernels.supports(t) for t in tensors)
    if backend == "cpu" and not native:
        raise ValueError("backend='cpu' needs contiguous float32 CPU tensors for params and optimizer state")
    return native and resolve_backend(tensors[0], backend) == "cpu"


# 1-bit LAMB's compression-stage update: C kernels only (the torch ops live in OnebitLamb, on any device)
lamb_prepare_ = cpu_kernels.lamb_prepare_
lamb_apply_ = cpu_kernels.lamb_apply_


def frozen_adam_denominators(
    exp_avg_sqs: Sequence[torch.Tensor], bias_correction2_sqrt: float, eps: float
) -> list[torch.Tensor]:
    """``sqrt(v) / bias_correction2_sqrt + eps`` for each variance, computed by the torch path's ops (the same bits
    as :func:`frozen_adam_update_` without a cache) and cached while ``v``, ``eps`` and the bias correction stay the
    same (:mod:`lightning_onebit.kernels.frozen`). No host synchronisation."""
    constants = (float(bias_correction2_sqrt), float(eps))
    compute = lambda v, out: torch_kernels.frozen_adam_denominators_into(v, out, *constants)  # noqa: E731
    return [_cached_frozen(v, "adam_denominator", constants, compute) for v in exp_avg_sqs]
