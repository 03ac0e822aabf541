"""0/1 Adam (``ZeroOneAdam``).

* The variance-step and sync schedules match closed forms of the rules for 400 steps, and the DDP hook's per-step
  decision (``needs_gradient_allreduce``) follows them.
* On one process every step matches a reference written here from the paper's formulas (0/1 Adam, arXiv 2202.06009), in float64:
  momentum updated on compressed steps at world size 1 (DeepSpeed skipped it), no weight decay in the momentum after
  a sync (DeepSpeed leaked it), and an interval with ``lr = 0`` stays finite (DeepSpeed divided by zero).
* On 2 and 3 gloo ranks with different data: replicas bitwise identical after every step that communicates, different
  after local steps, zero bytes on local steps; a resume after ``synchronize()`` continues exactly.
* Under the Lightning strategy (``strategy="zeroone_adam"``): bf16, 16-mixed overflow, accumulation with masks, an
  LR schedule, the communication monitor, replica checks between syncs, and a ``keep`` resume that continues exactly.
"""

from __future__ import annotations

import copy
import math
from typing import Any, Callable

import pytest
import torch
from torch import nn
from torch.nn.parallel import DistributedDataParallel as DDP

import lightning.pytorch as pl
from lightning_onebit import ReplicaCheck, ZeroOneAdam
from lightning_onebit.hooks import GradientSyncState, switchable_allreduce_hook
from tests.distributed import run_distributed
from tests.lightning_models import Regressor, fit_save_and_resume, flat_params, loader, trainer_kwargs
from tests.optim_models import Net, rank_batch, two_groups


# ------------------------------------------------------------------------------------------------ schedules
def expected_variance_steps(kappa: int, var_freeze_step: int) -> set[int]:
    """Block ``k`` of variance steps is the ``kappa`` smallest multiples of ``2^k`` after the last step of block
    ``k - 1`` (block 0: steps 1..kappa), up to ``var_freeze_step``."""
    steps, last, k = set(), 0, 0
    while last < var_freeze_step:
        block = [t for t in range(last + 1, last + 1 + kappa * 2**k + 2**k) if t % 2**k == 0][:kappa]
        steps.update(t for t in block if t <= var_freeze_step)
        last, k = block[-1], k + 1
    return steps


def expected_sync(t: int, var_freeze_step: int, alpha: int, clipper: int) -> bool:
    """Local step ``j = t - var_freeze_step`` runs at interval ``min(H, 2^floor((j - 1) / alpha))``; it syncs when
    ``t`` is a multiple of it."""
    j = t - var_freeze_step
    return t % min(clipper, 2 ** ((j - 1) // alpha)) == 0


def test_schedules_match_the_formulas_for_400_steps() -> None:
    kappa, vfs, alpha, clipper = 4, 150, 10, 8
    net = nn.Linear(3, 1)
    opt = ZeroOneAdam(net.parameters(), lr=1e-3, var_freeze_step=vfs, var_update_scaler=kappa,
                      local_step_scaler=alpha, local_step_clipper=clipper)
    variance = expected_variance_steps(kappa, vfs)
    assert sorted(variance)[:kappa + 3] == [1, 2, 3, 4, 6, 8, 10]  # the first blocks, read off the rule
    x = torch.randn(4, 3)
    for t in range(1, 401):
        assert opt.needs_gradient_allreduce == (t in variance), f"step {t}: DDP hook decision"
        opt.zero_grad()
        net(x).sum().backward()
        opt.step()
        if t <= vfs:
            want = "variance" if t in variance else "compressed"
        else:
            want = "sync" if expected_sync(t, vfs, alpha, clipper) else "local"
        assert opt.last_step_kind == want, f"step {t}"
    assert opt.variance_updates == len(variance)
    kinds = opt.steps_by_kind
    assert kinds["variance"] == len(variance) and kinds["variance"] + kinds["compressed"] == vfs
    assert kinds["local"] > 0 and kinds["sync"] + kinds["local"] == 400 - vfs


@pytest.mark.parametrize(
    "kwargs, message",
    [
        (dict(var_freeze_step=0), "var_freeze_step"),
        (dict(var_update_scaler=2.5), "var_update_scaler"),
        (dict(local_step_scaler=True), "local_step_scaler"),
        (dict(local_step_clipper=-1), "local_step_clipper"),
        (dict(amsgrad=True), "amsgrad"),
    ],
)
def test_bad_arguments_are_refused(kwargs: dict[str, Any], message: str) -> None:
    with pytest.raises(ValueError, match=message):
        ZeroOneAdam(Net().parameters(), **kwargs)


def test_the_schedule_left_to_the_run_is_scaled_to_its_length() -> None:
    """``var_update_scaler``, ``var_freeze_step`` and ``local_step_scaler`` default to ``None``: DeepSpeed's 16, 100000
    and 32678 until the run's length is known (a run shorter than 100000 steps then never took a local step), and
    scaled to it by ``fit_schedule_to_run``: the first tenth of the run all variance steps, the variance frozen at half
    the run, the local-step interval at its largest a quarter of the way into the rest. Given arguments are kept; an
    unknown length is refused, naming them."""
    opt = ZeroOneAdam(Net().parameters())
    assert (opt.var_update_scaler, opt.var_freeze_step, opt.local_step_scaler, opt.freeze_step) == (16, 100000, 32678,
                                                                                                    16)
    assert opt.fit_schedule_to_run(620) == (
        "var_update_scaler 62, var_freeze_step 310, local_step_scaler 39 (scaled to 620 steps)"
    )
    # 310 local steps; intervals 1, 2 -> 4; the first 62 steps are the warmup (no compression)
    assert (opt.var_update_scaler, opt.var_freeze_step, opt.local_step_scaler, opt.freeze_step) == (62, 310, 39, 62)
    assert opt.local_step_clipper == 4
    with pytest.raises(ValueError, match="scales local_step_scaler, var_freeze_step, var_update_scaler to the run"):
        opt.fit_schedule_to_run(None)
    short = ZeroOneAdam(Net().parameters(), local_step_clipper=4)
    short.fit_schedule_to_run(24)
    assert (short.var_update_scaler, short.var_freeze_step, short.local_step_scaler) == (2, 12, 2)  # 2 doublings
    tiny = ZeroOneAdam(Net().parameters(), var_freeze_step=3)
    tiny.fit_schedule_to_run(100)
    assert (tiny.var_update_scaler, tiny.var_freeze_step, tiny.freeze_step) == (10, 3, 3)  # no step past the freeze
    given = ZeroOneAdam(Net().parameters(), var_freeze_step=50, var_update_scaler=16, local_step_scaler=7)
    assert given.fit_schedule_to_run(620) is None and given.fit_schedule_to_run(None) is None
    assert (given.var_update_scaler, given.var_freeze_step, given.local_step_scaler, given.freeze_step) == (16, 50, 7,
                                                                                                          16)
    half = ZeroOneAdam(Net().parameters(), var_freeze_step=300, var_update_scaler=16, local_step_clipper=16)
    assert half.fit_schedule_to_run(620) == (
        "var_update_scaler 16, var_freeze_step 300, local_step_scaler 20 (scaled to 620 steps)"
    )


# ------------------------------------------------------------------------------------------------ reference
KAPPA, VFS, ALPHA, CLIPPER = 3, 14, 3, 4


def _lr_at(t: int) -> float:
    """1e-2, except 0 for steps 25..28: a whole sync interval (4) without learning rate."""
    return 0.0 if 25 <= t <= 28 else 1e-2


def _reference_zeroone(steps: int, wd: float, bias_correction: bool) -> list[list[torch.Tensor]]:
    """0/1 Adam from the formulas in float64 on one process (the compressed allreduce of one rank is the identity)."""
    b1, b2, eps = 0.9, 0.999, 1e-8
    model = Net().double()
    params = [p.detach().clone() for p in model.parameters()]
    m = [torch.zeros_like(p) for p in params]
    v = [torch.zeros_like(p) for p in params]
    variance_steps, n = expected_variance_steps(KAPPA, VFS), 0
    synced = update = None
    lr_sum, decay = 0.0, 1.0
    history = []
    for t in range(1, steps + 1):
        with torch.no_grad():
            for q, p in zip(model.parameters(), params):
                q.copy_(p)
        model.zero_grad()
        x, y = rank_batch(0, t)
        nn.functional.mse_loss(model(x.double()), y.double()).backward()
        grads = [q.grad for q in model.parameters()]
        lr = _lr_at(t)
        bc1 = 1 - b1**t if bias_correction else 1.0
        if t in variance_steps:
            n += 1
            v = [b2 * vi + (1 - b2) * g * g for vi, g in zip(v, grads)]
        bc2 = 1 - b2**n if bias_correction else 1.0
        m = [b1 * mi + (1 - b1) * g for mi, g in zip(m, grads)]
        denominators = [vi.sqrt() / math.sqrt(bc2) + eps for vi in v]
        params = [p * (1 - lr * wd) - lr / bc1 * mi / d for p, mi, d in zip(params, m, denominators)]
        if t > VFS:
            if synced is None:
                synced = [p.clone() for p in history[-1]]
                update = [torch.zeros_like(p) for p in params]
            update = [u + lr / bc1 * mi for u, mi in zip(update, m)]
            lr_sum, decay = lr_sum + lr, decay * (1 - lr * wd)
            if expected_sync(t, VFS, ALPHA, CLIPPER):
                if lr_sum == 0:
                    params = [s.clone() for s in synced]  # nothing moved; the momenta are averaged as they are
                else:
                    m = [bc1 * u / lr_sum for u in update]  # no weight decay in the momentum
                    params = [s * decay - u / d for s, u, d in zip(synced, update, denominators)]
                synced, update = [p.clone() for p in params], [torch.zeros_like(p) for p in params]
                lr_sum, decay = 0.0, 1.0
        history.append(params)
    return history


@pytest.mark.parametrize("kernel_backend", ["auto", "torch"])  # torch: the frozen denominators are cached
@pytest.mark.parametrize("bias_correction", [True, False])
def test_every_phase_matches_a_reference_from_the_formulas(bias_correction: bool, kernel_backend: str) -> None:
    steps, wd = 40, 0.1
    net = Net()
    opt = ZeroOneAdam(net.parameters(), lr=1e-2, weight_decay=wd, bias_correction=bias_correction,
                      var_freeze_step=VFS, var_update_scaler=KAPPA, local_step_scaler=ALPHA,
                      local_step_clipper=CLIPPER, kernel_backend=kernel_backend)
    reference = _reference_zeroone(steps, wd, bias_correction)
    # without bias correction the early variance is tiny and the steps large (~0.3): float32 rounding grows to ~5e-5
    tolerance = 2e-6 if bias_correction else 1e-4
    kinds = []
    for t in range(1, steps + 1):
        for group in opt.param_groups:
            group["lr"] = _lr_at(t)
        opt.zero_grad()
        x, y = rank_batch(0, t)
        nn.functional.mse_loss(net(x), y).backward()
        opt.step()
        kinds.append(opt.last_step_kind)
        for p, q in zip(net.parameters(), reference[t - 1]):
            torch.testing.assert_close(p.detach().double(), q, rtol=0, atol=tolerance, msg=f"step {t} ({kinds[-1]})")
    assert {"variance", "compressed", "local", "sync"} <= set(kinds)
    assert opt.replicas_in_sync == (kinds[-1] != "local")
    # a coordinate whose variance is zero never moved, although 1-bit noise would have moved it
    torch.testing.assert_close(net.unused_scale.detach(), torch.ones(3) * (1 - 1e-2 * wd) ** (steps - 4))


@pytest.mark.parametrize("kernel_backend", ["auto", "torch"])
def test_no_host_sync_in_any_step_after_the_warmup(kernel_backend: str) -> None:
    """Variance, compressed, local and sync steps (and the AdamW step of a compress=False group) read no device value
    on the host: the zero-variance masks are kept as tensors (no ``bool(zero.any())`` per parameter after each
    variance step), the schedules are Python numbers."""
    from tests.detectors import count_host_syncs

    net = Net()
    opt = ZeroOneAdam(
        [{"params": [p for p in net.parameters() if p is not net.head.bias]},
         {"params": [net.head.bias], "compress": False}],
        lr=1e-2, weight_decay=0.1, var_freeze_step=VFS, var_update_scaler=KAPPA, local_step_scaler=ALPHA,
        local_step_clipper=CLIPPER, kernel_backend=kernel_backend,
    )
    kinds = []
    for t in range(1, 41):
        opt.zero_grad()
        x, y = rank_batch(0, t)
        nn.functional.mse_loss(net(x), y).backward()
        with count_host_syncs() as syncs:
            opt.step()
        kinds.append(opt.last_step_kind)
        if t > KAPPA:
            assert syncs.count == 0, f"step {t} ({kinds[-1]}): {syncs.summary()}"
    assert {"variance", "compressed", "local", "sync"} <= set(kinds[KAPPA:])
    # the parameter whose variance is zero stayed at rest (weight decay aside)
    torch.testing.assert_close(net.unused_scale.detach(), torch.ones(3) * (1 - 1e-2 * 0.1) ** 40)


def test_the_gradient_exchange_matches_the_momentum_exchange_on_one_rank_across_bucket_rebuilds() -> None:
    """On one rank the 1-bit average is the identity, so ``exchange="gradient"`` (``m = b1 m + (1 - b1) avg(g)``) and
    ``"momentum"`` (``m = avg(b1 m + (1 - b1) g)``) take the same bits. The gradients' buffers are laid out once per
    bucket layout: a layer frozen and unfrozen in the 1-bit steps rebuilds the buckets, and they follow; a missing
    gradient counts as zero; the buffers are freed when the local steps begin."""
    nets = [Net(), Net()]
    nets[1].load_state_dict(nets[0].state_dict())
    opts = [ZeroOneAdam(net.parameters(), lr=1e-2, var_freeze_step=VFS, var_update_scaler=KAPPA,
                        local_step_scaler=ALPHA, local_step_clipper=CLIPPER, exchange=exchange)
            for net, exchange in zip(nets, ("momentum", "gradient"))]
    gradient = opts[1].gradient_buffers
    kinds, layouts = [], []
    for t in range(1, VFS + 3):
        for net, opt in zip(nets, opts):
            first = list(net.parameters())[0]
            first.requires_grad_(t not in (KAPPA + 2, KAPPA + 3))  # frozen for two 1-bit steps
            opt.zero_grad()
            x, y = rank_batch(0, t)
            nn.functional.mse_loss(net(x), y).backward()
            if t == KAPPA + 6:
                list(net.parameters())[-1].grad = None  # a missing gradient: a zero one
            opt.step()
        kinds.append(opts[1].last_step_kind)
        for a, b in zip(nets[0].parameters(), nets[1].parameters()):
            assert torch.equal(a, b), t
        if kinds[-1] == "compressed":
            assert [layout for _, _, layout in gradient.items] == list(opts[1].bucket_layouts().values()), t
            layouts.append(len(gradient.params))
    assert "compressed" in kinds and kinds[-1] in ("local", "sync")
    assert len(set(layouts)) == 2  # laid out again for the buckets without the frozen layer, and with it
    assert gradient is not opts[1].gradient_buffers and not opts[1].gradient_buffers.items  # freed


def test_state_dict_between_syncs_warns_until_synchronize() -> None:
    import warnings

    net = Net()
    opt = ZeroOneAdam(net.parameters(), lr=1e-2, var_freeze_step=VFS, var_update_scaler=KAPPA,
                      local_step_scaler=ALPHA, local_step_clipper=CLIPPER)
    for t in range(1, 20):  # step 19: a local step at interval 2
        opt.zero_grad()
        x, y = rank_batch(0, t)
        nn.functional.mse_loss(net(x), y).backward()
        opt.step()
    assert opt.last_step_kind == "local" and not opt.replicas_in_sync
    with pytest.warns(UserWarning, match="ZeroOneAdam.state_dict.. after 1 local step.*synchronize") as record:
        opt.state_dict()
    assert record[0].filename == __file__  # the warning points at the caller of state_dict()
    assert opt.synchronize() and opt.replicas_in_sync and opt.forced_syncs == 1
    assert not opt.synchronize()  # nothing left to sync
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        saved = opt.state_dict()
    assert saved["onebit"]["zeroone"]["local_steps_since_sync"] == 0


def test_a_load_replays_the_schedule_with_the_codes_arguments_and_restores_the_sums(caplog) -> None:
    """The checkpoint holds the local steps' sums and the schedule's arguments; a load replays the schedule to the
    loaded step with the loading optimizer's arguments (logging the checkpoint's when they differ) and restores the
    sums."""
    net = Net()
    opt = ZeroOneAdam(net.parameters(), lr=1e-2, var_freeze_step=VFS, var_update_scaler=KAPPA,
                      local_step_scaler=ALPHA, local_step_clipper=CLIPPER)
    for t in range(1, 20):
        opt.zero_grad()
        x, y = rank_batch(0, t)
        nn.functional.mse_loss(net(x), y).backward()
        opt.step()
    opt.synchronize()
    saved = copy.deepcopy(opt.state_dict())
    assert saved["onebit"]["zeroone"] == dict(
        lr_sum=[0.0] * len(opt.param_groups), decay=[1.0] * len(opt.param_groups), local_steps_since_sync=0,
        schedule_arguments=dict(var_freeze_step=VFS, var_update_scaler=KAPPA, local_step_scaler=ALPHA,
                                local_step_clipper=CLIPPER))
    other = ZeroOneAdam(Net().parameters(), lr=1e-2, var_freeze_step=VFS, var_update_scaler=KAPPA,
                        local_step_scaler=ALPHA + 1, local_step_clipper=CLIPPER)
    fresh = ZeroOneAdam(Net().parameters(), lr=1e-2, var_freeze_step=VFS, var_update_scaler=KAPPA,
                        local_step_scaler=ALPHA + 1, local_step_clipper=CLIPPER)
    fresh.schedule.replay(19)
    with caplog.at_level("INFO", logger="lightning_onebit.optim.checkpoint"):
        other.load_state_dict(saved)
    assert f"saved with schedule arguments {saved['onebit']['zeroone']['schedule_arguments']}" in caplog.text
    assert f"local_step_scaler': {ALPHA + 1}" in caplog.text  # the code's go on
    assert (other.step_count, other.var_interval, other.local_step_interval, other.variance_updates) == (
        19, fresh.var_interval, fresh.local_step_interval, fresh.variance_updates)
    assert other.local_steps.lr_sum == [0.0] * len(other.param_groups) and other.local_steps_since_sync == 0
    saved["onebit"]["zeroone"].update(lr_sum=[0.5] * len(opt.param_groups), local_steps_since_sync=1)
    caplog.clear()
    opt.load_state_dict(saved)  # its own arguments: nothing logged
    assert "schedule arguments" not in caplog.text
    assert opt.local_steps.lr_sum == [0.5] * len(opt.param_groups) and opt.local_steps_since_sync == 1
    assert not opt.replicas_in_sync


# ------------------------------------------------------------------------------------------------ distributed
D_VFS, D_STEPS, D_SAVE_AT = 12, 34, 22


def _train(rank: int, steps: range, state: Any = None, exchange: str = "momentum") -> dict[str, Any]:
    net = Net()
    ddp = DDP(net, bucket_cap_mb=0.001)
    opt = ZeroOneAdam(two_groups(net, 0.01), lr=1e-2, var_freeze_step=D_VFS, var_update_scaler=3, local_step_scaler=3,
                      local_step_clipper=4, exchange=exchange)
    sync = GradientSyncState(sync_predicate=lambda: opt.needs_gradient_allreduce)
    ddp.register_comm_hook(sync, switchable_allreduce_hook)
    # the second group's lr is 0 for steps 25-28, a whole sync interval
    scheduler = torch.optim.lr_scheduler.LambdaLR(opt, [lambda i: 1.0, lambda i: 0.0 if 24 <= i <= 27 else 1.0])
    if state is not None:
        net.load_state_dict(state["model"])
        opt.load_state_dict(state["optimizer"])
        scheduler.load_state_dict(state["scheduler"])
        opt.load_error_feedback_state_dict(state["error_feedback"])
    out: dict[str, Any] = dict(after=[], kinds=[], bytes=[], allreduce=[], saved=None)
    for t in steps:
        opt.zero_grad()
        out["allreduce"].append(opt.needs_gradient_allreduce)
        before = opt.communication.bytes_sent + sync.counters.bytes_sent
        x, y = rank_batch(ddp.process_group.rank(), t)
        nn.functional.mse_loss(ddp(x), y).backward()
        opt.step()
        scheduler.step()
        out["bytes"].append(opt.communication.bytes_sent + sync.counters.bytes_sent - before)
        out["kinds"].append(opt.last_step_kind)
        out["after"].append(torch.cat([p.detach().reshape(-1).clone() for p in net.parameters()]))
        if t == D_SAVE_AT:
            params = [p for group in opt.param_groups for p in group["params"]]
            out["before_sync"] = dict(
                updates=[opt.state[p]["update_since_sync"].clone() for p in params],
                lr_sums=[opt.local_steps.lr_sum[i] for i, group in enumerate(opt.param_groups) for _ in group["params"]],
                error_feedback=copy.deepcopy(opt.error_feedback_state_dict()),
            )
            out["synchronized"] = opt.synchronize()
            out["momenta_after_sync"] = [opt.state[p]["exp_avg"].clone() for p in params]
            out["error_feedback_after_sync"] = copy.deepcopy(opt.error_feedback_state_dict())
            out["after_sync"] = torch.cat([p.detach().reshape(-1).clone() for p in net.parameters()])
            out["saved"] = dict(model={k: v.clone() for k, v in net.state_dict().items()},
                                optimizer=copy.deepcopy(opt.state_dict()), scheduler=scheduler.state_dict(),
                                error_feedback=opt.error_feedback_state_dict())
    out["forced_syncs"] = opt.forced_syncs
    return out


def scenario_ranks(rank: int, world_size: int) -> dict[str, Any]:
    out = dict(
        full=_train(rank, range(1, D_STEPS + 1)), gradient=_train(rank, range(1, D_STEPS + 1), exchange="gradient")
    )
    out["resumed"] = _train(rank, range(D_SAVE_AT + 1, D_STEPS + 1), state=out["full"]["saved"])
    return out


@pytest.mark.parametrize("world_size", [2, 3])
def test_replicas_identical_after_every_sync_local_steps_silent_resume_exact(world_size: int) -> None:
    results = run_distributed(scenario_ranks, world_size, timeout_s=240)
    for variant in ("full", "gradient"):  # exchange="momentum" (default) and "gradient" (DeepSpeed's form)
        _check_replicas([r[variant] for r in results])
    full = [r["full"] for r in results]
    kinds = full[0]["kinds"]
    # the two forms are the same update in exact arithmetic, with different compression errors
    assert full[0]["kinds"] == results[0]["gradient"]["kinds"]
    assert not torch.equal(full[0]["after"][-1], results[0]["gradient"]["after"][-1])
    # synchronize() between syncs made them identical; the resumed run continues exactly
    assert all(r["synchronized"] for r in full) and all(r["forced_syncs"] == 1 for r in full)
    assert all(torch.equal(full[0]["after_sync"], r["after_sync"]) for r in full[1:])
    # ... in full precision: the momentum it sets is the exact mean of every rank's accumulated update over the summed
    # lr (a 1-bit sync would add the compression error of the last interval), and the error feedback is left as it was
    bc1 = 1 - 0.9**D_SAVE_AT
    for index, lr_sum in enumerate(full[0]["before_sync"]["lr_sums"]):
        mean = torch.stack([r["before_sync"]["updates"][index].double() for r in full]).mean(0)
        for r in full:
            torch.testing.assert_close(r["momenta_after_sync"][index].double(), mean * bc1 / lr_sum, rtol=1e-6,
                                       atol=1e-9)
    for r in full:
        before, after = r["before_sync"]["error_feedback"], r["error_feedback_after_sync"]
        assert repr(before.keys()) == repr(after.keys())
        _assert_same_tensors(before, after)
    for r in results:
        resumed = r["resumed"]["after"]
        assert len(resumed) == D_STEPS - D_SAVE_AT
        for a, b in zip(resumed, r["full"]["after"][D_SAVE_AT:]):
            assert torch.equal(a, b), "the resumed run differs from the uninterrupted one"
        assert r["resumed"]["kinds"] == kinds[D_SAVE_AT:]


def _assert_same_tensors(a: Any, b: Any) -> None:
    if isinstance(a, torch.Tensor):
        assert torch.equal(a, b)
    elif isinstance(a, dict):
        assert a.keys() == b.keys()
        for key in a:
            _assert_same_tensors(a[key], b[key])
    elif isinstance(a, (list, tuple)):
        assert len(a) == len(b)
        for x, y in zip(a, b):
            _assert_same_tensors(x, y)
    else:
        assert a == b


def _check_replicas(full: list[dict[str, Any]]) -> None:
    """Identical after every step that communicates, different after some local step, silent on local steps."""
    kinds = full[0]["kinds"]
    assert all(r["kinds"] == kinds for r in full)
    assert {"variance", "compressed", "local", "sync"} <= set(kinds)
    assert kinds[D_SAVE_AT - 1] == "local", "the save must fall between two syncs to test synchronize()"
    diverged = 0
    for step, kind in enumerate(kinds):
        ranks = [r["after"][step] for r in full]
        same = all(torch.equal(ranks[0], x) for x in ranks[1:])
        assert torch.isfinite(ranks[0]).all(), f"step {step + 1} ({kind})"
        if kind == "local":
            diverged += not same
            assert all(r["bytes"][step] == 0 for r in full), f"step {step + 1}: a local step sent bytes"
        else:
            assert same, f"replicas differ after step {step + 1} ({kind})"
            assert all(r["bytes"][step] > 0 for r in full)
        assert all(r["allreduce"][step] == (kind == "variance") for r in full)
    assert diverged > 0, "local steps should leave the replicas different (each rank has its own data)"
    variance_bytes = max(b for b, k in zip(full[0]["bytes"], kinds) if k == "variance")
    compressed_bytes = max(b for b, k in zip(full[0]["bytes"], kinds) if k in ("compressed", "sync"))
    assert compressed_bytes < variance_bytes / 3


# ------------------------------------------------------------------------------------------------ Lightning
class ZeroOneRegressor(Regressor):
    """``Regressor`` with ``ZeroOneAdam`` (var_update_scaler 2, var_freeze_step 4, local steps doubling every 2 up
    to 4), recording each step's kind and this rank's cumulative bytes."""

    def __init__(self, default_schedule: bool = False, **kwargs: Any) -> None:
        super().__init__(**kwargs)
        self.default_schedule = default_schedule  # the library's schedule defaults, scaled to the run

    def configure_optimizers(self) -> Any:
        schedule = {} if self.default_schedule else dict(var_freeze_step=4, var_update_scaler=2, local_step_scaler=2,
                                                         local_step_clipper=4)
        opt = ZeroOneAdam(self.parameters(), lr=self.lr, weight_decay=self.weight_decay, **schedule)
        if self.lr_lambda_zero_from is None:
            return opt
        zero_from = self.lr_lambda_zero_from
        scheduler = torch.optim.lr_scheduler.LambdaLR(opt, lambda i: 0.0 if i >= zero_from else 1.0)
        return {"optimizer": opt, "lr_scheduler": {"scheduler": scheduler, "interval": "step"}}

    def validation_step(self, batch: Any, batch_idx: int) -> None:
        if batch_idx == 0:  # the replica this rank validates, after the optimizer step it follows
            self.__dict__.setdefault("validated", []).append((self.global_step, flat_params(self)))

    def optimizer_step(self, *args: Any, **kwargs: Any) -> None:
        super().optimizer_step(*args, **kwargs)
        opt = self.trainer.strategy.onebit_optimizer
        self.records[-1]["kind"] = opt.last_step_kind
        self.records[-1]["bytes_total"] = self.trainer.strategy.communication.bytes_sent


def _zeroone_fit(rank: int, world_size: int, workdir: str, **kwargs: Any) -> dict[str, Any]:
    model_kwargs = kwargs.pop("model_kwargs", {})
    callbacks = kwargs.pop("callbacks", [])
    ckpt_path = kwargs.pop("ckpt_path", None)
    n_batches = kwargs.pop("n_batches", 14)
    validate = kwargs.pop("validate", False)
    model = ZeroOneRegressor(**model_kwargs)
    check = ReplicaCheck(every_n_steps=1)
    trainer = pl.Trainer(**trainer_kwargs(world_size, kwargs.pop("max_steps", 14), callbacks=[check, *callbacks],
                                          **kwargs))
    trainer.fit(model, loader(rank, n_batches), val_dataloaders=loader(rank, 2) if validate else None,
                ckpt_path=ckpt_path)
    opt = trainer.strategy.onebit_optimizer
    records = [r for r in model.records if "kind" in r]  # (a skipped fp16 step records no kind)
    return dict(
        final=flat_params(model), checks=check.checks, step_count=opt.step_count, losses=model.losses,
        kinds=[r["kind"] for r in records], bytes_total=[r["bytes_total"] for r in records],
        params_after=[r["params_after"] for r in records], lrs=[r["lr"] for r in model.records],
        fallback=trainer.strategy.overlap_fallback_reason, in_sync=opt.replicas_in_sync,
        metrics={k: float(v) for k, v in trainer.callback_metrics.items()},
        validated=getattr(model, "validated", []), forced_syncs=opt.forced_syncs,
    )


def _error_of(fn: Callable[[], Any]) -> str:
    try:
        fn()
    except ValueError as err:
        return str(err)
    return "no error"


def scenario_zeroone_lightning(rank: int, world_size: int, workdir: str) -> dict[str, Any]:
    import os

    from lightning.pytorch.plugins.precision import MixedPrecision

    from lightning_onebit import CommunicationMonitor, ErrorFeedbackCheckpoint, MomentumMask, OnebitStrategy

    out: dict[str, Any] = {}
    out["bf16"] = _zeroone_fit(rank, world_size, workdir, strategy="zeroone_adam", precision="bf16-mixed",
                               callbacks=[CommunicationMonitor()], model_kwargs=dict(weight_decay=0.01))
    scaler = torch.amp.GradScaler("cpu", init_scale=2.0**8)
    out["fp16"] = _zeroone_fit(rank, world_size, workdir, plugins=[MixedPrecision("16-mixed", "cpu", scaler=scaler)],
                               model_kwargs=dict(inf_at_step=9, inf_rank=1))
    out["accumulation"] = _zeroone_fit(
        rank, world_size, workdir, accumulate_grad_batches=2, n_batches=28,
        callbacks=[MomentumMask({"l1.bias": torch.zeros(8)}), CommunicationMonitor()],
        model_kwargs=dict(lr_lambda_zero_from=10),
    )
    # the library's schedule defaults, scaled by the strategy to a 40-step run: variance frozen at 20, local steps
    out["scaled"] = _zeroone_fit(rank, world_size, workdir, max_steps=40, n_batches=40,
                                 model_kwargs=dict(default_schedule=True))
    # a validation every 3 steps: some fall between syncs
    out["validated"] = _zeroone_fit(rank, world_size, workdir, validate=True, val_check_interval=3)
    out["auto_mask_refused"] = _error_of(
        lambda: _zeroone_fit(rank, world_size, workdir, callbacks=[MomentumMask(auto=True)])
    )
    out["overlap_true_refused"] = _error_of(
        lambda: _zeroone_fit(rank, world_size, workdir, strategy=OnebitStrategy(overlap=True))
    )

    # 5 steps per epoch: the saves after steps 5, 10 and 15 fall between syncs (interval 4 from step 9 on) at 10 and 15
    common = dict(max_steps=-1, max_epochs=3, n_batches=5, model_kwargs=dict(data_seed=5), enable_checkpointing=True)
    out.update(fit_save_and_resume(lambda **kwargs: _zeroone_fit(rank, world_size, workdir, **kwargs), workdir,
                                   **common))
    reset = ErrorFeedbackCheckpoint("reset")
    out["reset"] = _zeroone_fit(rank, world_size, workdir, callbacks=[reset],
                                ckpt_path=os.path.join(workdir, "full", "epoch=1.ckpt"), **common)
    out["reset"]["restored"] = reset.restored
    return out


@pytest.fixture(scope="module")
def lightning_session(tmp_path_factory: pytest.TempPathFactory) -> list[dict[str, Any]]:
    from tests.distributed import run_scenarios

    workdir = tmp_path_factory.mktemp("zeroone")
    return run_distributed(run_scenarios, 2, (("zeroone", scenario_zeroone_lightning),), str(workdir), timeout_s=300)


def _results(session: list[dict[str, Any]], name: str) -> list[Any]:
    from tests.distributed import scenario_results

    return [r[name] for r in scenario_results(session, "zeroone")]


def test_lightning_bf16_local_steps_silent_replica_checks_wait_for_syncs(
    lightning_session: list[dict[str, Any]],
) -> None:
    results = _results(lightning_session, "bf16")
    for r in results:
        assert r["step_count"] == 14 and "ZeroOneAdam" in r["fallback"]
        assert {"variance", "compressed", "local", "sync"} <= set(r["kinds"])
        sent = [b - a for a, b in zip([0, *r["bytes_total"]], r["bytes_total"])]
        assert all((n == 0) == (kind == "local") for n, kind in zip(sent, r["kinds"])), list(zip(sent, r["kinds"]))
        # ReplicaCheck(every_n_steps=1) checked after every step that left the replicas in sync, and only then
        assert r["checks"] == sum(kind != "local" for kind in r["kinds"])
        assert r["metrics"]["comm/stage"] == 1.0 and r["in_sync"]
    # fit ended with a sync: the replicas are identical even though the last step was a local one
    assert results[0]["kinds"][-1] == "local"
    assert torch.equal(results[0]["final"], results[1]["final"])


def test_lightning_scales_the_default_schedule_to_the_run(lightning_session: list[dict[str, Any]]) -> None:
    """``ZeroOneAdam()`` with its schedule defaults under the strategy, in a 40-step run: the first 4 steps (a tenth)
    update the variance (``var_update_scaler``), then every second step, then every fourth, until it is frozen at
    step 20 (half the run), and local steps follow, silent between syncs; with DeepSpeed's fixed defaults every step
    of such a run would have been a variance step."""
    for r in _results(lightning_session, "scaled"):
        assert r["step_count"] == 40
        variance_steps = [t for t, kind in enumerate(r["kinds"], 1) if kind == "variance"]
        assert variance_steps == [1, 2, 3, 4, 6, 8, 10, 12, 16, 20], r["kinds"]
        assert set(r["kinds"][20:]) == {"local", "sync"}, r["kinds"]
        sent = [b - a for a, b in zip([0, *r["bytes_total"]], r["bytes_total"])]
        assert all(n == 0 for n, kind in zip(sent, r["kinds"]) if kind == "local")


def test_lightning_validates_the_replica_the_ranks_share(lightning_session: list[dict[str, Any]]) -> None:
    """A validation after a local step syncs the replicas first (the metrics are then those of one model, the one a
    checkpoint would hold); a validation after a sync costs nothing."""
    results = _results(lightning_session, "validated")
    kinds = results[0]["kinds"]
    steps = [step for step, _ in results[0]["validated"]]
    assert steps == [3, 6, 9, 12]
    after_local = [step for step in steps if kinds[step - 1] == "local"]
    assert after_local, kinds  # at least one validation falls between syncs
    at_end = kinds[-1] == "local"  # fit ends with a sync too
    assert all(r["forced_syncs"] == len(after_local) + at_end for r in results), (kinds, after_local)
    for (step, a), (_, b) in zip(results[0]["validated"], results[1]["validated"]):
        assert torch.equal(a, b), f"the ranks validated different replicas after step {step}"


def test_lightning_fp16_overflow_on_one_rank_skips_the_step_on_both(lightning_session: list[dict[str, Any]]) -> None:
    results = _results(lightning_session, "fp16")
    for r in results:
        assert r["step_count"] == 14 - 1 and torch.isfinite(r["final"]).all()
    assert results[0]["kinds"] == results[1]["kinds"]
    assert torch.equal(results[0]["final"], results[1]["final"])


def test_lightning_accumulation_explicit_mask_and_lr_schedule(lightning_session: list[dict[str, Any]]) -> None:
    results = _results(lightning_session, "accumulation")
    for r in results:
        assert r["step_count"] == 14 and set(r["lrs"][10:]) == {0.0} and r["lrs"][0] > 0
        # the masked l1.bias (flat indices 48..55) does not move after the warmup (steps 1-2), in any kind of step
        biases = [p[48:56] for p in r["params_after"]]
        assert all(torch.equal(biases[1], b) for b in biases[2:])
        assert not torch.equal(r["params_after"][1], r["params_after"][-1])
        assert torch.isfinite(r["final"]).all()
    assert torch.equal(results[0]["final"], results[1]["final"])


def test_lightning_refuses_auto_masks_and_forced_overlap(lightning_session: list[dict[str, Any]]) -> None:
    for message in _results(lightning_session, "auto_mask_refused"):
        assert "MomentumMask(auto=True) does not apply to ZeroOneAdam" in message and "Remove auto=True" in message
    for message in _results(lightning_session, "overlap_true_refused"):
        assert "overlap=True" in message and "ZeroOneAdam decides in optimizer.step" in message


def test_lightning_checkpoint_syncs_keep_resume_continues_exactly_reset_resumes(
    lightning_session: list[dict[str, Any]],
) -> None:
    fulls, resumed = _results(lightning_session, "full"), _results(lightning_session, "resumed")
    assert fulls[0]["kinds"][9] == "local", "the save after step 10 must fall between syncs"
    for full, again in zip(fulls, resumed):
        assert again["restored"] is True
        assert torch.equal(again["final"], full["final"])
        assert again["losses"] == full["losses"][-len(again["losses"]):]
        assert again["kinds"] == full["kinds"][10:]
    assert torch.equal(fulls[0]["final"], fulls[1]["final"])
    # reset: the error feedback restarts from zero; training goes on, replicas identical, no longer the same bits
    resets = _results(lightning_session, "reset")
    assert all(r["restored"] is False and torch.isfinite(r["final"]).all() for r in resets)
    assert torch.equal(resets[0]["final"], resets[1]["final"])
    assert not torch.equal(resets[0]["final"], fulls[0]["final"])
