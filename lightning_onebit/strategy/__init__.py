"""The ``onebit_adam`` Lightning strategy (:class:`OnebitStrategy`): DDP whose gradient allreduce the compressed
optimizer switches off after its warmup (1-bit Adam, 1-bit LAMB) or on chosen steps only (0/1 Adam).

* :mod:`~lightning_onebit.strategy.strategy`: :class:`OnebitStrategy` (alias ``OnebitAdamStrategy``);
* :mod:`~lightning_onebit.strategy.overlap_policy`: when the exchange may start during backward;
* :mod:`~lightning_onebit.strategy.comm_hook`: the DDP hook the strategy registers;
* :mod:`~lightning_onebit.strategy.teardown`: process groups released at interpreter exit.
"""

from lightning_onebit.strategy.strategy import (
    PER_RANK_STATE_KEY,
    PER_RANK_STATUS_KEY,
    OnebitAdamStrategy,
    OnebitStrategy,
)
from lightning_onebit.strategy.teardown import _release_process_groups_at_exit  # noqa: F401  (called by the tests)

__all__ = ["PER_RANK_STATE_KEY", "PER_RANK_STATUS_KEY", "OnebitAdamStrategy", "OnebitStrategy"]
