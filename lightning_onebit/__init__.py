"""lightning-onebit: 1-bit Adam for PyTorch Lightning, on plain torch.distributed (NCCL and gloo)."""

from lightning_onebit.comm import (
    BucketLayout,
    CommunicationCounters,
    CompressedAllreduceState,
    compressed_allreduce_,
    ring_allreduce_bytes,
)
from lightning_onebit.optim import OnebitAdam, OnebitStage

__version__ = "0.1.0"

__all__ = [
    "BucketLayout",
    "CommunicationCounters",
    "CompressedAllreduceState",
    "OnebitAdam",
    "OnebitStage",
    "compressed_allreduce_",
    "ring_allreduce_bytes",
]
