"""How sensitive is training to ``freeze_step``? The BERT example's model and data, one process, several freezes.

With one process the compressed allreduce is the identity, so this isolates what the frozen variance does. Each run
starts from the same initialisation and data order and reports the training loss along the way (mean over 30
steps) and the final validation accuracy. Results: ``results/freeze_step_sweep.json``.

    python benchmarks/freeze_step_sweep.py --freeze-steps 60 120 200 300 --steps 450
"""

from __future__ import annotations

import argparse
import importlib.util
import sys
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
from benchmarks.common import write_results  # noqa: E402
from lightning_onebit import OnebitAdam  # noqa: E402


def _example():
    spec = importlib.util.spec_from_file_location("bert_finetune", ROOT / "examples" / "bert_finetune.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def run(freeze_step: int, steps: int, lr: float, seed: int) -> dict:
    example = _example()
    data = example.TextClassificationData(batch_size=32)
    data.setup("fit")
    torch.manual_seed(seed)
    model = example.BertClassifier(vocab_size=data.vocab_size, num_layers=4, hidden_size=128, intermediate_size=512)
    optimizer = OnebitAdam(model.parameters(), lr=lr, weight_decay=0.01, freeze_step=freeze_step)
    generator = torch.Generator().manual_seed(seed)
    loader = torch.utils.data.DataLoader(data.train_set, batch_size=32, shuffle=True, drop_last=True, generator=generator)
    batches, losses = iter(loader), []
    for _ in range(steps):
        try:
            batch = next(batches)
        except StopIteration:
            batches = iter(loader)
            batch = next(batches)
        loss = model.bert(**batch).loss
        loss.backward()
        optimizer.step()
        optimizer.zero_grad()
        losses.append(loss.item())
    model.eval()
    correct = total = 0
    with torch.no_grad():
        for batch in data.val_dataloader():
            predictions = model.bert(**batch).logits.argmax(-1)
            correct += int((predictions == batch["labels"]).sum())
            total += len(predictions)
    curve = [sum(losses[i : i + 30]) / len(losses[i : i + 30]) for i in range(0, steps, 30)]
    return dict(freeze_step=freeze_step, val_acc=correct / total, loss_curve=curve)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--freeze-steps", type=int, nargs="+", default=[60, 120, 200, 300])
    parser.add_argument("--steps", type=int, default=450)
    parser.add_argument("--lr", type=float, default=5e-4)
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()
    torch.set_num_threads(1)
    rows = []
    for freeze_step in args.freeze_steps:
        rows.append(run(freeze_step, args.steps, args.lr, args.seed))
        r = rows[-1]
        curve = " ".join(f"{x:.2f}" for x in r["loss_curve"])
        print(f"freeze_step={freeze_step:>5d}  val_acc={r['val_acc']:.3f}  loss per 30 steps: {curve}", flush=True)
    print(f"written to {write_results('freeze_step_sweep', dict(args=vars(args), rows=rows))}")


if __name__ == "__main__":
    main()
