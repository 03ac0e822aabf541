"""Replay the behaviour record on an emulated processor: ``python -m tests.behaviour.emulated [--cpu MODEL]``.

Every case of :mod:`tests.behaviour.cases` runs with its ranks under ``qemu-x86_64 -cpu MODEL`` (user-mode emulation:
the processor's CPUID, and so every library's choice of code path, is the emulated model's; the arithmetic is
emulated exactly), default ``Haswell-noTSX``: an Intel processor with AVX2 and FMA and without AVX-512. It checks what
nobody can check without another machine: that a record made on one x86 processor replays bit for bit on another.
``qemu-x86_64 -cpu help`` lists the models (TCG emulates up to AVX2: models with AVX-512 are not emulated).

Prints one JSON line: the instruction-set features the ranks saw, and per case the differences from the record, bit
for bit (:func:`tests.behaviour.compare.bitwise_differences`; an empty list: the same bits). Exits 0 when every case
is the record bit for bit, 1 otherwise, 2 without ``qemu-x86_64`` (Debian: ``apt-get install qemu-user``).
Takes about a minute on 2 cores (emulation is ~10x slower than the machine).
"""

from __future__ import annotations

import argparse
import json
import multiprocessing
import os
import shutil
import sys
import tempfile
from pathlib import Path
from typing import Any

import torch

from tests.behaviour.cases import cases_at, deterministic_cpu_env, processor_features, scenarios, unpack_record
from tests.behaviour.cases import world_sizes
from tests.behaviour.compare import bitwise_differences
from tests.behaviour.record import RECORDS_PATH
from tests.distributed import run_distributed, run_scenarios

SESSION_TIMEOUT_S = 600.0


def _python_under(qemu: str, cpu: str, directory: Path) -> str:
    """A script that runs this Python under ``qemu -cpu cpu``: the ranks' executable."""
    script = directory / "python-emulated"
    script.write_text(f'#!/bin/sh\nexec {qemu} -cpu {cpu} {sys.executable} "$@"\n')
    script.chmod(0o755)
    return str(script)


def replay(cpu: str) -> dict[str, Any]:
    """Every case with its ranks on the emulated ``cpu``; the report :func:`main` prints."""
    qemu = shutil.which("qemu-x86_64")
    if qemu is None:
        raise FileNotFoundError("qemu-x86_64 not found (Debian: apt-get install qemu-user)")
    records = torch.load(RECORDS_PATH, weights_only=True)
    report: dict[str, Any] = dict(cpu=cpu, features=None, cases={})
    with tempfile.TemporaryDirectory() as directory:
        # the fork server, and so every rank forked from it, starts from this executable
        multiprocessing.set_executable(_python_under(qemu, cpu, Path(directory)))
        for world_size in world_sizes():
            with deterministic_cpu_env():
                session = run_distributed(
                    run_scenarios, world_size, (("features", processor_features), *scenarios(world_size)), directory,
                    timeout_s=SESSION_TIMEOUT_S,
                )
            report["features"] = session[0]["features"]
            for case in cases_at(world_size):
                lines = []
                for rank, saved in enumerate(records["cases"][case.name]):
                    replayed = session[rank][case.name]
                    if "__error__" in replayed:
                        lines.append(f"{case.name}, rank {rank}: failed:\n{replayed['__error__']}")
                        continue
                    lines += [f"{case.name}, rank {rank}: {line}"
                              for line in bitwise_differences(unpack_record(saved), replayed)]
                report["cases"][case.name] = lines
    return report


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--cpu", default="Haswell-noTSX", help="a qemu-x86_64 CPU model (default: Haswell-noTSX)")
    args = parser.parse_args()
    if os.uname().machine != "x86_64":
        sys.exit("an x86-64 machine is needed")
    try:
        report = replay(args.cpu)
    except FileNotFoundError as error:
        print(error, file=sys.stderr)
        sys.exit(2)
    print(json.dumps(report))
    sys.exit(1 if any(report["cases"].values()) else 0)


if __name__ == "__main__":
    main()
