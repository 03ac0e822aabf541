"""Local steps and their sync, as a part of an optimizer (:class:`LocalSteps`; 0/1 Adam's local-step phase): steps
without communication in which each rank accumulates its own update, and the sync that averages the accumulated
updates (1 bit, or in full precision) and moves every replica to the same new point.

Between syncs each rank keeps, per parameter, the sum of its steps ``U`` (state ``update_since_sync``, laid out like
the momentum buckets so that it is exchanged as they are) and the parameter at the last sync ``p_sync`` (state
``synced_param``, identical on every rank), and per param group the learning rates summed since the last sync and the
product of the weight-decay factors. The sync computes the new point from rank-identical values only, so replicas are
bitwise identical after every sync.
"""

from __future__ import annotations

import logging
from typing import Any, Callable, Optional, Sequence

import torch

from lightning_onebit.comm.full_precision import full_precision_allreduce_
from lightning_onebit.optim.bucket_layout import MomentumBucket
from lightning_onebit.optim.buckets import BucketSource, MomentumBuckets, compressed_trainable
from lightning_onebit.optim.error_feedback import stream_of
from lightning_onebit.optim.functional import bias_corrections, sync_update_

log = logging.getLogger(__name__)

UPDATE = "update_since_sync"  #: per-parameter state: the sum of lr/bc1 * m over the local steps since the last sync
SYNCED = "synced_param"  #: per-parameter state: the parameter at the last sync (identical on every rank)
#: What :meth:`LocalSteps.sync_` does to a tensor before it is applied (masks, zero-variance coordinates).
KeepAtRest = Callable[[dict[str, Any], list[torch.Tensor], list[torch.Tensor]], None]


class LocalSteps:
    """The local steps of an optimizer whose momentum buckets are ``buckets``: the sums since the last sync and the
    sync itself. Every method that communicates is a collective: every rank calls it at the same step.

    Attributes:
        lr_sum: per param group, the learning rates summed since the last sync (``None`` before the first local step,
            or after a load that lacks them).
        decay: per param group, the product of the weight-decay factors ``1 - lr wd`` since the last sync.
        since_sync: local steps taken since the last sync (0: every replica is the same).
        forced_syncs: syncs made between scheduled ones (:meth:`synchronize`, e.g. before a checkpoint).
    """

    def __init__(self, buckets: MomentumBuckets) -> None:
        self.buckets = buckets
        self.lr_sum: Optional[list[float]] = None
        self.decay: Optional[list[float]] = None
        self.since_sync = 0
        self.forced_syncs = 0

    def updated(self, group: dict[str, Any]) -> list[torch.Tensor]:
        """The group's parameters local steps update: trainable, compressed, with a variance estimate."""
        return [p for p in compressed_trainable(group) if id(p) not in self.buckets.frozen]

    def update_buffers(self, source: BucketSource, buckets: Sequence[MomentumBucket]) -> list[torch.Tensor]:
        """Each bucket's flat buffer of the accumulated updates (its parameters' ``state[p][UPDATE]`` are views of it),
        in bucket order. A parameter in no bucket that the steps update (an empty shard: a sharded parameter with no
        row on this rank, which nothing exchanges) gets an empty update of its own."""
        flats = [bucket.state_buffer(UPDATE, source.state) for bucket in buckets]
        for group in source.groups:
            for p in self.updated(group):
                if p.numel() == 0 and UPDATE not in source.state[p]:
                    source.state[p][UPDATE] = torch.zeros_like(p)
        return flats

    def begin_(self, source: BucketSource, buckets: Sequence[MomentumBucket], after: int) -> None:
        """At the first local step (after step ``after``, the last that may update the variance): the error feedback
        held momentum (or gradient) errors and restarts for updates, the scratch gradient buffers are freed, and the
        (rank-identical) parameters become the first sync point."""
        # the algorithm's own reset (the error restarts for updates): not measured, which would read the device back
        # in the middle of training
        source.compression.reset_error_feedback(lambda key: stream_of(key) != "update", measure=False)
        for bucket in buckets:
            bucket.extra.pop("gradient", None)
            bucket.state_buffer(UPDATE, source.state).zero_()
        for group in source.groups:
            for p in self.updated(group):
                source.state[p][SYNCED] = p.detach().clone()
        self.lr_sum, self.decay = [0.0] * len(source.groups), [1.0] * len(source.groups)
        self.since_sync = 0
        log.info("%s: variance frozen after step %d; local steps from step %d (error feedback of the exchanges "
                 "before them reset)", source.name, after, source.step)

    def accumulate_(self, index: int, group: dict[str, Any], params: list[torch.Tensor],
                    exp_avgs: list[torch.Tensor], state: Any, t: int) -> None:
        """Add local step ``t``'s momentum step of param group ``index`` to the sums: ``U = U + lr m_hat`` (before the
        update is applied), ``lr_sum = lr_sum + lr``, ``decay = decay (1 - lr wd)``."""
        lr, wd = group["lr"], group["weight_decay"]
        bias_correction1 = bias_corrections(group, t, t)[0]
        torch._foreach_add_([state[p][UPDATE] for p in params], exp_avgs, alpha=lr / bias_correction1)
        assert self.lr_sum is not None and self.decay is not None
        self.lr_sum[index] += lr
        self.decay[index] *= 1 - lr * wd

    def sync_(self, source: BucketSource, buckets: Sequence[MomentumBucket], t: int, variance_updates: int,
              average_: Callable[[list[tuple[MomentumBucket, torch.Tensor]]], None], keep_at_rest_: KeepAtRest,
              exact: bool = False) -> None:
        """Average the accumulated updates (``average_``, the optimizer's 1-bit exchange of them; ``exact``: one
        full-precision ``all_reduce`` instead) and move every replica to the same new point
        (:func:`~lightning_onebit.optim.functional.sync_update_`), masked by ``keep_at_rest_``. A param group whose
        learning rate was 0 over the whole interval (``lr_sum = 0``) averages its momenta instead and stays at
        ``p_sync``."""
        state = source.state
        pairs = list(zip(buckets, self.update_buffers(source, buckets)))
        assert self.lr_sum is not None and self.decay is not None
        for index, group in enumerate(source.groups):
            params = self.updated(group)
            if self.lr_sum[index] == 0 and params:  # lr was 0 throughout: nothing moved; average the momenta
                torch._foreach_copy_([state[p][UPDATE] for p in params], [state[p]["exp_avg"] for p in params])
        if exact:
            full_precision_allreduce_(source.compression, [flat for _, flat in pairs])
        else:
            average_(pairs)
        for index, group in enumerate(source.groups):
            params = self.updated(group)
            if not params:
                continue
            updates = [state[p][UPDATE] for p in params]
            keep_at_rest_(group, params, updates)
            sync_update_(group, params, updates, [state[p]["exp_avg"] for p in params],
                         [state[p]["exp_avg_sq"] for p in params], [state[p][SYNCED] for p in params],
                         self.lr_sum[index], self.decay[index], t, variance_updates, source.compression.backend)
        for _, flat in pairs:
            flat.zero_()
        self.lr_sum, self.decay = [0.0] * len(source.groups), [1.0] * len(source.groups)
        self.since_sync = 0

    def state_dict(self) -> dict[str, Any]:
        """The sums since the last sync, for the optimizer's checkpoint."""
        return {"lr_sum": self.lr_sum, "decay": self.decay, "local_steps_since_sync": self.since_sync}

    def load_state_dict(self, saved: dict[str, Any], groups: int) -> None:
        """Restore :meth:`state_dict` when it has the sums of ``groups`` param groups; else the local steps start from
        the loaded point."""
        self.lr_sum, self.decay, self.since_sync = None, None, 0
        if saved.get("lr_sum") is not None and len(saved["lr_sum"]) == groups:
            self.lr_sum = [float(x) for x in saved["lr_sum"]]
            self.decay = [float(x) for x in saved["decay"]]
            self.since_sync = int(saved.get("local_steps_since_sync", 0))
