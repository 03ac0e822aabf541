"""The bucket plan: which parameters' momenta share a bucket, as asked for (the overlap hook passes DDP's gradient
buckets), checked and compared. :class:`~lightning_onebit.optim.buckets.MomentumBuckets` installs it and builds the
buckets.
"""

from __future__ import annotations

from typing import Optional, Sequence

import torch

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
