"""Torch process groups as the exchange needs them: a family of disjoint groups made in one split where the backend
can, a group's timeout, their destruction, the asynchronous ``all_gather`` every collective of the library uses, and
how a failed collective is reported (:class:`CollectiveFailedError`, raised by :func:`naming_the_group` with a
message that names the collective, the global ranks of its process group and the group's timeout).

Every creation here is a collective that every rank makes in the same order; destruction is local.
"""

from __future__ import annotations

import contextlib
from datetime import timedelta
from typing import Any, Iterable, Iterator, Optional, Sequence

import torch
import torch.distributed as dist

#: Most bytes one broadcast of :func:`broadcast_coalesced` carries (DDP's broadcast bucket is 250 MiB).
BROADCAST_BUCKET_BYTES = 256 * 2**20


def is_distributed() -> bool:
    """Whether ``torch.distributed`` is available and its default process group initialised (without one, every
    collective of the library is the identity on one rank)."""
    return dist.is_available() and dist.is_initialized()


def group_size(group: Optional[dist.ProcessGroup] = None) -> int:
    """The number of ranks of ``group`` (``None``: WORLD); 1 without an initialised process group."""
    return dist.get_world_size(group) if is_distributed() else 1


def group_rank(group: Optional[dist.ProcessGroup] = None) -> int:
    """This process's rank in ``group`` (``None``: WORLD); 0 without an initialised process group."""
    return dist.get_rank(group) if is_distributed() else 0


class CollectiveFailedError(RuntimeError):
    """A collective of the compressed exchange failed on this rank. The message names the collective, the global
    ranks of its process group and the group's timeout; the backend's own error is the ``__cause__``. On gloo a peer
    that stalled (stopped, swapped out, stuck in I/O or a debugger) makes it time out after the group's timeout, one
    that died makes it fail at once; neither error says which peer."""


@contextlib.contextmanager
def naming_the_group(what: str, group: Optional[dist.ProcessGroup]) -> Iterator[None]:
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


def all_gather_async(output: torch.Tensor, input: torch.Tensor, group: Optional[dist.ProcessGroup]) -> dist.Work:
    """``all_gather_into_tensor(output, input, group, async_op=True)`` under the name this torch gives it (torch 2.13
    renamed it ``all_gather_single``; the old name warns)."""
    gather = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
    return gather(output, input, group=group, async_op=True)


def group_timeout(group: Optional[dist.ProcessGroup] = None) -> Optional[timedelta]:
    """How long a collective in ``group`` (``None``: WORLD) waits before it fails, where torch says (``None`` where
    it does not: no initialised group, or a backend without the option). Reads the backend's options, which torch
    exposes without a public accessor (checked on torch 2.13, gloo and NCCL)."""
    if not is_distributed():
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
    ``device_id``), and on any backend but NCCL, groups are made with ``new_group``, where each is a gloo connection
    setup among its members only.
    The answer depends only on the torch build, the backend and whether a device is bound, which every rank shares,
    so every rank takes the same branch.
    """
    if not hasattr(dist, "split_group") or not is_distributed():
        return False
    default = dist.distributed_c10d._get_default_group()
    if getattr(default, "bound_device_id", None) is None:
        return False
    accelerator = getattr(torch, "accelerator", None)
    if accelerator is None or not accelerator.is_available():
        return False
    parent = default if group is None else group
    device = accelerator.current_accelerator()
    # torch documents split_group for NCCL only; gloo's backend says it supports splitting, but on torch 2.11 (CUDA
    # tensors on gloo, seen on an H200) split_group then fails to deepcopy gloo's options
    if _backend_for(parent, device.type) != "nccl":
        return False
    try:
        backend = parent._get_backend(device)
    except RuntimeError:  # the group has no backend for the accelerator
        return False
    return bool(getattr(backend, "supports_splitting", False))


def _backend_for(group: dist.ProcessGroup, device_type: str) -> Optional[str]:
    """The name of ``group``'s backend for ``device_type``: ``dist.get_backend`` gives ``"nccl"`` for a group of one
    backend and ``"cpu:gloo,cuda:nccl"`` for a group with one per device type."""
    names = str(dist.get_backend(group))
    if ":" not in names:
        return names
    by_device = dict(part.split(":", 1) for part in names.split(","))
    return by_device.get(device_type)


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
    if not is_distributed():
        raise RuntimeError("new_group_family needs an initialised torch.distributed process group")
    if timeout is None:
        timeout = group_timeout(group)
    if split_group_supported(group):
        return dist.split_group(group, split_ranks=members, timeout=timeout)  # None where this rank is in no entry
    own = dist.get_rank(group)
    global_ranks = list(range(dist.get_world_size())) if group is None else dist.get_process_group_ranks(group)
    mine = None
    with _gloo_unbound():
        for ranks in members:
            created = dist.new_group([global_ranks[r] for r in ranks], timeout=timeout)
            if own in ranks:
                mine = created
    return mine


@contextlib.contextmanager
def _gloo_unbound() -> Iterator[None]:
    """On gloo, the default group unbound from its device while groups are made. torch splits every new group from a
    default group bound to a device (Lightning binds a CUDA device); gloo says it can split, but on torch 2.11 (CUDA
    tensors on gloo, seen on an H200) a rank outside the new group then fails (``ProcessGroupGloo`` has no
    ``perform_nocolor_split``). Unbound, each group is its own gloo connection, as on a CPU."""
    default = dist.distributed_c10d._get_default_group()
    bound = getattr(default, "bound_device_id", None)
    name = dist.get_backend()
    if bound is None or "gloo" not in name or "nccl" in name:
        yield
        return
    default.bound_device_id = None
    try:
        yield
    finally:
        default.bound_device_id = bound


def is_registered(group: Any) -> bool:
    """Whether ``group`` is a process group torch still knows (not destroyed, and its default group alive). Reads
    torch's private registry: torch has no public test, and destroying an unknown group raises."""
    if group is None or not is_distributed():
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


def broadcast_coalesced(tensors: Iterable[torch.Tensor], group: Any = None,
                        bucket_bytes: int = BROADCAST_BUCKET_BYTES) -> int:
    """Broadcast ``tensors`` from the first rank of ``group`` (``None``: WORLD) in flat buffers of one device and
    dtype each, at most ``bucket_bytes`` (default 256 MiB; a larger tensor alone), copied back on the other ranks: one
    collective per buffer, not one per tensor. A collective: every rank of ``group`` calls it with tensors of the same
    shapes, dtypes and order. Returns how many broadcasts it made (0 in a group of one rank)."""
    if dist.get_world_size(group) == 1:
        return 0
    buckets: dict[tuple[torch.device, torch.dtype], list[list[torch.Tensor]]] = {}
    filled: dict[tuple[torch.device, torch.dtype], int] = {}
    for t in tensors:
        if t.numel() == 0:  # an empty shard: its replicate peers hold the same empty shard
            continue
        kind, nbytes = (t.device, t.dtype), t.numel() * t.element_size()
        runs = buckets.setdefault(kind, [[]])
        if runs[-1] and filled[kind] + nbytes > bucket_bytes:
            runs.append([])
            filled[kind] = 0
        runs[-1].append(t)
        filled[kind] = filled.get(kind, 0) + nbytes
    source = dist.get_rank(group) == 0
    count = 0
    for runs in buckets.values():
        for run in runs:
            flat = torch.cat([t.detach().reshape(-1) for t in run])
            with naming_the_group(f"broadcast of {len(run)} tensor(s) from the group's first rank", group):
                dist.broadcast(flat, group=group, group_src=0)
            count += 1
            if source:
                continue
            offset = 0
            for t in run:
                t.copy_(flat[offset : offset + t.numel()].view_as(t))
                offset += t.numel()
    return count
