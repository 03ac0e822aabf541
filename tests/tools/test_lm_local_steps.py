"""benchmarks/lm_local_steps.py: the standard-library corpus and its held-out files, the byte-level GPT, the windows
every rank trains on, the run names, the table, and one short run with local steps counted by hand."""

from __future__ import annotations

import hashlib
from types import SimpleNamespace

import pytest
import torch

from benchmarks import lm_local_steps as lm
from lightning_onebit.comm import ring_allreduce_bytes


def _stdlib(tmp_path, count=20):
    for i in range(count):
        (tmp_path / f"mod{i:02d}.py").write_bytes(f"# module {i}\nx = {i}\n".encode())
    (tmp_path / "notes.txt").write_text("not a module")
    (tmp_path / "pkg").mkdir()
    (tmp_path / "pkg" / "inner.py").write_text("# a subpackage: not a top-level module")
    return tmp_path


# ---------------------------------------------------------------------------------------------------------------------
# the corpus
def test_corpus_holds_out_every_tenth_file_and_names_its_digest(tmp_path):
    root = _stdlib(tmp_path)
    train, val, corpus = lm.stdlib_corpus(root)
    names = [f"mod{i:02d}.py" for i in range(20)]
    assert corpus["files"] == 20 and corpus["val_files"] == ["mod09.py", "mod19.py"] and corpus["train_files"] == 18
    assert val == b"# module 9\nx = 9\n\0# module 19\nx = 19\n"
    assert train.split(b"\0")[0] == b"# module 0\nx = 0\n" and len(train.split(b"\0")) == 18
    assert corpus["bytes"] == sum(len((root / n).read_bytes()) for n in names)
    assert corpus["train_bytes"] == len(train) and corpus["val_bytes"] == len(val)
    expected = hashlib.sha256(b"".join(n.encode() + b"\0" + (root / n).read_bytes() + b"\0" for n in names))
    assert corpus["sha256"] == expected.hexdigest()
    (root / "mod03.py").write_text("changed")
    assert lm.stdlib_corpus(root)[2]["sha256"] != corpus["sha256"]


def test_corpus_refuses_a_directory_that_is_no_standard_library(tmp_path):
    with pytest.raises(FileNotFoundError, match="not a standard library"):
        lm.stdlib_corpus(tmp_path)


def test_this_pythons_standard_library_makes_the_corpus():
    train, val, corpus = lm.stdlib_corpus()
    assert corpus["files"] > 100 and corpus["bytes"] > 10**6 and len(val) > 10**5 and "os.py" not in corpus["val_files"]


# ---------------------------------------------------------------------------------------------------------------------
# the model and the windows
def test_gpt_is_causal_and_ties_its_output_to_the_byte_embedding():
    TinyGPT, _ = lm._lightning_parts()
    torch.manual_seed(0)
    model = TinyGPT(layers=2, width=16, heads=2, context=12)
    tokens = torch.randint(0, 256, (2, 12))
    logits = model(tokens)
    assert logits.shape == (2, 12, 256)
    changed = tokens.clone()
    changed[:, 8] = (changed[:, 8] + 1) % 256
    again = model(changed)
    torch.testing.assert_close(again[:, :8], logits[:, :8], rtol=0, atol=0)  # the past does not see the future
    assert not torch.equal(again[:, 8:], logits[:, 8:])
    # no separate output matrix: embedding, positions, per block 2 LayerNorms, qkv, proj and the MLP, a final LayerNorm
    per_block = 2 * 2 * 16 + (16 * 48 + 48) + (16 * 16 + 16) + (16 * 64 + 64) + (64 * 16 + 16)
    assert sum(p.numel() for p in model.parameters()) == 256 * 16 + 12 * 16 + 2 * per_block + 2 * 16


def _loader(data, rank, world=2, which="train"):
    data.trainer = SimpleNamespace(world_size=world, global_rank=rank)
    return getattr(data, f"{which}_dataloader")()


def test_every_rank_trains_on_its_own_windows_the_same_for_every_method_of_a_seed():
    _, StdlibData = lm._lightning_parts()
    text = bytes(range(256)) * 40
    make = lambda seed: StdlibData(text, text[:2000], context=15, batch_size=4, steps=3, val_windows=8,  # noqa: E731
                                   seed=seed)
    batches = {rank: list(_loader(make(0), rank)) for rank in (0, 1)}
    assert [len(batches[r]) for r in (0, 1)] == [3, 3] and batches[0][0].shape == (4, 16)
    for step in range(3):
        first = {tuple(w.tolist()) for w in batches[0][step]}
        assert not first & {tuple(w.tolist()) for w in batches[1][step]}  # different windows on each rank
        assert all((w[1:] - w[:-1] == 1).logical_or(w[1:] == 0).all() for w in batches[0][step])  # contiguous text
    again = list(_loader(make(0), 0))
    assert all(torch.equal(a, b) for a, b in zip(again, batches[0]))  # the same windows for every method
    assert not all(torch.equal(a, b) for a, b in zip(list(_loader(make(1), 0)), batches[0]))  # another seed: others
    val = {rank: torch.cat(list(_loader(make(0), rank, which="val"))) for rank in (0, 1)}
    assert val[0].shape == (4, 16) and torch.equal(torch.cat([val[0], val[1]]).sort(0).values,
                                                   torch.tensor(list(text[:128])).view(8, 16).sort(0).values)


# ---------------------------------------------------------------------------------------------------------------------
# run names and the table
@pytest.mark.parametrize(("name", "kind", "options"), [
    ("adamw", "ddp", {}),
    ("onebit_adam@auto", "onebit_adam", {}),
    ("diloco_topk@32", "onebit_diloco", dict(sync_every=32, compressor="topk", outer_optimizer="nesterov")),
    ("diloco_none_sgd@8", "onebit_diloco", dict(sync_every=8, compressor="none", outer_optimizer="sgd", outer_lr=1.0)),
    ("diloco_onebit_sgd@8f4o1", "onebit_diloco", dict(sync_every=8, compressor="onebit", outer_optimizer="sgd",
                                                      outer_lr=1.0, fragments=4, overlap_steps=1)),
    ("zeroone_adam", "zeroone_adam", {}),
    ("zeroone_adam+fp32", "zeroone_adam", {"warmup_exchange": "fp32"}),  # not the strategy's default warmup
    ("onebit_adam@auto+fp32", "onebit_adam", {"warmup_exchange": "fp32"}),
    ("ddp_bf16", "ddp_hook", dict(gradient_exchange="bf16", powersgd_rank=4, vanilla_share=0.0)),
    ("ddp_powersgd_r1@0.1", "ddp_hook", dict(gradient_exchange="powersgd", powersgd_rank=1, vanilla_share=0.1)),
])
def test_lm_run_names(name, kind, options):
    assert lm.parse_lm_run(name) == (kind, options)


@pytest.mark.parametrize("name", ["onebit_adam@0.25", "ddp_powersgd_r4", "diloco_none", "lamb_uncompressed"])
def test_lm_refuses_runs_it_does_not_make(name):
    with pytest.raises(ValueError):
        lm.parse_lm_run(name)


def test_table_compares_each_loss_with_the_same_seed_adamw_run():
    def run(name, seed, loss, sent, bits):
        return dict(run=name, seed=seed, val_loss=loss, bytes_sent=sent, bits_per_parameter_step=bits, step_s=0.1,
                    settings=dict(steps=320))

    runs = [run("adamw", 0, 2.0, 1000, 32.0), run("adamw", 1, 2.5, 1000, 32.0),
            run("diloco_topk@32", 0, 2.02, 5, 0.16), run("diloco_topk@32", 1, 2.45, 15, 0.48)]
    results = dict(runs={f"lm/{r['run']}/{r['seed']}": r for r in runs}, corpus=dict(files=3, bytes=9, sha256="ab"))
    rows = {r["run"]: r for r in lm.table_rows(results)}
    assert rows["adamw"]["diff"] is None and rows["adamw"]["bytes_ratio"] == 1.0
    topk = rows["diloco_topk@32"]
    # the mean over seeds of AdamW-DDP's bytes over the run's (as freeze_sweep's table): (200 + 66.7) / 2
    assert topk["diff"] == {0: pytest.approx(1.0), 1: pytest.approx(-2.0)}
    assert topk["bytes_ratio"] == pytest.approx(400 / 3)
    assert topk["bits_per_parameter_step"] == pytest.approx(0.32) and topk["bytes_sent"] == 10
    line = next(x for x in lm.format_table(results).splitlines() if x.startswith("diloco_topk@32"))
    assert "+1.00" in line and "-2.00" in line and "133.3" in line and "0.32" in line


# ---------------------------------------------------------------------------------------------------------------------
# one short run
def test_a_short_local_steps_run_counts_its_outer_syncs(tmp_path):
    """``diloco_none@4``, 8 steps of a 1-layer GPT on 2 CPU ranks (2 replicas of one rank): 2 outer syncs, each an
    fp32 ring allreduce of the N parameters, and nothing else; the validation loss is recorded at steps 4 and 8."""
    settings = dict(steps=8, batch_size=2, context=16, layers=1, width=16, heads=2, lr=1e-3, warmup=2, val_windows=4,
                    val_every=4)
    record = lm.run_one("diloco_none@4", 0, settings, tmp_path)
    n = record["trainable_parameters"]
    assert n == 256 * 16 + 16 * 16 + (2 * 2 * 16 + 16 * 48 + 48 + 16 * 16 + 16 + 16 * 64 + 64 + 64 * 16 + 16) + 2 * 16
    assert record["strategy"] == "OnebitDiLoCoStrategy" and record["outer_syncs"] == 2 and record["steps"] == 8
    assert record["bytes_sent"] == 2 * ring_allreduce_bytes(n, 4, 2) and record["bits_per_parameter_step"] == 8.0
    assert record["bytes_fp32_equivalent"] == 8 * ring_allreduce_bytes(n, 4, 2)
    assert [v["step"] for v in record["validations"]] == [4, 8] and record["val_loss"] < 6.0  # ln 256 = 5.55
    assert record["tokens"] == 8 * 2 * 2 * 16 and record["settings"] == settings


def test_a_short_ddp_bf16_run_counts_the_hooks_bytes(tmp_path):
    """``ddp_bf16``, 4 steps: the bf16 hook's counted bytes, half of the fp32 ring allreduce's at every step."""
    settings = dict(steps=4, batch_size=2, context=16, layers=1, width=16, heads=2, lr=1e-3, warmup=2, val_windows=4,
                    val_every=4)
    record = lm.run_one("ddp_bf16", 0, settings, tmp_path)
    assert record["strategy"] == "CountedDDPStrategy" and record["steps"] == 4
    assert record["bytes_sent"] == 4 * ring_allreduce_bytes(record["trainable_parameters"], 2, 2)


# ---------------------------------------------------------------------------------------------------------------------
# torchft's DiLoCo on the same model
def test_torchft_run_names():
    assert lm.parse_lm_run("torchft_diloco@32") == ("torchft", dict(sync_every=32))
    assert lm.canonical_lm_run("torchft_diloco@032") == "torchft_diloco@32"
    assert lm.canonical_lm_run("diloco_topk@032") == "diloco_topk@32"
    for name in ("torchft_diloco@0", "torchft_diloco@x", "torchft_diloco"):
        with pytest.raises(ValueError):
            lm.parse_lm_run(name)
    assert lm.order_lm_runs({"torchft_diloco@32", "torchft_diloco@8", "diloco_none@8", "adamw"}) == [
        "adamw", "diloco_none@8", "torchft_diloco@8", "torchft_diloco@32"]


def test_a_short_torchft_diloco_run_syncs_and_is_counted_on_the_ring_model(tmp_path):
    """torchft's own DiLoCo (its lighthouse in the run's process, 2 replicas on gloo), where torchft imports (it is
    not a dependency of the project: ``pip install torchft`` or ``--torchft-path``): 8 steps, an outer step every 4."""
    pytest.importorskip("torchft")
    settings = dict(steps=8, batch_size=2, context=16, layers=1, width=16, heads=2, lr=1e-3, warmup=2, val_windows=4,
                    val_every=4)
    import sys

    record = lm.run_one("torchft_diloco@4", 0, settings, tmp_path, torchft_path=tuple(sys.path))
    n = record["trainable_parameters"]
    assert record["strategy"] == "torchft.local_sgd.DiLoCo" and record["outer_syncs"] == 2 and record["steps"] == 8
    assert record["bytes_sent"] == 2 * ring_allreduce_bytes(n, 4, 2) and record["bits_per_parameter_step"] == 8.0
    assert record["val_loss"] < 6.0 and [v["step"] for v in record["validations"]] == [8]
