"""The ``onebit_adam`` Lightning strategy (:class:`OnebitStrategy`): DDP whose gradient allreduce the compressed
optimizer switches off after its warmup (1-bit Adam, 1-bit LAMB) or on chosen steps only (0/1 Adam).

* :mod:`~lightning_onebit.strategy.strategy`: :class:`OnebitStrategy` (alias ``OnebitAdamStrategy``);
* :mod:`~lightning_onebit.strategy.fsdp`: :class:`OnebitFSDPStrategy` (``onebit_fsdp``), FSDP2 inside each node and
  the compressed exchange across nodes;
* :mod:`~lightning_onebit.strategy.local_steps`: :class:`OnebitDiLoCoStrategy` (``onebit_diloco``), local steps
  inside each node and a compressed outer step across nodes (DiLoCo family), with
  :mod:`~lightning_onebit.strategy.local_steps_run` (what both local-steps strategies hold);
* :mod:`~lightning_onebit.strategy.local_steps_fsdp`: :class:`OnebitDiLoCoFSDPStrategy` (``onebit_diloco_fsdp``), the
  same with FSDP2 inside each node, its checkpoints in :mod:`~lightning_onebit.strategy.local_steps_fsdp_checkpoint`;
* :mod:`~lightning_onebit.strategy.arguments`: the strategy's options and DDP arguments, checked;
* :mod:`~lightning_onebit.strategy.overlap_policy`: when the exchange may start during backward;
* :mod:`~lightning_onebit.strategy.process_groups`: the topology and the process groups the strategy owns, released
  at interpreter exit;
* :mod:`~lightning_onebit.strategy.auto_freeze`: the warmup against the run's length;
* :mod:`~lightning_onebit.strategy.clipping`: clipping by norm where gradients are local, one factor on every rank
  (the precision plugins of both strategies);
* :mod:`~lightning_onebit.strategy.stage_log`: the stage announcements and what clipping does in the compression stage;
* :mod:`~lightning_onebit.strategy.checkpoint`: per-rank state in checkpoints, in the sidecar files of
  :mod:`~lightning_onebit.strategy.sidecar`;
* :mod:`~lightning_onebit.strategy.checkpoint_files`: ``onebit_fsdp``'s checkpoint folders saved whole or not at all
  with a manifest of their digests, verified on load, and the errors for a checkpoint of the other strategy;
* :mod:`~lightning_onebit.strategy.error_feedback`: the compression error feedback across checkpoints (kept by
  default, reset or required: the strategies' ``error_feedback``).
"""

import warnings
from typing import Any


from lightning_onebit.strategy.checkpoint import PER_RANK_STATE_KEY, PER_RANK_STATUS_KEY
from lightning_onebit.strategy.error_feedback import ERROR_FEEDBACK_KEY, ERROR_FEEDBACK_POLICIES
from lightning_onebit.strategy.fsdp import OnebitFSDPStrategy
from lightning_onebit.strategy.local_steps import OnebitDiLoCoStrategy
from lightning_onebit.strategy.local_steps_fsdp import OnebitDiLoCoFSDPStrategy
from lightning_onebit.strategy.strategy import OnebitAdamStrategy, OnebitStrategy
from lightning_onebit.strategy.process_groups import release_process_groups_at_exit

__all__ = [
    "ERROR_FEEDBACK_KEY",
    "ERROR_FEEDBACK_POLICIES",
    "PER_RANK_STATE_KEY",
    "PER_RANK_STATUS_KEY",
    "OnebitAdamStrategy",
    "OnebitDiLoCoFSDPStrategy",
    "OnebitDiLoCoStrategy",
    "OnebitFSDPStrategy",
    "OnebitStrategy",
    "release_process_groups_at_exit",  # what runs at interpreter exit (the tests run it as the exit would)
]


def __getattr__(name: str) -> Any:
    """``_release_process_groups_at_exit``, the private name this namespace listed until 0.2, with a
    ``FutureWarning`` (PEP 562); it is removed in 0.3."""
    if name != "_release_process_groups_at_exit":
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    warnings.warn(f"{__name__}._release_process_groups_at_exit is deprecated: use {__name__}."
                  "release_process_groups_at_exit; the old name will be removed in 0.3", FutureWarning, stacklevel=2)
    return release_process_groups_at_exit
