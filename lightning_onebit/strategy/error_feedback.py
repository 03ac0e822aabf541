"""Compression error feedback across checkpoints: what happens to each rank's worker and server error buffers when
training resumes (the strategies' ``error_feedback`` argument, or :class:`~lightning_onebit.ErrorFeedbackCheckpoint`).

Each rank holds its own error buffers (they are what makes 1-bit compression unbiased over time), and Lightning writes
only rank 0's checkpoint. Lightning's restore of the optimizer state resets them, so a policy decides at the start of
training what they become:

* ``"keep"`` (default): every rank saves its own buffers in a sidecar file next to the checkpoint
  (:mod:`~lightning_onebit.strategy.checkpoint`). On resume each rank validates its own file, the ranks agree with one
  small collective, and either every rank restores (the resumed run continues bitwise as an uninterrupted one would)
  or every rank resets, with one warning naming each rank that cannot restore, its file and the reason.
* ``"reset"`` (DeepSpeed's behaviour): the buffers restart from zero; the norm that was dropped (rank 0's buffers at
  save time) is logged.
* ``"require"``: as ``"keep"``, but if any rank cannot restore, every rank raises ``RuntimeError`` at the start of
  training, before any training collective.

The main checkpoint records the policy and rank 0's error norm at save under :data:`ERROR_FEEDBACK_KEY`. A checkpoint
written before that key existed (the buffers were kept only under ``ErrorFeedbackCheckpoint("keep")``, whose state
then held the norm) still loads: its norm is taken from that state, or reported as unknown.
"""

from __future__ import annotations

from typing import Any, Literal, Optional

from lightning.pytorch.utilities.rank_zero import rank_zero_info, rank_zero_warn

from lightning_onebit._docs import docs_pointer
from lightning_onebit.comm.agreement import agree
from lightning_onebit.optim import CompressedOptimizer
from lightning_onebit.strategy.checkpoint import NO_PER_RANK_FILES, PER_RANK_STATE_KEY, PER_RANK_STATUS_KEY

__all__ = ["ERROR_FEEDBACK_KEY", "ERROR_FEEDBACK_POLICIES", "ErrorFeedbackKeeper", "ErrorFeedbackPolicy",
           "check_error_feedback_policy"]

#: What happens to the error feedback on resume.
ErrorFeedbackPolicy = Literal["keep", "reset", "require"]
#: The policies, in the order error messages name them.
ERROR_FEEDBACK_POLICIES: tuple[str, ...] = ("reset", "keep", "require")
#: Main-checkpoint key of ``{"policy": ..., "error_norm_rank0": ...}``: the policy in force at save and the L2 norm of
#: rank 0's error buffers then (what a reset drops).
ERROR_FEEDBACK_KEY = "onebit_error_feedback"
#: Name of the error feedback in each rank's per-rank state (``checkpoint[PER_RANK_STATE_KEY]``).
STATE_NAME = "error_feedback"
#: ``checkpoint["callbacks"]`` key of ``ErrorFeedbackCheckpoint``'s state in checkpoints written before
#: :data:`ERROR_FEEDBACK_KEY` (it held ``error_norm_rank0``).
_OLD_CALLBACK_STATE = "ErrorFeedbackCheckpoint"


def check_error_feedback_policy(policy: Any, what: str) -> str:
    """``policy`` if it is one of :data:`ERROR_FEEDBACK_POLICIES`, else ``ValueError`` naming ``what`` (the argument)
    and the allowed values."""
    if not isinstance(policy, str) or policy not in ERROR_FEEDBACK_POLICIES:
        raise ValueError(f"{what} must be one of {ERROR_FEEDBACK_POLICIES}, got {policy!r}")
    return policy


class ErrorFeedbackKeeper:
    """A strategy's error feedback across checkpoints: the policy, and the state between a checkpoint's load and the
    start of training.

    The strategy calls :meth:`save` from ``save_checkpoint`` (before the per-rank state goes to the sidecars),
    :meth:`load` from ``load_checkpoint`` (after its sidecar was read), :meth:`on_train_start` from ``on_train_start``
    (after Lightning restored the optimizer state, which resets the buffers) and :meth:`end_run` from ``teardown``.

    Args:
        policy: ``"keep"``, ``"reset"`` or ``"require"`` (the strategy's ``error_feedback`` argument).
        strategy_name: the strategy's registered name (``"onebit_adam"``), which speaks in the log.
        strategy_class: the strategy's class name, for messages about its argument.
    """

    def __init__(self, policy: ErrorFeedbackPolicy, strategy_name: str, strategy_class: str) -> None:
        self.argument = check_error_feedback_policy(policy, f"{strategy_class}(error_feedback=...)")
        self.policy: str = self.argument
        self.chosen_by: Optional[str] = None  # the callback that chose the policy; None: the strategy's argument
        self._strategy_name = strategy_name
        self._strategy_class = strategy_class
        self._pending: Optional[dict[str, Any]] = None
        self._status: Optional[dict[str, Any]] = None
        self._saved_norm: Optional[float] = None
        self._saved_policy: Optional[str] = None
        self._loaded = False
        #: After a resume: ``True`` if the buffers were restored, ``False`` if reset; ``None`` before any resume.
        self.restored: Optional[bool] = None

    # ------------------------------------------------------------------ the policy
    def choose(self, policy: ErrorFeedbackPolicy, chosen_by: Optional[str] = None) -> None:
        """Set the policy. ``chosen_by``: the callback that chooses it (named in the messages; it overrides the
        strategy's argument, said at info level when the two differ); ``None``: the strategy's own argument."""
        what = f"{chosen_by} policy" if chosen_by is not None else f"{self._strategy_class}(error_feedback=...)"
        check_error_feedback_policy(policy, what)
        if chosen_by is None:
            self.argument = policy
        elif policy != self.argument:
            rank_zero_info(
                f"{self._strategy_name}: {chosen_by}(policy={policy!r}) overrides the strategy's "
                f"error_feedback={self.argument!r}: compression error feedback is handled with {policy!r}"
            )
        self.policy, self.chosen_by = policy, chosen_by

    def _speaker(self) -> str:
        return self.chosen_by if self.chosen_by is not None else self._strategy_name

    def _call(self, policy: str) -> str:
        if self.chosen_by is not None:
            return f"{self.chosen_by}(policy={policy!r})"
        return f"{self._strategy_class}(error_feedback={policy!r})"

    def _argument_name(self) -> str:
        return "policy" if self.chosen_by is not None else "error_feedback"

    # ------------------------------------------------------------------ save and load
    def save(self, checkpoint: dict[str, Any], optimizer: Optional[CompressedOptimizer]) -> None:
        """Put this rank's buffers under ``checkpoint[PER_RANK_STATE_KEY]`` (unless the policy is ``"reset"``) and
        the policy and this rank's error norm under :data:`ERROR_FEEDBACK_KEY` (rank 0's is the one written). A
        weights-only checkpoint (no optimizer state to resume from) gets neither."""
        if optimizer is None or "optimizer_states" not in checkpoint:
            return
        if self.policy != "reset":
            checkpoint.setdefault(PER_RANK_STATE_KEY, {})[STATE_NAME] = optimizer.error_feedback_state_dict()
        checkpoint[ERROR_FEEDBACK_KEY] = {
            "policy": self.policy,
            "error_norm_rank0": optimizer.compression.error_feedback_norm(),
        }

    def load(self, checkpoint: dict[str, Any]) -> None:
        """Take this rank's saved buffers and its sidecar's status from a loaded checkpoint (the strategy put them
        there), for :meth:`on_train_start`."""
        record = checkpoint.get(ERROR_FEEDBACK_KEY)
        if not isinstance(record, dict):
            record = _old_callback_state(checkpoint)
        self._saved_norm = record.get("error_norm_rank0")
        self._saved_policy = record.get("policy")
        self._pending = (checkpoint.get(PER_RANK_STATE_KEY) or {}).get(STATE_NAME)
        self._status = checkpoint.get(PER_RANK_STATUS_KEY)
        self._loaded = True

    def end_run(self) -> None:
        """Forget a loaded checkpoint that no training start used (a ``validate`` or ``test`` with ``ckpt_path``, or
        a fit that failed before training), so a later fit does not restore it."""
        self._pending = self._status = None
        self._loaded = False

    # ------------------------------------------------------------------ the start of training
    def on_train_start(self, optimizer: Optional[CompressedOptimizer], global_rank: int) -> None:
        """After a resume, on every rank, before the first training step: restore on every rank or reset on every
        rank (``"keep"``), or raise on every rank (``"require"``). A collective (one ``all_gather_object`` over all
        ranks) unless the policy is ``"reset"``."""
        if not self._loaded:
            return
        pending, status = self._pending, self._status or {}
        self.end_run()
        if optimizer is None:
            return
        if self.policy == "reset":
            self._reset(optimizer)
            return
        reason = status.get("reason", "the strategy found no per-rank file for this rank")
        cause = self._why_no_error_feedback()
        if status.get("recorded") is False and cause is not None:
            reason = f"{NO_PER_RANK_FILES} ({cause}){status.get('detail', '')}"
        if reason is None and pending is None:
            reason = "the per-rank file holds no error feedback" + (f" ({cause})" if cause is not None else "")
        if reason is None:
            reason = optimizer.error_feedback_mismatch(pending)
        # over every rank of the strategy (under onebit_fsdp the optimizer's group is one replicate group only)
        verdicts = agree((global_rank, status.get("file"), reason))
        failures = [(rank, file, why) for rank, file, why in verdicts if why is not None]
        if not failures:
            assert pending is not None
            optimizer.load_error_feedback_state_dict(pending)
            self.restored = True
            rank_zero_info(
                f"{self._speaker()}: compression error feedback restored on every rank ({len(verdicts)} ranks)"
            )
            return
        text = failures_text(failures)
        if self.policy == "require":
            raise RuntimeError(
                f"{self._call('require')}: compression error feedback cannot be restored: {text}. "
                "Resume from a checkpoint whose per-rank files are intact and match this run, or use "
                f"{self._argument_name()}='keep' to reset instead; {docs_pointer('guides/checkpoints')}"
            )
        rank_zero_warn(
            f"{self._call('keep')}: error feedback reset on every rank because {text}; "
            f"{docs_pointer('guides/checkpoints')}"
        )
        self._reset(optimizer)

    def _why_no_error_feedback(self) -> Optional[str]:
        """Why a checkpoint holds no per-rank error feedback, from what its main file records."""
        if self._saved_policy == "reset":
            return "it was saved with error feedback policy 'reset'"
        if self._saved_policy is None:
            return ("it was saved before error feedback was kept by default, without "
                    "ErrorFeedbackCheckpoint(policy='keep')")
        return None

    def _reset(self, optimizer: CompressedOptimizer) -> None:
        optimizer.reset_error_feedback()
        self.restored = False
        norm = "unknown" if self._saved_norm is None else f"{self._saved_norm:.4g}"
        rank_zero_info(f"{self._speaker()}: compression error feedback reset (rank 0 norm at save: {norm})")


def _old_callback_state(checkpoint: dict[str, Any]) -> dict[str, Any]:
    """``ErrorFeedbackCheckpoint``'s state in a checkpoint written before :data:`ERROR_FEEDBACK_KEY` (its norm; no
    policy recorded), or ``{}``."""
    callbacks = checkpoint.get("callbacks")
    state = callbacks.get(_OLD_CALLBACK_STATE) if isinstance(callbacks, dict) else None
    return {"error_norm_rank0": state.get("error_norm_rank0")} if isinstance(state, dict) else {}


def failures_text(failures: list[tuple]) -> str:
    """``rank r (file): reason`` for each failing rank, ranks with the same reason together (a node without its
    sidecars: one reason, not one per rank)."""
    by_reason: dict[str, list[str]] = {}
    for rank, file, why in failures:
        by_reason.setdefault(why, []).append(f"rank {rank} ({file})")
    return "; ".join(f"{', '.join(ranks)}: {why}" for why, ranks in by_reason.items())

