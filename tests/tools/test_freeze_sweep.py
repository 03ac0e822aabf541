"""benchmarks/freeze_sweep.py (issue 26) without training: the arguments of each run kind as the example's parser reads
them, the variance trace on a real AdamW, and the table and picture from a small results dict."""

import dataclasses
import json
import math
from types import SimpleNamespace

import pytest
import torch
import yaml

from benchmarks import freeze_sweep as fs
from tests.paths import ROOT


# ---------------------------------------------------------------------------------------------------------------------
# arguments per run kind
def _flags(args: list[str]) -> dict[str, list[str]]:
    out: dict[str, list[str]] = {}
    for flag, value in zip(args[::2], args[1::2]):
        out.setdefault(flag, []).append(value)
    return out


def test_fixed_fractions_give_integer_freeze_steps_and_drop_the_config_auto_freeze():
    assert [fs.freeze_step_of(f, 600) for f in fs.DEFAULT_FRACTIONS] == [30, 60, 150, 300]
    assert [fs.freeze_step_of(f, 620) for f in fs.DEFAULT_FRACTIONS] == [31, 62, 155, 310]
    assert fs.freeze_step_of(0.05, 10) == 1 and fs.freeze_step_of(0.01, 10) == 1  # never step 0
    config, args = fs.run_args("onebit_adam@0.25", 600, lamb_lr="6e-4")
    assert config == "bert_onebit.yaml"
    assert args == ["--optimizer.init_args.freeze_step", "150", "--optimizer.init_args.auto_freeze", "null"]
    config, args = fs.run_args("onebit_lamb@0.25", 620, lamb_lr="6e-4")
    assert config == "bert_lamb.yaml"
    assert _flags(args) == {"--optimizer.init_args.lr": ["6e-4"], "--optimizer.init_args.freeze_step": ["155"],
                            "--optimizer.init_args.auto_freeze": ["null"]}
    assert fs.run_args("adamw", 600, lamb_lr="6e-4") == ("bert_adamw.yaml", [])


@pytest.mark.parametrize("steps", [600, 601, 620, 20])
def test_auto_passes_no_setting_unless_a_bound_share_is_given(steps):
    for family in ("onebit_adam", "onebit_lamb"):
        _, args = fs.run_args(f"{family}@auto", steps, lamb_lr=None)
        flags = _flags(args)
        assert flags.pop("--optimizer.init_args.freeze_step") == ["auto"]
        # the config's block is dropped, so that every AutoFreeze field is the library's default
        assert flags.pop("--optimizer.init_args.auto_freeze") == ["null"]
        assert flags == {}  # no window, check_every, thresholds, patience, loss_drop, min_step, max_step, lr
        _, args = fs.run_args(f"{family}@auto", steps, lamb_lr=None, auto_max_share=0.5)
        flags = _flags(args)
        position = args.index  # the block is dropped first, then max_step set
        assert position("--optimizer.init_args.auto_freeze") < position("--optimizer.init_args.auto_freeze.max_step")
        (max_step,) = flags.pop("--optimizer.init_args.auto_freeze.max_step")
        assert int(max_step) == steps // 2


def test_lamb_twin_never_freezes_and_shares_the_lr():
    _, twin = fs.run_args("lamb_uncompressed", 600, lamb_lr="6e-4")
    _, compressed = fs.run_args("onebit_lamb@auto", 600, lamb_lr="6e-4")
    assert int(_flags(twin)["--optimizer.init_args.freeze_step"][0]) > 600
    assert _flags(twin)["--optimizer.init_args.lr"] == _flags(compressed)["--optimizer.init_args.lr"] == ["6e-4"]
    assert fs.reference_of("onebit_lamb@0.25") == "lamb_uncompressed" and fs.reference_of("onebit_adam@auto") == "adamw"
    assert fs.reference_of("lamb_uncompressed") == "adamw" and fs.reference_of("adamw") is None


@pytest.mark.parametrize(
    "name", ["sgd", "adamw@0.1", "onebit_adam", "onebit_adam@1.5", "onebit_lamb@0", "zeroone@auto", "onebit_adam@x"]
)
def test_unknown_run_names_are_refused(name):
    with pytest.raises(ValueError):
        fs.parse_run(name)


def test_run_names_are_canonical():
    assert fs.canonical_run("onebit_adam@0.250") == "onebit_adam@0.25" and fs.canonical_run("adamw") == "adamw"
    assert fs.default_runs([0.05, 0.5]) == ["adamw", "onebit_adam@0.05", "onebit_adam@0.5", "onebit_adam@auto",
                                            "onebit_lamb@0.25", "onebit_lamb@auto", "lamb_uncompressed"]


def test_validation_falls_on_the_last_step():
    for steps, checks, every in ((600, 4, 150), (620, 4, 155), (20, 4, 5), (7, 4, 1), (601, 4, 1)):
        assert fs.val_interval(steps, checks) == every and steps % every == 0


def test_real_tasks_take_own_data_settings_but_not_its_epochs():
    flags = _flags(fs.REAL_TASK_ARGS)
    assert flags == {"--data.max_length": ["64"], "--data.batch_size": ["16"]}
    assert fs.DEFAULT_LR == "1e-4"
    args = SimpleNamespace(lamb_lr=None, lr=None)
    assert fs.lamb_lr_of("agnews", args) == "0.0006" and fs.lamb_lr_of("synthetic", args) is None
    # an Adam lr given on synthetic: LAMB's follows it (it would otherwise get the Adam lr from the common arguments)
    assert fs.lamb_lr_of("synthetic", SimpleNamespace(lamb_lr=None, lr="1e-3")) == "0.006"
    assert fs.lamb_lr_of("mail", SimpleNamespace(lamb_lr="2e-3", lr="1e-3")) == "2e-3"


@pytest.fixture(scope="module")
def optimizer_parser():
    """The optimizer part of the example's LightningCLI parser (jsonargparse, a subclass of Optimizer)."""
    from jsonargparse import ActionConfigFile, ArgumentParser

    import lightning_onebit  # noqa: F401

    parser = ArgumentParser(exit_on_error=False)
    parser.add_argument("--config", action=ActionConfigFile)
    parser.add_subclass_arguments((torch.optim.Optimizer,), "optimizer", fail_untyped=False, skip={"params"})
    return parser


@pytest.mark.parametrize("config", ["bert_onebit.yaml", "bert_lamb.yaml"])
def test_the_example_parser_reads_auto_as_the_library_defaults(optimizer_parser, config, tmp_path):
    from lightning_onebit import AutoFreeze

    block = yaml.safe_load((ROOT / "examples" / "configs" / config).read_text())["optimizer"]
    # the shipped configs leave every AutoFreeze setting to the library
    assert block["init_args"]["freeze_step"] == "auto" and "auto_freeze" not in block["init_args"]
    # a config that hand-sets them (as the configs did before): the sweep's @auto arguments still drop them all
    block["init_args"]["auto_freeze"] = dict(window=40, check_every=10, threshold=0.5, max_step=400)
    path = tmp_path / "optimizer.yaml"
    path.write_text(yaml.safe_dump({"optimizer": block}))
    family = "onebit_adam" if config == "bert_onebit.yaml" else "onebit_lamb"

    _, args = fs.run_args(f"{family}@auto", 600, lamb_lr="6e-4")
    init = optimizer_parser.parse_args(["--config", str(path), *args]).optimizer.init_args
    assert init.freeze_step == "auto"
    assert init.auto_freeze is None  # OnebitAdam then builds AutoFreeze(): the library's defaults

    _, args = fs.run_args(f"{family}@auto", 600, lamb_lr="6e-4", auto_max_share=0.5)
    init = optimizer_parser.parse_args(["--config", str(path), *args]).optimizer.init_args
    assert vars(init.auto_freeze) == dataclasses.asdict(AutoFreeze(max_step=300))

    _, args = fs.run_args(f"{family}@0.25", 600, lamb_lr="6e-4")
    init = optimizer_parser.parse_args(["--config", str(path), *args]).optimizer.init_args
    assert init.freeze_step == 150 and init.auto_freeze is None


# ---------------------------------------------------------------------------------------------------------------------
# the variance trace
def test_trace_records_adamw_variance_every_10_steps_and_its_change_over_50():
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.Tanh(), torch.nn.Linear(16, 1))
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
    trainer = SimpleNamespace(is_global_zero=True, global_step=0, strategy=SimpleNamespace(), optimizers=[optimizer])
    pl_module = SimpleNamespace(named_parameters=model.named_parameters)
    trace = fs.VarianceTrace(out="unused", sample=20)  # the 16x8 weight (128 elements) is sampled, the rest whole
    history = {}
    for step in range(1, 71):
        trace.on_train_batch_start(trainer, pl_module, None, step)
        x = torch.randn(32, 8) * (1 + step / 20)  # growing gradients: the variance keeps moving
        loss = model(x).pow(2).mean()
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
        trainer.global_step = step
        trace.on_train_batch_end(trainer, pl_module, {"loss": loss.detach()}, None, step)
        if step % 10 == 0:
            history[step] = [optimizer.state[p]["exp_avg_sq"].sqrt() / math.sqrt(1 - 0.999**step)
                             for p in model.parameters()]
            means = [optimizer.state[p]["exp_avg_sq"].sqrt().mean().item() for p in model.parameters()]
            assert trace.trace["sqrt_v"][-1] == pytest.approx(means, rel=1e-3)
    t = trace.trace
    assert t["names"] == [n for n, _ in model.named_parameters()]
    assert t["steps"] == [10, 20, 30, 40, 50, 60, 70]
    # a full window of 50 steps first at step 60
    assert t["rel_mean_med"][:5] == [None] * 5 and all(x is not None for x in t["rel_mean_med"][5:])
    for i, step in enumerate((60, 70), start=5):
        old, new = history[step - 50], history[step]
        mean_change = sorted(abs(n.mean() - o.mean()).item() / o.mean().item() for o, n in zip(old, new))
        expected = torch.tensor(mean_change, dtype=torch.float64)
        assert t["rel_mean_med"][i] == pytest.approx(float(expected.quantile(0.5)), rel=1e-3)
        assert t["rel_mean_p90"][i] == pytest.approx(float(expected.quantile(0.9)), rel=1e-3)
        assert t["rel_mean_med"][i] > 0.05  # the gradients grew: a real change, not rounding
        # per coordinate: on the sample of the 128-element weight, over the whole of the smaller tensors
        assert [None if idx is None else len(idx) for idx in trace._indices] == [20, None, None, None]
        coord = []
        for o, n, idx in zip(old, new, trace._indices):
            o, n = (o.reshape(-1), n.reshape(-1)) if idx is None else (o.reshape(-1)[idx], n.reshape(-1)[idx])
            coord.append(((n - o).abs().sum() / o.sum()).item())
        expected = torch.tensor(coord, dtype=torch.float64)
        assert t["rel_coord_med"][i] == pytest.approx(float(expected.quantile(0.5)), rel=1e-3)
        assert t["rel_coord_p90"][i] == pytest.approx(float(expected.quantile(0.9)), rel=1e-3)
    assert all(isinstance(x, float) for x in t["loss"])


def test_trace_records_the_step_size_every_10_steps_and_after_the_freeze():
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.Tanh(), torch.nn.Linear(16, 1))
    optimizer = _FrozenAt(model.parameters(), freeze_step=23)
    trainer = SimpleNamespace(is_global_zero=True, global_step=0, strategy=SimpleNamespace(), optimizers=[optimizer])
    pl_module = SimpleNamespace(named_parameters=model.named_parameters)
    trace = fs.VarianceTrace(out="unused")
    expected = {}
    for step in range(1, 41):
        trace.on_train_batch_start(trainer, pl_module, None, step)
        loss = model(torch.randn(32, 8)).pow(2).mean()
        optimizer.zero_grad()
        loss.backward()
        before = [p.detach().clone() for p in model.parameters()]
        trace.on_before_optimizer_step(trainer, pl_module, optimizer)
        optimizer.step()
        trainer.global_step = step
        trace.on_train_batch_end(trainer, pl_module, {"loss": loss.detach()}, None, step)
        deltas = [float((p.detach() - b).norm() / b.norm()) for p, b in zip(model.parameters(), before)]
        whole = math.sqrt(sum(float((p.detach() - b).norm()) ** 2 for p, b in zip(model.parameters(), before))
                          / sum(float(b.norm()) ** 2 for b in before))
        expected[step] = (whole, max(deltas), [n for n, _ in model.named_parameters()][deltas.index(max(deltas))])
    t = trace.trace
    # every 10 steps, and each of the 10 steps after the freeze at 23
    assert t["update_steps"] == [10, 20, *range(24, 34), 40]
    for i, step in enumerate(t["update_steps"]):
        whole, largest, name = expected[step]
        assert t["update_rel"][i] == pytest.approx(whole, rel=1e-3)
        assert t["update_rel_max"][i] == pytest.approx(largest, rel=1e-3)
        assert t["update_rel_max_name"][i] == name


def test_trace_records_the_share_of_coordinates_above_the_adam_bound_after_the_freeze():
    """In the compression stage of 1-bit Adam (here without the cap, which does not change the momenta the share is
    read from), at the steps whose update size is recorded: the share of coordinates whose ``|m_hat| / (sqrt(v_hat)
    + eps)`` exceeds ``adam_step_bound``, over the model and at its largest tensor. Gradients 100 times larger after
    the freeze take most coordinates past the bound; none is in warmup (nothing recorded there)."""
    from lightning_onebit import OnebitAdam
    from lightning_onebit.optim.functional import adam_step_bound

    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.Tanh(), torch.nn.Linear(16, 1))
    optimizer = OnebitAdam(model.parameters(), lr=1e-3, freeze_step=6, cap_update=False)
    trainer = SimpleNamespace(is_global_zero=True, global_step=0, strategy=SimpleNamespace(), optimizers=[optimizer])
    pl_module = SimpleNamespace(named_parameters=model.named_parameters)
    trace = fs.VarianceTrace(out="unused")
    expected = {}
    bound = adam_step_bound((0.9, 0.999))
    for step in range(1, 21):
        trace.on_train_batch_start(trainer, pl_module, None, step)
        loss = model(torch.randn(32, 8)).pow(2).mean() * (100.0 if step > 6 else 1.0)
        optimizer.zero_grad()
        loss.backward()
        trace.on_before_optimizer_step(trainer, pl_module, optimizer)
        optimizer.step()
        trainer.global_step = step
        trace.on_train_batch_end(trainer, pl_module, {"loss": loss.detach()}, None, step)
        shares = {}
        for name, p in model.named_parameters():
            m, v = optimizer.state[p]["exp_avg"].double(), optimizer.state[p]["exp_avg_sq"].double()
            ratio = (m / (1 - 0.9**step)).abs() / ((v / (1 - 0.999**6)).sqrt() + 1e-8)
            shares[name] = (int((ratio > bound).sum()), p.numel())
        above, total = sum(a for a, _ in shares.values()), sum(n for _, n in shares.values())
        largest = max(shares, key=lambda n: shares[n][0] / shares[n][1])
        expected[step] = (above / total, shares[largest][0] / shares[largest][1], largest)
    t = trace.trace
    assert t["clip_steps"] == [*range(7, 17), 20]  # the 10 steps after the freeze at 6, and step 20
    for i, step in enumerate(t["clip_steps"]):
        share, largest, name = expected[step]
        assert t["clip_share"][i] == pytest.approx(share, rel=1e-3)
        assert t["clip_share_max"][i] == pytest.approx(largest, rel=1e-3) and t["clip_share_max_name"][i] == name
    assert max(t["clip_share"]) > 0.5


class _FrozenAt(torch.optim.AdamW):
    """An AdamW that reports a freeze as the compressed optimizers do (``stage``, ``freeze_step``, a detector)."""

    stage = "warmup"

    def __init__(self, params, freeze_step, detector=None):
        super().__init__(params, lr=1e-2)
        self.freeze_step, self.freeze_detector = freeze_step, detector


def test_trace_stops_at_the_freeze_records_it_and_the_masked_embedding_rows(tmp_path):
    from lightning_onebit import MomentumMask

    torch.manual_seed(0)
    embedding = torch.nn.Embedding(10, 4)
    model = torch.nn.Sequential(embedding, torch.nn.Linear(4, 1))
    detector = SimpleNamespace(reason="rule", last=None, window=20,
                               check_every=5, min_step=20, max_step=40, config=SimpleNamespace(threshold=0.3),
                               describe=lambda: "at step 25, ...")
    optimizer = _FrozenAt(model.parameters(), freeze_step=None, detector=detector)
    mask = MomentumMask(auto=True)
    mask.masked_coordinates = {"0.weight": 3 * 4}  # three rows no batch looked up
    trainer = SimpleNamespace(is_global_zero=True, global_step=0, strategy=SimpleNamespace(onebit_optimizer=optimizer),
                              optimizers=[object()], callbacks=[mask])
    pl_module = SimpleNamespace(named_parameters=model.named_parameters,
                                bert=SimpleNamespace(get_input_embeddings=lambda: embedding))
    trace = fs.VarianceTrace(out=str(tmp_path / "trace.json"), window=20)
    for step in range(1, 41):
        trace.on_train_batch_start(trainer, pl_module, None, step)
        loss = model(torch.randint(0, 7, (8,))).pow(2).mean()
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
        if step in (20, 25):  # the rule's checks
            detector.last = {"step": step, "sample_excess": torch.tensor(0.5 if step == 20 else 0.25)}
        if step == 25:
            optimizer.freeze_step = 25  # decided at this step, as freeze_step="auto" does
        trainer.global_step = step
        trace.on_train_batch_end(trainer, pl_module, {"loss": loss.detach()}, None, step)
    trace.on_train_end(trainer, pl_module)
    saved = json.loads((tmp_path / "trace.json").read_text())
    t = saved["trace"]
    assert t["steps"] == [10, 20, 25]  # nothing after the freeze; the freeze step itself off the 10-step grid
    assert t["rel_mean_med"][:2] == [None, None] and t["rel_mean_med"][2] is None  # no record at step 5
    assert saved["freeze"]["step"] == 25 and saved["freeze"]["reason"] == "rule"
    assert saved["freeze"]["figures"] == {"step": 25, "sample_excess": 0.25}
    assert t["checks"] == [{"step": 20, "sample_excess": 0.5}, {"step": 25, "sample_excess": 0.25}]  # each once
    assert saved["freeze"]["settings"]["window"] == 20 and saved["freeze"]["settings"]["threshold"] == 0.3
    assert saved["mask"]["param"] == "0.weight" and saved["mask"]["rows"] == 3 and saved["mask"]["share"] == 0.3
    assert saved["step_s"]["steps"] == 38


# ---------------------------------------------------------------------------------------------------------------------
# the table and the picture
def _run(task, run, seed, acc, freeze=None, bytes_sent=100, reason=None, share=None, stage="compression"):
    return dict(task=task, run=run, seed=seed, val_acc=acc, bytes_sent=bytes_sent, bytes_fp32_equivalent=400,
                freeze_step=freeze, stage=None if freeze is None else stage, settings=dict(steps=600),
                freeze=None if reason is None else dict(reason=reason),
                mask=None if share is None else dict(share=share))


def _results():
    rows = [
        _run("agnews", "adamw", 0, 0.90, bytes_sent=400), _run("agnews", "adamw", 1, 0.92, bytes_sent=400),
        _run("agnews", "onebit_adam@0.25", 0, 0.895, 150, share=0.78), _run("agnews", "onebit_adam@0.25", 1, 0.93, 150),
        _run("agnews", "onebit_adam@0.05", 0, 0.85, 30),
        _run("agnews", "onebit_adam@auto", 0, 0.88, 120, reason="rule"),  # seed 1 missing
        _run("agnews", "lamb_uncompressed", 0, 0.85, 601, bytes_sent=400, stage="warmup"),  # seed 1 missing
        _run("agnews", "onebit_lamb@0.25", 0, 0.86, 150), _run("agnews", "onebit_lamb@0.25", 1, 0.87, 150),
        _run("agnews", "onebit_lamb@auto", 1, 0.80, 300, reason="max_step"),
        _run("mail", "onebit_adam@0.1", 0, 0.97, 60),  # no AdamW for seed 0
        _run("mail", "adamw", 1, 0.98, bytes_sent=400),
        _run("mail", "onebit_adam@auto", 1, 0.975, 601, stage="warmup", bytes_sent=400),  # warmup outlasted the run
    ]
    return {"runs": {fs.key_of(r["task"], r["run"], r["seed"]): r for r in rows}}


def test_table_compares_with_the_same_seed_reference():
    rows = {(r["task"], r["run"]): r for r in fs.table_rows(_results())}
    adam = rows["agnews", "onebit_adam@0.25"]
    assert adam["reference"] == "adamw"
    assert adam["diff"][0] == pytest.approx(-0.5) and adam["diff"][1] == pytest.approx(1.0)
    assert adam["diff_mean"] == pytest.approx(0.25) and adam["acc_mean"] == pytest.approx(0.9125)
    assert adam["bytes_ratio"] == pytest.approx(4.0) and adam["freeze"] == {0: 150, 1: 150}
    assert adam["mask_share"] == {0: 0.78, 1: None}
    lamb = rows["agnews", "onebit_lamb@0.25"]
    assert lamb["reference"] == "lamb_uncompressed"
    assert lamb["diff"] == {0: pytest.approx(1.0), 1: None}  # against its twin (not AdamW's -4), seed 1 has no twin
    assert lamb["diff_mean"] == pytest.approx(1.0)
    assert rows["agnews", "onebit_lamb@auto"]["diff"] == {0: None, 1: None}
    assert rows["agnews", "onebit_lamb@auto"]["diff_mean"] is None
    auto = rows["agnews", "onebit_adam@auto"]
    assert auto["missing"] == [1] and auto["acc"][1] is None and auto["diff"][0] == pytest.approx(-2.0)
    assert rows["agnews", "lamb_uncompressed"]["reference"] == "adamw"
    assert rows["agnews", "lamb_uncompressed"]["diff"][0] == pytest.approx(-5.0)
    assert rows["agnews", "lamb_uncompressed"]["freeze"] == {0: None, 1: None}  # 601 of 600: never froze
    assert rows["agnews", "adamw"]["diff"] is None
    # a seed without its reference: the reference's row says it is missing, and nothing is compared
    assert rows["mail", "adamw"]["missing"] == [0] and rows["mail", "onebit_adam@0.1"]["diff"] == {0: None, 1: None}
    assert rows["mail", "onebit_adam@auto"]["diff"][1] == pytest.approx(-0.5)
    assert rows["mail", "onebit_adam@auto"]["freeze"] == {0: None, 1: None}
    order = [run for task, run in rows if task == "agnews"]
    assert order == ["adamw", "onebit_adam@0.05", "onebit_adam@0.25", "onebit_adam@auto", "onebit_lamb@0.25",
                     "onebit_lamb@auto", "lamb_uncompressed"]

    text = fs.format_table(_results())
    line = next(x for x in text.splitlines() if x.startswith("onebit_lamb@0.25"))
    assert "+1.00" in line and "-4.00" not in line and line.rstrip().endswith("lamb_uncompressed")
    line = next(x for x in text.splitlines() if x.startswith("onebit_adam@auto"))
    assert "missing" in line and "-2.00" in line
    assert not any("gmissing" in x for x in text.splitlines())  # every "missing" in a column of its own
    assert text.index("== agnews") < text.index("== mail")
    assert fs.format_table({"runs": {}}) == "(no runs)"


def test_picture_is_830_px_wide_with_a_panel_per_task(tmp_path):
    import matplotlib.image

    path = fs.plot(_results(), tmp_path / "sweep.png")
    image = matplotlib.image.imread(path)
    assert image.shape[1] == 830 and image.shape[0] == 600  # two tasks, 3 inches each at 100 dpi
    assert fs.plot({"runs": {}}, tmp_path / "empty.png") is None


def test_keys_are_ordered_by_task_seed_and_run():
    keys = {"mail/adamw/0", "agnews/onebit_adam@auto/1", "agnews/adamw/1", "agnews/onebit_adam@0.5/0",
            "synthetic/lamb_uncompressed/0", "agnews/onebit_adam@0.05/0"}
    assert fs.ordered_keys(keys) == ["synthetic/lamb_uncompressed/0", "agnews/onebit_adam@0.05/0",
                                     "agnews/onebit_adam@0.5/0", "agnews/adamw/1", "agnews/onebit_adam@auto/1",
                                     "mail/adamw/0"]


def test_bytes_are_compared_with_the_same_tasks_ddp_run():
    """0/1 Adam's local steps send nothing, so its fp32-equivalent count leaves out what DDP would send there: the
    ratio is taken against the AdamW-DDP run of the same task and length, and only without one from that count."""
    zeroone = _run("mail", "zeroone_adam", 0, 0.98, bytes_sent=50)  # fp32-equivalent 400
    ddp = [_run("mail", "adamw", s, 0.98, bytes_sent=500) for s in (0, 1)]
    other_length = dict(_run("mail", "adamw", 2, 0.98, bytes_sent=900), settings=dict(steps=300))
    results = {"runs": {fs.key_of(r["task"], r["run"], r["seed"]): r for r in [zeroone, *ddp, other_length]}}
    assert fs.ddp_bytes_ratio(results, zeroone) == 10.0  # 500 / 50
    assert fs.ddp_bytes_ratio({"runs": {"mail/zeroone_adam/0": zeroone}}, zeroone) == 8.0  # 400 / 50
    (row,) = [r for r in fs.table_rows(results) if r["run"] == "zeroone_adam"]
    assert row["bytes_ratio"] == 10.0
