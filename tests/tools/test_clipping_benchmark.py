"""benchmarks/clipping.py's offline parts: the word corpus and its blocks, the sketch rule against the exact norm of a
mean, and the tables of the docs on made-up runs."""

from __future__ import annotations

import math
import re

import pytest
import torch

from benchmarks import clipping


def test_the_corpus_is_words_of_the_standard_library_cut_into_overlapping_blocks() -> None:
    data, vocab = clipping.corpus()
    assert vocab == clipping.VOCAB and len(data) == clipping.CORPUS_WORDS
    assert int(data.min()) == 0 and int(data.max()) == vocab - 1  # <unk> and the rarest word kept are both there
    train, held_out = clipping.blocks(data)
    assert train.shape[1] == held_out.shape[1] == clipping.BLOCK + 1
    assert len(held_out) == len(train) // (clipping.HELD_OUT_EVERY - 1)
    assert torch.equal(train[0, -1], train[1, 0])  # the target of one block's last input is the next block's first


def test_the_sketch_rule_estimates_the_norm_of_the_mean_of_the_ranks_gradients() -> None:
    """One rank's view of a 2-rank sketch: the mean of two ranks' sketches with the same seed is the sketch of the
    mean, whose norm is within the sketch's error of the mean's."""
    generator = torch.Generator().manual_seed(0)
    ranks = [[torch.randn(400, 30, generator=generator) + 0.5, torch.randn(70, generator=generator)] for _ in range(2)]
    mean = [(a + b) / 2 for a, b in zip(*ranks)]
    exact = math.sqrt(sum(float(m.double().square().sum()) for m in mean))
    estimates = []
    for step in range(40):
        sums = [clipping_sums(grads, step) for grads in ranks]
        estimates.append(float(((sums[0] + sums[1]) / 2).norm()) / exact)
    assert sum(estimates) / len(estimates) == pytest.approx(1.0, abs=0.03)
    assert all(0.8 < e < 1.2 for e in estimates)


def clipping_sums(grads: list[torch.Tensor], step: int) -> torch.Tensor:
    """``sketch_norm``'s sums on one rank (its all-reduce replaced by returning them)."""
    import torch.distributed as dist

    saved = dist.all_reduce, dist.get_world_size
    captured: list[torch.Tensor] = []
    dist.all_reduce, dist.get_world_size = (lambda t, *a, **k: captured.append(t.clone())), (lambda *a, **k: 1)
    try:
        clipping.sketch_norm(grads, step)
    finally:
        dist.all_reduce, dist.get_world_size = saved
    return captured[0]


def _run(final: float, rho: float = 0.8, sketch: float = 1.0) -> dict:
    norms = [dict(local=[2.0, 2.2], rms=2.1, mean=2.1 * rho, clip=2.1 * rho * sketch) for _ in range(clipping.STEPS)]
    return dict(final_loss=final, held_out=final - 0.5, norms=norms)


def test_the_tables_show_every_seed_the_mean_and_the_gap_to_adamw() -> None:
    results = {"seeds": {str(s): {run: _run(3.0 + 0.1 * i + 0.01 * s) for i, run in enumerate(clipping.RUNS)}
                         for s in (0, 1, 2)}}
    results["seeds"]["1"]["onebit_sketch"] = _run(3.5, rho=0.75, sketch=0.9)
    lines = clipping.table(results).splitlines()
    assert lines[0].startswith("| run | clipped by, compression stage | seed 0 | seed 1 | seed 2 | mean | vs AdamW |")
    assert len(lines) == 2 + len(clipping.RUNS)
    adamw = next(line for line in lines if line.startswith("| adamw |"))
    assert "| 3.000 | 3.010 | 3.020 | 3.010 | +0.000 | 2.510 |" in adamw
    assert all(len(re.findall(r"(?<!\\)\|", line)) == 9 for line in lines)  # the pipes of ||g|| are escaped
    norms = clipping.norms_table(results).splitlines()
    assert norms[2] == "| 0 | 0.800 (0.800) | 1.000 (1.000, 1.000) |"
    assert norms[3] == "| 1 | 0.750 (0.750) | 0.900 (0.900, 0.900) |"
