"""lightning-onebit: 1-bit Adam for PyTorch Lightning, on plain torch.distributed (NCCL and gloo).

Importing the package registers the ``onebit_adam`` strategies (``onebit_adam``, ``onebit_adam_spawn``,
``onebit_adam_fork``, ``onebit_adam_notebook``), ``onebit_fsdp`` (sharded inside a node, 1-bit across nodes) and
``onebit_diloco`` (local steps, a compressed outer step across nodes) with Lightning's ``StrategyRegistry``.

The top level holds what a Lightning user needs: the strategy, the optimizers, the callbacks and :class:`Topology`.
The lower layers have their own namespaces: the compressed collective and its accounting in
:mod:`lightning_onebit.comm`, the DDP communication hooks in :mod:`lightning_onebit.hooks`, the loss scaler in
:mod:`lightning_onebit.strategy.precision`. Their names that used to be re-exported here still resolve, with a
``FutureWarning``, until 0.3.
"""

import importlib
import warnings
from typing import Any

from lightning.pytorch.strategies import StrategyRegistry

from lightning_onebit.callbacks import CommunicationMonitor, CompressionAdvice, ErrorFeedbackCheckpoint
from lightning_onebit.callbacks import LocalStepsAdvice, MomentumMask, ReplicaCheck
from lightning_onebit.comm.topology import Topology
from lightning_onebit.optim import AutoFreeze, CompressedOptimizer, OnebitAdam, OnebitLamb, OnebitStage, ZeroOneAdam
from lightning_onebit.strategy import OnebitAdamStrategy, OnebitDiLoCoFSDPStrategy, OnebitDiLoCoStrategy
from lightning_onebit.strategy import OnebitFSDPStrategy, OnebitStrategy
from lightning_onebit.strategy.pytorch_lightning_guard import guard_pytorch_lightning

__version__ = "0.1.0"

if "onebit_adam" not in StrategyRegistry:
    OnebitStrategy.register_strategies(StrategyRegistry)
if "onebit_fsdp" not in StrategyRegistry:
    OnebitFSDPStrategy.register_strategies(StrategyRegistry)
if "onebit_diloco" not in StrategyRegistry:
    OnebitDiLoCoStrategy.register_strategies(StrategyRegistry)
if "onebit_diloco_fsdp" not in StrategyRegistry:
    OnebitDiLoCoFSDPStrategy.register_strategies(StrategyRegistry)
guard_pytorch_lightning()  # pytorch_lightning.Trainer(strategy="onebit_adam") says to use lightning.pytorch

__all__ = [
    "AutoFreeze",
    "CommunicationMonitor",
    "CompressedOptimizer",
    "CompressionAdvice",
    "ErrorFeedbackCheckpoint",
    "LocalStepsAdvice",
    "MomentumMask",
    "OnebitAdam",
    "OnebitAdamStrategy",
    "OnebitDiLoCoFSDPStrategy",
    "OnebitDiLoCoStrategy",
    "OnebitFSDPStrategy",
    "OnebitLamb",
    "OnebitStage",
    "OnebitStrategy",
    "ReplicaCheck",
    "Topology",
    "ZeroOneAdam",
    "__version__",
]

#: Names the top level used to re-export, and the module each is imported from now. They still resolve here, with a
#: ``FutureWarning``, for one release (removed in 0.3). Imported on access, not at package import.
_MOVED = {
    # the compressed collective and its accounting
    "BucketLayout": "lightning_onebit.comm",
    "CommunicationCounters": "lightning_onebit.comm",
    "CompressedAllreduceState": "lightning_onebit.comm",
    "agree_kernel_backend": "lightning_onebit.comm",
    "assert_replicas_identical": "lightning_onebit.comm",
    "bytes_leaving_node": "lightning_onebit.comm",
    "compressed_allreduce_": "lightning_onebit.comm",
    "compressed_allreduce_buckets_": "lightning_onebit.comm",
    "ring_allreduce_bytes": "lightning_onebit.comm",
    # the DDP communication hooks
    "GradientSyncState": "lightning_onebit.hooks",
    "OverlapState": "lightning_onebit.hooks",
    "leaves_gradients_unchanged": "lightning_onebit.hooks",
    "overlapped_exchange_hook": "lightning_onebit.hooks",
    "switchable_allreduce_hook": "lightning_onebit.hooks",
    # the strategy's loss scaler
    "RankSyncedGradScaler": "lightning_onebit.strategy.precision",
}
_REMOVED_IN = "0.3"


def __getattr__(name: str) -> Any:
    """A moved name (:data:`_MOVED`), from its new module, with a ``FutureWarning`` that names it (PEP 562)."""
    module = _MOVED.get(name)
    if module is None:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    warnings.warn(
        f"{__name__}.{name} moved to {module}.{name}; import it from there. The top-level name will be removed in"
        f" {_REMOVED_IN}.",
        FutureWarning,
        stacklevel=2,
    )
    return getattr(importlib.import_module(module), name)


def __dir__() -> list[str]:
    return sorted(__all__)
