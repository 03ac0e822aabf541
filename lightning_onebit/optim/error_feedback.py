"""The error feedback of the momentum buckets: the key of a bucket's error buffers in each compressed stream,
carrying the buffers over to a new bucket layout coordinate by coordinate (:func:`relayout_`), and checking and
restoring saved buffers against the buckets (:func:`feedback_mismatch`, :func:`load_feedback_`).
"""

from __future__ import annotations

import logging
from typing import Any, Callable, Hashable, Optional

import torch

from lightning_onebit.comm.groups import all_gather_async
from lightning_onebit.comm.layout import BucketLayout
from lightning_onebit.comm.state import CompressedAllreduceState
from lightning_onebit.optim.bucket_layout import MomentumBucket

log = logging.getLogger(__name__)


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


def relayout_(compression: CompressedAllreduceState, old_buckets: list[MomentumBucket],
              build_new: Callable[[], list[MomentumBucket]], owner: str, step: int, why: str) -> None:
    """The momentum buckets of the optimizer ``owner`` were re-laid out at ``step`` (``old_buckets`` is the layout the
    error feedback belongs to; ``why``, for the log): build the new buckets and move every rank's error buffers into
    them, coordinate by coordinate (:func:`carry_error_feedback_`, a collective when there is error feedback: every
    rank calls it at the same point, as it does the bucket plan change). A parameter no longer in any bucket drops its
    error (counted in the log)."""
    carried = carry_error_feedback_(compression, old_buckets, build_new)
    if carried is None:
        log.info("%s: momentum buckets re-laid out at step %d (%s); no error feedback to carry over", owner, step, why)
        return
    new_buckets, lost, stale = carried
    log.info(
        "%s: momentum buckets re-laid out at step %d (%s); error feedback carried over coordinate by coordinate "
        "(%d bucket(s) -> %d)%s", owner, step, why, len(old_buckets), len(new_buckets),
        "".join([f"; dropped for {lost} parameter(s) no longer in the buckets" if lost else "",
                 f"; {stale} buffer(s) of another layout dropped" if stale else ""]),
    )


def feedback_mismatch(compression: CompressedAllreduceState, state: Any,
                      layouts: Callable[[], dict[int, BucketLayout]]) -> Optional[str]:
    """Why ``state`` (the compression state's ``error_feedback_state_dict()``, possibly of another rank or run)
    cannot be restored into ``compression``, or ``None`` if it can: the world size, the topology, the bucket layouts
    ``layouts()`` returns (key -> layout; called only where ``state`` holds buffers) and the buffers' sizes and values.
    Changes nothing and does not communicate: whatever one rank finds, every rank's buckets stay as they were, so that
    ranks that go on to reset rather than restore take the same path through the next backward and step."""
    if not isinstance(state, dict):
        return f"the saved error feedback is a {type(state).__name__}, not a dict"
    if state.get("world_size") != compression.world_size():
        return (f"error feedback was saved with world size {state.get('world_size')}, "
                f"the current world size is {compression.world_size()}")
    if not state.get("buckets"):
        return None  # nothing had been compressed: the saved error feedback is all zero
    return compression.error_feedback_mismatch(state, _feedback_layouts(state, layouts()))


def load_feedback_(compression: CompressedAllreduceState, state: dict[str, Any],
                   built: Callable[[], list[MomentumBucket]]) -> None:
    """Restore the error buffers of ``state`` into ``compression`` for the buckets ``built()`` returns. Raises
    ``ValueError`` with the reason of :func:`feedback_mismatch` (changing nothing) if they do not fit."""
    reason = feedback_mismatch(compression, state, lambda: {b.key: b.layout for b in built()})
    if reason is not None:
        raise ValueError(reason)
    if not state.get("buckets"):
        # Nothing had been compressed (one rank, or saved before the first compressed step): the saved error
        # feedback is all zero. Building the layouts here would also be wrong during warmup.
        compression.reset_error_feedback()
        return
    buckets = built()
    layouts = _feedback_layouts(state, {b.key: b.layout for b in buckets})
    flats = {b.key: b.flat for b in buckets}
    like = {key: flats[key[1] if isinstance(key, tuple) else key] for key in layouts}
    compression.load_error_feedback_state_dict(state, layouts, like)


def _feedback_layouts(state: dict[str, Any], layouts: dict[int, BucketLayout]) -> dict[Hashable, BucketLayout]:
    """Error-feedback key -> bucket layout, for every bucket of ``layouts`` (key -> layout) in every stream the saved
    ``state`` holds: a stream saved for other buckets than the current ones then shows as a mismatch."""
    try:
        streams = {stream_of(key) for key in state["buckets"]}
    except TypeError:
        streams = {"momentum"}
    return {feedback_key(stream, key): layout for stream in sorted(streams) for key, layout in layouts.items()}
