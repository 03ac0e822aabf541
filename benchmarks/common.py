"""Shared helpers of the benchmarks: paths, the argument parser, the in-process multi-rank launcher, the example
module, BERT-like parameter shapes and the results files.

Every benchmark runs from the repository root as ``python -m benchmarks.NAME`` (``lightning_onebit`` installed, e.g.
``pip install -e .``); a benchmark that starts copies of itself starts them the same way, with the repository root as
working directory (:func:`module_command`). torch is imported where it is needed, so that the light benchmarks
(``result_tables``, ``freeze_rules``) import this module cheaply.
"""

from __future__ import annotations

import argparse
import datetime
import importlib.util
import json
import os
import socket
import sys
import tempfile
from pathlib import Path
from types import ModuleType
from typing import Any, Callable

ROOT = Path(__file__).resolve().parent.parent
RESULTS_DIR = ROOT / "results"
EXAMPLE = ROOT / "examples" / "bert_finetune.py"
EXAMPLE_CONFIGS = ROOT / "examples" / "configs"


def argument_parser(module: str, doc: str | None, **kwargs: Any) -> argparse.ArgumentParser:
    """The parser of benchmark ``module`` (its ``__spec__.name``, e.g. ``benchmarks.slow_link``): usage lines read
    ``python -m benchmarks.NAME``, the module docstring is the description, verbatim."""
    return argparse.ArgumentParser(prog=f"python -m {module}", description=doc,
                                   formatter_class=argparse.RawDescriptionHelpFormatter, **kwargs)


def module_command(module: str, *args: str) -> list[str]:
    """``python -m MODULE ARGS...`` with this interpreter; run it with ``cwd=ROOT`` so that ``benchmarks`` imports."""
    return [sys.executable, "-m", module, *args]


def load_example() -> ModuleType:
    """``examples/bert_finetune.py`` (a script, not a package) as a module, loaded from its file (no import path
    changed)."""
    spec = importlib.util.spec_from_file_location("bert_finetune", EXAMPLE)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def script_env(**changes: str) -> dict[str, str]:
    """The environment for a script this package starts (the example, a worker): this process's, with the repository
    root first on ``PYTHONPATH``, so that the script imports this checkout's library (not another copy pip installed)
    and the benchmarks' callbacks, plus ``changes``."""
    path = os.pathsep.join([str(ROOT), *filter(None, [os.environ.get("PYTHONPATH")])])
    return dict(os.environ, PYTHONPATH=path, **changes)


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _entry(rank: int, world_size: int, port: int, fn: Callable, args: tuple, out_dir: str, threads: int) -> None:
    import torch
    import torch.distributed as dist

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.set_num_threads(threads)
    dist.init_process_group("gloo", rank=rank, world_size=world_size, timeout=datetime.timedelta(seconds=600))
    try:
        result = fn(rank, world_size, *args)
    finally:
        dist.destroy_process_group()
    torch.save(result, os.path.join(out_dir, f"{rank}.pt"))


def launch(fn: Callable[..., Any], world_size: int, *args: Any, threads: int = 1) -> list[Any]:
    """Run ``fn(rank, world_size, *args)`` on ``world_size`` gloo processes on this machine; results by rank.

    The one launcher of in-process multi-rank runs (spawned processes, a free loopback port, one process group per
    run). ``fn`` must be importable by the spawned processes: a module-level function of a ``benchmarks`` module."""
    import torch
    import torch.multiprocessing as mp

    with tempfile.TemporaryDirectory() as out_dir:
        mp.start_processes(
            _entry, args=(world_size, _free_port(), fn, args, out_dir, threads), nprocs=world_size, start_method="spawn"
        )
        return [torch.load(os.path.join(out_dir, f"{r}.pt"), weights_only=False) for r in range(world_size)]


def bert_like_shapes(n_params: float) -> list[tuple[int, ...]]:
    """Parameter shapes of a BERT-like encoder (embeddings, per-layer attention/FFN/LayerNorm), ~``n_params`` total."""
    import math

    hidden, vocab = (256 if n_params < 15e6 else 384 if n_params < 50e6 else 768), 30522
    shapes: list[tuple[int, ...]] = [(vocab, hidden), (512, hidden), (2, hidden), (hidden,), (hidden,)]
    layer = [(hidden, hidden), (hidden,)] * 4 + [(hidden,), (hidden,)] + [(4 * hidden, hidden), (4 * hidden,)]
    layer += [(hidden, 4 * hidden), (hidden,), (hidden,), (hidden,)]
    total = lambda s: sum(math.prod(x) for x in s)  # noqa: E731
    while total(shapes) + total(layer) <= n_params:
        shapes += layer
    if total(shapes) < n_params:
        shapes.append((int(n_params) - total(shapes),))
    return shapes


def momentum_buckets(n_params: float, bucket_bytes: int = 25 * 2**20) -> list[list[int]]:
    """The tensor sizes of each fp32 momentum bucket of ``bert_like_shapes(n_params)``, cut as OnebitAdam cuts them
    (in parameter order, up to ``bucket_bytes``, default 25 MB)."""
    import math

    buckets: list[list[int]] = [[]]
    size = 0
    for n in (math.prod(s) for s in bert_like_shapes(n_params)):
        if buckets[-1] and size + 4 * n > bucket_bytes:
            buckets.append([])
            size = 0
        buckets[-1].append(n)
        size += 4 * n
    return buckets


def write_results(name: str, payload: dict[str, Any]) -> Path:
    RESULTS_DIR.mkdir(exist_ok=True)
    path = RESULTS_DIR / f"{name}.json"
    path.write_text(json.dumps(payload, indent=2))
    return path


def previous_results(name: str, rerun: list[str], all_runs: list[str]) -> dict[str, Any]:
    """results/NAME.json as a benchmark with ``--runs`` left it, when only some of ``all_runs`` are rerun (the
    others keep their figures); ``{}`` when every run is made afresh or there is no file."""
    path = RESULTS_DIR / f"{name}.json"
    return json.loads(path.read_text()) if path.exists() and set(rerun) != set(all_runs) else {}


def merge_runs(previous: dict[str, Any], fresh: dict[str, Any], all_runs: list[str]) -> dict[str, Any]:
    """The fresh runs, and the previous file's for the others, in ``all_runs`` order."""
    runs = {name: fresh.get(name, previous.get("runs", {}).get(name)) for name in all_runs}
    return {name: run for name, run in runs.items() if run is not None}
