"""The result tables of the docs and the README are the rendering of the benchmark outputs in results/ (never edited
by hand)."""

from __future__ import annotations

from benchmarks import result_tables


def _pages() -> dict[str, str]:
    return {str(path): path.read_text() for path in result_tables.pages()}


def test_result_tables_match_results():
    current = _pages()
    updated = result_tables.render(current)
    stale = [page for page in current if updated[page] != current[page]]
    assert not stale, f"stale result tables in {stale}: run python -m benchmarks.result_tables"


def test_render_replaces_only_marked_blocks():
    current = _pages()
    (page,) = [page for page, text in current.items() if "<!-- results:bytes -->" in text]
    stale = dict(current, **{page: current[page].replace("| 1/32.0 |", "| 1/99.0 |", 1)})
    assert stale[page] != current[page]
    assert result_tables.render(stale) == current


def _run(task: str, run: str, seed: int, val_acc: float, freeze_step=None, bytes_sent: float = 1.0) -> dict:
    return {"task": task, "run": run, "seed": seed, "val_acc": val_acc, "freeze_step": freeze_step,
            "bytes_sent": bytes_sent, "bytes_fp32_equivalent": 4.0, "settings": {"steps": 620}, "library": "abc1234"}


def test_freeze_seeds_table_counts_runs_within_half_a_point_collapses_and_bound_decisions(tmp_path, monkeypatch):
    import json

    capped = {
        f"synthetic/{r['run']}/{r['seed']}": r for r in [
            _run("synthetic", "adamw", 0, 0.996, bytes_sent=4.0), _run("synthetic", "adamw", 1, 0.998, bytes_sent=4.0),
            _run("synthetic", "onebit_adam@0.2", 0, 0.991, 124),  # -0.5 point: within
            dict(_run("synthetic", "onebit_adam@0.2", 1, 0.500, 124, bytes_sent=2.0),  # collapsed, at the bound
                 freeze={"reason": "max_step"}),
        ]}
    uncapped = {"synthetic/onebit_adam@0.2/0": _run("synthetic", "onebit_adam@0.2", 0, 0.990, 124)}  # -0.6: not
    (tmp_path / "freeze_sweep_capped.json").write_text(json.dumps({"tasks": {}, "runs": capped}))
    (tmp_path / "freeze_sweep_seeds_uncapped.json").write_text(json.dumps({"tasks": {}, "runs": uncapped}))
    monkeypatch.setattr(result_tables, "RESULTS", tmp_path)

    rows = {tuple(cell.strip() for cell in line.split("|")[1:3]): [c.strip() for c in line.split("|")[3:-1]]
            for line in result_tables.freeze_seeds_table().splitlines() if line.startswith("| onebit")}
    assert rows[("onebit_adam@0.2", "True")] == ["-0.5", "**-49.8**", "1 of 2", "1", "124 (1 at the bound)", "3.00x"]
    assert rows[("onebit_adam@0.2", "False")] == ["**-0.6**", "-", "0 of 1", "0", "124", "4.00x"]
    assert ("onebit_adam@0.25", "True") not in rows


def test_warmup_sweep_table_shows_every_seed_the_bytes_and_the_warmup_share(tmp_path, monkeypatch):
    import json

    runs = [
        _run("synthetic", "adamw", 0, 0.996, bytes_sent=4.0), _run("synthetic", "adamw", 1, 0.998, bytes_sent=4.0),
        _run("synthetic", "ddp_powersgd_r4@0.1", 0, 0.990, bytes_sent=0.5),  # seed 1 not run
        dict(_run("synthetic", "onebit_adam@auto+int8", 0, 0.997, 228, bytes_sent=0.4), bytes_sent_warmup=0.2,
             stage="compression"),
        dict(_run("synthetic", "onebit_adam@auto+int8", 1, 0.995, 310, bytes_sent=0.5), bytes_sent_warmup=0.35,
             stage="compression", freeze={"reason": "max_step"}),
    ]
    (tmp_path / "warmup_sweep.json").write_text(json.dumps({"tasks": {}, "runs": {
        f"{r['task']}/{r['run']}/{r['seed']}": r for r in runs}}))
    monkeypatch.setattr(result_tables, "RESULTS", tmp_path)
    rows = {cells[1]: cells[2:] for cells in ([c.strip() for c in line.split("|")[1:-1]]
                                              for line in result_tables.warmup_sweep_table().splitlines()
                                              if line.startswith("| synthetic"))}
    assert rows["adamw"] == ["99.60%", "99.80%", "", "-", "-", "1.00x"]
    assert rows["ddp_powersgd_r4@0.1"] == ["99.00%", "-", "-0.60 / -", "-", "-", "8.00x"]
    # seed 1 froze at its bound (starred); the warmup sent 50% and 70% of the bytes; 10x and 8x fewer than DDP
    assert rows["onebit_adam@auto+int8"] == ["99.70%", "99.50%", "+0.10 / -0.30", "228 / 310*", "60%", "9.00x"]
    assert "Library abc1234" in result_tables.warmup_sweep_table()


def test_defaults_sweep_table_applies_issue_44s_test_per_seed(tmp_path, monkeypatch):
    import json

    def write(name, runs):
        (tmp_path / f"{name}.json").write_text(json.dumps({"tasks": {}, "runs": {
            f"{r['task']}/{r['run']}/{r['seed']}": r for r in runs}}))

    write("freeze_sweep_capped", [_run("mail", "adamw", s, acc, bytes_sent=30.0)
                                  for s, acc in ((0, 0.980), (1, 0.985))])
    write("defaults_sweep", [
        _run("mail", "ddp_powersgd_r4@0.1", 0, 0.975, bytes_sent=6.0),
        _run("mail", "onebit_adam@auto+powersgd4", 0, 0.984, bytes_sent=2.0),  # +0.4, above PowerSGD, 3x fewer
        _run("mail", "ddp_powersgd_r4@0.1", 1, 0.978, bytes_sent=6.0),
        _run("mail", "onebit_adam@auto+powersgd4", 1, 0.977, bytes_sent=5.0),  # -0.8, under PowerSGD, 1.2x fewer
        _run("mail", "zeroone_adam+powersgd4", 1, 0.981, bytes_sent=1.0),
        _run("mail", "ddp_bf16", 1, 0.986, bytes_sent=15.0),  # a baseline: accuracy and AdamW-DDP's bytes over its
        _run("mail", "onebit_adam@auto+powersgd4", 2, 0.990, bytes_sent=2.0),  # a third seed: shown, no references
    ])
    monkeypatch.setattr(result_tables, "RESULTS", tmp_path)
    rows = {cells[1]: cells[2:] for cells in ([c.strip() for c in line.split("|")[1:-1]]
                                              for line in result_tables.defaults_sweep_table().splitlines()
                                              if line.startswith("| mail"))}
    # AdamW-DDP, DDP + bf16, DDP + PowerSGD r1 and r4, 1-bit Adam, 0/1 Adam, 1-bit LAMB, the bytes, the test
    assert rows["0"] == ["98.00%", "-", "-", "97.50% (-0.50, 5.0x)", "98.40% (+0.40, 15.0x)", "-", "-",
                         "15.0x / 3.00x", "met"]
    assert rows["1"] == ["98.50%", "98.60% (+0.10, 2.0x)", "-", "97.80% (-0.70, 5.0x)", "97.70% (-0.80, 6.0x)",
                         "98.10% (-0.40, 30.0x)", "-", "6.0x / 1.20x",
                         "not met: 0.5 point, PowerSGD's accuracy, 1.5x PowerSGD's bytes"]
    assert rows["2"] == ["-", "-", "-", "-", "99.00%", "-", "-", "-", "-"]


def test_example_seeds_table_counts_seeds_against_powersgd_and_adamw(tmp_path, monkeypatch):
    import json

    def run(name, seed, acc, loss):
        return dict(_run("synthetic", name, seed, acc), validations=[{"step": 620, "val_acc": acc, "val_loss": loss}])

    def write(name, runs):
        (tmp_path / f"{name}.json").write_text(json.dumps({"tasks": {}, "runs": {
            f"{r['task']}/{r['run']}/{r['seed']}": r for r in runs}}))

    # seed 0's references from the earlier files, seed 1's from the new one; the new file's 1-bit run wins
    write("freeze_sweep_capped", [run("adamw", 0, 0.996, 0.011)])
    write("defaults_sweep", [run("ddp_powersgd_r4@0.1", 0, 1.0, 0.001),
                             run("onebit_adam@auto+powersgd4", 0, 0.990, 0.05)])
    write("example_seeds", [
        run("onebit_adam@auto+powersgd4", 0, 0.997, 0.016),  # under PowerSGD, above AdamW-DDP
        run("adamw", 1, 0.998, 0.010), run("ddp_powersgd_r4@0.1", 1, 0.992, 0.029),
        run("onebit_adam@auto+powersgd4", 1, 0.998, 0.001),  # above PowerSGD, equal to AdamW-DDP
        run("onebit_adam@0.5+powersgd4", 1, 0.991, 0.002),  # under both
    ])
    monkeypatch.setattr(result_tables, "RESULTS", tmp_path)
    text = result_tables.example_seeds_table()
    rows = {cells[0]: cells[1:] for cells in ([c.strip() for c in line.split("|")[1:-1]]
                                             for line in text.splitlines() if line[:4] in ("| 0 ", "| 1 "))}
    assert rows["0"] == ["99.6% / 0.0110", "100.0% / 0.0010", "99.7% / 0.0160", "-", "-"]
    assert rows["1"] == ["99.8% / 0.0100", "99.2% / 0.0290", "99.8% / 0.0010", "99.1% / 0.0020", "-"]
    (mean,) = [[c.strip() for c in line.split("|")[2:-1]] for line in text.splitlines() if line.startswith("| mean ")]
    assert mean == ["99.70% / 0.0105", "99.60% / 0.0150", "99.75% / 0.0085", "99.10% / 0.0020", "-"]
    assert "1-bit Adam (defaults): 1 / 2 of 2" in text
    assert "frozen at 1/2: 0 / 0 of 1" in text
    assert "DDP + PowerSGD r4: 2 / 1 of 2" in text
