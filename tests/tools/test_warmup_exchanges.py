"""Issue 44's runs of benchmarks/freeze_sweep.py: the DDP baselines (DDP + bf16 / PowerSGD / int8, counted by
benchmarks.comm_hooks.CountedDDPStrategy) and the 1-bit runs whose warmup averages with a compressed exchange
(``+bf16``, ``+powersgdR``, ``+int8``): their names, the strategy the example's CLI builds from their arguments, the
check that their hook ran, the table, and one DDP + PowerSGD run of the example counted by hand."""

from __future__ import annotations

import json
import subprocess
import sys
from types import SimpleNamespace

import pytest

from benchmarks import comm_hooks
from benchmarks import freeze_sweep as fs
from benchmarks.common import script_env
from lightning_onebit.comm import ring_allreduce_bytes
from lightning_onebit.hooks import Int8AllreduceState, OrderedPowerSGDState, PowerSGDExchangeState, int8_allreduce_hook
from lightning_onebit.hooks import ordered_powersgd_hook
from lightning_onebit.hooks.powersgd import powersgd_allreduce_numels
from tests.paths import EXAMPLE, ROOT


# ---------------------------------------------------------------------------------------------------------------------
# names
@pytest.mark.parametrize(("name", "canonical", "family", "freeze"), [
    ("ddp_bf16", "ddp_bf16", "ddp_bf16", None),
    ("ddp_int8", "ddp_int8", "ddp_int8", None),
    ("ddp_powersgd_r4@0.10", "ddp_powersgd_r4@0.1", "ddp_powersgd_r4", None),
    ("ddp_powersgd_r1@0", "ddp_powersgd_r1@0", "ddp_powersgd_r1", None),
    ("onebit_adam@auto+bf16", "onebit_adam@auto+bf16", "onebit_adam", "auto"),
    ("onebit_adam@0.250+powersgd4s10", "onebit_adam@0.25+powersgd4", "onebit_adam", "0.25"),  # 10: the default S
    ("onebit_adam@auto+powersgd4s2", "onebit_adam@auto+powersgd4s2", "onebit_adam", "auto"),
    ("onebit_lamb@auto+int8", "onebit_lamb@auto+int8", "onebit_lamb", "auto"),
    ("zeroone_adam+bf16", "zeroone_adam+bf16", "zeroone_adam", None),
])
def test_exchange_run_names(name, canonical, family, freeze):
    assert fs.canonical_run(name) == canonical and fs.parse_run(name) == (family, freeze)
    assert fs.reference_of(name) == ("lamb_uncompressed" if family == "onebit_lamb" else "adamw")


@pytest.mark.parametrize("name", [
    "ddp_powersgd_r4",  # the vanilla share is part of the name
    "ddp_powersgd_r4@1", "ddp_powersgd_r0@0.1", "ddp_bf16@0.1", "ddp_bf16+int8", "ddp_fp16",
    "onebit_adam@auto+fp16", "onebit_adam@auto+powersgd", "onebit_adam@auto+powersgd4s1", "onebit_adam@auto+powersgd0",
    "adamw+bf16", "lamb_uncompressed+int8", "onebit_adam+bf16",
])
def test_bad_exchange_run_names_are_refused(name):
    with pytest.raises(ValueError):
        fs.parse_run(name)


def test_runs_sort_the_baselines_after_adamw_and_each_exchange_after_its_plain_run():
    names = {"onebit_adam@auto+int8", "ddp_powersgd_r4@0.1", "onebit_adam@auto", "adamw", "onebit_adam@0.25+bf16",
             "ddp_bf16", "onebit_adam@0.25", "onebit_lamb@auto+bf16", "onebit_lamb@auto"}
    assert fs.order_runs(names) == ["adamw", "ddp_bf16", "ddp_powersgd_r4@0.1", "onebit_adam@0.25",
                                    "onebit_adam@0.25+bf16", "onebit_adam@auto", "onebit_adam@auto+int8",
                                    "onebit_lamb@auto", "onebit_lamb@auto+bf16"]


# ---------------------------------------------------------------------------------------------------------------------
# the strategy the example's CLI builds from a run's arguments
def _strategy_of(example, name, steps=620):
    config, args = fs.run_args(name, steps, lamb_lr=None)
    cli = example.BertFinetuneCLI(
        example.BertClassifier, example.TextClassificationData, run=False,
        args=["--config", str(ROOT / "examples" / "configs" / config), "--data.num_train", "64", "--data.num_val",
              "32", "--trainer.logger", "false", *args])
    return cli.trainer.strategy


@pytest.mark.parametrize("name, rank, start", [("ddp_powersgd_r4@0.1", 4, 62), ("ddp_powersgd_r1@0", 1, 2)])
def test_ddp_powersgd_run_builds_a_counted_ddp_strategy_with_its_start(example, name, rank, start):
    strategy = _strategy_of(example, name)
    assert isinstance(strategy, comm_hooks.CountedDDPStrategy) and strategy.gradient_exchange == "powersgd"
    state = strategy.gradient_sync.averaging_hook_state
    assert strategy.gradient_sync.averaging_hook is ordered_powersgd_hook and isinstance(state, OrderedPowerSGDState)
    assert (state.powersgd.matrix_approximation_rank, state.powersgd.start_powerSGD_iter) == (rank, start)
    assert state.powersgd.use_error_feedback and state.powersgd.warm_start


@pytest.mark.parametrize("name, hook, state_type", [
    ("onebit_adam@auto+bf16", "bf16_compress_hook", type(None)),
    ("onebit_adam@auto+int8", "int8_allreduce_hook", Int8AllreduceState),
    ("onebit_adam@0.25+powersgd2s4", "powersgd_exchange_hook", PowerSGDExchangeState),
    ("ddp_bf16", "bf16_compress_hook", type(None)),
    ("ddp_int8", "int8_allreduce_hook", Int8AllreduceState),
])
def test_exchange_runs_average_with_their_hook(example, name, hook, state_type):
    from lightning_onebit import OnebitStrategy

    strategy = _strategy_of(example, name)
    assert strategy.gradient_sync.averaging_hook.__name__ == hook
    assert isinstance(strategy.gradient_sync.averaging_hook_state, state_type)
    if name.startswith("onebit"):
        assert isinstance(strategy, OnebitStrategy)
    if state_type is PowerSGDExchangeState:
        powersgd = strategy.gradient_sync.averaging_hook_state
        assert (powersgd.rank, powersgd.vanilla_steps) == (2, 4) and strategy.warmup_exchange == "powersgd"


def test_counted_ddp_strategy_refuses_bad_arguments():
    with pytest.raises(ValueError, match="gradient_exchange must be one of fp32, bf16, powersgd, int8"):
        comm_hooks.CountedDDPStrategy(gradient_exchange="fp16")
    with pytest.raises(ValueError, match="powersgd_start must be an integer >= 2, got 1"):
        comm_hooks.CountedDDPStrategy(gradient_exchange="powersgd", powersgd_start=1)


def _finished(strategy, steps):
    """``strategy`` as at the end of a fit of ``steps`` steps on 2 ranks."""
    from lightning.fabric.plugins.environments import LightningEnvironment

    strategy._lightning_module = SimpleNamespace(trainer=SimpleNamespace(global_step=steps))
    strategy.cluster_environment = LightningEnvironment()
    strategy.cluster_environment.set_world_size(2)


def test_counted_ddp_strategy_fails_a_run_whose_exchange_did_not_run():
    strategy = comm_hooks.CountedDDPStrategy(gradient_exchange="bf16")
    _finished(strategy, steps=5)
    with pytest.raises(RuntimeError, match="bf16 gradient exchange never ran in 5 steps"):
        strategy.on_train_end()
    strategy.gradient_sync.counters.calls = 5
    strategy.on_train_end()  # ran: fine

    strategy = comm_hooks.CountedDDPStrategy(gradient_exchange="powersgd", powersgd_start=3)
    _finished(strategy, steps=8)
    strategy.gradient_sync.counters.calls = 8
    strategy.exchange_state.vanilla_buckets = 8
    with pytest.raises(RuntimeError, match="PowerSGD never compressed in 8 steps"):
        strategy.on_train_end()


def test_sweep_fails_a_run_whose_exchange_left_no_trace():
    record = dict(steps=600, freeze_step=200, stage="compression", exchange=None)
    fs.check_exchange_ran("onebit_adam@auto", record)  # no exchange named: nothing to check
    with pytest.raises(RuntimeError, match="int8 gradient exchange did not run"):
        fs.check_exchange_ran("onebit_adam@auto+int8", record)
    with pytest.raises(RuntimeError, match="did not run"):
        fs.check_exchange_ran("ddp_bf16", dict(record, exchange=dict(exchange="bf16", calls=0)))
    powersgd = dict(exchange="ordered_powersgd_hook", calls=200, start=10, vanilla_buckets=200, compressed_buckets=0)
    with pytest.raises(RuntimeError, match="PowerSGD never compressed in 200 averaged steps"):
        fs.check_exchange_ran("onebit_adam@auto+powersgd4", dict(record, exchange=powersgd))
    # a warmup no longer than PowerSGD's vanilla start never compresses, rightly
    fs.check_exchange_ran("onebit_adam@auto+powersgd4", dict(record, freeze_step=10, exchange=powersgd))
    fs.check_exchange_ran("onebit_adam@auto+powersgd4",
                          dict(record, exchange=dict(powersgd, compressed_buckets=380, vanilla_buckets=20)))


def test_exchange_report_of_each_strategy():
    strategy = comm_hooks.CountedDDPStrategy(gradient_exchange="powersgd", powersgd_rank=2, powersgd_start=5)
    assert fs.exchange_report(strategy) == dict(exchange="powersgd", calls=0, rank=2, start=5, vanilla_buckets=0,
                                                compressed_buckets=0)
    from lightning_onebit import OnebitStrategy

    assert fs.exchange_report(OnebitStrategy(warmup_exchange="fp32")) is None  # the plain fp32 allreduce
    onebit = OnebitStrategy(ddp_comm_hook=int8_allreduce_hook, ddp_comm_state=Int8AllreduceState())
    assert fs.exchange_report(onebit) == dict(exchange="int8_allreduce_hook", calls=0)
    named = OnebitStrategy(warmup_exchange="powersgd", powersgd_rank=2, powersgd_vanilla_steps=5)
    assert fs.exchange_report(named) == dict(exchange="powersgd_exchange_hook", calls=0, rank=2, start=5,
                                             vanilla_buckets=0, compressed_buckets=0)


# ---------------------------------------------------------------------------------------------------------------------
# the table
def _run(run, seed, acc, bytes_sent, warmup=None, freeze=None):
    return dict(task="synthetic", run=run, seed=seed, val_acc=acc, bytes_sent=bytes_sent, bytes_fp32_equivalent=400,
                bytes_sent_warmup=warmup, freeze_step=freeze, stage=None if freeze is None else "compression",
                settings=dict(steps=620), freeze=None, mask=None)


def test_table_shows_the_baselines_and_warmups_against_adamw_with_their_bytes():
    rows = [_run("adamw", 0, 0.99, 400), _run("adamw", 1, 0.98, 400),
            _run("ddp_powersgd_r4@0.1", 0, 0.97, 50), _run("ddp_powersgd_r4@0.1", 1, 0.99, 50),
            _run("onebit_adam@auto", 0, 0.99, 100, warmup=90, freeze=200),
            _run("onebit_adam@auto+int8", 0, 0.985, 40, warmup=30, freeze=210)]
    results = {"runs": {fs.key_of(r["task"], r["run"], r["seed"]): r for r in rows}}
    table = {r["run"]: r for r in fs.table_rows(results)}
    psgd = table["ddp_powersgd_r4@0.1"]
    assert psgd["reference"] == "adamw" and psgd["diff"] == {0: pytest.approx(-2.0), 1: pytest.approx(1.0)}
    assert psgd["bytes_ratio"] == 8.0 and psgd["warmup_share"] is None and psgd["freeze"] == {0: None, 1: None}
    int8 = table["onebit_adam@auto+int8"]
    assert int8["bytes_ratio"] == 10.0 and int8["warmup_share"] == 0.75 and int8["freeze"] == {0: 210, 1: None}
    assert int8["diff"] == {0: pytest.approx(-0.5), 1: None} and table["onebit_adam@auto"]["warmup_share"] == 0.9
    text = fs.format_table(results)
    line = next(x for x in text.splitlines() if x.startswith("onebit_adam@auto+int8"))
    assert "10.00" in line and "75%" in line and "-0.50" in line and "missing" in line


# ---------------------------------------------------------------------------------------------------------------------
# one run of the example, counted by hand
def test_ddp_powersgd_baseline_runs_on_cpu_and_counts_every_all_reduce(example, tmp_path):
    """DDP + PowerSGD rank 1 after 3 vanilla steps on a 1-layer BERT of the example, 8 steps on 2 CPU ranks.
    Lightning's own DDPStrategy would not register the hook on CPU; CountedDDPStrategy does, and its count is what the
    hook sends: a ring allreduce over 2 ranks sends 4 bytes per fp32 element, of all N gradient elements in steps 1-3,
    then of the uncompressed tensors and of P and Q (torch's choice of tensors, per the shapes)."""
    sizes = dict(hidden_size=32, num_layers=1, num_heads=2, intermediate_size=64)
    data_sizes = dict(num_train=512, num_val=64)
    _, args = fs.run_args("ddp_powersgd_r1@0.375", 8, lamb_lr=None)  # the first 3 of 8 steps vanilla
    summary = tmp_path / "summary.json"
    command = [sys.executable, str(EXAMPLE), "fit", "--config", str(ROOT / "examples" / "configs" / "bert_adamw.yaml"),
               "--trainer.max_epochs", "1", "--trainer.enable_progress_bar", "false",
               "--trainer.logger.init_args.save_dir", str(tmp_path), "--summary_json", str(summary), *args]
    command += [f"--model.{k}={v}" for k, v in sizes.items()] + [f"--data.{k}={v}" for k, v in data_sizes.items()]
    assert command[command.index("--trainer.strategy.powersgd_start") + 1] == "3"
    proc = subprocess.run(command, cwd=tmp_path, env=script_env(), capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-4000:]
    result = json.loads(summary.read_text())
    assert result["strategy"] == "CountedDDPStrategy" and result["steps"] == 8
    data = example.TextClassificationData(**data_sizes)
    model = example.BertClassifier(vocab_size=data.vocab_size, num_labels=data.num_labels, **sizes)
    params = [p for p in model.parameters() if p.requires_grad]
    numel = sum(p.numel() for p in params)
    from torch.distributed.algorithms.ddp_comm_hooks.powerSGD_hook import PowerSGDState

    uncompressed, p_numel, q_numel = powersgd_allreduce_numels(PowerSGDState(None, matrix_approximation_rank=1),
                                                               [p.shape for p in params])
    assert p_numel > 0 and uncompressed < numel
    expected = 3 * ring_allreduce_bytes(numel, 4, 2) + 5 * 4 * (uncompressed + p_numel + q_numel)
    assert result["bytes_sent"] == expected, result
    assert result["bytes_fp32_equivalent"] == 8 * ring_allreduce_bytes(numel, 4, 2)
    assert "CommunicationMonitor" not in proc.stderr  # no monitor warning about a foreign hook: none was added
