"""How a replay of the behaviour record is compared with it: bit for bit (:func:`bitwise_differences`), or, on a
processor with other instruction-set features than the record's, up to rounding (:func:`portable_differences`); see
``tests/strategy/test_behaviour_replay.py``. Each returns one line per difference, naming the tensor or value and
where it first differs."""

from __future__ import annotations

import math
from typing import Any

import torch

from tests.behaviour.cases import cpu_description
from tests.tensors import same_bits

#: Portable comparison: a tensor may move by ``PORTABLE_RTOL`` of its root mean square (plus ``PORTABLE_ATOL``) and the
#: losses by a relative ``PORTABLE_LOSS_RTOL``. Measured: replayed with torch's kernels for another instruction set
#: (``ATEN_CPU_CAPABILITY=avx2`` or ``avx512`` instead of ``default``, which changes the rounding of nearly every op),
#: no tensor of any case moved by more than 2.7e-4 of its RMS (largest absolute move 1.0e-5) and no loss by more than
#: 1e-6 relative; tensors that are zero up to rounding (0/1 Adam's update error feedback, RMS ~1e-11) moved by at most
#: 2.3e-10. A change of behaviour moves them by percents (``test_portable_comparison_catches_changes_of_behaviour``).
PORTABLE_RTOL = 1e-3
PORTABLE_ATOL = 1e-7
PORTABLE_LOSS_RTOL = 1e-4
#: values that are rounding-dependent bits by construction (compared through the losses and the tensors instead)
BITS_ONLY = ("param_bits_by_step",)


def _tensor_difference(recorded: torch.Tensor, replayed: torch.Tensor) -> str:
    if recorded.dtype != replayed.dtype or recorded.shape != replayed.shape:
        return (
            f"recorded {recorded.dtype} {tuple(recorded.shape)}, replayed {replayed.dtype} {tuple(replayed.shape)}"
        )
    a, b = recorded.reshape(-1), replayed.reshape(-1)
    differ = (a != b) & ~(a.isnan() & b.isnan())
    if not differ.any():
        return "the values compare equal but their bits differ (signed zeros or NaN payloads)"
    first = int(differ.nonzero()[0])
    largest = (a.double() - b.double()).abs().nan_to_num(nan=float("inf")).max().item()
    return (
        f"{int(differ.sum())} of {a.numel()} elements differ; first at flat index {first}: recorded "
        f"{a[first].item()!r}, replayed {b[first].item()!r}; largest |difference| {largest:.3g}"
    )


def _first_difference(recorded: list, replayed: list) -> str:
    for step, (a, b) in enumerate(zip(recorded, replayed), start=1):
        if a != b:
            return f"first differs at step {step}: recorded {a!r}, replayed {b!r}"
    return f"recorded {len(recorded)} entries, replayed {len(replayed)}"


def _bits(values: list[float]) -> list[str]:
    return [float(v).hex() for v in values]


def bitwise_differences(recorded: dict[str, Any], replayed: dict[str, Any]) -> list[str]:
    """Every way ``replayed`` (one rank's record) differs from ``recorded``, one line each: the values first (the
    per-step losses and parameter fingerprints name the first step that differs), then the tensors."""
    problems = []
    old, new = recorded["values"], replayed["values"]
    for key in [*old, *(k for k in new if k not in old)]:
        if key not in new or key not in old:
            problems.append(f"value {key!r}: {'recorded, but not in the replay' if key not in new else 'not recorded'}")
        elif key == "losses":
            if _bits(old[key]) != _bits(new[key]):
                problems.append(f"losses: {_first_difference(_bits(old[key]), _bits(new[key]))}")
        elif key == "param_bits_by_step":
            if old[key] != new[key]:
                problems.append(f"parameters after each step (fingerprints): {_first_difference(old[key], new[key])}")
        elif old[key] != new[key]:
            problems.append(f"value {key!r}: recorded {old[key]!r}, replayed {new[key]!r}")
    old, new = recorded["tensors"], replayed["tensors"]
    for name in old:
        if name not in new:
            problems.append(f"tensor {name!r}: recorded, but not in the replay")
        elif not same_bits(old[name], new[name]):
            problems.append(f"tensor {name!r}: {_tensor_difference(old[name], new[name])}")
    problems += [f"tensor {name!r}: in the replay, but not recorded" for name in new if name not in old]
    return problems


def _portable_value_difference(key: str, old: Any, new: Any) -> str:
    """How ``new`` differs from ``old`` in what does not depend on rounding: floats to ``PORTABLE_LOSS_RTOL``,
    everything else exactly ('' if it does not)."""
    if isinstance(old, float) and isinstance(new, float):
        close = (math.isnan(old) and math.isnan(new)) or math.isclose(old, new, rel_tol=PORTABLE_LOSS_RTOL)
        return "" if close else f"{key}: recorded {old!r}, replayed {new!r}"
    if isinstance(old, (list, tuple)) and isinstance(new, (list, tuple)):
        if len(old) != len(new):
            return f"{key}: recorded {len(old)} entries, replayed {len(new)}"
        for i, (a, b) in enumerate(zip(old, new)):
            found = _portable_value_difference(f"{key}[{i}]", a, b)
            if found:
                return found
        return ""
    if isinstance(old, dict) and isinstance(new, dict):
        if sorted(map(str, old)) != sorted(map(str, new)):
            return f"{key}: recorded keys {sorted(map(str, old))}, replayed {sorted(map(str, new))}"
        for k in old:
            found = _portable_value_difference(f"{key}[{k!r}]", old[k], new[k])
            if found:
                return found
        return ""
    return "" if old == new else f"{key}: recorded {old!r}, replayed {new!r}"


def _portable_tensor_difference(recorded: torch.Tensor, replayed: torch.Tensor) -> str:
    """'' if ``replayed`` is ``recorded`` up to rounding (see ``PORTABLE_RTOL``), else how it differs."""
    if recorded.dtype != replayed.dtype or recorded.shape != replayed.shape:
        return f"recorded {recorded.dtype} {tuple(recorded.shape)}, replayed {replayed.dtype} {tuple(replayed.shape)}"
    a, b = recorded.reshape(-1).double(), replayed.reshape(-1).double()
    if not torch.equal(a.isnan(), b.isnan()):
        return f"NaN at other places: {int(a.isnan().sum())} recorded, {int(b.isnan().sum())} replayed"
    finite = ~a.isnan()
    a, b = a[finite], b[finite]
    if a.numel() == 0:
        return ""
    rms = float(a.square().mean().sqrt())
    largest = float((a - b).abs().max())
    bound = PORTABLE_RTOL * rms + PORTABLE_ATOL
    if largest <= bound:  # inf - inf is NaN: not <=, so an inf that moved or appeared fails too
        return ""
    return f"moved by up to {largest:.3g}, beyond what rounding moves ({bound:.3g}: RMS {rms:.3g})"


def portable_differences(recorded: dict[str, Any], replayed: dict[str, Any]) -> list[str]:
    """Every way ``replayed`` (one rank's record) differs from ``recorded`` beyond rounding, one line each."""
    problems = []
    old, new = recorded["values"], replayed["values"]
    for key in [*old, *(k for k in new if k not in old)]:
        if key in BITS_ONLY:
            continue
        if key not in new or key not in old:
            problems.append(f"value {key!r}: {'recorded, but not in the replay' if key not in new else 'not recorded'}")
            continue
        found = _portable_value_difference(key, old[key], new[key])
        if found:
            problems.append(f"value {found}")
    old, new = recorded["tensors"], replayed["tensors"]
    for name in old:
        if name not in new:
            problems.append(f"tensor {name!r}: recorded, but not in the replay")
            continue
        found = _portable_tensor_difference(old[name], new[name])
        if found:
            problems.append(f"tensor {name!r}: {found}")
    problems += [f"tensor {name!r}: in the replay, but not recorded" for name in new if name not in old]
    return problems


def comparison_mode(metadata: dict[str, Any]) -> tuple[str, str]:
    """``("bitwise", why)`` on a processor with the instruction-set features of the record's (``metadata``, the
    record's), else ``("portable", why)``."""
    recorded = metadata.get("cpu", {}).get("features")
    here = cpu_description()["features"]
    if recorded == here:
        return "bitwise", "this processor has the recorded instruction-set features"
    missing = sorted(set(recorded or ()) - set(here))
    extra = sorted(set(here) - set(recorded or ()))
    return "portable", (
        f"this processor's instruction-set features differ from the record's (missing {missing}, extra {extra})"
    )
