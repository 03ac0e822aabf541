"""The parts every compressor of the outer pseudo-gradient shares (:mod:`~lightning_onebit.comm.outer` has the
compressors): how to compress (:class:`OuterCompression`, checked where it is given), a bucket of the pseudo-gradient
(:class:`OuterBucket`), and :class:`OuterCompressor`: the average over the replica group, started and finished apart
(:class:`PendingAverage`) so that local steps can overlap the exchange, with this rank's error feedback per bucket
and its byte counters.
"""

from __future__ import annotations

import dataclasses
from typing import Any, Hashable, NamedTuple, Optional, Sequence

import torch
import torch.distributed as dist

from lightning_onebit._checks import check_integer, check_real
from lightning_onebit.comm.accounting import CommunicationCounters, ring_allreduce_bytes
from lightning_onebit.comm.groups import group_size
from lightning_onebit.comm.topk import MAX_CHUNK

__all__ = ["OUTER_COMPRESSIONS", "OuterBucket", "OuterCompression", "OuterCompressor", "PendingAverage"]

#: The compressions of the outer pseudo-gradient, by name.
OUTER_COMPRESSIONS = ("none", "bf16", "onebit", "topk")


@dataclasses.dataclass(frozen=True)
class OuterCompression:
    """How the outer pseudo-gradient is compressed (see the module docstring); checked when made.

    Attributes:
        kind: ``"none"``, ``"bf16"``, ``"onebit"`` or ``"topk"``.
        chunk: ``"topk"``: values per chunk, 2 to 32,768 (indices are int16). Default 4096.
        keep: ``"topk"``: values kept per chunk, 1 to ``chunk``. Default 64 (1.56%, SparseLoCo's at 72B).
        error_decay: the error feedback is multiplied by it before the next pseudo-gradient is added, in (0, 1].
            Default 1 (classic error feedback: nothing is forgotten). Not for ``"none"``, which keeps none.
    """

    kind: str = "onebit"
    chunk: int = 4096
    keep: int = 64
    error_decay: float = 1.0

    def __post_init__(self) -> None:
        if self.kind not in OUTER_COMPRESSIONS:
            raise ValueError(f"compressor must be one of {OUTER_COMPRESSIONS}, got {self.kind!r}")
        check_integer(self.chunk, "OuterCompression chunk", at_least=2, at_most=MAX_CHUNK)
        check_integer(self.keep, "OuterCompression keep", at_most=self.chunk,
                      what=f"an integer in [1, chunk = {self.chunk}]")
        check_real(self.error_decay, "OuterCompression error_decay", above=0.0, at_most=1.0)
        if self.kind == "none" and self.error_decay != 1.0:
            raise ValueError("compressor 'none' keeps no error feedback, so error_decay does not apply: leave it at 1")

    @classmethod
    def of(cls, value: Any) -> "OuterCompression":
        """``value`` if it is one, else ``OuterCompression(kind=value)`` (a name of :data:`OUTER_COMPRESSIONS`)."""
        if isinstance(value, cls):
            return value
        if not isinstance(value, str):
            raise ValueError(f"compressor must be one of {OUTER_COMPRESSIONS} or an OuterCompression, got {value!r}")
        return cls(kind=value)

    def quantum(self, replicas: int) -> int:
        """Every bucket's length must be a multiple of this (1-bit: ``8 M``, so its layout adds no padding; top-k:
        the chunk)."""
        return {"onebit": 8 * replicas, "topk": self.chunk}.get(self.kind, 1)


class OuterBucket(NamedTuple):
    """One bucket of the pseudo-gradient: ``key`` names its error feedback across calls (the same on every rank of
    the replica group), ``values`` (1-D, contiguous) is averaged in place, ``pieces`` are the element counts of the
    tensors (or parts of tensors) it holds, in order, summing to its length (the 1-bit exchange keeps a scale per
    piece), and ``real`` the leading elements that are not padding (padding enters as zeros and leaves as zeros)."""

    key: Hashable
    values: torch.Tensor
    pieces: tuple[int, ...]
    real: int


@dataclasses.dataclass
class PendingAverage:
    """An average :meth:`OuterCompressor.start_average_` launched and :meth:`OuterCompressor.finish_average_` has not
    finished: its buckets (their values must not change in between) and what the compressor keeps in flight."""

    buckets: list[OuterBucket]
    in_flight: list[Any] = dataclasses.field(default_factory=list)


class OuterCompressor:
    """The compressed average over ``group`` (the replica group; ``None``: WORLD), with this rank's error feedback
    per bucket and its byte counters. Made by :func:`~lightning_onebit.comm.outer.make_outer_compressor`.

    :meth:`average_` is :meth:`start_average_` then :meth:`finish_average_`. Between the two, this rank's part is
    computed and sent (asynchronous collectives, error feedback already updated) and the caller may compute: local
    steps overlap the exchange so. Every rank of the group starts and finishes its averages in the same order.
    """

    def __init__(self, config: OuterCompression, group: Optional[dist.ProcessGroup] = None) -> None:
        self.config = config
        self.group = group
        self.counters = CommunicationCounters()
        self._errors: dict[Hashable, torch.Tensor] = {}

    @property
    def replicas(self) -> int:
        """``M``, the ranks of the replica group."""
        return group_size(self.group)

    def average_(self, buckets: Sequence[OuterBucket]) -> None:
        """Replace every bucket's values by the compressed average over the replica group (a collective: every rank
        of the group passes buckets of the same keys and sizes in the same order). A subclass overrides this one (an
        exchange that cannot overlap) or :meth:`start_average_` and :meth:`finish_average_`."""
        if type(self).finish_average_ is OuterCompressor.finish_average_:
            raise NotImplementedError(f"{type(self).__name__} overrides neither average_ nor finish_average_")
        self.finish_average_(self.start_average_(buckets))

    def start_average_(self, buckets: Sequence[OuterBucket]) -> PendingAverage:
        """Start :meth:`average_`: encode what this rank sends (its error feedback updated) and launch the first
        collective; the buckets' values must not change until :meth:`finish_average_`. By default nothing starts
        here and :meth:`finish_average_` runs :meth:`average_` whole."""
        return PendingAverage(list(buckets))

    def finish_average_(self, pending: PendingAverage) -> None:
        """Wait for ``pending`` (and run what is left of its exchange) and write the averages into its buckets."""
        self.average_(pending.buckets)

    def bytes_per_call(self, bucket: OuterBucket) -> int:
        """Bytes this rank sends (and receives) to average ``bucket`` once (the ring model; 0 with one replica)."""
        raise NotImplementedError

    # ------------------------------------------------------------------ error feedback
    def error_feedback(self, key: Hashable) -> Optional[torch.Tensor]:
        """This rank's error feedback of bucket ``key`` (``None`` before its first call, or without error feedback)."""
        return self._errors.get(key)

    def set_error_feedback(self, bucket: OuterBucket, values: torch.Tensor) -> None:
        """Set this rank's error feedback of ``bucket`` to ``values`` (its size; copied): what a checkpoint laid out
        by parameter restores (:meth:`~lightning_onebit.optim.outer_step.OuterStep.load_per_parameter_state`)."""
        self._errors[bucket.key] = values.detach().to(bucket.values).reshape(bucket.values.shape).clone()

    def server_errors(self) -> dict[Hashable, torch.Tensor]:
        """Error feedback other than the per-bucket one of :meth:`error_feedback` (the two-phase 1-bit exchange's
        server error), by bucket key, copied; laid out by this run's buckets and replicas. Empty by default."""
        return {}

    def load_server_errors(self, saved: dict[Hashable, torch.Tensor], buckets: Sequence[OuterBucket]) -> None:
        """Restore :meth:`server_errors` for ``buckets``; ``ValueError`` (nothing changed) unless they fit."""
        if saved:
            raise ValueError(f"{type(self).__name__} keeps no server error, but {len(saved)} bucket(s) were saved")

    def _accumulate(self, bucket: OuterBucket) -> torch.Tensor:
        """The error feedback of ``bucket`` now holding ``error_decay * e + values``: what is to be compressed."""
        error = self._errors.get(bucket.key)
        if error is None or error.shape != bucket.values.shape or error.dtype != bucket.values.dtype:
            error = self._errors[bucket.key] = torch.zeros_like(bucket.values)
        elif self.config.error_decay != 1.0:
            error.mul_(self.config.error_decay)
        return error.add_(bucket.values)

    def error_state_dict(self) -> dict[str, Any]:
        """This rank's error feedback, for its per-rank checkpoint."""
        return {"kind": self.config.kind, "replicas": self.replicas,
                "buckets": {key: e.detach().clone() for key, e in self._errors.items()}}

    def load_error_state_dict(self, state: dict[str, Any], buckets: Sequence[OuterBucket]) -> None:
        """Restore :meth:`error_state_dict` for ``buckets`` (the layout in use now); ``ValueError`` naming the reason,
        with nothing changed, unless it fits exactly."""
        reason = self._mismatch(state, buckets)
        if reason is not None:
            raise ValueError(reason)
        self._errors = {b.key: state["buckets"][b.key].to(b.values).clone() for b in buckets
                        if b.key in state["buckets"]}

    def _saved_by_another(self, state: dict[str, Any]) -> Optional[str]:
        if state.get("kind") != self.config.kind or state.get("replicas") != self.replicas:
            return (f"the error feedback was saved for compressor {state.get('kind')!r} over {state.get('replicas')} "
                    f"replicas and this run uses {self.config.kind!r} over {self.replicas}")
        return None

    def _mismatch(self, state: dict[str, Any], buckets: Sequence[OuterBucket]) -> Optional[str]:
        if (reason := self._saved_by_another(state)) is not None:
            return reason
        saved = state.get("buckets", {})
        for b in buckets:
            if b.key in saved and tuple(saved[b.key].shape) != tuple(b.values.shape):
                return f"bucket {b.key!r}: the saved error feedback has {saved[b.key].numel()} elements, not " \
                       f"{b.values.numel()} (the model or the bucket size changed?)"
        unknown = set(saved) - {b.key for b in buckets}
        return f"saved buckets {sorted(map(str, unknown))} do not exist in this run" if unknown else None

    def _count(self, sent: int, numel: int) -> None:
        """Count one call of ``sent`` bytes averaging ``numel`` values (every peer is on another node)."""
        self.counters.bytes_sent += sent
        self.counters.bytes_received += sent
        self.counters.bytes_sent_inter_node += sent
        self.counters.bytes_fp32_equivalent += ring_allreduce_bytes(numel, 4, self.replicas)
        self.counters.calls += 1


