"""The warmup exchange: how ``OnebitStrategy`` averages gradients whenever it averages them (1-bit Adam's and 1-bit
LAMB's warmup, 0/1 Adam's variance steps), chosen by name (``warmup_exchange``), and its per-rank state across
checkpoints (:class:`WarmupExchangeKeeper`).

``"fp32"``: DDP's ``mean`` allreduce. ``"bf16"``: torch's ``bf16_compress_hook`` (half the bytes, no state).
``"int8"``: :func:`~lightning_onebit.hooks.int8_allreduce_hook` (about a quarter of the bytes, error feedback).
``"powersgd"``: :func:`~lightning_onebit.hooks.powersgd_exchange_hook` (rank ``powersgd_rank`` after
``powersgd_vanilla_steps`` uncompressed steps, error feedback and warm start). The two stateful exchanges keep their
state per parameter (:class:`~lightning_onebit.hooks.ParameterKeyedState`); the strategy saves it with every
checkpoint, one file per rank, as it saves the optimizer's error feedback, under the same ``error_feedback`` policy.
"""

from __future__ import annotations

from typing import Any, Callable, Literal, Optional

from lightning.pytorch.utilities.rank_zero import rank_zero_info, rank_zero_warn
from torch.distributed.algorithms.ddp_comm_hooks import default_hooks

from lightning_onebit._checks import check_integer
from lightning_onebit._docs import docs_pointer
from lightning_onebit.comm.agreement import agree
from lightning_onebit.hooks import Int8AllreduceState, ParameterKeyedState, PowerSGDExchangeState
from lightning_onebit.hooks import int8_allreduce_hook, powersgd_exchange_hook
from lightning_onebit.strategy.checkpoint import PER_RANK_STATE_KEY, PER_RANK_STATUS_KEY
from lightning_onebit.strategy.error_feedback import failures_text

#: The warmup exchanges ``OnebitStrategy(warmup_exchange=...)`` takes.
WarmupExchange = Literal["fp32", "bf16", "int8", "powersgd"]
WARMUP_EXCHANGES: tuple[str, ...] = ("fp32", "bf16", "int8", "powersgd")
#: The warmup exchange when neither ``warmup_exchange`` nor ``ddp_comm_hook`` is given: the one place that says it.
#: PowerSGD (rank :data:`DEFAULT_POWERSGD_RANK` after :data:`DEFAULT_POWERSGD_VANILLA_STEPS` plain steps): with it
#: 1-bit Adam's defaults held AdamW-DDP's accuracy on the example, the mail corpus and AG News (the task kept aside),
#: where the fp32 warmup lost 2 points on a held-out task and sent 93% of the run's bytes in the warmup
#: (``python -m benchmarks.freeze_sweep --name defaults_sweep``; the table in ``docs/benchmarks.md``).
DEFAULT_WARMUP_EXCHANGE: WarmupExchange = "powersgd"
#: ``powersgd_rank``'s default: the rank of PowerSGD's approximation.
DEFAULT_POWERSGD_RANK = 4
#: ``powersgd_vanilla_steps``'s default: the averaged steps sent uncompressed before PowerSGD starts.
DEFAULT_POWERSGD_VANILLA_STEPS = 10
#: Main-checkpoint key of ``{"exchange", "iteration", "policy"}``: the warmup exchange's name, its step count (the same
#: on every rank) and the error feedback policy at save.
WARMUP_EXCHANGE_KEY = "onebit_warmup_exchange"
#: Name of the warmup exchange's state in each rank's per-rank state (``checkpoint[PER_RANK_STATE_KEY]``).
STATE_NAME = "warmup_exchange"


def choose_warmup_exchange(
    warmup_exchange: Optional[str],
    ddp_comm_hook: Optional[Callable[..., Any]],
    ddp_comm_state: Any,
    powersgd_rank: Optional[int],
    powersgd_vanilla_steps: Optional[int],
) -> tuple[Optional[str], Optional[Callable[..., Any]], Any]:
    """``(name, hook, state)`` of the strategy's warmup average: the named exchange (:data:`DEFAULT_WARMUP_EXCHANGE`
    when neither it nor a hook is given), or the user's ``ddp_comm_hook`` with ``ddp_comm_state`` (name ``None``).
    ``ValueError`` naming the fix for both at once, an unknown name, or PowerSGD's arguments with another exchange;
    the state's process group and topology are set by the strategy at setup."""
    if warmup_exchange is not None and ddp_comm_hook is not None:
        raise ValueError(
            f"OnebitStrategy takes warmup_exchange={warmup_exchange!r} or ddp_comm_hook=..., not both: they both say "
            "how warmup gradients are averaged. Pass one of them"
        )
    known = isinstance(warmup_exchange, str) and warmup_exchange in WARMUP_EXCHANGES
    if warmup_exchange is not None and not known:
        raise ValueError(f"warmup_exchange must be one of {', '.join(map(repr, WARMUP_EXCHANGES))}, got "
                         f"{warmup_exchange!r}")
    name = None if ddp_comm_hook is not None else (warmup_exchange or DEFAULT_WARMUP_EXCHANGE)
    given = [arg for arg, value in (("powersgd_rank", powersgd_rank), ("powersgd_vanilla_steps",
                                                                         powersgd_vanilla_steps)) if value is not None]
    if given and name != "powersgd":
        using = f"warmup_exchange={name!r}" if name is not None else "a ddp_comm_hook"
        raise ValueError(f"{', '.join(given)} apply to warmup_exchange='powersgd', but this strategy uses {using}: "
                         "drop them or pass warmup_exchange='powersgd'")
    if name is None:
        return None, ddp_comm_hook, ddp_comm_state
    if name == "bf16":
        return name, default_hooks.bf16_compress_hook, None  # its state is the process group, set at setup
    if name == "int8":
        return name, int8_allreduce_hook, Int8AllreduceState()
    if name == "powersgd":
        rank = DEFAULT_POWERSGD_RANK if powersgd_rank is None else powersgd_rank
        vanilla = DEFAULT_POWERSGD_VANILLA_STEPS if powersgd_vanilla_steps is None else powersgd_vanilla_steps
        check_integer(rank, "powersgd_rank")
        check_integer(vanilla, "powersgd_vanilla_steps", at_least=0)
        return name, powersgd_exchange_hook, PowerSGDExchangeState(rank=rank, vanilla_steps=vanilla)
    return name, None, None


def check_sharded_warmup_exchange(warmup_exchange: Any) -> None:
    """``OnebitFSDPStrategy(warmup_exchange=...)``: ``None`` or ``"fp32"``, else a ``ValueError`` that says why and
    what to use (its warmup allreduces FSDP's gradient shards across nodes, not DDP buckets)."""
    if warmup_exchange is None or warmup_exchange == "fp32":
        return
    known = isinstance(warmup_exchange, str) and warmup_exchange in WARMUP_EXCHANGES
    raise ValueError(
        f"OnebitFSDPStrategy(warmup_exchange={warmup_exchange!r}): onebit_fsdp's warmup averages FSDP's gradient "
        "shards across nodes in fp32 (a reduce-scatter in the node, an allreduce across), which the DDP-bucket "
        "exchanges do not apply to; it takes 'fp32' only"
        + ("; for a compressed warmup use strategy='onebit_adam' (OnebitStrategy)" if known else "")
    )


class WarmupExchangeKeeper:
    """A stateful warmup exchange's per-rank state across checkpoints, under the strategy's ``error_feedback`` policy:
    ``"keep"`` saves it next to each checkpoint (one file per rank) and restores it on every rank if every rank can
    (the resumed run continues bit for bit), else resets it on every rank with one warning naming the ranks and
    reasons; ``"require"`` raises instead when the checkpoint holds the state but a rank cannot restore it;
    ``"reset"`` saves none and resets it. A reset drops the error feedback and ``Q``s and keeps the step count when
    the checkpoint records it (else the exchange starts over: PowerSGD's vanilla steps again).

    The strategy calls :meth:`save` from ``save_checkpoint``, :meth:`load` from ``load_checkpoint``, and
    :meth:`on_train_start` at the start of training, after the optimizer's error feedback was restored.
    """

    def __init__(self, strategy_name: str) -> None:
        self._strategy_name = strategy_name
        self._loaded: Optional[dict[str, Any]] = None
        #: After a resume with a stateful exchange: ``True`` if restored on every rank, ``False`` if reset.
        self.restored: Optional[bool] = None

    def save(self, checkpoint: dict[str, Any], state: Optional[ParameterKeyedState], policy: str) -> None:
        """Record the exchange and its step count in ``checkpoint`` and, unless ``policy`` is ``"reset"``, this rank's
        state under ``checkpoint[PER_RANK_STATE_KEY]`` (a weights-only checkpoint gets neither)."""
        if state is None or "optimizer_states" not in checkpoint:
            return
        checkpoint[WARMUP_EXCHANGE_KEY] = {"exchange": state.exchange, "iteration": state.iteration, "policy": policy}
        if policy != "reset":
            checkpoint.setdefault(PER_RANK_STATE_KEY, {})[STATE_NAME] = state.state_dict()

    def load(self, checkpoint: dict[str, Any]) -> None:
        """Take what :meth:`save` wrote (and this rank's sidecar status) from a loaded checkpoint."""
        self._loaded = {
            "record": checkpoint.get(WARMUP_EXCHANGE_KEY),
            "pending": (checkpoint.get(PER_RANK_STATE_KEY) or {}).get(STATE_NAME),
            "status": checkpoint.get(PER_RANK_STATUS_KEY) or {},
        }

    def end_run(self) -> None:
        """Forget a loaded checkpoint no training start used."""
        self._loaded = None

    def on_train_start(self, state: Optional[ParameterKeyedState], policy: str, global_rank: int) -> None:
        """After a resume, on every rank: restore on every rank, or reset on every rank (one message), or raise on
        every rank (``"require"``). A collective (one ``all_gather_object``) unless the policy is ``"reset"``."""
        loaded, self._loaded = self._loaded, None
        if loaded is None or state is None:
            return
        record = loaded["record"] if isinstance(loaded["record"], dict) else None
        same = record is not None and record.get("exchange") == state.exchange
        iteration = int(record.get("iteration", 0)) if same else 0
        if policy == "reset":
            state.reset(iteration)
            self.restored = False
            rank_zero_info(f"{self._strategy_name}: the {state.exchange} warmup exchange's error feedback reset "
                           f"(error_feedback='reset'), at its step {iteration}")
            return
        reason = self._why_not(state, record, loaded)
        verdicts = agree((global_rank, loaded["status"].get("file"), reason))
        failures = [(rank, file, why) for rank, file, why in verdicts if why is not None]
        if not failures:
            state.load_state_dict(loaded["pending"])
            self.restored = True
            rank_zero_info(f"{self._strategy_name}: the {state.exchange} warmup exchange's state restored on every "
                           f"rank ({len(verdicts)} ranks)")
            return
        text = failures_text(failures)
        if policy == "require" and same and record.get("policy") != "reset":
            raise RuntimeError(
                f"OnebitStrategy(error_feedback='require'): the {state.exchange} warmup exchange's state cannot be "
                f"restored: {text}. Resume from a checkpoint whose per-rank files are intact and match this run, or "
                f"use error_feedback='keep' to reset it instead; {docs_pointer('guides/checkpoints')}"
            )
        state.reset(iteration)
        self.restored = False
        rank_zero_warn(f"{self._strategy_name}: the {state.exchange} warmup exchange's state (error feedback, "
                       f"PowerSGD's Q) reset on every rank, at its step {iteration}, because {text}; "
                       f"{docs_pointer('guides/checkpoints')}")

    @staticmethod
    def _why_not(state: ParameterKeyedState, record: Optional[dict[str, Any]], loaded: dict[str, Any]) -> Optional[str]:
        if record is None:
            return "the checkpoint holds no warmup exchange state (saved before it was kept, or with a stateless one)"
        if record.get("exchange") != state.exchange:
            return f"the checkpoint was saved with the {record.get('exchange')!r} warmup exchange"
        if record.get("policy") == "reset":
            return "the checkpoint was saved with error_feedback='reset'"
        reason = loaded["status"].get("reason")
        if reason is not None:
            return reason
        return state.mismatch(loaded["pending"])
