"""Sharded parameters (FSDP2's ``DTensor`` shards) as the compressed optimizers see them: plain tensors over each
parameter's local shard.

A compressed optimizer keeps per-parameter state (momentum, variance, error feedback) for the coordinates this rank
holds, and averages momenta over the ranks that hold the *same* coordinates (the replicate group of a
``("replicate", "shard")`` mesh). Its algorithms are written for plain tensors, so each ``DTensor`` parameter is stood
in for by a plain tensor aliasing its local shard (``DTensor.to_local()``, the same storage: the optimizer's in-place
updates are the shard's). The stand-in is what the optimizer's param groups and state hold; its gradient is bound to
the ``DTensor`` gradient's local shard before every step (:meth:`ShardedParams.bind_gradients_`), so clipping or
editing either edits both.

Every sharded parameter must be sharded along dimension 0 (``Shard(0)``, what ``fully_shard`` makes) over one mesh: the
*shard group*. Per-tensor figures that need the whole tensor (1-bit LAMB's norms and maxima) are reduced over it
(:meth:`ShardedParams.reduce_figures`: one collective for a vector of them).
"""

from __future__ import annotations

import math
from typing import Any, Iterable, Optional, Sequence

import torch
import torch.distributed as dist

from lightning_onebit.comm.groups import group_size, is_distributed

try:  # torch >= 2.4 (the package requires 2.4+ for FSDP2; DDP users never reach a DTensor)
    from torch.distributed.tensor import DTensor, Shard
except ImportError:  # pragma: no cover - older torch
    DTensor, Shard = None, None  # type: ignore[assignment,misc]

__all__ = ["ShardedParams", "is_sharded"]


def is_sharded(tensor: Any) -> bool:
    """Whether ``tensor`` is a ``DTensor`` (a sharded parameter)."""
    return DTensor is not None and isinstance(tensor, DTensor)


class ShardedParams:
    """The ``DTensor`` parameters of one optimizer and their plain stand-ins (see the module docstring).

    Args:
        owner: the optimizer's class name, for messages.
    """

    def __init__(self, owner: str) -> None:
        self.owner = owner
        #: ``(stand-in, DTensor)`` per sharded parameter (empty when none is sharded).
        self.pairs: list[tuple[torch.Tensor, torch.Tensor]] = []
        #: Whether the optimizer's exchange group was checked against the shard group (:meth:`prepare_step_`).
        self.exchange_group_checked = False
        self._dtensor_of: dict[int, torch.Tensor] = {}  # id(stand-in) -> DTensor
        self._stand_in_of: dict[int, torch.Tensor] = {}  # id(DTensor) -> stand-in
        self.mesh: Optional[Any] = None  # the one mesh the parameters are sharded over

    def __bool__(self) -> bool:
        return bool(self.pairs)

    @property
    def shard_group(self) -> Optional[dist.ProcessGroup]:
        """The process group of the ranks that hold the other shards of the same parameters (``None`` when no
        parameter is sharded)."""
        return None if self.mesh is None else self.mesh.get_group()

    def localize(self, params: Iterable[torch.Tensor]) -> list[torch.Tensor]:
        """``params`` with every ``DTensor`` replaced by its stand-in (made once per ``DTensor``); raises
        ``ValueError`` for a placement other than ``Shard(0)`` or a second mesh."""
        out = []
        for p in params:
            if not is_sharded(p):
                out.append(p)
                continue
            stand_in = self._stand_in_of.get(id(p))
            if stand_in is None:
                self._check(p)
                with torch.no_grad():
                    stand_in = p.to_local().detach()
                stand_in.requires_grad_(p.requires_grad)
                self.pairs.append((stand_in, p))
                self._dtensor_of[id(stand_in)] = p
                self._stand_in_of[id(p)] = stand_in
            out.append(stand_in)
        return out

    def _check(self, p: torch.Tensor) -> None:
        placements = tuple(p.placements)
        if len(placements) != 1 or placements[0] != Shard(0):
            raise ValueError(
                f"{self.owner} takes DTensor parameters sharded along dimension 0 over a 1-D mesh (what FSDP2's "
                f"fully_shard makes with the shard mesh), got placements {placements} over a mesh of shape "
                f"{tuple(p.device_mesh.shape)}: shard the model with fully_shard(module, mesh=device_mesh['shard'])"
            )
        if self.mesh is None:
            self.mesh = p.device_mesh
        elif p.device_mesh != self.mesh:
            raise ValueError(
                f"{self.owner}'s DTensor parameters are sharded over different meshes ({self.mesh} and "
                f"{p.device_mesh}): shard every module with the same mesh (device_mesh['shard'])"
            )

    def dtensor_of(self, stand_in: torch.Tensor) -> Optional[torch.Tensor]:
        """The ``DTensor`` parameter a stand-in stands for (``None`` for an unsharded parameter)."""
        return self._dtensor_of.get(id(stand_in))

    def stand_in_of(self, param: torch.Tensor) -> torch.Tensor:
        """The tensor the optimizer holds for ``param`` (its stand-in if ``param`` is a sharded one, else ``param``)."""
        return self._stand_in_of.get(id(param), param)

    def local_part(self, param: torch.Tensor, whole: torch.Tensor) -> torch.Tensor:
        """This rank's part of ``whole``, a tensor shaped like the sharded ``param`` (e.g. a mask), cut as ``Shard(0)``
        cuts ``param`` (``torch.chunk`` along dimension 0, an empty part past the last chunk). No communication."""
        size, index = param.device_mesh.size(), param.device_mesh.get_local_rank()
        chunks = torch.chunk(whole, size, dim=0)
        if index < len(chunks):
            return chunks[index]
        return whole.narrow(0, whole.shape[0], 0)

    def localize_mask(self, param: torch.Tensor, mask: Optional[torch.Tensor]
                      ) -> tuple[torch.Tensor, Optional[torch.Tensor]]:
        """``(the tensor the optimizer holds for param, its mask)``: a sharded parameter's stand-in, with this rank's
        part of a mask of the whole parameter's shape (a mask of the local shard's shape is kept as it is)."""
        if not is_sharded(param):
            return param, mask
        if mask is not None and tuple(mask.shape) == tuple(param.shape):
            mask = self.local_part(param, mask)
        return self.stand_in_of(param), mask

    def whole_of(self, stand_in: torch.Tensor, local: torch.Tensor) -> torch.Tensor:
        """The whole tensor whose local parts (shaped like ``stand_in``, on every rank of the shard group) are
        ``local``: a collective over the shard group (every rank calls it, in the same order)."""
        owner = self.dtensor_of(stand_in)
        if owner is None:
            return local
        return DTensor.from_local(local, owner.device_mesh, owner.placements, run_check=False, shape=owner.shape,
                                  stride=owner.stride()).full_tensor()

    def prepare_step_(self, exchange_group: Optional[dist.ProcessGroup]) -> None:
        """Before a step: check once that the momenta are averaged over ``exchange_group`` correctly
        (:meth:`check_exchange_group`, before any collective), then bind the gradients (:meth:`bind_gradients_`)."""
        if not self.exchange_group_checked:
            self.check_exchange_group(exchange_group)
            self.exchange_group_checked = True
        self.bind_gradients_()

    def bind_gradients_(self) -> None:
        """Before a step: each stand-in's ``.grad`` becomes its ``DTensor``'s gradient's local shard (or ``None``), and
        its ``requires_grad`` follows the ``DTensor``'s (a model may freeze and unfreeze parameters). No copy, no
        host synchronisation. Re-aliases a stand-in whose ``DTensor`` moved its local shard to other storage."""
        for stand_in, p in self.pairs:
            with torch.no_grad():
                local = p.to_local()
                if local.data_ptr() != stand_in.data_ptr() or local.shape != stand_in.shape:
                    stand_in.set_(local.detach())
                if stand_in.requires_grad != p.requires_grad:
                    stand_in.requires_grad_(p.requires_grad)
                grad = p.grad
                stand_in.grad = None if grad is None else grad.to_local().detach()

    def follow_requires_grad_(self) -> None:
        """Each stand-in's ``requires_grad`` becomes its ``DTensor``'s (what :meth:`bind_gradients_` also does), for
        code that reads which parameters train before the step: the overlapped exchange, at the start of a backward
        pass. No communication."""
        for stand_in, p in self.pairs:
            if stand_in.requires_grad != p.requires_grad:
                stand_in.requires_grad_(p.requires_grad)

    def clear_gradients_(self, set_to_none: bool) -> None:
        """``zero_grad`` for the ``DTensor`` gradients (the stand-ins' are cleared by the optimizer itself)."""
        for _, p in self.pairs:
            if p.grad is None:
                continue
            if set_to_none:
                p.grad = None
            else:
                p.grad.to_local().zero_()

    def reduces_figures(self) -> bool:
        """Whether :meth:`reduce_figures` communicates: some parameter is sharded over a shard group of more than one
        rank (the same answer on every rank of the group)."""
        group = self.shard_group
        return group is not None and group_size(group) > 1

    def reduce_figures(self, maxima: Optional[torch.Tensor] = None, sums: Optional[torch.Tensor] = None
                       ) -> tuple[Optional[torch.Tensor], Optional[torch.Tensor]]:
        """Whole-tensor figures from this rank's figures of its shards: ``maxima`` become their largest value over the
        shard group (NaN if any rank's is; an empty shard contributes ``-inf``), ``sums`` their sum over the shard
        group, added in group-rank order (an empty shard contributes 0). Both tensors of any shape, laid out the same
        way on every rank of the group (one entry per tensor, in the same order: the ranks of a node hold different
        shards of the same tensors).

        ONE ``all_gather`` over the shard group of both, concatenated, in float64; the reduction is then local and
        the same ops on the same gathered values, so every rank of the group gets the same bits. Returns float64
        tensors of the given shapes (``None`` for ``None``). With no sharded parameter or a shard group of one rank
        (:meth:`reduces_figures` false) the tensors come back as they are, and nothing is communicated. A collective
        otherwise: every rank of the shard group calls it, with tensors of the same sizes."""
        if not self.reduces_figures():
            return maxima, sums
        parts = [t.reshape(-1).to(torch.float64) for t in (maxima, sums) if t is not None]
        if not parts or sum(t.numel() for t in parts) == 0:
            return maxima, sums
        flat = torch.cat(parts)
        group = self.shard_group
        gathered = [torch.empty_like(flat) for _ in range(dist.get_world_size(group))]
        dist.all_gather(gathered, flat, group=group)
        split = 0 if maxima is None else maxima.numel()
        out_max = out_sum = None
        if maxima is not None:
            out_max = gathered[0][:split]
            for other in gathered[1:]:
                out_max = torch.maximum(out_max, other[:split])  # propagates NaN, as torch's max of a tensor does
            out_max = out_max.reshape(maxima.shape)
        if sums is not None:
            out_sum = gathered[0][split:]
            for other in gathered[1:]:  # in rank order
                out_sum = out_sum + other[split:]
            out_sum = out_sum.reshape(sums.shape)
        return out_max, out_sum

    def reduce_tensor_figures(self, params: Sequence[torch.Tensor], maxima: Optional[torch.Tensor],
                              sums: Optional[torch.Tensor]) -> tuple[Optional[torch.Tensor], Optional[torch.Tensor]]:
        """:meth:`reduce_figures` of per-tensor figures (row ``k`` for ``params[k]``, stand-ins or plain tensors): a
        tensor that is not sharded is whole on every rank of the group and counts once (the group's first rank's
        figures; a small host-to-device copy of which rows those are, only when such a tensor is among them)."""
        whole = [self.dtensor_of(p) is None for p in params]
        if any(whole) and self.reduces_figures() and dist.get_rank(self.shard_group) != 0:
            keep = torch.tensor([not w for w in whole], device=params[0].device)
            if maxima is not None:
                maxima = torch.where(keep, maxima, -math.inf)
            if sums is not None:
                sums = torch.where(keep.reshape(-1, *([1] * (sums.dim() - 1))), sums, 0.0)
        return self.reduce_figures(maxima, sums)

    def check_exchange_group(self, group: Optional[dist.ProcessGroup]) -> None:
        """Raise ``ValueError`` (before any collective) unless ``group``, which the momenta are averaged over, holds
        this rank and no other rank of its shard group: it must pair this rank with the ranks that hold the same
        shard (the replicate dimension of the mesh)."""
        if not self.pairs or not is_distributed():
            return
        shard_ranks = set(dist.get_process_group_ranks(self.shard_group))
        exchange_ranks = set(dist.get_process_group_ranks(group if group is not None else dist.group.WORLD))
        shared = sorted(shard_ranks & exchange_ranks)
        if shared != [dist.get_rank()]:
            raise ValueError(
                f"{self.owner}'s parameters are sharded (DTensor) over ranks {sorted(shard_ranks)}, and its momenta "
                f"would be averaged over ranks {sorted(exchange_ranks)}, which hold "
                f"{'other shards' if len(shared) > 1 else 'not this rank'}: average them over the ranks that hold the "
                "same shard, the replicate dimension of the mesh (process_group=device_mesh['replicate'].get_group()), "
                "or train with strategy='onebit_fsdp', which sets it"
            )
