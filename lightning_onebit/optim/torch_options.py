"""The keyword arguments of ``torch.optim.AdamW`` that the compressed optimizers take so that an AdamW config ports
as it is, checked: each either means what the optimizer does anyway, or is refused with the fix.

* ``amsgrad``, ``maximize``, ``differentiable`` and ``capturable`` change the math or the way a step may run; only
  their defaults (``False``) are accepted, anything else is a ``ValueError`` naming what to do instead.
* ``foreach`` and ``fused`` choose torch's implementation of the same math; these optimizers choose their kernels
  themselves (multi-tensor and fused kernels where they apply, ``kernel_backend`` for the 1-bit exchange), so
  ``None`` (torch's default: "let the optimizer choose") is accepted silently and ``True`` or ``False`` with a
  ``UserWarning`` that says the choice is not theirs to make, rather than a refusal: they never change the result,
  and AdamW configs set them for speed (``fused=True``) often enough that refusing would only make each port edit
  its config.
"""

from __future__ import annotations

import warnings
from typing import Any, Optional

from lightning_onebit._checks import check_flag

#: Why each optimizer has no ``amsgrad`` (the running maximum of the variance).
_NO_AMSGRAD = {
    "OnebitAdam": "its variance is frozen after the warmup",
    "ZeroOneAdam": "its variance is updated on a schedule, then frozen",
    "OnebitLamb": "LAMB keeps no running maximum of the variance, and the variance is frozen after the warmup",
}


def check_torch_adamw_options(
    owner: str,
    *,
    amsgrad: Any,
    maximize: Any,
    differentiable: Any,
    capturable: Any,
    foreach: Any,
    fused: Any,
) -> None:
    """Raise ``ValueError`` for an AdamW option optimizer class ``owner`` cannot honour (``amsgrad``, ``maximize``,
    ``differentiable`` or ``capturable`` other than ``False``; ``foreach`` or ``fused`` other than ``True``,
    ``False`` or ``None``), and warn once per call site for ``foreach`` or ``fused`` given as ``True`` or ``False``
    (see the module docstring)."""
    # why each is not supported, and what to do instead
    refused = {
        "amsgrad": (_NO_AMSGRAD.get(owner, "it has no amsgrad"), "drop the argument (AdamW's default is False)"),
        "maximize": ("it minimises", "minimise the negated objective instead (e.g. return -objective from "
                     "training_step)"),
        "differentiable": ("the 1-bit exchange has no gradient", "drop the argument"),
        "capturable": ("its step decides on the host what to communicate and runs collectives, which a CUDA graph "
                       "cannot capture", "drop the argument"),
    }
    for name, value in (("amsgrad", amsgrad), ("maximize", maximize), ("differentiable", differentiable),
                        ("capturable", capturable)):
        if value is not False:
            why, fix = refused[name]
            raise ValueError(f"{name} must be False, got {value!r}: {owner} does not support {name} ({why}); {fix}")
    for name, value in (("foreach", foreach), ("fused", fused)):
        if value is None:
            continue
        check_flag(value, name, fix=f"or None (the default: {owner} chooses its kernels itself)")
        _warn_implementation_choice(owner, name, value)


def _warn_implementation_choice(owner: str, name: str, value: Optional[bool]) -> None:
    warnings.warn(
        f"{owner}({name}={value}) has no effect: {owner} chooses its kernels itself (torch's multi-tensor and fused "
        f"kernels where they apply, kernel_backend for the 1-bit exchange), and the results do not depend on it. "
        f"Drop {name}={value} to silence this warning.",
        UserWarning,
        stacklevel=4,
    )
