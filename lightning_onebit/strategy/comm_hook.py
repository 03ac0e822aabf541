"""The strategy's DDP communication hook and its state, which hold the strategy by weak reference."""

# No `from __future__ import annotations`: DDP checks the hook's annotations as real objects.
import weakref
from typing import TYPE_CHECKING

from lightning_onebit.hooks import overlapped_exchange_hook, switchable_allreduce_hook

if TYPE_CHECKING:
    from lightning_onebit.strategy.strategy import OnebitStrategy


class _HookState:
    """State of the strategy's DDP comm hook: the strategy, by weak reference. DDP keeps its hook state alive and the
    strategy keeps DDP (``strategy.model``): a strong reference would be a cycle holding DDP, and with it its process
    group, until the garbage collector finds it, possibly at interpreter exit."""

    __slots__ = ("_strategy",)

    def __init__(self, strategy: "OnebitStrategy") -> None:
        self._strategy = weakref.ref(strategy)

    @property
    def strategy(self) -> "OnebitStrategy":
        strategy = self._strategy()
        if strategy is None:
            raise RuntimeError("the OnebitStrategy that registered this DDP comm hook was freed")
        return strategy


def _gradient_allreduce_needed(strategy_ref: "weakref.ref[OnebitStrategy]") -> bool:
    """The strategy's gradient-sync predicate (``strategy_ref`` is weak for the reason given in :class:`_HookState`:
    the predicate lives in ``strategy.gradient_sync``, which the hook reaches)."""
    strategy = strategy_ref()
    optimizer = None if strategy is None else strategy._onebit_optimizer
    return optimizer is None or optimizer.needs_gradient_allreduce


def _strategy_comm_hook(state, bucket):  # type: ignore[no-untyped-def]
    """The strategy's DDP comm hook (``state``: a :class:`_HookState`): the overlapped exchange when configured, else
    the switchable allreduce.

    (No annotations: DDP checks them as objects.)"""
    strategy = state.strategy
    if strategy.overlap_state is not None:
        return overlapped_exchange_hook(strategy.overlap_state, bucket)
    return switchable_allreduce_hook(strategy.gradient_sync, bucket)
