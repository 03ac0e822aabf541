"""A clear error when the ``onebit_adam`` strategy meets the Trainer of the ``pytorch_lightning`` package.

The ``lightning`` package installs Lightning twice, as ``lightning.pytorch`` and as ``pytorch_lightning``: the same code
under two names, whose classes do not mix. :class:`~lightning_onebit.OnebitStrategy` is a ``lightning.pytorch``
strategy, so ``pytorch_lightning.Trainer`` knows neither its names nor its objects and answers "You selected an invalid
strategy name", which does not say what to change. :func:`guard_pytorch_lightning` (called by ``import
lightning_onebit``) makes that Trainer raise :func:`pytorch_lightning_error` instead:

* for a strategy name (``pytorch_lightning.Trainer(strategy="onebit_adam")``): the names are registered in
  ``pytorch_lightning``'s ``StrategyRegistry`` with a factory that raises it;
* for a strategy object (``pytorch_lightning.Trainer(strategy=OnebitStrategy())``): its accelerator connector's check
  of the ``strategy`` argument raises it first (the registry cannot see objects).

``pytorch_lightning`` is never imported here: importing it has side effects on ``lightning.pytorch`` users (it points
``lightning_utilities``' rank-zero logger at ``pytorch_lightning``'s, so ``lightning.pytorch``'s log handlers stop
seeing ``rank_zero_info``). The guard is installed at once when ``pytorch_lightning`` is already imported, else right
after a later import of it. ``lightning.pytorch`` is untouched, and a ``pytorch_lightning`` whose connector has
changed only goes without the clearer error for objects.
"""

from __future__ import annotations

import functools
import importlib.abc
import importlib.util
import logging
import sys
from types import ModuleType
from typing import Any, Callable, NoReturn, Optional, Sequence

from lightning.fabric.strategies import _StrategyRegistry

log = logging.getLogger(__name__)

#: marks the connector check once wrapped, so that it is never wrapped twice
_GUARD_MARK = "_lightning_onebit_guard"


def pytorch_lightning_error(what: str) -> ValueError:
    """The error for ``what`` (a strategy name or class) given to ``pytorch_lightning.Trainer``, saying what to use."""
    return ValueError(
        f"{what} is a `lightning.pytorch` strategy, but this Trainer is `pytorch_lightning.Trainer`. The `lightning` "
        "package ships Lightning twice, as `lightning.pytorch` and as `pytorch_lightning`, and the classes of one do "
        "not work with the other; lightning_onebit is built on `lightning.pytorch`. Use `import lightning.pytorch as "
        "pl` (or `from lightning.pytorch import Trainer`) instead of `import pytorch_lightning as pl`, for the "
        "Trainer, the LightningModule and the callbacks alike."
    )


def guard_pytorch_lightning() -> None:
    """Make ``pytorch_lightning.Trainer`` refuse the ``onebit_adam`` strategies, by name and as objects, with
    :func:`pytorch_lightning_error`: now if ``pytorch_lightning`` is imported, else as soon as it is. Idempotent."""
    if "pytorch_lightning" in sys.modules:
        _install()
    elif not any(isinstance(finder, _GuardAfterImport) for finder in sys.meta_path):
        sys.meta_path.insert(0, _GuardAfterImport())


def _install() -> None:
    """Register the names in ``pytorch_lightning``'s registry and wrap its connector's check (``pytorch_lightning`` is
    imported by now)."""
    try:
        from pytorch_lightning.strategies import StrategyRegistry
        from pytorch_lightning.trainer.connectors import accelerator_connector
    except Exception as error:  # noqa: BLE001 - a broken or other pytorch_lightning goes without the clearer error
        log.debug("lightning_onebit: pytorch_lightning not guarded: %r", error)
        return

    from lightning_onebit.strategy.strategy import OnebitStrategy

    names = _StrategyRegistry()  # the names, as the strategy registers them with lightning.pytorch
    OnebitStrategy.register_strategies(names)
    for name in names:
        if name not in StrategyRegistry:  # a name pytorch_lightning knows already is left alone
            StrategyRegistry.register(
                name,
                functools.partial(_refuse_name, name),
                description="lightning_onebit's strategy: use lightning.pytorch's Trainer, not pytorch_lightning's",
            )
    connector = getattr(accelerator_connector, "_AcceleratorConnector", None)
    check = getattr(connector, "_check_config_and_set_final_flags", None)
    if check is not None and not getattr(check, _GUARD_MARK, False):
        connector._check_config_and_set_final_flags = _refusing_objects(check, OnebitStrategy)


def _refuse_name(name: str, **_: Any) -> NoReturn:
    raise pytorch_lightning_error(f"strategy={name!r}")


def _refusing_objects(check: Callable[..., Any], strategy_class: type) -> Callable[..., Any]:
    """``check`` (the connector's check of the Trainer's arguments), raising first for a ``strategy_class`` object."""

    @functools.wraps(check)
    def refusing(self: Any, *args: Any, **kwargs: Any) -> Any:
        strategy = kwargs.get("strategy", args[0] if args else None)
        if isinstance(strategy, strategy_class):
            raise pytorch_lightning_error(type(strategy).__name__)
        return check(self, *args, **kwargs)

    setattr(refusing, _GUARD_MARK, True)
    return refusing


class _GuardAfterImport(importlib.abc.MetaPathFinder):
    """Runs :func:`_install` right after ``pytorch_lightning`` is imported, then leaves ``sys.meta_path``.

    It finds nothing itself: for ``pytorch_lightning`` it asks the other finders for the spec and has the spec's own
    loader (unchanged, so the module's ``__loader__`` and resources are the usual ones) install the guard once the
    package has run."""

    def __init__(self) -> None:
        self._finding = False

    def find_spec(
        self, fullname: str, path: Optional[Sequence[str]], target: Optional[ModuleType] = None
    ) -> Optional[importlib.machinery.ModuleSpec]:
        if fullname != "pytorch_lightning" or self._finding:
            return None
        self._finding = True
        try:
            spec = importlib.util.find_spec(fullname)  # the other finders (this one answers None while finding)
        finally:
            self._finding = False
        if spec is None or spec.loader is None or not hasattr(spec.loader, "exec_module"):
            return spec
        loader, exec_module = spec.loader, spec.loader.exec_module

        def exec_then_guard(module: ModuleType) -> None:
            exec_module(module)
            del loader.exec_module  # the loader's own method again
            if self in sys.meta_path:
                sys.meta_path.remove(self)
            _install()

        loader.exec_module = exec_then_guard  # on this spec's loader only (a loader per module)
        return spec
