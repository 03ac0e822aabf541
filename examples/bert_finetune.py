"""Fine-tune BERT for sequence classification with 1-bit Adam (``onebit_adam``), driven by LightningCLI.

Runs offline by default: a small BERT (4 layers, hidden 256) built from a config, on a synthetic review-sentiment task
generated here (see :func:`make_reviews`). Real models and data plug in through the same code:

    # offline, 2 CPU processes, a few minutes (the README's command)
    python examples/bert_finetune.py fit --config examples/configs/bert_onebit.yaml

    # the same with DDP + AdamW, for comparison
    python examples/bert_finetune.py fit --config examples/configs/bert_adamw.yaml

    # with a hub or local model (and its tokenizer) and GLUE SST-2 (needs network access and `pip install datasets`);
    # a pretrained model fine-tunes with a smaller learning rate than the fresh one
    python examples/bert_finetune.py fit --config examples/configs/bert_onebit.yaml \\
        --model.model_name_or_path bert-base-uncased --data.dataset glue/sst2 --data.max_length 128 \\
        --optimizer.init_args.lr 5e-5

    # your own data: a .tsv / .csv / .jsonl file, or a directory with train.* and dev.* (or validation.*), e.g. the
    # GLUE SST-2 TSVs; columns are detected (text, sentence, sentence1/sentence2, ..., label) or named explicitly
    python examples/bert_finetune.py fit --config examples/configs/bert_onebit.yaml --data.dataset SST-2/

Validation accuracy and macro F1 (torchmetrics) are logged every validation run; at the end rank 0 prints a short
table (accuracy, F1, bytes this rank sent against DDP's fp32 allreduce, the freeze step, steps, wall time, where the
logs are) and writes the full summary as JSON with ``--summary_json``. The DDP baseline (``bert_adamw.yaml``) is counted
by the same ``CommunicationMonitor`` as the 1-bit runs, which the example adds when the config lists none; a DDP
strategy that counts its own gradient average (a ``communication`` property, e.g. the benchmarks' DDP + PowerSGD and
DDP + bf16 baselines, ``--trainer.strategy benchmarks.comm_hooks.CountedDDPStrategy``) is read instead.
"""

from __future__ import annotations

import csv
import dataclasses
import json
import os
import random
import time
from pathlib import Path
from typing import Any, Literal, Optional

import lightning as L
import torch
import torchmetrics
from lightning.pytorch.cli import LightningCLI
from lightning.pytorch.strategies import DDPStrategy
from lightning.pytorch.utilities.rank_zero import rank_zero_warn
from torch.utils.data import DataLoader, Dataset

import lightning_onebit  # noqa: F401  (registers the onebit_adam strategies)
from lightning_onebit import CommunicationMonitor, CompressedOptimizer, OnebitDiLoCoFSDPStrategy, OnebitDiLoCoStrategy
from lightning_onebit import OnebitFSDPStrategy, OnebitStrategy
from lightning_onebit.comm import CommunicationCounters, ring_allreduce_bytes

SPECIAL_TOKENS = ["[PAD]", "[UNK]", "[CLS]", "[SEP]", "[MASK]"]

# ---------------------------------------------------------------------------------------------------------------------
# The offline task
_SUBJECTS = ["the movie", "the film", "the plot", "the acting", "the soundtrack", "the ending", "the cast",
             "the script", "the story", "the pacing", "the dialogue", "the camera work"]
_VERBS = ["was", "is", "felt", "seemed", "looked"]
_POSITIVE = ["good", "great", "excellent", "wonderful", "brilliant", "enjoyable", "moving", "superb", "delightful",
             "charming", "clever", "fun"]
_NEGATIVE = ["bad", "awful", "terrible", "boring", "dull", "weak", "poor", "tedious", "horrible", "bland", "messy",
             "clumsy"]
_NEGATORS = ["not", "never", "hardly"]
_INTENSIFIERS = ["very", "really", "quite", "truly", "rather"]
_FILLERS = ["honestly", "overall", "i think", "to be fair", "in the end", "frankly"]
_CONNECTIVES = ["and", "but", "although"]


def _clause(rng: random.Random, polarity: int) -> str:
    """A clause of the given polarity (+1/-1), negated 30% of the time (a negated adjective flips polarity)."""
    negated = rng.random() < 0.3
    adjective_polarity = -polarity if negated else polarity
    words = [rng.choice(_SUBJECTS), rng.choice(_VERBS)]
    if negated:
        words.append(rng.choice(_NEGATORS))
    if rng.random() < 0.4:
        words.append(rng.choice(_INTENSIFIERS))
    words.append(rng.choice(_POSITIVE if adjective_polarity > 0 else _NEGATIVE))
    return " ".join(words)


def make_reviews(n: int, seed: int) -> list[tuple[str, int]]:
    """``n`` labelled synthetic reviews (label 1 positive, 0 negative), balanced, deterministic in ``seed``.

    No single token decides the label: every adjective occurs in both classes because negators flip a clause, and
    two-clause reviews need word order: ``A and B`` (same polarity), ``A but B`` (B decides, A is opposite),
    ``although A, B`` (B decides, A is opposite). A bag-of-words model therefore stays far from solving it
    (``python -m benchmarks.bert_parity --bag-of-words`` measures it); a small transformer learns it in a few hundred
    steps.
    """
    rng = random.Random(seed)
    reviews = []
    for i in range(n):
        label = i % 2
        polarity = 1 if label else -1
        form = rng.random()
        if form < 0.3:
            text = _clause(rng, polarity)
        else:
            connective = rng.choice(_CONNECTIVES)
            if connective == "and":
                text = f"{_clause(rng, polarity)} and {_clause(rng, polarity)}"
            elif connective == "but":
                text = f"{_clause(rng, -polarity)} but {_clause(rng, polarity)}"
            else:
                text = f"although {_clause(rng, -polarity)} {_clause(rng, polarity)}"
        if rng.random() < 0.3:
            text = f"{rng.choice(_FILLERS)} {text}"
        reviews.append((text, label))
    rng.shuffle(reviews)
    return reviews


def _word_vocab(texts: list[str]) -> dict[str, int]:
    words = sorted({w for t in texts for w in t.lower().split()})
    return {w: i for i, w in enumerate(SPECIAL_TOKENS + [w for w in words if w not in SPECIAL_TOKENS])}


Row = tuple[str, Optional[str], Any]  # (text, second text of a pair task or None, label as read)

# Column layouts recognised without text_column/text_pair_column, in order of preference (GLUE's among them).
TEXT_LAYOUTS = (
    ("text", None), ("sentence", None), ("sentence1", "sentence2"), ("question1", "question2"),
    ("premise", "hypothesis"), ("question", "sentence"),
)
LABEL_COLUMNS = ("label", "labels")
TABLE_SUFFIXES = (".tsv", ".csv", ".jsonl")


def _read_records(path: str) -> list[dict[str, Any]]:
    """The rows of a .tsv, .csv (header line) or .jsonl (one object per line) file, as dicts."""
    if path.endswith(".jsonl"):
        with open(path, encoding="utf-8") as f:
            return [json.loads(line) for line in f if line.strip()]
    if not path.endswith((".tsv", ".csv")):
        raise ValueError(f"{path}: a local dataset is a .tsv, .csv or .jsonl file (or a directory of them)")
    with open(path, newline="", encoding="utf-8") as f:
        # GLUE's TSVs hold quotes inside sentences: no quoting in TSV
        reader = csv.DictReader(f, delimiter="\t", quoting=csv.QUOTE_NONE) if path.endswith(".tsv") else (
            csv.DictReader(f)
        )
        return list(reader)


def _columns(found: list[str], where: str, text: Optional[str], pair: Optional[str], label: Optional[str]):
    """The (text, pair, label) columns to read: the given ones, checked, or the first recognised layout."""
    def missing(name: str, what: str) -> ValueError:
        return ValueError(
            f"{where}: no column {name!r} ({what}); the columns are {found}. Name the right one with "
            "--data.text_column / --data.text_pair_column / --data.label_column"
        )

    if text is None:
        layout = next(((t, p) for t, p in TEXT_LAYOUTS if t in found and (p is None or p in found)), None)
        if layout is None:
            raise ValueError(
                f"{where}: none of the usual text columns ({', '.join(t for t, _ in TEXT_LAYOUTS)}) among the columns "
                f"{found}: name it with --data.text_column (and --data.text_pair_column for pair tasks)"
            )
        text, detected_pair = layout
        pair = pair if pair is not None else detected_pair
    for name, what in ((text, "text"), (pair, "second text")):
        if name is not None and name not in found:
            raise missing(name, what)
    if label is None:
        label = next((c for c in LABEL_COLUMNS if c in found), None)
        if label is None:
            raise ValueError(
                f"{where}: no label column ({' or '.join(LABEL_COLUMNS)}) among the columns {found}: name it with "
                "--data.label_column"
            )
    elif label not in found:
        raise missing(label, "label")
    return text, pair, label


def _rows(records: list[dict[str, Any]], where: str, text: Optional[str], pair: Optional[str],
          label: Optional[str]) -> list[Row]:
    if not records:
        raise ValueError(f"{where} holds no rows")
    text, pair, label = _columns(list(records[0]), where, text, pair, label)
    return [(str(r[text]), None if pair is None else str(r[pair]), r[label]) for r in records]


def _label_ids(train: list[Row], val: list[Row]) -> tuple[list[tuple[str, Optional[str], int]], ...]:
    """Labels as class ids: integers (or strings of integers) as they are, any other labels mapped to ids in sorted
    order (the names are returned as the last element)."""
    values = [label for *_, label in train + val]
    try:
        ids = {v: int(v) for v in set(values)}
        if any(i < 0 for i in ids.values()):
            raise ValueError
        names = None
    except (TypeError, ValueError):
        names = sorted({str(v) for v in values})
        ids = {v: names.index(str(v)) for v in set(values)}
    convert = lambda rows: [(t, p, ids[label]) for t, p, label in rows]  # noqa: E731
    return convert(train), convert(val), names


def _find_split(directory: str, names: tuple[str, ...]) -> Optional[str]:
    for name in names:
        for suffix in TABLE_SUFFIXES:
            path = os.path.join(directory, name + suffix)
            if os.path.exists(path):
                return path
    return None


# ---------------------------------------------------------------------------------------------------------------------
class _Encoded(Dataset):
    def __init__(self, encodings: dict[str, torch.Tensor], labels: list[int]) -> None:
        self.encodings, self.labels = encodings, torch.tensor(labels)

    def __len__(self) -> int:
        return len(self.labels)

    def __getitem__(self, i: int) -> dict[str, torch.Tensor]:
        item = {k: v[i] for k, v in self.encodings.items()}
        item["labels"] = self.labels[i]
        return item


class TextClassificationData(L.LightningDataModule):
    """Text classification data: the offline synthetic reviews, a Hugging Face dataset, or local files.

    Args:
        dataset: ``"synthetic"`` (default, built here, offline); a local ``.tsv`` / ``.csv`` / ``.jsonl`` file; a
            directory holding ``train.*`` and ``dev.*`` or ``validation.*`` in those formats (e.g. GLUE's SST-2 or
            MRPC TSVs); or a Hugging Face ``datasets`` name, ``name/config`` (``glue/sst2``), loaded when reachable or
            cached, with its ``train`` and ``val_split`` splits.
        text_column, text_pair_column, label_column: the columns to read. ``None`` (default) detects them: the first
            of ``text``, ``sentence``, ``sentence1`` + ``sentence2``, ``question1`` + ``question2``, ``premise`` +
            ``hypothesis``, ``question`` + ``sentence`` that the data has (a pair is tokenised as a pair), and
            ``label`` or ``labels``. A column that does not exist is an error listing the columns found.
        val_file: a separate validation file (same formats and columns). Without it (and without a ``dev``/
            ``validation`` file in a directory) 10% of the training rows are held out, split by ``seed``.
        val_split: the validation split of a Hugging Face dataset. Default ``"validation"``.
        tokenizer: hub name or local directory of a tokenizer. ``None`` (default) builds a word-level BERT tokenizer
            from the training texts (offline); with ``--model.model_name_or_path`` the CLI defaults it to the model's
            own tokenizer.
        max_length: tokens per example (padding and truncation). Default 32.
        batch_size: examples per rank per step. Default 32.
        num_train, num_val: sizes of the synthetic splits. Defaults 4000 and 1000.
        seed: seed of the synthetic data and of the held-out split. Default 0.

    Labels may be integers (class ids) or strings, which are mapped to ids in sorted order (``label_names``);
    ``num_labels`` is inferred from the data.
    """

    def __init__(
        self,
        dataset: str = "synthetic",
        text_column: Optional[str] = None,
        text_pair_column: Optional[str] = None,
        label_column: Optional[str] = None,
        val_file: Optional[str] = None,
        val_split: str = "validation",
        tokenizer: Optional[str] = None,
        max_length: int = 32,
        batch_size: int = 32,
        num_train: int = 4000,
        num_val: int = 1000,
        seed: int = 0,
    ) -> None:
        super().__init__()
        self.save_hyperparameters()
        columns = (text_column, text_pair_column, label_column)
        train, val = self._load(dataset, columns, val_file, val_split, num_train, num_val, seed)
        self.train_rows, self.val_rows, self.label_names = _label_ids(train, val)
        texts = [t for t, _, _ in self.train_rows] + [p for _, p, _ in self.train_rows if p is not None]
        self.tokenizer = self._tokenizer(tokenizer, texts)
        self.vocab_size = len(self.tokenizer)
        labels = [label for *_, label in self.train_rows + self.val_rows]
        self.num_labels = len(self.label_names) if self.label_names else max(labels) + 1

    @staticmethod
    def _load(dataset: str, columns: tuple, val_file: Optional[str], val_split: str, num_train: int, num_val: int,
              seed: int) -> tuple[list[Row], list[Row]]:
        if dataset == "synthetic":
            return ([(t, None, label) for t, label in make_reviews(num_train, seed)],
                    [(t, None, label) for t, label in make_reviews(num_val, seed + 1)])
        if os.path.isdir(dataset):
            train_path = _find_split(dataset, ("train",))
            if train_path is None:
                raise ValueError(f"{dataset}: no train.tsv, train.csv or train.jsonl in this directory")
            val_file = val_file or _find_split(dataset, ("dev", "validation"))
            dataset = train_path
        if os.path.exists(dataset):
            train = _rows(_read_records(dataset), dataset, *columns)
            if val_file is not None:
                return train, _rows(_read_records(val_file), val_file, *columns)
            random.Random(seed).shuffle(train)
            n_val = max(1, len(train) // 10)
            return train[n_val:], train[:n_val]
        if dataset.endswith(TABLE_SUFFIXES) or dataset.startswith((".", "/", "~")) or dataset.count("/") > 1:
            raise ValueError(f"unknown dataset {dataset!r}: no such file or directory")
        try:
            import datasets
        except ImportError as err:
            raise ValueError(
                f"unknown dataset {dataset!r}: not 'synthetic', not a local file or directory, and Hugging Face "
                "datasets need the `datasets` package (pip install datasets)"
            ) from err
        name, _, config = dataset.partition("/")
        splits = datasets.load_dataset(name, config or None)
        if val_split not in splits:
            raise ValueError(f"{dataset} has no split {val_split!r}; its splits are {list(splits)} (--data.val_split)")
        return (_rows(list(splits["train"]), f"{dataset} train", *columns),
                _rows(list(splits[val_split]), f"{dataset} {val_split}", *columns))

    @staticmethod
    def _tokenizer(name_or_path: Optional[str], texts: list[str]):
        from transformers import AutoTokenizer, BertTokenizerFast

        if name_or_path is not None:
            return AutoTokenizer.from_pretrained(name_or_path)
        # transformers >= 5 builds a WordPiece tokenizer from an in-memory vocabulary (4.x would ignore `vocab`).
        return BertTokenizerFast(vocab=_word_vocab(texts))

    def _encode(self, rows: list[tuple[str, Optional[str], int]]) -> _Encoded:
        pairs = [p for _, p, _ in rows]
        encodings = self.tokenizer(
            [t for t, _, _ in rows],
            None if all(p is None for p in pairs) else [p or "" for p in pairs],  # pair tasks: tokenised as pairs
            padding="max_length",
            truncation=True,
            max_length=self.hparams.max_length,
            return_tensors="pt",
        )
        keep = {k: encodings[k] for k in ("input_ids", "attention_mask", "token_type_ids") if k in encodings}
        return _Encoded(keep, [label for *_, label in rows])

    def setup(self, stage: str) -> None:
        self.train_set, self.val_set = self._encode(self.train_rows), self._encode(self.val_rows)

    def train_dataloader(self) -> DataLoader:
        return DataLoader(self.train_set, batch_size=self.hparams.batch_size, shuffle=True, drop_last=True)

    def val_dataloader(self) -> DataLoader:
        return DataLoader(self.val_set, batch_size=2 * self.hparams.batch_size)


# ---------------------------------------------------------------------------------------------------------------------
class BertClassifier(L.LightningModule):
    """BERT for sequence classification with torchmetrics accuracy and macro F1 on validation.

    Args:
        model_name_or_path: hub name or local directory of a pretrained BERT (e.g. ``bert-base-uncased``).
            ``None`` (default) builds a fresh BERT from the size arguments below, offline.
        vocab_size, num_labels: linked from the data module by the CLI.
        hidden_size, num_layers, num_heads, intermediate_size, max_position_embeddings, dropout: size of the fresh
            BERT (defaults: 256, 4, 4, 1024, 64, 0.1). Ignored with ``model_name_or_path``.
        word_embeddings: how a compressed optimizer exchanges the word embeddings after the freeze
            (``--model.word_embeddings compressed``). ``"sparse_rows"`` (default): a param group of their own with
            ``"compress": False, "sparse_rows": True``: averaged exactly, sending only the rows the step's batches
            looked up (for a pretrained vocabulary, fewer bytes than 1 bit for the whole table), with a live
            variance, so rows no warmup batch looked up train when they appear. ``"compressed"``: in 1 bit with the
            rest; ``MomentumMask(auto=True)`` then freezes the rows no warmup batch looked up (AG News, MiniLM,
            seed 0, freeze at step 150 of 600: 88.7% against 90.2% with ``sparse_rows``). ``"full_precision"``:
            ``"compress": False`` alone, a dense average (``2 (P-1)/P * 4`` bytes per element per step in fp32). An optimizer that does not
            compress (AdamW) averages every gradient exactly through DDP, so the choice changes nothing there.
        uncompressed_embeddings: deprecated: ``true`` is ``word_embeddings="full_precision"``.
    """

    def __init__(
        self,
        model_name_or_path: Optional[str] = None,
        vocab_size: int = 30522,
        num_labels: int = 2,
        hidden_size: int = 256,
        num_layers: int = 4,
        num_heads: int = 4,
        intermediate_size: int = 1024,
        max_position_embeddings: int = 64,
        dropout: float = 0.1,
        word_embeddings: Literal["compressed", "sparse_rows", "full_precision"] = "sparse_rows",
        uncompressed_embeddings: bool = False,
    ) -> None:
        super().__init__()
        self.save_hyperparameters()
        from transformers import AutoModelForSequenceClassification, BertConfig, BertForSequenceClassification

        if model_name_or_path is not None:
            self.bert = AutoModelForSequenceClassification.from_pretrained(model_name_or_path, num_labels=num_labels)
            self.bert.train()  # from_pretrained returns the model in eval mode: dropout would stay off in fine-tuning
        else:
            config = BertConfig(
                vocab_size=vocab_size,
                hidden_size=hidden_size,
                num_hidden_layers=num_layers,
                num_attention_heads=num_heads,
                intermediate_size=intermediate_size,
                max_position_embeddings=max_position_embeddings,
                hidden_dropout_prob=dropout,
                attention_probs_dropout_prob=dropout,
                num_labels=num_labels,
            )
            self.bert = BertForSequenceClassification(config)
        if uncompressed_embeddings:
            if word_embeddings == "compressed":
                raise ValueError(
                    f"uncompressed_embeddings=True (the deprecated name of word_embeddings='full_precision') "
                    f"contradicts word_embeddings={word_embeddings!r}; give only word_embeddings"
                )
            rank_zero_warn("--model.uncompressed_embeddings true is deprecated: use --model.word_embeddings "
                           "full_precision", category=FutureWarning)
            word_embeddings = "full_precision"
        self.word_embeddings = word_embeddings
        # the word-embedding parameter as built, in a tuple (not registered): LightningCLI builds the optimizer from
        # the parameters before a sharding strategy (onebit_fsdp) replaces them, and the optimizer still names this one
        # when configure_optimizers splits its groups
        self.built_word_embeddings = (self.bert.get_input_embeddings().weight,)
        self.val_accuracy = torchmetrics.Accuracy(task="multiclass", num_classes=num_labels)
        self.val_f1 = torchmetrics.F1Score(task="multiclass", num_classes=num_labels, average="macro")

    def training_step(self, batch: dict[str, torch.Tensor], batch_idx: int) -> torch.Tensor:
        loss = self.bert(**batch).loss
        self.log("train_loss", loss, prog_bar=True)
        return loss

    def validation_step(self, batch: dict[str, torch.Tensor], batch_idx: int) -> None:
        out = self.bert(**batch)
        predictions = out.logits.argmax(-1)
        self.val_accuracy(predictions, batch["labels"])
        self.val_f1(predictions, batch["labels"])
        self.log("val_loss", out.loss, sync_dist=True)
        self.log("val_acc", self.val_accuracy, prog_bar=True)
        self.log("val_f1", self.val_f1)


# ---------------------------------------------------------------------------------------------------------------------
def embedding_groups(optimizer: Any, embeddings: torch.nn.Parameter, sparse_rows: bool) -> None:
    """Split a fresh compressed optimizer's single param group in two: everything but ``embeddings``, then
    ``embeddings`` alone with ``"compress": False`` and ``"sparse_rows": sparse_rows`` (both with the group's other
    options). LightningCLI builds the optimizer from ``model.parameters()``, one group; a LightningModule's own
    ``configure_optimizers`` would pass the two groups directly: ``[{"params": rest}, {"params": [embeddings],
    "compress": False, "sparse_rows": True}]``. Any other optimizer is left as it is: it compresses nothing."""
    if not isinstance(optimizer, CompressedOptimizer):
        return
    embeddings = optimizer.shards.stand_in_of(embeddings)  # sharded (onebit_fsdp): the optimizer holds its local shard
    if any(not g["compress"] and any(p is embeddings for p in g["params"]) for g in optimizer.param_groups):
        return  # already split (configure_optimizers called again)
    if len(optimizer.param_groups) != 1 or optimizer.state:
        raise ValueError("word_embeddings: the example splits a fresh optimizer with a single param group")
    (group,) = optimizer.param_groups
    if not any(p is embeddings for p in group["params"]):
        raise ValueError("word_embeddings: the optimizer does not hold the word embeddings")
    options = {k: v for k, v in group.items()
               if k not in ("params", "param_names", "exp_avg_mask", "compress", "sparse_rows")}
    optimizer.param_groups.clear()
    optimizer.add_param_group({**options, "params": [p for p in group["params"] if p is not embeddings]})
    optimizer.add_param_group({**options, "params": [embeddings], "compress": False, "sparse_rows": sparse_rows})


def _per_100(rounds: int, steps: int) -> Optional[float]:
    return round(100.0 * rounds / steps, 1) if steps else None


def _monitor(trainer: L.Trainer) -> Optional[CommunicationMonitor]:
    return next((c for c in trainer.callbacks if isinstance(c, CommunicationMonitor)), None)


def _own_counters(strategy: Any) -> Optional[CommunicationCounters]:
    """The counters of a DDP strategy that counts its own gradient average (a ``communication`` property giving
    :class:`~lightning_onebit.comm.CommunicationCounters`, as ``benchmarks.comm_hooks.CountedDDPStrategy``), else
    ``None``."""
    counters = getattr(strategy, "communication", None)
    return counters if isinstance(counters, CommunicationCounters) else None


def _bytes(value: float) -> str:
    for unit, size in (("GB", 1e9), ("MB", 1e6), ("kB", 1e3)):
        if value >= size:
            return f"{value / size:.2f} {unit}"
    return f"{value:.0f} B"


def _bytes_row(sent: Optional[int], fp32: Optional[int]) -> str:
    if sent is None or fp32 is None:
        return "not counted (see the log)"  # e.g. DDP had a communication hook of its own: the monitor warned
    if not sent:
        return "0 B"
    ratio = fp32 / sent
    if abs(ratio - 1) < 0.005:
        return f"{_bytes(sent)} (= DDP fp32)"
    against = f"{ratio:.2f}x fewer than" if ratio > 1 else f"{1 / ratio:.2f}x more than"
    return f"{_bytes(sent)} (DDP fp32: {_bytes(fp32)}; {against} DDP fp32)"


def freeze_note(optimizer: CompressedOptimizer) -> str:
    """How the warmup ended, in a few words: a fixed ``freeze_step``, or what ``freeze_step='auto'`` decided on."""
    if optimizer.auto_freeze is None:
        return "fixed"
    if optimizer.freeze_step is None:
        return "auto: not decided"
    reason = optimizer.freeze_detector.reason
    if reason == "settled":
        return "auto: the gradients settled"
    if reason == "max_step":
        return f"auto: bound reached (max_step {optimizer.freeze_detector.max_step})"
    return "auto: decided before the resume"  # a resumed run does not know its detector's reason


def summary_table(
    summary: dict[str, Any],
    freeze: Optional[str] = None,
    log_dir: Optional[str] = None,
    checkpoint_dir: Optional[str] = None,
    summary_json: Optional[str] = None,
) -> str:
    """The end-of-fit summary as a short aligned table. Long values (``advice``, ``steps_by_kind``, the figures of
    ``auto_freeze``) are left to the JSON (``--summary_json``).

    Args:
        summary: what ``--summary_json`` writes.
        freeze: how the warmup ended (:func:`freeze_note`); ``None`` without a compressed optimizer.
        log_dir, checkpoint_dir, summary_json: where the logs, the checkpoints and the JSON summary are; rows left
            out when ``None``.
    """
    rows = [("run", f"{summary['strategy']}, {summary['optimizer']}")]
    if "val_acc" in summary:
        rows.append(("accuracy", f"{100 * summary['val_acc']:.2f} %"))
    if "val_f1" in summary:
        rows.append(("F1 (macro)", f"{100 * summary['val_f1']:.2f} %"))
    rows.append(("bytes sent (rank 0)", _bytes_row(summary.get("bytes_sent"), summary.get("bytes_fp32_equivalent"))))
    if freeze is not None:
        step = summary.get("freeze_step")
        if step is None or summary.get("stage") == "warmup":
            when = "not reached, the run ended in the warmup" if step is None else f"{step:,}, not reached"
        else:
            when = f"{step:,}"
        rows.append(("freeze step", f"{when} ({freeze})"))
    rows.append(("steps", f"{summary['steps']:,}"))
    wall_s = summary["wall_s"]
    rows.append(("wall time", f"{wall_s:.1f} s" + (f" ({wall_s / 60:.1f} min)" if wall_s >= 60 else "")))
    rows += [(label, path) for label, path in
             (("logs", log_dir), ("checkpoints", checkpoint_dir), ("summary JSON", summary_json)) if path]
    width = max(len(label) for label, _ in rows)
    return "\n".join(f"  {label:<{width}}  {value}" for label, value in rows)


class BertFinetuneCLI(LightningCLI):
    """LightningCLI that links data to model sizes and prints an accuracy and communication summary after fit."""

    def add_arguments_to_parser(self, parser) -> None:
        parser.link_arguments("data.vocab_size", "model.vocab_size", apply_on="instantiate")
        parser.link_arguments("data.num_labels", "model.num_labels", apply_on="instantiate")
        parser.add_argument("--summary_json", type=Optional[str], default=None, help="write the final summary here")

    def before_instantiate_classes(self) -> None:
        # a pretrained model reads the ids of its own vocabulary: without --data.tokenizer, use the model's tokenizer
        # rather than the word-level one built from the data
        config = self.config[self.subcommand] if self.subcommand else self.config
        if config.model.model_name_or_path is not None and config.data.tokenizer is None:
            config.data.tokenizer = config.model.model_name_or_path

    @staticmethod
    def configure_optimizers(lightning_module: L.LightningModule, optimizer: Any, lr_scheduler: Any = None) -> Any:
        # LightningCLI's automatic configure_optimizers, with the word embeddings in a compress=False group if asked
        word_embeddings = getattr(lightning_module, "word_embeddings", "compressed")
        if word_embeddings != "compressed" and isinstance(optimizer, CompressedOptimizer):
            if lr_scheduler is not None:
                raise ValueError(
                    f"--model.word_embeddings {word_embeddings} with an lr_scheduler is not supported by this "
                    "example: the scheduler was built for the optimizer's single param group. Pass "
                    "--model.word_embeddings compressed, or build the two groups in a LightningModule's "
                    "configure_optimizers"
                )
            weight = lightning_module.bert.get_input_embeddings().weight
            held = {id(p) for group in optimizer.param_groups for p in group["params"]}
            if id(optimizer.shards.stand_in_of(weight)) not in held:  # built before sharding (see BertClassifier)
                weight = lightning_module.built_word_embeddings[0]
            embedding_groups(optimizer, weight,
                             sparse_rows=word_embeddings == "sparse_rows")
        return LightningCLI.configure_optimizers(lightning_module, optimizer, lr_scheduler)

    def before_fit(self) -> None:
        self._started = time.perf_counter()
        # the DDP baseline is counted by the monitor that counts the 1-bit runs (bert_adamw.yaml lists no callbacks),
        # unless the strategy counts its gradient average itself (a DDP comm hook of its own, which the monitor
        # cannot count)
        strategy = self.trainer.strategy
        if (isinstance(strategy, DDPStrategy) and _monitor(self.trainer) is None
                and _own_counters(strategy) is None):
            self.trainer.callbacks.append(CommunicationMonitor(prog_bar=False, advise=False))

    def after_fit(self) -> None:
        trainer = self.trainer
        summary: dict[str, Any] = {
            "strategy": type(trainer.strategy).__name__,
            "optimizer": type(trainer.optimizers[0]).__name__,
            "steps": trainer.global_step,
            # the trainable parameters: what bits per parameter per step are counted over
            "trainable_parameters": sum(p.numel() for p in trainer.lightning_module.parameters() if p.requires_grad),
            "wall_s": round(time.perf_counter() - self._started, 1),
            **{k: float(v) for k, v in trainer.callback_metrics.items() if k.startswith("val_")},
        }
        strategy = trainer.strategy
        if isinstance(strategy, (OnebitStrategy, OnebitFSDPStrategy)):
            optimizer = strategy.onebit_optimizer
            warm, comp = strategy.warmup_communication, optimizer.communication
            overlap_state = getattr(strategy, "overlap_state", None)  # onebit_fsdp does not overlap yet
            summary.update(
                freeze_step=optimizer.freeze_step,
                # freeze_step='auto': the figures behind the decided step
                auto_freeze=None if optimizer.freeze_detector is None else optimizer.freeze_detector.describe(),
                # why the warmup ended: "settled" (the rule decided) or "max_step" (the bound); None if it has not
                auto_freeze_reason=None if optimizer.freeze_detector is None else optimizer.freeze_detector.reason,
                # 0/1 Adam: the last step that could update the variance (local steps after it), as the run used it
                var_freeze_step=getattr(optimizer, "var_freeze_step", None),
                stage=optimizer.stage.value,
                bytes_sent_warmup=warm.bytes_sent,
                bytes_sent_compression=comp.bytes_sent,
                bytes_sent=warm.bytes_sent + comp.bytes_sent,
                bytes_fp32_equivalent=warm.bytes_fp32_equivalent + comp.bytes_fp32_equivalent,
                overlap="off" if overlap_state is None else "on",
                overlap_fallback=getattr(strategy, "overlap_fallback_reason", None),
                exchange_exposed_s=round(comp.exposed_s, 3),
                exchange_in_hooks_s=round(comp.hook_s, 3),
                steps_by_kind={str(kind): n for kind, n in optimizer.steps_by_kind.items()},
                bytes_sent_uncompressed=comp.bytes_sent_uncompressed,
                # steps that communicated (all but 0/1 Adam's local ones, unless a compress=False group averages its
                # gradients on them), plus syncs forced by checkpoints
                rounds_per_100_steps=_per_100(
                    sum(
                        n for kind, n in optimizer.steps_by_kind.items()
                        if kind != "local" or any(not g["compress"] for g in optimizer.param_groups)
                    )
                    + getattr(optimizer, "forced_syncs", 0),
                    trainer.global_step,
                ),
            )
            monitor = _monitor(trainer)
            if monitor is not None and monitor.advice is not None:  # "will compression help?", and the measured answer
                summary["advice"] = dataclasses.asdict(monitor.advice)
        elif isinstance(strategy, (OnebitDiLoCoStrategy, OnebitDiLoCoFSDPStrategy)):
            counters = strategy.communication
            trainable = summary["trainable_parameters"]
            summary.update(
                outer_syncs=strategy.outer_syncs,
                bytes_sent=counters.bytes_sent,
                bytes_sent_inter_node=counters.bytes_sent_inter_node,
                # what DDP would send: an fp32 ring allreduce of the gradients at every step
                bytes_fp32_equivalent=trainer.global_step * ring_allreduce_bytes(trainable, 4, trainer.world_size),
                rounds_per_100_steps=_per_100(strategy.outer_syncs, trainer.global_step),
            )
        else:
            monitor = _monitor(trainer)
            # DDP: the strategy's own count, or the monitor's (None: DDP had a comm hook of its own that nothing
            # counted); a single process sends nothing
            counters = _own_counters(strategy)
            if counters is None:
                counters = monitor.communication if monitor is not None else (
                    CommunicationCounters() if trainer.world_size == 1 else None
                )
            summary.update(
                bytes_sent=None if counters is None else counters.bytes_sent,
                bytes_fp32_equivalent=None if counters is None else counters.bytes_fp32_equivalent,
                rounds_per_100_steps=_per_100(trainer.global_step, trainer.global_step),  # DDP: one every step
            )
        log_dir = trainer.log_dir  # a broadcast from rank 0: every rank asks
        if trainer.global_rank != 0:
            return
        summary_json = self.config[self.subcommand].get("summary_json")
        checkpoint = trainer.checkpoint_callback
        table = summary_table(
            summary,
            freeze=(freeze_note(strategy.onebit_optimizer)
                    if isinstance(strategy, (OnebitStrategy, OnebitFSDPStrategy)) else None),
            log_dir=log_dir,
            checkpoint_dir=getattr(checkpoint, "dirpath", None),
            summary_json=summary_json,
        )
        print("\n== bert_finetune summary (rank 0) ==\n" + table, flush=True)
        if summary_json:
            Path(summary_json).write_text(json.dumps(summary, indent=2))


def main() -> None:
    torch.set_float32_matmul_precision("high")
    BertFinetuneCLI(BertClassifier, TextClassificationData, save_config_kwargs={"overwrite": True})
    # Lightning leaves a gloo process group initialised after fit (it destroys NCCL's only). A gloo group destroyed
    # while the interpreter finalises can abort a finished run ("terminate called without an active exception", seen in
    # the freeze sweep's AdamW-DDP runs). The onebit strategies release their groups at exit themselves, and
    # CommunicationMonitor lets go of DDP's at teardown; plain DDP (bert_adamw.yaml) needs this too.
    if torch.distributed.is_available() and torch.distributed.is_initialized():
        torch.distributed.destroy_process_group()


if __name__ == "__main__":
    main()
