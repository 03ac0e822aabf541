"""What an optimizer step does: the one vocabulary shared by the optimizers, the hooks, the strategy and the callbacks.

Each compressed optimizer says what its next step will do (:attr:`CompressedOptimizer.next_step_kind
<lightning_onebit.optim.base.CompressedOptimizer.next_step_kind>`), which is what the DDP comm hook asks before every
backward (:attr:`StepKind.averages_gradients`), and records what every step did (``steps_by_kind``,
``last_step_kind``). Its phases (what the strategy announces, ``describe_phase``) are named by the kind of step that
characterises them.
"""

from __future__ import annotations

import enum


class StepKind(enum.StrEnum):
    """The kind of an optimizer step. A ``str`` (``StepKind.WARMUP == "warmup"``), so it logs and compares as text."""

    #: Gradients averaged in full precision by DDP, the full-precision update (the warmup of 1-bit Adam and LAMB).
    WARMUP = "warmup"
    #: One 1-bit compressed exchange of the momenta (or 0/1 Adam's gradients), the variance frozen.
    COMPRESSED = "compressed"
    #: 0/1 Adam: gradients averaged in full precision by DDP; momentum and variance updated (its warmup steps too).
    VARIANCE = "variance"
    #: 0/1 Adam: a step on this rank's own gradient, with no communication.
    LOCAL = "local"
    #: 0/1 Adam: a local step, then the update accumulated since the last sync averaged by a 1-bit exchange.
    SYNC = "sync"

    @property
    def averages_gradients(self) -> bool:
        """Whether the backward before a step of this kind must average gradients across ranks (DDP's allreduce)."""
        return self in (StepKind.WARMUP, StepKind.VARIANCE)
