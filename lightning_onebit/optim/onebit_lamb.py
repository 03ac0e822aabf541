"""1-bit LAMB (arXiv 2104.06069) as a ``torch.optim.Optimizer`` over plain ``torch.distributed``."""

from __future__ import annotations

import math
from typing import Any, Iterable, Literal, Optional, Sequence, Union

import torch
import torch.distributed as dist

from lightning_onebit.kernels import Backend
from lightning_onebit.optim.auto_freeze import AutoFreeze
from lightning_onebit.optim.base import DEFAULT_BUCKET_CAP_MB, CompressedOptimizer, _is_real, _mask_like
from lightning_onebit.topology import Topology


class OnebitLamb(CompressedOptimizer):
    r"""1-bit LAMB: LAMB during warmup, then LAMB with a frozen variance and 1-bit compressed momentum averaging.

    The large-batch member of the family (up to 4.6x less volume than LAMB at batch 8K-64K in the paper).

    **Warmup** (steps ``1..freeze_step``, gradients averaged by the caller: DDP, or the ``onebit_adam`` strategy),
    LAMB per parameter tensor::

        m = b1 m + (1 - b1) g;  v = b2 v + (1 - b2) g^2
        u = m_hat / (sqrt(v_hat) + eps) + wd p
        r = clip(||p|| / ||u||, min_coeff, max_coeff)      (1 if either norm is 0)
        coeff = coeff_beta coeff + (1 - coeff_beta) r      (an EMA from 0, not updated when r is 1)
        p = p - lr r u

    **Compression** (steps ``freeze_step + 1`` on, local gradients). At the first compressed step, per tensor,
    ``scaling_coeff = mean_over_tensors(rms) / rms`` with ``rms = ||m|| / sqrt(numel)`` (1 for an all-zero tensor,
    where DeepSpeed divided by zero): momenta of very different magnitudes then share a bucket fairly. Each step::

        m = CompressedAllreduce((b1 m + (1 - b1) g_local) scaling_coeff) / scaling_coeff * mask
        g_rec = (m - b1 m_last) / (1 - b1)                 (the averaged gradient, reconstructed)
        v_fresh = b2 v_fresh + (1 - b2) g_rec^2            (seeded with v at the first compressed step)
        u0 = m_hat / (sqrt(v_hat_frozen) + eps);  u = u0 + wd p
        factor = max((sqrt(v) + eps) / (sqrt(v_fresh) + eps))          (per tensor, raw v)
        factor = rho factor + (1 - rho), rho = min(1, ||u0|| / ||u||)  (only with weight decay)
        factor = clip(factor, factor_min, factor_max), then within last_factor (1 +- factor_threshold)
        p = p - lr coeff factor u

    Everything after the exchange depends only on rank-identical values, so replicas stay bit-identical. Bias
    correction (``bias_correction=True``) divides ``m`` by ``1 - b1^t`` and ``v`` by ``1 - b2^min(t, freeze_step)``,
    as :class:`~lightning_onebit.OnebitAdam` does (DeepSpeed accepted the flag and ignored it; with
    ``bias_correction=False`` this is DeepSpeed's update, its step ``t`` being this one's ``t``). bf16 works (DeepSpeed
    refused it). ``scaling_coeff``, ``coeff`` and ``last_factor`` (Python floats), ``v_fresh`` and the previous
    momentum are per-parameter optimizer state, saved and restored with it.

    A param group with ``compress=False`` (see :class:`~lightning_onebit.OnebitAdam`) takes the warmup's LAMB step
    above in the compression stage too, on its gradients averaged in full precision by :meth:`step` (its variance
    and trust-ratio EMA stay live; no scaling coefficient, factor or fresh variance). Cost: ``2 (P-1)/P * 4`` bytes
    per element per step in fp32, as DDP for that group; for embeddings, small or sparse groups.

    Args:
        params, lr, betas, eps, weight_decay, freeze_step, auto_freeze, bias_correction, bucket_cap_mb,
            process_group, kernel_backend, topology, warn_dead_coordinates: as for :class:`~lightning_onebit.OnebitAdam`
            (``weight_decay`` is added to the update before the trust ratio, as in LAMB; ``freeze_step="auto"`` also
            waits for every tensor's trust-ratio EMA to settle).
        max_coeff: upper clip of the warmup trust ratio ``r``. Default ``10.0``.
        min_coeff: lower clip of ``r``, ``> 0``. Default ``0.01``.
        coeff_beta: EMA rate of the trust ratio, in ``[0, 1)``. Default ``0.9``.
        factor_max: upper clip of the compression-stage factor. Default ``4.0``.
        factor_min: lower clip of the factor, ``> 0``. Default ``0.5``.
        factor_threshold: the factor changes by at most this fraction per step, ``>= 0``. Default ``0.1``.
    """

    def __init__(
        self,
        params: Union[Iterable[torch.Tensor], Iterable[dict[str, Any]]],
        lr: float = 1e-3,
        betas: tuple[float, float] = (0.9, 0.999),
        eps: float = 1e-8,
        weight_decay: float = 0.0,
        *,
        freeze_step: Union[int, Literal["auto"]],
        auto_freeze: Optional[AutoFreeze] = None,
        max_coeff: float = 10.0,
        min_coeff: float = 0.01,
        coeff_beta: float = 0.9,
        factor_max: float = 4.0,
        factor_min: float = 0.5,
        factor_threshold: float = 0.1,
        bias_correction: bool = True,
        bucket_cap_mb: float = DEFAULT_BUCKET_CAP_MB,
        process_group: Optional[dist.ProcessGroup] = None,
        kernel_backend: Backend = "auto",
        topology: Optional[Topology] = None,
        warn_dead_coordinates: bool = True,
    ) -> None:
        for name, value in (("max_coeff", max_coeff), ("min_coeff", min_coeff), ("factor_max", factor_max),
                            ("factor_min", factor_min), ("factor_threshold", factor_threshold),
                            ("coeff_beta", coeff_beta)):
            if not _is_real(value) or not math.isfinite(value):
                raise ValueError(f"{name} must be a finite number, got {value!r}")
        if not 0 < min_coeff <= max_coeff:
            raise ValueError(f"need 0 < min_coeff <= max_coeff, got min_coeff={min_coeff}, max_coeff={max_coeff}")
        if not 0 < factor_min <= factor_max:
            raise ValueError(f"need 0 < factor_min <= factor_max, got factor_min={factor_min}, factor_max={factor_max}")
        if not factor_threshold >= 0:
            raise ValueError(f"factor_threshold must be >= 0, got {factor_threshold}")
        if not 0 <= coeff_beta < 1:
            raise ValueError(f"coeff_beta must be in [0, 1), got {coeff_beta}")
        defaults = dict(
            lr=lr, betas=betas, eps=eps, weight_decay=weight_decay, bias_correction=bias_correction,
            max_coeff=float(max_coeff), min_coeff=float(min_coeff), coeff_beta=float(coeff_beta),
            factor_max=float(factor_max), factor_min=float(factor_min), factor_threshold=float(factor_threshold),
        )
        super().__init__(
            params,
            defaults,
            freeze_step=freeze_step,
            auto_freeze=auto_freeze,
            bucket_cap_mb=bucket_cap_mb,
            process_group=process_group,
            kernel_backend=kernel_backend,
            topology=topology,
            warn_dead_coordinates=warn_dead_coordinates,
        )

    # ------------------------------------------------------------------ warmup: LAMB
    def _warmup_step(self) -> None:
        self._lamb_step_(self.param_groups, compression_stage=False)

    def _full_precision_update_(self, groups: Sequence[dict[str, Any]]) -> None:
        self._lamb_step_(groups, compression_stage=True)

    def _lamb_step_(self, groups: Sequence[dict[str, Any]], compression_stage: bool) -> None:
        """Step ``t`` of LAMB on the (averaged) gradients of these groups. In warmup it records nonzero gradients of
        the compressed groups for the dead-coordinate warning; in the compression stage (``compress=False`` groups)
        explicit ``exp_avg_mask`` multiply the momentum after the gradient is folded in."""
        t = self._step
        for group in groups:
            b1, b2 = group["betas"]
            bc1, bc2 = _bias_corrections(group, t, t)
            masks = group["exp_avg_mask"]
            for i, p in enumerate(group["params"]):
                if p.grad is None:
                    continue
                state = self._moment_state(p)
                state.setdefault("lamb_coeff", 0.0)
                if self.warn_dead_coordinates and group["compress"] and not compression_stage:
                    self._track_nonzero(p)
                m, v, g = state["exp_avg"], state["exp_avg_sq"], p.grad
                m.lerp_(g, 1 - b1)
                if compression_stage and masks[i] is not None:
                    m.mul_(_mask_like(masks, i, m))
                v.mul_(b2).addcmul_(g, g, value=1 - b2)
                u = (m / bc1) / ((v / bc2).sqrt_().add_(group["eps"]))
                if group["weight_decay"]:
                    u.add_(p, alpha=group["weight_decay"])
                ratio = _trust_ratio(p, u, group["min_coeff"], group["max_coeff"])
                if ratio != 1.0:
                    beta = group["coeff_beta"]
                    state["lamb_coeff"] = beta * state["lamb_coeff"] + (1 - beta) * ratio
                p.add_(u, alpha=-group["lr"] * ratio)

    def _on_freeze(self) -> None:
        self._remember_momenta()  # the first compressed step reconstructs the gradient from them

    def _settling_figures(self) -> torch.Tensor:
        """freeze_step='auto' also waits for every compressed tensor's trust-ratio EMA (the coefficient that gets
        frozen; ``compress=False`` groups keep updating theirs)."""
        return torch.tensor(
            [self.state[p].get("lamb_coeff", 0.0) for group in self.param_groups if group["compress"]
             for p in group["params"] if p.requires_grad],
            dtype=torch.float64,
        )

    # ------------------------------------------------------------------ compression stage
    def _compressed_step(self) -> None:
        self._step_uncompressed_groups_()  # compress=False groups: full-precision gradient average, LAMB
        if not self._exchange_scale:
            self._set_scaling_coefficients()
        self._remember_momenta(missing_only=True)  # a group that became compressed on resume
        self._average_momenta_()
        t, t_v = self._step, self.freeze_step
        for group in self.param_groups:
            params = self._updated_params(group)
            if not params:
                continue
            b1, b2 = group["betas"]
            eps, wd, lr = group["eps"], group["weight_decay"], group["lr"]
            bc1, bc2 = _bias_corrections(group, t, t_v)
            for p in params:
                state = self.state[p]
                m, v = state["exp_avg"], state["exp_avg_sq"]
                v_fresh = state.get("exp_avg_sq_fresh")
                if v_fresh is None:  # seeded at the first compressed step, whatever freeze_step was
                    v_fresh = state["exp_avg_sq_fresh"] = v.clone()
                g_rec = (m - b1 * state["exp_avg_last"]) / (1 - b1)
                v_fresh.mul_(b2).addcmul_(g_rec, g_rec, value=1 - b2)
                denom = (v / bc2).sqrt_().add_(eps)
                u0 = (m / bc1) / denom
                u = u0 + wd * p if wd else u0
                factor = float(((v.sqrt() + eps) / (v_fresh.sqrt() + eps)).max())
                if wd:
                    u_norm = float(u.norm())
                    rho = min(1.0, float(u0.norm()) / u_norm) if u_norm > 0 else 1.0
                    factor = rho * factor + (1 - rho)
                factor = min(max(factor, group["factor_min"]), group["factor_max"])
                last = state.get("lamb_last_factor", 1.0)
                threshold = group["factor_threshold"]
                factor = min(max(factor, last * (1 - threshold)), last * (1 + threshold))
                state["lamb_last_factor"] = factor
                p.add_(u, alpha=-lr * state["lamb_coeff"] * factor)
        self._remember_momenta()

    def _remember_momenta(self, missing_only: bool = False) -> None:
        """Keep the (averaged) momenta of the compressed groups for the next step's gradient reconstruction; they are
        taken before the next backward, so the overlap hook may fold into the momenta while this copy stays.
        ``missing_only``: only for parameters without a copy (a group switched to ``compress=True`` on resume, before
        its first compressed step: nothing has been folded into its momenta yet)."""
        for group in self.param_groups:
            for p in self._updated_params(group):
                state = self.state[p]
                if "exp_avg" not in state or (missing_only and "exp_avg_last" in state):
                    continue
                last = state.get("exp_avg_last")
                if last is None or last.shape != p.shape:
                    state["exp_avg_last"] = state["exp_avg"].detach().clone()
                else:
                    last.copy_(state["exp_avg"])

    def _set_scaling_coefficients(self) -> None:
        """Per compressed tensor ``mean_over_tensors(rms) / rms`` from the momenta at the end of warmup
        (rank-identical: warmup averaged the gradients); 1 for an all-zero momentum. Kept in the state, so a resume
        keeps them; a tensor without one (its group switched to ``compress=True`` on resume) gets one from the current
        momenta, the others keep theirs."""
        trainable = [p for group in self.param_groups if group["compress"] for p in group["params"] if p.requires_grad]
        missing = [p for p in trainable if "lamb_scaling_coeff" not in self.state[p]]
        if missing:
            rms = {}
            for p in trainable:
                m = self.state[p].get("exp_avg")
                rms[id(p)] = 0.0 if m is None else float(m.float().norm()) / math.sqrt(max(p.numel(), 1))
            live = [r for r in rms.values() if r > 0]
            mean = sum(live) / len(live) if live else 1.0
            for p in missing:
                self.state[p]["lamb_scaling_coeff"] = mean / rms[id(p)] if rms[id(p)] > 0 else 1.0
        self._exchange_scale = {id(p): self.state[p]["lamb_scaling_coeff"] for p in trainable}

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        super().load_state_dict(state_dict)
        self._exchange_scale = {}  # re-read from the loaded state at the next compressed step


def _bias_corrections(group: dict[str, Any], t: int, t_v: int) -> tuple[float, float]:
    """``(1 - b1^t, 1 - b2^t_v)``, or ``(1, 1)`` without bias correction."""
    if not group["bias_correction"]:
        return 1.0, 1.0
    b1, b2 = group["betas"]
    return 1 - b1**t, 1 - b2**t_v


def _trust_ratio(p: torch.Tensor, u: torch.Tensor, low: float, high: float) -> float:
    """LAMB's ``clip(||p|| / ||u||, low, high)``, 1 when either norm is 0."""
    p_norm, u_norm = float(p.detach().float().norm()), float(u.float().norm())
    if p_norm == 0 or u_norm == 0:
        return 1.0
    return min(max(p_norm / u_norm, low), high)
