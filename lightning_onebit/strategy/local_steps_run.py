"""What both local-steps strategies hold (``onebit_diloco`` on DDP, ``onebit_diloco_fsdp`` on FSDP2): their checked
settings (:class:`LocalStepsSettings`, the defaults in :data:`DEFAULTS`) and the part that runs the outer step
(:class:`OuterSync`): the inner-step count, the outer sync after every ``sync_every`` of them, the sync at the end
of fit, validation on the outer model and the bytes of the outer syncs. The strategies say which parameters (whole
ones under DDP, local shards under FSDP2) and over which groups; this part is the same for both."""

from __future__ import annotations

import dataclasses
from typing import Any, Callable, Optional, Sequence, Union

import torch
import torch.distributed as dist
from lightning.pytorch.utilities.rank_zero import rank_zero_info

from lightning_onebit._checks import check_bucket_cap_mb, check_integer, check_real
from lightning_onebit.comm.accounting import CommunicationCounters, count_ring_bytes
from lightning_onebit.comm.groups import broadcast_coalesced, is_distributed
from lightning_onebit.comm.outer_base import OuterCompression, OuterCompressor
from lightning_onebit.optim import CompressedOptimizer
from lightning_onebit.optim.outer_step import OUTER_OPTIMIZERS
from lightning_onebit.optim.streaming import StreamingOuterStep

__all__ = ["DEFAULTS", "OUTER_LR", "LocalStepsDefaults", "LocalStepsSettings", "OuterSync",
           "check_inner_optimizers", "persistent_buffers", "replica_layout"]


@dataclasses.dataclass(frozen=True)
class LocalStepsDefaults:
    """The strategies' defaults, in one place, chosen on the example trained from scratch and the byte-level language
    model (2 seeds each), the fine-tuning tasks kept aside to check them (``docs/guides/local-steps.md``: the runs).

    * ``outer_optimizer = "sgd"`` (:data:`OUTER_LR`): it beat DiLoCo's Nesterov (0.7, 0.9) in every pair measured (the
      example: 99.4-100% against 50-80%; the language model: a loss 0.13-0.44 lower); at ``outer_lr = 0.7``: the
      language model's loss over AdamW-DDP's with the 1-bit exchange every 8 steps, seeds 0-3, was +1.3/+2.3/+0.4/+1.1%
      at 0.7 against +2.5/+3.2/+2.0/+1.3% at 1 (the same bytes); on the tasks kept aside no run fell below AdamW-DDP.
    * ``sync_every = 4``, ``compressor = "onebit"``: 0.25 bits per parameter per step, 128x fewer bytes than
      AdamW-DDP. The language model's loss over AdamW-DDP's at ``outer_lr = 0.7``, seeds 0-3: +1.6/+0.6/+0.5/+0.3% at
      4 (mean +0.8%, every seed within 2%) against +1.3/+2.3/+0.4/+1.1% at 8 (mean +1.3%; 255x fewer bytes); at lr 1
      16 and 32 were worse still (+5.1 to +5.7%). The tasks kept aside at 4: within 0.22 point of AdamW-DDP or above
      it (2 seeds each). Top-k: worse in 5 of 6.
    """

    sync_every: int = 4
    compressor: str = "onebit"
    outer_optimizer: str = "sgd"
    outer_momentum: float = 0.9
    bucket_cap_mb: float = 16.0


#: ``outer_lr``'s default per outer optimizer: SGD applies 0.7 of the average (a damped step: the compressed average's
#: noise is damped with it, see :class:`LocalStepsDefaults`); Nesterov takes DiLoCo's 0.7.
OUTER_LR = {"sgd": 0.7, "nesterov": 0.7}
DEFAULTS = LocalStepsDefaults()


@dataclasses.dataclass(frozen=True)
class LocalStepsSettings:
    """The outer step's settings, checked (:meth:`checked`: a ``ValueError`` naming the fix, where they are given,
    before any collective). The strategies' docstrings say what each one means."""

    sync_every: int
    compression: OuterCompression
    fragments: int
    overlap_steps: int
    outer_optimizer: str
    outer_lr: float
    outer_momentum: float
    bucket_cap_mb: float

    @classmethod
    def checked(cls, sync_every: Any, compressor: Union[str, OuterCompression], fragments: Any, overlap_steps: Any,
                outer_optimizer: Any, outer_lr: Any, outer_momentum: Any, bucket_cap_mb: Any) -> "LocalStepsSettings":
        sync_every = check_integer(sync_every, "sync_every")
        compression = OuterCompression.of(compressor)
        fragments = check_integer(fragments, "fragments", at_most=sync_every,
                                  what=f"an integer in [1, sync_every = {sync_every}]")
        overlap_steps = check_integer(overlap_steps, "overlap_steps", at_least=0, at_most=sync_every - 1,
                                      what=f"an integer in [0, sync_every - 1 = {sync_every - 1}]")
        if outer_optimizer not in OUTER_OPTIMIZERS:
            raise ValueError(f"outer_optimizer must be one of {OUTER_OPTIMIZERS}, got {outer_optimizer!r}")
        outer_lr = OUTER_LR[outer_optimizer] if outer_lr is None else check_real(outer_lr, "outer_lr", above=0.0)
        outer_momentum = check_real(outer_momentum, "outer_momentum", above=0.0, below=1.0)
        bucket_cap_mb = check_bucket_cap_mb(bucket_cap_mb, "bucket_cap_mb")
        return cls(sync_every, compression, fragments, overlap_steps, outer_optimizer, outer_lr, outer_momentum,
                   bucket_cap_mb)

    def describe(self) -> str:
        """One line for the strategies' start-up log."""
        return (f"outer step every {self.sync_every} inner steps, compressor {self.compression.kind!r}, outer "
                f"{self.outer_optimizer} lr {self.outer_lr:g}; {self.fragments} fragment(s), "
                f"overlap_steps={self.overlap_steps}")


def replica_layout(world_size: int, per_replica: int, strategy: str) -> tuple[int, int]:
    """``(M replicas, L ranks per replica)`` of ``world_size`` ranks in replicas of ``per_replica``; ``ValueError``
    naming the fix (pure: before any collective) when they do not divide evenly or form one replica."""
    if world_size % per_replica:
        raise ValueError(
            f"ranks_per_node={per_replica} does not divide the {world_size} ranks into equal replicas: pass a "
            "ranks_per_node that divides the world size"
        )
    replicas = world_size // per_replica
    if replicas < 2:
        raise ValueError(
            f"{strategy} needs two replicas or more, but all {world_size} rank(s) form one replica, so there is "
            "nothing to synchronise: run more nodes (Trainer(num_nodes=M)), pass ranks_per_node=K to treat every "
            "K ranks as a replica, or use strategy='ddp'"
        )
    return replicas, per_replica


def check_inner_optimizers(optimizers: Sequence[Any], strategy: str) -> None:
    """``ValueError`` naming the fix (on every rank alike) when an inner optimizer is one of this package's compressed
    optimizers: they exchange 1-bit momenta across every rank at every step, which local steps exist to avoid."""
    compressed = [type(o).__name__ for o in optimizers if isinstance(getattr(o, "_optimizer", o), CompressedOptimizer)]
    if compressed:
        raise ValueError(
            f"strategy='{strategy}' steps the optimizer of configure_optimizers locally (the inner optimizer) and "
            f"communicates only in its outer step, but {compressed[0]} exchanges compressed momenta across all ranks "
            "at every step: return a torch optimizer (e.g. torch.optim.AdamW), or use strategy='onebit_adam' "
            "(or 'onebit_fsdp') for 1-bit Adam"
        )


def persistent_buffers(module: torch.nn.Module) -> list[torch.Tensor]:
    """``module``'s buffers that its state dict holds (e.g. BatchNorm statistics; not caches registered with
    ``persistent=False``, such as rotary tables), in ``buffers()`` order."""
    saved = {id(t) for t in module.state_dict(keep_vars=True).values()}
    return [b for b in module.buffers() if id(b) in saved]


class OuterSync:
    """The outer step of a local-steps strategy and its bookkeeping (see the module docstring).

    :meth:`build` at the start of every fit; then :meth:`after_optimizer_step` after every inner optimizer step,
    :meth:`swap_in_outer` / :meth:`swap_back` around validation, :meth:`sync_at_end_of_fit` and :meth:`release` at
    teardown. :attr:`outer_step` is ``None`` outside ``fit``.
    """

    def __init__(self, settings: LocalStepsSettings) -> None:
        self.settings = settings
        self.outer_step: Optional[StreamingOuterStep] = None
        #: inner optimizer steps of this fit (resumed runs: since the start of training)
        self.inner_steps = 0
        #: outer syncs run (every fit's)
        self.outer_syncs = 0
        self.last_sync_communication = CommunicationCounters()
        self._finished = CommunicationCounters()  # the outer counters of fits that ended
        self._buffer_counters = CommunicationCounters()  # the buffers' broadcasts at the syncs, every fit's
        self._stashed: Optional[list[torch.Tensor]] = None  # the local parameters while the outer ones validate
        #: the module's buffers (e.g. BatchNorm statistics), every rank's made rank 0's at every sync
        self.buffers: list[torch.Tensor] = []

    def build(self, params: Sequence[torch.Tensor], make_compressor: Callable[[], OuterCompressor], *,
              shard_group: Any = None, sizes: Optional[Sequence[int]] = None,
              buffers: Sequence[torch.Tensor] = ()) -> None:
        """The outer step over ``params`` (their values now are the first outer parameters), each fragment's
        compressor from ``make_compressor()``; ``sizes``: the parameters' sizes the fragments are cut by (default
        theirs; a sharded model passes the whole parameters' sizes, so that every layout cuts alike); ``buffers``:
        the module's buffers, which every rank takes from rank 0 at each sync of the first fragment (once per outer
        period) and at the end of fit."""
        s = self.settings
        self.outer_step = StreamingOuterStep.build(
            params, make_compressor, fragments=s.fragments, sync_every=s.sync_every, overlap_steps=s.overlap_steps,
            bucket_cap_mb=s.bucket_cap_mb, optimizer=s.outer_optimizer, lr=s.outer_lr, momentum=s.outer_momentum,
            shard_group=shard_group, sizes=sizes)
        self.outer_step.on_sync = self._count_sync
        self.inner_steps = 0
        self.buffers = list(buffers)

    def _count_sync(self, fragment: int, sent: CommunicationCounters) -> None:
        self.outer_syncs += 1
        self.last_sync_communication = sent

    def after_optimizer_step(self) -> None:
        """Count an inner step; sync the fragments due after it (a collective on those steps)."""
        if self.outer_step is not None:
            self.inner_steps += 1
            if 0 in self.outer_step.after_inner_step(self.inner_steps):
                self.sync_buffers()

    def sync_buffers(self) -> None:
        """Every rank takes rank 0's buffers (a collective over every rank: one broadcast per dtype), as DDP does at
        every forward: buffers are not parameters (no pseudo-gradient, no outer optimizer), and the replicas then
        hold the same bits; counted as a ring broadcast, ``(W - 1) / W`` of the bytes per rank, inter-node."""
        if not self.buffers or not is_distributed() or dist.get_world_size() == 1:
            return
        with torch.no_grad():
            broadcast_coalesced(self.buffers)
        world = dist.get_world_size()
        nbytes = sum(b.numel() * b.element_size() for b in self.buffers)
        count_ring_bytes(self._buffer_counters, nbytes * (world - 1) // world, world, dist.get_rank(), None)
        self._buffer_counters.collectives += 1
        self._buffer_counters.calls += 1

    @property
    def steps_since_sync(self) -> int:
        """Inner steps taken since the last outer sync (the position in the outer period)."""
        return self.inner_steps % self.settings.sync_every

    def sync(self) -> None:
        """Sync every fragment that took inner steps since its last sync now, unoverlapped (a collective)."""
        assert self.outer_step is not None
        self.outer_step.flush(self.inner_steps)
        self.sync_buffers()

    def sync_at_end_of_fit(self, strategy: str) -> None:
        """When the parameters are not the outer ones (inner steps since the last sync, or a rebase to come), one more
        sync, said once, so that the model ``fit`` leaves behind holds every step (a collective)."""
        if self.outer_step is not None and not self.outer_step.params_are_outer:
            rank_zero_info(f"{strategy}: outer step at the end of fit (inner steps since the last sync), so that the "
                           "model holds every step")
            self.sync()

    # ------------------------------------------------------------------ validation on the outer model
    def swap_in_outer(self) -> None:
        """Before validation: the newest outer values into the parameters (the exchanges in flight finished: the
        training does not change), the local ones kept aside."""
        outer_step = self.outer_step
        if outer_step is not None and self._stashed is None:
            outer_step.finish_in_flight()
            if not outer_step.params_are_outer:
                self._stashed = [p.detach().clone() for p in outer_step.params]
                outer_step.copy_outer_to_params()

    def swap_back(self) -> None:
        """After validation: the local parameters back."""
        if self._stashed is not None:
            assert self.outer_step is not None
            with torch.no_grad():
                for p, local in zip(self.outer_step.params, self._stashed):
                    p.copy_(local)
            self._stashed = None

    def local_values(self) -> list[torch.Tensor]:
        """Copies of the replica's own parameters (not the outer ones swapped in for validation), in
        :attr:`StreamingOuterStep.params` order."""
        assert self.outer_step is not None
        return self._stashed if self._stashed is not None else [p.detach().clone() for p in self.outer_step.params]

    # ------------------------------------------------------------------ bytes and teardown
    @property
    def outer_communication(self) -> CommunicationCounters:
        """This rank's cumulative bytes of the outer syncs, the buffers' broadcasts included (this ``fit``'s and
        earlier ones')."""
        return (self._finished + self._buffer_counters
                + (self.outer_step.communication if self.outer_step else CommunicationCounters()))

    def release(self) -> None:
        """At teardown: keep the counters, drop the outer step (its compressors hold the replica group)."""
        if self.outer_step is not None:
            self._finished = self._finished + self.outer_step.communication
            self.outer_step = None
            self.buffers = []


_SETTINGS = ("sync_every", "compression", "fragments", "overlap_steps", "outer_optimizer", "outer_lr", "outer_momentum",
             "bucket_cap_mb")
_STATE = ("outer_step", "inner_steps", "outer_syncs", "last_sync_communication", "steps_since_sync",
          "outer_communication")


def with_local_steps_attributes(cls: type) -> type:
    """Give a strategy class that holds a :class:`OuterSync` as ``self.outer_sync`` its settings and state as
    read-only attributes (``strategy.sync_every``, ``strategy.outer_step``, ``strategy.outer_communication``, ...),
    documented once here rather than copied into each strategy."""
    for name in _SETTINGS:
        setattr(cls, name, property(lambda self, n=name: getattr(self.outer_sync.settings, n),
                                    doc=f"The ``{name}`` this strategy was made with (checked)."))
    for name in _STATE:
        doc = getattr(getattr(OuterSync, name, None), "__doc__", None) or f"See :class:`OuterSync` ``{name}``."
        setattr(cls, name, property(lambda self, n=name: getattr(self.outer_sync, n), doc=doc))
    return cls
