"""What the compressed exchange keeps between calls, per process group: :class:`CompressedAllreduceState` (process
group, topology, kernel backend and workspace, counters and device timings, the second-phase process groups, and
the error feedback of every bucket with its checkpointing), :class:`BucketBuffers` (one bucket's error feedback and
wire workspaces), and the error-feedback helpers (``_error_norm``; ``_same_exchange`` and ``_topology_text``: whether
saved error feedback still fits the topology, and why not).
"""

from __future__ import annotations

import math
from typing import Any, Callable, Hashable, Iterable, Optional

import torch
import torch.distributed as dist

from lightning_onebit import kernels
from lightning_onebit.comm.accounting import CommunicationCounters
from lightning_onebit.comm.groups import group_rank, group_size, is_distributed
from lightning_onebit.comm.layout import BucketLayout
from lightning_onebit.comm.topology import Topology, new_gather_groups
from lightning_onebit.kernels import Backend
from lightning_onebit.streams import DeviceTimings


class BucketBuffers:
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
        self._buckets: dict[Hashable, BucketBuffers] = {}
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
        behind it in one communicator. Flat: a copy of ``process_group``; hierarchical: copies of the intra- and
        inter-node groups (:func:`~lightning_onebit.comm.topology.new_gather_groups`).
        A collective (over WORLD, or ``process_group`` where torch can split it): every rank calls it, in the same
        order relative to other group creations. Valid until ``process_group`` or ``topology`` change (then the
        exchange falls back to the phase-1 groups).

        The groups are new on every call and belong to the caller, who destroys them (``dist.destroy_process_group()``
        at the end destroys every group). Whoever makes many optimizers over one process group (the Lightning strategy,
        one per ``fit``) makes them once with ``new_gather_groups`` and hands them over with
        :meth:`install_gather_groups` instead.
        """
        if not is_distributed():
            return
        self.install_gather_groups(*new_gather_groups(self.process_group, self.topology))

    def install_gather_groups(self, inter: Any, intra: Any = None) -> None:
        """Run the second phase in these ready-made groups (made by
        :func:`~lightning_onebit.comm.topology.new_gather_groups` for this ``process_group`` and ``topology``):
        ``inter`` for the ``all_gather`` between servers (flat: a copy of ``process_group``), ``intra`` for the
        hierarchical node gather (``None`` when flat). No collective; valid, as :meth:`create_gather_groups`' groups,
        until ``process_group`` or ``topology`` change. The caller keeps ownership (and destroys them)."""
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
        """The ranks of :attr:`process_group` (1 without an initialised process group)."""
        return group_size(self.process_group)

    def rank(self) -> int:
        """This process's rank in :attr:`process_group` (0 without an initialised process group)."""
        return group_rank(self.process_group)

    def count_call(self, layout: BucketLayout, buffer: torch.Tensor) -> None:
        """Count one compressed exchange of ``buffer`` (laid out as ``layout``) in :attr:`counters`: its bytes split
        into intra- and inter-node bytes (:meth:`BucketLayout.bytes_sent`), its fp32 equivalent, two collectives (four
        hierarchical) and one call."""
        counters = self.counters
        intra, inter = layout.bytes_sent(buffer.element_size(), self.topology, self.rank())
        counters.bytes_sent += intra + inter
        counters.bytes_received += intra + inter
        counters.bytes_sent_intra_node += intra
        counters.bytes_sent_inter_node += inter
        counters.bytes_fp32_equivalent += layout.fp32_equivalent_bytes()
        counters.collectives += 4 if self.ranks_per_node > 1 else 2
        counters.calls += 1

    def settle_timings(self) -> CommunicationCounters:
        """Add the completed CUDA-event timings to :attr:`counters` (never waits for the device) and return them."""
        self.timings.settle()
        return self.counters

    # ------------------------------------------------------------------ error feedback
    def buffers(self, key: Hashable, layout: BucketLayout, like: torch.Tensor) -> BucketBuffers:
        """The bucket's buffers on ``like``'s device and dtype: created as zeros when new or when the layout changed
        (the error belongs to a layout); when only the device or dtype changed, the error is carried over."""
        buffers = self._buckets.get(key)
        if buffers is None or buffers.layout != layout or buffers.ranks_per_node != self.ranks_per_node:
            buffers = self._buckets[key] = BucketBuffers(layout, like, self.ranks_per_node)
        elif buffers.worker_error.dtype != like.dtype or buffers.worker_error.device != like.device:
            moved = BucketBuffers(layout, like, self.ranks_per_node)
            moved.worker_error.copy_(buffers.worker_error)
            moved.server_error.copy_(buffers.server_error)
            buffers = self._buckets[key] = moved
        return buffers

    def existing_buffers(self, key: Hashable) -> Optional[BucketBuffers]:
        """Bucket ``key``'s buffers if its exchange has run (or they were restored), else ``None``; nothing made."""
        return self._buckets.get(key)

    def bucket_buffers(self) -> dict[Hashable, BucketBuffers]:
        """Every bucket's buffers made so far, by key (a new dict of the live buffers)."""
        return dict(self._buckets)

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


def _error_norm(buffers: Iterable[BucketBuffers]) -> float:
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
