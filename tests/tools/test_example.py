"""The BERT example: the synthetic task, local data loading, and a short 2-process run that must learn."""

import json
import re
import subprocess
import sys
from collections import Counter
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

from tests.paths import EXAMPLE, ROOT, script_env

CONFIG = ROOT / "examples" / "configs" / "bert_onebit.yaml"
DDP_CONFIG = ROOT / "examples" / "configs" / "bert_adamw.yaml"
FSDP_CONFIG = ROOT / "examples" / "configs" / "bert_fsdp.yaml"
DILOCO_CONFIG = ROOT / "examples" / "configs" / "bert_diloco.yaml"
DILOCO_FSDP_CONFIG = ROOT / "examples" / "configs" / "bert_diloco_fsdp.yaml"
#: what benchmarks/ read from a DDP run's --summary_json (bert_parity, convergence, freeze_sweep, result_tables)
DDP_SUMMARY_KEYS = {"strategy", "optimizer", "steps", "trainable_parameters", "wall_s", "val_loss", "val_acc",
                    "val_f1", "bytes_sent", "bytes_fp32_equivalent", "rounds_per_100_steps"}


def test_synthetic_reviews_are_balanced_deterministic_and_not_decided_by_one_word(example):
    reviews = example.make_reviews(2000, seed=3)
    assert reviews == example.make_reviews(2000, seed=3)
    assert reviews != example.make_reviews(2000, seed=4)
    assert Counter(label for _, label in reviews) == {0: 1000, 1: 1000}
    # Every adjective appears under both labels (negation and "but"/"although" clauses flip it).
    by_word = {}
    for text, label in reviews:
        for word in text.split():
            by_word.setdefault(word, set()).add(label)
    for adjective in example._POSITIVE + example._NEGATIVE:
        assert by_word[adjective] == {0, 1}, adjective
    # The same words in another order can carry the other label.
    assert any(t.startswith("although") for t, _ in reviews) and any(" but " in t for t, _ in reviews)


def test_local_table_and_errors(example, tmp_path):
    table = tmp_path / "reviews.tsv"
    rows = [("a fine film", 1), ("a dull film", 0)] * 10
    table.write_text("text\tlabel\n" + "".join(f"{t}\t{label}\n" for t, label in rows))
    data = example.TextClassificationData(dataset=str(table), max_length=8, batch_size=4)
    assert len(data.train_rows) == 18 and len(data.val_rows) == 2
    assert data.num_labels == 2 and data.vocab_size == len(example.SPECIAL_TOKENS) + 4
    data.setup("fit")
    batch = next(iter(data.train_dataloader()))
    assert batch["input_ids"].shape == (4, 8) and set(batch["labels"].tolist()) <= {0, 1}

    bad = tmp_path / "bad.csv"
    bad.write_text("sentence,y\nhello,1\n")
    with pytest.raises(ValueError, match=r"no label column .* the columns \['sentence', 'y'\].*label_column"):
        example.TextClassificationData(dataset=str(bad))
    with pytest.raises(ValueError, match=r"no column 'review' \(text\); the columns are \['sentence', 'y'\]"):
        example.TextClassificationData(dataset=str(bad), text_column="review", label_column="y")
    with pytest.raises(ValueError, match="unknown dataset"):
        example.TextClassificationData(dataset="no/such/thing")


def test_sst2_directory_layout_with_its_dev_file(example, tmp_path):
    """GLUE SST-2 as distributed: train.tsv and dev.tsv with columns sentence and label, unquoted quotes inside."""
    (tmp_path / "train.tsv").write_text("sentence\tlabel\n" + "".join(
        f"{t}\t{label}\n" for t, label in [('a "fine" film', 1), ("a dull film", 0)] * 8))
    (tmp_path / "dev.tsv").write_text("sentence\tlabel\nquite fine\t1\nso dull\t0\nfine\t1\n")
    data = example.TextClassificationData(dataset=str(tmp_path), max_length=8, batch_size=4)
    assert len(data.train_rows) == 16 and len(data.val_rows) == 3  # dev.tsv, not a 10% cut
    assert data.train_rows[0] == ('a "fine" film', None, 1) and data.num_labels == 2
    data.setup("fit")
    assert next(iter(data.val_dataloader()))["labels"].tolist() == [1, 0, 1]


def test_pair_task_is_tokenised_as_pairs_and_a_separate_val_file(example, tmp_path):
    rows = [("the cat sat", "a cat was sitting", 1), ("the cat sat", "dogs bark", 0)] * 6
    train, val = tmp_path / "mrpc.csv", tmp_path / "mrpc_val.csv"
    train.write_text("sentence1,sentence2,label\n" + "".join(f"{a},{b},{label}\n" for a, b, label in rows))
    val.write_text("sentence1,sentence2,label\nthe dog,dogs bark,1\n")
    data = example.TextClassificationData(dataset=str(train), val_file=str(val), max_length=12, batch_size=4)
    assert len(data.train_rows) == 12 and data.val_rows == [("the dog", "dogs bark", 1)]
    data.setup("fit")
    batch = next(iter(data.train_dataloader()))
    # the second sentence is segment 1: BERT sees a pair, not one concatenated text
    assert (batch["token_type_ids"] == 1).any() and (batch["token_type_ids"][:, 0] == 0).all()


def test_jsonl_with_string_labels_infers_the_classes(example, tmp_path):
    path = tmp_path / "reviews.jsonl"
    labels = ["positive", "negative", "neutral"]
    path.write_text("".join(json.dumps({"text": f"review {i}", "label": labels[i % 3]}) + "\n" for i in range(30)))
    data = example.TextClassificationData(dataset=str(path), batch_size=4)
    assert data.label_names == ["negative", "neutral", "positive"] and data.num_labels == 3
    assert {label for *_, label in data.train_rows + data.val_rows} == {0, 1, 2}
    assert len(data.val_rows) == 3  # held out: 10% of the rows


def test_pretrained_model_loads_in_train_mode_and_fine_tunes(example, tmp_path):
    """A model saved with save_pretrained (as a downloaded one) comes back in train mode: dropout is on."""
    from transformers import BertConfig, BertForSequenceClassification

    config = BertConfig(vocab_size=50, hidden_size=32, num_hidden_layers=1, num_attention_heads=2,
                        intermediate_size=64, max_position_embeddings=16, num_labels=2)
    torch.manual_seed(0)
    BertForSequenceClassification(config).save_pretrained(tmp_path / "tiny-bert")
    model = example.BertClassifier(model_name_or_path=str(tmp_path / "tiny-bert"), num_labels=2)
    assert all(m.training for m in model.bert.modules())
    batch = dict(input_ids=torch.randint(0, 50, (8, 10)), labels=torch.randint(0, 2, (8,)))
    assert not torch.equal(model.bert(**batch).logits, model.bert(**batch).logits)  # dropout is active
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
    before = [p.detach().clone() for p in model.parameters()]
    for _ in range(3):
        loss = model.bert(**batch).loss
        loss.backward()
        optimizer.step()
        optimizer.zero_grad()
    assert torch.isfinite(loss) and any(not torch.equal(a, p) for a, p in zip(before, model.parameters()))


def test_cli_gives_a_pretrained_model_its_own_tokenizer(example, tmp_path, monkeypatch):
    """--model.model_name_or_path without --data.tokenizer: the data is tokenised with the model's vocabulary, not a
    word-level one built from the data (whose ids would index the wrong embedding rows); an explicit tokenizer wins."""
    from transformers import BertConfig, BertForSequenceClassification, BertTokenizerFast

    vocab = ["[PAD]", "[UNK]", "[CLS]", "[SEP]", "[MASK]", "zebra", "film", "fine", "dull", "a"]
    BertTokenizerFast(vocab={w: i for i, w in enumerate(vocab)}).save_pretrained(tmp_path / "tiny-bert")
    BertForSequenceClassification(BertConfig(vocab_size=len(vocab), hidden_size=32, num_hidden_layers=1,
                                             num_attention_heads=2, intermediate_size=64,
                                             max_position_embeddings=16)).save_pretrained(tmp_path / "tiny-bert")
    (tmp_path / "train.tsv").write_text("sentence\tlabel\n" + "a fine film\t1\na dull film\t0\n" * 8)
    monkeypatch.chdir(tmp_path)

    def data_of(*extra):
        cli = example.BertFinetuneCLI(
            example.BertClassifier, example.TextClassificationData, run=False,
            args=["--trainer.accelerator", "cpu", "--trainer.devices", "1", "--trainer.logger", "false",
                  "--model.model_name_or_path", str(tmp_path / "tiny-bert"),
                  "--data.dataset", str(tmp_path / "train.tsv"), *extra],
        )
        return cli.datamodule

    data = data_of()
    assert data.tokenizer.get_vocab() == {w: i for i, w in enumerate(vocab)}  # the model's, zebra included
    assert data.tokenizer("a fine film")["input_ids"] == [2, 9, 7, 6, 3]
    other = vocab[:5] + ["film", "fine", "a", "dull"]
    BertTokenizerFast(vocab={w: i for i, w in enumerate(other)}).save_pretrained(tmp_path / "other-tokenizer")
    explicit = data_of("--data.tokenizer", str(tmp_path / "other-tokenizer"))
    assert explicit.tokenizer.get_vocab() == {w: i for i, w in enumerate(other)}


@pytest.mark.parametrize("word_embeddings, sparse_rows", [("sparse_rows", True), ("full_precision", False)])
def test_word_embeddings_option_puts_them_in_a_compress_false_group(example, word_embeddings, sparse_rows):
    """--model.word_embeddings sparse_rows / full_precision: the CLI's optimizer (one group over model.parameters())
    is split into the rest and the word embeddings with compress=False (and sparse_rows as asked), both with the
    configured options."""
    from lightning_onebit import OnebitAdam

    sizes = dict(vocab_size=50, num_labels=2, hidden_size=32, num_layers=1, num_heads=2, intermediate_size=64,
                 max_position_embeddings=16)
    model = example.BertClassifier(word_embeddings=word_embeddings, **sizes)
    embeddings = model.bert.get_input_embeddings().weight
    optimizer = OnebitAdam(model.parameters(), lr=1e-3, weight_decay=0.01, freeze_step=5)
    assert example.BertFinetuneCLI.configure_optimizers(model, optimizer) is optimizer
    rest, emb = optimizer.param_groups
    assert [rest["compress"], emb["compress"]] == [True, False]
    assert [rest["sparse_rows"], emb["sparse_rows"]] == [False, sparse_rows]
    assert len(emb["params"]) == 1 and emb["params"][0] is embeddings
    assert len(rest["params"]) == len(list(model.parameters())) - 1
    assert all(p is not embeddings for p in rest["params"])
    assert rest["weight_decay"] == emb["weight_decay"] == 0.01 and rest["lr"] == emb["lr"] == 1e-3
    example.BertFinetuneCLI.configure_optimizers(model, optimizer)  # called again (a second fit): unchanged
    assert len(optimizer.param_groups) == 2
    # "compressed" leaves the single compressed group alone; an optimizer that compresses nothing is left alone
    plain = example.BertClassifier(word_embeddings="compressed", **sizes)
    optimizer = OnebitAdam(plain.parameters(), lr=1e-3, freeze_step=5)
    example.BertFinetuneCLI.configure_optimizers(plain, optimizer)
    assert len(optimizer.param_groups) == 1 and optimizer.param_groups[0]["compress"] is True
    adamw = torch.optim.AdamW(model.parameters(), lr=1e-3)
    example.BertFinetuneCLI.configure_optimizers(model, adamw)
    assert len(adamw.param_groups) == 1
    assert example.BertClassifier(**sizes).word_embeddings == "sparse_rows"  # the default
    with pytest.raises(ValueError, match="lr_scheduler"):
        optimizer = OnebitAdam(model.parameters(), lr=1e-3, freeze_step=5)
        scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda i: 1.0)
        example.BertFinetuneCLI.configure_optimizers(model, optimizer, scheduler)


def test_uncompressed_embeddings_is_the_deprecated_name_of_full_precision(example):
    sizes = dict(vocab_size=50, num_labels=2, hidden_size=32, num_layers=1, num_heads=2, intermediate_size=64,
                 max_position_embeddings=16)
    with pytest.warns(FutureWarning, match="--model.word_embeddings full_precision"):
        model = example.BertClassifier(uncompressed_embeddings=True, **sizes)
    assert model.word_embeddings == "full_precision"
    with pytest.raises(ValueError, match="contradicts word_embeddings='compressed'"):
        example.BertClassifier(uncompressed_embeddings=True, word_embeddings="compressed", **sizes)


def test_short_two_process_run_learns_and_reaches_the_compression_stage(tmp_path):
    summary = tmp_path / "summary.json"
    command = [
        sys.executable, str(EXAMPLE), "fit", "--config", str(CONFIG),
        "--trainer.max_epochs", "EPOCHS",
        "--optimizer.init_args.freeze_step", "FREEZE", "--optimizer.init_args.auto_freeze", "null",
        "--optimizer.init_args.lr", "0.001",
        "--model.num_layers", "2", "--model.hidden_size", "64", "--model.intermediate_size", "256",
        "--data.num_val", "500", "--trainer.enable_progress_bar", "false",
        "--trainer.logger.init_args.save_dir", str(tmp_path), "--summary_json", str(summary),
    ]
    # The tiny model leaves its initial plateau around step 90 and has settled by ~150; freezing the variance during
    # that transition collapses training (README, "Choosing freeze_step"), so the freeze comes well after it.
    epochs, freeze = 5, 200
    steps = epochs * 62  # 4000 examples, 2 ranks, batch 32, drop_last
    command = [{"EPOCHS": str(epochs), "FREEZE": str(freeze)}.get(a, a) for a in command]
    proc = subprocess.run(command, cwd=tmp_path, env=script_env(), capture_output=True, text=True, timeout=400)
    assert proc.returncode == 0, proc.stderr[-4000:]
    result = json.loads(summary.read_text())
    assert result["strategy"] == "OnebitStrategy" and result["optimizer"] == "OnebitAdam"
    assert result["steps"] == steps and result["stage"] == "compression" and result["freeze_step"] == freeze
    assert result["val_acc"] > 0.65, result  # chance is 0.5
    fp32_per_step = result["bytes_fp32_equivalent"] / steps  # what DDP's fp32 allreduce sends per step
    warmup_per_step = result["bytes_sent_warmup"] / freeze
    compressed_per_step = result["bytes_sent_compression"] / (steps - freeze)
    # the default warmup exchange (PowerSGD rank 4, after 10 plain steps) sends less than DDP; the 1-bit stage less
    # than a tenth of DDP's bytes
    assert 0 < warmup_per_step < fp32_per_step / 2, result
    assert 0 < compressed_per_step < fp32_per_step / 10, result
    # the example config hits none of the overlap fallbacks: the exchange started in DDP's hooks during backward
    assert result["overlap"] == "on" and result["overlap_fallback"] is None, result
    assert result["exchange_in_hooks_s"] > 0, result
    assert "bert_finetune summary" in proc.stdout
    # the printed table: accuracy in %, the bytes against DDP fp32, the fixed freeze step, where the logs are
    assert re.search(rf"accuracy +{100 * result['val_acc']:.2f} %", proc.stdout), proc.stdout[-3000:]
    ratio = result["bytes_fp32_equivalent"] / result["bytes_sent"]
    assert f"; {ratio:.2f}x fewer than DDP fp32)" in proc.stdout, proc.stdout[-3000:]
    assert re.search(rf"freeze step +{freeze} \(fixed\)", proc.stdout) and "steps_by_kind" not in proc.stdout
    assert re.search(r"logs +\S*version_0", proc.stdout), proc.stdout[-3000:]


def test_the_sharded_config_trains_on_4_processes_as_2_nodes(tmp_path):
    """bert_fsdp.yaml as shipped (LightningCLI builds the optimizer before the strategy shards the model; the word
    embeddings go in a sparse_rows group; MomentumMask(auto=True) masks shards), a few steps past the freeze."""
    summary = tmp_path / "summary.json"
    command = [sys.executable, str(EXAMPLE), "fit", "--config", str(FSDP_CONFIG), "--trainer.max_steps", "12",
               "--optimizer.init_args.freeze_step", "6", "--model.num_layers", "2", "--model.hidden_size", "64",
               "--model.intermediate_size", "256", "--data.num_val", "100", "--trainer.enable_progress_bar", "false",
               "--trainer.logger.init_args.save_dir", str(tmp_path), "--summary_json", str(summary)]
    proc = subprocess.run(command, cwd=tmp_path, env=script_env(), capture_output=True, text=True, timeout=400)
    assert proc.returncode == 0, proc.stderr[-4000:]
    result = json.loads(summary.read_text())
    assert result["strategy"] == "OnebitFSDPStrategy" and result["optimizer"] == "OnebitAdam", result
    assert result["steps"] == 12 and result["stage"] == "compression" and result["freeze_step"] == 6, result
    assert 0 < result["bytes_sent_compression"] / 6 < result["bytes_sent_warmup"] / 6 / 10, result
    assert "MomentumMask:" in proc.stdout + proc.stderr and "(rank 0's shard)" in proc.stdout + proc.stderr


def _short_local_steps_run(config: Path, tmp_path: Path) -> dict:
    """The example with ``config`` as shipped, a smaller model and an outer sync every 4 of 8 steps; its summary."""
    summary = tmp_path / "summary.json"
    command = [sys.executable, str(EXAMPLE), "fit", "--config", str(config), "--trainer.max_steps", "8",
               "--trainer.strategy.init_args.sync_every", "4", "--model.num_layers", "2", "--model.hidden_size", "64",
               "--model.intermediate_size", "256", "--data.num_val", "100", "--trainer.enable_progress_bar", "false",
               "--trainer.logger.init_args.save_dir", str(tmp_path), "--summary_json", str(summary)]
    proc = subprocess.run(command, cwd=tmp_path, env=script_env(), capture_output=True, text=True, timeout=400)
    assert proc.returncode == 0, proc.stderr[-4000:]
    return json.loads(summary.read_text())


def test_the_local_steps_config_trains_on_2_processes_as_2_replicas(tmp_path):
    """bert_diloco.yaml (AdamW inner steps, a 1-bit outer step): 2 outer syncs in 8 steps (after steps 4 and 8),
    nothing sent between them."""
    result = _short_local_steps_run(DILOCO_CONFIG, tmp_path)
    assert result["strategy"] == "OnebitDiLoCoStrategy" and result["optimizer"] == "AdamW", result
    assert result["steps"] == 8 and result["outer_syncs"] == 2, result
    # two 1-bit syncs against eight fp32 allreduces: far more than 32 x 4 fewer bytes
    assert 0 < result["bytes_sent"] < result["bytes_fp32_equivalent"] / 100, result
    assert result["bytes_sent"] == result["bytes_sent_inter_node"], result  # a replica per process: nothing intra


def test_the_sharded_local_steps_config_trains_on_4_processes_as_2_replicas_of_2(tmp_path):
    """bert_diloco_fsdp.yaml (LightningCLI builds AdamW before the strategy shards the encoder layers; it is pointed
    at the shards): 2 outer syncs in 8 steps, each rank sending its shard's 1-bit exchange only."""
    result = _short_local_steps_run(DILOCO_FSDP_CONFIG, tmp_path)
    assert result["strategy"] == "OnebitDiLoCoFSDPStrategy" and result["optimizer"] == "AdamW", result
    assert result["steps"] == 8 and result["outer_syncs"] == 2, result
    assert 0 < result["bytes_sent"] < result["bytes_fp32_equivalent"] / 20, result
    assert result["bytes_sent"] == result["bytes_sent_inter_node"], result  # FSDP's collectives are not counted


def test_summary_table_is_short_and_aligned(example):
    summary = dict(strategy="OnebitStrategy", optimizer="OnebitAdam", steps=620, wall_s=312.44, val_loss=0.01,
                   val_acc=0.996999979019165, val_f1=0.9968, freeze_step=187, stage="compression",
                   auto_freeze="at step 187, gradients of the last 40 steps ... (long)", bytes_sent=1_234_567,
                   bytes_fp32_equivalent=4_518_000, steps_by_kind={"warmup": 187, "compressed": 433},
                   advice={"step_s": 0.5})
    table = example.summary_table(summary, freeze="auto: the gradients settled", log_dir="logs/bert/version_0")
    lines = table.splitlines()
    assert lines == [
        "  run                  OnebitStrategy, OnebitAdam",
        "  accuracy             99.70 %",
        "  F1 (macro)           99.68 %",
        "  bytes sent (rank 0)  1.23 MB (DDP fp32: 4.52 MB; 3.66x fewer than DDP fp32)",
        "  freeze step          187 (auto: the gradients settled)",
        "  steps                620",
        "  wall time            312.4 s (5.2 min)",
        "  logs                 logs/bert/version_0",
    ]
    # the DDP baseline: no freeze row, its bytes are the fp32 allreduce's; a run that ended in the warmup says so
    ddp = dict(strategy="DDPStrategy", optimizer="AdamW", steps=8, wall_s=3.0, val_acc=0.5, bytes_sent=400,
               bytes_fp32_equivalent=400, rounds_per_100_steps=100.0)
    table = example.summary_table(ddp, summary_json="s.json")
    assert "bytes sent (rank 0)  400 B (= DDP fp32)" in table and "freeze" not in table and "s.json" in table
    uncounted = dict(ddp, bytes_sent=None, bytes_fp32_equivalent=None)
    assert "not counted" in example.summary_table(uncounted)
    warm = dict(summary, freeze_step=None, stage="warmup")
    assert "freeze step          not reached, the run ended in the warmup (auto: not decided)" in (
        example.summary_table(warm, freeze="auto: not decided"))


def test_freeze_note_says_how_the_warmup_ended(example):
    def optimizer(auto, freeze_step, reason=None):
        detector = SimpleNamespace(reason=reason, max_step=400)
        return SimpleNamespace(auto_freeze=auto, freeze_step=freeze_step, freeze_detector=detector)

    assert example.freeze_note(optimizer(None, 200)) == "fixed"
    assert example.freeze_note(optimizer(object(), None)) == "auto: not decided"
    assert example.freeze_note(optimizer(object(), 187, "settled")) == "auto: the gradients settled"
    assert example.freeze_note(optimizer(object(), 400, "max_step")) == "auto: bound reached (max_step 400)"


#: Runs the example as ``python EXAMPLE ARGS...`` would, and says at the very end of the interpreter's exit (the first
#: atexit handler registered runs last) whether a process group is still initialised, and which objects that hold one
#: (DDP's wrapper, a communication hook's state with a group) are still alive, collectable or not
_EXIT_PROBE = (
    "import atexit, gc, runpy, sys, torch.distributed as dist\n"
    "from torch.nn.parallel import DistributedDataParallel\n"
    "from lightning_onebit.hooks.gradient_sync import GradientSyncState\n"
    "def probe():\n"
    "    print('process group initialised at exit:', dist.is_initialized(), flush=True)\n"
    "    alive = [type(o).__name__ for o in gc.get_objects() if isinstance(o, DistributedDataParallel)\n"
    "             or isinstance(o, GradientSyncState) and o.process_group is not None]\n"
    "    print('holders of the process group alive at exit:', sorted(alive), flush=True)\n"
    "atexit.register(probe)\n"
    "sys.argv = sys.argv[1:]\n"
    "runpy.run_path(sys.argv[0], run_name='__main__')\n"
)


def test_ddp_baseline_is_counted_by_the_communication_monitor(example, tmp_path):
    """bert_adamw.yaml (strategy='ddp', no callbacks): the example adds a CommunicationMonitor, whose count is the
    fp32 ring allreduce of every gradient at every step; the summary JSON keeps the keys the benchmarks read. The
    example destroys DDP's gloo process group before the interpreter exits (Lightning leaves it initialised), and
    nothing holds it then: the monitor's hook state lets go of it at teardown (a group destroyed during the
    interpreter's finalisation can abort the process after a successful run)."""
    from lightning_onebit.comm import ring_allreduce_bytes

    sizes = dict(hidden_size=32, num_layers=1, num_heads=2, intermediate_size=64)
    data_sizes = dict(num_train=512, num_val=64)
    summary = tmp_path / "summary.json"
    command = [sys.executable, "-c", _EXIT_PROBE, str(EXAMPLE), "fit", "--config", str(DDP_CONFIG),
               "--trainer.max_epochs", "1",
               "--trainer.enable_progress_bar", "false", "--trainer.log_every_n_steps", "1",
               "--trainer.logger.init_args.save_dir", str(tmp_path), "--summary_json", str(summary)]
    command += [f"--model.{k}={v}" for k, v in sizes.items()] + [f"--data.{k}={v}" for k, v in data_sizes.items()]
    proc = subprocess.run(command, cwd=tmp_path, env=script_env(), capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-4000:]
    result = json.loads(summary.read_text())
    assert set(result) == DDP_SUMMARY_KEYS, result
    assert result["strategy"] == "DDPStrategy" and result["steps"] == 8  # 512 examples, 2 ranks, batch 32
    data = example.TextClassificationData(**data_sizes)
    model = example.BertClassifier(vocab_size=data.vocab_size, num_labels=data.num_labels, **sizes)
    numel = sum(p.numel() for p in model.parameters() if p.requires_grad)
    assert result["bytes_sent"] == result["bytes_fp32_equivalent"] == ring_allreduce_bytes(numel, 4, 2) * 8, result
    assert result["rounds_per_100_steps"] == 100.0
    assert "(= DDP fp32)" in proc.stdout and re.search(r"accuracy +\d+\.\d\d %", proc.stdout), proc.stdout[-3000:]
    assert "process group initialised at exit: False" in proc.stdout, proc.stdout[-3000:]
    assert "holders of the process group alive at exit: []" in proc.stdout, proc.stdout[-3000:]
    # the monitor logged the baseline under the metric names of the 1-bit runs' warmup
    (metrics,) = tmp_path.glob("bert_adamw/version_*/metrics.csv")
    assert "comm/bytes_sent" in metrics.read_text().splitlines()[0]


@pytest.mark.parametrize(
    "config, expected, absent",
    [
        # word_embeddings: the model option is visible to the CLI (see test_word_embeddings_option_puts_...)
        ("bert_lamb.yaml", ["class_path: lightning_onebit.OnebitLamb", "strategy: onebit_lamb", "freeze_step: auto",
                            "word_embeddings: sparse_rows"], None),
        # without MomentumMask(auto=True), which ZeroOneAdam refuses; its schedule left to the run (scaled at fit)
        ("bert_zeroone.yaml",
         ["class_path: lightning_onebit.ZeroOneAdam", "strategy: zeroone_adam", "var_freeze_step: null",
          "local_step_scaler: null"], "MomentumMask"),
    ],
)
def test_family_configs_resolve_under_their_strategy_names(tmp_path, config, expected, absent):
    """bert_lamb.yaml and bert_zeroone.yaml (run in full by benchmarks/bert_parity.py) build their optimizer under the
    strategy name users of that optimizer look for."""
    proc = subprocess.run(
        [sys.executable, str(EXAMPLE), "fit", "--config", str(ROOT / "examples" / "configs" / config), "--print_config"],
        cwd=tmp_path, env=script_env(), capture_output=True, text=True, timeout=120,
    )
    assert proc.returncode == 0, proc.stderr[-4000:]
    assert all(text in proc.stdout for text in expected), proc.stdout
    assert absent is None or absent not in proc.stdout
