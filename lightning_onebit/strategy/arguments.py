"""What the strategy is given, checked where it is given and before any collective, so that no rank hangs: its own
options, the ``DistributedDataParallel`` arguments (``ddp_kwargs`` and those the strategy takes itself, the
``ddp_comm_hook`` among them), and the optimizer ``configure_optimizers`` returns."""

from __future__ import annotations

from collections.abc import Mapping
from datetime import timedelta
from typing import Any, Callable, Optional, Sequence

import torch
from torch.nn import Module

from lightning_onebit._checks import check_bucket_cap_mb, check_flag, check_integer
from lightning_onebit.optim import CompressedOptimizer

#: ``DistributedDataParallel`` arguments the strategy takes as arguments of its own: (key, strategy argument).
RESERVED_DDP_KWARGS = (
    ("find_unused_parameters", "find_unused_parameters"), ("static_graph", "static_graph"),
    ("gradient_as_bucket_view", "gradient_as_bucket_view"), ("bucket_cap_mb", "ddp_bucket_cap_mb"),
    ("ddp_comm_hook", "ddp_comm_hook"), ("ddp_comm_state", "ddp_comm_state"),
)
#: Lightning ``DDPStrategy`` arguments the strategy does not take, and why.
UNSUPPORTED_DDP_KWARGS = (
    ("ddp_comm_wrapper", "wrap the hook yourself and pass it as ddp_comm_hook"),
    ("model_averaging_period", "post-local SGD does not compose with the compressed exchange"),
)


def check_options(overlap: Any, topology: Any, ranks_per_node: Any) -> None:
    """Raise ``ValueError`` for an ``overlap``, ``topology`` or ``ranks_per_node`` the strategy does not take."""
    check_overlap(overlap)
    if topology not in ("auto", "flat", "hierarchical"):
        raise ValueError(f"topology must be 'auto', 'flat' or 'hierarchical', got {topology!r}")
    check_ranks_per_node(ranks_per_node)


def check_overlap(overlap: Any) -> None:
    """Raise ``ValueError`` unless ``overlap`` is ``"auto"``, ``True`` or ``False`` (both strategies take it)."""
    if overlap not in ("auto", True, False) or (overlap != "auto" and not isinstance(overlap, bool)):
        raise ValueError(f"overlap must be 'auto', True or False, got {overlap!r}")


def check_ranks_per_node(ranks_per_node: Any) -> None:
    """Raise ``ValueError`` unless ``ranks_per_node`` is an integer >= 1 or ``None`` (both strategies take it)."""
    check_integer(ranks_per_node, "ranks_per_node", none=True)


def check_process_group_options(timeout: Any, process_group_backend: Any) -> None:
    """Raise ``ValueError`` unless ``timeout`` is a positive ``datetime.timedelta`` or ``None`` (torch's default) and
    ``process_group_backend`` a string or ``None`` (both strategies pass them to ``init_process_group`` at setup,
    where a wrong type would fail late, on every rank)."""
    if timeout is not None and not (isinstance(timeout, timedelta) and timeout > timedelta(0)):
        raise ValueError(
            f"timeout must be a datetime.timedelta > 0 or None (torch's default), got {timeout!r}; e.g. "
            "timeout=datetime.timedelta(minutes=30)"
        )
    if process_group_backend is not None and not isinstance(process_group_backend, str):
        raise ValueError(
            f"process_group_backend must be a torch.distributed backend name ('nccl', 'gloo', ...) or None (the "
            f"accelerator's default), got {process_group_backend!r}"
        )


def shard_module_classes(shard_modules: Any) -> Optional[tuple[type[Module], ...]]:
    """``OnebitFSDPStrategy``'s ``shard_modules`` as a tuple of module classes (one class alone is a tuple of one;
    ``None`` stays ``None``); ``ValueError`` naming the fix for anything else, a class's name among them."""
    if shard_modules is None:
        return None
    example = "e.g. shard_modules=[TransformerBlock]"
    if isinstance(shard_modules, str) or (
        isinstance(shard_modules, (list, tuple)) and any(isinstance(m, str) for m in shard_modules)
    ):
        raise ValueError(
            f"shard_modules takes module classes, not their names: got {shard_modules!r}. Pass the classes "
            f"({example}); in a LightningCLI config, the CLI resolves class paths "
            "(shard_modules: [my_package.TransformerBlock]) to the classes"
        )
    if isinstance(shard_modules, type):
        shard_modules = (shard_modules,)
    if not isinstance(shard_modules, (list, tuple)):
        raise ValueError(f"shard_modules must be a torch.nn.Module class or a list of them ({example}), got "
                         f"{shard_modules!r}")
    bad = [m for m in shard_modules if not (isinstance(m, type) and issubclass(m, Module))]
    if bad or not shard_modules:
        raise ValueError(
            f"shard_modules must be a non-empty list of torch.nn.Module classes ({example}), got "
            f"{bad or list(shard_modules)!r}"
        )
    return tuple(shard_modules)


def check_mixed_precision(policy: Any) -> None:
    """Raise ``ValueError`` unless ``policy`` is an FSDP2 ``MixedPrecisionPolicy`` whose dtypes are floating point or
    ``None`` and whose ``cast_forward_inputs`` is a bool (an integer ``param_dtype`` would fail only at the first
    forward)."""
    from torch.distributed.fsdp import MixedPrecisionPolicy

    example = "MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)"
    if not isinstance(policy, MixedPrecisionPolicy):
        raise ValueError(f"mixed_precision must be a torch.distributed.fsdp.MixedPrecisionPolicy (e.g. {example}), got "
                         f"{policy!r}")
    for name in ("param_dtype", "reduce_dtype", "output_dtype"):
        dtype = getattr(policy, name)
        if dtype is not None and not (isinstance(dtype, torch.dtype) and dtype.is_floating_point):
            raise ValueError(
                f"mixed_precision's {name} must be a floating-point torch.dtype or None (no cast), got {dtype!r}: "
                f"parameters, gradients and outputs are cast to it; e.g. {example}"
            )
    check_flag(policy.cast_forward_inputs, "mixed_precision's cast_forward_inputs")


def ddp_kwargs_for(
    ddp_kwargs: Optional[dict[str, Any]],
    *,
    find_unused_parameters: bool,
    static_graph: bool,
    gradient_as_bucket_view: bool,
    ddp_bucket_cap_mb: Optional[float],
    ddp_comm_hook: Optional[Callable[..., Any]],
) -> dict[str, Any]:
    """The keyword arguments for Lightning's ``DDPStrategy`` (and through it ``DistributedDataParallel``): a copy of
    ``ddp_kwargs`` with the strategy's own DDP arguments added. ``ValueError`` for a key that must be passed as the
    strategy's argument, for an argument the strategy does not take, and for a ``ddp_comm_hook`` that is no callable
    (the hook itself is not passed on: the strategy calls it from its own DDP hook), and for arguments of the wrong
    type: ``ddp_kwargs`` not a dict, a flag not a bool, a ``ddp_bucket_cap_mb`` not a finite number > 0 or ``None``."""
    if ddp_kwargs is not None and not (isinstance(ddp_kwargs, Mapping) and all(isinstance(k, str) for k in ddp_kwargs)):
        raise ValueError(
            f"ddp_kwargs must be a dict of DistributedDataParallel arguments by name (e.g. {{'broadcast_buffers': "
            f"False}}) or None, got {ddp_kwargs!r}"
        )
    for name, flag in (("find_unused_parameters", find_unused_parameters), ("static_graph", static_graph),
                       ("gradient_as_bucket_view", gradient_as_bucket_view)):
        check_flag(flag, name)
    check_bucket_cap_mb(ddp_bucket_cap_mb, "ddp_bucket_cap_mb", none=True)
    ddp_kwargs = dict(ddp_kwargs or {})
    for reserved, argument in RESERVED_DDP_KWARGS:
        if reserved in ddp_kwargs:
            raise ValueError(f"pass {reserved!r} as the strategy argument {argument}=..., not inside ddp_kwargs")
    for unsupported, why in UNSUPPORTED_DDP_KWARGS:
        if unsupported in ddp_kwargs:
            raise ValueError(f"OnebitStrategy does not take {unsupported!r} ({why})")
    if ddp_comm_hook is not None and not callable(ddp_comm_hook):
        raise ValueError(f"ddp_comm_hook must be a DDP comm hook (a callable), got {ddp_comm_hook!r}")
    ddp_kwargs.update(
        find_unused_parameters=find_unused_parameters,
        static_graph=static_graph,
        gradient_as_bucket_view=gradient_as_bucket_view,
    )
    if ddp_bucket_cap_mb is not None:
        ddp_kwargs["bucket_cap_mb"] = ddp_bucket_cap_mb
    return ddp_kwargs


def the_compressed_optimizer(optimizers: Sequence[Any]) -> CompressedOptimizer:
    """The one compressed optimizer among the ``optimizers`` ``configure_optimizers`` returned (unwrapped from
    Lightning's ``LightningOptimizer``); ``ValueError`` naming the fix for anything else."""
    optimizers = [getattr(o, "_optimizer", o) for o in optimizers]
    if len(optimizers) != 1 or not isinstance(optimizers[0], CompressedOptimizer):
        names = ", ".join(type(o).__name__ for o in optimizers) or "no optimizer"
        raise ValueError(
            "The 'onebit_adam' strategy needs exactly one compressed optimizer (lightning_onebit.OnebitAdam, "
            "lightning_onebit.ZeroOneAdam or lightning_onebit.OnebitLamb), but configure_optimizers returned: "
            f"{names}. Return e.g. "
            "`OnebitAdam(self.parameters(), lr=1e-4, freeze_step=1000)` (in LightningCLI: "
            "`optimizer: {class_path: lightning_onebit.OnebitAdam, init_args: {lr: 1e-4, freeze_step: 1000}}`), "
            "or use strategy='ddp' for other optimizers."
        )
    return optimizers[0]
