"""benchmarks/convergence.py without training: the validation rows of a CSVLogger metrics file, the freeze step and
bytes ratio of each run, and the picture (and ``--plot-only``) from a small synthetic results dict."""

from __future__ import annotations

import json
import sys

import pytest

from benchmarks import convergence as cv

METRICS = """epoch,step,train_loss,val_acc,val_f1,val_loss
0,9,0.66,,,
0,19,0.69,,,
0,29,0.69,,,
0,30,,0.5,0.33,0.6931
0,39,0.69,,,
0,61,,0.75,0.7,0.52
0,61,,0.8,0.79,0.5
1,92,,0.99,0.99,0.01
"""


def test_val_rows_are_read_by_optimizer_step(tmp_path):
    path = tmp_path / "metrics.csv"
    path.write_text(METRICS)
    # Lightning logs a validation at the batches that stepped before it: step 30 is the validation after 31 steps;
    # a step logged twice keeps its last row; training rows (no val_acc) are skipped
    assert cv.read_val_metrics(path) == dict(steps=[31, 62, 93], val_acc=[0.5, 0.8, 0.99],
                                             val_loss=[0.6931, 0.5, 0.01])
    path.write_text("epoch,step,train_loss\n0,9,0.6\n")  # a logger without validation columns
    assert cv.read_val_metrics(path) == dict(steps=[], val_acc=[], val_loss=[])


def test_metrics_file_of_the_latest_version(tmp_path):
    for version in (2, 10):
        folder = tmp_path / "lightning_logs" / "bert_onebit" / f"version_{version}"
        folder.mkdir(parents=True)
        (folder / "metrics.csv").write_text(METRICS)
    assert cv.find_metrics(tmp_path, "bert_onebit").parent.name == "version_10"  # numeric, not text order
    with pytest.raises(FileNotFoundError):
        cv.find_metrics(tmp_path, "bert_lamb")


def test_validation_arguments_and_runs_are_bert_parity_configs():
    assert cv.val_args(31) == ["--trainer.val_check_interval", "31", "--trainer.check_val_every_n_epoch", "1"]
    from benchmarks.bert_parity import CONFIGS

    assert [CONFIGS[name] for name in cv.RUNS] == ["bert_adamw.yaml", "bert_onebit.yaml", "bert_zeroone.yaml",
                                                    "bert_lamb.yaml"]


def test_freeze_step_and_why():
    ddp = cv.freeze_of({"optimizer": "AdamW"}, {})
    assert ddp["freeze_step"] is None and ddp["freeze_kind"] is None
    auto = cv.freeze_of({"optimizer": "OnebitAdam", "freeze_step": 220, "auto_freeze": "at step 220, gradients ...",
                         "auto_freeze_reason": "settled"},
                        {"freeze_step": "auto"})
    assert (auto["freeze_step"], auto["freeze_kind"]) == (220, "auto")
    assert auto["freeze_reason"].startswith("at step 220")
    bound = cv.freeze_of({"optimizer": "OnebitLamb", "freeze_step": 400, "auto_freeze": "max_step 400 reached (...)",
                          "auto_freeze_reason": "max_step"},
                         {})
    assert bound["freeze_kind"] == "auto, max_step bound"
    fixed = cv.freeze_of({"optimizer": "OnebitAdam", "freeze_step": 150, "auto_freeze": None}, {"freeze_step": 150})
    assert fixed["freeze_kind"] == "fixed"
    zeroone = cv.freeze_of({"optimizer": "ZeroOneAdam", "freeze_step": 16, "auto_freeze": None},
                           {"var_update_scaler": 16, "var_freeze_step": 176})
    assert (zeroone["freeze_step"], zeroone["var_freeze_step"]) == (16, 176)
    assert "var_freeze_step=176" in zeroone["freeze_reason"]


def _run(name: str, acc: float, bytes_sent: int, freeze_step=None, auto=None, optimizer="OnebitAdam") -> dict:
    summary = dict(optimizer=optimizer, strategy="OnebitStrategy", steps=620, val_acc=acc, val_loss=1 - acc,
                   freeze_step=freeze_step, auto_freeze=auto,
                   auto_freeze_reason=None if auto is None else "max_step" if auto.startswith("max_step") else "settled",
                   bytes_sent=bytes_sent, bytes_fp32_equivalent=2000,
                   rounds_per_100_steps=100.0, wall_s=100.0)
    steps = list(range(31, 621, 31))
    metrics = dict(steps=steps, val_acc=[min(acc, 0.5 + s / 400) for s in steps],
                   val_loss=[max(1 - acc, 0.7 - s / 900) for s in steps])
    used = {"seed_everything": 42, "optimizer": {"init_args": {"lr": 5e-4, "var_update_scaler": 16,
                                                               "var_freeze_step": 176}}}
    return cv.run_record(name, cv.CONFIGS[name], summary, metrics, used)


def _results() -> dict:
    runs = {
        "ddp_adamw": _run("ddp_adamw", 0.999, 2000, optimizer="AdamW"),
        "onebit_adam": _run("onebit_adam", 0.997, 740, 220, "at step 220, ..."),
        "zeroone_adam": _run("zeroone_adam", 0.995, 200, 16, optimizer="ZeroOneAdam"),
        "onebit_lamb": _run("onebit_lamb", 0.998, 1300, 400, "max_step 400 reached (...)", optimizer="OnebitLamb"),
    }
    cv.add_bytes_ratios(runs)
    return dict(val_every=31, runs=runs)


def test_records_ratios_and_legend():
    runs = _results()["runs"]
    assert runs["ddp_adamw"]["freeze_step"] is None and runs["ddp_adamw"]["seed"] == 42
    assert runs["onebit_adam"]["bytes_ratio_vs_ddp_fp32"] == pytest.approx(2000 / 740)
    assert cv.legend_label("onebit_adam", runs["onebit_adam"]) == (
        "1-bit Adam: 99.7%, 2.7x fewer bytes; freeze 220 (auto)")
    assert cv.legend_label("ddp_adamw", runs["ddp_adamw"]) == "AdamW (DDP): 99.9%, fp32 bytes (baseline)"
    assert cv.legend_label("zeroone_adam", runs["zeroone_adam"]) == (
        "0/1 Adam: 99.5%, 10.0x fewer bytes; warmup 16, variance frozen 176")
    assert "(auto, max_step bound)" in cv.legend_label("onebit_lamb", runs["onebit_lamb"])
    without_ddp = {"onebit_adam": dict(runs["onebit_adam"])}
    cv.add_bytes_ratios(without_ddp)
    assert without_ddp["onebit_adam"]["bytes_ratio_vs_ddp_fp32"] is None


def test_picture_is_830_px_wide(tmp_path):
    matplotlib_image = pytest.importorskip("matplotlib.image")  # the benchmarks extra

    path = cv.plot(_results(), tmp_path / "convergence.png")
    assert path.exists()
    image = matplotlib_image.imread(path)
    assert image.shape[1] == 830
    assert cv.plot({"runs": {}}, tmp_path / "empty.png") is None


def test_plot_only_redraws_from_the_json_and_runs_nothing(tmp_path, monkeypatch):
    pytest.importorskip("matplotlib")
    (tmp_path / "convergence.json").write_text(json.dumps(_results()))
    monkeypatch.setattr(cv, "RESULTS_DIR", tmp_path)
    monkeypatch.setattr(cv, "run_example", lambda *a, **k: pytest.fail("--plot-only ran the example"))
    monkeypatch.setattr(sys, "argv", ["convergence", "--plot-only"])
    cv.main()
    assert (tmp_path / "convergence.png").exists()
