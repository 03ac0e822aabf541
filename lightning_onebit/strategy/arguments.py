"""What the strategy is given, checked where it is given and before any collective, so that no rank hangs: its own
options, the ``DistributedDataParallel`` arguments (``ddp_kwargs`` and those the strategy takes itself, the
``ddp_comm_hook`` among them), and the optimizer ``configure_optimizers`` returns."""

from __future__ import annotations

from typing import Any, Callable, Optional, Sequence

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
    if ranks_per_node is not None and (
        isinstance(ranks_per_node, bool) or not isinstance(ranks_per_node, int) or ranks_per_node < 1
    ):
        raise ValueError(f"ranks_per_node must be an integer >= 1 or None, got {ranks_per_node!r}")


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
    (the hook itself is not passed on: the strategy calls it from its own DDP hook)."""
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
