"""0/1 Adam's local steps' part (:class:`LocalSteps`): the sums each rank keeps between syncs, the buffers they are
laid out in, their start at the first local step and their checkpoint. The local and sync steps themselves, which
update them, read top-down in :mod:`~lightning_onebit.optim.zeroone_adam`.

Between syncs each rank keeps, per parameter, the sum of its steps ``U`` (state ``update_since_sync``, laid out like
the momentum buckets so that it is exchanged as they are) and the parameter at the last sync ``p_sync`` (state
``synced_param``, identical on every rank), and per param group the learning rates summed since the last sync and the
product of the weight-decay factors. The sync computes the new point from rank-identical values only, so replicas are
bitwise identical after every sync.
"""

from __future__ import annotations

import logging
from typing import Any, Callable, Hashable, Optional, Sequence

import torch

from lightning_onebit.comm.layout import BucketLayout
from lightning_onebit.optim.bucket_layout import MomentumBucket
from lightning_onebit.optim.buckets import BucketSource
from lightning_onebit.optim.error_feedback import feedback_key, stream_of

log = logging.getLogger(__name__)

UPDATE = "update_since_sync"  #: per-parameter state: the sum of lr/bc1 * m over the local steps since the last sync
SYNCED = "synced_param"  #: per-parameter state: the parameter at the last sync (identical on every rank)
#: The parameters of a param group that the local steps update (the optimizer's: those with a variance estimate).
Updated = Callable[[dict[str, Any]], list[torch.Tensor]]


class LocalSteps:
    """The sums of 0/1 Adam's local steps since the last sync, and the buffers of ``U``.

    Attributes:
        lr_sum: per param group, the learning rates summed since the last sync (``None`` before the first local step,
            or after a load that lacks them).
        decay: per param group, the product of the weight-decay factors ``1 - lr wd`` since the last sync.
        since_sync: local steps taken since the last sync (0: every replica is the same).
        forced_syncs: syncs made between scheduled ones (:meth:`ZeroOneAdam.synchronize`, e.g. before a checkpoint).
        laid_out_for: the momentum buckets (the list :meth:`MomentumBuckets.ensure
            <lightning_onebit.optim.buckets.MomentumBuckets.ensure>` returned) that :attr:`flats` are laid out like
            (:meth:`lay_out_`: once per bucket layout); ``None`` until then.
        flats: per bucket, the flat buffer of ``U`` (its parameters' ``state[p][UPDATE]`` are views of it).
        items: per bucket, what the 1-bit exchange of ``U`` averages: ``(error-feedback key, flat, layout)``, the key
            in the ``"update"`` stream (the error feedback of the momenta's exchange is not the updates').
    """

    def __init__(self) -> None:
        self.lr_sum: Optional[list[float]] = None
        self.decay: Optional[list[float]] = None
        self.since_sync = 0
        self.forced_syncs = 0
        self.laid_out_for: Optional[Sequence[MomentumBucket]] = None
        self.flats: list[torch.Tensor] = []
        self.items: list[tuple[Hashable, torch.Tensor, BucketLayout]] = []

    def lay_out_(self, source: BucketSource, buckets: Sequence[MomentumBucket], updated: Updated) -> None:
        """Lay ``U`` out like ``buckets`` (the values of ``state[p][UPDATE]`` kept: after a rebuild of the buckets or
        a load): :attr:`flats` and :attr:`items`. A parameter in no bucket that the steps update (an empty shard: a
        sharded parameter with no row on this rank, which nothing exchanges) gets an empty ``U`` of its own."""
        self.flats = [bucket.state_buffer(UPDATE, source.state) for bucket in buckets]
        self.items = [(feedback_key("update", b.key), flat, b.layout) for b, flat in zip(buckets, self.flats)]
        self.laid_out_for = buckets
        for group in source.groups:
            for p in updated(group):
                if p.numel() == 0 and UPDATE not in source.state[p]:
                    source.state[p][UPDATE] = torch.zeros_like(p)

    def begin_(self, source: BucketSource, buckets: Sequence[MomentumBucket], updated: Updated, after: int) -> None:
        """At the first local step (after step ``after``, the last that may update the variance): the error feedback
        held momentum (or gradient) errors and restarts for updates, ``U`` is laid out and zero and the
        (rank-identical) parameters become the first sync point."""
        # the algorithm's own reset (the error restarts for updates): not measured, which would read the device back
        # in the middle of training
        source.compression.reset_error_feedback(lambda key: stream_of(key) != "update", measure=False)
        self.lay_out_(source, buckets, updated)
        for flat in self.flats:
            flat.zero_()
        for group in source.groups:
            for p in updated(group):
                source.state[p][SYNCED] = p.detach().clone()
        self.lr_sum, self.decay = [0.0] * len(source.groups), [1.0] * len(source.groups)
        self.since_sync = 0
        log.info("%s: variance frozen after step %d; local steps from step %d (error feedback of the exchanges "
                 "before them reset)", source.name, after, source.step)

    def state_dict(self) -> dict[str, Any]:
        """The sums since the last sync, for the optimizer's checkpoint
        (:class:`~lightning_onebit.optim.checkpoint.LocalStepsEntry`)."""
        return {"lr_sum": self.lr_sum, "decay": self.decay, "local_steps_since_sync": self.since_sync}

    def load_state_dict(self, saved: dict[str, Any], groups: int) -> None:
        """Restore :meth:`state_dict` when it has the sums of ``groups`` param groups; else the local steps start from
        the loaded point. ``U`` is laid out again at the next local step (the loaded state replaced its views)."""
        self.lr_sum, self.decay, self.since_sync = None, None, 0
        self.laid_out_for, self.flats, self.items = None, [], []
        if saved.get("lr_sum") is not None and len(saved["lr_sum"]) == groups:
            self.lr_sum = [float(x) for x in saved["lr_sum"]]
            self.decay = [float(x) for x in saved["decay"]]
            self.since_sync = int(saved.get("local_steps_since_sync", 0))
