"""The outer step of local-steps training (DiLoCo family): :class:`OuterStep`, which keeps the outer parameters and
the outer optimizer, and every ``sync_every`` inner steps replaces each replica's parameters by the new outer ones.

One sync (:meth:`OuterStep.sync`):

1. pseudo-gradient ``delta = theta_outer - theta_local`` (the replica's parameters after its inner steps);
2. ``delta`` averaged over the replicas by the compressor (:mod:`~lightning_onebit.comm.outer`, error feedback
   per rank);
3. the outer optimizer applies the average to ``theta_outer``: ``torch.optim.SGD``, with Nesterov momentum
   (``"nesterov"``: DiLoCo's outer lr 0.7, momentum 0.9) or without momentum (``"sgd"``: ``theta_outer -= lr *
   average``, SparseLoCo's error-feedback-only form, whose memory is the error feedback);
4. every parameter of the replica is set to ``theta_outer``, bitwise the same on every rank.

**Sharded inside a replica.** A replica of ``L`` ranks (a node) holds ``L`` copies of the same parameters, so rank
``l`` of each replica takes shard ``l`` of the flat pseudo-gradient: it exchanges only that shard with rank ``l`` of
the other replicas (the replica group), keeps its error feedback and outer momentum only for it, steps only it, and
the new shards are all-gathered inside the replica (``shard_group``: the fast link). So the bytes that leave a
replica per sync are those of one full exchange, spread over its ``L`` ranks, and the error feedback and momentum
cost ``1/L`` of the parameters per rank. The outer parameters are kept whole on every rank (``N`` values): a
checkpoint and the validation of the outer model need no collective. When the average is all-gathered payloads
(:class:`~lightning_onebit.comm.outer.GatheredAverage`: 1-bit over two replicas, top-k) and the outer step is plain
SGD, the replica all-gathers those payloads instead of the new fp32 shards (:attr:`OuterStep.gathers_payloads`;
1/32 of the bytes for 1-bit over two replicas) and every rank decodes and steps every shard: the same bits.

Layout: the trainable parameters, per dtype in order of first appearance, flattened and zero-padded to a multiple of
``L x quantum`` (the compressor's :meth:`~lightning_onebit.comm.outer.OuterCompression.quantum`), cut into ``L``
equal shards, and each shard into buckets of at most ``bucket_numel`` values (a multiple of the quantum), each
bucket a piece list of the parameters it cuts.
"""

from __future__ import annotations

import copy
import dataclasses
from typing import Any, Optional, Sequence

import torch
import torch.distributed as dist

from lightning_onebit.comm.accounting import CommunicationCounters, count_ring_all_gather
from lightning_onebit.comm.groups import all_gather_async, group_rank, group_size, is_distributed, naming_the_group
from lightning_onebit.comm.outer import GatheredAverage, OuterBucket, OuterCompressor, PendingAverage

__all__ = ["OUTER_OPTIMIZERS", "OuterStep"]

#: The outer optimizers, by name.
OUTER_OPTIMIZERS = ("nesterov", "sgd")


@dataclasses.dataclass
class _Flat:
    """The parameters of one dtype: their outer values, flat and padded, and this rank's shard of them."""

    params: list[torch.Tensor]
    offsets: list[int]
    numel: int
    outer: torch.Tensor  # padded_numel values, whole on every rank
    shard: slice
    pseudo: torch.Tensor  # this rank's shard of the pseudo-gradient (a workspace)
    buckets: list[OuterBucket]
    #: per shard of the replica, its buckets with values in ``pseudo`` (the compressed gather decodes them in turn)
    shard_buckets: list[list[OuterBucket]]


class OuterStep:
    """Outer parameters, outer optimizer and the sync of local-steps training (see the module docstring).

    Args:
        params: the replica's trainable parameters (every rank of every replica in the same order and shapes); their
            values now are the first outer parameters (they must be the same on every rank).
        compressor: the average over the replica group (:func:`~lightning_onebit.comm.outer.make_outer_compressor`);
            rank ``l`` of each replica passes one over the group of the ranks ``l`` of every replica.
        optimizer: ``"nesterov"`` (default) or ``"sgd"`` (no momentum).
        lr: the outer learning rate, > 0. Default 0.7 (DiLoCo's).
        momentum: ``"nesterov"``'s momentum, in (0, 1). Default 0.9 (DiLoCo's).
        shard_group: the ranks of this replica (``None``: the replica is this rank alone). Rank ``l`` of it handles
            shard ``l``.
        bucket_numel: most values per bucket of the exchange. Default ``2**22``.
    """

    def __init__(
        self,
        params: Sequence[torch.Tensor],
        compressor: OuterCompressor,
        optimizer: str = "nesterov",
        lr: float = 0.7,
        momentum: float = 0.9,
        shard_group: Optional[dist.ProcessGroup] = None,
        bucket_numel: int = 2**22,
    ) -> None:
        if optimizer not in OUTER_OPTIMIZERS:
            raise ValueError(f"outer_optimizer must be one of {OUTER_OPTIMIZERS}, got {optimizer!r}")
        params = list(params)
        if not params:
            raise ValueError("the outer step needs at least one trainable parameter")
        self.compressor = compressor
        self.shard_group = shard_group
        # None is a replica of this rank alone (not WORLD)
        self.shards = 1 if shard_group is None else group_size(shard_group)
        self.shard_index = 0 if shard_group is None else group_rank(shard_group)
        #: the all-gathers of the new outer shards inside the replica (intra-node bytes)
        self.gather_counters = CommunicationCounters()
        quantum = compressor.config.quantum(compressor.replicas)
        bucket_numel = max(quantum, bucket_numel // quantum * quantum)
        by_dtype: dict[torch.dtype, list[torch.Tensor]] = {}
        for p in params:
            by_dtype.setdefault(p.dtype, []).append(p)
        self._flats = [self._flat(dtype, same, quantum, bucket_numel) for dtype, same in by_dtype.items()]
        shards = [f.outer[f.shard] for f in self._flats]
        if optimizer == "nesterov":
            self.optimizer = torch.optim.SGD(shards, lr=lr, momentum=momentum, nesterov=True)
        else:
            self.optimizer = torch.optim.SGD(shards, lr=lr)
        #: a replica of several ranks whose average is gathered payloads and whose outer step is plain SGD gathers the
        #: compressed payloads inside the replica and lets every rank decode and step every shard, instead of
        #: gathering the new fp32 shards (the same bits: every rank runs the same kernels on the same payloads)
        self.gathers_payloads = self.shards > 1 and isinstance(compressor, GatheredAverage) and optimizer == "sgd"
        self._payload_widths: Optional[list[int]] = None  # per shard, its gathered payloads' bytes (a fixed layout)
        self._pending: Optional[PendingAverage] = None  # the exchange start() began
        self.syncs = 0

    def _flat(self, dtype: torch.dtype, params: list[torch.Tensor], quantum: int, bucket_numel: int) -> _Flat:
        offsets, numel = [], 0
        for p in params:
            offsets.append(numel)
            numel += p.numel()
        unit = quantum * self.shards
        padded = -(-numel // unit) * unit
        outer = torch.zeros(padded, dtype=dtype, device=params[0].device)
        for p, offset in zip(params, offsets):
            outer[offset : offset + p.numel()].copy_(p.detach().reshape(-1))
        size = padded // self.shards
        lo = self.shard_index * size
        pseudo = torch.zeros(size, dtype=dtype, device=outer.device)
        shard_buckets = [self._buckets(dtype, shard, size, offsets, numel, pseudo, bucket_numel)
                         for shard in range(self.shards)]
        return _Flat(params, offsets, numel, outer, slice(lo, lo + size), pseudo, shard_buckets[self.shard_index],
                     shard_buckets)

    @staticmethod
    def _buckets(dtype: torch.dtype, shard: int, size: int, offsets: list[int], numel: int, pseudo: torch.Tensor,
                 bucket_numel: int) -> list[OuterBucket]:
        """Shard ``shard``'s buckets, their values in ``pseudo``: pieces cut at the parameters' boundaries."""
        lo = shard * size
        ends = sorted({min(max(o - lo, 0), size) for o in offsets + [numel]} | {0, size})
        buckets = []
        for index, start in enumerate(range(0, size, bucket_numel)):
            stop = min(start + bucket_numel, size)
            cuts = [start] + [e for e in ends if start < e < stop] + [stop]
            pieces = tuple(b - a for a, b in zip(cuts, cuts[1:]))
            real = min(max(numel - lo - start, 0), stop - start)
            buckets.append(OuterBucket((str(dtype), shard, index), pseudo[start:stop], pieces, real))
        return buckets

    # ------------------------------------------------------------------ the sync
    @property
    def params(self) -> list[torch.Tensor]:
        """The parameters the outer step keeps, in its order (by dtype, then as given)."""
        return [p for f in self._flats for p in f.params]

    @property
    def buckets(self) -> list[OuterBucket]:
        """This rank's buckets of the pseudo-gradient, in exchange order."""
        return [b for f in self._flats for b in f.buckets]

    def sync(self) -> None:
        """One outer step (a collective over the replica group, then the replica's ranks): after it every parameter
        holds the new outer value, the same bits on every rank. :meth:`start`, :meth:`finish`, then
        :meth:`copy_outer_to_params`."""
        self.start()
        self.finish()
        self.copy_outer_to_params()

    @property
    def in_flight(self) -> bool:
        """Whether an exchange was started and not finished."""
        return self._pending is not None

    def start(self) -> None:
        """Take the pseudo-gradient from the parameters now and start its exchange (the error feedback is updated and
        this rank's part sent; a collective): the parameters may change before :meth:`finish` (the overlap of
        streaming), the outer parameters not."""
        if self._pending is not None:
            raise RuntimeError("the outer step's exchange is in flight: finish() it before starting another")
        for f in self._flats:
            self._pseudo_gradient_into(f)
        self._check_finite()
        self._pending = self.compressor.start_average_(self.buckets)

    def finish(self) -> None:
        """Finish the exchange :meth:`start` began and apply the outer optimizer: the outer parameters are new, the
        same bits on every rank (a collective inside the replica); the parameters are left as they are."""
        pending, self._pending = self._pending, None
        if pending is None:
            raise RuntimeError("no outer exchange is in flight: start() one first")
        if self.gathers_payloads:
            self._finish_by_payloads(pending)
        else:
            self.compressor.finish_average_(pending)
            for shard, f in zip(self.optimizer.param_groups[0]["params"], self._flats):
                shard.grad = f.pseudo
            self.optimizer.step()
            for shard in self.optimizer.param_groups[0]["params"]:
                shard.grad = None
            self._gather_shards()
        self.syncs += 1

    def _check_finite(self) -> None:
        """Stop every rank, before anything is exchanged, when a rank's pseudo-gradient holds an inf or a NaN: a
        replica's inner steps diverged, and averaging would spread it to every replica and its error feedback. One
        flag, all-reduced (MAX) inside the replica and across replicas (a host synchronisation once per sync)."""
        flag = torch.zeros(1, device=self._flats[0].pseudo.device)
        for f in self._flats:
            if f.pseudo.numel():
                # min and max propagate inf and NaN: one read of the shard (isfinite() writes a mask as large as the
                # shard, ~30x slower on a CPU)
                flag = torch.maximum(flag, torch.stack(torch.aminmax(f.pseudo)).isfinite().logical_not().any()
                                     .float().reshape(1))
        for group, size in ((self.shard_group, self.shards), (self.compressor.group, self.compressor.replicas)):
            if size > 1 and is_distributed():
                with naming_the_group("all_reduce of the outer step's finiteness flag", group):
                    dist.all_reduce(flag, op=dist.ReduceOp.MAX, group=group)
        if flag.item():
            raise RuntimeError(
                f"outer step {self.syncs + 1}: the pseudo-gradient (outer minus local parameters) holds inf or NaN on "
                "at least one replica: its inner steps diverged. Nothing was exchanged or applied: the outer "
                "parameters, the outer optimizer and the error feedback are as after the last sync, and the "
                "checkpoints saved so far are intact. Lower the learning rate, clip the gradients "
                "(Trainer(gradient_clip_val=...)), or train with precision='16-mixed', whose loss scaler skips "
                "inf/NaN steps"
            )

    def _finish_by_payloads(self, pending: PendingAverage) -> None:
        """The payloads this rank gathered over the replica group are all-gathered inside the replica (one
        collective, each rank's padded to the largest), then every rank decodes every shard's mean in shard order and
        applies ``theta_outer -= lr * mean`` as ``torch.optim.SGD`` does (``add_(mean, alpha=-lr)``)."""
        compressor = self.compressor
        assert isinstance(compressor, GatheredAverage)
        mine = torch.cat(compressor.gathered_payloads(pending))
        if self._payload_widths is None:
            self._payload_widths = [[compressor.replicas * compressor.payload_bytes(b) for f in self._flats
                                     for b in f.shard_buckets[s]] for s in range(self.shards)]
        width = max(sum(sizes) for sizes in self._payload_widths)
        lr = self.optimizer.param_groups[0]["lr"]  # the optimizer's, as a loaded state_dict sets it
        padded = torch.zeros(width, dtype=torch.uint8, device=mine.device)
        padded[: mine.numel()].copy_(mine)
        everything = torch.empty(self.shards * width, dtype=torch.uint8, device=mine.device)
        with naming_the_group("all_gather of the outer payloads inside the replica", self.shard_group):
            all_gather_async(everything, padded, self.shard_group).wait()
        count_ring_all_gather(self.gather_counters, width, self.shards, intra_node=True)
        with torch.no_grad():
            for s, sizes in enumerate(self._payload_widths):
                parts = iter(everything[s * width : s * width + sum(sizes)].split(sizes))
                for f in self._flats:
                    lo = s * f.pseudo.numel()
                    for bucket in f.shard_buckets[s]:
                        compressor.decode_mean_(bucket, next(parts))
                        start = lo + bucket.values.storage_offset() - f.pseudo.storage_offset()
                        f.outer[start : start + bucket.values.numel()].add_(bucket.values, alpha=-lr)

    def _pseudo_gradient_into(self, f: _Flat) -> None:
        """``f.pseudo = outer - local`` on this rank's shard, one pass per parameter piece (the padding, outer and
        local both zero there: zero), the same bits as the whole shard's subtraction."""
        lo, hi = f.shard.start, f.shard.stop
        for p, offset in zip(f.params, f.offsets):
            a, b = max(offset, lo), min(offset + p.numel(), hi)
            if a < b:
                torch.sub(f.outer[a:b], p.detach().reshape(-1)[a - offset : b - offset], out=f.pseudo[a - lo : b - lo])
        if hi > f.numel:
            f.pseudo[max(f.numel - lo, 0) :].zero_()

    def _gather_shards(self) -> None:
        """Every rank of the replica gets every new outer shard (one all-gather per dtype, inside the replica)."""
        if self.shards == 1:
            return
        for f in self._flats:
            mine = f.outer[f.shard].clone()  # the gather's input must not alias its output
            with naming_the_group("all_gather of the outer shards inside the replica", self.shard_group):
                all_gather_async(f.outer, mine, self.shard_group).wait()
            # every peer of the gather is on this rank's node
            count_ring_all_gather(self.gather_counters, mine.numel() * mine.element_size(), self.shards,
                                  intra_node=True)

    def replace_params(self, params: Sequence[torch.Tensor]) -> None:
        """Hold ``params`` (in :attr:`params` order, the same shapes and dtypes) instead: a sharded parameter whose
        local tensor its FSDP group replaced (the same values). ``ValueError`` when they do not match."""
        params = list(params)
        held = self.params
        if len(params) != len(held) or any(a.shape != b.shape or a.dtype != b.dtype for a, b in zip(params, held)):
            raise ValueError("replace_params needs tensors of the held parameters' shapes and dtypes, in their order")
        values = iter(params)
        for f in self._flats:
            f.params = [next(values) for _ in f.params]

    def copy_outer_to_params(self) -> None:
        """Set every parameter to its outer value (no communication)."""
        with torch.no_grad():
            for f in self._flats:
                for p, offset in zip(f.params, f.offsets):
                    p.copy_(f.outer[offset : offset + p.numel()].view_as(p))

    def outer_values(self) -> dict[int, torch.Tensor]:
        """``id(parameter) -> its outer value`` (views of the outer parameters: clone to keep them)."""
        return {id(p): f.outer[offset : offset + p.numel()].view_as(p)
                for f in self._flats for p, offset in zip(f.params, f.offsets)}

    @property
    def communication(self) -> CommunicationCounters:
        """This rank's cumulative bytes of the outer syncs: the exchange over the replica group (inter-node) plus the
        all-gathers inside the replica (intra-node)."""
        return self.compressor.counters + self.gather_counters

    # ------------------------------------------------------------------ checkpoints
    def state_dict(self) -> dict[str, Any]:
        """This rank's outer optimizer state, error feedback and sync count, copied (the outer parameters are the
        model's checkpoint, the same on every rank). Not while an exchange is in flight: :meth:`finish` it first."""
        if self._pending is not None:
            raise RuntimeError("the outer step's exchange is in flight: finish() it before saving its state")
        return {"optimizer": copy.deepcopy(self.optimizer.state_dict()),
                "error_feedback": self.compressor.error_state_dict(),
                "syncs": self.syncs, "shards": (self.shard_index, self.shards),
                "numels": [f.numel for f in self._flats]}

    def per_parameter_state(self) -> dict[str, list[Optional[torch.Tensor]]]:
        """This rank's outer state per parameter, in :attr:`params` order, each a copy shaped like its parameter:
        ``"outer"`` (the outer values), ``"error_feedback"`` (this rank's, per bucket: zeros before a bucket's first
        exchange, which is what the exchange starts from) and ``"momentum"`` (Nesterov's buffer; ``None`` before the
        first outer step and without momentum). A checkpoint laid out by parameter loads at another layout (a model
        sharded over fewer ranks: :meth:`load_per_parameter_state`); the two-phase exchange's server error is laid
        out by bucket (:meth:`~lightning_onebit.comm.outer.OuterCompressor.server_errors`). For an outer step of one
        rank per replica (``shard_group=None``), whose buckets cover its parameters whole; nothing in flight."""
        self._check_per_parameter("save")
        out: dict[str, list[Optional[torch.Tensor]]] = {"outer": [], "error_feedback": [], "momentum": []}
        for f, shard in zip(self._flats, self.optimizer.param_groups[0]["params"]):
            error = torch.zeros_like(f.outer)
            for bucket in f.buckets:
                saved = self.compressor.error_feedback(bucket.key)
                if saved is not None:
                    error[self._bucket_slice(f, bucket)].copy_(saved.reshape(-1))
            momentum = self.optimizer.state.get(shard, {}).get("momentum_buffer")
            for p, offset in zip(f.params, f.offsets):
                piece = slice(offset, offset + p.numel())
                out["outer"].append(f.outer[piece].view_as(p).clone())
                out["error_feedback"].append(error[piece].view_as(p).clone())
                out["momentum"].append(None if momentum is None else momentum[piece].view_as(p).clone())
        return out

    def load_per_parameter_state(self, state: dict[str, Sequence[Optional[torch.Tensor]]]) -> None:
        """Restore :meth:`per_parameter_state` (saved at this layout or another): ``ValueError`` naming the parameter
        whose shape differs, nothing changed. Momentum is restored only where every parameter has one."""
        self._check_per_parameter("load")
        params = self.params
        for key in ("outer", "error_feedback", "momentum"):
            for i, (p, value) in enumerate(zip(params, state[key])):
                if value is not None and tuple(value.shape) != tuple(p.shape):
                    raise ValueError(f"outer state {key!r} of parameter {i}: saved with shape {tuple(value.shape)}, "
                                     f"the parameter here has {tuple(p.shape)}")
        values = iter(zip(state["outer"], state["error_feedback"], state["momentum"]))
        with torch.no_grad():
            for f, shard in zip(self._flats, self.optimizer.param_groups[0]["params"]):
                error = torch.zeros_like(f.outer)
                momentum: Optional[torch.Tensor] = torch.zeros_like(f.outer)
                for p, offset in zip(f.params, f.offsets):
                    outer, err, mom = next(values)
                    piece = slice(offset, offset + p.numel())
                    f.outer[piece].copy_(outer.reshape(-1))
                    error[piece].copy_(err.reshape(-1))
                    if mom is None or momentum is None:
                        momentum = None
                    else:
                        momentum[piece].copy_(mom.reshape(-1))
                for bucket in f.buckets:
                    self.compressor.set_error_feedback(bucket, error[self._bucket_slice(f, bucket)])
                if momentum is not None:
                    self.optimizer.state[shard]["momentum_buffer"] = momentum
                else:
                    self.optimizer.state.pop(shard, None)

    def _check_per_parameter(self, what: str) -> None:
        if self.shards != 1:
            raise RuntimeError(f"the outer state is laid out by parameter only with one rank per replica "
                               f"(shard_group=None); this rank holds shard {self.shard_index} of {self.shards}")
        if self._pending is not None:
            raise RuntimeError(f"the outer step's exchange is in flight: finish() it before you {what} its state")

    @staticmethod
    def _bucket_slice(f: _Flat, bucket: OuterBucket) -> slice:
        start = bucket.values.storage_offset() - f.pseudo.storage_offset()
        return slice(start, start + bucket.values.numel())

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Restore :meth:`state_dict`; ``ValueError`` naming what differs when it was saved for another layout."""
        if tuple(state["shards"]) != (self.shard_index, self.shards) or list(state["numels"]) != [
                f.numel for f in self._flats]:
            raise ValueError(
                f"the outer state was saved as shard {tuple(state['shards'])} of parameters of sizes {state['numels']}"
                f" and this rank holds shard {(self.shard_index, self.shards)} of sizes "
                f"{[f.numel for f in self._flats]}"
            )
        self.compressor.load_error_state_dict(state["error_feedback"], self.buckets)
        self.optimizer.load_state_dict(state["optimizer"])
        self.syncs = int(state["syncs"])

