"""The exact average over the state's process group, for param groups kept out of 1-bit compression
(``compress=False``): :func:`full_precision_allreduce_` (dense, counted as a ring allreduce) and
:func:`sparse_rows_allreduce_` (only the rows holding a nonzero, for embedding tables; ``sparse_rows=True``).
"""

from __future__ import annotations

from typing import Sequence

import torch
import torch.distributed as dist

from lightning_onebit.comm.accounting import count_ring_allreduce, count_ring_bytes, ring_allreduce_bytes
from lightning_onebit.comm.groups import all_gather_async, naming_the_group
from lightning_onebit.comm.state import CompressedAllreduceState


def full_precision_allreduce_(state: CompressedAllreduceState, tensors: Sequence[torch.Tensor]) -> None:
    """Replace every tensor by its exact mean over ``state.process_group``, in full precision.

    For param groups with ``compress=False``: their local gradients, averaged as DDP would. The tensors are copied
    into one flat buffer per (device, dtype), in the order given, and each buffer is reduced by one ``all_reduce``
    (SUM, then divided by the world size: gloo has no AVG), so every rank ends with the same bits. Counted in
    ``state.counters`` as a ring allreduce (:func:`ring_allreduce_bytes` in the tensors' dtype) in
    ``bytes_sent_uncompressed`` as well as in ``bytes_sent``, ``bytes_received`` and ``bytes_fp32_equivalent``, the
    bytes going to this rank's ring neighbour ``(rank + 1) % P``: intra-node if the topology puts it on this rank's
    node, else (or without a topology) inter-node.

    A collective: every rank must pass tensors of the same sizes, dtypes and devices in the same order. With one rank
    (or no initialised process group) the tensors are left exactly as they are.
    """
    world_size = state.world_size()
    if world_size == 1 or not tensors:
        return
    by_kind = _by_device_and_dtype(tensors)
    rank, topology, counters = state.rank(), state.topology, state.counters
    for (device, _), same_kind in by_kind.items():
        started = state.timings.mark(device)
        # a fresh buffer: the shared kernel workspace may still be in use by exchanges started during backward
        flat = torch.cat([t.reshape(-1) for t in same_kind])
        with naming_the_group("full-precision all_reduce (compress=False groups)", state.process_group):
            dist.all_reduce(flat, op=dist.ReduceOp.SUM, group=state.process_group)
        flat.div_(world_size)
        offset = 0
        for t in same_kind:
            t.copy_(flat[offset : offset + t.numel()].view_as(t))
            offset += t.numel()
        counters.bytes_sent_uncompressed += count_ring_allreduce(counters, flat, world_size, rank, topology)
        state.timings.add(counters, "time_s", started, state.timings.mark(device))


def sparse_rows_allreduce_(state: CompressedAllreduceState, tensors: Sequence[torch.Tensor]) -> None:
    """Replace every tensor by its exact mean over ``state.process_group``, sending only its nonzero rows.

    For param groups with ``compress=False`` and ``sparse_rows=True``: embedding tables, whose gradient in one step is
    nonzero only in the rows of the tokens the batch looked up (a few hundred of a vocabulary of tens of thousands).
    A row is a slice along the first dimension (a 0-d or 1-d tensor's rows are its elements). Per (device, dtype),
    over all the tensors of that kind at once:

    1. each rank counts the rows of each tensor holding a nonzero;
    2. one ``all_gather`` of the row counts (an int64 per tensor), so that every rank sizes the payload alike: per
       tensor, the largest count of any rank, ``w`` (read on the host: the one host synchronisation of the call);
    3. one ``all_gather`` of every rank's payload, as bytes: per tensor, ``w`` row indices (int64) and ``w`` rows in
       the tensor's dtype, padded with row 0 and zeros (adding a zero changes nothing);
    4. every rank zeroes each tensor, adds the ranks' rows in rank order (one ``index_add_`` per rank: within it no
       index repeats with a nonzero row, so the result does not depend on the order of a CUDA kernel's atomics) and
       divides by the world size.

    The result is bitwise the sum of the ranks' tensors in rank order divided by the world size, on every rank (the
    same bits everywhere: every rank adds the same gathered rows in the same order). Counted in ``state.counters``
    as a ring all-gather: each rank sends ``(P-1)`` times its payload (counts included), in ``bytes_sent_uncompressed``
    as well as ``bytes_sent``, ``bytes_received`` and ``bytes_fp32_equivalent`` (the dense ring allreduce DDP would
    send in fp32), intra- or inter-node by the ring neighbour ``(rank + 1) % P`` as in :func:`count_ring_allreduce`.
    With ``w`` the most rows any rank touches in a table of ``R`` rows, this sends about ``w P / (2 R)`` of
    :func:`full_precision_allreduce_`'s bytes (fp32) and about ``16 w P / R`` of a 1-bit exchange's: for 30,522 rows
    and 2 ranks each touching 600 (batches of 1,024 tokens), 2% of the dense bytes and 60% of the 1-bit bytes, for an
    exact average. Every rank receives every other rank's rows, so the cost grows with ``P``.

    A collective: every rank must pass tensors of the same shapes, dtypes and devices in the same order. With one rank
    (or no initialised process group) the tensors are left exactly as they are.
    """
    world_size = state.world_size()
    if world_size == 1 or not tensors:
        return
    by_kind = _by_device_and_dtype(tensors)
    group, rank, counters = state.process_group, state.rank(), state.counters
    for (device, dtype), same_kind in by_kind.items():
        started = state.timings.mark(device)
        rows = [t.reshape(t.shape[0] if t.dim() else 1, -1) for t in same_kind]
        nonzero = [r.ne(0).any(dim=1) for r in rows]
        counts = torch.stack([m.sum() for m in nonzero]).to(torch.int64)
        gathered_counts = torch.empty(world_size * len(rows), dtype=torch.int64, device=device)
        with naming_the_group("all_gather of the touched-row counts (sparse_rows groups)", group):
            all_gather_async(gathered_counts, counts, group).wait()
        # the step's one host synchronisation (per device and dtype): the payload's size
        widths = gathered_counts.view(world_size, -1).amax(dim=0).tolist()
        # this rank's payload: per tensor, `width` indices then `width` rows, padded with index 0 and zero rows
        parts = []
        for r, m, count, width in zip(rows, nonzero, counts, widths):
            index = torch.nonzero_static(m, size=width, fill_value=0).view(-1)  # no sync: the size is given
            valid = torch.arange(width, device=device) < count
            picked = torch.where(valid.unsqueeze(1), r.index_select(0, index), torch.zeros((), dtype=dtype,
                                                                                             device=device))
            parts += [index.view(torch.uint8), picked.reshape(-1).view(torch.uint8)]
        payload = torch.cat(parts)
        gathered = torch.empty(world_size * payload.numel(), dtype=torch.uint8, device=device)
        with naming_the_group("all_gather of the touched rows (sparse_rows groups)", group):
            all_gather_async(gathered, payload, group).wait()
        gathered = gathered.view(world_size, -1)
        offset = 0
        for t, r, width in zip(same_kind, rows, widths):
            index_bytes, row_bytes = 8 * width, width * r.shape[1] * r.element_size()
            total = torch.zeros_like(r)
            for peer in range(world_size):  # rank order: the same sum on every rank
                index = gathered[peer, offset : offset + index_bytes].clone().view(torch.int64)
                values = gathered[peer, offset + index_bytes : offset + index_bytes + row_bytes].clone()
                total.index_add_(0, index, values.view(dtype).view(width, r.shape[1]))
            t.copy_(total.view_as(t)).div_(world_size)
            offset += index_bytes + row_bytes
        sent = (world_size - 1) * (counts.numel() * counts.element_size() + payload.numel())
        count_ring_bytes(counters, sent, world_size, rank, state.topology)
        counters.bytes_sent_uncompressed += sent
        counters.bytes_fp32_equivalent += ring_allreduce_bytes(sum(t.numel() for t in same_kind), 4, world_size)
        counters.collectives += 2
        counters.calls += 1
        state.timings.add(counters, "time_s", started, state.timings.mark(device))


def _by_device_and_dtype(
    tensors: Sequence[torch.Tensor],
) -> dict[tuple[torch.device, torch.dtype], list[torch.Tensor]]:
    """The tensors grouped by (device, dtype), each group in the given order: one collective per group."""
    by_kind: dict[tuple[torch.device, torch.dtype], list[torch.Tensor]] = {}
    for t in tensors:
        by_kind.setdefault((t.device, t.dtype), []).append(t)
    return by_kind
