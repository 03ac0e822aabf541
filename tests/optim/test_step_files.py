"""How many library files one compressed step takes to read (issue 45): the files whose Python functions run during
one steady-state compressed ``step()`` of each optimizer, traced with ``sys.setprofile`` on 2 gloo ranks. 0/1 Adam's
compression stage has four kinds of step (a variance step, a 1-bit exchange of the momenta or of the gradients, a
local step and a sync step); each is traced, and the 1-bit step with ``exchange="gradient"`` too.

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
#: At most this many optim files for one step of any kind (issue 45).
MOST_FILES = 4


def _make(name: str) -> Callable[[Any], Any]:
    import lightning_onebit as lo

    return {
        "OnebitAdam": lambda params: lo.OnebitAdam(params, lr=1e-3, freeze_step=2),
        # steps 1-2 variance steps (the warmup), then a variance step every 2nd step up to step 6, every 4th up to
        # 12: compressed steps 3, 5, 7, 9-11; local steps from 13, syncing every step twice, then every 2nd step
        "ZeroOneAdam": lambda params: lo.ZeroOneAdam(params, lr=1e-3, var_freeze_step=12, var_update_scaler=2,
                                                     local_step_scaler=2),
        "ZeroOneAdam-gradient": lambda params: lo.ZeroOneAdam(params, lr=1e-3, var_freeze_step=12,
                                                              var_update_scaler=2, exchange="gradient"),
        "OnebitLamb": lambda params: lo.OnebitLamb(params, lr=1e-3, freeze_step=2),
    }[name]


def _traced_steps(rank: int, world_size: int, name: str, kinds: tuple[str, ...]) -> dict[str, dict[str, list[str]]]:
    """For each step kind in ``kinds``, the library files entered during the second step of that kind in the
    compression stage (the first compressed step also lays the buckets out and finds the dead coordinates, the first
    local step starts the sums since the last sync: once), with the functions entered in each."""
    from lightning_onebit.optim import OnebitStage, StepKind

    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.ReLU(), torch.nn.Linear(16, 4))
    optimizer = _make(name)(model.parameters())
    library = str(LIBRARY)
    seen: collections.Counter[str] = collections.Counter()
    traced: dict[str, dict[str, list[str]]] = {}
    while set(traced) != set(kinds):
        kind = optimizer.next_step_kind
        optimizer.zero_grad()
        model(torch.randn(4, 8)).pow(2).mean().backward()
        if optimizer.needs_gradient_allreduce:  # what the strategy's DDP hook does on these steps
            for p in model.parameters():
                torch.distributed.all_reduce(p.grad)
                p.grad /= world_size
        trace = optimizer.stage is OnebitStage.COMPRESSION and kind.name in kinds and seen[kind.name] == 1
        if optimizer.stage is OnebitStage.COMPRESSION:
            seen[kind.name] += 1
        functions: dict[str, set[str]] = collections.defaultdict(set)

        def profile(frame: Any, event: str, arg: Any) -> None:
            if event == "call" and frame.f_code.co_filename.startswith(library):
                functions[os.path.relpath(frame.f_code.co_filename, library)].add(frame.f_code.co_name)

        if trace:
            sys.setprofile(profile)
        try:
            optimizer.step()
        finally:
            sys.setprofile(None)
        assert optimizer.last_step_kind is StepKind[kind.name]
        if trace:
            traced[kind.name] = {path: sorted(names) for path, names in functions.items()}
        assert optimizer.step_count < 40, f"{name} took no second step of each kind in {kinds}: {dict(seen)}"
    return traced


def _by_layer(files: dict[str, list[str]]) -> dict[str, list[str]]:
    layers: dict[str, list[str]] = collections.defaultdict(list)
    for path in sorted(files):
        parts = Path(path).parts
        layers[parts[0] if len(parts) > 1 else "lightning_onebit"].append(parts[-1])
    return dict(layers)


@pytest.mark.parametrize("name, own, kinds", [
    ("OnebitAdam", "onebit_adam.py", ("COMPRESSED",)),
    ("OnebitLamb", "onebit_lamb.py", ("COMPRESSED",)),
    ("ZeroOneAdam", "zeroone_adam.py", ("VARIANCE", "COMPRESSED", "LOCAL", "SYNC")),
    # DeepSpeed's form: the gradients' buffers and their error-feedback keys laid out once per bucket layout
    # (ExchangeBuffers), only filled in the step
    ("ZeroOneAdam-gradient", "zeroone_adam.py", ("COMPRESSED",)),
])
def test_a_compressed_step_reads_in_its_own_file_and_three_parts(name: str, own: str, kinds: tuple[str, ...]) -> None:
    traced = run_distributed(_traced_steps, 2, name, kinds)[0]
    for kind in kinds:
        files = traced[kind]
        layers = _by_layer(files)
        print(f"\n{name}, a {kind} step: {len(files)} library files run; optim {len(layers['optim'])}: "
              f"{layers['optim']}; below it: {({k: v for k, v in layers.items() if k != 'optim'})}")
        for path, names in sorted(files.items()):
            print(f"    {path}: {', '.join(names)}")
    for kind in kinds:
        layers = _by_layer(traced[kind])
        # the algorithm's file, base.py, buckets.py (the exchange) and functional.py (the math), and nothing else
        # of the optim layer: 0/1 Adam's schedule and local-step sums are parts held in its own file's step
        assert set(layers["optim"]) <= {own} | PARTS, (kind, layers["optim"])
        assert own in layers["optim"] and len(layers["optim"]) <= MOST_FILES, (kind, layers["optim"])
        # nothing above the optimizers
        assert set(layers) <= {"optim", "comm", "kernels", "lightning_onebit"}, (kind, sorted(layers))
    for kind in set(kinds) & {"COMPRESSED", "SYNC"}:  # the 1-bit exchange goes through the comm layer's allreduce
        assert "exchange.py" in _by_layer(traced[kind])["comm"], kind
