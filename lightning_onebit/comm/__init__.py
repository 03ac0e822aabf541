"""The comm layer: the error-compensated 1-bit compressed allreduce over ``torch.distributed``, the topology it runs
on, and the accounting of what it sends. It knows nothing of optimizers, DDP or Lightning: it averages flat buffers.

* :mod:`~lightning_onebit.comm.exchange`: the compressed exchange (the algorithm is described there), blocking
  (:func:`compressed_allreduce_`, :func:`compressed_allreduce_buckets_`) or started and advanced by the caller
  (:func:`start_exchange_`, :func:`progress_exchanges_`, :func:`finish_exchanges_`), and its one-process simulation
  (:func:`simulate_compressed_allreduce_`);
* :mod:`~lightning_onebit.comm.state`: :class:`CompressedAllreduceState`, what the exchange keeps between calls
  (error feedback, workspaces, counters, second-phase groups);
* :mod:`~lightning_onebit.comm.layout`: :class:`BucketLayout`, how a buffer is padded, chunked and segmented;
* :mod:`~lightning_onebit.comm.full_precision`: :func:`full_precision_allreduce_` and
  :func:`sparse_rows_allreduce_`, the exact average of the groups kept out of compression (dense, or only the rows
  holding a nonzero);
* :mod:`~lightning_onebit.comm.agreement`: what keeps replicas bit-identical (:func:`agree_kernel_backend`) and the
  check that they are (:func:`assert_replicas_identical`);
* :mod:`~lightning_onebit.comm.topology`: :class:`~lightning_onebit.comm.topology.Topology`, which ranks share a
  node, and the process groups of the hierarchical exchange;
* :mod:`~lightning_onebit.comm.groups`: making process groups (one ``split_group`` per family where the backend can
  split), their timeouts and their destruction, the asynchronous ``all_gather``, and
  :class:`CollectiveFailedError`, a failed collective named with its group;
* :mod:`~lightning_onebit.comm.accounting`: :class:`CommunicationCounters` and the byte formulas;
* :mod:`~lightning_onebit.comm.outer`: the compressed average of local-steps training's outer pseudo-gradient over
  the replicas (:class:`OuterCompression`, :func:`make_outer_compressor`: fp32, bf16, 1-bit, top-k + 2-bit), and
  :mod:`~lightning_onebit.comm.topk`, the chunked top-k codec.

Everything is re-exported here (``from lightning_onebit.comm import X``). Monkeypatch a function in the module that
defines it, where its callers look it up. The private helpers this namespace used to re-export for tests and
benchmarks have public names now; the old names still resolve, with a ``FutureWarning``, until 0.3 (:data:`_MOVED`).
"""

import warnings
from typing import Any

from lightning_onebit.comm.accounting import (
    CommunicationCounters,
    add_traffic,
    bytes_leaving_node,
    count_ring_allreduce,
    flat_two_phase_bytes,
    ring_allreduce_bytes,
)
from lightning_onebit.comm.agreement import agree_kernel_backend, assert_replicas_identical, replica_checksums
from lightning_onebit.comm.exchange import (
    ExchangePhase,
    PendingExchange,
    advance_exchange_,
    check_buckets,
    compressed_allreduce_,
    compressed_allreduce_buckets_,
    finish_exchanges_,
    progress_exchanges_,
    simulate_compressed_allreduce_,
    start_exchange_,
)
from lightning_onebit.comm.full_precision import full_precision_allreduce_, sparse_rows_allreduce_
from lightning_onebit.comm.groups import CollectiveFailedError, all_gather_async
from lightning_onebit.comm.layout import BucketLayout
from lightning_onebit.comm.outer import (
    OUTER_COMPRESSIONS,
    OuterBucket,
    OuterCompression,
    OuterCompressor,
    make_outer_compressor,
)
from lightning_onebit.comm.state import CompressedAllreduceState
from lightning_onebit.comm.topology import Topology

__all__ = [
    "OUTER_COMPRESSIONS",
    "BucketLayout",
    "CollectiveFailedError",
    "CommunicationCounters",
    "CompressedAllreduceState",
    "ExchangePhase",
    "OuterBucket",
    "OuterCompression",
    "OuterCompressor",
    "PendingExchange",
    "Topology",
    "add_traffic",
    "advance_exchange_",
    "agree_kernel_backend",
    "all_gather_async",
    "assert_replicas_identical",
    "bytes_leaving_node",
    "check_buckets",
    "compressed_allreduce_",
    "compressed_allreduce_buckets_",
    "count_ring_allreduce",
    "finish_exchanges_",
    "flat_two_phase_bytes",
    "full_precision_allreduce_",
    "make_outer_compressor",
    "sparse_rows_allreduce_",
    "progress_exchanges_",
    "replica_checksums",
    "ring_allreduce_bytes",
    "simulate_compressed_allreduce_",
    "start_exchange_",
]


#: The private names this namespace re-exported for tests and benchmarks until 0.2, and what replaced each: they
#: still resolve, with a ``FutureWarning``, until 0.3.
_MOVED = {
    "_ALL_TO_ALL": ("ExchangePhase.ALL_TO_ALL", ExchangePhase.ALL_TO_ALL),
    "_GATHER": ("ExchangePhase.GATHER", ExchangePhase.GATHER),
    "_NODE_GATHER": ("ExchangePhase.NODE_GATHER", ExchangePhase.NODE_GATHER),
    "_advance": ("advance_exchange_", advance_exchange_),
    "_all_gather": ("all_gather_async", all_gather_async),
    "_bytes_sent": ("BucketLayout.bytes_sent", lambda layout, element_size, topology, rank: layout.bytes_sent(
        element_size, topology, rank)),
}


def __getattr__(name: str) -> Any:
    """A name of :data:`_MOVED`, with a ``FutureWarning`` that names its replacement (PEP 562)."""
    if name not in _MOVED:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    replacement, value = _MOVED[name]
    warnings.warn(f"{__name__}.{name} is deprecated: use {__name__}.{replacement}; the old name will be removed in 0.3",
                  FutureWarning, stacklevel=2)
    return value
