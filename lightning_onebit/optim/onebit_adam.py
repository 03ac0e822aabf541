"""1-bit Adam (arXiv 2102.02888) as a ``torch.optim.Optimizer`` over plain ``torch.distributed``."""

from __future__ import annotations

from typing import Any, Callable, Iterable, Literal, Optional, Sequence, Union

import torch
import torch.distributed as dist

from lightning_onebit.comm.topology import Topology
from lightning_onebit.kernels import Backend
from lightning_onebit.optim.auto_freeze_config import AutoFreeze
from lightning_onebit.optim.base import DEFAULT_BUCKET_CAP_MB, CompressedOptimizer
from lightning_onebit.optim.buckets import compressed_trainable
from lightning_onebit.optim.functional import adam_step_bound, adam_update_, adamw_step_, fold_gradients_, mask_
from lightning_onebit.optim.functional import mask_like
from lightning_onebit.optim.masks import DeadCoordinates
from lightning_onebit.optim.torch_options import check_torch_adamw_options


def adamw_steps_(groups: Sequence[dict[str, Any]], moments: Callable[[torch.Tensor], dict[str, Any]], t: int,
                 compression_stage: bool = False) -> None:
    """Step ``t`` of :class:`torch.optim.AdamW` (:func:`~lightning_onebit.optim.functional.adamw_step_`) on the
    (averaged) gradients of the parameters of ``groups`` that have one, whose state ``moments(p)`` gives (with
    ``exp_avg`` and ``exp_avg_sq``): the Adam family's warmup, and its ``compress=False`` groups in the compression
    stage (``compression_stage=True``), where explicit ``exp_avg_mask`` multiply the momentum after the gradient is
    folded in, as they multiply the averaged momentum of the compressed groups."""
    for group in groups:
        params, grads, exp_avgs, exp_avg_sqs, masks = [], [], [], [], []
        for i, p in enumerate(group["params"]):
            if p.grad is None:
                continue
            state = moments(p)
            params.append(p)
            grads.append(p.grad)
            exp_avgs.append(state["exp_avg"])
            exp_avg_sqs.append(state["exp_avg_sq"])
            if compression_stage and group["exp_avg_mask"][i] is not None:
                masks.append((len(params) - 1, mask_like(group["exp_avg_mask"], i, state["exp_avg"])))
        if params:
            adamw_step_(group, params, grads, exp_avgs, exp_avg_sqs, t, masks)


class OnebitAdam(CompressedOptimizer):
    r"""1-bit Adam: AdamW during warmup, then Adam with frozen variance and 1-bit compressed momentum averaging.

    **Warmup** (steps ``1..freeze_step``): the caller averages gradients across ranks (DDP's allreduce, or the
    ``onebit_adam`` strategy does it), and the update is exactly :class:`torch.optim.AdamW` (run by torch's fused
    AdamW kernel for float32/float64 tensors on CPU or CUDA when ``bias_correction=True``)::

        m = b1 m + (1 - b1) g;  v = b2 v + (1 - b2) g^2
        p = p (1 - lr wd) - lr m_hat / (sqrt(v_hat) + eps)

    **Compression** (steps ``freeze_step + 1`` on): gradients are *local* (not averaged). Each rank updates its
    momentum with its own gradient, the momenta are averaged with the error-compensated 1-bit compressed allreduce of
    :mod:`lightning_onebit.comm` (the result is identical on every rank), masked by ``exp_avg_mask`` if given, and
    applied with the variance frozen at its step-``freeze_step`` value::

        m = CompressedAllreduce(b1 m + (1 - b1) g_local) * mask
        p = p (1 - lr wd) - lr clip(m_hat / (sqrt(v_hat_frozen) + eps), -B, B)

    ``B = (1 - b1) / sqrt((1 - b2) (1 - b1^2 / b2))`` (``cap_update=True``, the default; not in the paper or
    DeepSpeed) is the largest size a coordinate of an Adam update can reach at any step, whatever the gradients
    (:func:`~lightning_onebit.optim.functional.adam_step_bound`: 7.27 for betas (0.9, 0.999), 1.70 for (0.9, 0.98);
    typical coordinates stay well below 1). The 1-bit exchange gives every coordinate of a segment the same magnitude
    (its scale), so a coordinate whose frozen variance is tiny but not zero (a position-embedding row that few warmup
    batches reached) would step by ``lr * scale / sqrt(v)``, a step no Adam run could take: on the example's fresh
    BERT frozen at a fifth of its run the position embeddings moved by up to 7.4 times their own norm in one step
    (docs/guides/freeze-step.md). The clip leaves every other coordinate's bits as they are; the momentum and the
    error feedback are not clipped, so a clipped coordinate moves in the direction error feedback gives it, more
    slowly. ``cap_update=False``: the paper's update.

    Bias correction (``bias_correction=True``) divides ``m`` by ``1 - b1^t`` (``t`` the current step) and ``v`` by
    ``1 - b2^t_v`` with ``t_v = min(t, freeze_step)``, the number of updates ``v`` received. With
    ``bias_correction=False`` neither is corrected (this is DeepSpeed's actual behaviour, which ignored the flag).

    Momenta of all trainable parameters are packed, at the first compressed step, into flat buckets of about
    ``bucket_cap_mb`` MB, or as :meth:`set_bucket_plan` says (the overlapped exchange lays them out like DDP's
    gradient buckets); each bucket costs two collectives per step however many parameters it holds. With
    :class:`~lightning_onebit.hooks.OverlapState` a bucket's exchange starts during backward
    (:meth:`start_bucket_exchange_`) and :meth:`step` finishes it, with the same bits. A parameter
    without a gradient on a rank in a compressed step contributes a zero gradient to that rank's momentum (the
    momentum is global, so the parameter still moves). A parameter that never had a gradient during warmup has no
    variance estimate: it is kept out of the update (frozen) and a warning names it.

    **Dead coordinates.** 1-bit compression cannot send zero: a coordinate whose gradient is exactly zero in every
    warmup step (embedding rows never looked up, position embeddings past the sequence length) has a frozen variance
    of 0 and, wherever its compression segment also holds live coordinates, receives ``+-scale`` momentum from the
    first compressed step on, so its update would explode to about ``lr * scale / eps``. At the first compressed step
    (after construction or a load) the optimizer finds them from the frozen variance (``v == 0``; warmup gradients are
    averaged, so every rank finds the same ones, with no communication and one host synchronisation) and, with
    ``dead_coordinates="mask"`` (the default), zeroes their averaged momentum every compressed step, so that they stay
    at their values (weight decay aside), and warns on rank 0 how many there are. To train such coordinates instead
    (embedding rows first seen after the warmup), put their parameters in a ``"compress": False`` param group (for an
    embedding table with ``"sparse_rows": True`` too). :class:`~lightning_onebit.MomentumMask` with ``auto=True``
    masks the same coordinates (detected from the gradients) and reports them itself.

    Nothing here touches ``torch.distributed`` before the first compressed step, so the optimizer can be built before
    the process group exists (LightningCLI does). Without an initialised process group (or with one rank) the
    compressed allreduce is the identity.

    Args:
        params: parameters, ``(name, parameter)`` pairs (e.g. ``named_parameters()``: warnings then use the names) or
            param-group dicts. Groups may set ``lr``, ``betas``, ``eps``, ``weight_decay``, ``bias_correction``,
            ``exp_avg_mask`` and ``compress`` (see below). Parameters must be floating point (float32, float64, float16,
            bfloat16): complex and integer parameters are refused, since the compressed momentum exchange has no form
            for them.
        lr: learning rate, a finite float ``>= 0`` (a learning-rate scheduler may change it later). Default ``1e-3``.
        betas: ``(b1, b2)`` decay rates of momentum and variance, a pair of floats each in ``[0, 1)``. Default
            ``(0.9, 0.999)``.
        eps: added to ``sqrt(v_hat)``; finite, ``>= 0``. Default ``1e-8``.
        weight_decay: decoupled weight decay coefficient (AdamW's), finite, ``>= 0``. Default ``0``, where
            ``torch.optim.AdamW``'s default is ``0.01``: a port from AdamW that relied on its default must pass
            ``weight_decay=0.01``.
        freeze_step: number of warmup steps, ``>= 1``. Step ``freeze_step + 1`` is the first compressed step (the
            paper uses 15-25% of training; the variance must have settled by then). ``"auto"`` (default): the warmup
            ends when the variance has stopped moving, decided by every rank together
            (:class:`~lightning_onebit.AutoFreeze`; under the Lightning strategies at half the run at the latest);
            :attr:`freeze_step` is ``None`` until then.
        auto_freeze: the settings of ``freeze_step="auto"`` (:class:`~lightning_onebit.AutoFreeze`); only with it.
            Default ``None``: ``AutoFreeze()``.
        bias_correction: see above; a bool (anything else is an error, not a truthy value). Default ``True``.
        amsgrad, maximize, differentiable, capturable: ``torch.optim.AdamW``'s, taken so that AdamW configs port:
            only ``False`` (their default) is accepted, anything else is a ``ValueError`` that says what to do instead
            (the variance is frozen, so there is no ``amsgrad``; ``maximize``: minimise the negated objective; the
            1-bit exchange has no gradient and its collectives cannot be captured in a CUDA graph).
        foreach, fused: ``torch.optim.AdamW``'s choice of implementation. The optimizer chooses its kernels itself
            (torch's fused AdamW in the warmup where it applies, ``kernel_backend`` for the compressed steps) and the
            results do not depend on it: ``None`` (default) is accepted as is, ``True`` or ``False`` with a
            ``UserWarning`` saying that they have no effect.
        bucket_cap_mb: approximate size of a compressed momentum bucket in MB (of momentum dtype), a number ``> 0``
            below ``2**43``. Default ``25``.
        process_group: group whose ranks average momenta; ``None`` (default) means WORLD, resolved at step time.
            The Lightning strategy sets its data-parallel group here.
        kernel_backend: ``"auto"`` (default), ``"torch"``, ``"cpu"`` (fused C kernels for float32 CPU tensors) or
            ``"cupy"``, see :mod:`lightning_onebit.kernels`. ``"auto"`` takes the C kernels for float32 CPU tensors when
            they build, else the torch ones (on CUDA too; cupy only when named).
            At the first compressed step (or when the strategy sets up) the ranks agree on it
            (:func:`~lightning_onebit.comm.agree_kernel_backend`): if they have different kernels available, all run
            the torch ones, so that replicas compute identical bits.
        topology: a :class:`~lightning_onebit.Topology` over ``process_group``, from :meth:`Topology.build`. A
            hierarchical one averages momenta in full precision inside each node and with 1 bit only between nodes
            (about ``N/8`` bytes per node per step instead of ``N/4`` or more); any topology splits the byte counters
            into intra- and inter-node bytes. ``None`` (default): flat exchange. The strategy sets it from its
            ``topology`` argument.
        cap_update: in the compression stage, clip every coordinate of ``m_hat / (sqrt(v_hat) + eps)`` at ``B``, the
            largest an Adam update can reach (see above; per param group, from its betas). A bool. Default ``True``;
            ``False``: the paper's (and DeepSpeed's) update.
        dead_coordinates: what happens to the dead coordinates (see above) at the first compressed step:
            ``"mask"`` keeps them at rest and warns (default; one bool per element of the parameters that have any,
            for the rest of training); ``"warn"`` only warns, and lets 1-bit noise move them (DeepSpeed's behaviour);
            ``"ignore"`` neither looks nor warns.

    All arguments are checked in the constructor (before any collective); an invalid one is a ``ValueError`` that
    names it.

    Param-group option ``exp_avg_mask``: a tensor of each parameter's shape (the group-wide DeepSpeed form, for
    groups whose parameters share one shape) or a list with one tensor or ``None`` per parameter. It multiplies the
    averaged momentum in the compression stage, so masked coordinates (mask 0) have momentum exactly zero and do not
    move except by weight decay. Masks come from the code, never from a checkpoint. A mask is bool or floating point
    and holds only 0 and 1 (DeepSpeed's semantics): the mask multiplies the stored momentum every compressed step, so
    a fractional value would compound (``0.5`` shrinks that momentum by ``0.5^k`` after ``k`` steps), ``2`` would
    grow it geometrically and NaN would spread to the parameters; other values are a ``ValueError`` naming the param
    group and index. Masks are converted to their parameter's dtype and device.

    Param-group option ``compress`` (a bool, default ``True``): ``False`` keeps the group out of 1-bit compression.
    In the compression stage its gradients (local, since DDP's allreduce is off) are averaged in full precision by
    :meth:`step` (one ``all_reduce`` per device and dtype over all such gradients, on ``process_group``; a parameter
    without a gradient on a rank contributes zeros) and the group takes the warmup's AdamW step, with momentum *and*
    variance updated and bias corrections of the true step ``t``. The momentum is the same on every rank before the
    gradient is folded in, so this is exactly the group's momentum averaged in full precision instead of 1 bit, with
    the variance kept live: coordinates whose gradient is zero during warmup and nonzero later (embedding rows first
    seen after the freeze) then train normally instead of being frozen by a mask or exploding. The warmup is
    unchanged. Cost: like DDP for that group, ``2 (P-1)/P * 4`` bytes per element per step in fp32 (the element size
    of the gradients' dtype in general), against about ``2 (P-1)/P / 8`` for a compressed element; counted in
    ``communication.bytes_sent_uncompressed``. Use it for embeddings (rows unseen in warmup) and for small or sparse
    groups where full precision costs little. Such groups are left out of the momentum buckets, the error feedback,
    the dead-coordinate warning and :class:`~lightning_onebit.MomentumMask`'s ``auto`` masks (a zero gradient
    averages to an exact zero, and the variance is live); explicit ``exp_avg_mask`` still multiply their momentum in
    the compression stage. ``compress`` comes from the code, not from a checkpoint: a group may be switched in or out
    of compression when a run resumes. Anything but a bool is a ``ValueError`` naming the group.

    Param-group option ``sparse_rows`` (a bool, default ``False``; only with ``compress=False``): the group's gradients
    are averaged as rows (slices along the first dimension) instead of dense tensors: each rank sends only the rows
    holding a nonzero (:func:`~lightning_onebit.comm.sparse_rows_allreduce_`: two ``all_gather`` and one host
    synchronisation per device and dtype per step). The result is the same exact average and the same update; what
    changes is the bytes. For an embedding table, whose gradient in one step has only the rows of the tokens the batch
    looked up, that is a few percent of the dense bytes and often fewer than 1-bit compression of the whole table
    would send, while every row keeps training with a live variance, also rows first looked up after the freeze::

        OnebitAdam([{"params": rest}, {"params": [model.embeddings.word_embeddings.weight], "compress": False,
                     "sparse_rows": True}], lr=1e-4, freeze_step="auto")

    Every rank receives every other rank's rows, so the saving shrinks as ranks are added: it pays while the rows the
    ranks touch in a step are fewer than about ``2 / P`` of the table (``P`` ranks) against full precision, and about
    ``1 / (16 P)`` against 1 bit. ``sparse_rows=True`` with ``compress=True`` is a ``ValueError``.
    """

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
        bias_correction: bool = True,
        amsgrad: bool = False,
        maximize: bool = False,
        foreach: Optional[bool] = None,
        fused: Optional[bool] = None,
        capturable: bool = False,
        differentiable: bool = False,
        cap_update: bool = True,
        bucket_cap_mb: float = DEFAULT_BUCKET_CAP_MB,
        process_group: Optional[dist.ProcessGroup] = None,
        kernel_backend: Backend = "auto",
        topology: Optional[Topology] = None,
        dead_coordinates: DeadCoordinates = "mask",
    ) -> None:
        check_torch_adamw_options(type(self).__name__, amsgrad=amsgrad, maximize=maximize,
                                  differentiable=differentiable, capturable=capturable, foreach=foreach, fused=fused)
        defaults = dict(lr=lr, betas=betas, eps=eps, weight_decay=weight_decay, bias_correction=bias_correction,
                        cap_update=cap_update)
        super().__init__(params, defaults, freeze_step=freeze_step, auto_freeze=auto_freeze,
                         bucket_cap_mb=bucket_cap_mb, process_group=process_group, kernel_backend=kernel_backend,
                         topology=topology, dead_coordinates=dead_coordinates)

    def _warmup_step(self) -> None:
        adamw_steps_(self.param_groups, self._moment_state, self._step)

    def _full_precision_update_(self, groups: Sequence[dict[str, Any]]) -> None:
        adamw_steps_(groups, self._moment_state, self._step, compression_stage=True)

    def _compressed_step(self) -> None:
        self._step_uncompressed_groups_()  # compress=False groups: gradients averaged in full precision, AdamW
        exchange = self._begin_exchange()  # the buckets; those the overlap hook folded and started during backward
        for group in self.param_groups:  # fold: m = b1 m + (1 - b1) g, with this rank's gradient
            params = exchange.unfolded(group)
            fold_gradients_([self.state[p]["exp_avg"] for p in params], [p.grad for p in params], group["betas"][0])
        exchange.finish_(self.state)  # exchange: m = the 1-bit compressed average of every rank's m
        for group in self.param_groups:  # mask: exp_avg_mask, and the dead coordinates kept at rest
            params = compressed_trainable(group)
            mask_(group, params, [self.state[p]["exp_avg"] for p in params], self.masks.kept)
        t, t_v = self._step, self.freeze_step
        for group in self.param_groups:  # update, with the variance frozen at the end of warmup
            params = self._updated_params(group)
            if params:
                exp_avgs = [self.state[p]["exp_avg"] for p in params]
                exp_avg_sqs = [self.state[p]["exp_avg_sq"] for p in params]
                bound = adam_step_bound(group["betas"]) if group["cap_update"] else None
                adam_update_(group, params, exp_avgs, exp_avg_sqs, t, t_v, self.compression.backend, bound)
