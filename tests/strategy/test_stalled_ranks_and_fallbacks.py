"""Issue 25, topology and stall cases: a stalled rank (SIGSTOP) in the compression stage must make every surviving
rank fail within the strategy's timeout, with an error naming the process group, in flat and hierarchical modes, with
and without overlap, and under ``onebit_fsdp`` (whose device mesh's groups wait the strategy's timeout too);
``topology="auto"`` with a ``ranks_per_node`` that does not divide the world size falls back to
flat and says why; the same stall under both local-steps strategies (``onebit_diloco`` and ``onebit_diloco_fsdp``);
and the smaller items of the same run (the ``freeze_step="auto"`` warning, the advisor with
ZeroOneAdam, ``CommunicationMonitor``'s argument checks).

The stall cases (4 CPU gloo ranks as 2 nodes x 2, ``ranks_per_node=2``) each need a fresh set of ranks (a stalled
peer leaves its process groups unusable). Rank 3 stops itself with SIGSTOP at the start of optimizer step
``STALL_STEP``; the other ranks catch their ``fit`` error and write a report. The test (in the pytest process) SIGKILLs
the stopped rank once every survivor reported, or ``KILL_AFTER_S`` after it stopped, whichever comes first, and again
when the test ends: nothing is left behind. Its kill makes the launcher see a rank that died by a signal, so the
reports are read from files rather than from ``run_distributed``'s return value. ``KILL_AFTER_S`` is well beyond the
bound the test asserts (``STALL_TIMEOUT_S + MARGIN_S``): a survivor that only failed because the stopped rank was
killed (before the fix: the topology's groups waited torch's default 30 minutes) fails the test.

Each rank re-creates WORLD with the strategy's timeout, as a real launch does (Lightning creates WORLD with
``OnebitStrategy(timeout=...)``; ``tests/distributed.py`` creates it first, with the launcher's own timeout).
"""

from __future__ import annotations

import datetime
import json
import os
import signal
import threading
import time
from typing import Any, Optional

import pytest
import torch
import torch.distributed as dist

import lightning.pytorch as pl
import lightning_onebit  # noqa: F401  (registers the strategies)
from lightning_onebit import CommunicationMonitor, OnebitDiLoCoFSDPStrategy, OnebitDiLoCoStrategy, OnebitFSDPStrategy
from lightning_onebit import OnebitStrategy, Topology, ZeroOneAdam
from lightning_onebit.optim import AutoFreeze, OnebitAdam
from tests.capture import capture_logs, capture_warnings
from tests.distributed import free_port, run_distributed, run_scenarios, scenario_results
from tests.lightning_models import Regressor, loader, trainer_kwargs
from tests.llama_models import LlamaLM

# ======================================================================================== a stalled rank
WORLD_SIZE, PER_NODE = 4, 2
STALLED_RANK = 3
STALL_TIMEOUT_S = 5.0  # OnebitStrategy(timeout=...)
MARGIN_S = 15.0  # a survivor's error must come within STALL_TIMEOUT_S + MARGIN_S of the stalled step's start
KILL_AFTER_S = 40.0  # the test kills the stopped rank this long after it stopped, if a survivor has not reported
FREEZE, STALL_STEP, MAX_STEPS = 2, 4, 8  # step 3 is the first compressed step, step 4 the first overlapped one
LAUNCH_LIMIT_S = 240.0  # start-up of 4 ranks with Lightning on a busy 2-core machine, the warmup, the kill


def _report_path(workdir: str, rank: int) -> str:
    return os.path.join(workdir, f"report_{rank}.json")


def _stalled_path(workdir: str) -> str:
    return os.path.join(workdir, "stalled.json")


def _write_json(path: str, data: dict[str, Any]) -> None:
    """Written whole or not at all (the test polls for the file)."""
    with open(path + ".tmp", "w") as f:
        json.dump(data, f)
    os.replace(path + ".tmp", path)


class StallOneRank(pl.Callback):
    """At the start of optimizer step ``STALL_STEP``: every rank notes the time; rank ``STALLED_RANK`` records its
    pid and stops itself (SIGSTOP), as a rank swapped out, stuck in I/O or in a debugger would."""

    def __init__(self, workdir: str) -> None:
        self.workdir = workdir
        self.started: Optional[float] = None

    def on_train_batch_start(
        self, trainer: pl.Trainer, pl_module: pl.LightningModule, batch: Any, batch_idx: int
    ) -> None:
        if trainer.global_step + 1 != STALL_STEP:
            return
        self.started = time.monotonic()
        if trainer.global_rank == STALLED_RANK:
            _write_json(_stalled_path(self.workdir), dict(pid=os.getpid(), stopped_at=time.time()))
            os.kill(os.getpid(), signal.SIGSTOP)


def _world_with_the_strategy_timeout(rank: int, world_size: int) -> None:
    """Destroy the launcher's WORLD, so that Lightning creates it with the strategy's timeout, as under torchrun."""
    port = [free_port() if rank == 0 else None]
    dist.broadcast_object_list(port, src=0)
    dist.barrier()
    dist.destroy_process_group()
    os.environ["MASTER_PORT"] = str(port[0])


def _stall_fit(rank: int, world_size: int, workdir: str, topology: str, overlap: bool) -> dict[str, Any]:
    _world_with_the_strategy_timeout(rank, world_size)
    strategy = OnebitStrategy(
        timeout=datetime.timedelta(seconds=STALL_TIMEOUT_S), topology=topology, ranks_per_node=PER_NODE,
        overlap=overlap,
    )
    stall = StallOneRank(workdir)
    trainer = pl.Trainer(**trainer_kwargs(world_size, MAX_STEPS, strategy=strategy, callbacks=[stall]))
    model = Regressor(freeze_step=FREEZE)
    report: dict[str, Any] = dict(rank=rank, error_type=None, message="")
    try:
        trainer.fit(model, loader(rank, MAX_STEPS))
    except Exception as error:  # noqa: BLE001 - the report says what it was
        report.update(error_type=type(error).__name__, message=str(error))
    report.update(
        elapsed_s=None if stall.started is None else time.monotonic() - stall.started,
        reported_at=time.time(),
        mode=None if trainer.strategy.topology is None else trainer.strategy.topology.mode,
        overlapped=trainer.strategy.overlap_state is not None,
        group_timeouts=[_timeout_s(group) for group in trainer.strategy.process_groups],
    )
    _write_json(_report_path(workdir, rank), report)
    return report


def _stall_fsdp_fit(rank: int, world_size: int, workdir: str, overlap: bool) -> dict[str, Any]:
    """The stall under ``onebit_fsdp`` (2 nodes x 2): rank 3 stops before its forward, where its node peer waits in
    FSDP's all-gather and its replica (rank 1) in the compressed exchange, and rank 0 waits for those two."""
    _world_with_the_strategy_timeout(rank, world_size)
    strategy = OnebitFSDPStrategy(timeout=datetime.timedelta(seconds=STALL_TIMEOUT_S), ranks_per_node=PER_NODE,
                                  overlap=overlap)
    stall = StallOneRank(workdir)
    trainer = pl.Trainer(accelerator="cpu", devices=world_size, strategy=strategy, max_steps=MAX_STEPS, logger=False,
                         enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False,
                         callbacks=[stall])
    report: dict[str, Any] = dict(rank=rank, error_type=None, message="")
    try:
        trainer.fit(LlamaLM(0, freeze_step=FREEZE))
    except Exception as error:  # noqa: BLE001 - the report says what it was
        report.update(error_type=type(error).__name__, message=str(error))
    report.update(
        elapsed_s=None if stall.started is None else time.monotonic() - stall.started,
        reported_at=time.time(),
        overlapped=strategy.overlap_state is not None,
        group_timeouts=[_timeout_s(strategy.device_mesh[dim].get_group()) for dim in ("replicate", "shard")],
    )
    _write_json(_report_path(workdir, rank), report)
    return report


class GroupTimeouts(pl.Callback):
    """At the start of training: how long each group a local-steps strategy made waits."""

    def __init__(self) -> None:
        self.seconds: list[Optional[float]] = []

    def on_train_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        strategy = trainer.strategy
        if isinstance(strategy, OnebitDiLoCoFSDPStrategy):
            groups = [strategy.device_mesh[dim].get_group() for dim in ("replicate", "shard")]
        else:
            groups = [strategy.replica_group, strategy.node_group]
        self.seconds = [_timeout_s(group) for group in groups]


def _stall_local_steps_fit(rank: int, world_size: int, workdir: str, fsdp: bool) -> dict[str, Any]:
    """The stall under ``onebit_diloco`` or ``onebit_diloco_fsdp`` (2 replicas x 2, an outer sync after every
    ``STALL_STEP`` steps): rank 3 stops before the step that ends the first period; its node peer waits inside the node
    (DDP's allreduce or FSDP's all-gather), rank 1 in the outer exchange with it, and rank 0 in the outer exchange
    with rank 2."""
    _world_with_the_strategy_timeout(rank, world_size)
    timeout = datetime.timedelta(seconds=STALL_TIMEOUT_S)
    stall, timeouts = StallOneRank(workdir), GroupTimeouts()
    if fsdp:
        strategy: Any = OnebitDiLoCoFSDPStrategy(sync_every=STALL_STEP, ranks_per_node=PER_NODE, timeout=timeout)
        trainer = pl.Trainer(accelerator="cpu", devices=world_size, strategy=strategy, max_steps=MAX_STEPS,
                             logger=False, enable_checkpointing=False, enable_progress_bar=False,
                             enable_model_summary=False, callbacks=[stall, timeouts])
        model, data = LlamaLM(0, optimizer=lambda params: torch.optim.AdamW(params, lr=3e-3)), None
    else:
        strategy = OnebitDiLoCoStrategy(sync_every=STALL_STEP, ranks_per_node=PER_NODE, timeout=timeout)
        trainer = pl.Trainer(**trainer_kwargs(world_size, MAX_STEPS, strategy=strategy, callbacks=[stall, timeouts]))
        model, data = Regressor(optimizer="adamw"), loader(rank, MAX_STEPS)
    report: dict[str, Any] = dict(rank=rank, error_type=None, message="")
    try:
        trainer.fit(model, data)
    except Exception as error:  # noqa: BLE001 - the report says what it was
        report.update(error_type=type(error).__name__, message=str(error))
    report.update(elapsed_s=None if stall.started is None else time.monotonic() - stall.started,
                  reported_at=time.time(), group_timeouts=timeouts.seconds)
    _write_json(_report_path(workdir, rank), report)
    return report


def _timeout_s(group: Any) -> Optional[float]:
    """How long a collective in ``group`` waits, read from its backend's options (torch has no public accessor)."""
    for device in group._device_types:
        options = group._get_backend(device).options
        value = getattr(options, "_timeout", getattr(options, "timeout", None))
        if value is not None:
            return value.total_seconds()
    return None


def _kill(pid: int) -> None:
    try:
        os.kill(pid, signal.SIGKILL)
    except ProcessLookupError:
        pass


def _run_stall_case(workdir: str, *args: Any, fit: Any = _stall_fit
                    ) -> tuple[dict[str, Any], dict[int, dict[str, Any]]]:
    """Launch the 4 ranks on ``fit(rank, world_size, workdir, *args)``; kill the stopped one once the 3 others
    reported (or KILL_AFTER_S after it stopped)."""
    survivors = [r for r in range(WORLD_SIZE) if r != STALLED_RANK]
    done = threading.Event()
    stalled: dict[str, Any] = {}

    def kill_the_stopped_rank() -> None:
        while not done.is_set() and not os.path.exists(_stalled_path(workdir)):
            done.wait(0.1)
        if not os.path.exists(_stalled_path(workdir)):
            return
        with open(_stalled_path(workdir)) as f:
            stalled.update(json.load(f))
        deadline = stalled["stopped_at"] + KILL_AFTER_S
        while not done.is_set() and time.time() < deadline and not all(
            os.path.exists(_report_path(workdir, r)) for r in survivors
        ):
            done.wait(0.1)
        stalled["killed_at"] = time.time()
        _kill(stalled["pid"])

    killer = threading.Thread(target=kill_the_stopped_rank, daemon=True)
    killer.start()
    try:
        # the killed rank fails the launch (a signal), or a hang exceeds its limit: the reports say what happened
        run_distributed(fit, WORLD_SIZE, workdir, *args, timeout_s=LAUNCH_LIMIT_S)
    except Exception as error:  # noqa: BLE001 - expected: the stopped rank dies by SIGKILL
        stalled["launch"] = f"{type(error).__name__}: {error}"
    finally:
        done.set()
        killer.join()
        if "pid" in stalled:
            _kill(stalled["pid"])  # a no-op unless the launch ended before the kill
    reports = {}
    for r in survivors:
        if os.path.exists(_report_path(workdir, r)):
            with open(_report_path(workdir, r)) as f:
                reports[r] = json.load(f)
    return stalled, reports


def _check_every_survivor_reported(stalled: dict[str, Any], reports: dict[int, dict[str, Any]]) -> None:
    survivors = [r for r in range(WORLD_SIZE) if r != STALLED_RANK]
    assert "pid" in stalled, f"rank {STALLED_RANK} never reached step {STALL_STEP} ({stalled}); reports: {reports}"
    assert sorted(reports) == survivors, (
        f"surviving ranks that never reported (still blocked when rank {STALLED_RANK} was killed "
        f"{KILL_AFTER_S:g} s after it stopped): {sorted(set(survivors) - set(reports))}; reports: {reports}"
    )


def _check_stall_case(workdir: str, topology: str, overlap: bool) -> None:
    stalled, reports = _run_stall_case(workdir, topology, overlap)
    _check_every_survivor_reported(stalled, reports)
    for rank, report in reports.items():
        assert report["mode"] == topology and report["overlapped"] == overlap, report
        # every group the strategy made waits the strategy's timeout, not torch's default 30 minutes
        made_groups = topology == "hierarchical" or overlap  # flat without overlap runs in WORLD alone
        assert bool(report["group_timeouts"]) == made_groups, report
        assert set(report["group_timeouts"]) <= {STALL_TIMEOUT_S}, report
        assert report["error_type"] is not None, f"rank {rank} finished the fit without its peer: {report}"
        # within the timeout plus a margin, and before the test killed the stopped rank
        assert report["elapsed_s"] <= STALL_TIMEOUT_S + MARGIN_S, report
        assert report["reported_at"] <= stalled["killed_at"], report
        message = report["message"]
        # the error names the group's ranks, its timeout, and the likely cause
        assert "in the process group of global ranks [" in message, message
        assert f"with a timeout of {STALL_TIMEOUT_S:g} s" in message, message
        assert "stalled" in message and "died" in message, message


@pytest.mark.parametrize("topology", ["flat", "hierarchical"])
def test_a_stalled_rank_fails_every_survivor_within_the_timeout(tmp_path: Any, topology: str) -> None:
    _check_stall_case(str(tmp_path), topology, overlap=False)


@pytest.mark.slow
@pytest.mark.parametrize("topology", ["flat", "hierarchical"])
def test_a_stalled_rank_fails_every_survivor_within_the_timeout_with_overlap(tmp_path: Any, topology: str) -> None:
    _check_stall_case(str(tmp_path), topology, overlap=True)


@pytest.mark.parametrize("overlap", [False, pytest.param(True, marks=pytest.mark.slow)])
def test_a_stalled_rank_under_onebit_fsdp_fails_every_survivor_within_the_timeout(tmp_path: Any, overlap: bool
                                                                                   ) -> None:
    """Before, the mesh's groups (``DeviceMesh(...)``) waited torch's default of 30 minutes: every survivor was still
    blocked when the test killed the stopped rank."""
    stalled, reports = _run_stall_case(str(tmp_path), overlap, fit=_stall_fsdp_fit)
    _check_every_survivor_reported(stalled, reports)
    for rank, report in reports.items():
        assert report["overlapped"] == overlap, report
        # both dimensions of the mesh wait the strategy's timeout
        assert report["group_timeouts"] == [STALL_TIMEOUT_S, STALL_TIMEOUT_S], report
        assert report["error_type"] is not None, f"rank {rank} finished the fit without its peer: {report}"
        assert report["elapsed_s"] <= STALL_TIMEOUT_S + MARGIN_S, report
        assert report["reported_at"] <= stalled["killed_at"], report
        if rank == 2:  # rank 3's node peer: in FSDP's collective inside the node, gloo's timeout error
            assert f"Timed out waiting {STALL_TIMEOUT_S * 1000:g}ms" in report["message"], report
        else:  # in the compressed exchange across nodes: the error names the group
            assert "in the process group of global ranks [" in report["message"], report
            assert f"with a timeout of {STALL_TIMEOUT_S:g} s" in report["message"], report


@pytest.mark.parametrize("fsdp", [False, True], ids=["onebit_diloco", "onebit_diloco_fsdp"])
def test_a_stalled_rank_under_local_steps_fails_every_survivor_within_the_timeout(tmp_path: Any, fsdp: bool) -> None:
    stalled, reports = _run_stall_case(str(tmp_path), fsdp, fit=_stall_local_steps_fit)
    _check_every_survivor_reported(stalled, reports)
    for rank, report in reports.items():
        # the replica group and the node's group wait the strategy's timeout
        assert report["group_timeouts"] == [STALL_TIMEOUT_S, STALL_TIMEOUT_S], report
        assert report["error_type"] is not None, f"rank {rank} finished the fit without its peer: {report}"
        assert report["elapsed_s"] <= STALL_TIMEOUT_S + MARGIN_S, report
        assert report["reported_at"] <= stalled["killed_at"], report
        if rank != 2:  # in the outer exchange (rank 2, rank 3's node peer, waits in a collective inside the node)
            assert "in the process group of global ranks [" in report["message"], report
            assert f"with a timeout of {STALL_TIMEOUT_S:g} s" in report["message"], report


# ======================================================================================== process group timeouts
@pytest.fixture
def one_rank_world() -> Any:
    """WORLD of this process alone (gloo, in-memory store), with a 7 s timeout."""
    dist.init_process_group(
        "gloo", store=dist.HashStore(), rank=0, world_size=1, timeout=datetime.timedelta(seconds=7)
    )
    try:
        yield
    finally:
        dist.destroy_process_group()


def test_new_groups_take_the_given_timeout_or_their_parents(one_rank_world: Any) -> None:
    """torch gives a new group its default of 30 minutes whatever its parent's timeout: a stalled peer then held the
    ranks of the topology's and the overlap's groups for half an hour."""
    from lightning_onebit.comm.groups import new_group_family
    from lightning_onebit.comm.topology import new_gather_groups

    assert _timeout_s(new_group_family([[0]])) == 7.0  # the parent's (WORLD's)
    assert _timeout_s(new_group_family([[0]], None, datetime.timedelta(seconds=3))) == 3.0
    inter, intra = new_gather_groups(None, None)
    assert intra is None and _timeout_s(inter) == 7.0
    inter, _ = new_gather_groups(None, None, datetime.timedelta(seconds=2))
    assert _timeout_s(inter) == 2.0


# ======================================================================================== an uneven ranks_per_node
def test_auto_falls_back_to_flat_when_ranks_per_node_does_not_divide_the_world_size() -> None:
    six = [(0, r) for r in range(6)]
    topology = Topology.plan(six, "auto", ranks_per_node=4)
    assert topology.mode == "flat"
    assert "falls back to flat" in topology.reason and "ranks_per_node=4 does not divide the world size 6" in (
        topology.reason
    )
    assert topology.node_of == (0, 0, 0, 0, 1, 1)  # the byte accounting still sees the simulated nodes
    assert Topology.plan(six, "flat", ranks_per_node=4).mode == "flat"
    with pytest.raises(ValueError, match="topology='hierarchical'.*ranks_per_node=4 does not divide the world size 6"):
        Topology.plan(six, "hierarchical", ranks_per_node=4)


def test_build_warns_on_auto_and_refuses_hierarchical_before_any_collective(
    one_rank_world: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    def no_collective(*args: Any, **kwargs: Any) -> None:
        raise AssertionError("a collective ran before the settings were checked")

    with capture_warnings() as warned:
        topology = Topology.build(0, 0, "auto", ranks_per_node=2)
    assert topology.mode == "flat"
    assert any("ranks_per_node=2 does not divide the world size 1" in w for w in warned), warned
    monkeypatch.setattr(dist, "all_gather_object", no_collective)
    with pytest.raises(ValueError, match="ranks_per_node=2 does not divide the world size 1"):
        Topology.build(0, 0, "hierarchical", ranks_per_node=2)


# ======================================================================================== smaller items
def test_auto_freeze_warning_does_not_say_compression_never_starts_when_it_may() -> None:
    """freeze_step='auto' bounded past the end of the run: the detector may still end the warmup (the hostile run's
    started at step 10 of 20), so the fit-start warning must not say compression never starts."""
    from types import SimpleNamespace

    opt = OnebitAdam(Regressor().parameters(), lr=1e-3, freeze_step="auto", auto_freeze=AutoFreeze(max_step=20))
    with capture_warnings() as warned:
        OnebitStrategy._warn_if_run_ends_in_warmup(SimpleNamespace(estimated_stepping_batches=20), opt)
    (message,) = [w for w in warned if "AutoFreeze(max_step=20)" in w]
    assert "compression starts only if the detector ends the warmup earlier" in message, message
    assert "it ends in the warmup" not in message, message
    fixed = OnebitAdam(Regressor().parameters(), lr=1e-3, freeze_step=20)
    with capture_warnings() as warned:
        OnebitStrategy._warn_if_run_ends_in_warmup(SimpleNamespace(estimated_stepping_batches=20), fixed)
    (message,) = [w for w in warned if "freeze_step=20" in w]
    assert "it ends in the warmup" in message and "compression never starts" in message, message


@pytest.mark.parametrize("argument", ["advise", "prog_bar"])
@pytest.mark.parametrize("value", ["yes", "no", 1, None])
def test_communication_monitor_refuses_a_non_boolean_switch(argument: str, value: Any) -> None:
    with pytest.raises(ValueError, match=f"CommunicationMonitor {argument} must be True or False, got {value!r}"):
        CommunicationMonitor(**{argument: value})


# ---------------------------------------------------------------------------------------- 2-rank Lightning session
class ZeroOneRegressor(Regressor):
    """``Regressor`` trained by ``ZeroOneAdam(**zeroone)``."""

    def __init__(self, **zeroone: Any) -> None:
        super().__init__()
        self.zeroone = zeroone

    def configure_optimizers(self) -> Any:
        return ZeroOneAdam(self.parameters(), lr=self.lr, **self.zeroone)


ADVISE_STEPS = 2


def _zeroone_advice(rank: int, world_size: int, max_steps: int, **zeroone: Any) -> dict[str, Any]:
    monitor = CommunicationMonitor(advise_steps=ADVISE_STEPS, prog_bar=False)
    model = ZeroOneRegressor(**zeroone)
    trainer = pl.Trainer(**trainer_kwargs(world_size, max_steps, callbacks=[monitor]))
    with capture_logs() as messages:
        trainer.fit(model, loader(rank, max_steps))
    onebit = trainer.strategy.onebit_optimizer
    return dict(
        advice=monitor.advice,
        messages=[m for m in messages if "advi" in m],
        kinds=dict(onebit.steps_by_kind),
    )


def scenario_zeroone_advice(rank: int, world_size: int, workdir: str) -> dict[str, Any]:
    """Warmup steps 1-4; then 1-bit steps 5, 7, 9, 11 between variance steps 6, 8, 10, 12."""
    return _zeroone_advice(rank, world_size, 12, var_update_scaler=4, var_freeze_step=1000)


def scenario_zeroone_local_steps_early(rank: int, world_size: int, workdir: str) -> dict[str, Any]:
    """Warmup steps 1-4, 1-bit step 5, variance step 6, 1-bit step 7, variance step 8, then local steps."""
    return _zeroone_advice(rank, world_size, 10, var_update_scaler=4, var_freeze_step=8)


def scenario_zeroone_no_onebit_step(rank: int, world_size: int, workdir: str) -> dict[str, Any]:
    """var_freeze_step=4: warmup steps 1-4, then local steps only."""
    return _zeroone_advice(rank, world_size, 7, var_update_scaler=16, var_freeze_step=4)


def _topology_fit(rank: int, world_size: int, topology: str) -> dict[str, Any]:
    strategy = OnebitStrategy(topology=topology, ranks_per_node=3)
    trainer = pl.Trainer(**trainer_kwargs(world_size, 4, strategy=strategy))
    model = Regressor(freeze_step=2)
    out: dict[str, Any] = dict(error_type=None, message="")
    with capture_warnings() as warned:
        try:
            trainer.fit(model, loader(rank, 4))
        except Exception as error:  # noqa: BLE001 - the test checks the type
            out.update(error_type=type(error).__name__, message=str(error))
    strategy_topology = trainer.strategy.topology
    out.update(
        warnings=[w for w in warned if "ranks_per_node" in w],
        mode=None if strategy_topology is None else strategy_topology.mode,
        steps=len(model.records),
    )
    return out


def scenario_uneven_ranks_per_node(rank: int, world_size: int, workdir: str) -> dict[str, Any]:
    return dict(
        auto=_topology_fit(rank, world_size, "auto"), hierarchical=_topology_fit(rank, world_size, "hierarchical")
    )


_SCENARIOS = (
    ("zeroone_advice", scenario_zeroone_advice),
    ("zeroone_local_early", scenario_zeroone_local_steps_early),
    ("zeroone_no_onebit_step", scenario_zeroone_no_onebit_step),
    ("uneven", scenario_uneven_ranks_per_node),
)


@pytest.fixture(scope="module")
def session(tmp_path_factory: pytest.TempPathFactory) -> list[dict[str, Any]]:
    workdir = str(tmp_path_factory.mktemp("hostile_topology"))
    return run_distributed(run_scenarios, 2, _SCENARIOS, workdir, timeout_s=240)


def test_the_advisor_advises_for_zeroone_adam_on_its_one_bit_steps(session: list[dict[str, Any]]) -> None:
    results = scenario_results(session, "zeroone_advice")
    assert results[0]["kinds"] == {"variance": 8, "compressed": 4}
    a = results[0]["advice"]
    assert a is not None and results[1]["advice"] == a, "no advice with ZeroOneAdam"
    assert a.warmup_steps == ADVISE_STEPS and a.compressed_bytes < a.warmup_bytes
    assert a.measured_steps == ADVISE_STEPS and a.measured_step_s is not None  # 1-bit steps 9 and 11
    estimate, measured = results[0]["messages"]
    assert "expect about" in estimate and "ZeroOneAdam: for its 1-bit steps only" in estimate
    assert "compression-stage step measured" in measured and "ZeroOneAdam" in measured
    assert results[1]["messages"] == []


def test_the_advisor_says_why_it_stops_or_does_not_advise_with_zeroone_adam(session: list[dict[str, Any]]) -> None:
    early = scenario_results(session, "zeroone_local_early")[0]
    assert early["kinds"]["compressed"] == 2 and early["kinds"].get("local", 0) + early["kinds"].get("sync", 0) == 2
    assert early["advice"] is not None and early["advice"].measured_step_s is None
    assert any("the 1-bit steps were not measured: ZeroOneAdam's local steps began" in m for m in early["messages"])
    none = scenario_results(session, "zeroone_no_onebit_step")[0]
    assert none["advice"] is None and "compressed" not in none["kinds"]
    expected = "no compression advice: in this fit ZeroOneAdam took no 1-bit compressed step"
    assert any(expected in m for m in none["messages"]), none["messages"]


def test_strategy_auto_falls_back_to_flat_on_an_uneven_ranks_per_node(session: list[dict[str, Any]]) -> None:
    results = scenario_results(session, "uneven")
    for rank, r in enumerate(results):
        auto, hierarchical = r["auto"], r["hierarchical"]
        assert auto["error_type"] is None and auto["mode"] == "flat" and auto["steps"] == 4, auto
        if rank == 0:
            assert any("ranks_per_node=3 does not divide the world size 2" in w for w in auto["warnings"]), auto
        assert hierarchical["error_type"] == "ValueError", hierarchical
        assert "ranks_per_node=3 does not divide the world size 2" in hierarchical["message"], hierarchical
