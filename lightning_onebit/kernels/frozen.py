"""Per-element functions of a frozen variance (Adam's denominator ``sqrt(v) / sqrt(bc2) + eps``, ...), computed once
and reused for as long as the variance tensor does not change.

In the compression stage of 1-bit Adam and 1-bit LAMB the variance ``v`` is frozen, so its denominator is a constant
that the update would otherwise recompute every step (a full-size temporary and three passes over memory). The cache
is keyed by the variance tensor itself (held weakly: an entry dies with its tensor) and by the name of the function;
an entry is valid while the tensor's version counter (bumped by every in-place write, ``copy_`` and ``set_``
included), its shape and the constants the function depends on (``eps``, bias corrections) are those it was computed
with (writes through ``v.data`` are not seen: optimizer code writes the state tensors themselves). So a variance step
(0/1 Adam), a ``load_state_dict`` (new tensors), a changed ``eps`` or a changed bias correction recompute it, into the
same buffer.

Cost: one tensor of the variance's size per cached function, for as long as the variance lives.
"""

from __future__ import annotations

from typing import Any, Callable, Hashable

import torch
from torch.utils.weak import WeakIdKeyDictionary

# variance tensor -> {function name: (stamp, cached tensor)}
_CACHE: WeakIdKeyDictionary = WeakIdKeyDictionary()


def _stamp(v: torch.Tensor, constants: Hashable) -> Any:
    try:
        version = v._version
    except RuntimeError:  # an inference-mode tensor has no version counter: never cached
        return None
    return (version, v.dtype, v.device, tuple(v.shape), constants)


def cached(
    v: torch.Tensor, name: str, constants: Hashable, compute_into: Callable[[torch.Tensor, torch.Tensor], None]
) -> torch.Tensor:
    """``f(v)`` for the function ``name`` with these ``constants``: the cached tensor while ``v`` is unchanged, else
    ``compute_into(v, out)`` writes it into ``out`` (the previous buffer, or a new one like ``v``) and it is kept.

    ``compute_into`` must be a pure function of ``v`` and ``constants`` (no host synchronisation: it runs on the
    device's queue like any other op)."""
    stamp = _stamp(v, constants)
    entries = _CACHE.get(v) if stamp is not None else None
    entry = entries.get(name) if entries is not None else None
    if entry is not None and entry[0] == stamp:
        return entry[1]
    out = entry[1] if entry is not None and _same_layout(entry[1], v) else torch.empty_like(v)
    with torch.no_grad():
        compute_into(v, out)
    if stamp is not None:
        if entries is None:
            entries = _CACHE[v] = {}
        entries[name] = (stamp, out)
    return out


def _same_layout(a: torch.Tensor, b: torch.Tensor) -> bool:
    return a.shape == b.shape and a.dtype == b.dtype and a.device == b.device
