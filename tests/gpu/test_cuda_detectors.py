"""What CUDA and NCCL would break, seen on CPU (issue 24 part 2), with the detectors of :mod:`tests.detectors`.

* **Host syncs.** Compression-stage steps of OnebitAdam, OnebitLamb and ZeroOneAdam (compressed, variance, local and
  sync steps) with ``kernel_backend="torch"`` on gloo ranks: flat (2 ranks), overlapped (plain DDP with
  ``OverlapState`` and ``overlapped_exchange_hook``, tiny DDP buckets), hierarchical (4 ranks as 2 nodes x 2, with
  and without overlap) and 16-mixed (a ``RankSyncedGradScaler``). After the freeze and the first compressed steps
  (one-time work: bucket building, dead-coordinate report, kernel agreement, LAMB's scaling coefficients), the
  backward pass and ``optimizer.step()`` of every steady step make **no host synchronisation**; the only one accepted
  is named in :data:`ALLOWED` with its reason. A failure names every sync with its ``lightning_onebit`` line.
* **Device placement.** Each optimizer's warmup and compressed steps, the compression kernels, the exchange (one
  rank of a 2-rank flat and of a 4-rank hierarchical fake process group), the overlapped start of a bucket, and the
  error-feedback restore from CPU tensors run on fake CUDA parameters; no op may mix devices where CUDA would refuse
  it. The detector catches R1 (CPU step tensors in ``_fused_adamw_``) when the old code is put back.
* **Collective order.** Every rank records the collectives it issues on every process group during overlapped and
  hierarchical steps, with random delays on some ranks; the merged sequences must be identical. With the old
  ``progress_exchanges_`` (launch a bucket's all_gather as soon as its all_to_all completed on this rank) put back, a
  straggler makes them differ, and the test sees it.

Two spawned sessions (2 and 4 gloo ranks) run every multi-rank scenario; the fake-CUDA tests run in this process.
On a CPU-only torch, indexing, ``copy_`` and ``to("cuda")`` of a fake CUDA tensor fail in torch's Python binding
(it takes a CUDA device guard that only CUDA builds have) before any op is dispatched; :func:`tests.detectors.fake_cuda`
issues the aten ops those bindings issue instead, so the check sees what a CUDA build would run.
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import random
import time
from typing import Any, Callable, Optional

import pytest
import torch
import torch.distributed as dist
from torch import nn
from torch.nn.parallel import DistributedDataParallel as DDP

import lightning_onebit.comm as comm
import lightning_onebit.comm.exchange as comm_exchange
import lightning_onebit.optim.base as optim_base
import lightning_onebit.optim.buckets as optim_exchange
import lightning_onebit.optim.functional as functional_module
from lightning_onebit import OnebitAdam, OnebitLamb, Topology, ZeroOneAdam
from lightning_onebit.hooks import GradientSyncState, OverlapState, overlapped_exchange_hook, switchable_allreduce_hook
from lightning_onebit import kernels
from lightning_onebit.strategy.precision import RankSyncedGradScaler
from tests.detectors import (
    AllowedSync,
    Collective,
    CollectiveRecorder,
    DeviceMixError,
    HostSyncCounter,
    HostSyncOnFakeDevice,
    SyncEvent,
    fake_cuda,
    fake_process_group,
    first_divergence,
    unexpected_syncs,
)
from tests.distributed import run_distributed, run_scenarios, scenario_results
from tests.optim_models import EmbeddingNet, token_batch

# lightning_onebit/kernels/frozen.py stamps its cache with data_ptr(), which torch warns about on fake tensors
pytestmark = pytest.mark.filterwarnings("ignore:Accessing the data pointer of FakeTensor:UserWarning")

VOCAB, DIM, FREEZE = 40, 16, 2
ADAM_STEPS = FREEZE + 5  # two compressed steps of one-time work, then three steady ones
# ZeroOneAdam: steps 1-2 warmup; 3, 5, 7 compressed; 4, 6, 8 variance; from 9 local and sync steps (interval 1 for
# two local steps, then 2): 9 sync, 10 sync, 11 local, 12 sync, 13 local, 14 sync
ZEROONE = dict(var_update_scaler=FREEZE, var_freeze_step=8, local_step_scaler=2, local_step_clipper=2)
ZEROONE_STEPS = 14
DDP_BUCKET_MB = 0.001  # about 1 KB: every layer in a DDP bucket of its own

#: Host syncs a steady compression-stage step may make, each with its reason. Nothing else.
ALLOWED = (
    AllowedSync(
        "item",
        "torch/amp/grad_scaler.py",
        "16-mixed: GradScaler.step reads found_inf on the host (`.item()` in torch's _maybe_opt_step) to decide "
        "whether to skip optimizer.step(); torch's design, one per step, and the verdict is already agreed across "
        "ranks on the device by RankSyncedGradScaler",
    ),
)


Chain = EmbeddingNet  # several DDP buckets at DDP_BUCKET_MB


def _groups(params: list[nn.Parameter]) -> list[dict[str, Any]]:
    """Every parameter compressed with weight decay (LAMB's weight-decay path), except the last one, which is kept
    out of compression (``compress=False``: a full-precision allreduce and the warmup update every step)."""
    return [{"params": params[:-1], "weight_decay": 0.01}, {"params": params[-1:], "compress": False}]


def _optimizer(name: str, params: list[nn.Parameter], **kwargs: Any) -> optim_base.CompressedOptimizer:
    common = dict(lr=1e-2, kernel_backend="torch", **kwargs)
    if name == "onebit_adam":
        return OnebitAdam(_groups(params), freeze_step=FREEZE, **common)
    if name == "onebit_lamb":
        return OnebitLamb(_groups(params), freeze_step=FREEZE, **common)
    common.pop("dead_coordinates", None)
    return ZeroOneAdam(_groups(params), **ZEROONE, **common)


def _hierarchical(rank: int, world_size: int) -> Optional[Topology]:
    """4 ranks as 2 simulated nodes x 2 ranks; ``None`` (flat) otherwise. A collective."""
    return Topology.build(rank // 2, rank % 2, "hierarchical", 2) if world_size == 4 else None


# ================================================================================================ host syncs
def scenario_syncs(rank: int, world_size: int, workdir: str, optimizer: str, mode: str) -> dict[str, Any]:
    """Train ``Chain`` on this rank and count the host syncs of every compression-stage step's backward and step.

    ``mode``: ``"plain"`` (DDP's switchable allreduce hook; the exchange runs in ``step``), ``"overlapped"``
    (``OverlapState``) or ``"16-mixed"`` (plain, with a ``RankSyncedGradScaler``). 4 ranks: hierarchical.
    """
    net = Chain()
    ddp = DDP(net, bucket_cap_mb=DDP_BUCKET_MB)
    opt = _optimizer(optimizer, list(net.parameters()))
    opt.topology = _hierarchical(rank, world_size)
    scaler = None
    if mode == "overlapped":
        state: Any = OverlapState(ddp, opt)
        ddp.register_comm_hook(state, overlapped_exchange_hook)
    else:
        state = GradientSyncState(sync_predicate=lambda: opt.needs_gradient_allreduce, topology=opt.topology)
        ddp.register_comm_hook(state, switchable_allreduce_hook)
        if mode == "16-mixed":
            scaler = RankSyncedGradScaler("cpu", init_scale=2.0**10)
    kinds = []
    with HostSyncCounter() as syncs:
        for t in range(1, (ZEROONE_STEPS if optimizer == "zeroone_adam" else ADAM_STEPS) + 1):
            counted = t > opt.freeze_step  # compression stage: count (the test decides which steps are steady)
            x, y = token_batch(rank, t, VOCAB)
            loss = nn.functional.cross_entropy(ddp(x), y)
            with syncs.counting(f"{t}:backward") if counted else contextlib.nullcontext():
                (loss if scaler is None else scaler.scale(loss)).backward()
            with syncs.counting(f"{t}:step") if counted else contextlib.nullcontext():
                if scaler is None:
                    opt.step()
                else:
                    scaler.step(opt)
                    scaler.update()
            kinds.append(opt.last_step_kind)
            opt.zero_grad()
    return dict(
        kinds=kinds,
        events=[dataclasses.astuple(e) for e in syncs.events],
        started=getattr(state, "buckets_started", 0),
        hierarchical=opt.topology is not None,
    )


def scenario_hook_sync_control(rank: int, world_size: int, workdir: str) -> dict[str, Any]:
    """Positive control: a sync made inside a DDP comm hook (the autograd engine calls it during backward) and one
    made by boolean-mask indexing inside ``step`` are both counted, with their lines."""
    net = Chain()
    ddp = DDP(net, bucket_cap_mb=DDP_BUCKET_MB)

    def syncing_hook(state, bucket):  # no annotations: DDP checks them as objects
        float(bucket.buffer().abs().sum())  # a host sync in the hook
        return _done(bucket.buffer())

    ddp.register_comm_hook(None, syncing_hook)
    with HostSyncCounter() as syncs:
        x, y = token_batch(rank, 0, VOCAB)
        loss = nn.functional.cross_entropy(ddp(x), y)
        with syncs.counting("backward"):
            loss.backward()
        with syncs.counting("step"):
            grad = net.head.weight.grad
            _ = grad[grad > 0]
            _ = grad.tolist()
    return dict(events=[dataclasses.astuple(e) for e in syncs.events])


def _done(tensor: torch.Tensor) -> torch.futures.Future:
    future: torch.futures.Future = torch.futures.Future()
    future.set_result(tensor)
    return future


def _steady(optimizer: str, kinds: list[str]) -> dict[int, str]:
    """Steady compression-stage steps ``{step: kind}``: for 1-bit Adam and LAMB every step after the first two
    compressed ones (one-time work); for 0/1 Adam every compression-stage step that is not the first of its kind
    (the first compressed step builds the buckets, the first local step starts the local phase)."""
    if optimizer != "zeroone_adam":
        return {t: k for t, k in enumerate(kinds, 1) if t > FREEZE + 2}
    steady, seen = {}, set()
    for t, kind in enumerate(kinds, 1):
        if t > FREEZE:
            if kind in seen:
                steady[t] = kind
            seen.add(kind)
    return steady


# ================================================================================================ collective order
def _old_progress_exchanges_(
    state: comm.CompressedAllreduceState, pending: Any, keep_newest: bool = True
) -> None:
    """``progress_exchanges_`` as it was before the deterministic schedule (commit 51ef743): advance an exchange
    as soon as ``work.is_completed()`` on this rank, so the launch order depends on timing."""
    if not state.has_gather_groups or not pending:
        return
    started = time.perf_counter()
    phases = comm_exchange.ExchangePhase
    last = phases.NODE_GATHER if pending[0].hierarchical else phases.GATHER
    for phase in range(phases.ALL_TO_ALL, last):
        for p in pending:
            if p.phase > phase:
                continue
            if p.phase < phase or not p.work.is_completed():
                break
            comm_exchange.advance_exchange_(state, p)
    state.counters.time_s += time.perf_counter() - started


@contextlib.contextmanager
def _old_schedule() -> Any:
    """Put the timing-driven ``progress_exchanges_`` back where the optimizer calls it."""
    saved = comm_exchange.progress_exchanges_, optim_exchange.progress_exchanges_
    comm_exchange.progress_exchanges_ = optim_exchange.progress_exchanges_ = _old_progress_exchanges_
    try:
        yield
    finally:
        comm_exchange.progress_exchanges_, optim_exchange.progress_exchanges_ = saved


def scenario_order(
    rank: int, world_size: int, workdir: str, overlapped: bool, old_schedule: bool = False
) -> dict[str, Any]:
    """Record this rank's collectives over OnebitAdam's warmup and compression stage, with delays injected.

    Random delays (seeded per rank) on every rank but 0, in the DDP hook and before ``step``; with ``old_schedule``
    rank 1 is a steady straggler instead (20-40 ms in every hook), which is what exposes the old schedule.
    """
    rng = random.Random(7919 * (rank + 1))

    def delay() -> None:
        if old_schedule:
            if rank == 1:
                time.sleep(rng.uniform(0.02, 0.04))
        elif rank != 0 and rng.random() < 0.5:
            time.sleep(rng.uniform(0.0, 0.02))

    with contextlib.ExitStack() as stack:
        if old_schedule:
            stack.enter_context(_old_schedule())
        recorder = stack.enter_context(CollectiveRecorder())
        net = Chain()
        ddp = DDP(net, bucket_cap_mb=DDP_BUCKET_MB)
        # small momentum buckets too, so that the in-step exchange has several buckets to order
        opt = OnebitAdam(net.parameters(), lr=1e-2, freeze_step=FREEZE, kernel_backend="torch",
                         bucket_cap_mb=DDP_BUCKET_MB, dead_coordinates="ignore")
        opt.topology = _hierarchical(rank, world_size)
        if overlapped:
            state: Any = OverlapState(ddp, opt)

            def hook(state, bucket):  # no annotations: DDP checks them as objects
                delay()
                return overlapped_exchange_hook(state, bucket)
        else:
            state = GradientSyncState(sync_predicate=lambda: opt.needs_gradient_allreduce, topology=opt.topology)

            def hook(state, bucket):
                delay()
                return switchable_allreduce_hook(state, bucket)

        ddp.register_comm_hook(state, hook)
        with recorder.recording():
            for t in range(1, ADAM_STEPS + 1):
                recorder.mark(f"step {t}")
                x, y = token_batch(rank, t, VOCAB)
                nn.functional.cross_entropy(ddp(x), y).backward()
                delay()
                opt.step()
                opt.zero_grad()
    return dict(
        calls=[dataclasses.astuple(c) for c in recorder.calls],
        unnumbered=recorder.unnumbered,
        started=getattr(state, "buckets_started", 0),
        momentum_buckets=len(opt.bucket_layouts()),
        counted=opt.communication.collectives,  # what the library counts: the compressed exchange's collectives
    )


# ================================================================================================ sessions
def _scenario(name: str, fn: Callable[..., dict], **kwargs: Any) -> tuple[str, Callable[..., dict]]:
    return name, functools.partial(fn, **kwargs)


TWO_RANKS = (
    _scenario("control", scenario_hook_sync_control),
    *(_scenario(f"syncs/flat/{o}", scenario_syncs, optimizer=o, mode="plain")
      for o in ("onebit_adam", "onebit_lamb", "zeroone_adam")),
    *(_scenario(f"syncs/overlapped/{o}", scenario_syncs, optimizer=o, mode="overlapped")
      for o in ("onebit_adam", "onebit_lamb")),
    _scenario("syncs/16-mixed/onebit_adam", scenario_syncs, optimizer="onebit_adam", mode="16-mixed"),
    _scenario("order/overlapped", scenario_order, overlapped=True),
    _scenario("order/overlapped/old", scenario_order, overlapped=True, old_schedule=True),
)
FOUR_RANKS = (
    *(_scenario(f"syncs/hierarchical/{o}", scenario_syncs, optimizer=o, mode="plain")
      for o in ("onebit_adam", "onebit_lamb", "zeroone_adam")),
    *(_scenario(f"syncs/hierarchical-overlapped/{o}", scenario_syncs, optimizer=o, mode="overlapped")
      for o in ("onebit_adam", "onebit_lamb")),
    _scenario("order/hierarchical", scenario_order, overlapped=False),
    _scenario("order/hierarchical-overlapped", scenario_order, overlapped=True),
)


@pytest.fixture(scope="module")
def two_ranks(tmp_path_factory: pytest.TempPathFactory) -> list[dict]:
    return run_distributed(run_scenarios, 2, TWO_RANKS, str(tmp_path_factory.mktemp("two")), timeout_s=300)


@pytest.fixture(scope="module")
def four_ranks(tmp_path_factory: pytest.TempPathFactory) -> list[dict]:
    return run_distributed(run_scenarios, 4, FOUR_RANKS, str(tmp_path_factory.mktemp("four")), timeout_s=400)


# ================================================================================================ tests: host syncs
def test_sync_counter_sees_syncs_in_hooks_and_at_the_tensor_method_level(two_ranks: list[dict]) -> None:
    for rank, result in enumerate(scenario_results(two_ranks, "control")):
        events = [SyncEvent(*e) for e in result["events"]]
        in_hooks = [e for e in events if e.region == "backward"]
        assert in_hooks and all(e.what == "__float__" and "syncing_hook" in e.where for e in in_hooks), events
        kinds = sorted(e.what for e in events if e.region == "step")
        assert kinds == ["boolean-mask index", "tolist"], events  # neither passes through Python dispatch


def test_sync_counter_unit() -> None:
    t = torch.arange(6.0)
    with HostSyncCounter() as syncs:
        float(t.sum())  # not counted: outside a counting region
        with syncs.counting("r"):
            float(t.sum())
            bool(t.any())
            t.max().item()
            int(t[0])
            t.tolist()
            t[t > 2]
            t[t > 2] = 0.0
            t.nonzero()
            torch.masked_select(t, t > 0)
            torch.repeat_interleave(t, torch.ones(6, dtype=torch.long))
            torch.repeat_interleave(t, torch.ones(6, dtype=torch.long), output_size=6)  # not a sync
            t.add_(1).mul_(torch.tensor(2.0))  # not a sync
            t[1:3].zero_()  # not a sync
    whats = [e.what for e in syncs.events]
    assert whats == [
        "__float__", "__bool__", "item", "__int__", "tolist", "boolean-mask index", "boolean-mask assignment",
        "nonzero", "masked_select", "repeat_interleave without output_size",
    ], whats
    assert all("test_cuda_detectors.py" in e.where for e in syncs.events), syncs.summary()
    assert "__float__" not in torch.Tensor.__dict__  # the patches are gone


SYNC_CASES = [
    "flat/onebit_adam", "flat/onebit_lamb", "flat/zeroone_adam", "overlapped/onebit_adam",
    "overlapped/onebit_lamb", "16-mixed/onebit_adam",
]
HIERARCHICAL_SYNC_CASES = [
    "hierarchical/onebit_adam", "hierarchical/onebit_lamb", "hierarchical/zeroone_adam",
    "hierarchical-overlapped/onebit_adam", "hierarchical-overlapped/onebit_lamb",
]


def _check_no_steady_syncs(session: list[dict], case: str) -> None:
    mode, optimizer = case.split("/")
    failures = []
    for rank, result in enumerate(scenario_results(session, f"syncs/{case}")):
        steady = _steady(optimizer, result["kinds"])
        assert len(steady) >= 3, result["kinds"]
        if optimizer == "zeroone_adam":  # every kind of compression-stage step is measured
            assert set(steady.values()) == {"compressed", "variance", "local", "sync"}, result["kinds"]
        if "overlapped" in mode:
            assert result["started"] > 0, "the overlap hook never started an exchange"
        events = [SyncEvent(*e) for e in result["events"] if int(e[3].split(":")[0]) in steady]
        bad = unexpected_syncs(events, ALLOWED)
        if bad:
            failures.append(
                f"rank {rank}: {len(bad)} host sync(s) in {len(steady)} steady steps "
                f"({', '.join(f'{t}: {k}' for t, k in steady.items())}); "
                f"{HostSyncCounter().summary(bad)}"
            )
    assert not failures, "\n".join(failures)


@pytest.mark.parametrize("case", SYNC_CASES)
def test_no_host_sync_in_steady_compression_steps(two_ranks: list[dict], case: str) -> None:
    _check_no_steady_syncs(two_ranks, case)


@pytest.mark.parametrize("case", HIERARCHICAL_SYNC_CASES)
def test_no_host_sync_in_steady_hierarchical_compression_steps(four_ranks: list[dict], case: str) -> None:
    _check_no_steady_syncs(four_ranks, case)


def test_the_16_mixed_allowance_is_used(two_ranks: list[dict]) -> None:
    """The allow-list entry is real: GradScaler's own sync happens once per step (and nothing else is allowed)."""
    for result in scenario_results(two_ranks, "syncs/16-mixed/onebit_adam"):
        steady = _steady("onebit_adam", result["kinds"])
        events = [SyncEvent(*e) for e in result["events"] if int(e[3].split(":")[0]) in steady]
        scaler = [e for e in events if ALLOWED[0].matches(e)]
        assert len(scaler) == len(steady), HostSyncCounter().summary(events)


# ================================================================================================ tests: collective order
def _calls(results: list[dict]) -> list[list[Collective]]:
    return [[Collective(*c) for c in r["calls"]] for r in results]


# the flat all_gather's name: torch 2.13 renamed ``all_gather_into_tensor`` to ``all_gather_single``
GATHER = "all_gather_single" if hasattr(dist, "all_gather_single") else "all_gather_into_tensor"


def _check_same_order(results: list[dict], overlapped: bool) -> None:
    sequences = _calls(results)
    for r in results:
        assert not r["unnumbered"], f"collectives on groups created outside the recorder: {r['unnumbered']}"
    divergence = first_divergence(sequences)
    assert divergence is None, divergence
    ops = {c.op for c in sequences[0] if c.group >= 0}
    assert {"all_to_all_single", GATHER} <= ops, ops
    for r, sequence in zip(results, sequences):  # the recorder saw every collective of the exchange
        exchange = [c for c in sequence if c.op in ("all_to_all_single", GATHER)]
        assert len(exchange) == r["counted"], (len(exchange), r["counted"])
    if overlapped:
        assert all(r["started"] > 0 for r in results), "the overlap hook never started an exchange"
        # the hooks really interleave groups: in some step a second-phase all_gather precedes a first-phase
        # all_to_all (on another group), which is what must happen in the same order everywhere
        steps: list[list[Collective]] = []
        for c in sequences[0]:
            if c.group < 0:
                steps.append([])
            elif steps:
                steps[-1].append(c)
        assert any(
            any(a.op == GATHER and b.op == "all_to_all_single" and a.group != b.group
                for i, a in enumerate(step) for b in step[i + 1 :])
            for step in steps
        ), "no step interleaves second-phase all_gathers with first-phase all_to_alls"
    assert results[0]["momentum_buckets"] >= 3


def test_collective_order_is_identical_across_ranks_overlapped_flat(two_ranks: list[dict]) -> None:
    _check_same_order(scenario_results(two_ranks, "order/overlapped"), overlapped=True)


def test_collective_order_is_identical_across_ranks_hierarchical(four_ranks: list[dict]) -> None:
    results = scenario_results(four_ranks, "order/hierarchical")
    _check_same_order(results, overlapped=False)
    groups = {c.group for c in _calls(results)[0] if c.group >= 0}
    assert len(groups) >= 3, groups  # WORLD (warmup allreduce), intra- and inter-node groups


def test_collective_order_is_identical_across_ranks_hierarchical_overlapped(four_ranks: list[dict]) -> None:
    results = scenario_results(four_ranks, "order/hierarchical-overlapped")
    _check_same_order(results, overlapped=True)
    groups = {c.group for c in _calls(results)[0] if c.group >= 0}
    assert len(groups) >= 5, groups  # WORLD, intra, inter, and the second phase's own inter and intra groups


def test_collective_order_detector_sees_the_old_timing_driven_schedule(two_ranks: list[dict]) -> None:
    """Expected mismatch: with the old ``progress_exchanges_`` a straggling rank launches a bucket's all_gather
    between later all_to_alls while the others launch it in ``step``; the recorder must see the difference."""
    results = scenario_results(two_ranks, "order/overlapped/old")
    assert all(r["started"] > 0 for r in results)
    assert first_divergence(_calls(results)) is not None, "the old schedule gave the same order on every rank"


# ================================================================================================ tests: device placement
def _fake_params() -> list[nn.Parameter]:
    """Parameters of several shapes on (fake) CUDA; the last goes to a ``compress=False`` group."""
    torch.manual_seed(0)
    shapes = [(16, 6), (16,), (3, 16), (3,), (5,)]
    return [nn.Parameter(torch.randn(*s, device="cuda")) for s in shapes]


def _set_grads(params: list[nn.Parameter]) -> None:
    for p in params:
        p.grad = torch.randn_like(p)


def _assert_on_cuda(opt: optim_base.CompressedOptimizer, params: list[nn.Parameter]) -> None:
    for p in params:
        assert p.device.type == "cuda"
        for name, value in opt.state[p].items():
            if isinstance(value, torch.Tensor):
                assert value.device.type == "cuda", f"state {name!r} on {value.device}"
    for key, buffers in opt.compression._buckets.items():
        assert buffers.worker_error.device.type == "cuda", f"bucket {key!r}: error feedback on the host"


@pytest.fixture
def agreed_backend(monkeypatch: pytest.MonkeyPatch) -> None:
    """The kernel agreement is an ``all_gather_object``, which torch's fake backend cannot carry (it returns the
    output as it was): every rank of these tests runs ``kernel_backend="torch"`` anyway."""
    monkeypatch.setattr(optim_base, "agree_kernel_backend", lambda backend, group=None: backend)


def test_placement_detector_unit() -> None:
    with fake_cuda() as placement:
        x = torch.randn(8, device="cuda")
        x.mul_(torch.tensor(2.0))  # a 0-dim CPU tensor in a binary op: CUDA reads it as a scalar
        torch.where(x > 0, x, torch.tensor(0.0))
        x[2:4].copy_(torch.ones(2))  # a host-to-device copy: allowed, recorded
        with pytest.raises(DeviceMixError, match=r"addcmul.*cpu.*cuda"):
            x.addcmul_(x, torch.tensor(2.0))  # ternary ops refuse CPU scalars
        with pytest.raises(DeviceMixError, match="add"):
            x.add_(torch.ones(8))  # not a scalar
        with pytest.raises(HostSyncOnFakeDevice, match="test_cuda_detectors.py"):
            float(x.sum())
        with pytest.raises(HostSyncOnFakeDevice):
            x.tolist()
        with pytest.raises(HostSyncOnFakeDevice, match="boolean-mask"):
            x[x > 0]
    assert [t.direction for t in placement.transfers] == ["cpu->cuda:0"]
    assert len(placement.errors) == 5


def test_fake_cuda_kernels_keep_every_op_on_the_device() -> None:
    segments = kernels.Segments([0, 40, 64, 200, 256])
    with fake_cuda() as placement:
        x = torch.randn(256, device="cuda")
        error = torch.zeros(256, device="cuda")
        workspace = kernels.Workspace()
        for _ in range(2):
            scales, packed = kernels.compress_with_error_feedback(x, error, segments, backend="torch",
                                                                  workspace=workspace)
        out = torch.empty(256, device="cuda")
        kernels.decompress(packed, scales, segments, out, backend="torch", workspace=workspace)
        kernels.decompress(packed, scales, segments, out, accumulate=True, backend="torch", workspace=workspace)
        target = torch.zeros(256, device="cuda")
        kernels.add_mean_of_signs_(target, [packed, packed], [scales, scales], segments, backend="torch",
                                   workspace=workspace)
        params, m, v = [torch.randn(10, device="cuda")], [torch.randn(10, device="cuda")], [torch.rand(10, device="cuda")]
        kernels.frozen_adam_update_(params, m, v, decay=0.99, bias_correction2_sqrt=0.5, eps=1e-8, step=-1e-3,
                                    backend="torch")
        setup = len(placement.transfers)  # the cached per-device tables (segment lengths, sign table) are made once
        kernels.compress_with_error_feedback(x, error, segments, backend="torch", workspace=workspace)
        kernels.decompress(packed, scales, segments, out, backend="torch", workspace=workspace)
    assert scales.device.type == packed.device.type == out.device.type == target.device.type == "cuda"
    assert placement.ops > 20 and not placement.errors
    assert len(placement.transfers) == setup, [str(t) for t in placement.transfers[setup:]]


OPTIMIZERS = ["onebit_adam", "onebit_lamb", "zeroone_adam"]


@pytest.mark.parametrize("optimizer", OPTIMIZERS)
def test_fake_cuda_optimizer_steps_keep_every_op_on_the_device(optimizer: str) -> None:
    """One process (the exchange of one rank is the identity): warmup and compression-stage steps (0/1 Adam: up to
    its local and sync steps), with a ``compress=False`` group. The first compressed step's dead-coordinate report
    (a documented one-time host sync per tensor) is switched off."""
    steps = ZEROONE_STEPS if optimizer == "zeroone_adam" else ADAM_STEPS
    kinds = []
    with fake_cuda() as placement:
        params = _fake_params()
        opt = _optimizer(optimizer, params, dead_coordinates="ignore")
        for _ in range(steps):
            _set_grads(params)
            opt.step()
            kinds.append(opt.last_step_kind)
        _assert_on_cuda(opt, params)
    assert not placement.errors
    assert "compressed" in kinds and (optimizer != "zeroone_adam" or {"local", "sync"} <= set(kinds)), kinds


@pytest.mark.parametrize("optimizer", OPTIMIZERS)
@pytest.mark.parametrize("world_size", [2, 4])
def test_fake_cuda_exchange_keeps_every_op_on_the_device(
    optimizer: str, world_size: int, agreed_backend: None
) -> None:
    """Rank 0 of a fake 2-rank (flat) or 4-rank (2 x 2, hierarchical) process group: worker compression, serving,
    decoding and the error feedback all run on fake CUDA tensors; a steady compressed step moves nothing between
    host and device."""
    steps = ZEROONE_STEPS if optimizer == "zeroone_adam" else ADAM_STEPS
    with fake_process_group(world_size), fake_cuda() as placement:
        params = _fake_params()
        opt = _optimizer(optimizer, params, dead_coordinates="ignore")
        if world_size == 4:
            plan = Topology.plan([(r // 2, r % 2) for r in range(4)], "hierarchical", 0, 2)
            opt.topology = plan.with_new_groups()
        moved = {}
        for t in range(1, steps + 1):
            _set_grads(params)
            before = len(placement.transfers)
            opt.step()
            moved[t] = [str(x) for x in placement.transfers[before:]]
        _assert_on_cuda(opt, params)
        assert opt.compression._buckets, "no exchange ran"
    assert not placement.errors
    steady = {t: m for t, m in moved.items() if t > FREEZE + 1 and m}
    assert not steady, f"host<->device copies in steady steps: {steady}"


def test_fake_cuda_overlapped_start_keeps_every_op_on_the_device(agreed_backend: None) -> None:
    """The overlap hook's path without DDP: ``start_bucket_exchange_`` per bucket (fold, compress, launch, advance
    earlier buckets) through the stream seam, ``progress_exchanges`` for a bucket it does not hold, then ``step``."""
    with fake_process_group(2), fake_cuda() as placement:
        params = _fake_params()
        opt = OnebitAdam(_groups(params), lr=1e-2, freeze_step=FREEZE, kernel_backend="torch",
                         dead_coordinates="ignore")
        opt.set_bucket_plan([[p] for p in params[:-1]])
        opt.compression.create_gather_groups()
        for _ in range(FREEZE + 1):  # warmup, then the first compressed step lays the buckets out
            _set_grads(params)
            opt.step()
        for _ in range(2):
            _set_grads(params)
            for key, p in enumerate(params[:-1]):
                assert opt.start_bucket_exchange_(key, [p], [p.grad])
            opt.progress_exchanges()  # the compress=False parameter's bucket
            assert opt.exchanges_in_flight == len(params) - 1
            opt.step()
        _assert_on_cuda(opt, params)
    assert not placement.errors


def _cpu_error_feedback(opt: optim_base.CompressedOptimizer) -> dict[str, Any]:
    """This rank's error feedback as ``torch.load(map_location="cpu")`` returns it: real CPU tensors (random values:
    a non-trivial state), built by hand in the format of ``CompressedAllreduceState.error_feedback_state_dict``."""
    layouts, world_size = opt.bucket_layouts(), opt.compression.world_size()
    generator = torch.Generator().manual_seed(3)
    with torch._subclasses.fake_tensor.unset_fake_temporarily():
        buckets = {
            key: {
                "layout": (layout.tensor_numels, world_size),
                "worker_error": torch.randn(layout.padded_numel, generator=generator),
                "server_error": torch.randn(layout.chunk_numel, generator=generator),
            }
            for key, layout in layouts.items()
        }
    return {"world_size": world_size, "topology": opt.compression.topology_description(), "buckets": buckets}


@pytest.mark.parametrize("world_size", [1, 2])
def test_error_feedback_restored_from_cpu_lives_on_the_parameters_device(world_size: int, agreed_backend: None) -> None:
    """R3: a checkpoint's error feedback (CPU tensors) is restored into buffers on the parameters' device, and the
    next exchange keeps those very buffers (it does not replace them by zeros)."""
    group = fake_process_group(world_size) if world_size > 1 else contextlib.nullcontext()
    with group, fake_cuda() as placement:
        params = _fake_params()
        opt = OnebitAdam(_groups(params), lr=1e-2, freeze_step=FREEZE, kernel_backend="torch",
                         dead_coordinates="ignore")
        for _ in range(FREEZE):
            _set_grads(params)
            opt.step()
        state = _cpu_error_feedback(opt)
        assert all(e["worker_error"].device.type == "cpu" for e in state["buckets"].values())
        assert opt.error_feedback_mismatch(state) is None
        opt.load_error_feedback_state_dict(state)
        restored = dict(opt.compression._buckets)
        assert restored.keys() == state["buckets"].keys()
        for key, buffers in restored.items():
            assert buffers.worker_error.device.type == "cuda", f"bucket {key}: restored on {buffers.worker_error.device}"
            assert buffers.server_error.device.type == "cuda"
        _set_grads(params)
        opt.step()  # a compressed step: the exchange must find the restored buffers in place
        for key, buffers in restored.items():
            assert opt.compression._buckets[key] is buffers, f"bucket {key}: the restored error feedback was replaced"
    assert not placement.errors
    copies = [t for t in placement.transfers if "load_error_feedback_state_dict" in t.where]
    assert len(copies) == 2 * len(restored), [str(t) for t in placement.transfers]  # worker and server, per bucket


def test_placement_detector_catches_r1_cpu_step_tensors(monkeypatch: pytest.MonkeyPatch) -> None:
    """R1 put back (``torch.tensor(float(t - 1))`` per parameter, on the CPU): the warmup's fused AdamW gets CPU
    step tensors next to CUDA parameters, which CUDA refuses (pytorch#111123). The detector must say so."""
    monkeypatch.setattr(functional_module, "_step_tensors",
                        lambda params, value: [torch.tensor(float(value)) for _ in params])
    with fake_cuda() as placement:
        params = _fake_params()
        opt = OnebitAdam(params, lr=1e-2, freeze_step=FREEZE, kernel_backend="torch")
        _set_grads(params)
        with pytest.raises(DeviceMixError) as caught:
            opt.step()
    message = str(caught.value)
    assert "_fused_adamw_" in message and "cpu" in message and "cuda" in message, message
    assert "functional.py" in message, message  # names the library line
    assert len(placement.errors) == 1
