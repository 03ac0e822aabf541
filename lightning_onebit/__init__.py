"""lightning-onebit: 1-bit Adam for PyTorch Lightning, on plain torch.distributed (NCCL and gloo).

Importing the package registers the ``onebit_adam`` strategies (``onebit_adam``, ``onebit_adam_spawn``,
``onebit_adam_fork``, ``onebit_adam_notebook``) with Lightning's ``StrategyRegistry``.
"""

from lightning.pytorch.strategies import StrategyRegistry

from lightning_onebit.callbacks import CommunicationMonitor, CompressionAdvice, ErrorFeedbackCheckpoint, MomentumMask, ReplicaCheck
from lightning_onebit.comm import (
    BucketLayout,
    CommunicationCounters,
    CompressedAllreduceState,
    agree_kernel_backend,
    assert_replicas_identical,
    bytes_leaving_node,
    compressed_allreduce_,
    compressed_allreduce_buckets_,
    ring_allreduce_bytes,
)
from lightning_onebit.hooks import (
    GradientSyncState,
    OverlapState,
    leaves_gradients_unchanged,
    overlapped_exchange_hook,
    switchable_allreduce_hook,
)
from lightning_onebit.optim import AutoFreeze, CompressedOptimizer, OnebitAdam, OnebitLamb, OnebitStage, ZeroOneAdam
from lightning_onebit.precision import RankSyncedGradScaler
from lightning_onebit.strategy import OnebitAdamStrategy, OnebitStrategy
from lightning_onebit.topology import Topology

__version__ = "0.1.0"

if "onebit_adam" not in StrategyRegistry:
    OnebitStrategy.register_strategies(StrategyRegistry)

__all__ = [
    "AutoFreeze",
    "BucketLayout",
    "CommunicationCounters",
    "CommunicationMonitor",
    "CompressionAdvice",
    "CompressedAllreduceState",
    "CompressedOptimizer",
    "ErrorFeedbackCheckpoint",
    "GradientSyncState",
    "MomentumMask",
    "OnebitAdam",
    "OnebitAdamStrategy",
    "OnebitStrategy",
    "OnebitLamb",
    "OnebitStage",
    "OverlapState",
    "RankSyncedGradScaler",
    "ReplicaCheck",
    "Topology",
    "ZeroOneAdam",
    "agree_kernel_backend",
    "assert_replicas_identical",
    "bytes_leaving_node",
    "compressed_allreduce_",
    "compressed_allreduce_buckets_",
    "leaves_gradients_unchanged",
    "overlapped_exchange_hook",
    "ring_allreduce_bytes",
    "switchable_allreduce_hook",
]
