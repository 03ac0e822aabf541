"""How momenta are laid out in buckets: the bucket plan (which parameters share a bucket, as asked for: the overlap
hook passes DDP's gradient buckets) checked and compared, the packing of the other momenta in parameter order up to a
size, the flat, zero-padded buffers (:class:`MomentumBucket`) whose views become the parameters' momenta, and other
buffers a step exchanges laid out like them (:class:`ExchangeBuffers`).

What runs when the buckets are laid out: at the first compressed step, and whenever the plan, the world size or the
trainable parameters change. :class:`~lightning_onebit.optim.buckets.MomentumBuckets` decides when.
"""

from __future__ import annotations

from typing import Any, Callable, Hashable, Optional, Sequence

import torch

from lightning_onebit.comm.layout import BucketLayout

#: A bucket plan: ``(bucket key, parameters in order)`` per bucket; ``None``: packed by size.
Plan = Optional[list[tuple[int, list[torch.Tensor]]]]


def same_plan(a: Plan, b: Plan) -> bool:
    """Whether two bucket plans are the same keys and parameters (by identity), in the same order."""
    if a is None or b is None:
        return a is None and b is None
    return len(a) == len(b) and all(
        ka == kb and len(pa) == len(pb) and all(x is y for x, y in zip(pa, pb)) for (ka, pa), (kb, pb) in zip(a, b)
    )


def checked_plan(buckets: Optional[Sequence[Sequence[torch.Tensor]]], trainable_ids: set[int]) -> Plan:
    """``buckets`` (parameters per bucket; ``None``: pack by size) as a plan over the parameters in
    ``trainable_ids``: others are dropped, and so are buckets left empty (their keys stay their positions). Raises
    ``ValueError`` if a bucket mixes devices or dtypes (a bucket is one flat buffer) or names a parameter twice (in
    it or in an earlier one)."""
    if buckets is None:
        return None
    plan: list[tuple[int, list[torch.Tensor]]] = []
    seen: set[int] = set()
    for key, params in enumerate(buckets):
        kept = [p for p in params if id(p) in trainable_ids]
        if len({(p.device, p.dtype) for p in kept}) > 1:
            raise ValueError(f"set_bucket_plan: bucket {key} mixes devices or dtypes; a bucket is one flat buffer")
        if any(id(p) in seen for p in kept):
            raise ValueError(f"set_bucket_plan: bucket {key} names a parameter that an earlier bucket holds")
        if len({id(p) for p in kept}) != len(kept):
            raise ValueError(f"set_bucket_plan: bucket {key} names a parameter twice")
        seen.update(id(p) for p in kept)
        if kept:
            plan.append((key, kept))
    return plan


class MomentumBucket:
    """A flat, zero-padded momentum buffer; the momenta of its parameters are views into it.

    ``fold_groups`` lists, per distinct ``beta1`` among its parameters' param groups, ``(beta1, indices into
    params)``: how a gradient is folded into these momenta (:func:`~lightning_onebit.optim.functional.fold_gradients_`).
    """

    def __init__(self, key: int, params: list[torch.Tensor], layout: BucketLayout, flat: torch.Tensor,
                 fold_groups: list[tuple[float, list[int]]]) -> None:
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


class ExchangeBuffers:
    """Flat buffers laid out like the momentum buckets (one per bucket: its layout, dtype and device, padding zero)
    that a step fills and exchanges, laid out once per bucket layout (:meth:`lay_out_`) rather than in every step:
    0/1 Adam's ``exchange="gradient"`` copies each compressed step's local gradients into them and averages them in
    1 bit. Nothing here is checkpointed (they hold nothing between steps; their error feedback is the exchange's).

    Attributes:
        laid_out_for: the bucket list (as :meth:`MomentumBuckets.ensure
            <lightning_onebit.optim.buckets.MomentumBuckets.ensure>` returned it) they are laid out like; ``None``
            until :meth:`lay_out_`. A rebuild of the buckets returns another list: lay them out again.
        params: the buckets' parameters, bucket by bucket, in order.
        views: each parameter's view of its bucket's buffer (the order of :attr:`params`).
        by_param: ``id(param)`` -> its view.
        items: per bucket, what the 1-bit exchange averages: ``(error-feedback key, flat buffer, layout)``.
    """

    def __init__(self) -> None:
        self.laid_out_for: Optional[Sequence[MomentumBucket]] = None
        self.params: list[torch.Tensor] = []
        self.views: list[torch.Tensor] = []
        self.by_param: dict[int, torch.Tensor] = {}
        self.items: list[tuple[Hashable, torch.Tensor, BucketLayout]] = []

    def lay_out_(self, buckets: Sequence[MomentumBucket], feedback_key: Callable[[int], Hashable]) -> None:
        """Lay the buffers out like ``buckets`` (zeros; an empty list frees them), bucket ``b``'s under the
        error-feedback key ``feedback_key(b.key)``."""
        self.params, self.views, self.items = [], [], []
        for bucket in buckets:
            flat = torch.zeros_like(bucket.flat)
            self.items.append((feedback_key(bucket.key), flat, bucket.layout))
            offset = 0
            for p in bucket.params:
                self.params.append(p)
                self.views.append(flat[offset : offset + p.numel()].view_as(p))
                offset += p.numel()
        self.by_param = {id(p): view for p, view in zip(self.params, self.views)}
        self.laid_out_for = buckets


def pack(trainable: Sequence[torch.Tensor], momentum: Callable[[torch.Tensor], torch.Tensor], plan: Plan,
         cap_bytes: int) -> list[tuple[int, list[torch.Tensor]]]:
    """``(key, parameters)`` per bucket: the ``plan``'s buckets (restricted to ``trainable``), then the rest packed in
    parameter order within each device and dtype (one of them per bucket; kinds in order of first appearance), each
    up to ``cap_bytes`` of momentum (``momentum(p)``), with keys after the plan's."""
    runs: list[tuple[int, list[torch.Tensor]]] = []
    planned: set[int] = set()
    if plan is not None:
        present = {id(p) for p in trainable}
        for key, params in plan:
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
        if packed[-1] and filled[kind] + nbytes > cap_bytes:
            packed.append([])
            filled[kind] = 0
        packed[-1].append(p)
        filled[kind] = filled.get(kind, 0) + nbytes
    for packed in packed_by_kind.values():
        for params in packed:
            runs.append((next_key, params))
            next_key += 1
    return runs


def build_buckets(runs: Sequence[tuple[int, list[torch.Tensor]]], state: Any, beta1: dict[int, float],
                  world_size: int) -> list[MomentumBucket]:
    """One :class:`MomentumBucket` per ``(key, parameters)`` of ``runs`` (:func:`pack`), for ``world_size`` ranks:
    every momentum (``state[p]["exp_avg"]``, which must exist) is copied into its bucket's flat buffer and replaced by
    a view of it; ``beta1[id(p)]`` is ``p``'s param group's ``beta1``."""
    buckets = []
    for key, params in runs:
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
            fold_groups.setdefault(beta1[id(p)], []).append(i)
        buckets.append(MomentumBucket(key, params, layout, flat, list(fold_groups.items())))
    return buckets


def layouts_of(runs: Sequence[tuple[int, list[torch.Tensor]]], world_size: int) -> dict[int, BucketLayout]:
    """Bucket key -> layout of the buckets ``runs`` would build, building none (no momentum moves)."""
    return {key: BucketLayout.build([p.numel() for p in params], world_size) for key, params in runs}
