"""What the ranks agree on, and how: :func:`agree`, the one collective through which every decision that several
ranks must take alike is made (a topology, a kernel backend, a freeze step, whether a checkpoint is sound, whether a
step is skipped); agreeing on the kernel backend every rank runs (:func:`agree_kernel_backend`), and checking that
the replicas did stay identical (:func:`replica_checksums`, :func:`assert_replicas_identical`).
"""

from __future__ import annotations

import logging
from typing import Any, Literal, Optional, Sequence, Union

import torch
import torch.distributed as dist

from lightning_onebit import kernels
from lightning_onebit.comm.groups import group_size
from lightning_onebit.kernels import Backend

log = logging.getLogger(__name__)


def agree(value: Any, group: Optional[dist.ProcessGroup] = None,
          reduce: Optional[Literal["max"]] = None) -> Union[list[Any], torch.Tensor]:
    """What every rank of ``group`` (``None``: WORLD) holds, so that each takes the same decision from it:

    * ``reduce=None``: every rank's ``value`` (any picklable object), in group-rank order, with one
      ``all_gather_object`` (decisions made on the host: a placement, a backend, a checkpoint's problems);
    * ``reduce="max"``: ``value``, a tensor, replaced in place by its elementwise maximum over the ranks, with one
      ``all_reduce`` on its device (NCCL takes CUDA tensors only), and returned: no host synchronisation, for
      decisions made on the device (a skipped step) or read once (the figures of ``freeze_step="auto"``).

    A collective: every rank of ``group`` calls it at the same point, with values of the same kind (tensors of the
    same shape and dtype). Without an initialised process group, or in a group of one rank, nothing is communicated:
    ``[value]`` and ``value``."""
    if reduce is not None and reduce != "max":
        raise ValueError(f"agree: reduce must be None or 'max', got {reduce!r}")
    if group_size(group) == 1:
        return value if reduce == "max" else [value]
    if reduce == "max":
        dist.all_reduce(value, op=dist.ReduceOp.MAX, group=group)
        return value
    everyone: list[Any] = [None] * dist.get_world_size(group)
    dist.all_gather_object(everyone, value, group=group)
    return everyone


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
    if group_size(group) == 1:
        return backend
    requested = kernels.effective_backend(backend)
    everyone = agree((requested, kernels.available_backends()), group)
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
        "lightning_onebit: ranks have different kernel backends available %s; every rank runs the torch kernels "
        "(identical bits); install a C compiler on every node (and cupy on GPU nodes) for the fused ones",
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
    named_tensors: Sequence[tuple[str, torch.Tensor]],
    group: Optional[dist.ProcessGroup] = None,
    replica_sets: Optional[Sequence[Sequence[int]]] = None,
) -> None:
    """Raise ``RuntimeError`` on every rank if any tensor differs in any bit between ranks of ``group`` that hold
    replicas of each other.

    ``replica_sets``: lists of ranks of ``group`` whose tensors must be identical (e.g. under FSDP the ranks that hold
    the same shard on every node, each rank comparing its local shards); ``None`` (default): every rank of ``group``.
    Every rank is compared over all of ``group``, so every rank raises when one set diverged.

    Compares :func:`replica_checksums` with one :func:`agree` (``all_gather_object``) of ``len(named_tensors)``
    integers per rank; the message names the first tensors that differ and the ranks that disagree with the first rank
    of their set. A collective: every rank must call it with as many tensors, in the same order.
    """
    size = group_size(group)
    if size == 1:
        return
    names = [name for name, _ in named_tensors]
    everyone = torch.tensor(agree(replica_checksums([t for _, t in named_tensors]).tolist(), group),
                            dtype=torch.int64).view(size, len(names))
    sets = [list(ranks) for ranks in replica_sets] if replica_sets is not None else [list(range(size))]
    differs = torch.zeros(len(names), dtype=torch.bool)
    ranks, against = [], []
    for members in sets:
        first = everyone[members[0]]
        for r in members[1:]:
            mismatch = everyone[r] != first
            if bool(mismatch.any()):
                differs |= mismatch
                ranks.append(r)
                against.append(members[0])
    if ranks:
        bad = [names[i] for i in differs.nonzero().flatten().tolist()]
        reference = "rank 0" if replica_sets is None else f"the first rank of their replicas (ranks {against})"
        raise RuntimeError(
            f"replicas diverged: {len(bad)} tensor(s) differ between ranks (first: {bad[:5]}); ranks {sorted(ranks)} "
            f"differ from {reference}. Every rank must run the same kernels on the same inputs (see "
            "agree_kernel_backend)."
        )
