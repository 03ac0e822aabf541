"""Lightning callbacks for the compressed optimizers: momentum masks, compression state across checkpoints,
communication logging and advice, replica checks.

Each needs a strategy of this package and fails at setup with a clear message otherwise, except
:class:`CommunicationMonitor`, which counts ``onebit_adam``, ``onebit_fsdp``, ``onebit_diloco`` (and advises its
``sync_every``) and plain DDP (``strategy="ddp"``), the baseline to compare with.
"""

from lightning_onebit.callbacks.advice import CompressionAdvice, LocalStepsAdvice
from lightning_onebit.callbacks.communication_monitor import CommunicationMonitor
from lightning_onebit.callbacks.error_feedback import ErrorFeedbackCheckpoint
from lightning_onebit.callbacks.momentum_mask import MaskSpec, MomentumMask
from lightning_onebit.callbacks.replica_check import ReplicaCheck

__all__ = [
    "CommunicationMonitor",
    "CompressionAdvice",
    "ErrorFeedbackCheckpoint",
    "LocalStepsAdvice",
    "MaskSpec",
    "MomentumMask",
    "ReplicaCheck",
]
