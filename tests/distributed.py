"""Run a function on several CPU processes joined by a gloo process group (the project's multi-rank test bed)."""

from __future__ import annotations

import datetime
import faulthandler
import multiprocessing
import os
import socket
import sys
import tempfile
import time
import traceback
from typing import Any, Callable

import torch
import torch.distributed as dist
import torch.multiprocessing as mp


def free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


# Ranks start from a fork server that has imported these once (torch, Lightning and the library take seconds to
# import, and every test spawns its ranks afresh): a rank then starts in about 0.1 s instead of about 4 s on 2 cores.
# The server is started by the first run; it only imports (no process group, no CUDA).
_PRELOAD = ["torch", "torch.distributed", "lightning.pytorch", "lightning_onebit", "tests.distributed"]
_START_METHOD = "forkserver"


def _start_method() -> str:
    multiprocessing.set_forkserver_preload(_PRELOAD)
    return _START_METHOD


def _entry(rank: int, world_size: int, port: int, fn: Callable, args: tuple, result_dir: str, timeout_s: float,
           parent: tuple[dict[str, str], str, list[str]]) -> None:
    """One rank: join the gloo group, run ``fn``, tear down as users are told to (``OverlapState``'s docstring):
    ``fn`` returns, which frees what it made (DDP, optimizers, hook states: no reference cycles hold them), then
    ``dist.destroy_process_group()`` destroys every group, so that no gloo group is left to be freed during
    interpreter finalization. No ``gc.collect()``: a rank that aborts at exit fails the run (``run_distributed``
    checks every exit code). A Lightning run inside ``fn`` needs nothing more: the strategy releases its groups
    at exit."""
    # a rank that dies of a signal (SIGABRT at exit, SIGSEGV) prints every thread's Python stack: where it was
    faulthandler.enable(all_threads=True)
    # what a spawned process would inherit from the test at this moment (the fork server's are those of its start):
    # the environment (monkeypatch.setenv), the working directory (monkeypatch.chdir) and the import path
    environ, cwd, path = parent
    os.environ.clear()
    os.environ.update(environ)
    os.chdir(cwd)
    sys.path[:] = path
    os.environ["MASTER_ADDR"] = "127.0.0.1"
    os.environ["MASTER_PORT"] = str(port)
    # With these set, Lightning treats the processes as externally launched (as under torchrun), so a Trainer with
    # devices=world_size can run inside `fn` on every rank.
    os.environ.update(LOCAL_RANK=str(rank), RANK=str(rank), WORLD_SIZE=str(world_size), NODE_RANK="0")
    torch.set_num_threads(1)
    dist.init_process_group(
        "gloo", rank=rank, world_size=world_size, timeout=datetime.timedelta(seconds=timeout_s)
    )
    try:
        result = fn(rank, world_size, *args)
    finally:
        if dist.is_initialized():  # a scenario may have run the strategy's exit handler, which destroys WORLD
            dist.destroy_process_group()
    torch.save(result, os.path.join(result_dir, f"{rank}.pt"))


def run_distributed(fn: Callable[..., Any], world_size: int, *args: Any, timeout_s: float = 120.0) -> list[Any]:
    """Call ``fn(rank, world_size, *args)`` on ``world_size`` new processes; return the results by rank.

    ``fn`` must be a module-level function. A rank that raises fails the call with its traceback, and so does a rank
    that exits with a non-zero code or a signal after ``fn`` succeeded (e.g. SIGABRT at interpreter exit); a run that
    takes longer than ``timeout_s`` (e.g. a collective that hangs) is killed and raises ``TimeoutError``.
    """
    with tempfile.TemporaryDirectory() as result_dir:
        context = mp.start_processes(
            _entry,
            args=(world_size, free_port(), fn, args, result_dir, timeout_s,
                  (dict(os.environ), os.getcwd(), list(sys.path))),
            nprocs=world_size,
            join=False,
            start_method=_start_method(),
        )
        deadline = time.monotonic() + timeout_s
        while not context.join(timeout=1.0):
            if time.monotonic() > deadline:
                for process in context.processes:
                    if process.is_alive():
                        process.kill()
                raise TimeoutError(f"distributed run of {fn.__name__} exceeded {timeout_s} s (a hang?)")
        return [torch.load(os.path.join(result_dir, f"{r}.pt"), weights_only=False) for r in range(world_size)]


Scenario = Callable[[int, int, str], dict]


def run_scenarios(rank: int, world_size: int, scenarios: tuple[tuple[str, Scenario], ...], workdir: str) -> dict:
    """Run named scenarios one after another in the same ranks (one process start-up for all of them).

    A scenario that raises is recorded as ``{"__error__": traceback}`` and the next one runs, so each test can report
    its own scenario's failure (see :func:`scenario_results`).
    """
    results: dict = {}
    for name, scenario in scenarios:
        try:
            results[name] = scenario(rank, world_size, workdir)
        except Exception:  # noqa: BLE001 - reported by the test that owns the scenario
            results[name] = {"__error__": traceback.format_exc()}
    return results


def run_sessions(scenarios_by_world_size: dict[int, tuple[tuple[str, Scenario], ...]], tmp_path_factory: Any,
                 name: str, timeout_s: float = 300.0) -> dict[int, list[dict]]:
    """One :func:`run_scenarios` session per world size (``{world_size: scenarios}``), each in a fresh temporary
    folder ``name<world_size>``: the per-rank results by world size."""
    return {world_size: run_distributed(run_scenarios, world_size, scenarios,
                                        str(tmp_path_factory.mktemp(f"{name}{world_size}")), timeout_s=timeout_s)
            for world_size, scenarios in scenarios_by_world_size.items()}


def scenario_results(session: list[dict], name: str) -> list[dict]:
    """Per-rank results of scenario ``name`` from a :func:`run_scenarios` session; fails the test on a rank's error."""
    import pytest

    results = [ranks[name] for ranks in session]
    for rank, result in enumerate(results):
        if "__error__" in result:
            pytest.fail(f"scenario {name!r} failed on rank {rank}:\n{result['__error__']}")
    return results


def wait_until_group_released(group: Any, references: int, timeout_s: float = 30.0) -> None:
    """Wait until ``group`` has no more than ``references`` references (e.g. until no callback of torch's PowerSGD hook
    holds it any more). Its callbacks keep the group (they
    launch the P and Q all-reduces) and gloo frees them on its worker thread just after it has completed the bucket's
    future, so the training loop can be done while one is still held; the group destroyed at the end of the rank
    would then be freed last on that worker thread, which gloo cannot join from itself (the process aborts with
    "Resource deadlock avoided")."""
    deadline = time.monotonic() + timeout_s
    while sys.getrefcount(group) > references + 1:  # + 1: this function's argument
        if time.monotonic() > deadline:
            raise TimeoutError(f"torch's PowerSGD callbacks still hold the process group after {timeout_s} s")
        time.sleep(0.001)
