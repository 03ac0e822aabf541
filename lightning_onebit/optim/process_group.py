"""Where a compressed optimizer's exchange runs, as properties of the optimizer: its process group and its topology,
and the exchange's counters.

They live in the optimizer's :class:`~lightning_onebit.comm.CompressedAllreduceState` (``compression``); what this
adds is what a change invalidates: the error feedback (its shapes and meaning depend on the group and the exchange),
the momentum buckets (padded to a multiple of the world size) and the kernel-backend agreement (the optimizer's
``agree_kernel_backend``, which stays on it).
"""

from __future__ import annotations

from typing import Optional

import torch.distributed as dist

from lightning_onebit.comm.accounting import CommunicationCounters
from lightning_onebit.comm.state import CompressedAllreduceState
from lightning_onebit.comm.topology import Topology
from lightning_onebit.optim.buckets import MomentumBuckets


class ProcessGroupMixin:
    """The process group, topology and counters of :class:`~lightning_onebit.optim.CompressedOptimizer`, which sets
    the attributes below."""

    compression: CompressedAllreduceState
    momentum_buckets: MomentumBuckets
    _backend_agreed: bool  # whether the kernel backend was agreed over the current process group
    _exchange_group_checked: bool  # whether sharded parameters were checked against the current process group

    @property
    def process_group(self) -> Optional[dist.ProcessGroup]:
        """The process group the momenta are averaged over (``None``: the default group). Setting another one resets
        the error feedback, rebuilds the buckets at their next use and agrees the kernel backend again."""
        return self.compression.process_group

    @process_group.setter
    def process_group(self, group: Optional[dist.ProcessGroup]) -> None:
        if group is not self.compression.process_group:
            self.compression.process_group = group
            self.compression.reset_error_feedback()
            self.momentum_buckets.built = None
            self._backend_agreed = False
            self._exchange_group_checked = False

    @property
    def topology(self) -> Optional[Topology]:
        """The :class:`~lightning_onebit.Topology` of the momentum exchange (``None``: flat, nodes unknown)."""
        return self.compression.topology

    @topology.setter
    def topology(self, topology: Optional[Topology]) -> None:
        if topology is not None and not isinstance(topology, Topology):
            raise ValueError(f"topology must be a lightning_onebit.Topology, got {type(topology).__name__}")
        if topology is not self.compression.topology:
            self.compression.topology = topology
            self.compression.reset_error_feedback()  # its shapes and meaning depend on the exchange

    @property
    def communication(self) -> CommunicationCounters:
        """Cumulative counters of the compressed allreduce on this rank, and of the full-precision allreduce of
        ``compress=False`` groups (``bytes_sent_uncompressed``); the warmup gradient sync is not included. On CUDA
        the times count once their events completed (read back here without waiting)."""
        return self.compression.settle_timings()
