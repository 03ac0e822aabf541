"""The compressed optimizers: a shared base (:mod:`lightning_onebit.optim.base`) made of parts, the math
(:mod:`lightning_onebit.optim.functional`) and one module per algorithm.

* :class:`OnebitAdam` (:mod:`lightning_onebit.optim.onebit_adam`): AdamW warmup, then Adam with a frozen variance and
  1-bit compressed momentum averaging.
* :class:`ZeroOneAdam` (:mod:`lightning_onebit.optim.zeroone_adam`): Adam whose variance is updated on ever rarer
  full-precision steps with 1-bit compressed gradients in between, then local steps synchronised by 1-bit compressed
  updates ever more rarely.
* :class:`OnebitLamb` (:mod:`lightning_onebit.optim.onebit_lamb`): LAMB warmup, then LAMB with a frozen variance,
  a reconstructed fresh variance for the trust factor, and 1-bit compressed momentum averaging.

:class:`OuterStep` (:mod:`lightning_onebit.optim.outer_step`) is no compressed optimizer: it is the outer step of
local-steps training (DiLoCo family), the outer parameters and optimizer of ``strategy="onebit_diloco"``.
"""

from lightning_onebit.optim.auto_freeze_config import AutoFreeze
from lightning_onebit.optim.base import CompressedOptimizer
from lightning_onebit.optim.masks import check_exp_avg_mask
from lightning_onebit.optim.onebit_adam import OnebitAdam
from lightning_onebit.optim.onebit_lamb import OnebitLamb
from lightning_onebit.optim.outer_step import OuterStep
from lightning_onebit.optim.phases import OnebitStage, StepKind
from lightning_onebit.optim.zeroone_adam import ZeroOneAdam

__all__ = [
    "AutoFreeze",
    "CompressedOptimizer",
    "OnebitAdam",
    "OnebitLamb",
    "OnebitStage",
    "OuterStep",
    "StepKind",
    "ZeroOneAdam",
    "check_exp_avg_mask",
]
