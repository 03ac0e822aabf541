"""The phase the strategy announces names the step the phase began at, also after a resume.

Before, the sentence named the next step: a run resumed at step 20 of a compression stage that began at step 11 logged
"compression stage from optimizer step 21". Now it says "from optimizer step 11 (this run continues it from step 21)",
for 1-bit Adam and 1-bit LAMB (the compression stage) and 0/1 Adam (its variance and local-step phases).
"""

from __future__ import annotations

from typing import Any

import pytest
import torch
from torch import nn

from lightning_onebit import OnebitAdam, OnebitLamb, ZeroOneAdam


def _make(cls: type, net: nn.Module) -> Any:
    if cls is ZeroOneAdam:  # warmup to 2, variance steps 3-4, local steps from 5
        return cls(net.parameters(), lr=1e-2, var_freeze_step=4, var_update_scaler=2)
    return cls(net.parameters(), lr=1e-2, freeze_step=3)


def _trained(cls: type, steps: int) -> tuple[nn.Module, Any]:
    torch.manual_seed(0)
    net = nn.Linear(4, 2)
    opt = _make(cls, net)
    for i in range(steps):
        x = torch.randn(8, 4, generator=torch.Generator().manual_seed(i))
        opt.zero_grad()
        net(x).pow(2).mean().backward()
        opt.step()
    return net, opt


@pytest.mark.parametrize("cls, steps, began", [
    (OnebitAdam, 7, "compression stage from optimizer step 4"),
    (OnebitLamb, 7, "compression stage from optimizer step 4"),
    (ZeroOneAdam, 3, "from optimizer step 3"),  # the variance phase
    (ZeroOneAdam, 7, "from optimizer step 5"),  # the local steps
])
def test_a_resumed_run_names_the_step_its_phase_began_at(cls: type, steps: int, began: str) -> None:
    net, opt = _trained(cls, steps)
    resumed = _make(cls, net)
    resumed.load_state_dict(opt.state_dict())
    for optimizer in (opt, resumed):
        sentence = optimizer.describe_phase()[1]
        assert sentence.startswith(f"{began} (this run continues it from step {steps + 1}):"), sentence


@pytest.mark.parametrize("cls, steps, began", [
    (OnebitAdam, 3, "compression stage from optimizer step 4:"),
    (ZeroOneAdam, 2, "from optimizer step 3:"),
    (ZeroOneAdam, 4, "from optimizer step 5:"),
])
def test_a_phase_entered_now_names_its_first_step_alone(cls: type, steps: int, began: str) -> None:
    _, opt = _trained(cls, steps)
    assert opt.describe_phase()[1].startswith(began), opt.describe_phase()[1]
