"""Accuracy parity: the BERT example with DDP + AdamW and with onebit_adam, same seed, data order and steps.

Runs ``examples/bert_finetune.py fit`` twice on 2 CPU processes (configs ``bert_adamw.yaml`` and
``bert_onebit.yaml``, which differ only in strategy, optimizer and the onebit callbacks), then prints validation
accuracy and F1 of both, the bytes each rank sent, and wall time; results go to ``results/bert_parity.json``.
Extra arguments are passed to both runs (e.g. ``--trainer.max_steps 300``).

    python benchmarks/bert_parity.py
    python benchmarks/bert_parity.py --bag-of-words   # also the accuracy of a bag-of-words logistic regression
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
from benchmarks.common import write_results  # noqa: E402


def run_example(config: str, extra: list[str], workdir: Path) -> dict:
    summary = workdir / f"{Path(config).stem}.json"
    command = [sys.executable, str(ROOT / "examples" / "bert_finetune.py"), "fit", "--config",
               str(ROOT / "examples" / "configs" / config), "--summary_json", str(summary),
               "--trainer.enable_progress_bar", "false", *extra]
    print("$", " ".join(command), flush=True)
    subprocess.run(command, check=True, cwd=workdir)
    return json.loads(summary.read_text())


def bag_of_words_accuracy(seed: int = 0) -> float:
    """Validation accuracy of a bag-of-words logistic regression on the synthetic reviews (the task's floor)."""
    import torch

    sys.path.insert(0, str(ROOT / "examples"))
    from bert_finetune import _word_vocab, make_reviews

    train, val = make_reviews(4000, seed), make_reviews(1000, seed + 1)
    vocab = _word_vocab([t for t, _ in train])

    def featurise(rows):
        x = torch.zeros(len(rows), len(vocab))
        for i, (text, _) in enumerate(rows):
            for word in text.split():
                x[i, vocab[word]] += 1
        return x, torch.tensor([label for _, label in rows], dtype=torch.float32)

    (x, y), (xv, yv) = featurise(train), featurise(val)
    w = torch.zeros(len(vocab), requires_grad=True)
    b = torch.zeros(1, requires_grad=True)
    optimizer = torch.optim.Adam([w, b], lr=0.05)
    for _ in range(500):
        loss = torch.nn.functional.binary_cross_entropy_with_logits(x @ w + b, y)
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
    return float(((xv @ w + b > 0).float() == yv).float().mean())


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--bag-of-words", action="store_true", help="also report a bag-of-words baseline")
    args, extra = parser.parse_known_args()
    with tempfile.TemporaryDirectory() as tmp:
        runs = {name: run_example(config, extra, Path(tmp)) for name, config in
                (("ddp_adamw", "bert_adamw.yaml"), ("onebit_adam", "bert_onebit.yaml"))}
    results = dict(runs=runs, extra_args=extra)
    if args.bag_of_words:
        results["bag_of_words_val_acc"] = bag_of_words_accuracy()
    a, o = runs["ddp_adamw"], runs["onebit_adam"]
    print(f"\n{'':28s}{'DDP + AdamW':>16s}{'onebit_adam':>16s}")
    for key, fmt in (("steps", "{:>16,d}"), ("val_acc", "{:>16.4f}"), ("val_f1", "{:>16.4f}"),
                     ("bytes_sent", "{:>16,d}"), ("wall_s", "{:>16.1f}")):
        print(f"{key:28s}" + fmt.format(a[key]) + fmt.format(o[key]))
    print(f"{'accuracy difference (points)':28s}{100 * (o['val_acc'] - a['val_acc']):>32.2f}")
    print(f"{'bytes ratio AdamW / onebit':28s}{a['bytes_sent'] / o['bytes_sent']:>32.2f}")
    if args.bag_of_words:
        print(f"{'bag-of-words val accuracy':28s}{results['bag_of_words_val_acc']:>32.4f}")
    print(f"written to {write_results('bert_parity', results)}")


if __name__ == "__main__":
    main()
