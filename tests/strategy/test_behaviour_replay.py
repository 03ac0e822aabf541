"""Replay of the bitwise behaviour record ``tests/behaviour/records.pt`` (made by ``python -m tests.behaviour.record``).

Every case of :mod:`tests.behaviour.cases` (3 optimizers x flat / hierarchical / overlapped exchange x ``32-true`` /
``bf16-mixed``, Lightning fits on gloo CPU ranks) runs again with the code as it is now, and every recorded tensor
(parameters, error feedback, optimizer state) must be bitwise equal to the recording on every rank (``torch.equal``,
and the same bits: signed zeros included), and so must the step count, the per-step losses, the per-step fingerprints
of the parameters and the other recorded values. A failure names the case, the rank and the tensor or value, and
where they first differ.

A failure means the library's numbers changed. If that was not meant (a refactor), the change is a regression. If it
was (a deliberate change of behaviour), rerun the recorder in the same commit and say so in the commit message (see
``tests/behaviour/record.py``).

The cases at one world size run in one spawned session (a module-scoped fixture, started by the first test that needs
it): spawning ranks and importing Lightning in them costs far more than the tiny fits.
"""

from __future__ import annotations

import functools
from typing import Any, Callable

import pytest
import torch

import lightning
from tests.behaviour.cases import CASES, CASES_BY_NAME, deterministic_cpu_env, scenarios, unpack_record
from tests.behaviour.record import RECORDS_PATH
from tests.distributed import run_distributed, run_scenarios, scenario_results
from tests.tensors import same_bits

SESSION_TIMEOUT_S = 300.0
MAX_LINES = 60  # differences listed per failing case


@functools.lru_cache(maxsize=1)
def _records() -> dict[str, Any]:
    return torch.load(RECORDS_PATH, weights_only=True)


@pytest.fixture(scope="module")
def session_at(tmp_path_factory: pytest.TempPathFactory) -> Callable[[int], list[dict[str, Any]]]:
    """``session_at(world_size)``: the per-rank results of every case at that world size, from one spawned session
    (run on first use, then kept for the module; a session that failed fails every test that needs it)."""
    sessions: dict[int, Any] = {}

    def session(world_size: int) -> list[dict[str, Any]]:
        if world_size not in sessions:
            workdir = str(tmp_path_factory.mktemp(f"behaviour{world_size}"))
            try:
                with deterministic_cpu_env():
                    sessions[world_size] = run_distributed(
                        run_scenarios, world_size, scenarios(world_size), workdir, timeout_s=SESSION_TIMEOUT_S
                    )
            except Exception as error:  # noqa: BLE001 - reported by every test of this world size
                sessions[world_size] = error
        result = sessions[world_size]
        if isinstance(result, Exception):
            raise result
        return result

    return session


# ======================================================================================== comparison
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


def _differences(recorded: dict[str, Any], replayed: dict[str, Any]) -> list[str]:
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


def _provenance() -> str:
    meta = _records()["metadata"]
    return (
        f"(recorded at commit {meta['commit'][:12]} with torch {meta['torch']}, lightning {meta['lightning']}; "
        f"replayed with torch {torch.__version__}, lightning {lightning.__version__})"
    )


# ======================================================================================== tests
def test_the_record_holds_exactly_the_current_case_table() -> None:
    records = _records()
    assert sorted(records["cases"]) == sorted(case.name for case in CASES), (
        "tests/behaviour/cases.py and records.pt disagree on the cases: a change of the case table needs a new "
        "recording (python -m tests.behaviour.record), made with the code whose behaviour it records"
    )
    for case in CASES:
        assert records["metadata"]["cases"][case.name] == dict(
            optimizer=case.optimizer, mode=case.mode, precision=case.precision, world_size=case.world_size,
            steps=case.steps,
        ), f"{case.name}: the case's settings changed since the recording"
        assert len(records["cases"][case.name]) == case.world_size


@pytest.mark.parametrize("name", [case.name for case in CASES])
def test_replay_is_bitwise_the_record(session_at: Callable[[int], list[dict[str, Any]]], name: str) -> None:
    case = CASES_BY_NAME[name]
    recorded = [unpack_record(saved) for saved in _records()["cases"][name]]
    replayed = scenario_results(session_at(case.world_size), name)
    assert len(replayed) == len(recorded) == case.world_size
    problems = [
        f"{name}, rank {rank}: {problem}"
        for rank, (old, new) in enumerate(zip(recorded, replayed))
        for problem in _differences(old, new)
    ]
    shown = problems[:MAX_LINES] + ([f"... and {len(problems) - MAX_LINES} more"] if len(problems) > MAX_LINES else [])
    assert not problems, f"the replay differs from the record {_provenance()}:\n" + "\n".join(shown)
