"""LightningCLI: the strategy by name or class_path and OnebitAdam from the `optimizer:` section, on 2 CPU processes."""

import json
import subprocess
import sys
from pathlib import Path

import pytest

from tests.paths import ASSETS, script_env

APP = ASSETS / "cli_app.py"

CONFIG = """
trainer:
  accelerator: cpu
  devices: 2
  strategy: {strategy}
  max_steps: 12
  logger: false
  enable_checkpointing: false
  enable_progress_bar: false
  enable_model_summary: false
optimizer:
  class_path: lightning_onebit.OnebitAdam
  init_args:
    lr: 0.01
    freeze_step: 4
    weight_decay: 0.01
"""

STRATEGY_BY_CLASS_PATH = """
    class_path: lightning_onebit.OnebitStrategy
    init_args:
      find_unused_parameters: false"""
# configs written before the rename keep working
STRATEGY_BY_OLD_CLASS_PATH = STRATEGY_BY_CLASS_PATH.replace("OnebitStrategy", "OnebitAdamStrategy")


def _run_cli(tmp_path: Path, strategy: str) -> list[dict]:
    # Not in the run directory: LightningCLI saves the resolved config there and refuses to overwrite.
    config = tmp_path / "onebit.yaml"
    config.write_text(CONFIG.format(strategy=strategy))
    env = script_env(CLI_REPORT_DIR=str(tmp_path), MASTER_ADDR="127.0.0.1")
    env.pop("LOCAL_RANK", None)
    proc = subprocess.run(
        [sys.executable, str(APP), "fit", "--config", str(config)],
        cwd=tmp_path,
        env=env,
        capture_output=True,
        text=True,
        timeout=240,
    )
    assert proc.returncode == 0, proc.stderr[-4000:]
    return [json.loads((tmp_path / f"rank{r}.json").read_text()) for r in range(2)]


def test_cli_yaml_trains_both_stages_on_two_processes(tmp_path):
    reports = _run_cli(tmp_path, STRATEGY_BY_CLASS_PATH)
    for report in reports:
        assert report["strategy"] == "OnebitStrategy"
        assert report["optimizer"] == "OnebitAdam"
        assert report["freeze_step"] == 4
        assert report["step_count"] == 12
        assert report["stage"] == "compression"
    assert reports[0]["params"] == reports[1]["params"], "replicas diverged"


@pytest.mark.parametrize(
    "strategy",
    ["onebit_adam", STRATEGY_BY_CLASS_PATH, STRATEGY_BY_OLD_CLASS_PATH],
    ids=["registry-name", "class_path", "old-class_path"],
)
def test_every_spelling_of_the_strategy_gives_the_onebit_strategy(tmp_path, monkeypatch, strategy):
    """The registry name, the class_path and the class_path of the old name build the same strategy with the YAML's
    arguments (parsed and instantiated in this process; the training above runs one of them)."""
    import importlib.util

    from lightning_onebit import OnebitStrategy

    spec = importlib.util.spec_from_file_location("cli_app", APP)
    app = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(app)
    config = tmp_path / "onebit.yaml"
    config.write_text(CONFIG.format(strategy=strategy))
    monkeypatch.chdir(tmp_path)
    cli = app.LightningCLI(app.RegressionModule, app.RegressionData, run=False, args=["--config", str(config)])
    assert type(cli.trainer.strategy) is OnebitStrategy
    assert cli.trainer.strategy._ddp_kwargs.get("find_unused_parameters") is False

def _parse_in_process(tmp_path, monkeypatch, config: str):
    """LightningCLI of the app over ``config`` (YAML), parsed and instantiated in this process (``run=False``): its
    strategy, model and, when the config has an ``optimizer:`` section, the optimizer it built at instantiation."""
    import importlib.util

    spec = importlib.util.spec_from_file_location("cli_app", APP)
    app = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(app)
    path = tmp_path / "config.yaml"
    path.write_text(config)
    monkeypatch.chdir(tmp_path)
    return app.LightningCLI(app.RegressionModule, app.RegressionData, run=False, args=["--config", str(path)])


FSDP_CONFIG = """
trainer:
  accelerator: cpu
  devices: 1
  logger: false
  strategy:
    class_path: lightning_onebit.OnebitFSDPStrategy
    init_args:
      shard_modules: {shard_modules}
"""


@pytest.mark.parametrize(
    "shard_modules, expected",
    [("torch.nn.Linear", ("Linear",)), ("[torch.nn.Linear, torch.nn.Tanh]", ("Linear", "Tanh"))],
    ids=["one-class-path", "list"],
)
def test_shard_modules_from_yaml_take_one_class_path_or_a_list(tmp_path, monkeypatch, shard_modules, expected):
    """Used to: ``shard_modules: torch.nn.Linear`` (one class, not a list) was refused by the CLI's type check
    ("Expected a collections.abc.Sequence"), and ``OnebitFSDPStrategy(shard_modules=nn.Linear)`` in code raised
    "'type' object is not iterable". One class is now a list of one; the CLI resolves the class paths to classes."""
    cli = _parse_in_process(tmp_path, monkeypatch, FSDP_CONFIG.format(shard_modules=shard_modules))
    assert tuple(m.__name__ for m in cli.trainer.strategy.shard_modules) == expected


OPTIMIZER_CONFIG = """
trainer:
  accelerator: cpu
  devices: 1
  logger: false
optimizer:
  class_path: lightning_onebit.OnebitAdam
  init_args: {{lr: 0.001, weight_decay: 0.01, freeze_step: 4, {extra}}}
"""


def test_an_adamw_config_ports_fused_with_a_warning_and_maximize_with_the_fix(tmp_path, monkeypatch):
    """Used to: an AdamW ``init_args`` block with ``fused: true`` moved to ``class_path: lightning_onebit.OnebitAdam``
    was refused by the CLI ("No action for key fused") and ``maximize: true`` likewise, naming neither what happens
    nor what to do. Now ``fused`` builds the optimizer with one warning that it has no effect, and ``maximize: true``
    stops the CLI with the fix, when the CLI builds the optimizer (before any process group)."""
    import warnings

    from lightning_onebit import OnebitAdam

    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        cli = _parse_in_process(tmp_path, monkeypatch, OPTIMIZER_CONFIG.format(extra="fused: true"))
    optimizer = cli.model.configure_optimizers()
    optimizer = optimizer[0] if isinstance(optimizer, (list, tuple)) else optimizer
    optimizer = optimizer["optimizer"] if isinstance(optimizer, dict) else optimizer
    assert isinstance(optimizer, OnebitAdam) and optimizer.param_groups[0]["weight_decay"] == 0.01
    assert [str(w.message) for w in caught if "has no effect" in str(w.message)] == [
        "OnebitAdam(fused=True) has no effect: OnebitAdam chooses its kernels itself (torch's multi-tensor and fused "
        "kernels where they apply, kernel_backend for the 1-bit exchange), and the results do not depend on it. "
        "Drop fused=True to silence this warning."
    ]
    with pytest.raises(ValueError, match="maximize must be False, got True: OnebitAdam does not support maximize"):
        _parse_in_process(tmp_path, monkeypatch, OPTIMIZER_CONFIG.format(extra="maximize: true"))


WARMUP_EXCHANGE_CONFIG = """
trainer:
  accelerator: cpu
  devices: 1
  logger: false
  strategy:
    class_path: lightning_onebit.OnebitStrategy
    init_args:
      warmup_exchange: powersgd
      powersgd_rank: 2
      powersgd_vanilla_steps: 5
"""


def test_the_warmup_exchange_is_chosen_by_name_in_yaml(tmp_path, monkeypatch):
    from lightning_onebit.hooks import PowerSGDExchangeState

    strategy = _parse_in_process(tmp_path, monkeypatch, WARMUP_EXCHANGE_CONFIG).trainer.strategy
    state = strategy.warmup_exchange_state
    assert strategy.warmup_exchange == "powersgd" and isinstance(state, PowerSGDExchangeState)
    assert (state.rank, state.vanilla_steps) == (2, 5)


def test_a_bad_warmup_exchange_in_yaml_is_refused(tmp_path, monkeypatch):
    with pytest.raises((ValueError, SystemExit)):
        _parse_in_process(tmp_path, monkeypatch, WARMUP_EXCHANGE_CONFIG.replace("powersgd\n", "int4\n", 1))
