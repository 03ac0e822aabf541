"""The error feedback of the momentum buckets: the key of a bucket's error buffers in each compressed stream, and
carrying the buffers over to a new bucket layout, coordinate by coordinate.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, Callable, Hashable, Optional

import torch

from lightning_onebit.comm.groups import all_gather_async
from lightning_onebit.comm.state import CompressedAllreduceState

if TYPE_CHECKING:  # for annotations only: optim.buckets imports this module
    from lightning_onebit.optim.buckets import MomentumBucket


def feedback_key(stream: str, key: int) -> Hashable:
    """The error-feedback key of bucket ``key`` in ``stream``: each quantity an optimizer compresses (momenta,
    gradients, accumulated updates) has error buffers of its own. The momentum stream keeps the bare bucket key (what
    checkpoints of 1-bit Adam and 1-bit LAMB hold)."""
    return key if stream == "momentum" else (stream, key)


def stream_of(key: Any) -> str:
    """The stream of an error-feedback key (:func:`feedback_key`)."""
    return key[0] if isinstance(key, tuple) and len(key) == 2 else "momentum"


def _bucket_key(key: Any) -> Any:
    return key[1] if isinstance(key, tuple) else key


def carry_error_feedback_(
    compression: CompressedAllreduceState,
    old_buckets: list[MomentumBucket],
    build_new: Callable[[], list[MomentumBucket]],
) -> Optional[tuple[list[MomentumBucket], int, int]]:
    """Move every rank's error buffers from the layout of ``old_buckets`` into the buckets ``build_new()`` makes,
    coordinate by coordinate, so that no error is dropped when the momenta are re-laid out (a checkpoint saved with
    ``overlap=False`` resumed with ``overlap=True``: the packed layout restored from the sidecars, then DDP's).

    Both buffers hold one value per coordinate of a bucket's flat padded buffer: the worker error the coordinates this
    rank compresses (flat: all of them; hierarchical: its node's shard ``l`` of ``L``), the server error the chunk this
    rank serves. A new layout moves coordinates to other chunks and shards, hence to other ranks, so each stream's
    buffers are first gathered into whole per-coordinate vectors (``all_gather``: the server chunks over the process
    group, flat, or over the inter- then the intra-node group, hierarchical; the worker shards over the intra-node
    group), cut per parameter, placed at the parameter's offset in its new bucket, and this rank's new shard and chunk
    taken. Padding holds no error (it is zero and compresses to zero). Transient memory: two flat copies of the
    bucketed momenta per stream. A collective when there is error feedback (every rank has the same buffers): every
    rank calls it at the same point.

    Returns ``None`` when there was no error feedback of ``old_buckets``' layout (nothing is built then), else
    ``(new buckets, parameters whose error was dropped because no new bucket holds them, buffers of another layout
    dropped)``. The error feedback is reset either way before the new one is written.
    """
    saved = compression.error_feedback_state_dict()["buckets"]
    old_by_key = {b.key: b for b in old_buckets}
    entries = sorted(
        (
            (fkey, entry) for fkey, entry in saved.items()
            if _bucket_key(fkey) in old_by_key
            and tuple(entry["layout"][0]) == old_by_key[_bucket_key(fkey)].layout.tensor_numels
        ),
        key=lambda item: (stream_of(item[0]), _bucket_key(item[0])),
    )
    stale = len(saved) - len(entries)
    compression.reset_error_feedback()
    if not entries:
        return None
    topology, per_node = compression.topology, compression.ranks_per_node
    if per_node > 1:
        nodes, local, inter = topology.num_nodes, topology.local_index, topology.inter_index
        intra_group, inter_group = topology.intra_group, topology.inter_group
    else:
        nodes, local, inter = compression.world_size(), 0, compression.rank()
        intra_group, inter_group = None, compression.process_group

    def gather(part: torch.Tensor, group: Any, n: int) -> torch.Tensor:
        out = part.new_empty(n * part.numel())
        all_gather_async(out, part.contiguous(), group).wait()
        return out

    # stream -> id(param) -> (worker error, server error) of the parameter's coordinates
    carried: dict[str, dict[int, tuple[torch.Tensor, torch.Tensor]]] = {}
    for fkey, entry in entries:
        bucket = old_by_key[_bucket_key(fkey)]
        worker, server = entry["worker_error"], entry["server_error"]
        if per_node > 1:
            worker = gather(worker, intra_group, per_node)
            server = gather(gather(server, inter_group, nodes), intra_group, per_node)
        else:
            server = gather(server, inter_group, nodes)
        per_param, offset = carried.setdefault(stream_of(fkey), {}), 0
        for p in bucket.params:
            per_param[id(p)] = (worker[offset : offset + p.numel()], server[offset : offset + p.numel()])
            offset += p.numel()
    new_buckets = build_new()
    moved: set[int] = set()
    chunk = local * nodes + inter  # the chunk this rank serves (flat: its rank)
    for stream, per_param in carried.items():
        for bucket in new_buckets:
            layout = bucket.layout
            worker = bucket.flat.new_zeros(layout.padded_numel)  # the error buffers' device and dtype
            server = bucket.flat.new_zeros(layout.padded_numel)
            offset = 0
            for p in bucket.params:
                found = per_param.get(id(p))
                if found is not None:
                    worker[offset : offset + p.numel()].copy_(found[0])
                    server[offset : offset + p.numel()].copy_(found[1])
                    moved.add(id(p))
                offset += p.numel()
            shard, c = layout.padded_numel // per_node, layout.chunk_numel
            buffers = compression.buffers(feedback_key(stream, bucket.key), layout, bucket.flat)
            buffers.worker_error.copy_(worker[local * shard : (local + 1) * shard])
            buffers.server_error.copy_(server[chunk * c : (chunk + 1) * c])
    lost = {i for per_param in carried.values() for i in per_param} - moved
    return new_buckets, len(lost), stale
