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
  split), their timeouts and their destruction;
* :mod:`~lightning_onebit.comm.accounting`: :class:`CommunicationCounters` and the byte formulas;
* :mod:`~lightning_onebit.comm.errors`: :class:`CollectiveFailedError`, a failed collective named with its group.

Everything is re-exported here (``from lightning_onebit.comm import X``), including the few private helpers that
tests and benchmarks import. Monkeypatch a function in the module that defines it, where its callers look it up.
"""

from lightning_onebit.comm.accounting import (
    CommunicationCounters,
    _bytes_sent,
    add_traffic,
    bytes_leaving_node,
    count_ring_allreduce,
    flat_two_phase_bytes,
    ring_allreduce_bytes,
)
from lightning_onebit.comm.agreement import agree_kernel_backend, assert_replicas_identical, replica_checksums
from lightning_onebit.comm.errors import CollectiveFailedError
from lightning_onebit.comm.exchange import (
    _ALL_TO_ALL,
    _GATHER,
    _NODE_GATHER,
    PendingExchange,
    _advance,
    _all_gather,
    all_gather_async,
    check_buckets,
    compressed_allreduce_,
    compressed_allreduce_buckets_,
    finish_exchanges_,
    progress_exchanges_,
    simulate_compressed_allreduce_,
    start_exchange_,
)
from lightning_onebit.comm.full_precision import full_precision_allreduce_, sparse_rows_allreduce_
from lightning_onebit.comm.layout import BucketLayout
from lightning_onebit.comm.state import CompressedAllreduceState
from lightning_onebit.comm.topology import Topology

__all__ = [
    "BucketLayout",
    "CollectiveFailedError",
    "CommunicationCounters",
    "CompressedAllreduceState",
    "PendingExchange",
    "Topology",
    "add_traffic",
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
    "sparse_rows_allreduce_",
    "progress_exchanges_",
    "replica_checksums",
    "ring_allreduce_bytes",
    "simulate_compressed_allreduce_",
    "start_exchange_",
]
# Private, not API: re-exported for the tests and benchmarks that import them from here (and listed so that the
# re-export is explicit). Patching one of them here changes nothing: patch it in its defining module.
__all__ += ["_ALL_TO_ALL", "_GATHER", "_NODE_GATHER", "_advance", "_all_gather", "_bytes_sent"]
