"""The algorithms' math, as small updates over lists of tensors (no optimizer, no communication): the moments (the fold
of a gradient into the momentum, the variance), the bias corrections, the masks, Adam's update with a frozen variance
and its bound, AdamW's step, and 1-bit LAMB's trust ratios, scaling coefficients and updates.

:class:`~lightning_onebit.OnebitAdam`, :class:`~lightning_onebit.ZeroOneAdam`, :class:`~lightning_onebit.OnebitLamb`
and the rule of ``freeze_step="auto"`` call these; the optimizers say which tensors and step counts go in and when the
exchange runs. Each function keeps the order of operations of the code it mirrors (``torch.optim``'s, or 1-bit LAMB's
per-tensor arithmetic in Python floats), so that the same inputs give the same bits. Square roots go through
:func:`~lightning_onebit.kernels.sqrt_into` (correctly rounded: the same bits on every processor). No function here
synchronises the host with the device.
"""

from __future__ import annotations

import math
from typing import Any, Callable, Optional, Sequence

import torch
from torch.optim.adamw import adamw as adamw_functional

from lightning_onebit import kernels
from lightning_onebit.kernels import Backend
from lightning_onebit.kernels import frozen as frozen_cache

#: Per-tensor reduction of 1-bit LAMB's figures over the ranks that hold other shards of the same tensors (sharded
#: parameters): ``reduce(params, maxima, sums) -> (maxima, sums)``, ``None`` without sharding.
FigureReduction = Optional[Callable[..., tuple[Optional[torch.Tensor], Optional[torch.Tensor]]]]


# ================================================================================================== the moments
def bias_corrections(group: dict[str, Any], t: int, t_v: int) -> tuple[float, float]:
    """``(1 - b1^t, 1 - b2^t_v)`` for the param group's betas, or ``(1, 1)`` without ``bias_correction``; ``t_v``: the
    number of updates the variance received (``t`` unless it was frozen or updated on some steps only)."""
    if not group["bias_correction"]:
        return 1.0, 1.0
    b1, b2 = group["betas"]
    return 1 - b1**t, 1 - b2**t_v


def fold_gradients_(exp_avgs: Sequence[torch.Tensor], grads: Sequence[Optional[torch.Tensor]], beta1: float) -> None:
    """``m = b1 m + (1 - b1) g`` (as ``lerp``, AdamW's form), in place. A ``None`` gradient is a zero one (``lerp``
    towards 0, the op that folds DDP's zero-filled bucket entries: the same bits whichever path folds it)."""
    weight = 1 - beta1
    live = [(m, g) for m, g in zip(exp_avgs, grads) if g is not None]
    if live:
        torch._foreach_lerp_([m for m, _ in live], [g for _, g in live], weight)
    decayed = [m for m, g in zip(exp_avgs, grads) if g is None]
    if decayed:
        torch._foreach_lerp_(decayed, [m.new_zeros(()).expand_as(m) for m in decayed], weight)


def update_variances_(exp_avg_sqs: Sequence[torch.Tensor], grads: Sequence[torch.Tensor], beta2: float) -> None:
    """``v = b2 v + (1 - b2) g^2``, in place."""
    torch._foreach_mul_(exp_avg_sqs, beta2)
    torch._foreach_addcmul_(exp_avg_sqs, grads, grads, value=1 - beta2)


def mask_like(masks: list[Optional[torch.Tensor]], index: int, like: torch.Tensor) -> torch.Tensor:
    """The mask ``masks[index]`` on ``like``'s device and dtype, converted once and cached in the mask list."""
    mask = masks[index]
    if mask.device != like.device or mask.dtype != like.dtype:
        mask = masks[index] = mask.to(device=like.device, dtype=like.dtype)
    return mask


def mask_(group: dict[str, Any], params: Sequence[torch.Tensor], tensors: Sequence[torch.Tensor],
          dead: dict[int, torch.Tensor]) -> None:
    """Multiply each of ``tensors`` (one per parameter of ``params``, of param group ``group``: momenta, exchanged
    gradients or updates) by its parameter's ``exp_avg_mask`` where it has one, and zero it where ``dead``
    (``id(param) -> bool tensor``: the dead or zero-variance coordinates) says."""
    masks, index = group["exp_avg_mask"], {id(q): i for i, q in enumerate(group["params"])}
    for p, x in zip(params, tensors):
        i = index[id(p)]
        if masks[i] is not None:
            x.mul_(mask_like(masks, i, x))
        zero = dead.get(id(p))
        if zero is not None:
            x.masked_fill_(zero, 0)


# ============================================================================================== Adam and AdamW
def adam_step_bound(betas: tuple[float, float], t: Optional[int] = None, bias_correction: bool = True) -> float:
    """The largest size a coordinate of an Adam update can have, in units of ``lr``: ``max |m_hat_t| / sqrt(v_hat_t)``
    over every sequence of gradients (``eps`` and weight decay aside), at step ``t``, or at any step (``t=None``).

    With ``m_t = (1 - b1) sum_k b1^k g_(t-k)`` and ``v_t = (1 - b2) sum_k b2^k g_(t-k)^2`` (``k = 0 .. t-1``), the
    Cauchy-Schwarz inequality over the pairs ``(b1^k / b2^(k/2), b2^(k/2) |g_(t-k)|)`` gives::

        |m_t| / sqrt(v_t) <= (1 - b1) sqrt(S_t / (1 - b2)),   S_t = sum_k (b1^2 / b2)^k

    and bias correction multiplies the ratio by ``sqrt(1 - b2^t) / (1 - b1^t)``. The bound is attained (by gradients
    ``|g_(t-k)|`` proportional to ``(b1 / b2)^k``). It grows with ``t`` (bias-corrected: 1 at step 1, 2.24 at step 100,
    5.78 at step 1000 for betas (0.9, 0.999)) towards, for ``b1^2 < b2``, the bound over all steps::

        B = (1 - b1) / sqrt((1 - b2) (1 - b1^2 / b2))          (7.27 for (0.9, 0.999), 1.70 for (0.9, 0.98))

    The typical size is well below 1. ``inf`` where no bound exists (``b1^2 >= b2`` over all steps, ``b2 = 0``)."""
    b1, b2 = betas
    if b2 == 0:  # v_t = g_t^2: |m_t| / |g_t| is unbounded unless b1 = 0
        return 1.0 if b1 == 0 else math.inf
    ratio = b1 * b1 / b2
    if t is None:
        return (1 - b1) / math.sqrt((1 - b2) * (1 - ratio)) if ratio < 1 else math.inf
    if ratio == 1:
        total = float(t)
    else:
        try:
            total = (1 - ratio**t) / (1 - ratio)
        except OverflowError:
            return math.inf
    if not math.isfinite(total):
        return math.inf
    bound = (1 - b1) * math.sqrt(total / (1 - b2))
    if bias_correction:
        bound *= math.sqrt(1 - b2**t) / (1 - b1**t)
    return bound


def adam_update_(group: dict[str, Any], params: list[torch.Tensor], exp_avgs: list[torch.Tensor],
                 exp_avg_sqs: list[torch.Tensor], t: int, t_v: int, backend: Backend = "torch",
                 bound: Optional[float] = None) -> None:
    """``p = p (1 - lr wd) - lr/bc1 * m / (sqrt(v)/sqrt(bc2) + eps)``, in AdamW's order of operations, with
    ``bc1 = 1 - b1^t`` and ``bc2 = 1 - b2^t_v`` (``t_v``: the number of updates ``v`` received), or neither without
    ``bias_correction``.

    ``bound``: every coordinate of ``m_hat / (sqrt(v_hat) + eps)`` is clipped to ``[-bound, bound]`` before it is
    applied (the stored momentum is not changed; where the clip does not bind, the update is the unclipped one to the
    last bit). ``None`` (default): no clip.

    Warmup without torch's fused AdamW kernel uses the torch ``_foreach`` ops here (as AdamW does); the
    compression stage passes its kernel backend, which on CPU makes this one fused pass per parameter.

    ``t_v < t`` means that ``v`` was not updated by this step (it is frozen: the compression stage, or 0/1 Adam
    between variance steps), so the torch path caches the denominator ``sqrt(v)/sqrt(bc2) + eps`` until ``v``, ``eps``
    or ``bc2`` change (:func:`~lightning_onebit.kernels.frozen_adam_denominators`; same bits, two passes instead of
    five, no temporary).
    """
    lr, eps, wd = group["lr"], group["eps"], group["weight_decay"]
    bias_correction1, bias_correction2 = bias_corrections(group, t, t_v)
    kernels.frozen_adam_update_(
        params, exp_avgs, exp_avg_sqs, decay=1 - lr * wd if wd != 0 else None,
        bias_correction2_sqrt=math.sqrt(bias_correction2), eps=eps, step=-lr / bias_correction1, backend=backend,
        frozen=t_v < t, limit=None if bound is None or math.isinf(bound) else bound * bias_correction1,
    )


def adamw_step_(group: dict[str, Any], params: list[torch.Tensor], grads: list[torch.Tensor],
                exp_avgs: list[torch.Tensor], exp_avg_sqs: list[torch.Tensor], t: int,
                momentum_masks: Optional[Sequence[tuple[int, torch.Tensor]]] = None) -> None:
    """Step ``t`` of :class:`torch.optim.AdamW` on ``grads``: momentum and variance updated, bias corrections
    ``1 - b1^t`` and ``1 - b2^t``. ``momentum_masks``: ``(index into params, mask)`` pairs that multiply those
    momenta after the gradient is folded in (a masked coordinate keeps a zero momentum).

    Runs torch's fused AdamW kernel (one pass instead of seven foreach passes) where it applies: no masks, bias
    correction on, dense float32/float64 tensors on CPU or CUDA."""
    b1, b2 = group["betas"]
    if not momentum_masks and group["bias_correction"] and _fused_adamw_supports(params, grads, exp_avgs, exp_avg_sqs):
        # The fused kernel increments the step tensors before using them, so they start at t - 1 (one per
        # parameter: each is incremented).
        steps = _step_tensors(params, t - 1)
        adamw_functional(
            params, grads, exp_avgs, exp_avg_sqs, [], steps, fused=True, amsgrad=False, beta1=b1, beta2=b2,
            lr=group["lr"], weight_decay=group["weight_decay"], eps=group["eps"], maximize=False,
        )
        return
    fold_gradients_(exp_avgs, grads, b1)
    for k, mask in momentum_masks or ():
        exp_avgs[k].mul_(mask)
    update_variances_(exp_avg_sqs, grads, b2)
    adam_update_(group, params, exp_avgs, exp_avg_sqs, t, t)


def accumulate_update_(group: dict[str, Any], updates: list[torch.Tensor], exp_avgs: list[torch.Tensor],
                       t: int) -> None:
    """A local step's momentum step added to the sum since the last sync (0/1 Adam): ``U = U + lr m / bc1``, before
    the update is applied (:func:`sync_update_` averages ``U``)."""
    torch._foreach_add_(updates, exp_avgs, alpha=group["lr"] / bias_corrections(group, t, t)[0])


def sync_update_(group: dict[str, Any], params: list[torch.Tensor], updates: list[torch.Tensor],
                 exp_avgs: list[torch.Tensor], exp_avg_sqs: list[torch.Tensor], synced: list[torch.Tensor],
                 lr_sum: float, decay: float, t: int, t_v: int, backend: Backend) -> None:
    """The sync of local steps (0/1 Adam), from the averaged sum of the momentum steps ``W`` (``updates``), the
    learning rates summed since the last sync and the product of the weight-decay factors ``decay``::

        m = W bc1 / lr_sum;  p = p_sync decay - W / (sqrt(v / bc2) + eps);  p_sync = p

    (``lr_sum = 0``: ``m = W``, the averaged momenta, and ``p = p_sync``). Only rank-identical values go in, so the
    replicas are identical after it. ``t_v``: the updates the variance received (its bias correction)."""
    torch._foreach_copy_(exp_avgs, updates)
    if lr_sum == 0:
        torch._foreach_copy_(params, synced)
        return
    torch._foreach_mul_(exp_avgs, bias_corrections(group, t, t)[0] / lr_sum)
    bc2_sqrt, eps = math.sqrt(bias_corrections(group, t, t_v)[1]), group["eps"]
    if kernels.uses_native_update((params, exp_avgs, exp_avg_sqs), backend):
        # the C kernel's local steps keep no cached denominator: a temporary per tensor, as they need none
        denominators = [kernels.sqrt_into(v, torch.empty_like(v)).div_(bc2_sqrt).add_(eps) for v in exp_avg_sqs]
    else:  # the torch path's local steps cached them (the frozen variance's): the same bits, no pass
        denominators = kernels.frozen_adam_denominators(exp_avg_sqs, bc2_sqrt, eps)
    torch._foreach_copy_(params, synced)
    if decay != 1.0:
        torch._foreach_mul_(params, decay)
    torch._foreach_addcdiv_(params, updates, denominators, value=-1.0)
    torch._foreach_copy_(synced, params)


def _step_tensors(params: Sequence[torch.Tensor], value: int) -> list[torch.Tensor]:
    """One float32 step tensor per parameter, holding ``value``, on that parameter's device.

    The fused kernel reads each step through a ``float*`` on the parameters' device and refuses a CPU step next to
    CUDA parameters, so the steps are made where the parameters live: one fill kernel per device (the steps are
    0-dim views of it), no host-to-device copy and no synchronisation.
    """
    by_device: dict[torch.device, list[int]] = {}
    for i, p in enumerate(params):
        by_device.setdefault(p.device, []).append(i)
    steps: list[Optional[torch.Tensor]] = [None] * len(params)
    for device, indices in by_device.items():
        for i, step in zip(indices, torch.full((len(indices),), float(value), dtype=torch.float32, device=device)):
            steps[i] = step
    return steps  # type: ignore[return-value]


def _fused_adamw_supports(*tensor_lists: Sequence[torch.Tensor]) -> bool:
    """Whether torch's fused AdamW kernel takes these tensors: dense float32/float64 on CPU or CUDA."""
    return all(t.device.type in ("cpu", "cuda") and t.dtype in (torch.float32, torch.float64) and not t.is_sparse
               for tensors in tensor_lists for t in tensors)


# ================================================================================================== 1-bit LAMB
def _py_max(a: Any, b: Any) -> torch.Tensor:
    """Python's ``max(a, b)`` elementwise (``a`` unless ``b > a``: NaN handled as Python does)."""
    return torch.where(b > a, b, a)


def _py_min(a: Any, b: Any) -> torch.Tensor:
    """Python's ``min(a, b)`` elementwise (``a`` unless ``b < a``)."""
    return torch.where(b < a, b, a)


def trust_ratios(params: Sequence[torch.Tensor], updates: Sequence[torch.Tensor], low: float, high: float
                 ) -> torch.Tensor:
    """LAMB's ``clip(||p|| / ||u||, low, high)`` per tensor, 1 where either norm is 0: a float64 vector on the
    parameters' device (norms in float32, as ``float(p.float().norm())`` read them, then the Python arithmetic)."""
    p_norms = torch.stack(torch._foreach_norm([p.detach().float() for p in params])).double()
    u_norms = torch.stack(torch._foreach_norm([u.float() for u in updates])).double()
    return clipped_ratios(p_norms, u_norms, low, high)


def clipped_ratios(p_norms: torch.Tensor, u_norms: torch.Tensor, low: float, high: float) -> torch.Tensor:
    """``clip(p_norms / u_norms, low, high)``, 1 where either norm is 0 (float64 vectors)."""
    ratios = _py_min(_py_max(p_norms / u_norms, low), high)
    return torch.where((p_norms == 0) | (u_norms == 0), 1.0, ratios)


def scaling_coefficients(rms: torch.Tensor) -> torch.Tensor:
    """1-bit LAMB's ``mean(rms) / rms`` per tensor over the tensors whose momentum ``rms`` is nonzero (1 for the
    others, and a mean of 1 if there is none): a float64 vector. The mean is Python's ``sum(live) / len(live)``, the
    live values added in order (a cumulative sum)."""
    live = rms > 0
    total = torch.cumsum(torch.where(live, rms, 0.0), 0)[-1]
    count = live.sum().double()
    mean = torch.where(count > 0, total / count, 1.0)
    return torch.where(live, mean / rms, 1.0)


def squared_norms(tensors: Sequence[torch.Tensor]) -> torch.Tensor:
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


def lamb_update_(group: dict[str, Any], params: list[torch.Tensor], exp_avgs: list[torch.Tensor],
                 exp_avg_sqs: list[torch.Tensor], coeffs: list[torch.Tensor], corrections: tuple[float, float],
                 reduce: FigureReduction = None) -> None:
    """LAMB's update after the moments (warmup), for these parameters (one device) with their trust-ratio EMAs
    ``coeffs`` (0-dim float64 tensors)::

        u = m_hat / (sqrt(v_hat) + eps) + wd p;  r = clip(||p|| / ||u||, min_coeff, max_coeff)  (1 if a norm is 0)
        coeff = coeff_beta coeff + (1 - coeff_beta) r  (not where r is 1);  p = p - lr r u

    ``corrections``: ``(bc1, bc2)``. The trust ratios and EMAs are computed on the device in float64, the Python
    arithmetic of the per-tensor version op for op. ``reduce`` (sharded parameters): the norms are the whole tensors',
    from this rank's squared norms added over the shard group (one collective). ``p - s u`` is ``addcmul`` with a
    device-side ``s``, where the per-tensor version called ``p.add_(u, alpha=-lr * r)``: the same bits in float32
    (tested); with bf16/fp16 parameters ``addcmul`` rounds ``s`` to their dtype first (last-bit differences)."""
    bc1, bc2 = corrections
    us = torch._foreach_div(exp_avgs, bc1)
    denominators = torch._foreach_div(exp_avg_sqs, bc2)
    kernels.foreach_sqrt_(denominators)
    torch._foreach_add_(denominators, group["eps"])
    torch._foreach_div_(us, denominators)
    del denominators
    if group["weight_decay"]:
        torch._foreach_add_(us, params, alpha=group["weight_decay"])
    if reduce is not None:
        _, squares = reduce(params, None, torch.stack([squared_norms(params), squared_norms(us)], 1))
        norms = kernels.sqrt_into(squares, torch.empty_like(squares))
        ratios = clipped_ratios(norms[:, 0], norms[:, 1], group["min_coeff"], group["max_coeff"])
    else:
        ratios = trust_ratios(params, us, group["min_coeff"], group["max_coeff"])
    beta, coeff = group["coeff_beta"], torch.stack(coeffs)
    # the EMA skips tensors whose ratio is 1 (a zero norm)
    torch._foreach_copy_(coeffs, torch.where(ratios != 1.0, beta * coeff + (1 - beta) * ratios, coeff).unbind(0))
    torch._foreach_addcmul_(params, us, (ratios * -group["lr"]).unbind(0))


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


def _lamb_figures_(ms: list[torch.Tensor], scratch: list[torch.Tensor], fresh: list[torch.Tensor],
                   roots: list[torch.Tensor], denominators: list[torch.Tensor], params: list[torch.Tensor],
                   group: dict[str, Any], bc1: float, squared: bool = False, with_norms: bool = False,
                   bound: Optional[float] = None
                   ) -> tuple[torch.Tensor, Optional[torch.Tensor], Optional[torch.Tensor]]:
    """The torch ops of the compressed update's first part: the fresh variance updated, ``u`` written into
    ``scratch`` (``u0`` clipped to ``[-bound, bound]`` first, with a ``bound``); returns per tensor the largest ratio
    (``-inf`` for an empty tensor) and, with weight decay or ``with_norms``, the norms of ``u0`` and ``u`` (float64
    device vectors, the same vector twice without weight decay, where ``u = u0``; else ``None``). ``squared``: the
    squared norms instead, accumulated in float64 (:func:`squared_norms`; what sharded parameters add up)."""
    (b1, b2), eps, wd = group["betas"], group["eps"], group["weight_decay"]
    # g_rec = (m - b1 m_last) / (1 - b1), in place: (b1 m_last - m) / -(1 - b1) is the same number, bit for bit
    torch._foreach_mul_(scratch, b1)
    torch._foreach_sub_(scratch, ms)
    torch._foreach_div_(scratch, -(1 - b1))
    update_variances_(fresh, scratch, b2)
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
    norms = squared_norms if squared else (lambda ts: torch.stack(torch._foreach_norm(ts)).double())
    u0_norm = norms(scratch)
    if not wd:
        return factor, u0_norm, u0_norm
    # u0 + wd * p: addcmul multiplies p by wd (rounded) and then adds, as the two ops did
    torch._foreach_addcmul_(scratch, params, [torch.ones((), dtype=p.dtype, device=p.device) for p in params],
                            value=wd)
    return factor, u0_norm, norms(scratch)


def compressed_lamb_update_(params: list[torch.Tensor], states: list[dict[str, Any]], group: dict[str, Any],
                            corrections: tuple[float, float], backend: str, reduce: FigureReduction,
                            bound: Optional[float] = None) -> None:
    """1-bit LAMB's update after the exchange (:class:`~lightning_onebit.OnebitLamb`'s compression stage), for these
    parameters (one device) and their optimizer ``states`` (the averaged ``exp_avg``, the frozen ``exp_avg_sq``,
    ``exp_avg_sq_fresh``, ``exp_avg_last``, ``lamb_coeff`` and ``lamb_last_factor``). ``corrections``: ``(bc1,
    bc2)``; ``backend``: the kernel backend; ``reduce``: for sharded parameters, what makes this rank's per-tensor
    maxima and sums the whole tensors' (one collective; an empty shard gives ``-inf`` and 0), else ``None``;
    ``bound``: every coordinate of ``u0 = m_hat / (sqrt(v_hat) + eps)`` is clipped to ``[-bound, bound]``.

    Scratch: each parameter's ``exp_avg_last`` (the previous momentum is only needed for the reconstructed gradient,
    and the optimizer rewrites it after the step), so the step allocates no full-size temporary; the frozen
    variance's ``sqrt(v) + eps`` and ``sqrt(v / bc2) + eps`` are cached (:mod:`lightning_onebit.kernels.frozen`).
    With the torch kernels every op and its rounding is the per-tensor version's except where a comment says
    otherwise. With the C kernels (CPU float32) the fresh variance, the ratios, ``u`` and its norms come from one
    fused pass per tensor and the step from a second (:func:`~lightning_onebit.kernels.lamb_prepare_`), where the
    torch ops make about thirteen: the same arithmetic per element, norms summed in float64 (last-bit differences)."""
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
        figures = kernels.lamb_prepare_(ms, scratch, fresh, roots, denominators, params, (b1, b2), eps, bc1, wd, bound)
        factor, squares = figures[:, 0], figures[:, 1:]
    else:
        factor, u0_norm, u_norm = _lamb_figures_(ms, scratch, fresh, roots, denominators, params, group, bc1,
                                                 squared=sharded, with_norms=cap, bound=bound)
        squares = torch.stack([u0_norm, u_norm], 1) if u_norm is not None else None
    p_norm = None
    if sharded:  # the squared norms added over the shard group, the maxima maxed over it
        if cap:
            squares = torch.cat([squares, squared_norms(params).unsqueeze(1)], 1)
        factor, squares = reduce(params, factor, squares if wd or cap else None)
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
        coeff = _py_min(coeff, clipped_ratios(p_norm, u_norm, group["min_coeff"], group["max_coeff"]))
    step = -lr * coeff * factor
    if native:  # CPU tensors: reading the steps is no device synchronisation
        kernels.lamb_apply_(params, scratch, step.tolist())
    else:  # p - lr coeff factor u: addcmul with a device-side step (see lamb_update_ for its bits)
        torch._foreach_addcmul_(params, scratch, step.unbind(0))
