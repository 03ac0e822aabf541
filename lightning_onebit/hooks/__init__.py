"""Torch-only DDP communication hooks (the layer between the optimizers and the strategy; like
``torch.distributed.algorithms.ddp_comm_hooks``, each is a state object and a pure hook):

* :mod:`~lightning_onebit.hooks.gradient_sync`: :class:`GradientSyncState` and :func:`switchable_allreduce_hook`,
  DDP's allreduce during warmup (or the user's ``ddp_comm_hook``), nothing afterwards;
* :mod:`~lightning_onebit.hooks.overlap`: :class:`OverlapState` and :func:`overlapped_exchange_hook`, the compressed
  momentum exchange started during backward, what decides whether it may (:func:`leaves_gradients_unchanged`,
  :class:`OverlapFallbackReason`), and :class:`ExchangeHookState` with :func:`exchange_hook`, the one hook a strategy
  registers before it knows which of the two it runs;
* :mod:`~lightning_onebit.hooks.powersgd`: :class:`OrderedPowerSGDState` and :func:`ordered_powersgd_hook`, torch's
  PowerSGD with its buckets compressed in order (gloo-safe) and its bytes counted;
* :mod:`~lightning_onebit.hooks.powersgd_exchange`: :class:`PowerSGDExchangeState` and
  :func:`powersgd_exchange_hook`, the library's own PowerSGD (state kept per parameter, so it resumes bit for bit; one
  allreduce per phase per step; no host synchronisation): ``OnebitStrategy(warmup_exchange="powersgd")``;
* :mod:`~lightning_onebit.hooks.int8`: :class:`Int8AllreduceState` and :func:`int8_allreduce_hook`, gradients averaged
  with 8 bits per element and error feedback kept per parameter;
* :mod:`~lightning_onebit.hooks.parameter_state`: :class:`ParameterKeyedState`, what those two states share (their
  per-rank state keyed by parameter, saved and restored with checkpoints);
* :mod:`~lightning_onebit.hooks.fsdp` (imported on its own, it needs FSDP2): the FSDP2 counterparts,
  :class:`~lightning_onebit.hooks.fsdp.ReplicaAllReduceState` (the warmup's average across nodes) and
  :class:`~lightning_onebit.hooks.fsdp.ShardedOverlapState` (the exchange of each FSDP group started during backward).
"""

from lightning_onebit.hooks.gradient_sync import GradientSyncState, switchable_allreduce_hook
from lightning_onebit.hooks.int8 import Int8AllreduceState, int8_allreduce_hook
from lightning_onebit.hooks.overlap import (
    ExchangeHookState,
    OverlapFallbackReason,
    OverlapState,
    exchange_hook,
    is_marked_read_only,
    leaves_gradients_unchanged,
    overlapped_exchange_hook,
)
from lightning_onebit.hooks.parameter_state import ParameterKeyedState
from lightning_onebit.hooks.powersgd import OrderedPowerSGDState, ordered_powersgd_hook
from lightning_onebit.hooks.powersgd_exchange import PowerSGDExchangeState, powersgd_exchange_hook

__all__ = [
    "ExchangeHookState",
    "GradientSyncState",
    "Int8AllreduceState",
    "OrderedPowerSGDState",
    "OverlapFallbackReason",
    "OverlapState",
    "ParameterKeyedState",
    "PowerSGDExchangeState",
    "exchange_hook",
    "is_marked_read_only",
    "int8_allreduce_hook",
    "leaves_gradients_unchanged",
    "ordered_powersgd_hook",
    "overlapped_exchange_hook",
    "powersgd_exchange_hook",
    "switchable_allreduce_hook",
]
