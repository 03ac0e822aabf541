"""Torch process groups as the exchange needs them: a family of disjoint groups made in one split where the backend
can, the second-phase gather groups of the overlapped exchange, a group's timeout, and their destruction.

Every creation here is a collective that every rank makes in the same order; destruction is local.
"""

from __future__ import annotations

from datetime import timedelta
from typing import TYPE_CHECKING, Any, Optional, Sequence

import torch
import torch.distributed as dist

if TYPE_CHECKING:  # for annotations only: comm.topology imports this module
    from lightning_onebit.comm.topology import Topology


def group_timeout(group: Optional[dist.ProcessGroup] = None) -> Optional[timedelta]:
    """How long a collective in ``group`` (``None``: WORLD) waits before it fails, where torch says (``None`` where
    it does not: no initialised group, or a backend without the option). Reads the backend's options, which torch
    exposes without a public accessor (checked on torch 2.13, gloo and NCCL)."""
    if not (dist.is_available() and dist.is_initialized()):
        return None
    try:
        pg = dist.distributed_c10d._get_default_group() if group is None else group
        for device in pg._device_types:
            options = pg._get_backend(device).options
            value = getattr(options, "_timeout", getattr(options, "timeout", None))
            if isinstance(value, timedelta):
                return value
    except (AttributeError, RuntimeError, ValueError, TypeError):
        pass
    return None


def split_group_supported(group: Optional[dist.ProcessGroup] = None) -> bool:
    """Whether ``dist.split_group`` can split ``group`` (``None``: WORLD) here, with the checks torch makes.

    ``split_group`` (torch >= 2.6) makes a whole family of disjoint groups in one communicator split. On NCCL with a
    bound device (Lightning passes ``device_id`` to ``init_process_group``), each ``dist.new_group`` is instead an
    eager split of WORLD in which every rank takes part, non-members included: ``M + L`` of them for a hierarchical
    topology, against 2 with ``split_group``. torch refuses to split without an
    accelerator and a device bound to the default group, so on CPU gloo (checked on torch 2.13: "No device
    associated with the default pg, not safe to split any process groups"; ``init_process_group`` refuses a CPU
    ``device_id``) groups are made with ``new_group``, where each is a gloo connection setup among its members only.
    The answer depends only on the torch build, the backend and whether a device is bound, which every rank shares,
    so every rank takes the same branch.
    """
    if not hasattr(dist, "split_group") or not (dist.is_available() and dist.is_initialized()):
        return False
    default = dist.distributed_c10d._get_default_group()
    if getattr(default, "bound_device_id", None) is None:
        return False
    accelerator = getattr(torch, "accelerator", None)
    if accelerator is None or not accelerator.is_available():
        return False
    parent = default if group is None else group
    try:
        backend = parent._get_backend(accelerator.current_accelerator())
    except RuntimeError:  # the group has no backend for the accelerator (e.g. a gloo-only group)
        return False
    return bool(getattr(backend, "supports_splitting", False))


def new_group_family(
    members: Sequence[Sequence[int]],
    group: Optional[dist.ProcessGroup] = None,
    timeout: Optional[timedelta] = None,
) -> Optional[dist.ProcessGroup]:
    """Create one process group per entry of ``members`` (disjoint lists of ranks of ``group``, ``None``: WORLD)
    and return the one this rank is in (``None`` if it is in none).

    One ``dist.split_group`` of ``group`` for the whole family where :func:`split_group_supported`, else one
    ``dist.new_group`` per entry, in the order given. A collective: every rank calls it with the same ``members``
    (``new_group``: every rank of WORLD; ``split_group``: every rank of ``group``), in the same order relative to
    every other group creation. Each group's members are numbered in ascending order of their rank in ``group``.

    ``timeout`` is how long a collective in the new groups waits for a peer before it fails; ``None`` takes
    ``group``'s own (:func:`group_timeout`), where torch would otherwise give every new group its default of 30
    minutes whatever the parent's: a stalled rank would then hold its peers for half an hour.
    """
    members = [sorted(int(r) for r in ranks) for ranks in members]
    if not (dist.is_available() and dist.is_initialized()):
        raise RuntimeError("new_group_family needs an initialised torch.distributed process group")
    if timeout is None:
        timeout = group_timeout(group)
    if split_group_supported(group):
        return dist.split_group(group, split_ranks=members, timeout=timeout)  # None where this rank is in no entry
    own = dist.get_rank(group)
    global_ranks = list(range(dist.get_world_size())) if group is None else dist.get_process_group_ranks(group)
    mine = None
    for ranks in members:
        created = dist.new_group([global_ranks[r] for r in ranks], timeout=timeout)
        if own in ranks:
            mine = created
    return mine


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
    families: list[Any] = [None] * dist.get_world_size()
    dist.all_gather_object(families, dist.get_process_group_ranks(process_group))
    family = sorted({tuple(sorted(ranks)) for ranks in families})
    if len({r for ranks in family for r in ranks}) != sum(len(ranks) for ranks in family):
        raise ValueError(f"new_gather_groups: the ranks' process groups overlap without being equal: {family}")
    return new_group_family(family, None, timeout if timeout is not None else group_timeout(process_group)), None


def is_registered(group: Any) -> bool:
    """Whether ``group`` is a process group torch still knows (not destroyed, and its default group alive). Reads
    torch's private registry: torch has no public test, and destroying an unknown group raises."""
    if group is None or not (dist.is_available() and dist.is_initialized()):
        return False
    return dist.distributed_c10d._world.pg_map.get(group) is not None


def destroy_groups(groups: Sequence[Any]) -> int:
    """``dist.destroy_process_group(g)`` for each of ``groups`` that is still registered (a group destroyed already,
    e.g. by ``dist.destroy_process_group()`` of WORLD, is skipped); returns how many were destroyed. Local, no
    collective: each rank destroys its own groups."""
    destroyed = 0
    for group in groups:
        if group is not None and group is not dist.GroupMember.WORLD and is_registered(group):
            dist.destroy_process_group(group)
            destroyed += 1
    return destroyed
