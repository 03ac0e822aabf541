"""How many library files one compressed step takes to read (issue 45): the files whose Python functions run during
one steady-state compressed ``step()`` of each optimizer, traced with ``sys.setprofile`` on 2 gloo ranks.

The step reads top-down in the algorithm's own file (fold -> exchange -> mask -> update) over three more optim files:
``base.py`` (``step()`` itself and the bucket helpers), ``buckets.py`` (the exchange part) and ``functional.py`` (the
math). Below them the compressed allreduce (``comm``) and the sign kernels (``kernels``) are the primitives the step
calls, as ``torch.optim.adam`` calls ``torch._foreach_*`` and PowerSGD's hook ``dist.all_reduce``; they are listed
too. Run ``python -m pytest -q -s tests/optim/test_step_files.py`` to see every file.
"""

from __future__ import annotations

import collections
import os
import sys
from pathlib import Path
from typing import Any, Callable

import pytest
import torch

from tests.distributed import run_distributed
from tests.paths import ROOT

LIBRARY = ROOT / "lightning_onebit"
#: The optim-layer files of a compressed step besides the algorithm's own (its parts and math).
PARTS = {"base.py", "buckets.py", "functional.py"}


def _make(name: str) -> Callable[[Any], Any]:
    import lightning_onebit as lo

    return {
        "OnebitAdam": lambda params: lo.OnebitAdam(params, lr=1e-3, freeze_step=2),
        # var_update_scaler=2: steps 1-2 are variance steps, then every other step is a compressed one
        "ZeroOneAdam": lambda params: lo.ZeroOneAdam(params, lr=1e-3, var_freeze_step=100, var_update_scaler=2),
        "OnebitLamb": lambda params: lo.OnebitLamb(params, lr=1e-3, freeze_step=2),
    }[name]


def _traced_step(rank: int, world_size: int, name: str) -> dict[str, Any]:
    """The library files entered during the second compressed step (the first one also lays the buckets out and
    finds the dead coordinates, once), by layer, with the functions entered in each."""
    from lightning_onebit.optim import StepKind

    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.ReLU(), torch.nn.Linear(16, 4))
    optimizer = _make(name)(model.parameters())

    def backward() -> None:
        optimizer.zero_grad()
        model(torch.randn(4, 8)).pow(2).mean().backward()
        if optimizer.needs_gradient_allreduce:  # what the strategy's DDP hook does in the warmup
            for p in model.parameters():
                torch.distributed.all_reduce(p.grad)
                p.grad /= world_size

    compressed_steps = 0
    while compressed_steps < 2:
        kind = optimizer.next_step_kind
        backward()
        if kind is StepKind.COMPRESSED and compressed_steps == 1:
            break
        optimizer.step()
        compressed_steps += kind is StepKind.COMPRESSED
    functions: dict[str, set[str]] = collections.defaultdict(set)
    library = str(LIBRARY)

    def profile(frame: Any, event: str, arg: Any) -> None:
        if event == "call" and frame.f_code.co_filename.startswith(library):
            functions[os.path.relpath(frame.f_code.co_filename, library)].add(frame.f_code.co_name)

    sys.setprofile(profile)
    try:
        optimizer.step()
    finally:
        sys.setprofile(None)
    assert optimizer.last_step_kind is StepKind.COMPRESSED
    return {path: sorted(names) for path, names in functions.items()}


def _by_layer(files: dict[str, list[str]]) -> dict[str, list[str]]:
    layers: dict[str, list[str]] = collections.defaultdict(list)
    for path in sorted(files):
        parts = Path(path).parts
        layers[parts[0] if len(parts) > 1 else "lightning_onebit"].append(parts[-1])
    return dict(layers)


@pytest.mark.parametrize("name, own", [("OnebitAdam", {"onebit_adam.py"}), ("OnebitLamb", {"onebit_lamb.py"}),
                                       ("ZeroOneAdam", {"zeroone_adam.py", "zeroone_schedule.py"})])
def test_a_compressed_step_reads_in_its_own_file_and_three_parts(name: str, own: set[str]) -> None:
    files = run_distributed(_traced_step, 2, name)[0]
    layers = _by_layer(files)
    print(f"\n{name}: {len(files)} library files run in one compressed step; optim {len(layers['optim'])}: "
          f"{layers['optim']}; below it: {({k: v for k, v in layers.items() if k != 'optim'})}")
    for path, names in sorted(files.items()):
        print(f"    {path}: {', '.join(names)}")
    # the algorithm's file, base.py, buckets.py (the exchange) and functional.py (the math); 0/1 Adam's schedule
    # (a part of its own: the step's kind, and its counters after the step) besides
    assert set(layers["optim"]) == own | PARTS
    # nothing above the optimizers, and the exchange goes through the comm layer's compressed allreduce
    assert set(layers) <= {"optim", "comm", "kernels", "lightning_onebit"}
    assert "exchange.py" in layers["comm"]
