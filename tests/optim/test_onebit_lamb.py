"""1-bit LAMB (``OnebitLamb``).

* Warmup is LAMB: it matches a reference written here from the paper's formulas (1-bit LAMB, arXiv 2104.06069), to 1e-6, with and
  without bias correction and weight decay, across param groups.
* An all-zero momentum tensor gets ``scaling_coeff = 1`` (DeepSpeed divided by zero), and training stays finite.
* On 2 and 3 gloo ranks with different data, replicas are bitwise identical after every step; starting each bucket's
  exchange during backward (``OverlapState``) gives the same bits as exchanging in ``step``; a resume mid-stage from
  the optimizer state and this rank's error feedback continues exactly.
* Under the Lightning strategy (``bf16-mixed``) it trains with replicas identical at every step.
"""

from __future__ import annotations

import copy
import math
from typing import Any, Optional

import pytest
import torch
from torch import nn
from torch.nn.parallel import DistributedDataParallel as DDP

import lightning.pytorch as pl
from lightning_onebit import OnebitLamb, ReplicaCheck, kernels
from lightning_onebit.optim.functional import adam_step_bound
from lightning_onebit.hooks import GradientSyncState, OverlapState, overlapped_exchange_hook, switchable_allreduce_hook
from tests.distributed import run_distributed
from tests.lightning_models import Regressor, fit_save_and_resume, flat_params, loader, trainer_kwargs
from tests.optim_models import Net, rank_batch, two_groups
from tests.tensors import exact_sqrt


# ------------------------------------------------------------------------------------------------ warmup reference
def _reference_lamb(net: Net, steps: int, lr: float, wd: float, bias_correction: bool) -> list[torch.Tensor]:
    """LAMB from the formulas, in float64, on the same batches (rank 0's)."""
    b1, b2, eps, max_coeff, min_coeff = 0.9, 0.999, 1e-8, 10.0, 0.01
    params = [p.detach().double().clone() for p in net.parameters()]
    groups = two_groups(net, wd)
    settings = {}
    for group in groups:
        for p in group["params"]:
            settings[id(p)] = (group.get("lr", lr), group.get("weight_decay", 0.0))
    ids = [id(p) for p in net.parameters()]
    m = [torch.zeros_like(p) for p in params]
    v = [torch.zeros_like(p) for p in params]
    model = Net().double()
    for t in range(1, steps + 1):
        with torch.no_grad():
            for q, p in zip(model.parameters(), params):
                q.copy_(p)
        model.zero_grad()
        x, y = rank_batch(0, t)
        nn.functional.mse_loss(model(x.double()), y.double()).backward()
        for i, q in enumerate(model.parameters()):
            g = q.grad
            lr_i, wd_i = settings[ids[i]]
            m[i] = b1 * m[i] + (1 - b1) * g
            v[i] = b2 * v[i] + (1 - b2) * g * g
            bc1, bc2 = (1 - b1**t, 1 - b2**t) if bias_correction else (1.0, 1.0)
            u = (m[i] / bc1) / (exact_sqrt(v[i] / bc2) + eps) + wd_i * params[i]
            pn, un = float(params[i].norm()), float(u.norm())
            r = 1.0 if pn == 0 or un == 0 else min(max(pn / un, min_coeff), max_coeff)
            params[i] = params[i] - lr_i * r * u
    return params


@pytest.mark.parametrize("bias_correction", [True, False])
def test_warmup_matches_a_lamb_reference(bias_correction: bool) -> None:
    net, steps, lr, wd = Net(), 12, 1e-3, 0.05
    opt = OnebitLamb(two_groups(net, wd), lr=lr, freeze_step=100, bias_correction=bias_correction)
    for t in range(1, steps + 1):
        opt.zero_grad()
        x, y = rank_batch(0, t)
        nn.functional.mse_loss(net(x), y).backward()
        opt.step()
    reference = _reference_lamb(Net(), steps, lr, wd, bias_correction)
    for p, q in zip(net.parameters(), reference):
        torch.testing.assert_close(p.detach().double(), q, rtol=0, atol=1e-6)
    # the trust-ratio EMA ran from 0 for every tensor whose ratio was not 1
    coeffs = [float(opt.state[p]["lamb_coeff"]) for p in (net.l1.weight, net.l2.weight, net.head.weight)]
    assert all(0 < c < 10 for c in coeffs)


def test_zero_momentum_tensor_gets_scaling_one_and_training_stays_finite() -> None:
    net = Net()
    opt = OnebitLamb(net.parameters(), lr=1e-3, freeze_step=3, dead_coordinates="ignore")
    for t in range(1, 9):
        opt.zero_grad()
        x, y = rank_batch(0, t)
        nn.functional.mse_loss(net(x), y).backward()
        opt.step()
    assert opt.state[net.unused_scale]["lamb_scaling_coeff"] == 1.0
    scales = [float(opt.state[p]["lamb_scaling_coeff"]) for p in net.parameters()]
    assert all(math.isfinite(s) and s > 0 for s in scales) and len(set(scales)) > 2
    assert all(torch.isfinite(p).all() for p in net.parameters())


# ------------------------------------------------------------------------------------------------ per-tensor version
class _PerTensorLamb:
    """1-bit LAMB on one process written per tensor with Python-float coefficients, as the optimizer was before its
    norms, ratios and coefficients moved to the device (each ``float(norm)`` a host sync on CUDA): the reference for
    the bits. World size 1: the exchange is the identity, but the momenta are multiplied by their scaling coefficients
    and divided again, as the optimizer does around it."""

    def __init__(self, groups: list[dict[str, Any]], freeze_step: int, bias_correction: bool,
                 cap_trust_ratio: bool = True, cap_update: bool = True) -> None:
        self.groups = [dict(dict(lr=1e-2, weight_decay=0.0), **g) for g in groups]
        self.freeze_step, self.bias_correction, self.t = freeze_step, bias_correction, 0
        self.cap_trust_ratio, self.cap_update = cap_trust_ratio, cap_update
        self.capped = 0  # compression-stage steps of a tensor where the live trust ratio was the smaller
        self.clipped = 0  # coordinates of u0 the update's cap clipped
        self.b1, self.b2, self.eps = 0.9, 0.999, 1e-8
        self.state: dict[int, dict[str, Any]] = {}
        self.scales: dict[int, float] = {}

    def _corrections(self, t_v: int) -> tuple[float, float]:
        if not self.bias_correction:
            return 1.0, 1.0
        return 1 - self.b1**self.t, 1 - self.b2**t_v

    @torch.no_grad()
    def step(self) -> None:
        self.t += 1
        b1, b2, eps = self.b1, self.b2, self.eps
        params = [p for g in self.groups for p in g["params"]]
        if self.t <= self.freeze_step:
            bc1, bc2 = self._corrections(self.t)
            for group in self.groups:
                for p in group["params"]:
                    s = self.state.setdefault(id(p), dict(m=torch.zeros_like(p), v=torch.zeros_like(p), coeff=0.0))
                    m, v, g = s["m"], s["v"], p.grad
                    m.lerp_(g, 1 - b1)
                    v.mul_(b2).addcmul_(g, g, value=1 - b2)
                    u = (m / bc1) / (exact_sqrt(v / bc2).add_(eps))
                    if group["weight_decay"]:
                        u.add_(p, alpha=group["weight_decay"])
                    p_norm, u_norm = float(p.float().norm()), float(u.float().norm())
                    ratio = 1.0 if p_norm == 0 or u_norm == 0 else min(max(p_norm / u_norm, 0.01), 10.0)
                    if ratio != 1.0:
                        s["coeff"] = 0.9 * s["coeff"] + (1 - 0.9) * ratio
                    p.add_(u, alpha=-group["lr"] * ratio)
            if self.t == self.freeze_step:
                for p in params:
                    self.state[id(p)]["m_last"] = self.state[id(p)]["m"].clone()
            return
        if not self.scales:
            rms = {id(p): float(self.state[id(p)]["m"].float().norm()) / math.sqrt(p.numel()) for p in params}
            live = [r for r in rms.values() if r > 0]
            mean = sum(live) / len(live) if live else 1.0
            self.scales = {k: mean / r if r > 0 else 1.0 for k, r in rms.items()}
        for p in params:
            m = self.state[id(p)]["m"]
            m.lerp_(p.grad, 1 - b1).mul_(self.scales[id(p)]).div_(self.scales[id(p)])
        bc1, bc2 = self._corrections(self.freeze_step)
        for group in self.groups:
            wd = group["weight_decay"]
            for p in group["params"]:
                s = self.state[id(p)]
                m, v = s["m"], s["v"]
                if "v_fresh" not in s:
                    s["v_fresh"] = v.clone()
                g_rec = (m - b1 * s["m_last"]) / (1 - b1)
                s["v_fresh"].mul_(b2).addcmul_(g_rec, g_rec, value=1 - b2)
                u0 = (m / bc1) / exact_sqrt(v / bc2).add_(eps)
                if self.cap_update:
                    bound = adam_step_bound((b1, b2))
                    self.clipped += int((u0.abs() > bound).sum())
                    u0 = u0.clamp(-bound, bound)
                u = u0 + wd * p if wd else u0
                factor = float(((exact_sqrt(v) + eps) / (exact_sqrt(s["v_fresh"]) + eps)).max())
                if wd:
                    u_norm = float(u.norm())
                    rho = min(1.0, float(u0.norm()) / u_norm) if u_norm > 0 else 1.0
                    factor = rho * factor + (1 - rho)
                factor = min(max(factor, 0.5), 4.0)
                last = s.get("last_factor", 1.0)
                factor = min(max(factor, last * 0.9), last * 1.1)
                s["last_factor"] = factor
                coeff = s["coeff"]
                if self.cap_trust_ratio:  # LAMB's trust ratio of this step, as in warmup
                    p_norm, u_norm = float(p.float().norm()), float(u.float().norm())
                    live = 1.0 if p_norm == 0 or u_norm == 0 else min(max(p_norm / u_norm, 0.01), 10.0)
                    self.capped += live < coeff
                    coeff = min(coeff, live)
                p.add_(u, alpha=-group["lr"] * coeff * factor)
        for p in params:
            self.state[id(p)]["m_last"] = self.state[id(p)]["m"].clone()


def _lamb_batches(net: Net, opt: Any, steps: range, grow_after: Optional[int] = None) -> list[torch.Tensor]:
    """Train on ``steps``; ``grow_after``: from that step on the loss, and so the gradients, are 30 times larger (a
    variance frozen before it is too small for them)."""
    out = []
    for t in steps:
        for p in net.parameters():
            p.grad = None
        x, y = rank_batch(0, t)
        scale = 30.0 if grow_after is not None and t > grow_after else 1.0
        (scale * nn.functional.mse_loss(net(x), y)).backward()
        opt.step()
        out.append(torch.cat([p.detach().reshape(-1).clone() for p in net.parameters()]))
    return out


# late enough for the trust-ratio EMAs (from 0) to reach the live ratios, so that the cap takes effect
FREEZE_LATE = 30


@pytest.mark.parametrize("bias_correction", [True, False])
@pytest.mark.parametrize("wd", [0.0, 0.05])
@pytest.mark.parametrize("cap_trust_ratio", [True, False])
def test_every_step_is_the_per_tensor_python_float_version_bit_for_bit(bias_correction: bool, wd: float,
                                                                       cap_trust_ratio: bool) -> None:
    """Multi-tensor ops, device-side ratios and factors in float64, cached frozen denominators, the previous momentum
    as scratch: in float32 the bits of the per-tensor version with Python floats, warmup and compression stage, with
    the live trust-ratio cap and without it (DeepSpeed's update)."""
    net, ref_net = Net(), Net()
    opt = OnebitLamb(two_groups(net, wd), lr=1e-2, freeze_step=FREEZE_LATE, bias_correction=bias_correction,
                     dead_coordinates="ignore", kernel_backend="torch", cap_trust_ratio=cap_trust_ratio)
    ref_groups = [dict(g, lr=g.get("lr", 1e-2)) for g in two_groups(ref_net, wd)]
    reference = _PerTensorLamb(ref_groups, freeze_step=FREEZE_LATE, bias_correction=bias_correction,
                               cap_trust_ratio=cap_trust_ratio)
    ours, theirs = _lamb_batches(net, opt, range(1, FREEZE_LATE + 15)), _lamb_batches(ref_net, reference, range(1, FREEZE_LATE + 15))
    for t, (a, b) in enumerate(zip(ours, theirs), start=1):
        assert torch.equal(a, b), f"step {t}: max difference {float((a - b).abs().max())}"
    if cap_trust_ratio:  # the cap took effect in this run, so the comparison above covers it
        assert reference.capped > 0
    for p, q in zip(net.parameters(), ref_net.parameters()):
        state, ref = opt.state[p], reference.state[id(q)]
        assert state["lamb_coeff"].dtype == torch.float64 and state["lamb_coeff"].dim() == 0
        assert float(state["lamb_coeff"]) == ref["coeff"] and float(state["lamb_last_factor"]) == ref["last_factor"]
        assert float(state["lamb_scaling_coeff"]) == reference.scales[id(q)]


@pytest.mark.parametrize("kernel_backend", ["torch", "cpu"])
@pytest.mark.parametrize("cap_update", [True, False])
def test_compressed_update_is_clipped_at_the_adam_bound(kernel_backend: str, cap_update: bool) -> None:
    """Gradients 30 times larger after the freeze than during warmup: ``u0 = m_hat / (sqrt(v_hat) + eps)`` outgrows
    every value it could take in warmup, and ``cap_update`` clips each coordinate at ``adam_step_bound`` (the per-tensor
    version's bits with the torch ops; the C kernel's fused pass clips the same coordinates, its norms summed in
    another order). Without the cap, the paper's u0."""
    if kernel_backend == "cpu" and not kernels.cpu_kernels.is_available():
        pytest.skip("no C compiler")
    net, ref_net = Net(), Net()
    opt = OnebitLamb(two_groups(net, 0.05), lr=1e-2, freeze_step=FREEZE_LATE, dead_coordinates="ignore",
                     kernel_backend=kernel_backend, cap_update=cap_update)
    ref_groups = [dict(g, lr=g.get("lr", 1e-2)) for g in two_groups(ref_net, 0.05)]
    reference = _PerTensorLamb(ref_groups, freeze_step=FREEZE_LATE, bias_correction=True, cap_update=cap_update)
    steps = range(1, FREEZE_LATE + 10)
    ours = _lamb_batches(net, opt, steps, grow_after=FREEZE_LATE)
    theirs = _lamb_batches(ref_net, reference, steps, grow_after=FREEZE_LATE)
    for t, (a, b) in enumerate(zip(ours, theirs), start=1):
        if kernel_backend == "torch":
            assert torch.equal(a, b), f"step {t}: max difference {float((a - b).abs().max())}"
        else:
            torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6, msg=f"step {t}")
    assert (reference.clipped > 0) is cap_update  # the cap bound in this run, so the comparison covers it


def test_steady_steps_do_not_synchronise_the_host() -> None:
    """Warmup and compressed steps (and the LAMB step of a compress=False group in the compression stage) read no
    device value on the host, the first compressed step (scaling coefficients) included."""
    from tests.detectors import count_host_syncs

    net = Net()
    groups = two_groups(net, 0.01)
    groups[1]["params"] = [p for p in groups[1]["params"] if p is not net.head.bias]
    groups.append({"params": [net.head.bias], "compress": False})
    opt = OnebitLamb(groups, lr=1e-2, freeze_step=3, dead_coordinates="ignore", kernel_backend="torch")
    for t in range(1, 9):
        opt.zero_grad()
        x, y = rank_batch(0, t)
        nn.functional.mse_loss(net(x), y).backward()
        with count_host_syncs() as syncs:
            opt.step()
        # the first compressed step (t == 4) included: the scaling coefficients stay on the device
        assert syncs.count == 0, f"step {t} ({opt.last_step_kind}): {syncs.summary()}"


def _as_old_checkpoint(state_dict: dict[str, Any]) -> dict[str, Any]:
    """A state dict as the optimizer wrote it when its coefficients were Python floats."""
    state_dict = copy.deepcopy(state_dict)
    for entry in state_dict["state"].values():
        for key in ("lamb_coeff", "lamb_last_factor", "lamb_scaling_coeff"):
            if key in entry:
                entry[key] = float(entry[key])
    return state_dict


@pytest.mark.parametrize("checkpoint", ["python floats (older checkpoints)", "torch.save round trip"])
def test_checkpoints_with_float_or_tensor_coefficients_resume_exactly(checkpoint: str) -> None:
    import io

    net = Net()
    opt = OnebitLamb(two_groups(net, 0.01), lr=1e-2, freeze_step=3, dead_coordinates="ignore")
    _lamb_batches(net, opt, range(1, 6))
    saved_model = {k: v.clone() for k, v in net.state_dict().items()}
    saved = copy.deepcopy(opt.state_dict())
    expected = _lamb_batches(net, opt, range(6, 10))

    if checkpoint.startswith("python"):
        saved = _as_old_checkpoint(saved)
        assert isinstance(saved["state"][0]["lamb_coeff"], float)
    else:
        buffer = io.BytesIO()
        torch.save(saved, buffer)
        buffer.seek(0)
        saved = torch.load(buffer, weights_only=True)
    resumed_net = Net()
    resumed_net.load_state_dict(saved_model)
    resumed = OnebitLamb(two_groups(resumed_net, 0.01), lr=1e-2, freeze_step=3, dead_coordinates="ignore")
    resumed.load_state_dict(saved)
    for p in resumed_net.parameters():
        for key in ("lamb_coeff", "lamb_last_factor", "lamb_scaling_coeff"):
            value = resumed.state[p][key]  # float64 kept: torch's loading alone would cast it to the parameter's dtype
            assert isinstance(value, torch.Tensor) and value.dtype == torch.float64 and value.dim() == 0, key
    got = _lamb_batches(resumed_net, resumed, range(6, 10))
    for a, b in zip(got, expected):
        assert torch.equal(a, b)


@pytest.mark.parametrize(
    "kwargs, message",
    [
        (dict(min_coeff=0.0), "min_coeff"),
        (dict(max_coeff=0.001), "min_coeff <= max_coeff"),
        (dict(factor_min=5.0), "factor_min <= factor_max"),
        (dict(factor_threshold=-0.1), "factor_threshold"),
        (dict(coeff_beta=1.0), "coeff_beta"),
        (dict(max_coeff=float("nan")), "finite"),
    ],
)
def test_bad_arguments_are_refused(kwargs: dict[str, Any], message: str) -> None:
    with pytest.raises(ValueError, match=message):
        OnebitLamb(Net().parameters(), freeze_step=3, **kwargs)


# ------------------------------------------------------------------------------------------------ distributed
FREEZE, STEPS, RESUME_AT = 3, 9, 6


def _train(rank: int, overlap: bool, steps: range, state: Any = None) -> dict[str, Any]:
    net = Net()
    ddp = DDP(net, bucket_cap_mb=0.001)
    opt = OnebitLamb(two_groups(net, 0.01), lr=1e-2, freeze_step=FREEZE, dead_coordinates="ignore")
    if overlap is None:  # the in-step path with DDP's momentum layout, for the bitwise comparison
        hook_state = OverlapState(ddp, opt, enabled=False)
        ddp.register_comm_hook(hook_state, overlapped_exchange_hook)
    elif overlap:
        hook_state = OverlapState(ddp, opt)
        ddp.register_comm_hook(hook_state, overlapped_exchange_hook)
    else:
        ddp.register_comm_hook(GradientSyncState(sync_predicate=lambda: opt.needs_gradient_allreduce),
                               switchable_allreduce_hook)
    if state is not None:
        net.load_state_dict(state["model"])
        opt.load_state_dict(state["optimizer"])
        opt.load_error_feedback_state_dict(state["error_feedback"])
    after, saved = [], None
    for t in steps:
        opt.zero_grad()
        x, y = rank_batch(ddp.process_group.rank(), t)
        nn.functional.mse_loss(ddp(x), y).backward()
        opt.step()
        after.append(torch.cat([p.detach().reshape(-1).clone() for p in net.parameters()]))
        if t == RESUME_AT:
            # state_dict() holds references to the live state tensors: copy it, as saving a checkpoint does
            saved = dict(model={k: v.clone() for k, v in net.state_dict().items()},
                         optimizer=copy.deepcopy(opt.state_dict()),
                         error_feedback=opt.error_feedback_state_dict())
    return dict(after=after, saved=saved, bytes=opt.communication.bytes_sent, hook_s=opt.communication.hook_s)


def scenario_ranks(rank: int, world_size: int) -> dict[str, Any]:
    out = dict(
        plain=_train(rank, False, range(1, STEPS + 1)),
        in_step=_train(rank, None, range(1, STEPS + 1)),
        overlapped=_train(rank, True, range(1, STEPS + 1)),
    )
    out["resumed"] = _train(rank, False, range(RESUME_AT + 1, STEPS + 1), state=out["plain"]["saved"])
    return out


@pytest.mark.parametrize("world_size", [2, 3])
def test_replicas_identical_every_step_overlap_bitwise_and_resume_exact(world_size: int) -> None:
    results = run_distributed(scenario_ranks, world_size, timeout_s=240)
    for name in ("plain", "in_step", "overlapped"):
        for step in range(STEPS):
            ranks = [r[name]["after"][step] for r in results]
            assert all(torch.equal(ranks[0], x) for x in ranks[1:]), f"{name}: replicas differ after step {step + 1}"
        assert all(r[name]["bytes"] > 0 for r in results)
    for r in results:
        assert r["overlapped"]["hook_s"] > 0 and r["in_step"]["hook_s"] == 0
        for a, b in zip(r["overlapped"]["after"], r["in_step"]["after"]):
            assert torch.equal(a, b), "overlapped and in-step exchanges differ"
        resumed = r["resumed"]["after"]
        assert len(resumed) == STEPS - RESUME_AT
        for a, b in zip(resumed, r["plain"]["after"][RESUME_AT:]):
            assert torch.equal(a, b), "the resumed run differs from the uninterrupted one"
    # it learns: the compression stage keeps moving the parameters
    first, last = results[0]["plain"]["after"][FREEZE], results[0]["plain"]["after"][-1]
    assert not torch.equal(first, last)


# ------------------------------------------------------------------------------------------------ Lightning
class LambRegressor(Regressor):
    def configure_optimizers(self) -> Any:
        opt = OnebitLamb(self.parameters(), lr=self.lr, freeze_step=self.freeze_step, weight_decay=0.01)
        if self.lr_lambda_zero_from is None:
            return opt
        zero_from = self.lr_lambda_zero_from
        scheduler = torch.optim.lr_scheduler.LambdaLR(opt, lambda i: 0.0 if i >= zero_from else 1.0)
        return {"optimizer": opt, "lr_scheduler": {"scheduler": scheduler, "interval": "step"}}


def _lamb_fit(rank: int, world_size: int, workdir: str, **kwargs: Any) -> dict[str, Any]:
    model_kwargs = kwargs.pop("model_kwargs", {})
    callbacks = kwargs.pop("callbacks", [])
    ckpt_path = kwargs.pop("ckpt_path", None)
    n_batches = kwargs.pop("n_batches", 8)
    model = LambRegressor(freeze_step=3, **model_kwargs)
    check = ReplicaCheck(every_n_steps=1)
    trainer = pl.Trainer(**trainer_kwargs(world_size, kwargs.pop("max_steps", 8), callbacks=[check, *callbacks],
                                          **kwargs))
    trainer.fit(model, loader(rank, n_batches), ckpt_path=ckpt_path)
    opt = trainer.strategy.onebit_optimizer
    state = trainer.strategy.overlap_state
    return dict(final=flat_params(model), checks=check.checks, stage=opt.stage.value, losses=model.losses,
                started=None if state is None else state.buckets_started, step_count=opt.step_count,
                records=[(r["lr"], torch.equal(r["params_before"], r.get("params_after", r["params_before"])))
                         for r in model.records], metrics={k: float(v) for k, v in trainer.callback_metrics.items()})


def scenario_lightning(rank: int, world_size: int, workdir: str) -> dict[str, Any]:
    from lightning.pytorch.plugins.precision import MixedPrecision

    from lightning_onebit import CommunicationMonitor, MomentumMask

    out: dict[str, Any] = {}
    out["bf16"] = _lamb_fit(rank, world_size, workdir, precision="bf16-mixed")
    scaler = torch.amp.GradScaler("cpu", init_scale=2.0**8)
    out["fp16"] = _lamb_fit(rank, world_size, workdir,
                            plugins=[MixedPrecision("16-mixed", "cpu", scaler=scaler)],
                            model_kwargs=dict(inf_at_step=5, inf_rank=1))
    out["accumulation"] = _lamb_fit(
        rank, world_size, workdir, accumulate_grad_batches=2, n_batches=16,
        callbacks=[MomentumMask(auto=True), CommunicationMonitor()], model_kwargs=dict(lr_lambda_zero_from=6),
    )

    common = dict(max_steps=-1, max_epochs=3, n_batches=3, model_kwargs=dict(data_seed=5), enable_checkpointing=True)
    out.update(fit_save_and_resume(lambda **kwargs: _lamb_fit(rank, world_size, workdir, **kwargs), workdir,
                                   **common))
    return out


@pytest.fixture(scope="module")
def lightning_session(tmp_path_factory: pytest.TempPathFactory) -> list[dict[str, Any]]:
    from tests.distributed import run_scenarios

    workdir = tmp_path_factory.mktemp("lamb")
    return run_distributed(run_scenarios, 2, (("lamb", scenario_lightning),), str(workdir), timeout_s=300)


def _lamb_results(session: list[dict[str, Any]], name: str) -> list[dict[str, Any]]:
    from tests.distributed import scenario_results

    return [r[name] for r in scenario_results(session, "lamb")]


def test_trains_under_the_strategy_with_bf16_and_identical_replicas(lightning_session: list[dict[str, Any]]) -> None:
    results = _lamb_results(lightning_session, "bf16")
    for r in results:
        assert r["checks"] == 8 and r["stage"] == "compression" and r["started"] > 0
        assert all(math.isfinite(x) for x in r["losses"])
    assert torch.equal(results[0]["final"], results[1]["final"])


def test_fp16_overflow_on_one_rank_skips_the_step_on_both(lightning_session: list[dict[str, Any]]) -> None:
    results = _lamb_results(lightning_session, "fp16")
    for r in results:
        assert r["started"] is None  # 16-mixed: the exchange is not overlapped (the strategy falls back)
        assert r["step_count"] == 8 - 1  # the overflow step was skipped, on both ranks
        assert torch.isfinite(r["final"]).all()
    assert torch.equal(results[0]["final"], results[1]["final"])


def test_accumulation_masks_monitor_and_lr_schedule(lightning_session: list[dict[str, Any]]) -> None:
    results = _lamb_results(lightning_session, "accumulation")
    for r in results:
        assert r["step_count"] == 8 and r["checks"] == 8
        # a 65-parameter model: the per-tensor scales weigh more than the signs, so ~6x rather than ~32x
        assert r["metrics"]["comm/stage"] == 1.0 and r["metrics"]["comm/compression_ratio"] > 4
        # LambdaLR sets lr 0 from scheduler step 6: the parameters stop moving (weight decay is inside the update)
        lrs = [lr for lr, _ in r["records"]]
        assert lrs[:6] == [Regressor().lr] * 6 and set(lrs[6:]) == {0.0}
        assert [unchanged for _, unchanged in r["records"]][6:] == [True] * (len(lrs) - 6)
    assert torch.equal(results[0]["final"], results[1]["final"])


def test_keep_resume_mid_stage_is_bitwise_the_uninterrupted_run(lightning_session: list[dict[str, Any]]) -> None:
    for r in zip(_lamb_results(lightning_session, "full"), _lamb_results(lightning_session, "resumed")):
        full, resumed = r
        assert resumed["restored"] is True
        assert torch.equal(resumed["final"], full["final"])
        assert resumed["losses"] == full["losses"][-len(resumed["losses"]):]


def test_freeze_step_defaults_to_auto_and_is_keyword_only() -> None:
    """``freeze_step`` defaults to ``"auto"`` (it was required), with the library's AutoFreeze settings; it stays
    keyword-only."""
    opt = OnebitLamb(Net().parameters())
    assert opt.freeze_step is None and opt.auto_freeze is not None and opt.freeze_detector is not None
    with pytest.raises(TypeError):
        OnebitLamb(Net().parameters(), 1e-3, (0.9, 0.999), 1e-8, 0.0, 5)  # freeze_step is keyword-only
