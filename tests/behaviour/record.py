"""Record the library's bitwise behaviour: ``python -m tests.behaviour.record`` (from the repository root).

Runs every case of :mod:`tests.behaviour.cases` (OnebitAdam, ZeroOneAdam and OnebitLamb; flat, hierarchical and
overlapped exchange; ``32-true`` and ``bf16-mixed``: Lightning fits on gloo CPU ranks, a warmup then compression-stage
steps) and writes ``tests/behaviour/records.pt``: ``{"cases": {case name: [record of rank 0, rank 1, ...]},
"metadata": {...}}``. The metadata hold the git commit whose code made the recording (``git rev-parse HEAD``;
library files that differed from it, if any, under ``dirty``), the torch and lightning versions, the CPU environment,
the processor (:func:`tests.behaviour.cases.cpu_description`: model, vendor, flags, the features a replay compares)
and the case table. Each record (stored packed, :func:`tests.behaviour.cases.pack_record`) holds every parameter, the
error-feedback buffers, the optimizer state, the step count and the per-step losses (see :mod:`tests.behaviour.cases`).
``tests/strategy/test_behaviour_replay.py`` replays the same runs and requires every recorded tensor and value to match
bit for bit.

When to rerun it: never, as long as the library's numerical behaviour is meant to stay what it is (refactors,
performance work, reorganisation: the replay test is what shows them behaviour-preserving, and rerunning the recorder
to make it pass defeats it). Rerun it only with a change that is *meant* to change the numbers (a bug fix in an update
rule, a new default, a torch upgrade that changes kernels), in the same commit as that change, and say so in the
commit message (which cases changed, and why), so that the history shows where the recorded behaviour changed.

Options: ``--output PATH`` writes elsewhere (e.g. to compare two recordings); ``--world-size N`` (repeatable) records
only the cases at those world sizes (for trying things; the committed file holds every case).
"""

from __future__ import annotations

import argparse
import subprocess
import tempfile
import time
from pathlib import Path
from typing import Any, Optional

import torch

import lightning
from tests.behaviour.cases import (
    CASES,
    DETERMINISTIC_CPU_ENV,
    cases_at,
    cpu_description,
    deterministic_cpu_env,
    pack_record,
    scenarios,
    world_sizes,
)
from tests.distributed import run_distributed, run_scenarios

RECORDS_PATH = Path(__file__).with_name("records.pt")
#: seconds one world size's spawned session may take (every case at that world size, one after another)
SESSION_TIMEOUT_S = 600.0


def run_world_size(world_size: int) -> dict[str, list[dict[str, Any]]]:
    """Every case at ``world_size`` in one spawned session: ``{case name: per-rank records}``; raises on a rank's
    error."""
    with tempfile.TemporaryDirectory() as workdir, deterministic_cpu_env():
        session = run_distributed(
            run_scenarios, world_size, scenarios(world_size), workdir, timeout_s=SESSION_TIMEOUT_S
        )
    out: dict[str, list[dict[str, Any]]] = {}
    for case in cases_at(world_size):
        ranks = [results[case.name] for results in session]
        for rank, result in enumerate(ranks):
            if "__error__" in result:
                raise RuntimeError(f"case {case.name} failed on rank {rank}:\n{result['__error__']}")
        out[case.name] = ranks
    return out


def _git(*args: str) -> str:
    root = Path(__file__).resolve().parents[2]
    return subprocess.run(["git", *args], cwd=root, capture_output=True, text=True, check=True).stdout.strip()


def metadata() -> dict[str, Any]:
    return dict(
        commit=_git("rev-parse", "HEAD"),
        # library files that differed from that commit when the recording was made (should be none)
        dirty=_git("status", "--porcelain", "--untracked-files=all", "--", "lightning_onebit").splitlines(),
        torch=str(torch.__version__),
        lightning=str(lightning.__version__),
        environment=dict(DETERMINISTIC_CPU_ENV),
        cpu=cpu_description(),
        cases={case.name: dict(optimizer=case.optimizer, mode=case.mode, precision=case.precision,
                               world_size=case.world_size, steps=case.steps) for case in CASES},
    )


def record(output: Path = RECORDS_PATH, only: Optional[list[int]] = None) -> dict[str, Any]:
    cases: dict[str, list[dict[str, Any]]] = {}
    for world_size in world_sizes():
        if only and world_size not in only:
            continue
        start = time.monotonic()
        cases.update(run_world_size(world_size))
        print(f"world size {world_size}: {len(cases_at(world_size))} cases in {time.monotonic() - start:.1f} s")
    packed = {name: [pack_record(r) for r in ranks] for name, ranks in cases.items()}
    # the ranks of a case (and cases alike) have the same tensor index: one shared object, which pickle stores once
    shared: dict[tuple, list] = {}
    for ranks in packed.values():
        for saved in ranks:
            index = saved["packed"]["index"]
            saved["packed"]["index"] = shared.setdefault(tuple(index), index)
    records = dict(cases=packed, metadata=metadata())
    if records["metadata"]["dirty"]:
        print("WARNING: the library differs from the commit recorded in the metadata:", *records["metadata"]["dirty"])
    torch.save(records, output)
    print(f"wrote {output} ({output.stat().st_size} bytes, {len(cases)} cases)")
    return records


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--output", type=Path, default=RECORDS_PATH)
    parser.add_argument("--world-size", type=int, action="append", dest="only")
    args = parser.parse_args()
    if args.only and args.output.resolve() == RECORDS_PATH.resolve():
        parser.error("--world-size records only some cases: write them elsewhere with --output")
    record(args.output, args.only)


if __name__ == "__main__":
    main()
