"""1-bit LAMB (arXiv 2104.06069) as a ``torch.optim.Optimizer`` over plain ``torch.distributed``; its per-tensor math
is :mod:`~lightning_onebit.optim.functional`'s."""

from __future__ import annotations

import math
from typing import Any, Iterable, Literal, Optional, Sequence, Union

import torch
import torch.distributed as dist

from lightning_onebit import kernels
from lightning_onebit._checks import check_flag, check_real
from lightning_onebit.comm.topology import Topology
from lightning_onebit.kernels import Backend
from lightning_onebit.optim.auto_freeze_config import AutoFreeze
from lightning_onebit.optim.base import DEFAULT_BUCKET_CAP_MB, CompressedOptimizer
from lightning_onebit.optim.buckets import compressed_trainable
from lightning_onebit.optim.checkpoint import CHECKPOINT_KEY, restore_scalar_state_, take_scalar_state_
from lightning_onebit.optim.freeze import state_figures
from lightning_onebit.optim.functional import (
    adam_step_bound,
    bias_corrections,
    compressed_lamb_update_,
    fold_gradients_,
    lamb_update_,
    mask_,
    mask_like,
    scaling_coefficients,
    squared_norms,
    update_variances_,
)
from lightning_onebit.optim.masks import DeadCoordinates
from lightning_onebit.optim.torch_options import check_torch_adamw_options

# per-parameter state held as 0-dim float64 tensors on the parameter's device
_SCALAR_STATE = ("lamb_coeff", "lamb_last_factor", "lamb_scaling_coeff")
# the warmup's multi-tensor ops run over at most this many elements at a time (their temporaries: u, denominators)
_CHUNK_NUMEL = 2**24


def _scalar(value: float, device: torch.device) -> torch.Tensor:
    """A 0-dim float64 tensor on ``device``, filled there (no host-to-device copy)."""
    return torch.full((), value, dtype=torch.float64, device=device)


def _chunks(params: Sequence[torch.Tensor], limit: Optional[int] = _CHUNK_NUMEL) -> list[list[int]]:
    """Indices into ``params``, by device, in runs of at most ``limit`` elements (a larger tensor alone; ``None``:
    one run per device)."""
    by_device: dict[torch.device, list[int]] = {}
    for i, p in enumerate(params):
        by_device.setdefault(p.device, []).append(i)
    out = []
    for indices in by_device.values():
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
        u0 = clip(m_hat / (sqrt(v_hat_frozen) + eps), -B, B);  u = u0 + wd p
        factor = max((sqrt(v) + eps) / (sqrt(v_fresh) + eps))          (per tensor, raw v)
        factor = rho factor + (1 - rho), rho = min(1, ||u0|| / ||u||)  (only with weight decay)
        factor = clip(factor, factor_min, factor_max), then within last_factor (1 +- factor_threshold)
        r = clip(||p|| / ||u||, min_coeff, max_coeff)      (the live trust ratio; with cap_trust_ratio only)
        p = p - lr min(coeff, r) factor u                  (DeepSpeed's, cap_trust_ratio=False: p - lr coeff factor u)

    The cap (``cap_trust_ratio=True``, the default; not in DeepSpeed) keeps each compressed step within LAMB's own
    size, ``factor * lr * ||p||`` (unless ``r`` is clipped): the sign-compressed momentum gives every coordinate of a
    chunk the same magnitude, so ``||u||`` can be many times its warmup value where ``v`` is small, and the frozen
    ``coeff`` no longer offsets that. Measured on a pretrained MiniLM fine-tuned on a mail corpus (variance frozen at
    step 300): without the cap the whole model moved 2.5-2.9x further per step than in warmup (one tensor up to 19x)
    and a 600-step run ended at 67.7% (its uncompressed twin: 97.8%); with the cap it moved as far as in warmup and
    ended at 98.1% (``docs/guides/freeze-step.md``). Cost: one norm per parameter tensor per step, on the device.

    ``B`` (``cap_update=True``, the default; not in DeepSpeed) clips every coordinate of ``u0`` at the largest size
    it can reach in warmup, whatever the gradients (see :class:`~lightning_onebit.OnebitAdam`): a coordinate whose
    frozen variance is tiny would otherwise get ``scale / sqrt(v)`` from the sign-compressed momentum, lengthen
    ``||u||`` by itself and push the live trust ratio of its whole tensor to ``min_coeff``, where the step
    ``lr min_coeff factor ||u||`` is no longer bounded by ``lr ||p||``.

    Everything after the exchange depends only on rank-identical values, so replicas stay bit-identical. Bias
    correction (``bias_correction=True``) divides ``m`` by ``1 - b1^t`` and ``v`` by ``1 - b2^min(t, freeze_step)``,
    as :class:`~lightning_onebit.OnebitAdam` does (DeepSpeed accepted the flag and ignored it; with
    ``bias_correction=False`` this is DeepSpeed's update, its step ``t`` being this one's ``t``). bf16 works (DeepSpeed
    refused it). ``scaling_coeff``, ``coeff`` and ``last_factor`` (0-dim float64 tensors on the parameter's device;
    a checkpoint that holds them as Python floats loads too), ``v_fresh`` and the previous momentum are per-parameter
    optimizer state, saved and restored with it.

    Host synchronisations: none per step. Norms, trust ratios, factors and coefficients are computed on the device
    with multi-tensor ops in float64, the arithmetic of the scalar rules above op for op; the scaling coefficients are
    read once, at the first compressed step of a run (the exchange multiplies by Python floats). In float32 every
    parameter gets the bits of the per-tensor version with Python floats (tested); with bf16/fp16 parameters the update
    ``p - s u`` (``addcmul`` with a device-side ``s``, rounded to the parameters' dtype, where that version called
    ``p.add_(u, alpha=s)`` with ``s`` in float32) can differ in the last bit. Memory in the compression stage: the
    frozen variance's ``sqrt(v) + eps`` and, with bias correction, ``sqrt(v_hat) + eps`` are cached (one or two
    tensors of the parameters' size), and the previous momentum serves as scratch, so a step allocates no full-size
    temporary (the warmup's temporaries are bounded by runs of ``2**24`` elements).

    A param group with ``compress=False`` (see :class:`~lightning_onebit.OnebitAdam`) takes the warmup's LAMB step
    above in the compression stage too, on its gradients averaged in full precision by :meth:`step` (its variance
    and trust-ratio EMA stay live; no scaling coefficient, factor or fresh variance). Cost: ``2 (P-1)/P * 4`` bytes
    per element per step in fp32, as DDP for that group; for embeddings, small or sparse groups.

    Sharded (``DTensor``, FSDP2) parameters train as with :class:`~lightning_onebit.OnebitAdam`
    (:mod:`~lightning_onebit.optim.sharded`: each rank steps its local shard, momenta averaged over the ranks that
    hold the same shard). The per-tensor figures are those of the whole tensor: each rank's squared norms (of ``p``
    and ``u`` in warmup, of ``u0`` and ``u`` in the compression stage, of ``m`` for the scaling coefficients) are
    added over the shard group, the compression-stage maxima maxed over it, the scaling coefficients' ``numel`` is
    the whole tensor's. One collective per param group per step (a vector of the group's figures), so the ranks of a
    node get the same coefficients, bit for bit, and the result is the unsharded run's to rounding (the norms are
    summed in another order: float64 sums of shards, where the unsharded path takes float32 norms). The warmup then
    runs a group's multi-tensor ops as one run (its ``u`` for every local shard alive at once). A rank whose shard
    of a small tensor is empty contributes nothing to its figures.

    Args:
        params, lr, betas, eps: as for :class:`~lightning_onebit.OnebitAdam`.
        weight_decay: as for :class:`~lightning_onebit.OnebitAdam` (default ``0``, where ``torch.optim.AdamW``'s is
            ``0.01``), but added to the update before the trust ratio, as in LAMB.
        freeze_step, auto_freeze: as for :class:`~lightning_onebit.OnebitAdam` (``"auto"`` by default: within 0.5
            point of LAMB that never freezes on a synthetic task from scratch and on two real fine-tuning tasks, two
            seeds each, docs/guides/freeze-step.md); ``freeze_step="auto"`` also waits for the trust-ratio EMAs to
            settle: on average over the coordinates, and, without ``cap_trust_ratio``, at every tensor. With the cap
            (the default) it does not wait for the gradient backtest either: no compressed step can then be larger
            than LAMB's.
        bias_correction, bucket_cap_mb, process_group: as for :class:`~lightning_onebit.OnebitAdam`.
        kernel_backend, topology, dead_coordinates: as for :class:`~lightning_onebit.OnebitAdam`.
        amsgrad, maximize, differentiable, capturable, foreach, fused: ``torch.optim.AdamW``'s, as for
            :class:`~lightning_onebit.OnebitAdam` (only ``False`` for the first four; ``foreach`` and ``fused`` have
            no effect and warn unless ``None``).
        max_coeff: upper clip of the warmup trust ratio ``r``. Default ``10.0``.
        min_coeff: lower clip of ``r``, ``> 0``. Default ``0.01``.
        coeff_beta: EMA rate of the trust ratio, in ``[0, 1)``. Default ``0.9``.
        factor_max: upper clip of the compression-stage factor. Default ``4.0``.
        factor_min: lower clip of the factor, ``> 0``. Default ``0.5``.
        factor_threshold: the factor changes by at most this fraction per step, ``>= 0``. Default ``0.1``.
        cap_trust_ratio: in the compression stage, cap the frozen trust ratio ``coeff`` by the live one,
            ``clip(||p|| / ||u||, min_coeff, max_coeff)``, so a step is never larger than LAMB's. ``False``: DeepSpeed's
            update, which can diverge late in fine-tuning (above). Default ``True``.
        cap_update: in the compression stage, clip every coordinate of ``u0`` at ``B`` (above). A bool. Default
            ``True``; ``False``: DeepSpeed's ``u0``.

    The six LAMB numbers (finite), ``cap_trust_ratio`` and ``cap_update`` may also be set per param group; each group's
    are checked when it is added (a ``ValueError`` naming the option and the group).
    """

    # its compression stage needs the trust-ratio coefficients only its own warmup computes (see load_state_dict)
    _continues_state_of = ("OnebitLamb",)

    def __init__(
        self,
        params: Union[Iterable[torch.Tensor], Iterable[dict[str, Any]]],
        lr: float = 1e-3,
        betas: tuple[float, float] = (0.9, 0.999),
        eps: float = 1e-8,
        weight_decay: float = 0.0,
        *,
        freeze_step: Union[int, Literal["auto"]] = "auto",
        auto_freeze: Optional[AutoFreeze] = None,
        max_coeff: float = 10.0,
        min_coeff: float = 0.01,
        coeff_beta: float = 0.9,
        factor_max: float = 4.0,
        factor_min: float = 0.5,
        factor_threshold: float = 0.1,
        cap_trust_ratio: bool = True,
        cap_update: bool = True,
        bias_correction: bool = True,
        amsgrad: bool = False,
        maximize: bool = False,
        foreach: Optional[bool] = None,
        fused: Optional[bool] = None,
        capturable: bool = False,
        differentiable: bool = False,
        bucket_cap_mb: float = DEFAULT_BUCKET_CAP_MB,
        process_group: Optional[dist.ProcessGroup] = None,
        kernel_backend: Backend = "auto",
        topology: Optional[Topology] = None,
        dead_coordinates: DeadCoordinates = "mask",
    ) -> None:
        # the LAMB options are param-group options too: checked with each group (_check_group)
        check_torch_adamw_options(type(self).__name__, amsgrad=amsgrad, maximize=maximize,
                                  differentiable=differentiable, capturable=capturable, foreach=foreach, fused=fused)
        defaults = dict(
            lr=lr, betas=betas, eps=eps, weight_decay=weight_decay, bias_correction=bias_correction,
            max_coeff=max_coeff, min_coeff=min_coeff, coeff_beta=coeff_beta,
            factor_max=factor_max, factor_min=factor_min, factor_threshold=factor_threshold,
            cap_trust_ratio=cap_trust_ratio, cap_update=cap_update,
        )
        super().__init__(params, defaults, freeze_step=freeze_step, auto_freeze=auto_freeze,
                         bucket_cap_mb=bucket_cap_mb, process_group=process_group, kernel_backend=kernel_backend,
                         topology=topology, dead_coordinates=dead_coordinates)

    @classmethod
    def _check_group(cls, group: dict[str, Any], index: int) -> None:
        """The base class's checks, and LAMB's own options (given to the constructor or set per param group),
        normalised to floats: the coefficients' and factors' clips finite with ``0 < min <= max``,
        ``factor_threshold >= 0``, ``coeff_beta`` in ``[0, 1)``, ``cap_trust_ratio`` a bool."""
        super()._check_group(group, index)
        where = f" (param group {index})"
        for name in ("max_coeff", "min_coeff", "factor_max", "factor_min", "factor_threshold", "coeff_beta"):
            group[name] = check_real(group[name], name, where=where)
        if not 0 < group["min_coeff"] <= group["max_coeff"]:
            raise ValueError(f"need 0 < min_coeff <= max_coeff, got min_coeff={group['min_coeff']}, "
                             f"max_coeff={group['max_coeff']}{where}")
        if not 0 < group["factor_min"] <= group["factor_max"]:
            raise ValueError(f"need 0 < factor_min <= factor_max, got factor_min={group['factor_min']}, "
                             f"factor_max={group['factor_max']}{where}")
        check_real(group["factor_threshold"], "factor_threshold", at_least=0.0, where=where)
        check_real(group["coeff_beta"], "coeff_beta", at_least=0.0, below=1.0, where=where)
        check_flag(group["cap_trust_ratio"], "cap_trust_ratio", where=where)

    # ------------------------------------------------------------------ warmup: LAMB
    def _warmup_step(self) -> None:
        self._lamb_step_(self.param_groups, compression_stage=False)

    def _full_precision_update_(self, groups: Sequence[dict[str, Any]]) -> None:
        self._lamb_step_(groups, compression_stage=True)

    def _lamb_step_(self, groups: Sequence[dict[str, Any]], compression_stage: bool) -> None:
        """Step ``t`` of LAMB on the (averaged) gradients of these groups. In warmup it records nonzero gradients of
        the compressed groups for the dead-coordinate warning; in the compression stage (``compress=False`` groups)
        explicit ``exp_avg_mask`` multiply the momentum after the gradient is folded in.

        Multi-tensor ops over runs of tensors (:func:`_chunks`: one device, at most ``_CHUNK_NUMEL`` elements, which
        bounds the temporaries ``u`` and the denominators), the trust ratios and their EMAs computed on the device in
        float64 (the Python arithmetic of the per-tensor version, op for op): no host synchronisation.

        Sharded parameters (:meth:`_reduces_figures`): the trust ratios' norms are the whole tensors', from this
        rank's squared norms added over the shard group (:meth:`_whole_figures`), one collective per group."""
        t = self._step
        sharded = self._reduces_figures()
        for group in groups:
            b1, b2 = group["betas"]
            bc1, bc2 = bias_corrections(group, t, t)
            masks = group["exp_avg_mask"]
            params, indices = [], []
            for i, p in enumerate(group["params"]):
                if p.grad is None:
                    continue
                state = self._moment_state(p)
                if "lamb_coeff" not in state:
                    state["lamb_coeff"] = _scalar(0.0, p.device)
                params.append(p)
                indices.append(i)
            # Under sharding a group is one run (per device), so that its figures travel in one collective: this keeps
            # one u per local shard of the group alive at once, which the shards (1/L of the model) bound.
            reduce = self.shards.reduce_tensor_figures if sharded else None
            for chunk in (_chunks(params, limit=None) if sharded else _chunks(params)):
                ps = [params[k] for k in chunk]
                states = [self.state[p] for p in ps]
                ms, vs, gs = [s["exp_avg"] for s in states], [s["exp_avg_sq"] for s in states], [p.grad for p in ps]
                fold_gradients_(ms, gs, b1)
                if compression_stage:
                    for m, k in zip(ms, chunk):
                        if masks[indices[k]] is not None:
                            m.mul_(mask_like(masks, indices[k], m))
                update_variances_(vs, gs, b2)
                lamb_update_(group, ps, ms, vs, [s["lamb_coeff"] for s in states], (bc1, bc2), reduce)

    def _on_freeze(self) -> None:
        self._remember_momenta()  # the first compressed step reconstructs the gradient from them

    def _steps_capped(self) -> bool:
        """With ``cap_trust_ratio`` in every compressed group, each tensor's compressed step is at most LAMB's."""
        return all(group["cap_trust_ratio"] for group in self.param_groups if group["compress"])

    def _settling_figures(self) -> torch.Tensor:
        """freeze_step='auto' also waits for the compressed tensors' trust-ratio EMAs (the coefficients that get
        frozen; ``compress=False`` groups keep updating theirs)."""
        return state_figures(self.param_groups, self.state, "lamb_coeff")

    # ------------------------------------------------------------------ compression stage
    def _compressed_step(self) -> None:
        self._step_uncompressed_groups_()  # compress=False groups: gradients averaged in full precision, LAMB
        if not self._exchange_scale:
            self._set_scaling_coefficients()
        self._remember_momenta(missing_only=True)  # a group that became compressed on resume
        exchange = self._begin_exchange()  # the buckets; those the overlap hook folded and started during backward
        for group in self.param_groups:  # fold: m = b1 m + (1 - b1) g, with this rank's gradient
            params = exchange.unfolded(group)
            fold_gradients_([self.state[p]["exp_avg"] for p in params], [p.grad for p in params], group["betas"][0])
        # exchange: m = the 1-bit compressed average of every rank's m, each tensor scaled by its coefficient for it
        exchange.finish_(self.state, self._exchange_scale)
        for group in self.param_groups:  # mask: exp_avg_mask, and the dead coordinates kept at rest
            params = compressed_trainable(group)
            mask_(group, params, [self.state[p]["exp_avg"] for p in params], self.masks.kept)
        t, t_v = self._step, self.freeze_step
        for group in self.param_groups:  # update: LAMB with the frozen variance, the fresh one and the trust ratio
            params = self._updated_params(group)
            for chunk in _chunks(params, limit=None):
                self._compressed_update_(group, [params[k] for k in chunk], t, t_v)
        self._remember_momenta()

    def _compressed_update_(self, group: dict[str, Any], params: list[torch.Tensor], t: int, t_v: int) -> None:
        """The update after the exchange, for these parameters (one device): :func:`compressed_lamb_update_` on
        their state, with the whole tensors' figures when they are sharded (:meth:`_reduces_figures`)."""
        states = [self.state[p] for p in params]
        for p, state in zip(params, states):
            if state.get("exp_avg_sq_fresh") is None:  # seeded at the first compressed step, whatever freeze_step was
                state["exp_avg_sq_fresh"] = state["exp_avg_sq"].clone()
            if "lamb_last_factor" not in state:
                state["lamb_last_factor"] = _scalar(1.0, p.device)
        reduce = self.shards.reduce_tensor_figures if self._reduces_figures() else None
        bound = adam_step_bound(group["betas"]) if group["cap_update"] else None
        compressed_lamb_update_(params, states, group, bias_corrections(group, t, t_v), self.compression.backend,
                                reduce, None if bound is None or math.isinf(bound) else bound)

    # ------------------------------------------------------------------ sharded parameters: whole-tensor figures
    def _reduces_figures(self) -> bool:
        """Whether per-tensor figures are reduced over the shard group: some parameter is sharded (``DTensor``) over
        more than one rank. Otherwise every path is the unsharded one, bit for bit."""
        return bool(self.shards.pairs) and self.shards.reduces_figures()

    def _remember_momenta(self, missing_only: bool = False) -> None:
        """Keep the (averaged) momenta of the compressed groups for the next step's gradient reconstruction; they are
        taken before the next backward, so the overlap hook may fold into the momenta while this copy stays.
        ``missing_only``: only for parameters without a copy (a group switched to ``compress=True`` on resume, before
        its first compressed step: nothing has been folded into its momenta yet)."""
        copies, sources = [], []
        for group in self.param_groups:
            for p in self._updated_params(group):
                state = self.state[p]
                if "exp_avg" not in state or (missing_only and "exp_avg_last" in state):
                    continue
                last = state.get("exp_avg_last")
                if last is None or last.shape != p.shape:
                    state["exp_avg_last"] = state["exp_avg"].detach().clone()
                else:
                    copies.append(last)
                    sources.append(state["exp_avg"])
        if copies:
            torch._foreach_copy_(copies, sources)

    def _set_scaling_coefficients(self) -> None:
        """Per compressed tensor ``mean_over_tensors(rms) / rms`` from the momenta at the end of warmup
        (rank-identical: warmup averaged the gradients); 1 for an all-zero momentum. Kept in the state (0-dim float64
        tensors), so a resume keeps them; a tensor without one (its group switched to ``compress=True`` on resume)
        gets one from the current momenta, the others keep theirs.

        Computed on the device (the Python arithmetic of the per-tensor version, the mean summed in order), and
        never read back to the host: the exchange multiplies the momenta by these 0-dim tensors
        (:attr:`_exchange_scale`). Sharded parameters: ``||m||`` and ``numel`` are the whole tensor's (the squared
        norms of the local shards added over the shard group, one collective), so every rank of a node gets the
        coefficients of the unsharded run, to rounding."""
        trainable = [p for group in self.param_groups for p in compressed_trainable(group)]
        if not trainable:
            self._exchange_scale = {}
            return
        missing = [p for p in trainable if "lamb_scaling_coeff" not in self.state[p]]
        if missing:
            home = trainable[0].device
            with_m = [p for p in trainable if self.state[p].get("exp_avg") is not None]
            if self._reduces_figures():
                rms = self._whole_rms(trainable, with_m, home)
            else:
                norms = dict(zip(map(id, with_m),
                                 torch._foreach_norm([self.state[p]["exp_avg"].float() for p in with_m])))
                rms = torch.stack([
                    norms[id(p)].to(home).double() / math.sqrt(max(p.numel(), 1)) if id(p) in norms
                    else _scalar(0.0, home)
                    for p in trainable
                ])
            coeffs = scaling_coefficients(rms)
            index = {id(p): i for i, p in enumerate(trainable)}
            for p in missing:
                self.state[p]["lamb_scaling_coeff"] = coeffs[index[id(p)]].to(p.device).clone()
        self._exchange_scale = {id(p): self.state[p]["lamb_scaling_coeff"] for p in trainable}

    def _whole_rms(self, trainable: list[torch.Tensor], with_m: list[torch.Tensor], home: torch.device
                   ) -> torch.Tensor:
        """Sharded parameters: ``||m|| / sqrt(numel)`` of each whole tensor (0 without a momentum), a float64 vector
        on ``home``: the local shards' squared norms added over the shard group, the whole tensor's ``numel``."""
        squares = dict(zip(map(id, with_m), squared_norms([self.state[p]["exp_avg"] for p in with_m]).to(home)
                           if with_m else ()))
        local = torch.stack([squares[id(p)] if id(p) in squares else _scalar(0.0, home) for p in trainable])
        _, total = self.shards.reduce_tensor_figures(trainable, None, local)
        assert total is not None
        numels = [(self.shards.dtensor_of(p) if self.shards.dtensor_of(p) is not None else p).numel()
                  for p in trainable]
        norms = kernels.sqrt_into(total, torch.empty_like(total))
        return torch.stack([norm / math.sqrt(max(n, 1)) for norm, n in zip(norms.unbind(0), numels)])

    # ------------------------------------------------------------------ checkpoints
    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """As :meth:`CompressedOptimizer.load_state_dict`. The per-tensor coefficients (``lamb_coeff``,
        ``lamb_last_factor``, ``lamb_scaling_coeff``) come back as 0-dim float64 tensors on each parameter's device,
        from tensors or from the Python floats that checkpoints written before they were tensors hold (torch's own
        loading would cast a tensor to the parameter's dtype and lose their bits). Another algorithm's state
        (OnebitAdam, ZeroOneAdam, a torch optimizer's) raises ``ValueError`` naming it, before anything is loaded."""
        # before the coefficients are taken out (they identify the state's writer)
        state_dict = self.checkpoint.readable(state_dict, warn=self.compression.rank() == 0)
        meta = state_dict.get(CHECKPOINT_KEY)
        if isinstance(meta, dict):  # checked: the base need not infer it
            state_dict[CHECKPOINT_KEY] = dict(meta, optimizer=self.checkpoint.family)
        scalars = take_scalar_state_(state_dict, _SCALAR_STATE)  # torch's load would cast them to the params' dtype
        super().load_state_dict(state_dict)
        restore_scalar_state_(self.state, scalars, state_dict["param_groups"], self.param_groups)
        # The exchange's factors are the loaded coefficients: the overlapped exchange may start during the first
        # backward after the resume, before this step could read them (rank-identical: every rank loads the same).
        # A tensor without one (its group switched to compress=True) gets one at the next compressed step, which no
        # exchange starts before (start_bucket_exchange_).
        self._exchange_scale = self._loaded_exchange_scale()

    def _loaded_exchange_scale(self) -> dict[int, torch.Tensor]:
        """The exchange's factors from the loaded ``lamb_scaling_coeff`` s, if every compressed trainable tensor has
        one; else empty (set at the next compressed step, :meth:`_set_scaling_coefficients`)."""
        trainable = [p for group in self.param_groups for p in compressed_trainable(group)]
        if not all("lamb_scaling_coeff" in self.state.get(p, {}) for p in trainable):
            return {}
        return {id(p): self.state[p]["lamb_scaling_coeff"] for p in trainable}

    def start_bucket_exchange_(self, key: int, params: Sequence[torch.Tensor], gradients: Sequence[torch.Tensor],
                               clip_value: Optional[float] = None) -> bool:
        """As :meth:`CompressedOptimizer.start_bucket_exchange_`, but only once the scaling coefficients are known
        (from the first compressed step, or loaded): until then every bucket is exchanged in :meth:`step`, which sets
        them first. The same answer on every rank (the coefficients are)."""
        if not self._exchange_scale:
            return False
        return super().start_bucket_exchange_(key, params, gradients, clip_value)
