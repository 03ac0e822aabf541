"""1-bit LAMB's per-tensor math, on the device and with no host synchronisation: the trust ratios, Python's ``min``
and ``max`` elementwise, the frozen variance's cached denominators, the compression-stage update
(:func:`compressed_lamb_update_`), the scaling coefficients, the runs of tensors the multi-tensor ops take, the 0-dim
float64 coefficients kept per tensor in the optimizer state, and the per-shard squared norms and maxima that sharded
parameters reduce over their shard group.
"""

from __future__ import annotations

import math
from typing import Any, Callable, Optional, Sequence

import torch

from lightning_onebit import kernels
from lightning_onebit.kernels import frozen as frozen_cache

# per-parameter state held as 0-dim float64 tensors on the parameter's device
_SCALAR_STATE = ("lamb_coeff", "lamb_last_factor", "lamb_scaling_coeff")
# the warmup's multi-tensor ops run over at most this many elements at a time (their temporaries: u, denominators)
_CHUNK_NUMEL = 2**24


def _scalar(value: float, device: torch.device) -> torch.Tensor:
    """A 0-dim float64 tensor on ``device``, filled there (no host-to-device copy)."""
    return torch.full((), value, dtype=torch.float64, device=device)


def _one(p: torch.Tensor) -> torch.Tensor:
    return torch.ones((), dtype=p.dtype, device=p.device)


def _as_scalar(value: Any, device: torch.device) -> torch.Tensor:
    """A loaded coefficient (a Python number from an older checkpoint, or a tensor) as a 0-dim float64 tensor."""
    if isinstance(value, torch.Tensor):
        return value.detach().to(device=device, dtype=torch.float64).reshape(()).clone()
    return _scalar(float(value), device)


def _py_max(a: Any, b: Any) -> torch.Tensor:
    """Python's ``max(a, b)`` elementwise (``a`` unless ``b > a``: NaN handled as Python does)."""
    return torch.where(b > a, b, a)


def _py_min(a: Any, b: Any) -> torch.Tensor:
    """Python's ``min(a, b)`` elementwise (``a`` unless ``b < a``)."""
    return torch.where(b < a, b, a)


def _by_device(params: Sequence[torch.Tensor]) -> dict[torch.device, list[int]]:
    out: dict[torch.device, list[int]] = {}
    for i, p in enumerate(params):
        out.setdefault(p.device, []).append(i)
    return out


def _chunks(params: Sequence[torch.Tensor], limit: Optional[int] = _CHUNK_NUMEL) -> list[list[int]]:
    """Indices into ``params``, by device, in runs of at most ``limit`` elements (a larger tensor alone; ``None``:
    one run per device)."""
    out = []
    for indices in _by_device(params).values():
        chunk, size = [], 0
        for i in indices:
            n = params[i].numel()
            if chunk and limit is not None and size + n > limit:
                out.append(chunk)
                chunk, size = [], 0
            chunk.append(i)
            size += n
        if chunk:
            out.append(chunk)
    return out


def _root_eps(v: torch.Tensor, eps: float) -> torch.Tensor:
    """The frozen variance's ``sqrt(v) + eps`` (the ops of ``v.sqrt() + eps``), cached while ``v`` and ``eps`` stay."""

    def into(x: torch.Tensor, out: torch.Tensor) -> None:
        kernels.sqrt_into(x, out)
        out.add_(eps)

    return frozen_cache.cached(v, "lamb_root_eps", (float(eps),), into)


def _denominator(v: torch.Tensor, bc2: float, eps: float) -> torch.Tensor:
    """The frozen variance's ``sqrt(v / bc2) + eps`` (the ops of ``(v / bc2).sqrt_().add_(eps)``), cached."""

    def into(x: torch.Tensor, out: torch.Tensor) -> None:
        torch.div(x, bc2, out=out)
        kernels.sqrt_into(out, out).add_(eps)

    return frozen_cache.cached(v, "lamb_denominator", (float(bc2), float(eps)), into)


def _trust_ratios(params: Sequence[torch.Tensor], updates: Sequence[torch.Tensor], low: float, high: float
                  ) -> torch.Tensor:
    """LAMB's ``clip(||p|| / ||u||, low, high)`` per tensor, 1 where either norm is 0: a float64 vector on the
    parameters' device (norms in float32, as ``float(p.float().norm())`` read them, then the Python arithmetic)."""
    p_norms = torch.stack(torch._foreach_norm([p.detach().float() for p in params])).double()
    u_norms = torch.stack(torch._foreach_norm([u.float() for u in updates])).double()
    return _clipped_ratios(p_norms, u_norms, low, high)


def _clipped_ratios(p_norms: torch.Tensor, u_norms: torch.Tensor, low: float, high: float) -> torch.Tensor:
    """``clip(p_norms / u_norms, low, high)``, 1 where either norm is 0 (float64 vectors)."""
    ratios = _py_min(_py_max(p_norms / u_norms, low), high)
    return torch.where((p_norms == 0) | (u_norms == 0), 1.0, ratios)


def _scaling_coefficients(rms: torch.Tensor) -> torch.Tensor:
    """1-bit LAMB's ``mean(rms) / rms`` per tensor over the tensors whose momentum ``rms`` is nonzero (1 for the
    others, and a mean of 1 if there is none): a float64 vector. The mean is Python's ``sum(live) / len(live)``, the
    live values added in order (a cumulative sum)."""
    live = rms > 0
    total = torch.cumsum(torch.where(live, rms, 0.0), 0)[-1]
    count = live.sum().double()
    mean = torch.where(count > 0, total / count, 1.0)
    return torch.where(live, mean / rms, 1.0)


def _squared_norms(tensors: Sequence[torch.Tensor]) -> torch.Tensor:
    """Per tensor the sum of its squared elements, accumulated in float64 (0 for an empty tensor): a float64 vector.
    Under sharding these are added over the shard group into whole-tensor squared norms."""
    return torch.stack(torch._foreach_norm([t.detach() for t in tensors], 2, dtype=torch.float64)).square()


def _maxima(tensors: Sequence[torch.Tensor]) -> torch.Tensor:
    """Per tensor its largest element (NaN if one is NaN), as a float64 vector; ``-inf`` for an empty tensor (a shard
    that holds none of a small tensor's rows, which the maximum over the shard group then ignores), where
    ``torch._foreach_max`` raises. Without empty tensors: exactly ``torch.stack(torch._foreach_max(tensors))``."""
    full = [t for t in tensors if t.numel()]
    if len(full) == len(tensors):
        return torch.stack(torch._foreach_max(list(tensors))).double()
    found = iter(torch._foreach_max(full) if full else ())
    return torch.stack([next(found).double() if t.numel() else torch.full((), -math.inf, dtype=torch.float64,
                                                                          device=t.device) for t in tensors])


def _lamb_figures_(ms: list[torch.Tensor], scratch: list[torch.Tensor], fresh: list[torch.Tensor],
                   roots: list[torch.Tensor], denominators: list[torch.Tensor], params: list[torch.Tensor],
                   group: dict[str, Any], bc1: float, squared: bool = False, with_norms: bool = False,
                   bound: Optional[float] = None
                   ) -> tuple[torch.Tensor, Optional[torch.Tensor], Optional[torch.Tensor]]:
    """The torch ops of the update's first part (any device, no host synchronisation): the fresh variance
    updated, ``u`` written into ``scratch`` (``u0`` clipped to ``[-bound, bound]`` first, with a ``bound``); returns
    per tensor the largest ratio (``-inf`` for an empty tensor) and,
    with weight decay or ``with_norms``, the norms of ``u0`` and ``u`` (float64 device vectors, the same vector twice
    without weight decay, where ``u = u0``; else ``None``). ``squared``: the squared norms instead, accumulated in
    float64 (:func:`_squared_norms`; what sharded parameters add over the shard group)."""
    (b1, b2), eps, wd = group["betas"], group["eps"], group["weight_decay"]
    # g_rec = (m - b1 m_last) / (1 - b1), in place: (b1 m_last - m) / -(1 - b1) is the same number, bit for bit
    torch._foreach_mul_(scratch, b1)
    torch._foreach_sub_(scratch, ms)
    torch._foreach_div_(scratch, -(1 - b1))
    torch._foreach_mul_(fresh, b2)
    torch._foreach_addcmul_(fresh, scratch, scratch, value=1 - b2)
    # factor = max((sqrt(v) + eps) / (sqrt(v_fresh) + eps))
    for s, v_fresh in zip(scratch, fresh):
        kernels.sqrt_into(v_fresh, s)
    torch._foreach_add_(scratch, eps)
    for s, root in zip(scratch, roots):
        torch.div(root, s, out=s)
    factor = _maxima(scratch)
    # u0 = (m / bc1) / (sqrt(v / bc2) + eps);  u = u0 + wd p  (with bc2 = 1 the denominators are the roots)
    for s, m in zip(scratch, ms):
        torch.div(m, bc1, out=s)
    torch._foreach_div_(scratch, denominators)
    if bound is not None:  # clamp keeps NaN, as the C kernel's ordered compares do
        torch._foreach_clamp_min_(scratch, -bound)
        torch._foreach_clamp_max_(scratch, bound)
    if not wd and not with_norms:
        return factor, None, None
    norms = _squared_norms if squared else (lambda ts: torch.stack(torch._foreach_norm(ts)).double())
    u0_norm = norms(scratch)
    if not wd:
        return factor, u0_norm, u0_norm
    # u0 + wd * p: addcmul multiplies p by wd (rounded) and then adds, as the two ops did
    torch._foreach_addcmul_(scratch, params, [_one(p) for p in params], value=wd)
    u_norm = norms(scratch)
    return factor, u0_norm, u_norm


def compressed_lamb_update_(params: list[torch.Tensor], states: list[dict[str, Any]], group: dict[str, Any],
                            corrections: tuple[float, float], backend: str,
                            reduce: Optional[Callable[..., tuple[Optional[torch.Tensor], Optional[torch.Tensor]]]],
                            bound: Optional[float] = None) -> None:
    """1-bit LAMB's update after the exchange (:class:`~lightning_onebit.OnebitLamb`'s compression stage), for these
    parameters (one device) and their optimizer ``states`` (the averaged ``exp_avg``, the frozen ``exp_avg_sq``,
    ``exp_avg_sq_fresh``, ``exp_avg_last``, ``lamb_coeff`` and ``lamb_last_factor``), with multi-tensor ops and no
    host synchronisation. ``corrections``: the bias corrections ``(bc1, bc2)``; ``backend``: the kernel backend;
    ``reduce``: for sharded parameters, what makes this rank's per-tensor maxima and sums the whole tensors'
    (:meth:`~lightning_onebit.optim.sharded.ShardedParams.reduce_tensor_figures`), else ``None``; ``bound``: every
    coordinate of ``u0 = m_hat / (sqrt(v_hat) + eps)`` is clipped to ``[-bound, bound]`` (``None``: not clipped).

    Scratch: each parameter's ``exp_avg_last`` (the previous momentum is only needed for the reconstructed gradient,
    and the optimizer rewrites it after the step), so the step allocates no full-size temporary; the frozen
    variance's ``sqrt(v) + eps`` and ``sqrt(v / bc2) + eps`` are computed once and cached
    (:mod:`lightning_onebit.kernels.frozen`). With the torch kernels every op and its rounding is the per-tensor
    version's except where a comment says otherwise. With the C kernels (CPU float32, kernel backend ``"auto"`` or
    ``"cpu"``) the fresh variance, the ratios, ``u`` and its norms come from one fused pass per tensor and the step
    from a second (:func:`~lightning_onebit.kernels.lamb_prepare_`), where the torch ops make about thirteen: the
    same arithmetic per element, norms summed in float64 (last-bit differences).

    Sharded parameters: the factor is the largest ratio over the whole tensor and the norms of ``u0``, ``u`` and
    (with the cap) ``p`` the whole tensor's (this rank's maxima and squared norms reduced over the shard group, one
    collective for these parameters; an empty shard gives ``-inf`` and 0, the C kernel's figures of no element)."""
    b1, b2 = group["betas"]
    eps, wd, lr = group["eps"], group["weight_decay"], group["lr"]
    bc1, bc2 = corrections
    sharded = reduce is not None
    ms, vs = [s["exp_avg"] for s in states], [s["exp_avg_sq"] for s in states]
    fresh, scratch = [s["exp_avg_sq_fresh"] for s in states], [s["exp_avg_last"] for s in states]
    roots = [_root_eps(v, eps) for v in vs]
    denominators = roots if bc2 == 1.0 else [_denominator(v, bc2, eps) for v in vs]
    native = kernels.uses_native_update((params, ms, vs, fresh, scratch), backend)
    cap = group["cap_trust_ratio"]
    if native:  # the same quantities in one C pass per tensor (CPU float32): scratch = u
        # (an empty tensor, a shard of none of a small tensor's rows, reads nothing: -inf, 0, 0)
        figures = kernels.lamb_prepare_(ms, scratch, fresh, roots, denominators, params, (b1, b2), eps, bc1, wd, bound)
        factor, squares = figures[:, 0], figures[:, 1:]
    else:
        factor, u0_norm, u_norm = _lamb_figures_(ms, scratch, fresh, roots, denominators, params, group, bc1,
                                                 squared=sharded, with_norms=cap, bound=bound)
        squares = torch.stack([u0_norm, u_norm], 1) if u_norm is not None else None
    p_norm = None
    if sharded:  # the squared norms added over the shard group, the maxima maxed over it
        if cap:
            squares = torch.cat([squares, _squared_norms(params).unsqueeze(1)], 1)
        factor, squares = reduce(params, factor, squares if wd or cap else None)
        assert factor is not None
    if squares is not None and (native or sharded):
        squares = kernels.sqrt_into(squares, torch.empty_like(squares))
    if squares is not None:
        u0_norm, u_norm = squares[:, 0], squares[:, 1]
        p_norm = squares[:, 2] if sharded and cap else None
    if wd:
        rho = torch.where(u_norm > 0, _py_min(1.0, u0_norm / u_norm), 1.0)
        factor = rho * factor + (1 - rho)
    factor = _py_min(_py_max(factor, group["factor_min"]), group["factor_max"])
    last_factors = [s["lamb_last_factor"] for s in states]
    last, threshold = torch.stack(last_factors), group["factor_threshold"]
    factor = _py_min(_py_max(factor, last * (1 - threshold)), last * (1 + threshold))
    torch._foreach_copy_(last_factors, factor.unbind(0))
    coeff = torch.stack([s["lamb_coeff"] for s in states])
    if cap:  # the frozen trust ratio, at most the live one: a step stays within factor * lr * ||p||
        if p_norm is None:
            p_norm = torch.stack(torch._foreach_norm([p.detach().float() for p in params])).double()
        coeff = _py_min(coeff, _clipped_ratios(p_norm, u_norm, group["min_coeff"], group["max_coeff"]))
    step = -lr * coeff * factor
    if native:  # CPU tensors: reading the steps is no device synchronisation
        kernels.lamb_apply_(params, scratch, step.tolist())
    else:
        # p - lr coeff factor u: addcmul with a device-side step (see OnebitLamb._lamb_step_ for its bits)
        torch._foreach_addcmul_(params, scratch, step.unbind(0))
