"""Momentum buckets: the flat, zero-padded buffers whose views are the parameters' momenta, and their layout.

A bucket is what one compressed exchange sends: one flat local tensor with a :class:`~lightning_onebit.comm.BucketLayout`
(segment sizes, padding to a multiple of the world size). :class:`MomentumBuckets` decides which parameters share a
bucket, either packed in parameter order up to ``bucket_cap_mb`` (one device and dtype per bucket) or as a *plan*
says (the overlapped exchange passes DDP's gradient buckets, so that a bucket can be exchanged as soon as its
gradients are ready; checked by :mod:`~lightning_onebit.optim.bucket_plan`), and it keeps the plan that waits while
exchanges are in flight. A re-layout carries the compression error over to the new buckets
(:mod:`~lightning_onebit.optim.error_feedback`).

Nothing here steps an optimizer: the optimizer hands in a :class:`BucketSource` (its param groups and per-parameter
state, where the momenta live) and gets buckets back.
"""

from __future__ import annotations

import logging
from typing import Any, Callable, NamedTuple, Optional, Sequence

import torch

from lightning_onebit.comm.layout import BucketLayout
from lightning_onebit.comm.state import CompressedAllreduceState
# the plan and the error-feedback keys are defined in bucket_plan and error_feedback; imported here too, where callers
# import them from
from lightning_onebit.optim.bucket_plan import Plan, checked_plan, same_plan
from lightning_onebit.optim.error_feedback import carry_error_feedback_, feedback_key, stream_of
from lightning_onebit.optim.groups import compressed_trainable

__all__ = [
    "BucketSource",
    "MomentumBucket",
    "MomentumBuckets",
    "Plan",
    "carry_error_feedback_",
    "checked_plan",
    "feedback_key",
    "same_plan",
    "stream_of",
]

log = logging.getLogger(__name__)


class BucketSource(NamedTuple):
    """What an optimizer's buckets are built from, taken when they are used (``load_state_dict`` replaces the
    optimizer's groups and state, so they are not kept): its param groups and per-parameter state (where the momenta
    live), its compression state (the world size, and the error feedback a re-layout carries over), and its class name
    and global step (for the log and the errors)."""

    groups: Sequence[dict[str, Any]]
    state: Any
    compression: CompressedAllreduceState
    name: str
    step: int

    def trainable(self) -> list[torch.Tensor]:
        """The compressed trainable parameters, in order (those of ``compress=False`` groups are not compressed)."""
        return [p for group in self.groups for p in compressed_trainable(group)]


class MomentumBucket:
    """A flat, zero-padded momentum buffer; the momenta of its parameters are views into it.

    ``fold_groups`` lists, per distinct ``beta1`` among its parameters' param groups, ``(1 - beta1, indices into
    params)``: how a gradient is folded into these momenta (``m = lerp(m, g, 1 - beta1)``).
    """

    def __init__(
        self,
        key: int,
        params: list[torch.Tensor],
        layout: BucketLayout,
        flat: torch.Tensor,
        fold_groups: list[tuple[float, list[int]]],
    ) -> None:
        self.key = key
        self.params = params
        self.layout = layout
        self.flat = flat
        self.fold_groups = fold_groups
        self.extra: dict[str, torch.Tensor] = {}  # other buffers laid out like ``flat`` (see state_buffer)

    def state_buffer(self, name: str, state: Any) -> torch.Tensor:
        """A flat buffer laid out like this bucket's momenta (layout, dtype, device; padding zero) whose views become
        each of its parameters' ``state[p][name]``, so that the per-parameter state is checkpointed and the buffer can
        be exchanged as one. Created on first use from the existing ``state[p][name]`` values (zeros where absent)."""
        flat = self.extra.get(name)
        if flat is None:
            flat = self.extra[name] = torch.zeros_like(self.flat)
            offset = 0
            for p in self.params:
                view = flat[offset : offset + p.numel()].view_as(p)
                old = state[p].get(name)
                if old is not None:
                    view.copy_(old)
                state[p][name] = view
                offset += p.numel()
        return flat


class MomentumBuckets:
    """Which compressed momenta share a bucket, and the buckets built for it.

    Attributes:
        cap_bytes: the size a packed bucket is filled to (``bucket_cap_mb``), bytes.
        plan: the installed plan (:func:`checked_plan`), or ``None`` (packed by ``cap_bytes``).
        plan_version: incremented whenever the installed plan changes (set or loaded); the overlap hook reads it to
            hand DDP's buckets again after a checkpoint brought another plan.
        deferred_plan: ``(plan,)`` asked for while exchanges were in flight, installed after the next step.
        built: the buckets, or ``None`` until built (and after anything that changes them).
        built_for: what ``built`` was made from (the plan as ids, the world size, the trainable ids): a rebuild is due
            when it changes (:meth:`fits`).
        by_key: ``built`` by bucket key.
        bucketed_ids: ids of the parameters in ``built``.
        frozen: ids of the compressed trainable parameters that had no variance estimate when ``built`` was made
            (never updated in warmup): the compression stage leaves them frozen; a warmup step that gives one a
            variance takes it out.
    """

    def __init__(self, cap_bytes: int) -> None:
        self.cap_bytes = cap_bytes
        self.plan: Plan = None
        self.plan_version = 0
        self.deferred_plan: Optional[tuple[Plan]] = None
        self.built: Optional[list[MomentumBucket]] = None
        self.built_for: Any = None
        self.by_key: dict[int, MomentumBucket] = {}
        self.bucketed_ids: set[int] = set()
        self.frozen: set[int] = set()

    def inputs(self, trainable: Sequence[torch.Tensor], world_size: int) -> Any:
        """What buckets over ``trainable`` and ``world_size`` are built from (host-only: no device access)."""
        return (
            None if self.plan is None else [(k, [id(p) for p in ps]) for k, ps in self.plan],
            world_size,
            [id(p) for p in trainable],
        )

    def fits(self, built_for: Any) -> bool:
        """Whether the built buckets are the ones for ``built_for`` (:meth:`inputs`)."""
        return self.built is not None and self.built_for == built_for

    def runs(self, trainable: Sequence[torch.Tensor], momentum: Callable[[torch.Tensor], torch.Tensor]) -> list[
            tuple[int, list[torch.Tensor]]]:
        """``(key, parameters)`` per bucket: the plan's buckets (restricted to ``trainable``), then the rest packed in
        parameter order within each device and dtype (one of them per bucket; kinds in order of first appearance),
        each up to :attr:`cap_bytes` of momentum (``momentum(p)``), with keys after the plan's."""
        runs: list[tuple[int, list[torch.Tensor]]] = []
        planned: set[int] = set()
        if self.plan is not None:
            present = {id(p) for p in trainable}
            for key, params in self.plan:
                kept = [p for p in params if id(p) in present and p.numel() > 0]
                if kept:
                    runs.append((key, kept))
                    planned.update(id(p) for p in kept)
        next_key = max((key for key, _ in runs), default=-1) + 1
        packed_by_kind: dict[tuple[torch.device, torch.dtype], list[list[torch.Tensor]]] = {}
        filled: dict[tuple[torch.device, torch.dtype], int] = {}
        for p in trainable:
            # an empty tensor (a sharded parameter with no row on this rank: its replicate peers hold the same empty
            # shard) has nothing to exchange: no bucket
            if id(p) in planned or p.numel() == 0:
                continue
            m = momentum(p)
            kind, nbytes = (m.device, m.dtype), m.numel() * m.element_size()
            packed = packed_by_kind.setdefault(kind, [[]])
            if packed[-1] and filled[kind] + nbytes > self.cap_bytes:
                packed.append([])
                filled[kind] = 0
            packed[-1].append(p)
            filled[kind] = filled.get(kind, 0) + nbytes
        for packed in packed_by_kind.values():
            for params in packed:
                runs.append((next_key, params))
                next_key += 1
        return runs

    def build(self, trainable: Sequence[torch.Tensor], state: Any, fold_weight: dict[int, float],
              world_size: int) -> list[MomentumBucket]:
        """Build the buckets over ``trainable`` for ``world_size`` ranks: every momentum (``state[p]["exp_avg"]``,
        which must exist) is copied into its bucket's flat buffer and replaced by a view of it;
        ``fold_weight[id(p)]`` is ``1 - beta1`` of ``p``'s param group. Afterwards :meth:`fits` holds for
        ``inputs(trainable, world_size)``."""
        built_for = self.inputs(trainable, world_size)
        self.built_for = built_for
        self.bucketed_ids = set(built_for[2])
        self.by_key = {}
        buckets = []
        for key, params in self.runs(trainable, lambda p: state[p]["exp_avg"]):
            like = state[params[0]]["exp_avg"]
            layout = BucketLayout.build([p.numel() for p in params], world_size)
            flat = torch.zeros(layout.padded_numel, dtype=like.dtype, device=like.device)
            offset = 0
            for p in params:
                view = flat[offset : offset + p.numel()].view_as(p)
                view.copy_(state[p]["exp_avg"])
                state[p]["exp_avg"] = view
                offset += p.numel()
            fold_groups: dict[float, list[int]] = {}
            for i, p in enumerate(params):
                fold_groups.setdefault(fold_weight[id(p)], []).append(i)
            bucket = MomentumBucket(key, params, layout, flat, list(fold_groups.items()))
            buckets.append(bucket)
            self.by_key[key] = bucket
        self.built = buckets
        return buckets

    def layouts(self, source: BucketSource) -> dict[int, BucketLayout]:
        """Bucket key -> layout of the buckets :meth:`ensure` would use for ``source`` now: the built ones if they fit,
        else those it would build, computed without building them (nothing changes: no momentum moves, no state is
        made). What a check of saved error feedback compares against, which every rank must be able to make without
        changing what the next backward and step do."""
        trainable = source.trainable()
        world_size = source.compression.world_size()
        if self.fits(self.inputs(trainable, world_size)):
            return {b.key: b.layout for b in self.built}
        state = source.state

        def momentum(p: torch.Tensor) -> torch.Tensor:  # ensure() gives a parameter without one zeros like it
            return (state[p] if p in state else {}).get("exp_avg", p)

        return {key: BucketLayout.build([p.numel() for p in params], world_size)
                for key, params in self.runs(trainable, momentum)}

    def built_empty(self, world_size: int) -> list[MomentumBucket]:
        """No compressed trainable parameter: no bucket."""
        self.built_for, self.bucketed_ids, self.by_key, self.built = self.inputs([], world_size), set(), {}, []
        return self.built

    # ------------------------------------------------------------------ the plan
    def planned_params(self) -> Optional[list[list[torch.Tensor]]]:
        """The parameters of each bucket of the installed plan, or ``None`` (packed by ``cap_bytes``)."""
        return None if self.plan is None else [list(params) for _, params in self.plan]

    def request_plan(
        self,
        buckets: Optional[Sequence[Sequence[torch.Tensor]]],
        source: BucketSource,
        *,
        defer: bool,
        install: Callable[[Plan], None],
    ) -> bool:
        """The optimizer's ``set_bucket_plan``: lay the momenta out in these buckets. Bucket ``i`` holds the momenta of
        ``buckets[i]``'s parameters, in that order, in one flat buffer exchanged by one compressed allreduce (its key
        is ``i``).

        The overlap hook passes DDP's gradient buckets (after DDP rebuilt them), so that a gradient bucket can be
        folded and exchanged as soon as it is ready. Parameters that are not among ``source``'s compressed trainable
        ones (not trained, or in ``compress=False`` groups) are skipped (:func:`checked_plan`, which raises
        ``ValueError`` if a bucket mixes devices or dtypes or names a parameter twice); trainable compressed
        parameters no bucket names are packed by ``cap_bytes`` after them. ``None`` returns to packing everything by
        ``cap_bytes``. The plan is saved in the optimizer's ``state_dict``, so a resumed run keeps its layout (and its
        error feedback, which belongs to the layout).

        Nothing happens if the plan is the one installed, or waiting. Otherwise, while exchanges are in flight
        (``defer``), it waits in :attr:`deferred_plan` for the end of the next step; else ``install`` installs it now
        (the optimizer's ``_install_plan``, which calls :meth:`install_plan_`): during the compression stage that
        moves the momenta into the new layout and carries the error feedback over coordinate by coordinate
        (:func:`carry_error_feedback_`, a collective: every rank calls it). Returns whether the plan changed."""
        plan = checked_plan(buckets, {id(p) for p in source.trainable()})
        if same_plan(plan, self.deferred_plan[0] if self.deferred_plan is not None else self.plan):
            return False
        if defer:
            self.deferred_plan = (plan,)
        else:
            install(plan)
        return True

    def install_plan_(self, plan: Plan, source: BucketSource) -> None:
        """Install ``plan`` (unless it is installed already); buckets already built are re-laid out at once, with
        their error feedback carried over (:meth:`relayout_`, a collective when there is error feedback)."""
        if same_plan(plan, self.plan):
            return
        self.plan = plan
        self.plan_version += 1
        if self.built is not None:
            old, self.built = self.built, None
            self.relayout_(old, source, "new bucket plan" if plan is not None else "packed by bucket_cap_mb")

    def load_plan(self, plan: Plan) -> None:
        """Install a plan read from a checkpoint (``None``: packed by ``cap_bytes``), dropping a waiting one; the
        buckets are rebuilt at their next use, without error feedback to carry (a load resets it)."""
        self.plan, self.deferred_plan = plan, None
        self.plan_version += 1
        self.built = None

    # ------------------------------------------------------------------ the buckets
    def ensure(self, source: BucketSource, carry: bool = False) -> list[MomentumBucket]:
        """Pack momenta of the compressed trainable parameters into flat padded buckets (once per layout; rebuilt
        when that set changes, e.g. a group's ``compress`` or a ``requires_grad``); momenta become views.

        ``carry=True`` (the step's exchange paths, which every rank runs at the same step): a rebuild carries the
        error feedback of the parameters that stay over to the new layout (:meth:`relayout_`, a collective), so
        freezing one layer does not reset the error of the others. Other callers (e.g. the optimizer's
        ``bucket_layouts``, which one rank may call alone) never start a collective here."""
        trainable = source.trainable()
        built_for = self.inputs(trainable, source.compression.world_size())
        if self.fits(built_for):
            return self.built
        if carry and self.built is not None:
            old, self.built = self.built, None
            self.relayout_(old, source, "the compressed trainable parameters changed")
            # without error feedback to carry, nothing was built yet
            return self.built if self.built is not None else self.ensure(source)
        if not trainable:
            return self.built_empty(built_for[1])
        self.frozen = set()
        never_updated = []
        for p in trainable:
            state = source.state[p]
            if "exp_avg_sq" not in state:
                # No variance estimate: frozen. It gets no exp_avg_sq, so it is recognised again whenever the
                # buckets are rebuilt (after load_state_dict, a process-group change).
                if "exp_avg" not in state:
                    state["exp_avg"] = torch.zeros_like(p)
                self.frozen.add(id(p))
                never_updated.append(tuple(p.shape))
        if never_updated:
            log.warning(
                "%s: %d parameter(s) had no gradient during warmup (shapes %s); without a variance estimate "
                "they stay frozen in the compression stage. Mask or exclude them, or lengthen warmup.",
                source.name,
                len(never_updated),
                never_updated[:8],
            )
        fold_weight = {
            id(p): 1 - group["betas"][0] for group in source.groups for p in compressed_trainable(group)
        }
        built = self.build(trainable, source.state, fold_weight, built_for[1])
        log.info(
            "%s: momentum buckets laid out at step %d: %d trainable tensors in %d bucket(s) over %d rank(s)%s",
            source.name,
            source.step,
            len(trainable),
            len(built),
            built_for[1],
            " (laid out like DDP's gradient buckets)" if self.plan is not None else "",
        )
        return built

    def relayout_(self, old_buckets: list[MomentumBucket], source: BucketSource, why: str) -> None:
        """The momentum buckets were re-laid out (``old_buckets`` is the layout the error feedback belongs to): build
        the new buckets and move every rank's error buffers into them, coordinate by coordinate
        (:func:`carry_error_feedback_`, a collective when there is error feedback: every rank calls it at the same
        point, as it does the bucket plan change). A parameter no longer in any bucket drops its error (counted in
        the log)."""
        carried = carry_error_feedback_(source.compression, old_buckets, lambda: self.ensure(source))
        if carried is None:
            log.info("%s: momentum buckets re-laid out at step %d (%s); no error feedback to carry over", source.name,
                     source.step, why)
            return
        new_buckets, lost, stale = carried
        log.info(
            "%s: momentum buckets re-laid out at step %d (%s); error feedback carried over coordinate by coordinate "
            "(%d bucket(s) -> %d)%s",
            source.name,
            source.step,
            why,
            len(old_buckets),
            len(new_buckets),
            "".join([
                f"; dropped for {lost} parameter(s) no longer in the buckets" if lost else "",
                f"; {stale} buffer(s) of another layout dropped" if stale else "",
            ]),
        )
