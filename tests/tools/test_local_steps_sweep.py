"""Issue 46's runs of benchmarks/freeze_sweep.py: local steps with a compressed outer step (``diloco_C@H``,
``diloco_C_sgd@H``): their names, the strategy the example's CLI builds from their arguments, the bits per parameter
per step, the check of their outer syncs, the table, and one run of the example counted by hand."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from benchmarks import freeze_sweep as fs
from benchmarks.common import script_env
from lightning_onebit.comm import ring_allreduce_bytes
from tests.paths import EXAMPLE, ROOT


# ---------------------------------------------------------------------------------------------------------------------
# names
@pytest.mark.parametrize(("name", "canonical", "parsed"), [
    ("diloco_none@32", "diloco_none@32", ("none", 32, "nesterov")),
    ("diloco_bf16@08", "diloco_bf16@8", ("bf16", 8, "nesterov")),
    ("diloco_onebit@1", "diloco_onebit@1", ("onebit", 1, "nesterov")),
    ("diloco_topk_sgd@128", "diloco_topk_sgd@128", ("topk", 128, "sgd")),
    ("diloco_none_sgd@8", "diloco_none_sgd@8", ("none", 8, "sgd")),  # plain model averaging (local SGD)
    ("diloco_onebit_sgd0.70@8", "diloco_onebit_sgd0.7@8", ("onebit", 8, "sgd")),  # outer lr 0.7
    ("diloco_onebit_sgd1.0@8", "diloco_onebit_sgd@8", ("onebit", 8, "sgd")),
])
def test_local_steps_run_names(name, canonical, parsed):
    assert fs.diloco_run(name) == parsed and fs.canonical_run(name) == canonical
    assert fs.parse_run(name) == (name.partition("@")[0], None) and fs.reference_of(name) == "adamw"
    assert fs.diloco_run("adamw") is None and fs.diloco_run("onebit_adam@auto") is None


@pytest.mark.parametrize("name", [
    "diloco_none",  # the period is part of the name
    "diloco_none@0", "diloco_none@x", "diloco_none@-8", "diloco_fp16@8", "diloco@8", "diloco_topk@8+bf16",
    "diloco_onebit_adam@8", "diloco_onebit_sgd0@8", "diloco_onebit_sgd.5@8", "diloco_onebit0.7@8",
])
def test_bad_local_steps_run_names_are_refused(name):
    with pytest.raises(ValueError):
        fs.canonical_run(name)


def test_local_steps_runs_sort_last_by_compressor_outer_optimizer_and_period():
    names = {"diloco_topk@8", "diloco_none@32", "adamw", "diloco_onebit@8", "onebit_adam@auto", "diloco_topk_sgd@8",
             "ddp_powersgd_r4@0.1", "diloco_none@8", "diloco_topk@32"}
    assert fs.order_runs(names) == ["adamw", "ddp_powersgd_r4@0.1", "onebit_adam@auto", "diloco_none@8",
                                    "diloco_none@32", "diloco_onebit@8", "diloco_topk@8", "diloco_topk@32",
                                    "diloco_topk_sgd@8"]
    assert fs.order_runs({"diloco_onebit_sgd0.5@8", "diloco_onebit_sgd@8", "diloco_onebit_sgd0.7@8"}) == [
        "diloco_onebit_sgd@8", "diloco_onebit_sgd0.7@8", "diloco_onebit_sgd0.5@8"]
    assert fs.diloco_outer_lr("diloco_onebit_sgd0.7@8") == 0.7 and fs.diloco_outer_lr("diloco_onebit@8") is None


# ---------------------------------------------------------------------------------------------------------------------
# the strategy the example's CLI builds from a run's arguments
@pytest.mark.parametrize(("name", "every", "kind", "outer", "lr"), [
    ("diloco_topk@8", 8, "topk", "nesterov", 0.7), ("diloco_onebit_sgd@16", 16, "onebit", "sgd", 1.0),
    ("diloco_none@32", 32, "none", "nesterov", 0.7), ("diloco_onebit_sgd0.7@8", 8, "onebit", "sgd", 0.7),
])
def test_local_steps_run_builds_onebit_diloco_with_its_compressor_and_period(example, name, every, kind, outer, lr):
    from lightning_onebit import OnebitDiLoCoStrategy

    config, args = fs.run_args(name, 620, lamb_lr=None)
    assert config == "bert_diloco.yaml"
    cli = example.BertFinetuneCLI(
        example.BertClassifier, example.TextClassificationData, run=False,
        args=["--config", str(ROOT / "examples" / "configs" / config), "--data.num_train", "64", "--data.num_val",
              "32", "--trainer.logger", "false", *args])
    strategy = cli.trainer.strategy
    assert isinstance(strategy, OnebitDiLoCoStrategy)
    assert (strategy.sync_every, strategy.compression.kind, strategy.outer_optimizer) == (every, kind, outer)
    assert strategy.outer_lr == lr and strategy.ranks_per_node == 1  # bert_diloco.yaml's two replicas of one rank


# ---------------------------------------------------------------------------------------------------------------------
# the figures of a run
def test_bits_per_parameter_per_step():
    n = 1000
    assert fs.bits_per_parameter_step(620 * ring_allreduce_bytes(n, 4, 2), n, 620) == 32.0  # DDP on 2 ranks
    assert fs.bits_per_parameter_step(20 * ring_allreduce_bytes(n, 4, 2), n, 640) == 1.0  # fp32 sync every 32 steps
    assert fs.bits_per_parameter_step(None, n, 620) is None and fs.bits_per_parameter_step(8, None, 620) is None


def test_sweep_fails_a_local_steps_run_that_synced_less_than_named():
    fs.check_outer_syncs("adamw", dict(steps=620))  # not local steps: nothing to check
    fs.check_outer_syncs("diloco_topk@32", dict(steps=620, outer_syncs=20))  # 19 periods and the end of fit
    with pytest.raises(RuntimeError, match="diloco_topk@32: 18 outer syncs in 620 steps, expected at least 19"):
        fs.check_outer_syncs("diloco_topk@32", dict(steps=620, outer_syncs=18))
    with pytest.raises(RuntimeError, match="None outer syncs"):
        fs.check_outer_syncs("diloco_none@8", dict(steps=620, outer_syncs=None))


def _run(run, seed, acc, bytes_sent, bits=None):
    return dict(task="synthetic", run=run, seed=seed, val_acc=acc, bytes_sent=bytes_sent, bytes_fp32_equivalent=400,
                bytes_sent_warmup=None, freeze_step=None, stage=None, settings=dict(steps=620), freeze=None,
                mask=None, bits_per_parameter_step=bits)


def test_table_shows_local_steps_runs_against_adamw_with_their_bytes_and_bits():
    rows = [_run("adamw", 0, 0.99, 400, 32.0), _run("adamw", 1, 0.98, 400, 32.0),
            _run("diloco_topk@32", 0, 0.985, 4, 0.32), _run("diloco_topk@32", 1, 0.99, 2, 0.16),
            _run("onebit_adam@auto", 0, 0.99, 100)]  # made before bits were recorded
    results = {"runs": {fs.key_of(r["task"], r["run"], r["seed"]): r for r in rows}}
    table = {r["run"]: r for r in fs.table_rows(results)}
    topk = table["diloco_topk@32"]
    assert topk["reference"] == "adamw" and topk["diff"] == {0: pytest.approx(-0.5), 1: pytest.approx(1.0)}
    assert topk["bytes_ratio"] == 150.0 and topk["bits_per_parameter_step"] == pytest.approx(0.24)
    assert table["onebit_adam@auto"]["bits_per_parameter_step"] is None
    line = next(x for x in fs.format_table(results).splitlines() if x.startswith("diloco_topk@32"))
    assert "150.00" in line and "0.24" in line and "+0.25" in line


# ---------------------------------------------------------------------------------------------------------------------
# one run of the example, counted by hand
def test_local_steps_run_of_the_example_counts_its_outer_syncs(example, tmp_path):
    """``diloco_none@4`` on a 1-layer BERT of the example, 8 steps on 2 CPU ranks (2 replicas of one rank): the inner
    steps send nothing, and each of the 2 outer syncs is an fp32 ring allreduce of the N trainable parameters (4N
    bytes on 2 ranks); so 8 bits per parameter per step, a quarter of DDP's 32."""
    sizes = dict(hidden_size=32, num_layers=1, num_heads=2, intermediate_size=64)
    data_sizes = dict(num_train=512, num_val=64)
    config, args = fs.run_args("diloco_none@4", 8, lamb_lr=None)
    summary = tmp_path / "summary.json"
    command = [sys.executable, str(EXAMPLE), "fit", "--config", str(ROOT / "examples" / "configs" / config),
               "--trainer.max_epochs", "1", "--trainer.enable_progress_bar", "false",
               "--trainer.logger.init_args.save_dir", str(tmp_path), "--summary_json", str(summary), *args]
    command += [f"--model.{k}={v}" for k, v in sizes.items()] + [f"--data.{k}={v}" for k, v in data_sizes.items()]
    proc = subprocess.run(command, cwd=tmp_path, env=script_env(), capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-4000:]
    result = json.loads(summary.read_text())
    assert result["strategy"] == "OnebitDiLoCoStrategy" and result["steps"] == 8 and result["outer_syncs"] == 2
    data = example.TextClassificationData(**data_sizes)
    model = example.BertClassifier(vocab_size=data.vocab_size, num_labels=data.num_labels, **sizes)
    numel = sum(p.numel() for p in model.parameters() if p.requires_grad)
    assert result["trainable_parameters"] == numel
    assert result["bytes_sent"] == 2 * ring_allreduce_bytes(numel, 4, 2) == 2 * 4 * numel, result
    assert result["bytes_fp32_equivalent"] == 8 * ring_allreduce_bytes(numel, 4, 2)
    assert fs.bits_per_parameter_step(result["bytes_sent"], result["trainable_parameters"], 8) == 8.0


# ---------------------------------------------------------------------------------------------------------------------
# the docs' table and the picture
def _record(run, seed, acc, bytes_sent, settings, **extra):
    return dict(task="synthetic", run=run, seed=seed, val_acc=acc, bytes_sent=bytes_sent, bytes_fp32_equivalent=400,
                steps=620, bytes_sent_warmup=None, freeze_step=None, stage=None, settings=settings, freeze=None,
                mask=None, library="abc1234", **extra)


def _lm_record(run, seed, loss, bytes_sent, bits):
    return dict(task="lm", run=run, seed=seed, val_loss=loss, bytes_sent=bytes_sent, bits_per_parameter_step=bits,
                step_s=0.1, trainable_parameters=100, tokens=1000, library="def5678",
                settings=dict(steps=320, batch_size=8, context=128, layers=4, width=128, heads=4, lr=2e-3,
                              val_windows=128))


@pytest.fixture
def local_steps_results(tmp_path, monkeypatch):
    from benchmarks import result_tables

    same, other = dict(steps=620, val_checks=4), dict(steps=20, val_checks=4)
    runs = [_record("diloco_topk@32", 0, 0.99, 4.0, same, trainable_parameters=10, bits_per_parameter_step=0.005),
            _record("onebit_adam@auto", 1, 0.98, 100.0, same, trainable_parameters=10, bits_per_parameter_step=0.13)]
    references = [_record("adamw", 0, 0.996, 400.0, same), _record("adamw", 1, 0.998, 400.0, other),  # not the same
                  _record("onebit_adam@auto", 1, 0.5, 1.0, same),  # the file's own run of that key stays
                  _record("onebit_adam@auto+int8", 0, 0.99, 50.0, same)]  # not a reference run
    lm = [_lm_record("adamw", 0, 2.5, 1000.0, 32.0), _lm_record("diloco_topk@32", 0, 2.55, 2.0, 0.064)]
    write = lambda name, rs, **more: (tmp_path / f"{name}.json").write_text(json.dumps(  # noqa: E731
        dict(runs={f"{r['task']}/{r['run']}/{r['seed']}": r for r in rs}, **more)))
    write("local_steps_sweep", runs)
    write("warmup_sweep", references)
    write("lm_local_steps", lm, corpus=dict(files=168, python="3.11.7", bytes=4698388, sha256="ab" * 32,
                                            val_bytes=413539))
    monkeypatch.setattr(result_tables, "RESULTS", tmp_path)
    return tmp_path


def test_local_steps_table_completes_the_sweep_with_same_settings_references(local_steps_results):
    from benchmarks import result_tables

    runs = result_tables.local_steps_runs()["runs"]
    assert set(runs) == {"synthetic/diloco_topk@32/0", "synthetic/onebit_adam@auto/1", "synthetic/adamw/0"}
    assert runs["synthetic/adamw/0"]["copied_from"] == "warmup_sweep"
    assert runs["synthetic/adamw/0"]["bits_per_parameter_step"] == 8 * 400 / (10 * 620)  # the same model's parameters
    assert runs["synthetic/onebit_adam@auto/1"]["val_acc"] == 0.98
    text = result_tables.local_steps_table()
    example = text.split("**A language model")[0]
    rows = {cells[1]: cells[2:] for cells in ([c.strip() for c in line.split("|")[1:-1]]
                                              for line in example.splitlines() if line.startswith("| synthetic |"))}
    assert rows["`diloco_topk@32`"] == ["99.00%", "-", "-0.60 / -", "4e-06", "100.0x", "0.005"]
    assert rows["`adamw`"][:3] == ["99.60%", "-", ""]
    assert ("Copied from `results/warmup_sweep.json`, `results/freeze_sweep_capped.json`, `results/defaults_sweep.json`"
            " (same harness and settings): synthetic `adamw` seed 0." in text)
    # the language model's table: loss per seed, percent against the same seed's AdamW-DDP
    assert "| `diloco_topk@32` | 2.5500 | +2.00 | 2e-06 | 500.0x | 0.064 |" in text
    assert "168 files of Python 3.11.7" in text


def test_local_steps_picture_is_830_px_wide_with_both_panels(local_steps_results):
    pytest.importorskip("matplotlib")
    import matplotlib.image

    from benchmarks import plot_local_steps, result_tables

    lm = json.loads((local_steps_results / "lm_local_steps.json").read_text())
    path = plot_local_steps.plot(result_tables.local_steps_runs(), lm, local_steps_results / "local_steps.png")
    image = matplotlib.image.imread(path)
    assert image.shape[1] == 830 and image.shape[0] == 720  # two panels of 360 px
    assert plot_local_steps.family_of("diloco_topk_sgd@8") == ("onebit_diloco, top-k + 2-bit, outer SGD lr 1",
                                                               "tab:orange", "P")
    assert [p["value"] for p in plot_local_steps.points(lm["runs"], "val_loss")] == [2.5, 2.55]
