"""``pytorch_lightning.Trainer`` given the ``onebit_adam`` strategy, by name or as an object: a clear error that says to
use ``lightning.pytorch``, whichever of the two packages is imported first (the ``lightning`` package installs
``pytorch_lightning`` too, so it is normally here).

Each case runs in a fresh interpreter: importing ``pytorch_lightning`` in the test process would point Lightning's
rank-zero logger at ``pytorch_lightning``'s for every later test, and the order of the imports is what is tested."""

from __future__ import annotations

import importlib.util
import json
import subprocess
import sys
import textwrap

import pytest

from tests.paths import ROOT

pytestmark = pytest.mark.skipif(
    importlib.util.find_spec("pytorch_lightning") is None, reason="pytorch_lightning is not installed"
)

ADVICE = ("`import lightning.pytorch as pl`", "`from lightning.pytorch import Trainer`", "`pytorch_lightning.Trainer`")

SCRIPT = """
import json, sys
{imports}
import lightning.pytorch as pl
import pytorch_lightning as ptl
from lightning.fabric.strategies import _StrategyRegistry
from lightning_onebit import OnebitStrategy
from lightning_onebit.strategy import pytorch_lightning_guard
from pytorch_lightning.trainer.connectors.accelerator_connector import _AcceleratorConnector

kwargs = dict(accelerator="cpu", devices=2, logger=False, enable_progress_bar=False, enable_model_summary=False)

def error(strategy):
    try:
        ptl.Trainer(strategy=strategy, **kwargs)
    except Exception as raised:
        return [type(raised).__name__, str(raised)]
    return None

names = _StrategyRegistry()
OnebitStrategy.register_strategies(names)
check = _AcceleratorConnector._check_config_and_set_final_flags
pytorch_lightning_guard.guard_pytorch_lightning()  # again: idempotent
print(json.dumps(dict(
    imported_alone=imported_alone,
    names={{name: error(name) for name in names}},
    object=error(OnebitStrategy()),
    lightning_pytorch=[type(pl.Trainer(strategy=s, **kwargs).strategy).__name__
                       for s in ("onebit_adam", OnebitStrategy())],
    ptl_ddp=type(ptl.Trainer(strategy="ddp", **kwargs).strategy).__module__,
    wrapped_once=_AcceleratorConnector._check_config_and_set_final_flags is check,
    finder_left=[type(f).__name__ for f in sys.meta_path if "Guard" in type(f).__name__],
)))
"""

IMPORTS = {
    # the guard waits in sys.meta_path for pytorch_lightning's import
    "lightning_onebit_first": "import lightning_onebit\nimported_alone = 'pytorch_lightning' in sys.modules",
    "pytorch_lightning_first": "import pytorch_lightning\nimport lightning_onebit\nimported_alone = None",
}


@pytest.fixture(scope="module", params=sorted(IMPORTS))
def outcome(request: pytest.FixtureRequest) -> dict:
    script = textwrap.dedent(SCRIPT).format(imports=IMPORTS[request.param])
    proc = subprocess.run([sys.executable, "-c", script], cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-4000:]
    return json.loads(proc.stdout.strip().splitlines()[-1])


def test_every_strategy_name_under_pytorch_lightning_says_to_use_lightning_pytorch(outcome: dict) -> None:
    assert {"onebit_adam", "onebit_adam_spawn", "onebit_lamb", "zeroone_adam"} <= set(outcome["names"])
    for name, (kind, message) in outcome["names"].items():
        assert kind == "ValueError" and message.startswith(f"strategy={name!r} is a `lightning.pytorch` strategy"), (
            message)
        assert all(advice in message for advice in ADVICE), message


def test_a_strategy_object_under_pytorch_lightning_says_to_use_lightning_pytorch(outcome: dict) -> None:
    kind, message = outcome["object"]
    assert kind == "ValueError" and message.startswith("OnebitStrategy is a `lightning.pytorch` strategy"), message
    assert all(advice in message for advice in ADVICE), message


def test_lightning_pytorch_and_pytorch_lightnings_own_strategies_are_unaffected(outcome: dict) -> None:
    assert outcome["lightning_pytorch"] == ["OnebitStrategy", "OnebitStrategy"]
    assert outcome["ptl_ddp"] == "pytorch_lightning.strategies.ddp"


def test_the_guard_is_installed_once_without_importing_pytorch_lightning(outcome: dict) -> None:
    assert outcome["wrapped_once"] and outcome["finder_left"] == []
    assert outcome["imported_alone"] in (False, None)  # import lightning_onebit alone leaves pytorch_lightning out
