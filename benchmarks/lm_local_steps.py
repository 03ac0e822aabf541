"""Issue 46: a small GPT trained from scratch, byte-level, on the Python standard library's own source files, with
every strategy: AdamW-DDP, 1-bit Adam and local steps (``onebit_diloco``); validation loss at equal tokens.

**Corpus** (offline, the same on every machine with the same Python): the top-level modules of the standard library
(``sysconfig.get_paths()["stdlib"]/*.py``), sorted by name; every tenth file (index 9, 19, ...) is held out for
validation, the others are the training text. Files are joined with a NUL byte between them; a token is a byte (256
symbols). The results record the files, their bytes and a SHA-256 digest of the names and contents
(:func:`stdlib_corpus`), and the Python version they came from.

**Model** (:class:`TinyGPT`): a pre-LayerNorm decoder, ``--layers`` 4, width ``--width`` 128, 4 heads, context
``--context`` 128, learned positions, the output layer tied to the byte embedding (about 0.84 M parameters).

**Training**: 2 CPU processes (gloo, one thread each), ``--steps`` (320) optimizer steps of ``--batch-size`` (8)
windows of ``context + 1`` bytes per rank, cut from the training text at random offsets drawn from the seed (the same
windows for every method of a seed: equal tokens); AdamW (or 1-bit Adam) at ``--lr`` (2e-3, constant after a linear
warmup of ``--warmup`` (20) steps), betas (0.9, 0.95), weight decay 0.1. Validation: the mean cross-entropy (nats per
byte) of the first ``--val-windows`` (128) non-overlapping windows of the held-out text, split over the ranks, every
``--val-every`` (80) steps, the last at the last step, on the model every rank agrees on (for local steps: the synced
outer model; 320 is a multiple of every period run).

Runs (``--runs``), the names of ``benchmarks.freeze_sweep``:

* ``adamw``: ``strategy="ddp"``, ``torch.optim.AdamW``; bytes from ``CommunicationMonitor`` (an fp32 ring allreduce of
  the gradients at every step);
* ``ddp_bf16``, ``ddp_powersgd_rR@F``: ``adamw`` with DDP's gradient average by torch's ``bf16_compress_hook`` or its
  PowerSGD of rank ``R`` after ``F`` of 320 steps of vanilla allreduce (``benchmarks.comm_hooks.CountedDDPStrategy``,
  registered on CPU too, counted);
* ``onebit_adam@auto``: ``strategy="onebit_adam"``, ``OnebitAdam(freeze_step="auto")`` with the library's defaults;
  bytes: its warmup's and its compressed stage's counters; ``zeroone_adam``: the same strategy with
  ``ZeroOneAdam`` and its defaults; a ``+fp32`` suffix on either: ``OnebitStrategy(warmup_exchange="fp32")``;
* ``diloco_C@H`` / ``diloco_C_sgd@H``: ``OnebitDiLoCoStrategy(ranks_per_node=1, sync_every=H, compressor=C)`` (2
  replicas of one rank, inner AdamW as ``adamw``; ``_sgd``: ``outer_optimizer="sgd", outer_lr=1``, ``_sgdL``: at
  ``outer_lr=L``); bytes: the strategy's counters;
* ``torchft_diloco@H``: torchft's own ``torchft.local_sgd.DiLoCo`` (no Lightning) on the same model, data and inner
  AdamW: 2 replicas of one process each, a ``Manager`` each (synchronous quorum, gloo), its lighthouse started in the
  run's first process; outer ``torch.optim.SGD(lr=0.7, momentum=0.9, nesterov=True)``, an fp32 allreduce of every
  parameter's pseudo-gradient every ``H`` steps. torchft counts no bytes: its bytes are the ring model's for that
  allreduce, ``2 (M-1)/M x 4 N`` per sync (as ``diloco_none@H``'s counters); its validation is at the last step only
  (on the synced model). ``--torchft-path`` puts an unpacked torchft and its dependencies on the import path.

Each run records the validation loss at the last step (``val_loss``) and every validation, the tokens seen (all
ranks), whole-run bytes per rank and what DDP's fp32 allreduce would send, the bits per parameter per step, outer
syncs, the step time and the wall time; the results file (``results/NAME.json``, default ``lm_local_steps``, keyed
``lm/RUN/SEED``) is merged with what it holds and rewritten after every run.

    python -m benchmarks.lm_local_steps                                  # the default runs, seeds 0 and 1
    python -m benchmarks.lm_local_steps --runs adamw diloco_topk@32 --seeds 0 --steps 300
    python -m benchmarks.lm_local_steps --summary                        # the table only
"""

from __future__ import annotations

import argparse
import hashlib
import json
import math
import platform
import subprocess
import sys
import sysconfig
import time
from pathlib import Path
from typing import Any, Optional

from benchmarks.common import RESULTS_DIR, ROOT, argument_parser, module_command, script_env

DEFAULT_RUNS = ("adamw", "onebit_adam@auto", "diloco_none@8", "diloco_onebit@8", "diloco_topk@8", "diloco_none@32",
                "diloco_onebit@32", "diloco_topk@32")
#: every HELD_OUT_EVERY-th file of the sorted list (index HELD_OUT_EVERY - 1, ...) is validation text
HELD_OUT_EVERY = 10
SEPARATOR = b"\0"


# ---------------------------------------------------------------------------------------------------------------------
# the corpus
def stdlib_files(root: Optional[Path] = None) -> list[Path]:
    """The standard library's top-level modules, sorted by name (``root``: the standard library's directory)."""
    root = Path(sysconfig.get_paths()["stdlib"]) if root is None else Path(root)
    files = sorted(p for p in root.glob("*.py") if p.is_file())
    if len(files) < HELD_OUT_EVERY:
        raise FileNotFoundError(f"{root}: fewer than {HELD_OUT_EVERY} .py files, not a standard library")
    return files


def stdlib_corpus(root: Optional[Path] = None) -> tuple[bytes, bytes, dict[str, Any]]:
    """``(train, validation, description)``: the training and held-out text (files joined by NUL) and what they are
    made of: file counts and names, bytes, the SHA-256 of every name and content in order, the Python version."""
    files = stdlib_files(root)
    digest = hashlib.sha256()
    train, held_out = [], []
    for index, path in enumerate(files):
        data = path.read_bytes()
        digest.update(path.name.encode() + SEPARATOR + data + SEPARATOR)
        (held_out if index % HELD_OUT_EVERY == HELD_OUT_EVERY - 1 else train).append((path.name, data))
    train_text = SEPARATOR.join(data for _, data in train)
    val_text = SEPARATOR.join(data for _, data in held_out)
    description = dict(
        source=f"{files[0].parent}/*.py (the standard library's top-level modules, sorted)",
        python=platform.python_version(), files=len(files), bytes=sum(len(d) for _, d in train + held_out),
        sha256=digest.hexdigest(), train_files=len(train), train_bytes=len(train_text),
        val_files=[name for name, _ in held_out], val_bytes=len(val_text),
    )
    return train_text, val_text, description


# ---------------------------------------------------------------------------------------------------------------------
# the model and the data (imported by the runs; torch and Lightning only here)
def _lightning_parts():  # noqa: ANN202  (classes built on first use: this module imports without torch)
    import lightning as L
    import torch
    import torch.nn.functional as F
    from torch import nn
    from torch.utils.data import DataLoader, Dataset, DistributedSampler

    class Block(nn.Module):
        def __init__(self, width: int, heads: int) -> None:
            super().__init__()
            self.heads = heads
            self.ln1, self.ln2 = nn.LayerNorm(width), nn.LayerNorm(width)
            self.qkv, self.proj = nn.Linear(width, 3 * width), nn.Linear(width, width)
            self.mlp = nn.Sequential(nn.Linear(width, 4 * width), nn.GELU(), nn.Linear(4 * width, width))

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            b, t, c = x.shape
            q, k, v = self.qkv(self.ln1(x)).view(b, t, 3, self.heads, c // self.heads).permute(2, 0, 3, 1, 4)
            y = F.scaled_dot_product_attention(q, k, v, is_causal=True).transpose(1, 2).reshape(b, t, c)
            x = x + self.proj(y)
            return x + self.mlp(self.ln2(x))

    class TinyGPT(L.LightningModule):
        """A byte-level GPT (pre-LayerNorm blocks, learned positions, output tied to the embedding); the optimizer
        is ``optimizer`` (``"adamw"`` or ``"onebit_adam"``) at ``lr``, constant after ``warmup`` linear steps."""

        def __init__(self, layers: int = 4, width: int = 128, heads: int = 4, context: int = 128, lr: float = 1e-3,
                     warmup: int = 20, optimizer: str = "adamw") -> None:
            super().__init__()
            self.save_hyperparameters()
            self.embed = nn.Embedding(256, width)
            self.position = nn.Parameter(torch.zeros(context, width))
            self.blocks = nn.ModuleList(Block(width, heads) for _ in range(layers))
            self.ln = nn.LayerNorm(width)
            nn.init.normal_(self.embed.weight, std=0.02)
            nn.init.normal_(self.position, std=0.02)

        def forward(self, tokens: torch.Tensor) -> torch.Tensor:
            x = self.embed(tokens) + self.position[: tokens.shape[1]]
            for block in self.blocks:
                x = block(x)
            return self.ln(x) @ self.embed.weight.t()

        def _loss(self, batch: torch.Tensor) -> torch.Tensor:
            logits = self(batch[:, :-1])
            return F.cross_entropy(logits.reshape(-1, 256), batch[:, 1:].reshape(-1))

        def training_step(self, batch: torch.Tensor, batch_idx: int) -> torch.Tensor:
            loss = self._loss(batch)
            self.log("train_loss", loss, prog_bar=True)
            return loss

        def validation_step(self, batch: torch.Tensor, batch_idx: int) -> None:
            # equal batches on every rank: the mean over ranks of the per-rank means is the mean over all windows
            self.log("val_loss", self._loss(batch), sync_dist=True, prog_bar=True)

        def configure_optimizers(self) -> Any:
            hp = self.hparams
            if hp.optimizer == "onebit_adam":
                from lightning_onebit import OnebitAdam

                optimizer = OnebitAdam(self.parameters(), lr=hp.lr, betas=(0.9, 0.95), weight_decay=0.1,
                                       freeze_step="auto")
            elif hp.optimizer == "zeroone_adam":
                from lightning_onebit import ZeroOneAdam

                optimizer = ZeroOneAdam(self.parameters(), lr=hp.lr, betas=(0.9, 0.95), weight_decay=0.1)
            else:
                optimizer = torch.optim.AdamW(self.parameters(), lr=hp.lr, betas=(0.9, 0.95), weight_decay=0.1)
            warmup = max(1, hp.warmup)
            schedule = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda step: min(1.0, (step + 1) / warmup))
            return {"optimizer": optimizer, "lr_scheduler": {"scheduler": schedule, "interval": "step"}}

    class RandomWindows(Dataset):
        """``count`` windows of ``length`` bytes at offsets drawn from ``seed`` (the same for every method)."""

        def __init__(self, text: bytes, length: int, count: int, seed: int) -> None:
            self.data = torch.frombuffer(bytearray(text), dtype=torch.uint8)
            generator = torch.Generator().manual_seed(seed)
            self.offsets = torch.randint(0, len(text) - length, (count,), generator=generator)
            self.length = length

        def __len__(self) -> int:
            return len(self.offsets)

        def __getitem__(self, index: int) -> torch.Tensor:
            start = int(self.offsets[index])
            return self.data[start : start + self.length].long()

    class Windows(Dataset):
        """The first ``count`` non-overlapping windows of ``length`` bytes."""

        def __init__(self, text: bytes, length: int, count: int) -> None:
            if count * length > len(text):
                raise ValueError(f"{count} windows of {length} bytes need {count * length} bytes, the text has "
                                 f"{len(text)}")
            self.data = torch.frombuffer(bytearray(text[: count * length]), dtype=torch.uint8).view(count, length)

        def __len__(self) -> int:
            return self.data.shape[0]

        def __getitem__(self, index: int) -> torch.Tensor:
            return self.data[index].long()

    class StdlibData(L.LightningDataModule):
        """Rank ``r`` of ``W`` trains on windows ``r, r + W, ...`` of the seed's draw (``steps x batch_size x W``
        windows: every rank a fresh batch each step, the same ones for every method) and validates on its share of
        the held-out windows."""

        def __init__(self, train: bytes, val: bytes, context: int, batch_size: int, steps: int, val_windows: int,
                     seed: int) -> None:
            super().__init__()
            self.train_text, self.val_text = train, val
            self.context, self.batch_size, self.steps = context, batch_size, steps
            self.val_windows, self.seed = val_windows, seed

        def _sampler(self, dataset: Dataset) -> DistributedSampler:
            world, rank = self.trainer.world_size, self.trainer.global_rank
            return DistributedSampler(dataset, num_replicas=world, rank=rank, shuffle=False)

        def train_dataloader(self) -> DataLoader:
            count = self.steps * self.batch_size * self.trainer.world_size
            data = RandomWindows(self.train_text, self.context + 1, count, self.seed)
            return DataLoader(data, batch_size=self.batch_size, sampler=self._sampler(data), drop_last=True)

        def val_dataloader(self) -> DataLoader:
            data = Windows(self.val_text, self.context + 1, self.val_windows)
            return DataLoader(data, batch_size=self.batch_size, sampler=self._sampler(data))

    return TinyGPT, StdlibData


# ---------------------------------------------------------------------------------------------------------------------
# run names
def parse_lm_run(name: str) -> tuple[str, dict[str, Any]]:
    """``(kind, options)`` of a run name: ``("ddp", {})`` for ``adamw``, ``("onebit_adam", {})`` for
    ``onebit_adam@auto``, ``("onebit_diloco", {sync_every, compressor, outer_optimizer[, outer_lr]})`` for
    ``diloco_C@H`` and ``diloco_C_sgd@H``; ``ValueError`` for any other."""
    from benchmarks.freeze_sweep import ddp_exchange, diloco_outer_lr, diloco_run, diloco_streaming

    if name == "adamw":
        return "ddp", {}
    base, _, exchange = name.partition("+")
    if base in ("zeroone_adam", "onebit_adam@auto") and exchange == "fp32":  # the warmup in fp32, not the default
        return base.partition("@")[0], {"warmup_exchange": "fp32"}
    if name == "zeroone_adam":
        return "zeroone_adam", {}
    ddp = ddp_exchange(name) if name.startswith("ddp_") else None
    if ddp is not None:
        kind, rank, share = ddp
        return "ddp_hook", dict(gradient_exchange=kind, powersgd_rank=rank or 4, vanilla_share=share or 0.0)
    if name.startswith("torchft_diloco@"):
        every = name.partition("@")[2]
        if not every.isdigit() or int(every) < 1:
            raise ValueError(f"run {name!r}: torchft_diloco@H, H the inner steps between outer syncs (>= 1)")
        return "torchft", dict(sync_every=int(every))
    if name == "onebit_adam@auto":
        return "onebit_adam", {}
    diloco = diloco_run(name) if name.startswith("diloco") else None
    if diloco is None:
        raise ValueError(f"unknown LM run {name!r}: adamw, ddp_bf16, ddp_powersgd_rR@F, onebit_adam@auto, "
                         "zeroone_adam, diloco_C@H, diloco_C_sgd@H or torchft_diloco@H")
    compressor, every, outer = diloco
    options: dict[str, Any] = dict(sync_every=every, compressor=compressor, outer_optimizer=outer)
    if outer == "sgd":
        options["outer_lr"] = diloco_outer_lr(name)
    fragments, overlap = diloco_streaming(name)
    if (fragments, overlap) != (1, 0):
        options.update(fragments=fragments, overlap_steps=overlap)
    return "onebit_diloco", options


def canonical_lm_run(name: str) -> str:
    """One name per run: ``torchft_diloco@H`` with ``H`` as an integer, the others as ``freeze_sweep`` writes them."""
    from benchmarks.freeze_sweep import canonical_run

    kind, options = parse_lm_run(name)
    return f"torchft_diloco@{options['sync_every']}" if kind == "torchft" else canonical_run(name)


def order_lm_runs(names: set[str]) -> list[str]:
    """``freeze_sweep``'s order, then torchft's runs by period."""
    from benchmarks.freeze_sweep import order_runs

    torchft = {n for n in names if parse_lm_run(n)[0] == "torchft"}
    return order_runs(names - torchft) + sorted(torchft, key=lambda n: parse_lm_run(n)[1]["sync_every"])


def _strategy(kind: str, options: dict[str, Any], steps: int) -> Any:
    if kind == "ddp":
        return "ddp"
    if kind in ("onebit_adam", "zeroone_adam"):
        from lightning_onebit import OnebitStrategy

        return OnebitStrategy(**options)
    if kind == "ddp_hook":
        from benchmarks.comm_hooks import CountedDDPStrategy
        from benchmarks.freeze_sweep import powersgd_start_of

        return CountedDDPStrategy(options["gradient_exchange"], options["powersgd_rank"],
                                  powersgd_start_of(options["vanilla_share"], steps))
    from lightning_onebit import OnebitDiLoCoStrategy

    return OnebitDiLoCoStrategy(ranks_per_node=1, **options)


def counted_bytes(trainer: Any, monitor: Any) -> dict[str, Any]:
    """This rank's whole-run bytes, counted as ``examples/bert_finetune.py`` counts them: the 1-bit strategies'
    warmup and compression counters, ``onebit_diloco``'s own counters, DDP's by ``monitor``
    (``CommunicationMonitor``)."""
    from benchmarks.comm_hooks import CountedDDPStrategy
    from lightning_onebit import OnebitDiLoCoStrategy, OnebitStrategy

    strategy = trainer.strategy
    if isinstance(strategy, CountedDDPStrategy):
        return dict(bytes_sent=strategy.communication.bytes_sent)
    if isinstance(strategy, OnebitStrategy):
        warm, comp = strategy.warmup_communication, strategy.onebit_optimizer.communication
        optimizer = strategy.onebit_optimizer
        return dict(bytes_sent=warm.bytes_sent + comp.bytes_sent, bytes_sent_warmup=warm.bytes_sent,
                    freeze_step=optimizer.freeze_step, stage=optimizer.stage.value)
    if isinstance(strategy, OnebitDiLoCoStrategy):
        counters = strategy.communication
        return dict(bytes_sent=counters.bytes_sent, bytes_sent_inter_node=counters.bytes_sent_inter_node,
                    outer_syncs=strategy.outer_syncs)
    return dict(bytes_sent=monitor.communication.bytes_sent)


def _torchft_replica(replica: int, lighthouse: str, store_port: int, config: dict[str, Any]) -> Optional[dict]:
    """One replica of a ``torchft_diloco@H`` run: torchft's Manager and DiLoCo around the same model, data and inner
    AdamW as the Lightning runs; replica 0 returns the summary."""
    import datetime
    from types import SimpleNamespace

    import lightning as L
    import torch
    from torch.distributed import TCPStore
    from torchft.local_sgd import DiLoCo
    from torchft.manager import Manager
    from torchft.process_group import ProcessGroupGloo

    from lightning_onebit.comm import ring_allreduce_bytes

    torch.set_num_threads(1)
    TinyGPT, StdlibData = _lightning_parts()
    train, val, _ = stdlib_corpus(config.get("stdlib"))
    L.seed_everything(config["seed"], workers=True)  # as the Lightning runs: the same initial model on both replicas
    model = TinyGPT(layers=config["layers"], width=config["width"], heads=config["heads"], context=config["context"])
    data = StdlibData(train, val, config["context"], config["batch_size"], config["steps"], config["val_windows"],
                      config["seed"])
    data.trainer = SimpleNamespace(world_size=2, global_rank=replica)
    inner = torch.optim.AdamW(model.parameters(), lr=config["lr"], betas=(0.9, 0.95), weight_decay=0.1)
    warmup = max(1, config["warmup"])
    schedule = torch.optim.lr_scheduler.LambdaLR(inner, lambda step: min(1.0, (step + 1) / warmup))
    outer = torch.optim.SGD(model.parameters(), lr=0.7, momentum=0.9, nesterov=True)
    store = TCPStore("localhost", store_port, is_master=True, wait_for_workers=False)  # this replica's own
    timeout = datetime.timedelta(seconds=120)
    manager = Manager(pg=ProcessGroupGloo(timeout=timeout), min_replica_size=2, use_async_quorum=False,
                      load_state_dict=lambda state: model.load_state_dict(state["model"]),
                      state_dict=lambda: {"model": model.state_dict()}, replica_id=f"replica_{replica}",
                      store_addr="localhost", store_port=store.port, rank=0, world_size=1, lighthouse_addr=lighthouse,
                      timeout=timeout, quorum_timeout=timeout, connect_timeout=timeout)
    every = parse_lm_run(config["run"])[1]["sync_every"]
    step_times = []
    started = time.perf_counter()
    try:
        with DiLoCo(manager, [model], inner, outer, sync_every=every) as diloco:
            for batch in data.train_dataloader():
                t0 = time.perf_counter()
                inner.zero_grad()
                loss = model._loss(batch)
                loss.backward()
                inner.step()  # DiLoCo's hook: the outer step every `every` steps
                schedule.step()
                step_times.append(time.perf_counter() - t0)
            left = diloco._local_step  # steps since the last sync (0: the run ends on a sync)
        syncs = manager.current_step()  # the outer steps the manager committed
        wall = time.perf_counter() - started
        data.trainer = SimpleNamespace(world_size=1, global_rank=0)  # every held-out window, on the synced model
        with torch.no_grad():
            val_loss = float(torch.stack([model._loss(b) for b in data.val_dataloader()]).mean())
    finally:
        manager.shutdown(wait=False)
    if replica:
        return None
    steps = len(step_times)
    if left:
        raise RuntimeError(f"torchft run ended {left} steps after its last sync: pass --steps a multiple of {every}")
    parameters = sum(p.numel() for p in model.parameters() if p.requires_grad)
    times = step_times[2:] or step_times
    return dict(run=config["run"], seed=config["seed"], strategy="torchft.local_sgd.DiLoCo", steps=steps,
                tokens=steps * 2 * config["batch_size"] * config["context"], val_loss=round(val_loss, 6),
                validations=[dict(step=steps, val_loss=round(val_loss, 6))],
                trainable_parameters=parameters, outer_syncs=syncs,
                bytes_sent=syncs * ring_allreduce_bytes(parameters, 4, 2),
                bytes_counted_by="ring model, fp32 allreduce of every parameter per sync (torchft counts none)",
                bytes_fp32_equivalent=steps * ring_allreduce_bytes(parameters, 4, 2),
                step_s=round(sum(times) / len(times), 4), wall_s=round(wall, 1))


def _torchft_worker(replica: int, lighthouse: str, config: dict[str, Any], out: str) -> None:
    import socket

    with socket.socket() as s:
        s.bind(("localhost", 0))
        port = s.getsockname()[1]
    result = _torchft_replica(replica, lighthouse, port, config)
    Path(f"{out}.replica{replica}").write_text(json.dumps(result))


def torchft_run(config: dict[str, Any]) -> None:
    """A ``torchft_diloco@H`` run: the lighthouse in this process, a process per replica; replica 0's summary (its
    validation on every held-out window of the synced model) to ``config["out"]``."""
    import multiprocessing

    from torchft._torchft import LighthouseServer

    lighthouse = LighthouseServer(bind="[::]:0", min_replicas=2)
    context = multiprocessing.get_context("spawn")
    workers = [context.Process(target=_torchft_worker, args=(r, lighthouse.address(), config, config["out"]))
               for r in range(2)]
    for w in workers:
        w.start()
    for w in workers:
        w.join()
    lighthouse.shutdown()
    if any(w.exitcode for w in workers):
        raise RuntimeError(f"torchft run: replica exit codes {[w.exitcode for w in workers]}")
    Path(config["out"]).write_text(Path(f"{config['out']}.replica0").read_text())


def one_run(config: dict[str, Any]) -> None:
    """One run on this process's rank (the Trainer starts the other rank as a copy of this command); rank 0 writes
    the summary to ``config["out"]``."""
    import lightning as L
    import torch

    import lightning_onebit  # noqa: F401  (registers the strategies)
    from lightning_onebit import CommunicationMonitor
    from lightning_onebit.comm import ring_allreduce_bytes

    torch.set_num_threads(1)
    TinyGPT, StdlibData = _lightning_parts()
    kind, options = parse_lm_run(config["run"])
    train, val, _ = stdlib_corpus(config.get("stdlib"))
    L.seed_everything(config["seed"], workers=True)
    model = TinyGPT(layers=config["layers"], width=config["width"], heads=config["heads"], context=config["context"],
                    lr=config["lr"], warmup=config["warmup"],
                    optimizer=kind if kind in ("onebit_adam", "zeroone_adam") else "adamw")
    data = StdlibData(train, val, config["context"], config["batch_size"], config["steps"], config["val_windows"],
                      config["seed"])
    monitor = CommunicationMonitor(prog_bar=False, advise=False)
    validations: list[dict[str, Any]] = []
    step_times: list[float] = []

    class Record(L.Callback):
        def on_train_batch_start(self, trainer, pl_module, batch, batch_idx) -> None:  # noqa: ANN001
            self.started = time.perf_counter()

        def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:  # noqa: ANN001
            step_times.append(time.perf_counter() - self.started)

        def on_validation_end(self, trainer, pl_module) -> None:  # noqa: ANN001
            if not trainer.sanity_checking:
                validations.append(dict(step=trainer.global_step,
                                        val_loss=round(float(trainer.callback_metrics["val_loss"]), 6)))

    trainer = L.Trainer(accelerator="cpu", devices=2, strategy=_strategy(kind, options, config["steps"]),
                        max_steps=config["steps"],
                        val_check_interval=config["val_every"], check_val_every_n_epoch=None,
                        callbacks=[monitor, Record()], use_distributed_sampler=False, logger=False,
                        enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False,
                        num_sanity_val_steps=0, deterministic=True)
    started = time.perf_counter()
    trainer.fit(model, data)
    wall = time.perf_counter() - started
    bytes_ = counted_bytes(trainer, monitor)
    if trainer.global_rank == 0:
        parameters = sum(p.numel() for p in model.parameters() if p.requires_grad)
        steps = trainer.global_step
        times = step_times[2:] or step_times
        summary = dict(
            run=config["run"], seed=config["seed"], strategy=type(trainer.strategy).__name__, steps=steps,
            tokens=steps * trainer.world_size * config["batch_size"] * config["context"],
            val_loss=validations[-1]["val_loss"], validations=validations, trainable_parameters=parameters,
            bytes_fp32_equivalent=steps * ring_allreduce_bytes(parameters, 4, trainer.world_size),
            step_s=round(sum(times) / len(times), 4), wall_s=round(wall, 1), **bytes_,
        )
        Path(config["out"]).write_text(json.dumps(summary))
    if torch.distributed.is_available() and torch.distributed.is_initialized():
        torch.distributed.destroy_process_group()


# ---------------------------------------------------------------------------------------------------------------------
# the sweep
def settings_of(args: argparse.Namespace) -> dict[str, Any]:
    """What makes two runs of the same name and seed comparable."""
    return dict(steps=args.steps, batch_size=args.batch_size, context=args.context, layers=args.layers,
                width=args.width, heads=args.heads, lr=args.lr, warmup=args.warmup, val_windows=args.val_windows,
                val_every=args.val_every)


def run_one(name: str, seed: int, settings: dict[str, Any], workdir: Path, stdlib: Optional[str] = None,
            torchft_path: tuple[str, ...] = ()) -> dict:
    """Run ``name`` for ``seed`` in a fresh pair of processes; its record (the summary with the settings, the bits
    per parameter per step and the library's commit)."""
    from benchmarks.freeze_sweep import bits_per_parameter_step, check_outer_syncs, library_version

    rundir = workdir / f"lm_{name}_s{seed}"
    rundir.mkdir(parents=True, exist_ok=True)
    out = rundir / "summary.json"
    out.unlink(missing_ok=True)
    config = dict(settings, run=name, seed=seed, out=str(out), stdlib=stdlib, torchft_path=list(torchft_path))
    log = rundir / "run.log"
    with open(log, "w") as f:
        subprocess.run(module_command(__spec__.name if __spec__ else "benchmarks.lm_local_steps", "--one-run",
                                      json.dumps(config)),
                       cwd=ROOT, env=script_env(), stdout=f, stderr=subprocess.STDOUT, check=True)
    summary = json.loads(out.read_text())
    if summary["steps"] != settings["steps"]:
        raise RuntimeError(f"lm {name} seed {seed}: {summary['steps']} steps, expected {settings['steps']} ({log})")
    record = dict(summary, task="lm", settings=settings, library=library_version(), log_file=str(log),
                  bits_per_parameter_step=bits_per_parameter_step(summary["bytes_sent"],
                                                                  summary["trainable_parameters"], summary["steps"]))
    check_outer_syncs(name, record)
    return record


def sweep(args: argparse.Namespace) -> dict[str, Any]:
    path = RESULTS_DIR / f"{args.name}.json"
    results = json.loads(path.read_text()) if path.exists() else {}
    _, _, corpus = stdlib_corpus(args.stdlib)
    if results.get("corpus") not in (None, corpus):
        raise SystemExit(f"{path} holds runs on another corpus ({results['corpus']['sha256']}, Python "
                         f"{results['corpus']['python']}); pass another --name")
    results["corpus"] = corpus
    runs = results.setdefault("runs", {})
    settings = settings_of(args)
    workdir = Path(args.workdir)
    for seed in args.seeds:
        for name in dict.fromkeys(canonical_lm_run(n) for n in args.runs):
            key = f"lm/{name}/{seed}"
            if args.skip_done and runs.get(key, {}).get("settings") == settings:
                print(f"skip {key}: done", flush=True)
                continue
            print(f"=== {key}", flush=True)
            record = run_one(name, seed, settings, workdir, args.stdlib, tuple(args.torchft_path))
            runs[key] = record
            print(f"=== {key}: val_loss {record['val_loss']:.4f}, bytes {record['bytes_sent']:,}, "
                  f"{record['bits_per_parameter_step']:.4g} bits/param/step, {record['wall_s']} s", flush=True)
            RESULTS_DIR.mkdir(exist_ok=True)
            path.write_text(json.dumps(results, indent=2))
    return results


# ---------------------------------------------------------------------------------------------------------------------
# the table
def table_rows(results: dict[str, Any]) -> list[dict[str, Any]]:
    """Per run: validation loss per seed, its relative difference to the same-seed ``adamw`` run (percent), whole-run
    bytes per rank (mean over seeds), the same-length AdamW-DDP runs' bytes over them, bits per parameter per step."""
    runs = {(r["run"], int(r["seed"])): r for r in results.get("runs", {}).values()}
    seeds = sorted({s for _, s in runs})
    rows = []
    for name in order_lm_runs({n for n, _ in runs} | {"adamw"}):
        got = {s: runs.get((name, s)) for s in seeds}
        present = [r for r in got.values() if r is not None]
        ddp = [r["bytes_sent"] for (n, _), r in runs.items() if n == "adamw"
               and present and r["settings"]["steps"] == present[0]["settings"]["steps"]]
        diff = {}
        for s, r in got.items():
            base = runs.get(("adamw", s))
            diff[s] = None if r is None or base is None else 100 * (r["val_loss"] / base["val_loss"] - 1)
        mean = lambda values: sum(values) / len(values) if values else None  # noqa: E731
        rows.append(dict(
            run=name, loss={s: None if r is None else r["val_loss"] for s, r in got.items()},
            diff=None if name == "adamw" else diff,
            bytes_sent=mean([r["bytes_sent"] for r in present]),
            bytes_ratio=mean([mean(ddp) / r["bytes_sent"] for r in present]) if ddp else None,
            bits_per_parameter_step=mean([r["bits_per_parameter_step"] for r in present]),
            step_s=mean([r["step_s"] for r in present]),
        ))
    return rows


def format_table(results: dict[str, Any]) -> str:
    rows = table_rows(results)
    if not any(r["bytes_sent"] is not None for r in rows):
        return "(no runs)"
    seeds = list(rows[0]["loss"])
    cell = lambda x, f: "-" if x is None else format(x, f)  # noqa: E731
    lines = [f"{'run':20s}" + "".join(f"{'loss s' + str(s):>10s}" for s in seeds)
             + "".join(f"{'d% s' + str(s):>9s}" for s in seeds) + f"{'MB sent':>10s}{'DDP/x':>9s}{'bits/p/step':>12s}"]
    for r in rows:
        lines.append(f"{r['run']:20s}" + "".join(f"{cell(r['loss'][s], '.4f'):>10s}" for s in seeds)
                     + "".join(f"{'' if r['diff'] is None else cell(r['diff'][s], '+.2f'):>9s}" for s in seeds)
                     + f"{cell(None if r['bytes_sent'] is None else r['bytes_sent'] / 1e6, '.3f'):>10s}"
                     + f"{cell(r['bytes_ratio'], '.1f'):>9s}{cell(r['bits_per_parameter_step'], '.3g'):>12s}")
    corpus = results.get("corpus", {})
    lines.append(f"\nval loss: nats per byte on the held-out files; d%: relative to the same-seed AdamW-DDP run; "
                 f"corpus: {corpus.get('files')} files, {corpus.get('bytes')} bytes, sha256 {corpus.get('sha256')}")
    return "\n".join(lines)


def main() -> None:
    parser = argument_parser(__spec__.name, __doc__)
    parser.add_argument("--runs", nargs="+", default=list(DEFAULT_RUNS))
    parser.add_argument("--seeds", type=int, nargs="+", default=[0, 1])
    parser.add_argument("--steps", type=int, default=320, help="optimizer steps per run")
    parser.add_argument("--batch-size", type=int, default=8, help="windows per rank per step")
    parser.add_argument("--context", type=int, default=128, help="bytes of context")
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--width", type=int, default=128)
    parser.add_argument("--heads", type=int, default=4)
    parser.add_argument("--lr", type=float, default=2e-3)
    parser.add_argument("--warmup", type=int, default=20, help="linear lr warmup steps")
    parser.add_argument("--val-windows", type=int, default=128, help="held-out windows per validation")
    parser.add_argument("--val-every", type=int, default=80, help="validation every this many steps")
    parser.add_argument("--stdlib", default=None, help="the standard library's directory (default: this Python's)")
    parser.add_argument("--workdir", default=str(RESULTS_DIR / "tmp" / "lm_local_steps"))
    parser.add_argument("--name", default="lm_local_steps", help="results/NAME.json")
    parser.add_argument("--skip-done", action="store_true", help="skip runs the file holds with the same settings")
    parser.add_argument("--summary", action="store_true", help="only print the table")
    parser.add_argument("--torchft-path", nargs="+", default=[],
                        help="directories with torchft and its dependencies, put first on the import path")
    parser.add_argument("--one-run", default=None, help=argparse.SUPPRESS)  # a run's own processes
    args = parser.parse_args()
    if args.torchft_path:
        sys.path[:0] = args.torchft_path
    if args.steps % args.val_every:
        parser.error(f"--val-every ({args.val_every}) must divide --steps ({args.steps}): the last validation is at "
                     "the last step")
    if args.one_run is not None:
        config = json.loads(args.one_run)
        sys.path[:0] = config.get("torchft_path") or []
        (torchft_run if config["run"].startswith("torchft") else one_run)(config)
        return
    if not args.summary:
        sweep(args)
    print(format_table(json.loads((RESULTS_DIR / f"{args.name}.json").read_text())))


if __name__ == "__main__":
    main()
