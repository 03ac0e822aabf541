"""What a recipe's steps are made of, as a mixin of :class:`~lightning_onebit.optim.CompressedOptimizer`: a
parameter's moments, the AdamW step of the Adam family's warmup, the full-precision step of ``compress=False`` groups,
and the 1-bit compressed average of the momenta (or of any buffers laid out like the buckets).

A subclass's ``_warmup_step`` and ``_compressed_step`` call these; the base itself only dispatches to them.
"""

from __future__ import annotations

from typing import Any, Callable, Optional, Sequence

import torch

from lightning_onebit.comm.state import CompressedAllreduceState
from lightning_onebit.optim.buckets import BucketSource, MomentumBucket, MomentumBuckets
from lightning_onebit.optim.error_feedback import feedback_key
from lightning_onebit.optim.exchange import MomentumExchange
from lightning_onebit.optim.functional import adamw_step_, mask_like
from lightning_onebit.optim.groups import compressed_trainable
from lightning_onebit.optim.masks import (
    apply_momentum_masks_,
    warn_zero_variance,
    zero_variance_coordinates,
)
from lightning_onebit.optim.uncompressed import average_gradients_


class StepPartsMixin:
    """The parts of the steps of :class:`~lightning_onebit.optim.CompressedOptimizer`, which sets the attributes
    below."""

    param_groups: list[dict[str, Any]]
    state: Any
    _step: int
    compression: CompressedAllreduceState
    momentum_buckets: MomentumBuckets
    exchange: MomentumExchange
    _exchange_scale: dict[int, torch.Tensor]
    dead_coordinates: str
    _dead_coordinates_masked_by: Optional[str]
    _zero_variance: Optional[dict[int, torch.Tensor]]
    _backend_agreed: bool
    agree_kernel_backend: Callable[[], str]
    _bucket_source: Callable[[], BucketSource]
    _ensure_buckets: Callable[..., list[MomentumBucket]]
    _full_precision_update_: Callable[[Sequence[dict[str, Any]]], None]  # the subclass's

    def _moment_state(self, p: torch.Tensor) -> dict[str, Any]:
        """``p``'s state with ``exp_avg`` and ``exp_avg_sq`` (zeros when new), for a warmup step where ``p`` has a
        gradient; from then on ``p`` has a variance estimate and is no longer frozen."""
        state = self.state[p]
        if "exp_avg_sq" not in state:
            if "exp_avg" not in state:  # else: a zero momentum view into a bucket built early
                state["exp_avg"] = torch.zeros_like(p, memory_format=torch.preserve_format)
            state["exp_avg_sq"] = torch.zeros_like(p, memory_format=torch.preserve_format)
            self.momentum_buckets.frozen.discard(id(p))
        return state

    def _adamw_step_(
        self, t: int, groups: Optional[Sequence[dict[str, Any]]] = None, compression_stage: bool = False
    ) -> None:
        """Step ``t`` of :class:`torch.optim.AdamW` (:func:`~lightning_onebit.optim.functional.adamw_step_`) on the
        (averaged) gradients of the parameters of ``groups`` (default all) that have one.

        The Adam-based optimizers' warmup, and their ``compress=False`` groups in the compression stage
        (``compression_stage=True``), where explicit ``exp_avg_mask`` multiply the momentum after the gradient is
        folded in, as they multiply the averaged momentum of the compressed groups."""
        for group in self.param_groups if groups is None else groups:
            params, grads, exp_avgs, exp_avg_sqs, masks = [], [], [], [], []
            for i, p in enumerate(group["params"]):
                if p.grad is None:
                    continue
                state = self._moment_state(p)
                params.append(p)
                grads.append(p.grad)
                exp_avgs.append(state["exp_avg"])
                exp_avg_sqs.append(state["exp_avg_sq"])
                if compression_stage and group["exp_avg_mask"][i] is not None:
                    masks.append((len(params) - 1, mask_like(group["exp_avg_mask"], i, state["exp_avg"])))
            if params:
                adamw_step_(group, params, grads, exp_avgs, exp_avg_sqs, t, masks)

    def _uncompressed_groups(self) -> list[dict[str, Any]]:
        """The param groups with ``compress=False``."""
        return [group for group in self.param_groups if not group["compress"]]

    def _step_uncompressed_groups_(self, averaged: bool = False) -> None:
        """Compression stage: average the gradients of the ``compress=False`` groups in full precision (unless
        ``averaged``: DDP's allreduce already did, e.g. 0/1 Adam's variance steps;
        :func:`~lightning_onebit.optim.uncompressed.average_gradients_`) and take their warmup update."""
        groups = self._uncompressed_groups()
        if not groups:
            return
        if not averaged:
            average_gradients_(self.compression, groups)
        self._full_precision_update_(groups)

    def _find_zero_variance(self) -> dict[int, torch.Tensor]:
        """The dead coordinates to keep at rest from now on (``v == 0`` with the variance frozen; see
        ``dead_coordinates`` of :class:`~lightning_onebit.OnebitAdam`), reported on rank 0 unless ``'ignore'`` or a
        callback masks them (:meth:`dead_coordinates_masked_by`)."""
        if self.dead_coordinates == "ignore":
            return {}
        zero_variance, report = zero_variance_coordinates(self.param_groups, self.state)
        masked = self.dead_coordinates == "mask"
        if report and self._dead_coordinates_masked_by is None and self.compression.rank() == 0:
            warn_zero_variance(report, type(self).__name__, masked)
        return zero_variance if masked else {}

    def _average_momenta_(self) -> None:
        """Fold each rank's local gradient into its momentum (``m = lerp(m, g, 1 - beta1)``), replace the momenta by
        their 1-bit compressed average over the process group (identical on every rank), and apply the masks; for
        the compressed param groups only (``compress=False`` groups: :meth:`_step_uncompressed_groups_`).

        Buckets whose exchange started during backward (the overlap hook) were folded there and are only finished
        here (:meth:`MomentumExchange.finish_step_`). Finds the dead coordinates (:meth:`_find_zero_variance`) and
        runs the kernel agreement at the first compressed step.
        """
        if self._zero_variance is None:
            self._zero_variance = self._find_zero_variance()
        if not self._backend_agreed:
            self.agree_kernel_backend()
        started = self.exchange.take_started()
        buckets = self._ensure_buckets(carry=True)
        self.exchange.finish_step_(started, buckets, self._bucket_source(), self._exchange_scale)
        apply_momentum_masks_(self.param_groups, self.state, self._zero_variance)

    def _compressed_average_(self, stream: str, buffers: Sequence[tuple[MomentumBucket, torch.Tensor]]) -> None:
        """Replace each buffer (laid out like its bucket, e.g. from :meth:`_bucket_state_buffer`) by its
        error-compensated 1-bit average over the process group, identical on every rank; the error feedback is
        ``stream``'s (:func:`~lightning_onebit.optim.buckets.feedback_key`). Buckets are pipelined."""
        if not self._backend_agreed:
            self.agree_kernel_backend()
        self.exchange.average_([(feedback_key(stream, bucket.key), flat, bucket.layout) for bucket, flat in buffers])

    def _bucket_state_buffer(self, bucket: MomentumBucket, name: str) -> torch.Tensor:
        """``bucket``'s flat buffer of ``state[p][name]`` (:meth:`MomentumBucket.state_buffer`)."""
        return bucket.state_buffer(name, self.state)

    def _updated_params(self, group: dict[str, Any]) -> list[torch.Tensor]:
        """The group's parameters a compressed step updates: trainable ones with a variance estimate; none in a
        ``compress=False`` group (:meth:`_step_uncompressed_groups_` updates those)."""
        return [p for p in compressed_trainable(group) if id(p) not in self.momentum_buckets.frozen]
