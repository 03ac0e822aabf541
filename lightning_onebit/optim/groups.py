"""The compressed optimizers' arguments and param groups: the constructor's arguments and each param group's options,
checked when given (a ``ValueError`` that names the option and the fix, before any collective), and the full-precision
average of the groups kept out of compression (``compress=False``)."""

from __future__ import annotations

import warnings
from typing import Any, Optional, Sequence, Union, get_args

import torch
import torch.distributed as dist

from lightning_onebit import kernels
from lightning_onebit._checks import check_bucket_cap_mb, check_flag, check_real, is_real
from lightning_onebit.comm.full_precision import full_precision_allreduce_, sparse_rows_allreduce_
from lightning_onebit.comm.state import CompressedAllreduceState
from lightning_onebit.comm.topology import Topology
from lightning_onebit.optim.auto_freeze_config import AutoFreeze
from lightning_onebit.optim.buckets import trainable
from lightning_onebit.optim.freeze import check_freeze_options
from lightning_onebit.optim.masks import DeadCoordinates, describe_param, normalise_masks


def check_optimizer_options(owner: str, freeze_step: Union[int, str], auto_freeze: Optional[AutoFreeze],
                            bucket_cap_mb: float, process_group: Optional[dist.ProcessGroup],
                            topology: Optional[Topology], dead_coordinates: DeadCoordinates,
                            kernel_backend: str) -> Optional[AutoFreeze]:
    """Check the arguments every compressed optimizer (class ``owner``) takes (:class:`~lightning_onebit.OnebitAdam`
    documents them); returns the ``auto_freeze`` that applies (:func:`~lightning_onebit.optim.freeze.
    check_freeze_options`)."""
    auto_freeze = check_freeze_options(freeze_step, auto_freeze, owner)
    check_bucket_cap_mb(bucket_cap_mb, "bucket_cap_mb")
    if process_group is not None and not (dist.is_available() and isinstance(process_group, dist.ProcessGroup)):
        raise ValueError(
            f"process_group must be a torch.distributed.ProcessGroup or None (WORLD), got {process_group!r}"
        )
    if dead_coordinates not in get_args(DeadCoordinates):
        raise ValueError(f"dead_coordinates must be one of {get_args(DeadCoordinates)}, got {dead_coordinates!r}")
    if topology is not None and not isinstance(topology, Topology):
        raise ValueError(
            f"topology must be a lightning_onebit.Topology (from Topology.build), got {type(topology).__name__}"
        )
    kernels.effective_backend(kernel_backend)  # raises on an unknown name
    return auto_freeze


def check_exchange(exchange: Any, compress: Any) -> str:
    """0/1 Adam's ``exchange`` (``"momentum"`` or ``"gradient"``), given as itself or by its former name ``compress``
    (deprecated: it is also the name of the param-group option that keeps a group out of compression), which warns
    with a ``FutureWarning`` at the caller of ``ZeroOneAdam(...)``; a ``ValueError`` for anything else or both."""
    if compress is not None:
        if exchange != "momentum" and compress != exchange:
            raise ValueError(
                f"ZeroOneAdam got exchange={exchange!r} and compress={compress!r}: compress is the former name of "
                "exchange; pass exchange only"
            )
        warnings.warn(
            f"ZeroOneAdam(compress={compress!r}) is deprecated: pass exchange={compress!r} (compress is also the "
            "name of the param-group option that keeps a group out of compression)",
            FutureWarning,
            stacklevel=3,
        )
        exchange = compress
    if exchange not in ("momentum", "gradient"):
        raise ValueError(f"exchange must be 'momentum' or 'gradient', got {exchange!r}")
    return exchange


def check_param_group(group: dict[str, Any], index: int, owner: str) -> None:
    """Check param group ``index`` of optimizer class ``owner`` (``lr``, ``betas``, ``eps``, ``weight_decay``,
    ``bias_correction``, ``compress``, ``sparse_rows``, ``exp_avg_mask``, floating-point parameters) and normalise it
    in place (betas as floats, ``compress`` defaulted to ``True``, ``sparse_rows`` to ``False``, one checked mask or
    ``None`` per parameter). Raises ``ValueError``
    naming the option and the group."""
    where = f" (param group {index})"
    lr, betas = group["lr"], group["betas"]
    if isinstance(lr, torch.Tensor):
        raise ValueError(f"{owner} takes lr as a float, not a tensor{where}; pass lr=float(lr)")
    # finite: a learning rate, eps or weight decay of inf turns the parameters to NaN within two steps (or stops them)
    check_real(lr, "lr", at_least=0.0, where=where, fix="e.g. lr=1e-3")
    check_real(group["eps"], "eps", at_least=0.0, where=where, fix="e.g. eps=1e-8 (AdamW's)")
    check_real(group["weight_decay"], "weight_decay", at_least=0.0, where=where,
               fix="e.g. weight_decay=0.01 (torch.optim.AdamW's default; this optimizer's is 0)")
    if not (isinstance(betas, (tuple, list)) and len(betas) == 2 and all(is_real(b) for b in betas)):
        raise ValueError(f"betas must be a pair of floats (b1, b2), e.g. (0.9, 0.999); got {betas!r}{where}")
    b1, b2 = betas
    if not (0.0 <= b1 < 1.0 and 0.0 <= b2 < 1.0):
        raise ValueError(f"betas must each be in [0, 1), got {betas}{where}")
    group["betas"] = (float(b1), float(b2))
    check_flag(group["bias_correction"], "bias_correction", where=where)
    for i, p in enumerate(group["params"]):
        if not p.is_floating_point():
            raise ValueError(
                f"{owner} trains floating-point parameters only, but {describe_param(group, index, i, p)} "
                f"has dtype {p.dtype}: 1-bit momentum compression has no complex or integer form. Leave it out of "
                "the optimizer (e.g. `[p for p in model.parameters() if p.is_floating_point()]`), or keep a "
                "complex parameter as a real one with a trailing dimension of 2 (torch.view_as_real) and view it "
                "as complex in forward (torch.view_as_complex)."
            )
    compress = _flag(group, "compress", True, where, "compress=False keeps the group out of 1-bit compression (its "
                     "gradients are averaged in full precision every step)")
    sparse_rows = _flag(group, "sparse_rows", False, where, "sparse_rows=True (with compress=False) averages the "
                        "group by sending only its nonzero rows")
    if sparse_rows and compress:
        raise ValueError(
            f"sparse_rows=True applies to a group with compress=False{where}: such a group's gradients are averaged "
            "exactly every step, and sparse_rows sends only their nonzero rows (embedding tables). Give the group "
            '"compress": False as well, e.g. {"params": [embedding.weight], "compress": False, "sparse_rows": True}'
        )
    if "cap_update" in group:  # OnebitAdam's and OnebitLamb's
        _flag(group, "cap_update", True, where, "cap_update=True clips every coordinate of a compressed update at the "
              "largest one an Adam step can have")
    group["exp_avg_mask"] = normalise_masks(group.get("exp_avg_mask"), group, index)


def _flag(group: dict[str, Any], name: str, default: bool, where: str, meaning: str) -> bool:
    """The group's bool option ``name`` (set to ``default`` when absent); anything but a bool is a ``ValueError``."""
    return check_flag(group.setdefault(name, default), name, where=where,
                      fix=f"a string or number is not read as a flag. {meaning}")


def average_gradients_(compression: CompressedAllreduceState, groups: Sequence[dict[str, Any]]) -> None:
    """Average the gradients of the trainable parameters of ``groups`` (the ``compress=False`` ones) over
    ``compression``'s process group, in full precision, in place.

    One ``all_reduce`` per (device, dtype) over all their gradients
    (:func:`~lightning_onebit.comm.full_precision_allreduce_`), and for groups with ``sparse_rows=True`` two
    ``all_gather`` of their nonzero rows (:func:`~lightning_onebit.comm.sparse_rows_allreduce_`). A parameter without a
    gradient on this rank contributes a zero gradient (written into its ``.grad``), as in the compressed groups, so
    that every rank sends the same buffer; afterwards ``.grad`` holds the averaged gradient. Since the momentum is
    identical on every rank before the gradient is folded in, averaging the gradient is averaging the momentum
    exactly.
    """
    dense, sparse = [], []
    for group in groups:
        for p in trainable(group):
            if p.grad is None:
                p.grad = torch.zeros_like(p, memory_format=torch.preserve_format)
            (sparse if group["sparse_rows"] else dense).append(p.grad)
    full_precision_allreduce_(compression, dense)
    sparse_rows_allreduce_(compression, sparse)
