"""Replay of the behaviour record ``tests/behaviour/records.pt`` (made by ``python -m tests.behaviour.record``).

Every case of :mod:`tests.behaviour.cases` (3 optimizers x flat / hierarchical / overlapped exchange x ``32-true`` /
``bf16-mixed``, Lightning fits on gloo CPU ranks) runs again with the code as it is now and is compared with the
record, on every rank:

* **bit for bit** where the processor has the instruction-set features of the one that made the record (the record's
  ``metadata["cpu"]["features"]``, :func:`tests.behaviour.cases.cpu_description`): every recorded tensor
  (parameters, error feedback, optimizer state) with the same bits (``torch.equal``, and signed zeros and NaN
  payloads too), and so the step count, the per-step losses, the per-step fingerprints of the parameters and the
  other recorded values. That is the check a refactor must pass, and CI runs it. The library's numbers are meant to
  be the same bits on every x86 processor (``test_replay_is_bitwise_on_an_emulated_intel_cpu`` holds it to that on an
  emulated Intel Haswell, when ``qemu-x86_64`` is installed), but a processor nobody here has tried may still take
  another code path in a library below (MKL, oneDNN), so elsewhere the replay is:
* **portable**: what cannot depend on rounding compared exactly (step counts, steps by kind, bucket layouts, overlap
  figures, forced syncs, non-tensor optimizer state, shapes, dtypes, where the NaNs are), the per-step losses to a
  relative ``1e-4``, and every tensor within ``PORTABLE_RTOL`` of its root mean square (plus ``PORTABLE_ATOL``): far
  above what rounding moves and far below what a change of behaviour does (``test_portable_comparison_*``). The
  parameter fingerprints (bits) are not compared there.

A failure names the case, the rank and the tensor or value, and where they first differ. It means the library's
numbers changed. If that was not meant (a refactor), the change is a regression. If it was (a deliberate change of
behaviour), rerun the recorder in the same commit and say so in the commit message (see ``tests/behaviour/record.py``).

The cases at one world size run in one spawned session (a module-scoped fixture, started by the first test that needs
it): spawning ranks and importing Lightning in them costs far more than the tiny fits.
"""

from __future__ import annotations

import functools
import json
import platform
import shutil
import subprocess
import sys
from typing import Any, Callable, Optional

import pytest
import torch

import lightning
from tests.behaviour.cases import (
    CASES,
    CASES_BY_NAME,
    DETERMINISTIC_CPU_ENV,
    cpu_description,
    deterministic_cpu_env,
    scenarios,
    unpack_record,
)
from tests.behaviour.compare import bitwise_differences, comparison_mode, portable_differences
from tests.behaviour.record import RECORDS_PATH
from tests.distributed import run_distributed, run_scenarios, scenario_results
from tests.paths import ROOT, script_env

SESSION_TIMEOUT_S = 300.0
MAX_LINES = 60  # differences listed per failing case
#: the ranks with torch's kernels for AVX2 instead of the record's ISA-independent ones: another rounding of nearly
#: every op, as on a processor that takes other code paths
OTHER_ROUNDING_ENV = {**DETERMINISTIC_CPU_ENV, "ATEN_CPU_CAPABILITY": "avx2"}


@functools.lru_cache(maxsize=1)
def _records() -> dict[str, Any]:
    return torch.load(RECORDS_PATH, weights_only=True)


def _recorded(name: str) -> list[dict[str, Any]]:
    return [unpack_record(saved) for saved in _records()["cases"][name]]


@pytest.fixture(scope="module")
def session_at(tmp_path_factory: pytest.TempPathFactory) -> Callable[..., list[dict[str, Any]]]:
    """``session_at(world_size, environment=None)``: the per-rank results of every case at that world size, from one
    spawned session under ``environment`` (default: the record's; run on first use, then kept for the module; a
    session that failed fails every test that needs it)."""
    sessions: dict[tuple, Any] = {}

    def session(world_size: int, environment: Optional[dict[str, str]] = None) -> list[dict[str, Any]]:
        key = (world_size, tuple(sorted((environment or {}).items())))
        if key not in sessions:
            workdir = str(tmp_path_factory.mktemp(f"behaviour{world_size}"))
            try:
                with deterministic_cpu_env(environment):
                    sessions[key] = run_distributed(
                        run_scenarios, world_size, scenarios(world_size, environment), workdir,
                        timeout_s=SESSION_TIMEOUT_S,
                    )
            except Exception as error:  # noqa: BLE001 - reported by every test of this world size
                sessions[key] = error
        result = sessions[key]
        if isinstance(result, Exception):
            raise result
        return result

    return session


def _provenance() -> str:
    meta = _records()["metadata"]
    cpu = meta.get("cpu", {})
    return (
        f"(recorded at commit {meta['commit'][:12]} with torch {meta['torch']}, lightning {meta['lightning']} on "
        f"{cpu.get('model') or 'an unnamed processor'}; replayed with torch {torch.__version__}, "
        f"lightning {lightning.__version__} on {cpu_description()['model'] or 'an unnamed processor'})"
    )


def _problems(name: str, recorded: list[dict[str, Any]], replayed: list[dict[str, Any]], mode: str) -> list[str]:
    differences = bitwise_differences if mode == "bitwise" else portable_differences
    problems = [
        f"{name}, rank {rank}: {problem}"
        for rank, (old, new) in enumerate(zip(recorded, replayed))
        for problem in differences(old, new)
    ]
    return problems[:MAX_LINES] + ([f"... and {len(problems) - MAX_LINES} more"] if len(problems) > MAX_LINES else [])


# ======================================================================================== the record
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


def test_the_record_names_its_processor() -> None:
    cpu = _records()["metadata"]["cpu"]
    assert {"features", "vendor", "model", "flags", "machine", "libc"} <= set(cpu)
    assert cpu["features"] and cpu["features"] == sorted(cpu["features"]) and "SSE2" in cpu["features"]


# ======================================================================================== the replay
@pytest.mark.parametrize("name", [case.name for case in CASES])
def test_replay_matches_the_record(session_at: Callable[..., list[dict[str, Any]]], name: str) -> None:
    """Bit for bit on a processor with the recorded features (CI's), else the portable comparison."""
    case = CASES_BY_NAME[name]
    recorded = _recorded(name)
    replayed = scenario_results(session_at(case.world_size), name)
    assert len(replayed) == len(recorded) == case.world_size
    mode, why = comparison_mode(_records()["metadata"])
    problems = _problems(name, recorded, replayed, mode)
    assert not problems, f"the replay differs from the record, compared {mode} ({why}) {_provenance()}:\n" + (
        "\n".join(problems)
    )


@pytest.mark.skipif(platform.machine() != "x86_64" or shutil.which("qemu-x86_64") is None,
                    reason="needs qemu-x86_64 (Debian: apt-get install qemu-user) on an x86-64 machine")
def test_replay_is_bitwise_on_an_emulated_intel_cpu() -> None:
    """The ranks run under ``qemu-x86_64 -cpu Haswell-noTSX``: a processor of another vendor (Intel) without AVX-512
    (``python -m tests.behaviour.emulated``). Every case is the record bit for bit there too: the library's numbers do
    not depend on the processor. (Before the library took correctly rounded square roots, 0/1 Adam's and 1-bit
    LAMB's cases differed there from step 8, by one unit in the last place, as on a user's Intel Xeon.)"""
    result = subprocess.run(
        [sys.executable, "-m", "tests.behaviour.emulated", "--cpu", "Haswell-noTSX"], cwd=ROOT, env=script_env(),
        capture_output=True, text=True, timeout=900,
    )
    assert result.stdout.strip(), f"no report (exit {result.returncode}):\n{result.stderr[-4000:]}"
    report = json.loads(result.stdout.strip().splitlines()[-1])
    assert "AVX512F" not in report["features"] and "AVX2" in report["features"], report["features"]
    assert sorted(report["cases"]) == sorted(case.name for case in CASES)
    problems = [line for lines in report["cases"].values() for line in lines]
    assert not problems, "the emulated replay differs from the record:\n" + "\n".join(problems[:MAX_LINES])
    assert result.returncode == 0, result.stderr[-4000:]


# ======================================================================================== the portable comparison
def test_portable_comparison_accepts_another_rounding(session_at: Callable[..., list[dict[str, Any]]]) -> None:
    """Replayed with torch's AVX2 kernels (other rounding in nearly every op, as on a processor that takes other code
    paths), the cases differ from the record in their bits, and the portable comparison accepts every one."""
    if "AVX2" not in cpu_description()["features"]:
        pytest.skip("this processor has no AVX2: torch has no other kernels to round differently")
    differ = []
    for world_size in sorted({case.world_size for case in CASES}):
        session = session_at(world_size, OTHER_ROUNDING_ENV)
        for case in (c for c in CASES if c.world_size == world_size):
            recorded, replayed = _recorded(case.name), scenario_results(session, case.name)
            assert not _problems(case.name, recorded, replayed, "portable"), case.name
            differ += [case.name] if _problems(case.name, recorded, replayed, "bitwise") else []
    assert len(differ) == len(CASES), f"the other rounding left cases bitwise the record: {set(CASES_BY_NAME) - set(differ)}"


def _nudged(value: torch.Tensor, every: int = 3) -> torch.Tensor:
    """``value`` with every ``every``-th element one unit in the last place up: a difference of rounding."""
    out = value.clone()
    flat = out.reshape(-1)
    flat[::every] = torch.nextafter(flat[::every], torch.full_like(flat[::every], float("inf")))
    return out


def _with(record: dict[str, Any], tensors: Optional[dict] = None, values: Optional[dict] = None) -> dict[str, Any]:
    return dict(tensors={**record["tensors"], **(tensors or {})}, values={**record["values"], **(values or {})})


def test_portable_comparison_accepts_last_place_differences() -> None:
    recorded = _recorded("OnebitLamb-hierarchical-32-true")[1]
    nudged = _with(recorded, tensors={k: _nudged(t) for k, t in recorded["tensors"].items() if t.is_floating_point()},
                   values=dict(losses=[v * (1 + 2**-52) for v in recorded["values"]["losses"]]))
    assert bitwise_differences(recorded, nudged)
    assert portable_differences(recorded, nudged) == []


def test_portable_comparison_catches_changes_of_behaviour() -> None:
    """Changes the library could make: a tensor off by 1%, a loss off by 0.1%, another step count or step kinds or
    bucket layout, a NaN, a missing tensor; and the same case at another precision (a real change of the numbers)."""
    recorded = _recorded("OnebitAdam-flat-32-true")[0]
    name = "param/l2.weight"
    nan = recorded["tensors"][name].clone()
    nan[3] = float("nan")
    changed = {
        "a tensor 1% off": _with(recorded, tensors={name: recorded["tensors"][name] * 1.01}),
        "one element moved": _with(recorded, tensors={name: recorded["tensors"][name].index_add(
            0, torch.tensor([5]), torch.tensor([0.01]))}),
        "a loss 0.1% off": _with(recorded, values=dict(losses=[*recorded["values"]["losses"][:-1],
                                                              recorded["values"]["losses"][-1] * 1.001])),
        "another step count": _with(recorded, values=dict(step_count=recorded["values"]["step_count"] + 1)),
        "other step kinds": _with(recorded, values=dict(steps_by_kind={"warmup": 4, "compressed": 3})),
        "another layout": _with(recorded, values=dict(bucket_layouts={0: (56,), 1: (64,), 2: (17,)})),
        "a NaN": _with(recorded, tensors={name: nan}),
        "a missing tensor": dict(tensors={k: t for k, t in recorded["tensors"].items() if k != name},
                                 values=recorded["values"]),
        "another precision": _recorded("OnebitAdam-flat-bf16-mixed")[0],
    }
    for what, record in changed.items():
        assert portable_differences(recorded, record), f"{what}: not caught"
