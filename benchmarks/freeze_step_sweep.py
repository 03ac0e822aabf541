"""How sensitive is training to ``freeze_step``, and where does ``freeze_step="auto"`` land? The BERT example's model
and data, one process, several freezes and seeds.

With one process the compressed allreduce is the identity, so this isolates what the frozen variance does. Each run
starts from its seed's initialisation and data order and reports the training loss along the way (mean over 30
steps) and the final validation accuracy. ``auto`` is ``OnebitAdam(freeze_step="auto", auto_freeze=AutoFreeze(...))``
with the ``--auto-*`` settings (the example configs' values by default); its row also gives the decided step, the
detector's figures and its time per warmup step. Per seed, the summary compares ``auto`` with the best fixed step
(highest accuracy, the earliest of equals): accuracy difference, warmup ratio, and the mean training loss of the 30
steps before the decision (the initial plateau sits at ~0.69). Runs go to ``--jobs`` processes, one thread each.
Results: ``results/freeze_step_sweep.json``.

    python -m benchmarks.freeze_step_sweep --freeze-steps 60 120 200 300 auto --seeds 0 1 2 --steps 450
"""

from __future__ import annotations

import multiprocessing
import time
from typing import Union

import torch

from benchmarks.common import argument_parser, load_example, write_results
from lightning_onebit import AutoFreeze, OnebitAdam

# freeze_step="auto" as examples/configs/bert_onebit.yaml sets it (a run of 620 steps; the defaults are tied to
# beta2 = 0.999, a 1000-step window, for runs of many thousands of steps)
AUTO_DEFAULTS = dict(window=40, check_every=10, threshold=0.5, tensor_threshold=1.6, loss_drop=0.1, patience=3,
                     min_step=None, max_step=400)


def run(freeze_step: Union[int, str], steps: int, lr: float, seed: int, auto: dict) -> dict:
    torch.set_num_threads(1)
    example = load_example()
    data = example.TextClassificationData(batch_size=32)
    data.setup("fit")
    torch.manual_seed(seed)
    model = example.BertClassifier(vocab_size=data.vocab_size, num_layers=4, hidden_size=128, intermediate_size=512)
    auto_freeze = AutoFreeze(**auto) if freeze_step == "auto" else None
    optimizer = OnebitAdam(model.parameters(), lr=lr, weight_decay=0.01, freeze_step=freeze_step,
                           auto_freeze=auto_freeze)
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
        optimizer.observe_loss(loss)  # freeze_step="auto": the loss_drop guard (the Lightning strategy does this)
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
    row = dict(freeze_step=freeze_step, seed=seed, val_acc=correct / total, loss_curve=curve)
    if freeze_step == "auto":
        detector = optimizer.freeze_detector
        decided = optimizer.freeze_step
        row.update(
            decided_step=decided,
            reason=detector.reason,
            figures=detector.last,
            detector_ms_per_warmup_step=1e3 * detector.seconds / decided,
            loss_before_decision=sum(losses[max(0, decided - 30) : decided]) / min(30, decided),
        )
    return row


def _run(job: tuple) -> dict:
    return run(*job)


def summarise(rows: list[dict]) -> list[dict]:
    """Per seed: auto against the best fixed step (highest accuracy, the earliest of equals)."""
    out = []
    for seed in sorted({r["seed"] for r in rows}):
        fixed = [r for r in rows if r["seed"] == seed and r["freeze_step"] != "auto"]
        auto = [r for r in rows if r["seed"] == seed and r["freeze_step"] == "auto"]
        if not fixed or not auto:
            continue
        best = max(fixed, key=lambda r: (r["val_acc"], -r["freeze_step"]))
        a = auto[0]
        out.append(dict(
            seed=seed, best_fixed_step=best["freeze_step"], best_fixed_acc=best["val_acc"],
            auto_step=a["decided_step"], auto_acc=a["val_acc"],
            accuracy_points=100 * (a["val_acc"] - best["val_acc"]),
            warmup_ratio=a["decided_step"] / best["freeze_step"],
            loss_before_decision=a["loss_before_decision"],
        ))
    return out


def main() -> None:
    parser = argument_parser(__spec__.name, __doc__)
    parser.add_argument("--freeze-steps", nargs="+", default=["60", "120", "200", "300", "auto"],
                        help="fixed steps and/or 'auto'")
    parser.add_argument("--steps", type=int, default=450)
    parser.add_argument("--lr", type=float, default=5e-4)
    parser.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2])
    parser.add_argument("--jobs", type=int, default=2, help="runs in parallel (one thread each)")
    parser.add_argument("--name", default="freeze_step_sweep", help="results/NAME.json (default freeze_step_sweep)")
    for name, value in AUTO_DEFAULTS.items():
        parser.add_argument(f"--auto-{name.replace('_', '-')}", type=type(value) if value is not None else int,
                            default=value, help=f"AutoFreeze {name} (default {value})")
    args = parser.parse_args()
    freezes = [f if f == "auto" else int(f) for f in args.freeze_steps]
    auto = {name: getattr(args, f"auto_{name}") for name in AUTO_DEFAULTS}
    jobs = [(f, args.steps, args.lr, seed, auto) for seed in args.seeds for f in freezes]
    started = time.perf_counter()
    with multiprocessing.get_context("spawn").Pool(args.jobs) as pool:
        rows = pool.map(_run, jobs)
    for r in rows:
        curve = " ".join(f"{x:.2f}" for x in r["loss_curve"])
        decided = f" (decided {r['decided_step']}, {r['reason']})" if r["freeze_step"] == "auto" else ""
        print(f"seed {r['seed']} freeze_step={r['freeze_step']!s:>5s}{decided}  val_acc={r['val_acc']:.3f}  "
              f"loss per 30 steps: {curve}", flush=True)
    summary = summarise(rows)
    for s in summary:
        print(f"seed {s['seed']}: auto froze at {s['auto_step']} ({s['auto_acc']:.3f}; loss before it "
              f"{s['loss_before_decision']:.3f}), best fixed {s['best_fixed_step']} ({s['best_fixed_acc']:.3f}): "
              f"{s['accuracy_points']:+.2f} points, warmup x{s['warmup_ratio']:.2f}")
    results = dict(args=vars(args), rows=rows, summary=summary, wall_s=round(time.perf_counter() - started, 1))
    print(f"written to {write_results(args.name, results)}")


if __name__ == "__main__":
    main()
