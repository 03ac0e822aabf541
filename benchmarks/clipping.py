"""Gradient clipping by norm in the compression stage: which norm to clip by, measured on Lightning's transformer.

The setting of a user's report: Lightning's ``examples/pytorch/basics/transformer.py`` (the
``lightning.pytorch.demos.transformer.Transformer``, blocks of 35 tokens, batch 20 per rank, ``gradient_clip_val=0.25``)
on 2 gloo ranks for 60 steps, AdamW under DDP against OnebitAdam under ``strategy="onebit_adam"`` with
``freeze_step=15`` (a quarter of the run, so 45 steps are compressed). Offline: the corpus is the bytes of the Python
standard library's top-level ``*.py`` files (a byte-level vocabulary of 256, not WikiText2's 33,278 words), cut into
blocks of 36 bytes (35 inputs, targets shifted by one); every 20th block is held out. Same seed, same model
initialisation and same batches on every rank for every run of a seed.

In the compression stage DDP's gradient allreduce is off, so each rank holds its own gradient ``g_r`` when Lightning
clips; DDP clips the averaged gradient ``g = mean_r g_r`` by its norm. The clipping rules compared (each scales every
rank's local gradient by ``min(1, clip / (norm + 1e-6))``, as ``torch.nn.utils.clip_grad_norm_`` does, with ``norm``):

  local         ||g_r||, each rank its own (the library's behaviour before this benchmark: clip_grad_norm_ as is)
  rms           sqrt(mean_r ||g_r||^2), one all-reduce of one scalar, the same on every rank
  warmup_ratio  rho * sqrt(mean_r ||g_r||^2), rho = ||g|| / sqrt(mean_r ||g_r||^2) measured over the last 5 warmup
                steps (local norms read by gradient hooks before DDP averages them), the same on every rank
  sketch        the norm of the mean of the ranks' random-sign sums of their gradients into 256 bins (the same signs on
                every rank, new every step), one all-reduce of 256 numbers: the squared norm of a random-sign sketch
                estimates the squared norm of what it sketched without bias, and the mean of the sketches is the
                sketch of the mean gradient
  oracle        ||g|| itself, from a full-size all-reduce of the gradients (what DDP clips; a reference, not a
                candidate: it costs as much as DDP's allreduce)
  library       what strategy="onebit_adam" does with Lightning's own precision plugin (the library's default, chosen
                from these runs: the sketch in float32, capped by the rms; lightning_onebit/strategy/clipping.py)

Warmup steps clip as DDP does in every run. Runs per seed: ``adamw`` and ``adamw_noclip`` (DDP), ``onebit_<rule>``
for each rule above (clipping at 0.25), ``onebit_noclip``. Recorded per run: the training loss of every step (mean
over the ranks), the held-out loss of the final model (every held-out block, dropout off), and, every step, the three
norms ``||g_r||`` (per rank), ``sqrt(mean_r ||g_r||^2)`` and ``||g||`` (measured for the record, whatever the rule;
the full-size all-reduce that measures ``||g||`` in the compression stage changes no gradient), and the clip factor
the rule applied. The table shows the mean training loss of the last 10 steps (the end of the run) per seed, and
the held-out loss.

    python -m benchmarks.clipping                        # 3 seeds (0 1 2), every run: results/clipping.json
    python -m benchmarks.clipping --seeds 3 4 --name clipping_more
    python -m benchmarks.clipping --runs onebit_library  # rerun one run, keep the others' results in the JSON

Cost: about 40 s of compute per run and rank on one core (0.5 s a step), 60-100 s of wall time per run on 2 cores
shared with other work (13 minutes a seed for 9 runs).
"""

from __future__ import annotations

import os
import statistics
import sysconfig
from pathlib import Path
from typing import Any

from benchmarks.common import argument_parser, launch, write_results

NAME = "clipping"
STEPS, FREEZE, CLIP = 60, 15, 0.25
BLOCK, BATCH, LR = 35, 20, 1e-3
HELD_OUT_EVERY, CORPUS_WORDS, VOCAB = 20, 400_000, 8192
LAST = 10  # the end of the run: the mean training loss of the last LAST steps
RATIO_WINDOW = 5  # warmup_ratio: rho averaged over the last RATIO_WINDOW warmup steps
SKETCH_BINS = 256  # sketch: the number of random-sign sums all-reduced
RULES = ("local", "rms", "warmup_ratio", "sketch", "oracle", "library")
RUNS = ("adamw", "adamw_noclip", *(f"onebit_{r}" for r in RULES), "onebit_noclip")


def corpus() -> tuple["Any", int]:
    """The word corpus and its vocabulary size: the standard library's top-level ``*.py`` files in name order up to
    CORPUS_WORDS words, split as the demo's ``tokenize`` splits WikiText2 (whitespace, ``<eos>`` after every line);
    the VOCAB - 1 most frequent words keep an id of their own, the others share ``<unk>``."""
    import collections

    import torch

    stdlib = Path(sysconfig.get_paths()["stdlib"])
    words: list[str] = []
    for path in sorted(stdlib.glob("*.py")):
        for line in path.read_text(encoding="utf-8", errors="replace").splitlines():
            words += line.split() + ["<eos>"]
        if len(words) >= CORPUS_WORDS:
            break
    words = words[:CORPUS_WORDS]
    common = [w for w, _ in collections.Counter(words).most_common(VOCAB - 1)]
    ids = {w: i + 1 for i, w in enumerate(common)}  # 0: <unk>
    return torch.tensor([ids.get(w, 0) for w in words], dtype=torch.long), VOCAB


def blocks(data: "Any") -> tuple["Any", "Any"]:
    """``(train, held_out)`` blocks of BLOCK + 1 words (input and target overlap by BLOCK)."""
    import torch

    n = (len(data) - 1) // BLOCK
    all_blocks = data[: n * BLOCK + 1].unfold(0, BLOCK + 1, BLOCK)
    held = torch.tensor([i % HELD_OUT_EVERY == HELD_OUT_EVERY - 1 for i in range(n)])
    return all_blocks[~held], all_blocks[held]


class NormProbe:
    """Per step: this rank's gradient norm before any averaging (gradient hooks, which run before DDP's reducer),
    ``sqrt(mean_r ||g_r||^2)`` and ``||g||`` (the averaged gradient); and ``rho`` over the last warmup steps."""

    def __init__(self, module: "Any") -> None:
        import torch

        self.params = [p for p in module.parameters() if p.requires_grad]
        self.local_sq = torch.zeros((), dtype=torch.float64)
        self.handles = [p.register_hook(self._add) for p in self.params]
        self.records: list[dict[str, Any]] = []
        self.warmup_rhos: list[float] = []

    def _add(self, grad: "Any") -> None:
        self.local_sq += grad.detach().double().pow(2).sum()

    def measure(self, averaged: bool) -> dict[str, float]:
        """Before clipping: the three norms of this step (collectives: every rank calls it)."""
        import torch
        import torch.distributed as dist

        world = dist.get_world_size()
        grads = [p.grad for p in self.params if p.grad is not None]
        local = float(self.local_sq.sqrt())
        mean_sq = self.local_sq.clone()
        dist.all_reduce(mean_sq)
        rms = float((mean_sq / world).sqrt())
        if averaged:  # DDP's allreduce already averaged them
            mean_norm = float(torch.linalg.vector_norm(torch.cat([g.double().reshape(-1) for g in grads])))
        else:
            flat = torch.cat([g.double().reshape(-1) for g in grads])
            dist.all_reduce(flat)
            mean_norm = float(flat.div_(world).norm())
        self.local_sq.zero_()
        record = dict(local=local, rms=rms, mean=mean_norm, averaged=averaged)
        self.records.append(record)
        if averaged:
            self.warmup_rhos.append(mean_norm / rms)
        return record

    @property
    def rho(self) -> float:
        window = self.warmup_rhos[-RATIO_WINDOW:]
        return sum(window) / len(window)

    def remove(self) -> None:
        for handle in self.handles:
            handle.remove()


def sketch_norm(grads: list["Any"], step: int, bins: int = SKETCH_BINS) -> float:
    """An estimate of ``||mean_r g_r||`` from one all-reduce of ``bins`` numbers: every rank sums its gradient's
    coordinates with random signs into ``bins`` bins (coordinate ``i`` of a tensor into bin ``i mod bins``), with the
    same signs on every rank (a generator seeded by the step), so the mean of the ranks' sums is the sums of the mean
    gradient, and the squared norm of a vector of random-sign sums is an unbiased estimate of the squared norm of
    what was summed (relative standard deviation about ``sqrt(2 / bins)`` when no few coordinates dominate)."""
    import torch
    import torch.distributed as dist

    generator = torch.Generator().manual_seed(1_000_003 * step + 12345)
    sums = torch.zeros(bins, dtype=torch.float64)
    for grad in grads:
        flat = grad.detach().reshape(-1).double()
        signs = torch.randint(0, 2, flat.shape, generator=generator, dtype=torch.int8).double().mul_(2).sub_(1)
        signed = torch.nn.functional.pad(flat * signs, (0, (-flat.numel()) % bins))
        sums += signed.view(-1, bins).sum(0)
    dist.all_reduce(sums)
    return float(sums.div_(dist.get_world_size()).norm())


def _plugin(rule: str, probe_holder: dict[str, Any]) -> Any:
    """A ``Precision`` plugin that clips by norm with ``rule`` where gradients are local (compression stage)."""
    import torch
    from lightning.pytorch.plugins.precision import Precision

    class RuleClipping(Precision):
        def clip_grad_by_norm(self, optimizer: Any, clip_val: float) -> None:
            inner = getattr(optimizer, "_optimizer", optimizer)
            probe: NormProbe = probe_holder["probe"]
            record = probe.records[-1]
            if inner.needs_gradient_allreduce or rule == "local":  # DDP's clip, or clip_grad_norm_ as it is
                return super().clip_grad_by_norm(optimizer, clip_val)
            if rule == "sketch":
                norm = sketch_norm([p.grad for p in self.main_params(optimizer) if p.grad is not None],
                                   inner.step_count)
            else:
                norm = dict(rms=record["rms"], warmup_ratio=probe.rho * record["rms"], oracle=record["mean"])[rule]
            params = list(self.main_params(optimizer))
            probe.records[-1]["clip_norm"] = float(norm)
            torch.nn.utils.clip_grads_with_norm_(params, clip_val, torch.tensor(norm))

    return RuleClipping()


def _run_one(rank: int, world_size: int, seed: int, run: str, train: Any, held_out: Any, vocab: int
             ) -> dict[str, Any]:
    import torch
    from lightning.pytorch.demos.transformer import Transformer
    from torch.utils.data import DataLoader, TensorDataset
    from torch.utils.data.distributed import DistributedSampler

    import lightning.pytorch as pl
    from lightning_onebit import OnebitAdam, OnebitStrategy
    from lightning_onebit.hooks import leaves_gradients_unchanged

    onebit = run.startswith("onebit")
    clip = None if run.endswith("noclip") else CLIP
    rule = run[len("onebit_"):] if onebit and clip else None
    holder: dict[str, Any] = {}

    class LM(pl.LightningModule):
        def __init__(self) -> None:
            super().__init__()
            self.model = Transformer(vocab_size=vocab)
            self.losses: list[float] = []

        def training_step(self, batch: Any, batch_idx: int) -> Any:
            (chunk,) = batch
            inputs, target = chunk[:, :-1], chunk[:, 1:]
            loss = torch.nn.functional.nll_loss(self.model(inputs, target), target.reshape(-1))
            self.losses.append(float(loss.detach()))
            return loss

        def configure_optimizers(self) -> Any:
            if onebit:
                return OnebitAdam(self.parameters(), lr=LR, weight_decay=0.0, freeze_step=FREEZE)
            return torch.optim.AdamW(self.parameters(), lr=LR, weight_decay=0.0)

    class Probe(pl.Callback):
        @leaves_gradients_unchanged
        def on_before_optimizer_step(self, trainer: pl.Trainer, module: Any, optimizer: Any) -> None:
            inner = getattr(optimizer, "_optimizer", optimizer)
            holder["probe"].measure(averaged=not onebit or inner.needs_gradient_allreduce)

    pl.seed_everything(seed, verbose=False)
    module = LM()
    holder["probe"] = NormProbe(module)
    dataset = TensorDataset(train)
    sampler = DistributedSampler(dataset, num_replicas=world_size, rank=rank, shuffle=True, seed=seed, drop_last=True)
    loader = DataLoader(dataset, batch_size=BATCH, sampler=sampler, drop_last=True)
    kwargs: dict[str, Any] = {}
    if rule not in (None, "library"):
        kwargs["plugins"] = [_plugin(rule, holder)]
    strategy: Any = OnebitStrategy() if onebit else "ddp"
    trainer = pl.Trainer(accelerator="cpu", devices=world_size, strategy=strategy, max_steps=STEPS, logger=False,
                         enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False,
                         use_distributed_sampler=False, gradient_clip_val=clip, callbacks=[Probe()], **kwargs)
    trainer.fit(module, loader)
    holder["probe"].remove()
    module.eval()
    with torch.no_grad():
        losses = [torch.nn.functional.nll_loss(module.model(b[:, :-1], b[:, 1:]), b[:, 1:].reshape(-1), reduction="sum")
                  for b in held_out.split(BATCH)]
        held = float(sum(losses)) / held_out[:, 1:].numel()
    return dict(losses=module.losses, held_out=held, norms=holder["probe"].records,
                rho=holder["probe"].rho if holder["probe"].warmup_rhos else None)


def _seed_runs(rank: int, world_size: int, seed: int, runs: list[str]) -> dict[str, Any]:
    import torch

    os.environ.update(LOCAL_RANK=str(rank), RANK=str(rank), WORLD_SIZE=str(world_size), NODE_RANK="0")
    import logging
    import warnings

    logging.getLogger("lightning").setLevel(logging.ERROR)
    logging.getLogger("lightning_onebit").setLevel(logging.ERROR)
    warnings.filterwarnings("ignore")
    data, vocab = corpus()
    train, held_out = blocks(data)
    torch.set_num_threads(1)
    return {run: _run_one(rank, world_size, seed, run, train, held_out, vocab) for run in runs}


def _summary(per_rank: list[dict[str, Any]]) -> dict[str, Any]:
    """One run from its ranks' records: losses averaged over ranks, the norms per step."""
    steps = len(per_rank[0]["losses"])
    losses = [sum(r["losses"][i] for r in per_rank) / len(per_rank) for i in range(steps)]
    norms = [dict(local=[r["norms"][i]["local"] for r in per_rank], rms=per_rank[0]["norms"][i]["rms"],
                  mean=per_rank[0]["norms"][i]["mean"], clip=per_rank[0]["norms"][i].get("clip_norm"))
             for i in range(len(per_rank[0]["norms"]))]
    compressed = [n for n, r in zip(norms, per_rank[0]["norms"]) if not r["averaged"]]
    return dict(
        losses=losses,
        final_loss=sum(losses[-LAST:]) / LAST,
        held_out=per_rank[0]["held_out"],
        rho_warmup=per_rank[0]["rho"],
        # ||g|| / sqrt(mean_r ||g_r||^2) over the compressed steps (how far the rms overestimates what DDP clips)
        rho_compression=statistics.mean(n["mean"] / n["rms"] for n in compressed) if compressed else None,
        norms=norms,
    )


#: What each run clips by in the compression stage (the table's second column).
LABELS = {
    "adamw": "AdamW, DDP: ||g|| every step",
    "adamw_noclip": "AdamW, DDP, no clipping",
    "onebit_local": "each rank its own ||g_r|| (before)",
    "onebit_rms": "sqrt(mean_r ||g_r||^2)",
    "onebit_warmup_ratio": "rho sqrt(mean_r ||g_r||^2), rho of the warmup's end",
    "onebit_sketch": "256-bin sketch of g (float64, uncapped)",
    "onebit_oracle": "||g|| exactly (full-size all-reduce)",
    "onebit_library": "the default: the sketch, capped by the rms",
    "onebit_noclip": "no clipping",
}


def _compressed(run: dict[str, Any]) -> list[dict[str, Any]]:
    return run["norms"][FREEZE:]


def table(results: dict[str, Any]) -> str:
    """The markdown table of the docs: the mean training loss of the last LAST steps per seed, their mean and its
    difference to AdamW's, and the held-out loss (mean over seeds)."""
    seeds = sorted(results["seeds"], key=int)
    runs = [r for r in RUNS if all(r in results["seeds"][s] for s in seeds)]
    head = ("| run | clipped by, compression stage | " + " | ".join(f"seed {s}" for s in seeds)
            + " | mean | vs AdamW | held-out |")
    lines = [head, "|" + "---|" * (len(seeds) + 5)]
    reference = statistics.mean(results["seeds"][s]["adamw"]["final_loss"] for s in seeds)
    for run in runs:
        finals = [results["seeds"][s][run]["final_loss"] for s in seeds]
        held = [results["seeds"][s][run]["held_out"] for s in seeds]
        label = LABELS[run].replace("||", "\\|\\|")  # a pipe inside a markdown table cell
        lines.append(f"| {run} | {label} | " + " | ".join(f"{f:.3f}" for f in finals)
                     + f" | {statistics.mean(finals):.3f} | {statistics.mean(finals) - reference:+.3f}"
                     f" | {statistics.mean(held):.3f} |")
    return "\n".join(lines)


def norms_table(results: dict[str, Any]) -> str:
    """Per seed, over the compressed steps of the ``onebit_sketch`` run: ``||g|| / sqrt(mean_r ||g_r||^2)`` (how far
    the rms overestimates what DDP clips) and the sketch's norm against ``||g||``."""
    seeds = [s for s in sorted(results["seeds"], key=int) if "onebit_sketch" in results["seeds"][s]]
    lines = ["| seed | `\\|\\|g\\|\\|` / rms: mean (min) | sketch / `\\|\\|g\\|\\|`: mean (min, max) |", "|---|---|---|"]
    for s in seeds:
        steps = _compressed(results["seeds"][s]["onebit_sketch"])
        ratios = [n["mean"] / n["rms"] for n in steps]
        errors = [n["clip"] / n["mean"] for n in steps]
        lines.append(f"| {s} | {statistics.mean(ratios):.3f} ({min(ratios):.3f}) | {statistics.mean(errors):.3f} "
                     f"({min(errors):.3f}, {max(errors):.3f}) |")
    return "\n".join(lines)


def main() -> None:
    parser = argument_parser(__spec__.name, __doc__)
    parser.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2])
    parser.add_argument("--runs", nargs="+", choices=RUNS, default=list(RUNS))
    parser.add_argument("--name", default=NAME, help=f"results/NAME.json (default {NAME})")
    args = parser.parse_args()
    from benchmarks.common import RESULTS_DIR
    import json

    path = RESULTS_DIR / f"{args.name}.json"
    previous = json.loads(path.read_text()) if path.exists() else {}
    results = dict(setting=dict(steps=STEPS, freeze_step=FREEZE, clip=CLIP, block=BLOCK, batch_per_rank=BATCH, lr=LR,
                                ranks=2, corpus="stdlib *.py bytes", last=LAST, ratio_window=RATIO_WINDOW),
                   seeds=previous.get("seeds", {}))
    for seed in args.seeds:
        per_rank = launch(_seed_runs, 2, seed, list(args.runs))
        fresh = {run: _summary([r[run] for r in per_rank]) for run in args.runs}
        kept = results["seeds"].get(str(seed), {})
        results["seeds"][str(seed)] = {run: fresh.get(run, kept.get(run)) for run in RUNS
                                       if run in fresh or run in kept}
        print(f"seed {seed}: " + ", ".join(f"{run} {fresh[run]['final_loss']:.3f}" for run in args.runs), flush=True)
        write_results(args.name, results)
    print(table(results))
    print(norms_table(results))
    print(f"written to {write_results(args.name, results)}")


if __name__ == "__main__":
    main()
