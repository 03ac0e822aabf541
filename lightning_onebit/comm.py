"""Error-compensated two-phase 1-bit compressed allreduce over ``torch.distributed``.

The algorithm (1-bit Adam, arXiv 2102.02888) averages a flat buffer ``x`` of ``N`` elements over ``P`` ranks while
sending about one bit per element each way. The buffer is zero-padded to ``N_pad`` (a multiple of ``8 P``) and cut
into ``P`` chunks of ``c = N_pad / P`` elements; rank ``r`` is the *server* of chunk ``r``.

1. Worker: ``y = x + e_w``; per segment ``s_w = ||y|| / sqrt(n)``; ``e_w <- y - s_w sgn(y)``; pack ``sgn(y)``.
2. ``all_to_all``: rank ``r`` receives every rank's packed chunk ``r`` together with the worker scales of the
   segments in that chunk.
3. Server: ``z = mean_j(s_w_j sgn_j) + e_s``; per segment ``s_s = ||z|| / sqrt(n)``; ``e_s <- z - s_s sgn(z)``.
4. ``all_gather`` of every server's packed chunk and scales; the result ``concat_j(s_s_j sgn_j)`` is identical on
   every rank, so replicas that apply it stay bit-identical.

Scales are kept per *segment*: the buffer's tensors cut at chunk boundaries. A bucket of many parameters therefore
keeps one scale per parameter (DeepSpeed's fused 1-bit LAMB needed extra rescaling because one scale covered tensors
of very different magnitude), and still costs exactly **two collectives per call however many parameters it holds**
(DeepSpeed's 1-bit Adam issued four per parameter). Scales travel in the same byte blocks as the signs.

Error state per bucket and rank: ``e_w`` (``N_pad`` elements) and ``e_s`` (``c`` elements), in the buffer's dtype.

Bytes per rank and call, counted as each rank's payload on the wire: the all_to_all sends and receives
``(P-1) B_1`` and the all_gather ``(P-1) B_2``, with blocks ``B = c/8 + 4 S_max`` (``S_max`` = most segments in one
chunk). An fp32 ring allreduce of the same ``N`` elements sends ``2 (P-1)/P * 4 N``: the compressed call is ~32x
lighter. With ``P = 1`` nothing is communicated and the buffer is left exactly as it is (the mean over one rank).

:func:`compressed_allreduce_buckets_` runs several buckets at once with asynchronous collectives, so that one
bucket's transfer overlaps another's compression; :func:`compressed_allreduce_` is the one-bucket case. Both are
:func:`start_exchange_` (compress, launch the first collective) per bucket, then :func:`finish_exchanges_`; the
overlapped exchange calls the same functions, starting each bucket from DDP's comm hook during backward and
advancing earlier ones with :func:`progress_exchanges_` (second phase in groups of its own,
:meth:`CompressedAllreduceState.create_gather_groups`), so both paths compute the same bits.

With a hierarchical :class:`~lightning_onebit.Topology` (``M`` nodes x ``L`` ranks) the same two phases run between
nodes only: a full-precision reduce-scatter inside each node gives local rank ``l`` its node's mean of shard ``l``,
the 1-bit exchange of that shard runs among the ``M`` ranks with local rank ``l``, and an all-gather of the packed
server blocks inside the node gives every rank every chunk (see :func:`_hierarchical_buckets_`). Error state then
shrinks to ``N_pad / L`` (worker) and ``c`` (server) elements, and about ``2 (M-1)/M N/8`` bytes leave each node per
call (:func:`bytes_leaving_node`). The counters split every call's bytes into intra- and inter-node bytes.
"""

from __future__ import annotations

import contextlib
import dataclasses
import logging
import math
from typing import Any, Callable, Hashable, Iterable, Iterator, Optional, Sequence

import torch
import torch.distributed as dist

from lightning_onebit import kernels
from lightning_onebit.kernels import Backend, Segments
from lightning_onebit.streams import DeviceTimings
from lightning_onebit.topology import Topology, group_timeout

log = logging.getLogger(__name__)

_SCALE_BYTES = 4  # scales travel as float32


def ring_allreduce_bytes(numel: int, element_size: int, world_size: int) -> int:
    """Bytes one rank sends (and receives) in a ring allreduce of ``numel`` elements: ``2 (P-1)/P * numel * size``."""
    if world_size <= 1:
        return 0
    return (2 * (world_size - 1) * numel * element_size) // world_size


def bytes_leaving_node(numel: int, num_nodes: int, ranks_per_node: int, exchange: str) -> float:
    """Payload bytes that leave one node per step to average ``numel`` fp32 elements over ``num_nodes`` x
    ``ranks_per_node`` ranks, by formula (ring and two-phase byte counts; scales and padding ignored, ranks numbered node by
    node so that a ring crosses each node boundary once).

    ``exchange``:

    * ``"fp32_ring"``: DDP's fp32 ring allreduce, ``2 (P-1)/P 4N``;
    * ``"flat"``: the flat 1-bit exchange, all_to_all ``L (P-L) N / (8P)`` plus ring all_gather ``(P-1) N / (8P)``;
    * ``"hierarchical"``: the hierarchical 1-bit exchange, ``2 (M-1)/M N/8``.
    """
    m, l = num_nodes, ranks_per_node
    p = m * l
    if m < 1 or l < 1:
        raise ValueError(f"need at least one node of one rank, got {m} x {l}")
    if exchange == "fp32_ring":
        return 2 * (p - 1) / p * 4 * numel if m > 1 else 0.0
    if exchange == "flat":
        return (l * (p - l) + (p - 1 if m > 1 else 0)) * numel / (8 * p)
    if exchange == "hierarchical":
        return 2 * (m - 1) / m * numel / 8
    raise ValueError(f"exchange must be 'fp32_ring', 'flat' or 'hierarchical', got {exchange!r}")


@dataclasses.dataclass
class CommunicationCounters:
    """Cumulative communication of one rank. All byte counts are payload bytes of this rank.

    Attributes:
        bytes_sent: bytes this rank put on the wire.
        bytes_received: bytes this rank received.
        bytes_sent_intra_node: the part of ``bytes_sent`` that went to ranks on this rank's node.
        bytes_sent_inter_node: the part of ``bytes_sent`` that crossed to other nodes (the slow link). Without a
            :class:`~lightning_onebit.Topology` every peer counts as another node.
        bytes_fp32_equivalent: bytes an fp32 ring allreduce of the same data would have sent from this rank.
        bytes_sent_uncompressed: the part of ``bytes_sent`` (and of ``bytes_received``) that averaged gradients of
            param groups with ``compress=False`` in full precision (:func:`full_precision_allreduce_`), counted as a
            ring allreduce in the gradients' dtype; also in ``bytes_fp32_equivalent`` (an fp32 allreduce of fp32
            data costs exactly itself) and split into intra- and inter-node bytes like the rest.
        collectives: number of collective operations issued.
        calls: number of allreduce calls (one per bucket per step, plus one per device and dtype of the
            full-precision allreduce of ``compress=False`` groups).
        time_s: seconds spent inside the calls (compression included).
        exposed_s: the exchange time *not* hidden behind backward, seconds. Compressed exchange: the time the
            optimizer step spent on it after backward (starting buckets that were not started during backward,
            waiting, decoding). DDP's warmup allreduce (:class:`~lightning_onebit.GradientSyncState`): per backward,
            from the launch of the last gradient bucket's allreduce to the completion of every allreduce.
        hook_s: seconds spent during backward, inside DDP's hooks, folding gradients into momenta, compressing and
            launching (the overlapped exchange; 0 without it).

    Times are host wall-clock seconds off CUDA. On CUDA they are device times between CUDA events recorded on the
    stream that runs the work (the hooks' side stream, the optimizer step's stream), read back lazily: a figure
    counts once its end event has completed (``settle_timings`` of the owning state; the optimizer's
    ``communication`` and the strategy's do it), typically a step later.
    """

    bytes_sent: int = 0
    bytes_received: int = 0
    bytes_sent_intra_node: int = 0
    bytes_sent_inter_node: int = 0
    bytes_fp32_equivalent: int = 0
    bytes_sent_uncompressed: int = 0
    collectives: int = 0
    calls: int = 0
    time_s: float = 0.0
    exposed_s: float = 0.0
    hook_s: float = 0.0

    def snapshot(self) -> "CommunicationCounters":
        return dataclasses.replace(self)

    def __sub__(self, other: "CommunicationCounters") -> "CommunicationCounters":
        return CommunicationCounters(
            *(getattr(self, f.name) - getattr(other, f.name) for f in dataclasses.fields(self))
        )

    def __add__(self, other: "CommunicationCounters") -> "CommunicationCounters":
        return CommunicationCounters(
            *(getattr(self, f.name) + getattr(other, f.name) for f in dataclasses.fields(self))
        )

    def reset(self) -> None:
        for f in dataclasses.fields(self):
            setattr(self, f.name, f.default)


@dataclasses.dataclass(frozen=True)
class BucketLayout:
    """How a flat buffer made of tensors of ``tensor_numels`` elements is padded, chunked and segmented for ``P`` ranks.

    Pure and deterministic: every rank derives the same layout from the same inputs.

    Attributes:
        tensor_numels: element count of each tensor in the buffer, in order.
        world_size: ``P``.
        numel: ``N``, the real elements (sum of ``tensor_numels``).
        padded_numel: ``N_pad``, ``N`` rounded up to a multiple of ``8 P``.
        chunk_numel: ``c = N_pad / P``, the elements each rank serves.
        segments: the scale segments of the padded buffer: tensor boundaries, chunk boundaries and the padding.
        chunk_segments: per chunk, its segments with offsets relative to the chunk start.
        max_chunk_segments: ``S_max``, the most segments in one chunk (scales are padded to this on the wire).
    """

    tensor_numels: tuple[int, ...]
    world_size: int
    numel: int
    padded_numel: int
    chunk_numel: int
    segments: Segments
    chunk_segments: tuple[Segments, ...]
    max_chunk_segments: int

    @classmethod
    def build(cls, tensor_numels: Sequence[int], world_size: int) -> "BucketLayout":
        tensor_numels = tuple(int(n) for n in tensor_numels)
        if world_size < 1:
            raise ValueError(f"world_size must be >= 1, got {world_size}")
        if any(n < 0 for n in tensor_numels):
            raise ValueError("tensor sizes must be non-negative")
        numel = sum(tensor_numels)
        if numel == 0:
            raise ValueError("a bucket needs at least one element")
        quantum = 8 * world_size
        padded = -(-numel // quantum) * quantum
        chunk = padded // world_size
        cuts = {0, padded, numel}
        offset = 0
        for n in tensor_numels:
            offset += n
            cuts.add(offset)
        cuts.update(range(0, padded, chunk))
        offsets = sorted(cuts)
        chunk_segments = []
        for r in range(world_size):
            lo, hi = r * chunk, (r + 1) * chunk
            chunk_segments.append(Segments([o - lo for o in offsets if lo <= o <= hi]))
        return cls(
            tensor_numels=tensor_numels,
            world_size=world_size,
            numel=numel,
            padded_numel=padded,
            chunk_numel=chunk,
            segments=Segments(offsets),
            chunk_segments=tuple(chunk_segments),
            max_chunk_segments=max(len(s) for s in chunk_segments),
        )

    @property
    def block_bytes(self) -> int:
        """Bytes of one wire block: ``S_max`` float32 scales followed by ``c / 8`` packed sign bytes."""
        return _SCALE_BYTES * self.max_chunk_segments + self.chunk_numel // 8

    def bytes_per_call(self) -> int:
        """Bytes one rank sends (and, equally, receives) per compressed allreduce of this layout."""
        if self.world_size == 1:
            return 0
        return 2 * (self.world_size - 1) * self.block_bytes

    def fp32_equivalent_bytes(self) -> int:
        """Bytes one rank would send in an fp32 ring allreduce of the ``N`` real elements."""
        return ring_allreduce_bytes(self.numel, 4, self.world_size)


class _BucketBuffers:
    """Error feedback and reusable workspaces of one bucket on one rank.

    Flat: the worker compresses the whole buffer (``N_pad`` error elements) and exchanges ``P`` blocks. Hierarchical
    (``M`` nodes x ``L`` ranks): the worker compresses its node's mean of one shard (``N_pad / L`` error elements) and
    exchanges ``M`` blocks with its inter-node group; the node then gathers all ``P`` server blocks.
    """

    def __init__(self, layout: BucketLayout, like: torch.Tensor, ranks_per_node: int = 1) -> None:
        device, dtype = like.device, like.dtype
        c, block = layout.chunk_numel, layout.block_bytes
        exchanged = layout.world_size // ranks_per_node  # ranks in the 1-bit exchange: P flat, M hierarchical
        self.layout = layout
        self.ranks_per_node = ranks_per_node
        self.worker_error = torch.zeros(layout.padded_numel // ranks_per_node, dtype=dtype, device=device)
        self.server_error = torch.zeros(c, dtype=dtype, device=device)
        self.send = torch.zeros(exchanged * block, dtype=torch.uint8, device=device)
        self.recv = torch.empty(exchanged * block, dtype=torch.uint8, device=device)
        self.gather_send = torch.zeros(block, dtype=torch.uint8, device=device)
        self.gather_recv = torch.empty(exchanged * block, dtype=torch.uint8, device=device)
        # hierarchical: every server block of the bucket, gathered inside the node
        self.node_gather_recv = (
            torch.empty(layout.world_size * block, dtype=torch.uint8, device=device) if ranks_per_node > 1 else None
        )


class CompressedAllreduceState:
    """Everything the compressed allreduce keeps between calls, for one process group.

    Holds, per bucket key, the worker and server error-feedback buffers (created as zeros on first use) and reusable
    communication workspaces, plus cumulative :class:`CommunicationCounters`. Modelled on PyTorch's ``PowerSGDState``:
    a state object plus the pure function :func:`compressed_allreduce_`.

    Args:
        process_group: group to average over; ``None`` means the default (WORLD) group. Resolved at call time, so the
            state may be built before ``torch.distributed`` is initialised.
        backend: kernel backend, see :mod:`lightning_onebit.kernels`. Every rank must run the same one (the C and
            torch Adam updates differ in the last bit): :func:`agree_kernel_backend` settles it.
        topology: which ranks share a node (:class:`~lightning_onebit.Topology`, built over ``process_group``). A
            hierarchical topology selects the hierarchical exchange; any topology splits the byte counters into
            intra- and inter-node bytes. ``None`` (default): flat, and every peer counts as another node.
    """

    def __init__(
        self,
        process_group: Optional[dist.ProcessGroup] = None,
        backend: Backend = "auto",
        topology: Optional[Topology] = None,
    ) -> None:
        self.process_group = process_group
        self.backend = backend
        self.topology = topology
        self.counters = CommunicationCounters()
        #: Device-time spans of the exchange on CUDA, added to ``counters`` once complete (:meth:`settle_timings`).
        self.timings = DeviceTimings()
        self._buckets: dict[Hashable, _BucketBuffers] = {}
        # Scratch memory for the kernels, shared by all buckets (they are reduced one after another): it is sized
        # for the largest bucket instead of growing with their number.
        self.workspace = kernels.Workspace()
        # second-phase groups of create_gather_groups(), valid for the (process_group, topology) they were made for
        self._gather_groups: Optional[tuple[Any, Any, Any, Any]] = None

    # ------------------------------------------------------------------ second-phase groups
    def create_gather_groups(self) -> None:
        """Create process groups of their own for the second phase of the exchange (the ``all_gather`` calls).

        Needed by :func:`progress_exchanges_`, which launches bucket ``k - 1``'s ``all_gather`` right after bucket
        ``k``'s ``all_to_all``: in a group of its own it runs concurrently with that transfer instead of queueing
        behind it in one communicator. Flat: a copy of ``process_group``;
        hierarchical: copies of the intra- and inter-node groups (:func:`~lightning_onebit.topology.new_gather_groups`).
        A collective (over WORLD, or ``process_group`` where torch can split it): every rank calls it, in the same
        order relative to other group creations. Valid until ``process_group`` or ``topology`` change (then the
        exchange falls back to the phase-1 groups).

        The groups are new on every call and belong to the caller, who destroys them (``dist.destroy_process_group()``
        at the end destroys every group). Whoever makes many optimizers over one process group (the Lightning strategy,
        one per ``fit``) makes them once with ``new_gather_groups`` and hands them over with
        :meth:`install_gather_groups` instead.
        """
        if not (dist.is_available() and dist.is_initialized()):
            return
        from lightning_onebit.topology import new_gather_groups

        self.install_gather_groups(*new_gather_groups(self.process_group, self.topology))

    def install_gather_groups(self, inter: Any, intra: Any = None) -> None:
        """Run the second phase in these ready-made groups (made by
        :func:`~lightning_onebit.topology.new_gather_groups` for this ``process_group`` and ``topology``): ``inter``
        for the ``all_gather`` between servers (flat: a copy of ``process_group``), ``intra`` for the hierarchical node
        gather (``None`` when flat). No collective; valid, as :meth:`create_gather_groups`' groups, until
        ``process_group`` or ``topology`` change. The caller keeps ownership (and destroys them)."""
        topology = self.topology
        if inter is None or ((topology is not None and topology.is_hierarchical) != (intra is not None)):
            raise ValueError(
                "install_gather_groups needs an inter-node group, and an intra-node group exactly when the topology is "
                "hierarchical"
            )
        self._gather_groups = (self.process_group, topology, inter, intra)

    def release_gather_groups(self) -> tuple[Any, ...]:
        """Forget the second-phase groups (the exchange falls back to the phase-1 groups) and return them, for their
        owner to destroy; ``()`` when there were none. No collective."""
        made, self._gather_groups = self._gather_groups, None
        return () if made is None else tuple(g for g in made[2:] if g is not None)

    @property
    def has_gather_groups(self) -> bool:
        """Whether the second phase runs in groups of its own (:meth:`create_gather_groups` or
        :meth:`install_gather_groups`, still valid)."""
        made = self._gather_groups
        return made is not None and made[0] is self.process_group and made[1] is self.topology

    def gather_groups(self) -> tuple[Any, Any]:
        """``(group of the all_gather between servers, intra-node group of the hierarchical node gather)``: the
        groups of :meth:`create_gather_groups` when valid, else the phase-1 groups."""
        if self.has_gather_groups:
            return self._gather_groups[2], self._gather_groups[3]
        topology = self.topology
        if topology is not None and topology.is_hierarchical:
            return topology.inter_group, topology.intra_group
        return self.process_group, None

    @property
    def ranks_per_node(self) -> int:
        """``L`` of the hierarchical exchange, 1 for the flat one."""
        topology = self.topology
        return topology.ranks_per_node if topology is not None and topology.is_hierarchical else 1

    # ------------------------------------------------------------------ group
    def world_size(self) -> int:
        if not (dist.is_available() and dist.is_initialized()):
            return 1
        return dist.get_world_size(self.process_group)

    def rank(self) -> int:
        if not (dist.is_available() and dist.is_initialized()):
            return 0
        return dist.get_rank(self.process_group)

    def settle_timings(self) -> CommunicationCounters:
        """Add the completed CUDA-event timings to :attr:`counters` (never waits for the device) and return them."""
        self.timings.settle()
        return self.counters

    # ------------------------------------------------------------------ error feedback
    def buffers(self, key: Hashable, layout: BucketLayout, like: torch.Tensor) -> _BucketBuffers:
        """The bucket's buffers on ``like``'s device and dtype: created as zeros when new or when the layout changed
        (the error belongs to a layout); when only the device or dtype changed, the error is carried over."""
        buffers = self._buckets.get(key)
        if buffers is None or buffers.layout != layout or buffers.ranks_per_node != self.ranks_per_node:
            buffers = self._buckets[key] = _BucketBuffers(layout, like, self.ranks_per_node)
        elif buffers.worker_error.dtype != like.dtype or buffers.worker_error.device != like.device:
            moved = _BucketBuffers(layout, like, self.ranks_per_node)
            moved.worker_error.copy_(buffers.worker_error)
            moved.server_error.copy_(buffers.server_error)
            buffers = self._buckets[key] = moved
        return buffers

    def error_feedback_norm(self) -> float:
        """L2 norm of all error-feedback buffers of this rank (worker and server); one host read per device."""
        return _error_norm(self._buckets.values())

    def reset_error_feedback(
        self, which: Optional[Callable[[Hashable], bool]] = None, measure: bool = True
    ) -> Optional[float]:
        """Drop error-feedback buffers (they restart from zero): all of them, or those whose key ``which(key)``
        accepts (e.g. one stream of an optimizer). Returns the L2 norm that was dropped, read back with one host
        synchronisation; ``measure=False`` skips that and returns ``None`` (for a reset the algorithm itself makes
        during training, where nobody reads the figure)."""
        dropped = [self._buckets.pop(key) for key in [k for k in self._buckets if which is None or which(k)]]
        return _error_norm(dropped) if measure else None

    def error_feedback_state_dict(self) -> dict[str, Any]:
        """This rank's error-feedback buffers with the layouts they belong to (for per-rank checkpoints)."""
        return {
            "world_size": self.world_size(),
            "topology": self.topology_description(),
            "buckets": {
                key: {
                    "layout": (b.layout.tensor_numels, b.layout.world_size),
                    "worker_error": b.worker_error.detach().clone(),
                    "server_error": b.server_error.detach().clone(),
                }
                for key, b in self._buckets.items()
            },
        }

    def error_feedback_mismatch(self, state: Any, layouts: dict[Hashable, BucketLayout]) -> Optional[str]:
        """Why ``state`` (from :meth:`error_feedback_state_dict`) cannot be restored with ``layouts`` (bucket key ->
        layout in use now), or ``None`` if it can. Changes nothing; never raises for a malformed ``state``."""
        try:
            saved = state["buckets"]
            saved_topology, topology = state.get("topology"), self.topology_description()
            if not _same_exchange(saved_topology, topology):
                return (
                    f"the error feedback was saved with topology {_topology_text(saved_topology)} and this run uses "
                    f"{_topology_text(topology)} (the buffers' shapes and meaning depend on it)"
                )
            if set(saved) != set(layouts):
                return f"saved buckets {sorted(map(str, saved))} differ from current {sorted(map(str, layouts))}"
            for key, layout in layouts.items():
                entry = saved[key]
                if tuple(entry["layout"]) != (layout.tensor_numels, layout.world_size):
                    return f"bucket {key!r}: the saved layout differs from the current one (the model changed?)"
                worker, server = entry["worker_error"], entry["server_error"]
                if not (isinstance(worker, torch.Tensor) and isinstance(server, torch.Tensor)):
                    return f"bucket {key!r}: the saved error buffers are not tensors"
                if worker.numel() != layout.padded_numel // self.ranks_per_node or (
                    server.numel() != layout.chunk_numel
                ):
                    return f"bucket {key!r}: the saved error buffers have the wrong sizes for this topology"
                if not (bool(torch.isfinite(worker).all()) and bool(torch.isfinite(server).all())):
                    return f"bucket {key!r}: the saved error buffers hold inf or NaN"
        except (KeyError, TypeError, AttributeError, ValueError) as err:
            return f"the saved error feedback is malformed ({type(err).__name__}: {err})"
        return None

    def load_error_feedback_state_dict(
        self, state: dict[str, Any], layouts: dict[Hashable, BucketLayout], like: dict[Hashable, torch.Tensor]
    ) -> None:
        """Restore buffers saved by :meth:`error_feedback_state_dict`.

        ``layouts`` maps each bucket key to the layout in use now, ``like`` to a tensor on the device and of the
        dtype the bucket exchanges (its flat momentum buffer): the buffers are made there and the saved values
        (typically loaded to the CPU) copied in, so the next exchange finds them in place. Raises ``ValueError`` with
        the reason of :meth:`error_feedback_mismatch` (and changes nothing) unless the saved buckets fit exactly, so
        a caller can fall back to a reset with a reason.
        """
        reason = self.error_feedback_mismatch(state, layouts)
        if reason is not None:
            raise ValueError(reason)
        missing = [key for key in layouts if key not in like]
        if missing:
            raise ValueError(f"no live buffer given for bucket(s) {missing}: pass one per layout")
        for key, layout in layouts.items():
            entry = state["buckets"][key]
            buffers = self.buffers(key, layout, like[key])
            buffers.worker_error.copy_(entry["worker_error"])
            buffers.server_error.copy_(entry["server_error"])

    def topology_description(self) -> dict[str, Any]:
        """The exchange this state runs (mode, nodes x ranks per node, this rank's place), as checkpoints record it."""
        if self.topology is None:
            return {"mode": "flat", "num_nodes": None, "ranks_per_node": None, "world_size": self.world_size()}
        return self.topology.describe()


def _error_norm(buffers: Iterable[_BucketBuffers]) -> float:
    """The L2 norm of the worker and server errors of ``buffers``, summed in float64 on each device, one host read
    per device."""
    by_device: dict[torch.device, list[torch.Tensor]] = {}
    for b in buffers:
        for error in (b.worker_error, b.server_error):
            by_device.setdefault(error.device, []).append(error.double().square().sum())
    return math.sqrt(sum(float(torch.stack(squares).sum()) for squares in by_device.values()))


def _same_exchange(saved: Optional[dict[str, Any]], current: dict[str, Any]) -> bool:
    """Whether error feedback saved under ``saved`` means the same in ``current``: flat buffers depend only on the
    rank (checked by the caller), hierarchical ones also on the node shape and this rank's place in it."""
    saved = saved or {"mode": "flat"}  # written before topologies existed: flat
    if saved.get("mode") != current["mode"]:
        return False
    if current["mode"] == "flat":
        return True
    fields = ("num_nodes", "ranks_per_node", "world_size", "node", "local")
    return all(saved.get(f) == current.get(f) for f in fields)


def _topology_text(description: Optional[dict[str, Any]]) -> str:
    if not description:
        return "unrecorded (a checkpoint from an older version: flat)"
    text = f"{description.get('mode')}"
    if description.get("num_nodes") is not None:
        text += f" {description['num_nodes']} nodes x {description['ranks_per_node']} ranks"
    if description.get("node") is not None:
        text += f", this rank at node {description['node']} local {description['local']}"
    return text


class CollectiveFailedError(RuntimeError):
    """A collective of the compressed exchange failed on this rank. The message names the collective, the global
    ranks of its process group and the group's timeout; the backend's own error is the ``__cause__``. On gloo a peer
    that stalled (stopped, swapped out, stuck in I/O or a debugger) makes it time out after the group's timeout, one
    that died makes it fail at once; neither error says which peer."""


@contextlib.contextmanager
def _naming_the_group(what: str, group: Optional[dist.ProcessGroup]) -> Iterator[None]:
    """Re-raise a backend error of the collective(s) inside as a :class:`CollectiveFailedError` naming ``group``."""
    try:
        yield
    except CollectiveFailedError:
        raise
    except RuntimeError as error:  # gloo and NCCL raise RuntimeError (DistBackendError is one) for a failed peer
        raise CollectiveFailedError(_collective_failure(what, group, error)) from error


def _collective_failure(what: str, group: Optional[dist.ProcessGroup], error: BaseException) -> str:
    try:
        ranks: Any = dist.get_process_group_ranks(group if group is not None else dist.group.WORLD)
    except (RuntimeError, ValueError):
        ranks = "unknown"
    timeout = group_timeout(group)
    waited = f"with a timeout of {timeout.total_seconds():g} s" if timeout is not None else "(timeout unknown)"
    return (
        f"lightning_onebit: the compressed exchange's {what} in the process group of global ranks {ranks} {waited} "
        f"failed: {error}. A rank of that group that stalled (stopped, swapped out, stuck in I/O or a debugger) "
        "makes this collective time out; one that died makes it fail at once. Look for the rank whose log stops "
        "before this step; the timeout is the strategy's (or init_process_group's) timeout"
    )


def _all_gather(output: torch.Tensor, input: torch.Tensor, group: Optional[dist.ProcessGroup]) -> dist.Work:
    # torch 2.13 renamed all_gather_into_tensor to all_gather_single (the old name warns).
    gather = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
    return gather(output, input, group=group, async_op=True)


def _write_scales(block: torch.Tensor, scales: torch.Tensor) -> None:
    # A wire block is S_max float32 scales (unused tail left as is) followed by the packed signs, written in place.
    block[: _SCALE_BYTES * scales.numel()].copy_(scales.view(torch.uint8))


def _read_block(block: torch.Tensor, n_scales: int, n_scales_max: int) -> tuple[torch.Tensor, torch.Tensor]:
    # The clone realigns the scale bytes so they can be viewed as float32.
    scales = block[: _SCALE_BYTES * n_scales].clone().view(torch.float32)
    return scales, block[_SCALE_BYTES * n_scales_max :]


def compressed_allreduce_(
    state: CompressedAllreduceState, key: Hashable, buffer: torch.Tensor, layout: BucketLayout
) -> torch.Tensor:
    """Replace ``buffer`` by the error-compensated 1-bit average of ``buffer`` over the state's process group.

    Args:
        state: the :class:`CompressedAllreduceState` holding this bucket's error feedback and counters.
        key: identifies the bucket across calls (its error feedback belongs to it); any hashable.
        buffer: 1-D contiguous floating tensor of ``layout.padded_numel`` elements, modified in place. Elements past
            ``layout.numel`` must be zero; they stay zero.
        layout: from :meth:`BucketLayout.build` with this group's world size.

    Returns:
        ``buffer``, now holding the same values on every rank.
    """
    compressed_allreduce_buckets_(state, [(key, buffer, layout)])
    return buffer


def compressed_allreduce_buckets_(
    state: CompressedAllreduceState, buckets: Sequence[tuple[Hashable, torch.Tensor, BucketLayout]]
) -> None:
    """:func:`compressed_allreduce_` of several buckets, pipelined: one bucket's transfer overlaps another's compression.

    :func:`start_exchange_` for every bucket (the transfer of bucket ``k`` runs while bucket ``k + 1`` is compressed),
    then :func:`finish_exchanges_`. Still two collectives per bucket (four hierarchical), issued in the same order on
    every rank. All arguments are checked before the first collective, so a bad bucket raises on every rank instead of
    leaving the others waiting.

    Args:
        state: as for :func:`compressed_allreduce_`.
        buckets: ``(key, buffer, layout)`` triples, each as for :func:`compressed_allreduce_`; keys must differ.
    """
    check_buckets(state, buckets)
    pending = [start_exchange_(state, key, buffer, layout, checked=True) for key, buffer, layout in buckets]
    finish_exchanges_(state, pending)


def check_buckets(
    state: CompressedAllreduceState, buckets: Sequence[tuple[Hashable, torch.Tensor, BucketLayout]]
) -> None:
    """Raise ``ValueError`` unless every ``(key, buffer, layout)`` fits ``state``'s process group and topology and the
    keys differ. Local (no communication): call it on every rank before the first collective."""
    world_size = state.world_size()
    topology = state.topology
    if topology is not None and topology.world_size != world_size:
        raise ValueError(
            f"the topology describes {topology.world_size} ranks but the process group has {world_size}: build it "
            "over the same group (Topology.build(..., group=process_group))"
        )
    keys = set()
    for key, buffer, layout in buckets:
        if key in keys:
            raise ValueError(f"bucket key {key!r} appears twice")
        keys.add(key)
        if layout.world_size != world_size:
            raise ValueError(f"layout was built for {layout.world_size} ranks but the process group has {world_size}")
        if buffer.dim() != 1 or not buffer.is_contiguous() or buffer.numel() != layout.padded_numel:
            raise ValueError(
                f"buffer must be 1-D contiguous with {layout.padded_numel} elements, got {tuple(buffer.shape)}"
            )
        if not buffer.is_floating_point():
            raise ValueError(f"buffer must be floating point, got {buffer.dtype}")


# Phases of a PendingExchange. Flat: ALL_TO_ALL -> GATHER -> DONE. Hierarchical: ALL_TO_ALL (inter-node) -> GATHER
# (inter-node) -> NODE_GATHER (intra-node) -> DONE.
_ALL_TO_ALL, _GATHER, _NODE_GATHER, _DONE = 1, 2, 3, 4
_PHASE_NAMES = {_ALL_TO_ALL: "1-bit all_to_all", _GATHER: "all_gather of the server blocks",
                _NODE_GATHER: "intra-node all_gather of the server blocks"}


class PendingExchange:
    """One bucket's compressed allreduce in flight, from :func:`start_exchange_` to :func:`finish_exchanges_`.

    Attributes:
        key, buffer, layout: as passed to :func:`start_exchange_`; ``buffer`` holds the average once done.
        done: whether the average has been written into ``buffer``.
    """

    __slots__ = ("key", "buffer", "layout", "buffers", "work", "group", "phase", "hierarchical")

    def __init__(self, key: Hashable, buffer: torch.Tensor, layout: BucketLayout) -> None:
        self.key, self.buffer, self.layout = key, buffer, layout
        self.buffers: Optional[_BucketBuffers] = None
        self.work: Optional[dist.Work] = None  # the collective in flight
        self.group: Optional[dist.ProcessGroup] = None  # its process group (named if it fails)
        self.phase = _DONE
        self.hierarchical = False

    @property
    def done(self) -> bool:
        return self.phase == _DONE


def start_exchange_(
    state: CompressedAllreduceState, key: Hashable, buffer: torch.Tensor, layout: BucketLayout, checked: bool = False
) -> PendingExchange:
    """Start the compressed allreduce of one bucket: compress it and launch its first collective asynchronously.

    Flat: worker compression of ``buffer + e_w`` into ``P`` wire blocks and an ``all_to_all`` in
    ``state.process_group``. Hierarchical: the intra-node reduce-scatter (synchronous, full precision), compression of
    the node's shard and the ``all_to_all`` in the inter-node group. Every rank must start the same buckets in the same
    order; :func:`finish_exchanges_` completes them. ``buffer`` must not be changed until then.

    Args:
        state, key, buffer, layout: as for :func:`compressed_allreduce_`.
        checked: the caller already ran :func:`check_buckets` on this bucket (skips the check).

    Returns:
        The :class:`PendingExchange`, for :func:`progress_exchanges_` and :func:`finish_exchanges_`.
    """
    if not checked:
        check_buckets(state, [(key, buffer, layout)])
    pending = PendingExchange(key, buffer, layout)
    if state.world_size() == 1:
        return pending  # the mean over one rank: nothing to do
    started = state.timings.mark(buffer.device)  # on the stream that runs the work (the hook's side stream)
    bufs = pending.buffers = state.buffers(key, layout, buffer)
    pending.hierarchical = state.ranks_per_node > 1
    backend, workspace = state.backend, state.workspace
    if pending.hierarchical:
        topology = state.topology
        assert topology is not None and topology.intra_group is not None and topology.inter_group is not None, (
            "a hierarchical Topology needs its process groups: build it with Topology.build"
        )
        per_node, nodes = topology.ranks_per_node, topology.num_nodes
        local = topology.local_index
        # intra-node reduce-scatter: all_to_all of the L shards, then a sum in local-rank order and a division by L
        # (gloo has no AVG, and a fixed order gives the same bits as a single-process reference)
        shard = layout.padded_numel // per_node
        received = workspace.get("intra_reduce_scatter", layout.padded_numel, buffer.dtype, buffer.device)
        with _naming_the_group("intra-node reduce-scatter (all_to_all)", topology.intra_group):
            dist.all_to_all_single(received, buffer, group=topology.intra_group)
        node_mean = received[:shard]
        for j in range(1, per_node):
            node_mean.add_(received[j * shard : (j + 1) * shard])
        node_mean.div_(per_node)
        own_chunks = range(local * nodes, (local + 1) * nodes)
        _compress_chunks(node_mean, bufs.worker_error, bufs.send, layout, own_chunks, backend, workspace)
        pending.group = topology.inter_group
    else:
        _compress_chunks(buffer, bufs.worker_error, bufs.send, layout, range(state.world_size()), backend, workspace)
        pending.group = state.process_group
    with _naming_the_group("1-bit all_to_all", pending.group):
        pending.work = dist.all_to_all_single(bufs.recv, bufs.send, group=pending.group, async_op=True)
    pending.phase = _ALL_TO_ALL
    _count_call(state, layout, buffer)
    state.timings.add(state.counters, "time_s", started, state.timings.mark(buffer.device))
    return pending


def progress_exchanges_(
    state: CompressedAllreduceState, pending: Sequence[PendingExchange], keep_newest: bool = True
) -> None:
    """Advance the exchanges started so far on a fixed schedule: serve each one and launch the rest of its
    collectives (decoding is left to :func:`finish_exchanges_`), except the newest when ``keep_newest`` (its first
    collective then stays in flight while the caller computes).

    Called after each start (the overlapped hook does), bucket ``k``'s start therefore advances bucket ``k - 1``: the
    order of launches on every process group, and their interleaving across groups, is a function of the bucket
    schedule alone, the same on every rank. NCCL requires that (operations on different communicators issued in the
    same order on every rank, or kernels that cannot co-reside deadlock). Waiting is stream-ordered on CUDA (the
    host does not block); on gloo it blocks until that bucket's first collective arrived.

    Needs the second phase in process groups of its own (:meth:`CompressedAllreduceState.create_gather_groups`), so
    that the ``all_gather`` of bucket ``k - 1`` and the ``all_to_all`` of bucket ``k`` run concurrently instead of
    queueing in one communicator. Without them this does nothing (:func:`finish_exchanges_` does it all).
    """
    if not state.has_gather_groups or not pending:
        return
    device = pending[0].buffer.device
    with state.timings.span(state.counters, "time_s", device):
        last = _NODE_GATHER if pending[0].hierarchical else _GATHER
        advancing = pending[:-1] if keep_newest else pending
        for phase in range(_ALL_TO_ALL, last):  # phase by phase, oldest first: every group sees start order
            for p in advancing:
                if p.phase == phase:
                    _advance(state, p)


def finish_exchanges_(state: CompressedAllreduceState, pending: Sequence[PendingExchange]) -> None:
    """Complete the exchanges (waiting where needed) and write each average into its buffer, in start order: first
    every server phase and its ``all_gather``, then (hierarchical) every intra-node gather, then every decode."""
    if all(p.done for p in pending):
        return
    with state.timings.span(state.counters, "time_s", pending[0].buffer.device):
        for phase in (_ALL_TO_ALL, _GATHER, _NODE_GATHER):
            for p in pending:
                if p.phase == phase:
                    _advance(state, p)


def _advance(state: CompressedAllreduceState, p: PendingExchange) -> None:
    """Wait for ``p``'s collective and run its next phase."""
    bufs, layout = p.buffers, p.layout
    assert bufs is not None and p.work is not None
    with _naming_the_group(_PHASE_NAMES[p.phase], p.group):
        p.work.wait()
    backend, workspace = state.backend, state.workspace
    inter_gather_group, intra_gather_group = state.gather_groups()
    if p.phase == _ALL_TO_ALL:
        if p.hierarchical:
            topology = state.topology
            chunk = topology.local_index * topology.num_nodes + topology.inter_index
            sources = topology.num_nodes
        else:
            chunk, sources = state.rank(), state.world_size()
        _serve_chunk(bufs, layout, layout.chunk_segments[chunk], sources, backend, workspace)
        with _naming_the_group(_PHASE_NAMES[_GATHER], inter_gather_group):
            p.work = _all_gather(bufs.gather_recv, bufs.gather_send, inter_gather_group)
        p.group, p.phase = inter_gather_group, _GATHER
    elif p.phase == _GATHER and p.hierarchical:
        # every server block of the bucket, gathered packed inside the node (32x fewer bytes than the decoded shard)
        with _naming_the_group(_PHASE_NAMES[_NODE_GATHER], intra_gather_group):
            p.work = _all_gather(bufs.node_gather_recv, bufs.gather_recv, intra_gather_group)
        p.group, p.phase = intra_gather_group, _NODE_GATHER
    else:
        _decode_all(p.buffer, bufs.gather_recv if not p.hierarchical else bufs.node_gather_recv, layout, backend,
                    workspace)
        p.work, p.phase = None, _DONE


def simulate_compressed_allreduce_(
    buffers: Sequence[torch.Tensor],
    layout: BucketLayout,
    states: Optional[Sequence[_BucketBuffers]] = None,
    backend: Backend = "auto",
    workspace: Optional[kernels.Workspace] = None,
) -> list[_BucketBuffers]:
    """The flat compressed allreduce of ``P = layout.world_size`` ranks, simulated in one process: ``buffers[r]`` is
    rank ``r``'s input (``layout.padded_numel`` elements, padding zero) and is replaced by the average every rank
    would get. The collectives become copies between the ranks' wire buffers; the compression, serving and decoding
    are the kernels and helpers the distributed path runs, so the bits are the same.

    For checks and benchmarks on a single device (a one-GPU machine cannot run two NCCL ranks). ``states``: each
    rank's error feedback and wire buffers from an earlier call (``None``: zeros). Returns the states, to pass on.
    """
    world_size = layout.world_size
    if len(buffers) != world_size:
        raise ValueError(f"the layout is for {world_size} ranks but {len(buffers)} buffers were given")
    for buffer in buffers:
        if buffer.dim() != 1 or buffer.numel() != layout.padded_numel or not buffer.is_contiguous():
            raise ValueError(f"every buffer must be 1-D contiguous with {layout.padded_numel} elements")
    ranks = list(states) if states is not None else [_BucketBuffers(layout, buffers[0]) for _ in range(world_size)]
    workspace = workspace if workspace is not None else kernels.Workspace()
    block = layout.block_bytes
    for buffer, bufs in zip(buffers, ranks):
        _compress_chunks(buffer, bufs.worker_error, bufs.send, layout, range(world_size), backend, workspace)
    for r, bufs in enumerate(ranks):  # all_to_all: rank r receives every rank's block r
        for j, peer in enumerate(ranks):
            bufs.recv[j * block : (j + 1) * block].copy_(peer.send[r * block : (r + 1) * block])
    for r, bufs in enumerate(ranks):
        _serve_chunk(bufs, layout, layout.chunk_segments[r], world_size, backend, workspace)
    for bufs in ranks:  # all_gather of the server blocks
        for j, peer in enumerate(ranks):
            bufs.gather_recv[j * block : (j + 1) * block].copy_(peer.gather_send)
    for buffer, bufs in zip(buffers, ranks):
        _decode_all(buffer, bufs.gather_recv, layout, backend, workspace)
    return ranks


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
    by_kind: dict[tuple[torch.device, torch.dtype], list[torch.Tensor]] = {}
    for t in tensors:
        by_kind.setdefault((t.device, t.dtype), []).append(t)
    rank, topology, counters = state.rank(), state.topology, state.counters
    for (device, _), same_kind in by_kind.items():
        started = state.timings.mark(device)
        # a fresh buffer: the shared kernel workspace may still be in use by exchanges started during backward
        flat = torch.cat([t.reshape(-1) for t in same_kind])
        with _naming_the_group("full-precision all_reduce (compress=False groups)", state.process_group):
            dist.all_reduce(flat, op=dist.ReduceOp.SUM, group=state.process_group)
        flat.div_(world_size)
        offset = 0
        for t in same_kind:
            t.copy_(flat[offset : offset + t.numel()].view_as(t))
            offset += t.numel()
        counters.bytes_sent_uncompressed += count_ring_allreduce(counters, flat, world_size, rank, topology)
        state.timings.add(counters, "time_s", started, state.timings.mark(device))


def count_ring_allreduce(
    counters: CommunicationCounters,
    tensor: torch.Tensor,
    world_size: int,
    rank: int,
    topology: Optional[Topology],
    element_size: Optional[int] = None,
) -> int:
    """Count one ring allreduce of ``tensor`` in ``counters`` and return the bytes this rank sends; ``element_size``:
    bytes per element on the wire (default: ``tensor``'s; 2 when a hook sends it in bf16 or fp16).

    A ring sends everything to the next rank, ``(rank + 1) % P``: intra-node bytes when the topology puts it on this
    rank's node, else (or without a topology) inter-node. ``bytes_fp32_equivalent`` counts the same data in fp32."""
    size = tensor.element_size() if element_size is None else element_size
    sent = ring_allreduce_bytes(tensor.numel(), size, world_size)
    counters.bytes_sent += sent
    counters.bytes_received += sent
    if topology is not None and topology.same_node(rank, (rank + 1) % world_size):
        counters.bytes_sent_intra_node += sent
    else:
        counters.bytes_sent_inter_node += sent
    counters.bytes_fp32_equivalent += ring_allreduce_bytes(tensor.numel(), 4, world_size)
    counters.collectives += 1
    counters.calls += 1
    return sent


def _count_call(state: CompressedAllreduceState, layout: BucketLayout, buffer: torch.Tensor) -> None:
    counters = state.counters
    intra, inter = _bytes_sent(layout, buffer.element_size(), state.topology, state.rank())
    counters.bytes_sent += intra + inter
    counters.bytes_received += intra + inter
    counters.bytes_sent_intra_node += intra
    counters.bytes_sent_inter_node += inter
    counters.bytes_fp32_equivalent += layout.fp32_equivalent_bytes()
    counters.collectives += 4 if state.ranks_per_node > 1 else 2
    counters.calls += 1


def _bytes_sent(layout: BucketLayout, element_size: int, topology: Optional[Topology], rank: int) -> tuple[int, int]:
    """Payload bytes one call sends from ``rank`` to ranks on its own node and to other nodes.

    Flat: the ``all_to_all`` sends one block to every peer; gloo's and NCCL's ``all_gather`` are rings that send
    ``P - 1`` blocks to the next group rank. Hierarchical: the intra-node reduce-scatter sends ``L - 1`` shards in the
    buffer's dtype and the intra-node gather ``(L - 1) M`` blocks; the inter-node ``all_to_all`` and ``all_gather``
    send ``M - 1`` blocks each.
    """
    block, world_size = layout.block_bytes, layout.world_size
    if topology is not None and topology.is_hierarchical:
        nodes, per_node = topology.num_nodes, topology.ranks_per_node
        shard_bytes = layout.padded_numel // per_node * element_size
        intra = (per_node - 1) * shard_bytes + (per_node - 1) * nodes * block
        return intra, 2 * (nodes - 1) * block
    if topology is None:
        return 0, layout.bytes_per_call()
    same_node_peers = topology.node_sizes[topology.node_of[rank]] - 1
    intra, inter = same_node_peers * block, (world_size - 1 - same_node_peers) * block
    if topology.same_node(rank, (rank + 1) % world_size):
        intra += (world_size - 1) * block
    else:
        inter += (world_size - 1) * block
    return intra, inter


def _compress_chunks(
    x: torch.Tensor,
    worker_error: torch.Tensor,
    send: torch.Tensor,
    layout: BucketLayout,
    chunks: range,
    backend: Backend,
    workspace: kernels.Workspace,
) -> None:
    """Worker phase: compress ``x + e_w`` (``x`` covers ``chunks`` of the layout) straight into one wire block per
    chunk, in order (segments never cross a chunk boundary)."""
    c, s_max, block = layout.chunk_numel, layout.max_chunk_segments, layout.block_bytes
    for i, r in enumerate(chunks):
        part, out = slice(i * c, (i + 1) * c), send[i * block : (i + 1) * block]
        scales, _ = kernels.compress_with_error_feedback(
            x[part],
            worker_error[part],
            layout.chunk_segments[r],
            packed_out=out[_SCALE_BYTES * s_max :],
            backend=backend,
            workspace=workspace,
        )
        _write_scales(out, scales)


def _serve_chunk(
    bufs: _BucketBuffers, layout: BucketLayout, segments: Segments, sources: int, backend: Backend, workspace
) -> None:
    """Server phase: ``e_s += mean of the received chunks``; compress ``e_s`` into the all_gather block."""
    s_max, block = layout.max_chunk_segments, layout.block_bytes
    blocks = [_read_block(bufs.recv[j * block : (j + 1) * block], len(segments), s_max) for j in range(sources)]
    kernels.add_mean_of_signs_(
        bufs.server_error,
        [signs for _, signs in blocks],
        [scales for scales, _ in blocks],
        segments,
        backend=backend,
        workspace=workspace,
    )
    # the server's signs are packed straight into its all_gather block, behind the scales
    server_scales, _ = kernels.compress_in_place(
        bufs.server_error, segments, packed_out=bufs.gather_send[_SCALE_BYTES * s_max :], backend=backend,
        workspace=workspace,
    )
    _write_scales(bufs.gather_send, server_scales)


def _decode_all(
    buffer: torch.Tensor, blocks: torch.Tensor, layout: BucketLayout, backend: Backend, workspace
) -> None:
    """Write every server's chunk (``P`` wire blocks in chunk order) into ``buffer``."""
    c, s_max, block = layout.chunk_numel, layout.max_chunk_segments, layout.block_bytes
    for j, chunk_segments in enumerate(layout.chunk_segments):
        scales, signs = _read_block(blocks[j * block : (j + 1) * block], len(chunk_segments), s_max)
        kernels.decompress(signs, scales, chunk_segments, buffer[j * c : (j + 1) * c], backend=backend, workspace=workspace)


def agree_kernel_backend(backend: Backend = "auto", group: Optional[dist.ProcessGroup] = None) -> str:
    """The kernel backend every rank of ``group`` will run, agreed with one ``all_gather_object``.

    Replicas stay bit-identical only if every rank computes the same bits, and the fused C Adam update rounds
    differently from torch's in the last bit (the compression kernels agree bit for bit). ``"auto"`` resolves per
    process (a node without a C compiler, or ``LIGHTNING_ONEBIT_NATIVE=0`` on one rank, lacks the C kernels), so:

    * ``"auto"`` stays ``"auto"`` when every rank has the same backends available (each then resolves identically
      for identical tensors), and becomes ``"torch"`` otherwise, with a warning that names the ranks;
    * an explicit backend that some rank lacks raises ``RuntimeError`` on every rank, naming them;
    * ranks that asked for different backends raise ``ValueError`` on every rank.

    A collective: every rank of ``group`` must call it. Without an initialised process group it returns ``backend``.
    """
    if not (dist.is_available() and dist.is_initialized()) or dist.get_world_size(group) == 1:
        return backend
    requested = kernels.effective_backend(backend)
    mine = (requested, kernels.available_backends())
    everyone: list[Any] = [None] * dist.get_world_size(group)
    dist.all_gather_object(everyone, mine, group=group)
    if len({r for r, _ in everyone}) != 1:
        asked = {rank: r for rank, (r, _) in enumerate(everyone)}
        raise ValueError(f"ranks asked for different kernel backends {asked}; pass the same kernel_backend everywhere")
    if requested != "auto":
        lacking = [rank for rank, (_, available) in enumerate(everyone) if requested not in available]
        if lacking:
            raise RuntimeError(
                f"kernel_backend={requested!r} is not available on rank(s) {lacking} (see their logs: no C compiler, "
                "LIGHTNING_ONEBIT_NATIVE=0, or no cupy); use kernel_backend='auto' or 'torch'"
            )
        return requested
    if len({available for _, available in everyone}) == 1:
        return "auto"
    by_rank = {rank: list(available) for rank, (_, available) in enumerate(everyone)}
    log.warning(
        "lightning_onebit: ranks have different kernel backends available %s; every rank runs the torch kernels so "
        "that replicas compute identical bits (install a C compiler on every node, and cupy on every GPU node, to "
        "use the fused kernels)",
        by_rank,
    )
    return "torch"


def replica_checksums(tensors: Sequence[torch.Tensor]) -> torch.Tensor:
    """One int64 per tensor: the sum of its raw bit patterns, which differs if any element's bits differ (a cheap
    test of bitwise equality between replicas; one pass over the parameters)."""
    sums = []
    for t in tensors:
        flat = t.detach().reshape(-1)
        bits = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}[flat.element_size()]
        words = flat.view(bits).to(torch.int64)
        # weight by position modulo a prime so that swapped elements do not cancel
        weights = torch.arange(1, words.numel() + 1, device=words.device, dtype=torch.int64).remainder_(1_000_003)
        sums.append((words * weights).sum())
    return torch.stack(sums).cpu() if sums else torch.zeros(0, dtype=torch.int64)


def assert_replicas_identical(
    named_tensors: Sequence[tuple[str, torch.Tensor]], group: Optional[dist.ProcessGroup] = None
) -> None:
    """Raise ``RuntimeError`` on every rank if any tensor differs in any bit between the ranks of ``group``.

    Compares :func:`replica_checksums` with one ``all_gather`` of ``8 x len(named_tensors)`` bytes per rank; the
    message names the first tensors that differ and the ranks that disagree with rank 0. A collective: every rank
    must call it with the same tensors in the same order.
    """
    if not (dist.is_available() and dist.is_initialized()) or dist.get_world_size(group) == 1:
        return
    names = [name for name, _ in named_tensors]
    mine = replica_checksums([t for _, t in named_tensors])
    device = named_tensors[0][1].device if named_tensors and dist.get_backend(group) == "nccl" else torch.device("cpu")
    everyone = torch.empty(dist.get_world_size(group) * mine.numel(), dtype=torch.int64, device=device)
    _all_gather(everyone, mine.to(device), group).wait()
    everyone = everyone.cpu().view(-1, mine.numel())
    differs = (everyone != everyone[0]).any(dim=0)
    if bool(differs.any()):
        bad = [names[i] for i in differs.nonzero().flatten().tolist()]
        ranks = [r for r in range(everyone.shape[0]) if bool((everyone[r] != everyone[0]).any())]
        raise RuntimeError(
            f"replicas diverged: {len(bad)} tensor(s) differ between ranks (first: {bad[:5]}); ranks {ranks} differ "
            "from rank 0. Every rank must run the same kernels on the same inputs (see agree_kernel_backend)."
        )
