"""The compressed average of the outer step's pseudo-gradient over the *replica group* (DiLoCo family): one rank per
replica, each holding the same part of the pseudo-gradient of its replica.

:class:`OuterCompression` says how (checked where it is given, before any collective); :func:`make_outer_compressor`
makes the compressor that does it over a process group:

* ``"none"`` (:class:`DenseAverage`): an fp32 ``all_reduce`` (sum, then division by ``M``): plain DiLoCo, the honest
  baseline; no error feedback, nothing is lost but the sum's rounding.
* ``"bf16"`` (:class:`DenseAverage`): the pseudo-gradient plus its error feedback rounded to bf16, divided by ``M``,
  summed by a bf16 ``all_reduce`` (half the bytes); the rounding residual (exact in fp32) stays as error feedback.
* ``"onebit"``: 1-bit sign + scale (one scale per tensor piece of a bucket, ``||y_s|| / sqrt(len_s)``), ~32x fewer
  bytes than fp32, in one of two exchanges, whichever sends fewer bytes for the number of replicas ``M``:

  - ``M = 2`` (:class:`OnebitGatherAverage`): each rank compresses its bucket once (error feedback per rank) and the
    payloads are all-gathered (:class:`GatheredAverage`): as many bytes as the two-phase exchange at ``M = 2``, but
    the mean is not compressed a second time (on the byte-level language model of ``benchmarks.lm_local_steps``, a
    lower loss in 9 of 12 same-seed runs, by 0.48% on average).
  - ``M > 2`` (:class:`OnebitAverage`): the two-phase exchange (:func:`~lightning_onebit.comm.
    compressed_allreduce_buckets_`: workers compress, each rank serves the mean of one chunk and compresses it
    again), worker and server error feedback per rank; an all-gather would send ``M / 2`` times its bytes.
* ``"topk"`` (:class:`TopkAverage`): SparseLoCo's chunked top-k with 2-bit values (:mod:`~lightning_onebit.comm.topk`),
  all-gathered (:class:`GatheredAverage`: every rank keeps a different set); the residual stays as error feedback.

Error feedback (all but ``"none"``): per bucket and rank, ``e <- error_decay * e + x`` is compressed, and ``e`` keeps
what was not sent; so ``sent + e_new == x + error_decay * e_old`` (exactly for ``"bf16"`` and off the kept
elements for ``"topk"``; elsewhere to the fp32 rounding of one subtraction).

Bytes are counted per rank in :attr:`OuterCompressor.counters` on the ring model of
:mod:`~lightning_onebit.comm.accounting` (inter-node bytes): a ring ``all_reduce`` sends ``2 (M-1)/M`` of the buffer,
a ring ``all_gather`` ``(M-1)`` payloads, the two-phase exchange its layout's
:meth:`~lightning_onebit.comm.BucketLayout.bytes_per_call`; :meth:`OuterCompressor.bytes_per_call` per bucket.
"""

from __future__ import annotations

import itertools
from typing import Any, Hashable, Optional, Sequence

import torch
import torch.distributed as dist

from lightning_onebit.comm.accounting import ring_allreduce_bytes
from lightning_onebit.comm.agreement import agree_kernel_backend
from lightning_onebit.comm.exchange import check_buckets, finish_exchanges_, start_exchange_
from lightning_onebit.comm.groups import all_gather_async, group_size, naming_the_group
from lightning_onebit.comm.layout import BucketLayout
from lightning_onebit.comm.outer_base import OUTER_COMPRESSIONS, OuterBucket, OuterCompression, OuterCompressor
from lightning_onebit.comm.outer_base import PendingAverage
from lightning_onebit.comm.state import CompressedAllreduceState
from lightning_onebit.comm.topk import topk_decode_add_, topk_encode, topk_payload_bytes
from lightning_onebit.kernels import Segments, Workspace, add_mean_of_signs_, compress_in_place

__all__ = [
    "OUTER_COMPRESSIONS",
    "DenseAverage",
    "GatheredAverage",
    "OnebitAverage",
    "OnebitGatherAverage",
    "OuterBucket",
    "OuterCompression",
    "OuterCompressor",
    "PendingAverage",
    "TopkAverage",
    "make_outer_compressor",
]

class DenseAverage(OuterCompressor):
    """``"none"``: fp32 (the values' dtype) ``all_reduce``; ``"bf16"``: bf16 ``all_reduce`` with error feedback.
    One ``all_reduce`` per bucket, all launched before the first is waited for."""

    @property
    def _wire_dtype(self) -> Optional[torch.dtype]:
        return torch.bfloat16 if self.config.kind == "bf16" else None

    def bytes_per_call(self, bucket: OuterBucket) -> int:
        size = 2 if self._wire_dtype is not None else bucket.values.element_size()
        return ring_allreduce_bytes(bucket.values.numel(), size, self.replicas)

    def start_average_(self, buckets: Sequence[OuterBucket]) -> PendingAverage:
        pending = PendingAverage(list(buckets))
        replicas = self.replicas
        if replicas == 1:
            return pending
        for bucket in pending.buckets:
            if self._wire_dtype is None:
                wire = bucket.values
            else:
                accumulated = self._accumulate(bucket)
                wire = accumulated.to(self._wire_dtype)
                accumulated.sub_(wire)  # the rounding residual: exact in the values' dtype
                wire.div_(replicas)  # before the sum, as torch's bf16_compress_hook: no overflow in bf16
            with naming_the_group("outer all_reduce of the pseudo-gradient", self.group):
                work = dist.all_reduce(wire, op=dist.ReduceOp.SUM, group=self.group, async_op=True)
            pending.in_flight.append((wire, work))
            self._count(self.bytes_per_call(bucket), bucket.values.numel())
            self.counters.collectives += 1
        return pending

    def finish_average_(self, pending: PendingAverage) -> None:
        for bucket, (wire, work) in zip(pending.buckets, pending.in_flight):
            with naming_the_group("outer all_reduce of the pseudo-gradient", self.group):
                work.wait()
            if self._wire_dtype is None:
                bucket.values.div_(self.replicas)  # gloo has no AVG: sum, then divide
            else:
                bucket.values.copy_(wire)


class OnebitAverage(OuterCompressor):
    """``"onebit"``: the error-compensated 1-bit exchange of each bucket (flat, over the replica group), its error
    feedback in a :class:`~lightning_onebit.comm.CompressedAllreduceState` (worker and server error)."""

    def __init__(self, config: OuterCompression, group: Optional[dist.ProcessGroup] = None,
                 backend: str = "auto") -> None:
        super().__init__(config, group)
        self.state = CompressedAllreduceState(process_group=group, backend=backend)
        self.counters = self.state.counters

    @staticmethod
    def _layout(bucket: OuterBucket, replicas: int) -> BucketLayout:
        return BucketLayout.build(bucket.pieces, replicas)

    def bytes_per_call(self, bucket: OuterBucket) -> int:
        return self._layout(bucket, self.replicas).bytes_per_call()

    def start_average_(self, buckets: Sequence[OuterBucket]) -> PendingAverage:
        pending = PendingAverage(list(buckets))
        replicas = self.replicas
        if replicas == 1:
            return pending
        triples = []
        for bucket in pending.buckets:
            layout = self._layout(bucket, replicas)
            if layout.padded_numel != bucket.values.numel():
                raise ValueError(f"bucket {bucket.key!r}: {bucket.values.numel()} values is not a multiple of "
                                 f"8 x {replicas} replicas (OuterCompression.quantum)")
            if self.config.error_decay != 1.0:
                self.state.buffers(bucket.key, layout, bucket.values).worker_error.mul_(self.config.error_decay)
            triples.append((bucket.key, bucket.values, layout))
        check_buckets(self.state, triples)  # on every rank before the first collective
        # the first collective (all_to_all) of each bucket is in flight; the server phase waits for finish_average_
        pending.in_flight = [start_exchange_(self.state, *triple, checked=True) for triple in triples]
        return pending

    def finish_average_(self, pending: PendingAverage) -> None:
        finish_exchanges_(self.state, pending.in_flight)

    def error_feedback(self, key: Hashable) -> Optional[torch.Tensor]:
        """The worker error of bucket ``key`` (the server error is the state's)."""
        buffers = self.state.existing_buffers(key)
        return None if buffers is None else buffers.worker_error

    def set_error_feedback(self, bucket: OuterBucket, values: torch.Tensor) -> None:
        buffers = self.state.buffers(bucket.key, self._layout(bucket, self.replicas), bucket.values)
        buffers.worker_error.copy_(values.reshape(buffers.worker_error.shape))

    def server_errors(self) -> dict[Hashable, torch.Tensor]:
        return {key: buffers.server_error.detach().clone() for key, buffers in self.state.bucket_buffers().items()}

    def load_server_errors(self, saved: dict[Hashable, torch.Tensor], buckets: Sequence[OuterBucket]) -> None:
        unknown = set(saved) - {b.key for b in buckets}
        if unknown:
            raise ValueError(f"saved server errors of buckets {sorted(map(str, unknown))} that this run does not have")
        layouts = {b.key: self._layout(b, self.replicas) for b in buckets if b.key in saved}
        for key, layout in layouts.items():
            if saved[key].numel() != layout.chunk_numel:
                raise ValueError(f"bucket {key!r}: the saved server error has {saved[key].numel()} elements, not "
                                 f"{layout.chunk_numel}")
        for b in buckets:
            if b.key in layouts:
                self.state.buffers(b.key, layouts[b.key], b.values).server_error.copy_(saved[b.key])

    def error_state_dict(self) -> dict[str, Any]:
        return {"kind": self.config.kind, "replicas": self.replicas, "exchange": self.state.error_feedback_state_dict()}

    def load_error_state_dict(self, state: dict[str, Any], buckets: Sequence[OuterBucket]) -> None:
        saved = state.get("exchange")
        reason = self._saved_by_another(state) or (None if isinstance(saved, dict) else (
            "the error feedback was saved by another 1-bit exchange (the all-gather of two replicas) than this run's "
            "two-phase exchange"))
        if reason:
            raise ValueError(reason)
        present = [b for b in buckets if b.key in saved["buckets"]]
        layouts = {b.key: self._layout(b, self.replicas) for b in present}
        self.state.load_error_feedback_state_dict(saved, layouts, {b.key: b.values for b in present})


class GatheredAverage(OuterCompressor):
    """An average whose every rank encodes each bucket (with its error feedback) into a byte payload of a fixed size,
    all-gathers the payloads (:meth:`start_average_`, then :meth:`gathered_payloads`: one ``all_gather`` per bucket,
    all launched before the first is waited for) and decodes them in rank order into the mean (:meth:`decode_mean_`):
    the same bits on every rank, and on any rank that holds the gathered payloads. Subclasses give
    :meth:`payload_bytes`, :meth:`_encode` and :meth:`_decode_mean`."""

    #: what the collectives are called in an error message
    WHAT = "payloads"

    def payload_bytes(self, bucket: OuterBucket) -> int:
        """Bytes of one rank's payload of ``bucket``."""
        raise NotImplementedError

    def _encode(self, bucket: OuterBucket, payload: torch.Tensor) -> None:
        """Write ``bucket``'s payload, and leave what was not sent in its error feedback."""
        raise NotImplementedError

    def _decode_mean(self, bucket: OuterBucket, payloads: list[torch.Tensor]) -> None:
        """Set ``bucket.values`` to the mean of the ranks' payloads, decoded in rank order."""
        raise NotImplementedError

    def bytes_per_call(self, bucket: OuterBucket) -> int:
        return (self.replicas - 1) * self.payload_bytes(bucket)

    def start_average_(self, buckets: Sequence[OuterBucket]) -> PendingAverage:
        """Encode every bucket and launch the all-gathers of the payloads over the replica group (a collective)."""
        pending = PendingAverage(list(buckets))
        if self.replicas == 1:
            return pending
        for bucket in pending.buckets:
            size = self.payload_bytes(bucket)
            payload = torch.zeros(size, dtype=torch.uint8, device=bucket.values.device)
            self._encode(bucket, payload)
            gathered = torch.empty(self.replicas * size, dtype=torch.uint8, device=bucket.values.device)
            with naming_the_group(f"outer all_gather of the {self.WHAT}", self.group):
                work = all_gather_async(gathered, payload, self.group)
            pending.in_flight.append((gathered, work))
            self._count(self.bytes_per_call(bucket), bucket.values.numel())
            self.counters.collectives += 1
        return pending

    def gathered_payloads(self, pending: PendingAverage) -> list[torch.Tensor]:
        """Wait for ``pending``'s all-gathers; per bucket, the ``M`` payloads in rank order, one byte tensor."""
        for _, work in pending.in_flight:
            with naming_the_group(f"outer all_gather of the {self.WHAT}", self.group):
                work.wait()
        return [gathered for gathered, _ in pending.in_flight]

    def decode_mean_(self, bucket: OuterBucket, gathered: torch.Tensor) -> None:
        """Set ``bucket.values`` to the mean of the payloads :meth:`gathered_payloads` returned for a bucket of its keys
        and sizes (no communication: any rank holding ``gathered`` gets the same bits)."""
        size = self.payload_bytes(bucket)
        self._decode_mean(bucket, list(gathered.split(size)))

    def finish_average_(self, pending: PendingAverage) -> None:
        if self.replicas == 1:
            return
        for bucket, gathered in zip(pending.buckets, self.gathered_payloads(pending)):
            self.decode_mean_(bucket, gathered)


class OnebitGatherAverage(GatheredAverage):
    """``"onebit"`` over two replicas: each rank compresses ``e <- error_decay * e + x`` of every bucket once (1-bit,
    one scale per piece; ``e`` keeps the error, so ``sent + e_new == x + error_decay * e_old`` to one rounding); the
    payload is the float32 scales, then the sign bits, to 4 bytes (:class:`GatheredAverage` exchanges it)."""

    #: the exchange's name in the error feedback state (a checkpoint of the two-phase exchange is refused)
    EXCHANGE = "gather"
    WHAT = "1-bit payloads"

    def __init__(self, config: OuterCompression, group: Optional[dist.ProcessGroup] = None,
                 backend: str = "auto") -> None:
        super().__init__(config, group)
        self.backend = backend
        self._workspace = Workspace()
        self._segments: dict[tuple[int, ...], Segments] = {}

    def _segments_of(self, bucket: OuterBucket) -> Segments:
        """The scale segments: the bucket's pieces, cut at the padding too (padding is a segment of scale 0)."""
        key = (*bucket.pieces, bucket.real)
        if key not in self._segments:
            self._segments[key] = Segments(sorted({0, bucket.real, *itertools.accumulate(bucket.pieces)}))
        return self._segments[key]

    def payload_bytes(self, bucket: OuterBucket) -> int:
        raw = 4 * len(self._segments_of(bucket)) + bucket.values.numel() // 8
        return -(-raw // 4) * 4

    def _encode(self, bucket: OuterBucket, payload: torch.Tensor) -> None:
        numel, segments = bucket.values.numel(), self._segments_of(bucket)
        if numel % 8:
            raise ValueError(f"bucket {bucket.key!r}: {numel} values is not a multiple of 8 (OuterCompression.quantum)")
        scale_bytes = 4 * len(segments)
        scales, _ = compress_in_place(self._accumulate(bucket), segments, backend=self.backend,
                                      packed_out=payload[scale_bytes : scale_bytes + numel // 8],
                                      workspace=self._workspace)
        payload[:scale_bytes].view(torch.float32).copy_(scales)

    def _decode_mean(self, bucket: OuterBucket, payloads: list[torch.Tensor]) -> None:
        numel, segments = bucket.values.numel(), self._segments_of(bucket)
        scale_bytes = 4 * len(segments)
        add_mean_of_signs_(bucket.values.zero_(), [p[scale_bytes : scale_bytes + numel // 8] for p in payloads],
                           [p[:scale_bytes].view(torch.float32) for p in payloads], segments, backend=self.backend,
                           workspace=self._workspace)

    def error_state_dict(self) -> dict[str, Any]:
        return dict(super().error_state_dict(), exchange=self.EXCHANGE)

    def _mismatch(self, state: dict[str, Any], buckets: Sequence[OuterBucket]) -> Optional[str]:
        if state.get("kind") == self.config.kind and state.get("exchange") != self.EXCHANGE:
            return ("the error feedback was saved by another 1-bit exchange (the two-phase exchange of more than two "
                    "replicas) than this run's all-gather of two")
        return super()._mismatch(state, buckets)


class TopkAverage(GatheredAverage):
    """``"topk"``: chunked top-k + 2-bit values (:mod:`~lightning_onebit.comm.topk`), exchanged by
    :class:`GatheredAverage`; decoded in rank order, then divided by the number of replicas."""

    WHAT = "top-k payloads"

    def payload_bytes(self, bucket: OuterBucket) -> int:
        return topk_payload_bytes(bucket.values.numel(), self.config.chunk, self.config.keep)

    def _encode(self, bucket: OuterBucket, payload: torch.Tensor) -> None:
        chunk = self.config.chunk
        accumulated = self._accumulate(bucket)
        indices, sent = topk_encode(accumulated, chunk, self.config.keep, payload)
        table = accumulated.view(-1, chunk)
        table.scatter_(1, indices, table.gather(1, indices) - sent)  # what was not sent stays here
        accumulated[bucket.real :].zero_()  # padding carries no error

    def _decode_mean(self, bucket: OuterBucket, payloads: list[torch.Tensor]) -> None:
        values = bucket.values.zero_()
        for payload in payloads:  # rank order: the same sum on every rank
            topk_decode_add_(values, payload, self.config.chunk, self.config.keep)
        values.div_(len(payloads))


def make_outer_compressor(
    compression: Any, group: Optional[dist.ProcessGroup] = None, backend: str = "auto"
) -> OuterCompressor:
    """The compressor of ``compression`` (an :class:`OuterCompression` or its ``kind``) over ``group``, the replica
    group (``None``: WORLD). For ``"onebit"``, the kernel ``backend`` every rank of ``group`` runs is agreed first
    (:func:`~lightning_onebit.comm.agree_kernel_backend`, a collective over ``group``)."""
    config = OuterCompression.of(compression)
    if config.kind == "onebit":
        exchange = OnebitGatherAverage if group_size(group) == 2 else OnebitAverage  # see the module docstring
        return exchange(config, group, agree_kernel_backend(backend, group))
    if config.kind == "topk":
        return TopkAverage(config, group)
    return DenseAverage(config, group)
