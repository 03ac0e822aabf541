"""The algorithms' shared math as small pure updates over lists of tensors (no optimizer, no communication).

:class:`~lightning_onebit.OnebitAdam`, :class:`~lightning_onebit.ZeroOneAdam` and :class:`~lightning_onebit.OnebitLamb`
are recipes over these: which gradients, which moments and which step counts go in, and when the exchange runs. Each
function keeps the order of operations of the ``torch.optim`` code it mirrors, so that the same inputs give the same
bits.
"""

from __future__ import annotations

import math
from typing import Any, Optional, Sequence

import torch
from torch.optim.adamw import adamw as adamw_functional

from lightning_onebit import kernels
from lightning_onebit.kernels import Backend


def bias_corrections(group: dict[str, Any], t: int, t_v: int) -> tuple[float, float]:
    """``(1 - b1^t, 1 - b2^t_v)`` for the param group's betas, or ``(1, 1)`` without ``bias_correction``; ``t_v``: the
    number of updates the variance received (``t`` unless it was frozen or updated on some steps only)."""
    if not group["bias_correction"]:
        return 1.0, 1.0
    b1, b2 = group["betas"]
    return 1 - b1**t, 1 - b2**t_v


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


def fold_gradients_(exp_avgs: Sequence[torch.Tensor], grads: Sequence[torch.Tensor], beta1: float) -> None:
    """``m = b1 m + (1 - b1) g`` (as ``lerp``, AdamW's form), in place."""
    torch._foreach_lerp_(exp_avgs, grads, 1 - beta1)


def update_variances_(exp_avg_sqs: Sequence[torch.Tensor], grads: Sequence[torch.Tensor], beta2: float) -> None:
    """``v = b2 v + (1 - b2) g^2``, in place."""
    torch._foreach_mul_(exp_avg_sqs, beta2)
    torch._foreach_addcmul_(exp_avg_sqs, grads, grads, value=1 - beta2)


def adam_update_(
    group: dict[str, Any],
    params: list[torch.Tensor],
    exp_avgs: list[torch.Tensor],
    exp_avg_sqs: list[torch.Tensor],
    t: int,
    t_v: int,
    backend: Backend = "torch",
    bound: Optional[float] = None,
) -> None:
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
    five, no temporary). Host synchronisations: none (every argument but the tensors is a Python number).
    """
    lr, eps, wd = group["lr"], group["eps"], group["weight_decay"]
    bias_correction1, bias_correction2 = bias_corrections(group, t, t_v)
    kernels.frozen_adam_update_(
        params,
        exp_avgs,
        exp_avg_sqs,
        decay=1 - lr * wd if wd != 0 else None,
        bias_correction2_sqrt=math.sqrt(bias_correction2),
        eps=eps,
        step=-lr / bias_correction1,
        backend=backend,
        frozen=t_v < t,
        limit=None if bound is None or math.isinf(bound) else bound * bias_correction1,
    )


def adamw_step_(
    group: dict[str, Any],
    params: list[torch.Tensor],
    grads: list[torch.Tensor],
    exp_avgs: list[torch.Tensor],
    exp_avg_sqs: list[torch.Tensor],
    t: int,
    momentum_masks: Optional[Sequence[tuple[int, torch.Tensor]]] = None,
) -> None:
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
    return all(
        t.device.type in ("cpu", "cuda") and t.dtype in (torch.float32, torch.float64) and not t.is_sparse
        for tensors in tensor_lists
        for t in tensors
    )
