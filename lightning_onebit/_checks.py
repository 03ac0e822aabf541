"""The argument checks every public constructor shares: numbers, integers, flags and choices, each refused with a
``ValueError`` that names the argument, the value it got and what it takes.

The library checks its arguments where they are given (constructors, ``add_param_group``), before any collective, so
that a bad value stops every rank at once instead of failing late on some of them. A message reads
``"<name> must be <what it takes>, got <value>[<where>][; <fix>]"``: ``name`` says whose argument it is (``"lr"``,
``"AutoFreeze seed"``), ``where`` which param group, ``fix`` what to do instead when the requirement alone does not say.
"""

from __future__ import annotations

import math
import numbers
from typing import Any, Optional


def is_real(value: Any) -> bool:
    """A real number (int, float, numpy scalar), not a bool or a tensor."""
    return isinstance(value, numbers.Real) and not isinstance(value, bool)


def is_integer(value: Any) -> bool:
    """A Python int, not a bool (``True`` is no count of steps) or a float such as ``2.0``."""
    return isinstance(value, int) and not isinstance(value, bool)


def _interval(at_least: Optional[float], above: Optional[float], below: Optional[float],
              at_most: Optional[float]) -> str:
    """``" >= 0"``, ``" > 0"``, ``" in [0, 1)"``... for the bounds given (at most one lower and one upper)."""
    low = f"[{at_least:g}" if at_least is not None else f"({above:g}" if above is not None else None
    high = f"{below:g})" if below is not None else f"{at_most:g}]" if at_most is not None else None
    if low and high:
        return f" in {low}, {high}"
    if low:
        return f" >= {at_least:g}" if at_least is not None else f" > {above:g}"
    if high:
        return f" < {below:g}" if below is not None else f" <= {at_most:g}"
    return ""


def _refuse(name: str, what: str, value: Any, where: str, fix: str) -> ValueError:
    shown = f"{value!r}" if is_real(value) or value is None else f"{value!r} ({type(value).__name__})"
    return ValueError(f"{name} must be {what}, got {shown}{where}" + (f"; {fix}" if fix else ""))


def check_real(
    value: Any,
    name: str,
    *,
    at_least: Optional[float] = None,
    above: Optional[float] = None,
    below: Optional[float] = None,
    at_most: Optional[float] = None,
    unit: str = "",
    none: bool = False,
    what: str = "",
    where: str = "",
    fix: str = "",
) -> Optional[float]:
    """``value`` as a float if it is a finite real number within the bounds given (``at_least <= value``,
    ``above < value``, ``value < below``, ``value <= at_most``), or ``None`` if it is ``None`` and ``none`` allows
    it; else ``ValueError``: ``"<name> must be a finite number >= 0 (<unit>), got inf<where>; <fix>"`` (``what``
    replaces ``"a finite number >= 0 (<unit>)"`` where the bounds need words). NaN and the infinities are refused (a
    learning rate of ``inf`` turns the parameters to NaN in two steps); so are bools and strings (``"1e-3"`` from a
    config is not read as a number)."""
    if value is None and none:
        return None
    what = what or "a finite number" + _interval(at_least, above, below, at_most) + (f" ({unit})" if unit else "")
    what += " or None" if none else ""
    if not is_real(value) or not math.isfinite(value):
        raise _refuse(name, what, value, where, fix)
    if ((at_least is not None and not value >= at_least) or (above is not None and not value > above)
            or (below is not None and not value < below) or (at_most is not None and not value <= at_most)):
        raise _refuse(name, what, value, where, fix)
    return float(value)


def check_integer(
    value: Any,
    name: str,
    *,
    at_least: Optional[int] = 1,
    at_most: Optional[int] = None,
    none: bool = False,
    what: str = "",
    where: str = "",
    fix: str = "",
) -> Optional[int]:
    """``value`` as an int if it is an integer (not a bool, not a float such as ``2.0``) within the bounds, or
    ``None`` if it is ``None`` and ``none`` allows it; else ``ValueError``: ``"<name> must be an integer >= 1, got
    2.5"`` (``what`` replaces ``"an integer >= 1"`` where the bounds need words)."""
    if value is None and none:
        return None
    what = (what or "an integer" + _interval(at_least, None, None, at_most)) + (" or None" if none else "")
    if (not is_integer(value) or (at_least is not None and value < at_least)
            or (at_most is not None and value > at_most)):
        raise _refuse(name, what, value, where, fix)
    return int(value)


def check_flag(value: Any, name: str, *, where: str = "", fix: str = "") -> bool:
    """``value`` if it is ``True`` or ``False``, else ``ValueError`` (``"no"``, ``0`` and ``1`` are not read as truth
    values: ``bool("no")`` is ``True``)."""
    if not isinstance(value, bool):
        raise _refuse(name, "True or False", value, where, fix or "a string or number is not read as a flag")
    return value


#: The largest bucket size in MB: DDP counts a bucket's bytes in an int64 (``int(bucket_cap_mb * 2**20)``).
MAX_BUCKET_CAP_MB = 2.0**43


def check_bucket_cap_mb(value: Any, name: str, *, none: bool = False) -> Optional[float]:
    """A bucket size in MB (the optimizers' ``bucket_cap_mb``, ``OnebitStrategy(ddp_bucket_cap_mb=...)``): a number
    > 0 and below :data:`MAX_BUCKET_CAP_MB` (``inf`` overflowed the byte count with a bare ``OverflowError``; a size
    larger than the model already gives one bucket per device and dtype)."""
    return check_real(value, name, above=0.0, below=MAX_BUCKET_CAP_MB, none=none,
                      what="a number > 0 (MB) below 2**43 (its bytes must fit an int64)",
                      fix="e.g. 25 (DDP's default); a size larger than the model gives one bucket")
