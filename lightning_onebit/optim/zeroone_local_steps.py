"""0/1 Adam's local-step phase, as a mixin of :class:`~lightning_onebit.ZeroOneAdam`: steps without communication
that accumulate each rank's update, and the 1-bit sync that moves every replica to the same point.
"""

from __future__ import annotations

import logging
import math
from typing import Any, Callable, Optional, Sequence

import torch

from lightning_onebit import kernels
from lightning_onebit.comm.full_precision import full_precision_allreduce_
from lightning_onebit.comm.state import CompressedAllreduceState
from lightning_onebit.optim.buckets import MomentumBucket
from lightning_onebit.optim.error_feedback import stream_of
from lightning_onebit.optim.functional import adam_update_, bias_corrections
from lightning_onebit.optim.step_kind import StepKind

log = logging.getLogger(__name__)

_UPDATE = "update_since_sync"  # per-parameter state: sum of lr/bc1 * m over the local steps since the last sync
_SYNCED = "synced_param"  # per-parameter state: the parameter at the last sync (identical on every rank)


class LocalStepsMixin:
    """The local steps and syncs of :class:`~lightning_onebit.ZeroOneAdam`, which sets the attributes below."""

    param_groups: list[dict[str, Any]]
    state: Any
    _step: int
    compression: CompressedAllreduceState
    var_freeze_step: int
    variance_updates: int
    local_step_interval: int
    local_steps_since_sync: int
    forced_syncs: int
    _lr_sum: Optional[list[float]]
    _decay: Optional[list[float]]
    _ensure_buckets: Callable[..., list[MomentumBucket]]
    _bucket_state_buffer: Callable[[MomentumBucket, str], torch.Tensor]
    _updated_params: Callable[[dict[str, Any]], list[torch.Tensor]]
    _compressed_average_: Callable[[str, Sequence[tuple[MomentumBucket, torch.Tensor]]], None]
    _keep_at_rest_: Callable[[dict[str, Any], list[torch.Tensor], list[torch.Tensor]], None]

    @property
    def replicas_in_sync(self) -> bool:
        """False after a local step, until the next sync."""
        return self.local_steps_since_sync == 0

    def _local_step(self, t: int) -> StepKind:
        """A step on this rank's own gradient with no communication; a sync after it when the schedule says so."""
        buckets = self._ensure_buckets(carry=True)
        if self._lr_sum is None:
            self._begin_local_steps(buckets)
        self._update_buffers(buckets)
        for index, group in enumerate(self.param_groups):
            params = self._updated_params(group)
            if not params:
                continue
            exp_avgs = [self.state[p]["exp_avg"] for p in params]
            with_grad = [(m, p.grad) for m, p in zip(exp_avgs, params) if p.grad is not None]
            without = [m for m, p in zip(exp_avgs, params) if p.grad is None]
            b1 = group["betas"][0]
            if with_grad:
                torch._foreach_lerp_([m for m, _ in with_grad], [g for _, g in with_grad], 1 - b1)
            if without:  # a zero gradient, as in the compressed steps
                torch._foreach_mul_(without, b1)
            self._keep_at_rest_(group, params, exp_avgs)
            lr, wd = group["lr"], group["weight_decay"]
            bias_correction1 = bias_corrections(group, t, t)[0]
            torch._foreach_add_([self.state[p][_UPDATE] for p in params], exp_avgs, alpha=lr / bias_correction1)
            exp_avg_sqs = [self.state[p]["exp_avg_sq"] for p in params]
            adam_update_(group, params, exp_avgs, exp_avg_sqs, t, self.variance_updates, self.compression.backend)
            self._lr_sum[index] += lr
            self._decay[index] *= 1 - lr * wd
        self.local_steps_since_sync += 1
        if t % self.local_step_interval == 0:
            self._sync(t)
            return StepKind.SYNC
        return StepKind.LOCAL

    def _update_buffers(self, buckets: list[MomentumBucket]) -> list[torch.Tensor]:
        """Each bucket's flat buffer of the accumulated updates (its parameters' ``state[p][_UPDATE]`` are views of
        it), in bucket order. A parameter in no bucket that the steps update (an empty shard: a sharded parameter
        with no row on this rank, which nothing exchanges) gets an empty update of its own."""
        flats = [self._bucket_state_buffer(bucket, _UPDATE) for bucket in buckets]
        for group in self.param_groups:
            for p in self._updated_params(group):
                if p.numel() == 0 and _UPDATE not in self.state[p]:
                    self.state[p][_UPDATE] = torch.zeros_like(p)
        return flats

    def _begin_local_steps(self, buckets: list[MomentumBucket]) -> None:
        """At the first local step: the error feedback held momentum (or gradient) errors and restarts for updates,
        the scratch gradient buffers are freed, and the (rank-identical) parameters become the first sync point."""
        # the algorithm's own reset (0/1 Adam restarts the error for updates): not measured, which would read the
        # device back in the middle of training
        self.compression.reset_error_feedback(lambda key: stream_of(key) != "update", measure=False)
        for bucket in buckets:
            bucket.extra.pop("gradient", None)
            self._bucket_state_buffer(bucket, _UPDATE).zero_()
        for group in self.param_groups:
            for p in self._updated_params(group):
                self.state[p][_SYNCED] = p.detach().clone()
        self._lr_sum = [0.0] * len(self.param_groups)
        self._decay = [1.0] * len(self.param_groups)
        self.local_steps_since_sync = 0
        log.info(
            "ZeroOneAdam: variance frozen after step %d; local steps from step %d (error feedback of the exchanges "
            "before them reset)",
            self.var_freeze_step,
            self._step,
        )

    @torch.no_grad()
    def synchronize(self) -> bool:
        """Sync now if local steps were taken since the last sync (every rank must call it; the next scheduled sync
        still comes when the schedule says). Returns whether it synced.

        This sync averages the accumulated updates in full precision (one ``all_reduce`` of their size), not in 1
        bit, and leaves the compression error feedback to the next scheduled sync. A 1-bit sync here, a step or two
        after a scheduled one, would fold the compression error of a whole interval (up to ``local_step_clipper``
        steps of updates) into an update of one step, and the momentum it sets (the average update over the summed
        learning rate) would grow by that ratio: on the example, syncs before every validation so made the local
        steps diverge."""
        if self.local_steps_since_sync == 0:
            return False
        self._sync(self._step, exact=True)
        self.forced_syncs += 1
        return True

    def _sync(self, t: int, exact: bool = False) -> None:
        """Average the accumulated updates (1 bit; ``exact``: in full precision) and move every replica to the same
        new point."""
        buckets = self._ensure_buckets(carry=True)
        pairs = list(zip(buckets, self._update_buffers(buckets)))
        assert self._lr_sum is not None and self._decay is not None
        for index, group in enumerate(self.param_groups):
            if self._lr_sum[index] == 0:  # lr was 0 throughout: nothing moved; average the momenta themselves
                params = self._updated_params(group)
                if params:
                    torch._foreach_copy_(
                        [self.state[p][_UPDATE] for p in params], [self.state[p]["exp_avg"] for p in params]
                    )
        if exact:
            full_precision_allreduce_(self.compression, [flat for _, flat in pairs])
        else:
            self._compressed_average_("update", pairs)
        for index, group in enumerate(self.param_groups):
            params = self._updated_params(group)
            if not params:
                continue
            updates = [self.state[p][_UPDATE] for p in params]
            self._keep_at_rest_(group, params, updates)
            exp_avgs = [self.state[p]["exp_avg"] for p in params]
            synced = [self.state[p][_SYNCED] for p in params]
            lr_sum, decay = self._lr_sum[index], self._decay[index]
            if lr_sum == 0:
                torch._foreach_copy_(exp_avgs, updates)
                torch._foreach_copy_(params, synced)
                continue
            torch._foreach_copy_(exp_avgs, updates)
            torch._foreach_mul_(exp_avgs, bias_corrections(group, t, t)[0] / lr_sum)
            bc2_sqrt = math.sqrt(bias_corrections(group, t, self.variance_updates)[1])
            eps = group["eps"]
            exp_avg_sqs = [self.state[p]["exp_avg_sq"] for p in params]
            if kernels._uses_native_adam(params, exp_avgs, exp_avg_sqs, self.compression.backend):
                # the C kernel's local steps keep no cached denominator: a temporary per tensor, as they need none
                denominators = [kernels.sqrt_into(v, torch.empty_like(v)).div_(bc2_sqrt).add_(eps) for v in exp_avg_sqs]
            else:  # the torch path's local steps cached them (the frozen variance's): the same bits, no pass
                denominators = kernels.frozen_adam_denominators(exp_avg_sqs, bc2_sqrt, eps)
            torch._foreach_copy_(params, synced)
            if decay != 1.0:
                torch._foreach_mul_(params, decay)
            torch._foreach_addcdiv_(params, updates, denominators, value=-1.0)
            torch._foreach_copy_(synced, params)
        for _, flat in pairs:
            flat.zero_()
        self._lr_sum = [0.0] * len(self.param_groups)
        self._decay = [1.0] * len(self.param_groups)
        self.local_steps_since_sync = 0
