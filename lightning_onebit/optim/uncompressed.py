"""Param groups kept out of compression (param-group option ``compress=False``): in the compression stage their
gradients are averaged in full precision every step, so their variance stays live and their momentum exact."""

from __future__ import annotations

from typing import Any, Sequence

import torch

from lightning_onebit.comm.full_precision import full_precision_allreduce_, sparse_rows_allreduce_
from lightning_onebit.comm.state import CompressedAllreduceState
from lightning_onebit.optim.groups import trainable


def average_gradients_(compression: CompressedAllreduceState, groups: Sequence[dict[str, Any]]) -> None:
    """Average the gradients of the trainable parameters of ``groups`` (the ``compress=False`` ones) over
    ``compression``'s process group, in full precision, in place.

    One ``all_reduce`` per (device, dtype) over all their gradients
    (:func:`~lightning_onebit.comm.full_precision_allreduce_`), and for groups with ``sparse_rows=True`` two
    ``all_gather`` of their nonzero rows (:func:`~lightning_onebit.comm.sparse_rows_allreduce_`). A parameter without a
    gradient on this rank contributes a zero gradient (written into its ``.grad``), as in the compressed groups, so
    that every rank sends the same buffer; afterwards ``.grad`` holds the averaged gradient. Since the momentum is
    identical on every rank before the gradient is folded in, averaging the gradient is averaging the momentum
    exactly.
    """
    dense, sparse = [], []
    for group in groups:
        for p in trainable(group):
            if p.grad is None:
                p.grad = torch.zeros_like(p, memory_format=torch.preserve_format)
            (sparse if group["sparse_rows"] else dense).append(p.grad)
    full_precision_allreduce_(compression, dense)
    sparse_rows_allreduce_(compression, sparse)
