"""Process groups released at interpreter exit, while the interpreter is still whole."""

from __future__ import annotations

import atexit
import weakref
from typing import TYPE_CHECKING

import torch

if TYPE_CHECKING:
    from lightning_onebit.strategy.strategy import OnebitStrategy

#: Strategies that may hold process groups at interpreter exit (weakly: a strategy freed earlier holds none).
_LIVE_STRATEGIES: "weakref.WeakSet[OnebitStrategy]" = weakref.WeakSet()
_EXIT_HANDLER_REGISTERED = False


def _register_exit_handler() -> None:
    global _EXIT_HANDLER_REGISTERED
    if not _EXIT_HANDLER_REGISTERED:
        atexit.register(_release_process_groups_at_exit)
        _EXIT_HANDLER_REGISTERED = True


def _release_process_groups_at_exit() -> None:
    """At interpreter exit, while the interpreter is still whole: every live strategy destroys the process groups it
    made and detaches its optimizers from them (:meth:`OnebitStrategy.destroy_process_groups`), then WORLD is
    destroyed if still initialised (Lightning does that for NCCL only).

    Why: ``dist.destroy_process_group`` only unregisters a group; a gloo group stops its threads when its C++ object is
    freed, i.e. when the last Python reference to it goes. If that is during interpreter finalization (the trainer in
    a module global, or objects in a reference cycle that the final garbage collection meets), a thread that needs the
    GIL then is ended by the interpreter, and the forced unwind through C++ calls ``std::terminate``: "terminate called
    without an active exception" (SIGABRT, exit code 134) after training had succeeded, and the launcher reports a
    failed job. Unregistered by torch and no longer referenced by the strategy or its optimizers, the strategy's
    groups, and DDP's (WORLD, which the strategy's gradient sync and every optimizer it attached also hold), are
    freed here, by reference counting: no ``gc.collect()`` is needed, because none of them is held in a
    reference cycle (the DDP comm hook's state and the gradient predicate hold the strategy weakly,
    :class:`~lightning_onebit.hooks.OverlapState` holds DDP weakly). Whatever else the program holds (its own references
    to WORLD) it keeps; those threads then live on, idle, as they would without this library.
    """
    for strategy in list(_LIVE_STRATEGIES):
        strategy._release_ddp_group()
        strategy.destroy_process_groups()
    if torch.distributed.is_available() and torch.distributed.is_initialized():
        torch.distributed.destroy_process_group()
