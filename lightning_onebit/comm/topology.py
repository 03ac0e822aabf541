"""Which ranks share a node, and the process groups that topology-aware compression runs in.

A cluster of ``P = M x L`` ranks (``M`` nodes, ``L`` ranks per node) has a fast link inside each node and a slow one
between nodes. Rank ``(n, l)`` (node ``n``, local index ``l``) belongs to two groups:

* its *intra-node* group: the ``L`` ranks of node ``n``, ordered by local index;
* its *inter-node* group: the ``M`` ranks with local index ``l``, one per node, ordered by node.

The hierarchical compressed allreduce (:mod:`lightning_onebit.comm`) reduces in full precision inside the node, runs
the 1-bit exchange inside the inter-node group, and gathers the result inside the node again, so only ``~N/8`` bytes
per node cross the slow link instead of ``~N/4`` to ``N`` for a flat 1-bit exchange.

The topology is derived from an all-gather of every rank's ``(node_rank, local_rank)`` as the launcher reports them
(torchrun, SLURM, LSF, ... via Lightning's cluster environment), never from ``rank // L``: under SLURM and torchrun
the ranks of a node need not be contiguous. :meth:`Topology.plan` is the pure part (testable without processes);
:meth:`Topology.build` gathers the placements and creates the groups, on every rank, in the same order: each family
of groups (the intra-node groups, the inter-node groups) in one ``dist.split_group`` where torch and the backend can
split (NCCL with a bound device), else one ``dist.new_group`` per group (gloo: :func:`split_group_supported`).
Creating and destroying the groups is :mod:`lightning_onebit.comm.groups`'s.
"""

from __future__ import annotations

import dataclasses
import functools
import logging
import warnings
from datetime import timedelta
from typing import Any, Literal, Optional, Sequence

import torch.distributed as dist

from lightning_onebit._checks import check_integer
from lightning_onebit._docs import docs_pointer
from lightning_onebit.comm.agreement import agree
# defined in comm.groups; imported here too, where callers have always imported them from
from lightning_onebit.comm.groups import (
    destroy_groups,
    group_timeout,
    is_distributed,
    is_registered,
    new_group_family,
    split_group_supported,
)

__all__ = [
    "Topology",
    "TopologyMode",
    "destroy_groups",
    "group_timeout",
    "is_registered",
    "new_gather_groups",
    "new_group_family",
    "split_group_supported",
]

log = logging.getLogger(__name__)

TopologyMode = Literal["auto", "flat", "hierarchical"]
_MODES = ("auto", "flat", "hierarchical")


@dataclasses.dataclass(frozen=True)
class Topology:
    """Placement of the ranks of one process group on nodes, and the exchange mode chosen for it.

    Build it with :meth:`build` (a collective: every rank of the group calls it) or :meth:`plan` (pure, no groups).

    Attributes:
        mode: ``"flat"`` (every rank exchanges 1-bit momentum with every other) or ``"hierarchical"``.
        reason: why this mode was chosen (e.g. why ``auto`` fell back to flat); logged by :meth:`build`.
        node_of: per group rank, the index of its node (nodes numbered ``0..M-1`` in order of their node rank).
        local_of: per group rank, its index inside its node (``0..L-1``, in order of group rank: the launcher's local
            ranks only identify places, torch numbers a group's members by global rank).
        rank: this process's rank in the group (``None`` for a plan made without a process).
        intra_group: this rank's intra-node process group (hierarchical mode, after :meth:`build`).
        inter_group: this rank's inter-node process group (hierarchical mode, after :meth:`build`).
    """

    mode: Literal["flat", "hierarchical"]
    reason: str
    node_of: tuple[int, ...]
    local_of: tuple[int, ...]
    rank: Optional[int] = None
    intra_group: Optional[Any] = dataclasses.field(default=None, compare=False, repr=False)
    inter_group: Optional[Any] = dataclasses.field(default=None, compare=False, repr=False)

    # ------------------------------------------------------------------ shape
    @property
    def world_size(self) -> int:
        """``P``, the ranks in the group."""
        return len(self.node_of)

    @functools.cached_property
    def node_sizes(self) -> tuple[int, ...]:
        """Ranks per node, by node index (computed once: the byte accounting reads it every step)."""
        sizes = [0] * (max(self.node_of) + 1 if self.node_of else 0)
        for node in self.node_of:
            sizes[node] += 1
        return tuple(sizes)

    @property
    def num_nodes(self) -> int:
        """``M``, the number of nodes."""
        return len(self.node_sizes)

    @functools.cached_property
    def ranks_per_node(self) -> Optional[int]:
        """``L`` when every node has the same number of ranks, else ``None``."""
        return self.node_sizes[0] if len(set(self.node_sizes)) == 1 else None

    @property
    def is_hierarchical(self) -> bool:
        return self.mode == "hierarchical"

    def node_ranks(self, node: int) -> tuple[int, ...]:
        """Group ranks of node ``node`` in ascending order: the members of its intra-node group, in group-rank order."""
        return tuple(r for r, n in enumerate(self.node_of) if n == node)

    def local_ranks(self, local: int) -> tuple[int, ...]:
        """Group ranks with local index ``local`` in ascending order: the members of that inter-node group, in
        group-rank order (which need not be node order when ranks are not numbered node by node)."""
        return tuple(r for r, l in enumerate(self.local_of) if l == local)

    @property
    def inter_index(self) -> int:
        """This rank's position in its inter-node group (the chunk of its shard that it serves)."""
        return self.local_ranks(self.local_index).index(self._own_rank())

    @property
    def node_index(self) -> int:
        """This rank's node index ``n``."""
        return self.node_of[self._own_rank()]

    @property
    def local_index(self) -> int:
        """This rank's index ``l`` inside its node."""
        return self.local_of[self._own_rank()]

    def same_node(self, a: int, b: int) -> bool:
        """Whether group ranks ``a`` and ``b`` share a node."""
        return self.node_of[a] == self.node_of[b]

    def describe(self) -> dict[str, Any]:
        """What a per-rank checkpoint records to detect a topology change: mode, ``(M, L)``, this rank's place."""
        rank = self._own_rank()
        return {
            "mode": self.mode,
            "num_nodes": self.num_nodes,
            "ranks_per_node": self.ranks_per_node,
            "world_size": self.world_size,
            "node": self.node_of[rank],
            "local": self.local_of[rank],
        }

    def _own_rank(self) -> int:
        if self.rank is None:
            raise ValueError("this Topology is a plan without a process: it has no own rank")
        return self.rank

    # ------------------------------------------------------------------ construction
    @classmethod
    def plan(
        cls,
        placements: Sequence[tuple[int, int]],
        mode: TopologyMode = "auto",
        rank: Optional[int] = None,
        ranks_per_node: Optional[int] = None,
    ) -> "Topology":
        """Choose the exchange mode from every rank's ``(node_rank, local_rank)`` (pure; creates no groups).

        Args:
            placements: per group rank, the ``(node_rank, local_rank)`` its launcher reports. Node and local ranks need
                not be contiguous or start at 0; they are renumbered in sorted order.
            mode: ``"auto"`` is hierarchical when there are several nodes with the same number (> 1) of ranks each,
                and flat otherwise, with the reason. ``"hierarchical"`` where that is impossible is a ``ValueError``
                naming the reason. ``"flat"`` is always flat.
            rank: this process's group rank (optional).
            ranks_per_node: override the placements: ranks ``k K .. k K + K - 1`` form node ``k`` (for one host
                playing several nodes, e.g. in tests). ``None`` (default) uses the placements. A ``K`` that does not
                divide the world size leaves the last node short: ``"auto"`` is then flat, saying why (and
                :meth:`build` warns), ``"hierarchical"`` a ``ValueError``.

        Raises:
            ValueError: on an unknown mode, a bad override, ``"hierarchical"`` where it is impossible, or two ranks
                reporting the same ``(node, local)`` place.
        """
        if mode not in _MODES:
            raise ValueError(f"topology must be one of {_MODES}, got {mode!r}")
        world_size = len(placements)
        uneven_override = None  # why ranks_per_node cannot give equal nodes, if it cannot
        if ranks_per_node is not None:
            check_integer(ranks_per_node, "ranks_per_node")
            if world_size % ranks_per_node:
                uneven_override = _uneven_override(ranks_per_node, world_size)
                if mode == "hierarchical":
                    raise ValueError(
                        f"topology='hierarchical' needs every simulated node to have the same number of ranks, but "
                        f"{uneven_override}; pass a ranks_per_node that divides the world size, or use "
                        "topology='auto' (falls back to flat) or 'flat'"
                    )
            # the last simulated node is short when ranks_per_node does not divide the world size ('auto': flat)
            placements = [(r // ranks_per_node, r % ranks_per_node) for r in range(world_size)]
        placements = [(int(n), int(l)) for n, l in placements]
        seen: dict[tuple[int, int], int] = {}
        for r, place in enumerate(placements):
            if place in seen:
                raise ValueError(
                    f"ranks {seen[place]} and {r} both report node_rank={place[0]}, local_rank={place[1]}: the "
                    "cluster environment is inconsistent (check NODE_RANK/GROUP_RANK and LOCAL_RANK, or SLURM_NODEID "
                    "and SLURM_LOCALID), or pass ranks_per_node explicitly"
                )
            seen[place] = r
        node_ids = sorted({n for n, _ in placements})
        node_of = tuple(node_ids.index(n) for n, _ in placements)
        # The local index is the position in the node by group rank, not by the launcher's local rank: it must equal
        # the rank in the intra-node group, and torch orders a new group's ranks by their global rank.
        local_of = [0] * world_size
        for node in range(len(node_ids)):
            for index, r in enumerate(r for r in range(world_size) if node_of[r] == node):
                local_of[r] = index
        topology = cls("flat", "", node_of, tuple(local_of), rank)
        why_not = uneven_override or topology._why_not_hierarchical()
        if mode == "flat":
            reason = "topology='flat' requested"
        elif why_not is None:
            reason = f"{topology.num_nodes} nodes x {topology.ranks_per_node} ranks per node"
            if mode == "auto":
                reason += " (topology='auto')"
        elif mode == "hierarchical":
            raise ValueError(
                f"topology='hierarchical' needs several nodes with several ranks each, but {why_not}; "
                "use topology='auto' or 'flat'"
            )
        else:
            reason = f"topology='auto' falls back to flat: {why_not}"
        chosen = "hierarchical" if mode != "flat" and why_not is None else "flat"
        return dataclasses.replace(topology, mode=chosen, reason=reason)

    def _why_not_hierarchical(self) -> Optional[str]:
        counts = list(self.node_sizes)
        if self.num_nodes == 1:
            return f"all {self.world_size} ranks are on one node"
        if len(set(counts)) != 1:
            return f"nodes have uneven numbers of ranks {counts}"
        if counts[0] == 1:
            return f"each of the {self.num_nodes} nodes has one rank"
        return None

    @classmethod
    def build(
        cls,
        node_rank: int,
        local_rank: int,
        mode: TopologyMode = "auto",
        ranks_per_node: Optional[int] = None,
        group: Optional[dist.ProcessGroup] = None,
        timeout: Optional[timedelta] = None,
    ) -> "Topology":
        """Gather every rank's placement, choose the mode, and create the intra- and inter-node groups.

        A collective over ``group`` (default WORLD): every rank must call it, with the same ``mode`` and
        ``ranks_per_node``. Every rank creates every group, the intra-node family (one group per node) and then the
        inter-node family (one per local index), each in one ``dist.split_group`` where the backend can split, else
        one ``dist.new_group`` per group in that order (:func:`new_group_family`). The caller owns the groups
        (:attr:`groups`, :func:`destroy_groups`). Without an initialised process group the topology is flat over one
        rank.

        Args:
            node_rank, local_rank: this process's node and local rank, as the launcher reports them (Lightning:
                ``cluster_environment.node_rank()`` and ``local_rank()``; torchrun: ``GROUP_RANK``, ``LOCAL_RANK``).
            mode, ranks_per_node: see :meth:`plan`.
            group: the process group the compressed allreduce averages over; ``None`` means WORLD.
            timeout: how long a collective in the new groups waits for a peer before it fails (a stalled or dead
                rank); ``None``: ``group``'s own timeout (:func:`new_group_family`). The Lightning strategy passes
                its ``timeout``.

        Raises:
            ValueError: as :meth:`plan`; ``"hierarchical"`` with a ``ranks_per_node`` that does not divide the world
                size is refused before any collective.
        """
        if not is_distributed():
            topology = cls.plan(
                [(node_rank, local_rank)], mode if mode != "hierarchical" else "auto", 0, ranks_per_node
            )
            _warn_uneven_override(topology, mode, ranks_per_node)
            return topology
        world_size, rank = dist.get_world_size(group), dist.get_rank(group)
        if mode == "hierarchical" and ranks_per_node is not None:
            # refused here, locally, so that no rank waits in the gather below for one that raised
            cls.plan([(0, r) for r in range(world_size)], mode, None, ranks_per_node)
        placements = agree((int(node_rank), int(local_rank), mode, ranks_per_node), group)
        requested = {(m, k) for _, _, m, k in placements}
        if len(requested) != 1:
            raise ValueError(
                f"ranks disagree on the topology settings (mode, ranks_per_node): {sorted(map(str, requested))}; "
                "every rank must pass the same values"
            )
        topology = cls.plan([(n, l) for n, l, _, _ in placements], mode, rank, ranks_per_node)
        if topology.is_hierarchical:
            topology = topology.with_new_groups(group, timeout)
        if rank == 0:
            _warn_uneven_override(topology, mode, ranks_per_node)
        log.info("lightning_onebit topology: %s (%s)", topology.mode, topology.reason)
        return topology

    def with_new_groups(
        self, group: Optional[dist.ProcessGroup] = None, timeout: Optional[timedelta] = None
    ) -> "Topology":
        """This topology with freshly created intra- and inter-node process groups (hierarchical mode).

        A collective: every rank creates every group, the family of intra-node groups (one per node) first, then the
        family of inter-node groups (one per local index), each family in one :func:`new_group_family` (one
        ``dist.split_group`` where the backend can split, else one ``dist.new_group`` per group), as torch requires.
        :meth:`build` uses it; the overlapped exchange's second phase takes a second set
        (:func:`new_gather_groups`, made once per process group by the Lightning strategy). ``group`` is the process
        group the topology was built over (``None``: WORLD). ``timeout``: how long the groups' collectives wait for
        a peer (``None``: ``group``'s own, see :func:`new_group_family`). A flat topology is returned unchanged.

        The groups belong to the caller: destroy them with ``destroy_groups(topology.groups)`` (or
        ``dist.destroy_process_group()``, which destroys every group) when they are no longer used.
        """
        if not self.is_hierarchical:
            return self
        intra = new_group_family([self.node_ranks(node) for node in range(self.num_nodes)], group, timeout)
        inter = new_group_family([self.local_ranks(local) for local in range(self.ranks_per_node or 0)], group, timeout)
        if intra is None or inter is None:
            raise RuntimeError("this rank is in no topology group: the placements do not cover every rank")
        if (dist.get_rank(intra), dist.get_rank(inter)) != (self.local_index, self.inter_index):
            raise RuntimeError(
                f"topology groups are numbered ({dist.get_rank(intra)}, {dist.get_rank(inter)}), expected "
                f"({self.local_index}, {self.inter_index}): torch's group ordering changed"
            )
        return dataclasses.replace(self, intra_group=intra, inter_group=inter)

    @property
    def groups(self) -> tuple[Any, ...]:
        """The process groups this topology holds (hierarchical: ``(intra_group, inter_group)``; else ``()``)."""
        return tuple(g for g in (self.intra_group, self.inter_group) if g is not None)


def new_gather_groups(
    process_group: Optional[dist.ProcessGroup], topology: Optional[Topology], timeout: Optional[timedelta] = None
) -> tuple[Any, Any]:
    """Process groups of their own for the second phase of the compressed exchange, ``(inter, intra)``.

    The overlapped exchange launches bucket ``k - 1``'s ``all_gather`` right after bucket ``k``'s ``all_to_all``;
    in groups of their own the two run concurrently (:meth:`CompressedAllreduceState.create_gather_groups`). Flat: a
    copy of ``process_group`` and ``None``; hierarchical: copies of the topology's inter- and intra-node groups. A
    collective, as :func:`new_group_family`; ``timeout`` as there (``None``: ``process_group``'s own). Where groups are
    made with ``new_group`` and ``process_group`` holds only some ranks (FSDP's replicate group), every rank of WORLD
    calls it with its own group, these groups being disjoint: they are gathered (one ``all_gather_object`` over
    WORLD) and a copy of each is made.
    """
    if topology is not None and topology.is_hierarchical:
        copy = topology.with_new_groups(process_group, timeout)
        return copy.inter_group, copy.intra_group
    size = dist.get_world_size(process_group)
    if size == dist.get_world_size() or split_group_supported(process_group):
        return new_group_family([list(range(size))], process_group, timeout), None
    # A group of some ranks only (FSDP's replicate group): dist.new_group wants every rank of WORLD to create every
    # group, so every rank makes a copy of each rank's group (WORLD is split into such groups, e.g. a mesh dimension).
    families = agree(dist.get_process_group_ranks(process_group))
    family = sorted({tuple(sorted(ranks)) for ranks in families})
    if len({r for ranks in family for r in ranks}) != sum(len(ranks) for ranks in family):
        raise ValueError(f"new_gather_groups: the ranks' process groups overlap without being equal: {family}")
    return new_group_family(family, None, timeout if timeout is not None else group_timeout(process_group)), None


def _uneven_override(ranks_per_node: int, world_size: int) -> str:
    nodes = -(-world_size // ranks_per_node)
    sizes = [ranks_per_node] * (nodes - 1) + [world_size - ranks_per_node * (nodes - 1)]
    return (
        f"ranks_per_node={ranks_per_node} does not divide the world size {world_size} (the simulated nodes would have "
        f"{sizes} ranks)"
    )


def _warn_uneven_override(topology: Topology, mode: str, ranks_per_node: Optional[int]) -> None:
    """Warn when ``topology='auto'`` fell back to flat because ``ranks_per_node`` does not divide the world size: the
    override was asked for, so a silent flat exchange would hide a mistake."""
    if mode == "auto" and ranks_per_node is not None and topology.world_size % ranks_per_node:
        warnings.warn(
            f"lightning_onebit: {topology.reason}; {docs_pointer('guides/multi-node')}", UserWarning, stacklevel=3
        )
