"""Accuracy parity: the BERT example with DDP + AdamW and with the compressed optimizers, same seed, data order and
steps.

Runs ``examples/bert_finetune.py fit`` on 2 CPU processes once per config (``bert_adamw.yaml``, ``bert_onebit.yaml``,
``bert_zeroone.yaml``, ``bert_lamb.yaml``, which differ only in strategy, optimizer, learning rate and the onebit
callbacks; ``onebit_adam_bf16_warmup`` is ``bert_onebit.yaml`` with the warmup's gradients averaged in bf16 by
``OnebitStrategy(ddp_comm_hook=bf16_compress_hook)``), then prints validation accuracy and F1, the bytes each rank sent, communication rounds per 100 steps and
wall time; results go to ``results/bert_parity.json``.
``--runs`` runs a subset and keeps the other runs already in that file (each column is one run of the example).
Extra arguments are passed to every run (e.g. ``--trainer.max_steps 300``).

    python -m benchmarks.bert_parity
    python -m benchmarks.bert_parity --runs onebit_lamb   # rerun one, keep the others' results
    python -m benchmarks.bert_parity --bag-of-words       # also the accuracy of a bag-of-words logistic regression
"""

from __future__ import annotations

import json
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Optional

from benchmarks.common import (
    EXAMPLE,
    EXAMPLE_CONFIGS,
    argument_parser,
    load_example,
    merge_runs,
    previous_results,
    script_env,
    write_results,
)


def run_example(config: str, extra: list[str], workdir: Path, log: Optional[Path] = None,
                env: Optional[dict[str, str]] = None) -> dict:
    """One run of the example (``python examples/bert_finetune.py fit --config examples/configs/CONFIG ...`` in
    ``workdir``, with ``env`` added to the environment); its summary. With ``log``, its output also goes to that
    file. The repository root comes first on the run's ``PYTHONPATH``, so that the example imports this checkout's
    library (not another copy pip installed) and the benchmarks' callbacks."""
    summary = workdir / f"{Path(config).stem}.json"
    command = [sys.executable, str(EXAMPLE), "fit", "--config", str(EXAMPLE_CONFIGS / config), "--summary_json",
               str(summary), "--trainer.enable_progress_bar", "false", *extra]
    environment = script_env(**(env or {}))
    print("$", " ".join(command), flush=True)
    if log is None:
        subprocess.run(command, check=True, cwd=workdir, env=environment)
        return json.loads(summary.read_text())
    with open(log, "w") as f:  # shown as it runs and kept
        process = subprocess.Popen(command, cwd=workdir, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                                   env=environment)
        for line in process.stdout:
            sys.stdout.write(line)
            f.write(line)
    if process.wait():
        raise subprocess.CalledProcessError(process.returncode, command)
    return json.loads(summary.read_text())


def bag_of_words_accuracy(seed: int = 0) -> float:
    """Validation accuracy of a bag-of-words logistic regression on the synthetic reviews (the task's floor)."""
    import torch

    example = load_example()
    make_reviews, _word_vocab = example.make_reviews, example._word_vocab
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


CONFIGS = {
    "ddp_adamw": "bert_adamw.yaml",
    "onebit_adam": "bert_onebit.yaml",
    "onebit_adam_bf16_warmup": "bert_onebit.yaml",
    "zeroone_adam": "bert_zeroone.yaml",
    "onebit_lamb": "bert_lamb.yaml",
}
#: Arguments a run adds to its config: 1-bit Adam whose warmup averages gradients with torch's bf16_compress_hook
#: (``OnebitStrategy(ddp_comm_hook=...)``: half the warmup's bytes).
RUN_ARGS = {
    "onebit_adam_bf16_warmup": [
        "--trainer.strategy", "lightning_onebit.OnebitStrategy",
        "--trainer.strategy.ddp_comm_hook",
        "torch.distributed.algorithms.ddp_comm_hooks.default_hooks.bf16_compress_hook",
    ],
}


def main() -> None:
    parser = argument_parser(__spec__.name, __doc__)
    parser.add_argument("--bag-of-words", action="store_true", help="also report a bag-of-words baseline")
    parser.add_argument("--runs", nargs="+", choices=list(CONFIGS), default=list(CONFIGS),
                        help="configs to run (default all); the others keep their results in results/bert_parity.json")
    args, extra = parser.parse_known_args()
    previous = previous_results("bert_parity", args.runs, list(CONFIGS))
    with tempfile.TemporaryDirectory() as tmp:
        fresh = {name: run_example(CONFIGS[name], [*RUN_ARGS.get(name, []), *extra], Path(tmp)) for name in args.runs}
    runs = merge_runs(previous, fresh, list(CONFIGS))
    results = dict(runs=runs, extra_args=extra)
    if args.bag_of_words:
        results["bag_of_words_val_acc"] = bag_of_words_accuracy()
    elif "bag_of_words_val_acc" in previous:
        results["bag_of_words_val_acc"] = previous["bag_of_words_val_acc"]
    a = runs["ddp_adamw"]
    print(f"\n{'':28s}" + "".join(f"{name:>16s}" for name in runs))
    for key, fmt in (("steps", "{:>16,d}"), ("val_acc", "{:>16.4f}"), ("val_f1", "{:>16.4f}"),
                     ("bytes_sent", "{:>16,d}"), ("rounds_per_100_steps", "{:>16.1f}"), ("wall_s", "{:>16.1f}")):
        print(f"{key:28s}" + "".join(fmt.format(run[key]) for run in runs.values()))
    for name, o in runs.items():
        if name != "ddp_adamw":
            print(f"{name}: accuracy difference {100 * (o['val_acc'] - a['val_acc']):+.2f} points, bytes ratio "
                  f"AdamW / {name} {a['bytes_sent'] / o['bytes_sent']:.2f}")
    if args.bag_of_words:
        print(f"{'bag-of-words val accuracy':28s}{results['bag_of_words_val_acc']:>32.4f}")
    print(f"written to {write_results('bert_parity', results)}")


if __name__ == "__main__":
    main()
