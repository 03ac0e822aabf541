"""Tests of :class:`lightning_onebit.OnebitAdam`: warmup == AdamW, frozen-variance compression stage, masks,
checkpoints, error-feedback seam, and multi-rank runs over gloo (2 and 3 CPU processes)."""

from __future__ import annotations

import copy
import io
import logging
import math
import re

import pytest
import torch
import torch.distributed as dist
from torch import nn

from lightning_onebit import OnebitAdam, OnebitStage
from lightning_onebit.optim.functional import adam_step_bound
from tests.distributed import run_distributed

N_IN = 7  # the last input feature is always 0: its first-layer weights never get a gradient (the "dead" column)
HIDDEN = 8


# ---------------------------------------------------------------------------------------------------- helpers
class Net(nn.Module):
    """A small MLP with parameters of several sizes, including 1-element ones (fewer than 8 P elements)."""

    def __init__(self, seed: int = 0, dtype: torch.dtype = torch.float32) -> None:
        super().__init__()
        g = torch.Generator().manual_seed(seed)
        self.w1 = nn.Parameter((torch.randn(HIDDEN, N_IN, generator=g) * 0.5).to(dtype))
        self.b1 = nn.Parameter((torch.randn(HIDDEN, generator=g) * 0.1).to(dtype))
        self.w2 = nn.Parameter((torch.randn(1, HIDDEN, generator=g) * 0.5).to(dtype))
        self.b2 = nn.Parameter(torch.zeros(1, dtype=dtype))
        self.extra = nn.Parameter(torch.full((1,), 0.1, dtype=dtype))

    def forward(self, x: torch.Tensor, use_extra: bool = True) -> torch.Tensor:
        h = torch.tanh(x @ self.w1.T + self.b1)
        out = h @ self.w2.T + self.b2
        if use_extra:
            out = out + self.extra
        return out.squeeze(-1)


def _teacher(x: torch.Tensor) -> torch.Tensor:
    a = torch.randn(N_IN, 4, generator=torch.Generator().manual_seed(123), dtype=x.dtype)
    return torch.tanh(x @ a).sum(-1) * 0.7 + 0.3


def _batch(step: int, rank: int = 0, n: int = 16, dtype: torch.dtype = torch.float32):
    g = torch.Generator().manual_seed(10_000 + 100 * step + rank)
    x = torch.randn(n, N_IN, generator=g).to(dtype)
    x[:, -1] = 0.0
    return x, _teacher(x)


def _eval_loss(net: Net) -> float:
    g = torch.Generator().manual_seed(999)
    x = torch.randn(256, N_IN, generator=g)
    x[:, -1] = 0.0
    with torch.no_grad():
        return float(((net(x) - _teacher(x)) ** 2).mean())


def _dead_mask() -> torch.Tensor:
    mask = torch.ones(HIDDEN, N_IN)
    mask[:, -1] = 0.0
    return mask


def _groups(net: Net, mask: bool = True) -> list[dict]:
    """Two param groups with different lr and weight decay; w1's dead column is masked (per-parameter list form)."""
    weights = {"params": [net.w1, net.w2], "lr": 0.03, "weight_decay": 0.01}
    if mask:
        weights["exp_avg_mask"] = [_dead_mask(), None]
    return [weights, {"params": [net.b1, net.b2, net.extra], "lr": 0.05, "weight_decay": 0.0}]


def _backward(net: Net, step: int, rank: int = 0, use_extra: bool = True, dtype=torch.float32) -> torch.Tensor:
    x, y = _batch(step, rank, dtype=dtype)
    loss = ((net(x, use_extra) - y) ** 2).mean()
    loss.backward()
    return loss


def _train(net: Net, opt: torch.optim.Optimizer, steps) -> None:
    for s in steps:
        opt.zero_grad(set_to_none=True)
        _backward(net, s)
        opt.step()


def _params(net: nn.Module) -> dict[str, torch.Tensor]:
    return {n: p.detach().clone() for n, p in net.named_parameters()}


def _max_diff(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> float:
    assert a.keys() == b.keys()
    return max(float((a[k].double() - b[k].double()).abs().max()) for k in a)


def _assert_bitwise(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor], what: str = "") -> None:
    assert a.keys() == b.keys(), what
    for k in a:
        assert torch.equal(a[k], b[k]), f"{what}: {k} differs (max diff {float((a[k] - b[k]).abs().max())})"


class _Reference:
    """Hand-written 1-bit Adam for one process: AdamW in warmup, frozen variance after, mask on the momentum.

    Parameters without a gradient in a compressed step contribute a zero gradient (their momentum decays)."""

    def __init__(self, groups: list[dict], freeze_step: int, bias_correction: bool = True,
                 cap_update: bool = True) -> None:
        self.groups = groups
        self.freeze_step = freeze_step
        self.bias_correction = bias_correction
        self.cap_update = cap_update
        self.t = 0
        self.state: dict[int, dict[str, torch.Tensor]] = {}
        self.clipped = 0  # coordinates the cap clipped, over all compressed steps

    @staticmethod
    def bound(b1: float, b2: float) -> float:
        """The largest |m_hat / sqrt(v_hat)| Adam reaches at any step (Cauchy-Schwarz, the geometric sum's limit)."""
        return (1 - b1) / math.sqrt((1 - b2) * (1 - b1 * b1 / b2))

    @torch.no_grad()
    def step(self) -> None:
        self.t += 1
        t, warmup = self.t, self.t <= self.freeze_step
        for group in self.groups:
            lr, wd = group["lr"], group.get("weight_decay", 0.0)
            b1, b2 = group.get("betas", (0.9, 0.999))
            eps = group.get("eps", 1e-8)
            masks = group.get("exp_avg_mask") or [None] * len(group["params"])
            for p, mask in zip(group["params"], masks):
                if p.grad is None and warmup:
                    continue
                g = torch.zeros_like(p) if p.grad is None else p.grad
                st = self.state.setdefault(id(p), {"m": torch.zeros_like(p), "v": torch.zeros_like(p)})
                st["m"] = b1 * st["m"] + (1 - b1) * g
                if warmup:
                    st["v"] = b2 * st["v"] + (1 - b2) * g * g
                elif mask is not None:
                    st["m"] = st["m"] * mask
                if self.bias_correction:
                    bc1, bc2 = 1 - b1**t, 1 - b2 ** min(t, self.freeze_step)
                else:
                    bc1 = bc2 = 1.0
                p.mul_(1 - lr * wd)
                update = st["m"] / bc1 / (st["v"].sqrt() / math.sqrt(bc2) + eps)
                if self.cap_update and not warmup:
                    bound = self.bound(b1, b2)
                    self.clipped += int((update.abs() > bound).sum())
                    update = update.clamp(-bound, bound)
                p.sub_(lr * update)


# ---------------------------------------------------------------------------------------------------- warmup
def _train_side_by_side(net_a, opt_a, net_b, opt_b, steps: int) -> None:
    """Step both optimizers on the same gradients; the parameters must agree within 1e-6 after every step."""
    for s in range(steps):
        for net, opt in ((net_a, opt_a), (net_b, opt_b)):
            opt.zero_grad()
            _backward(net, s)
            opt.step()
        assert _max_diff(_params(net_a), _params(net_b)) < 1e-6, f"step {s + 1}"


def test_warmup_equals_adamw_two_groups_with_weight_decay():
    net_a, net_b = Net(), Net()
    # Masks only act in the compression stage, so warmup must still be exactly AdamW with them present.
    opt_a = OnebitAdam(_groups(net_a), betas=(0.8, 0.99), freeze_step=1000)
    opt_b = torch.optim.AdamW(_groups(net_b, mask=False), betas=(0.8, 0.99))
    assert opt_a.param_groups[0]["weight_decay"] != opt_a.param_groups[1]["weight_decay"]
    start = _params(net_a)
    _train_side_by_side(net_a, opt_a, net_b, opt_b, steps=30)
    assert opt_a.stage is OnebitStage.WARMUP
    assert _max_diff(_params(net_a), start) > 1e-2  # the comparison is not vacuous
    for p, q in zip(net_a.parameters(), net_b.parameters()):
        state_b = opt_b.state[q]
        torch.testing.assert_close(opt_a.state[p]["exp_avg"], state_b["exp_avg"], rtol=0, atol=1e-6)
        torch.testing.assert_close(opt_a.state[p]["exp_avg_sq"], state_b["exp_avg_sq"], rtol=0, atol=1e-6)


def test_warmup_default_hyperparameters_equal_adamw():
    net_a, net_b = Net(seed=3), Net(seed=3)
    opt_a = OnebitAdam(net_a.parameters(), lr=0.01, weight_decay=0.1, freeze_step=50)
    opt_b = torch.optim.AdamW(net_b.parameters(), lr=0.01, weight_decay=0.1)
    _train_side_by_side(net_a, opt_a, net_b, opt_b, steps=25)


def test_bias_correction_false_matches_uncorrected_reference():
    net_a, net_b = Net(dtype=torch.float64), Net(dtype=torch.float64)
    opt = OnebitAdam(_groups(net_a, mask=False), freeze_step=100, bias_correction=False)
    ref = _Reference(_groups(net_b, mask=False), freeze_step=100, bias_correction=False)
    adamw_net = Net()
    adamw = torch.optim.AdamW(_groups(adamw_net, mask=False))
    for s in range(25):
        for net, o in ((net_a, opt), (net_b, ref), (adamw_net, adamw)):
            for p in net.parameters():
                p.grad = None
            _backward(net, s, dtype=next(net.parameters()).dtype)
            o.step()
        assert _max_diff(_params(net_a), _params(net_b)) < 1e-6, f"step {s + 1}"
    # and it really is a different update from the bias-corrected one
    assert _max_diff(_params(net_a), _params(adamw_net)) > 1e-3


def test_no_lost_first_step():
    net = Net()
    opt = OnebitAdam(net.parameters(), lr=0.01, freeze_step=5)
    before = _params(net)
    _train(net, opt, range(1))
    after = _params(net)
    for name in before:
        if name == "w1":  # the dead column does not move without weight decay, the other columns must
            assert not torch.equal(before[name][:, :-1], after[name][:, :-1])
        else:
            assert not torch.equal(before[name], after[name]), name
    assert opt.step_count == 1


def test_closure_is_called_and_its_loss_returned():
    net = Net()
    opt = OnebitAdam(net.parameters(), freeze_step=2)
    for s in range(4):

        def closure():
            opt.zero_grad()
            return _backward(net, s)

        loss = opt.step(closure)
        assert isinstance(loss, torch.Tensor) and loss.requires_grad
    assert opt.step_count == 4


# ---------------------------------------------------------------------------------------------------- stages
def test_freeze_step_semantics():
    net = Net()
    opt = OnebitAdam(net.parameters(), freeze_step=3)
    assert opt.step_count == 0
    assert opt.stage is OnebitStage.WARMUP and opt.stage == "warmup"
    assert opt.needs_gradient_allreduce is True
    previous = None
    for step in range(1, 9):
        opt.zero_grad()
        _backward(net, step)
        opt.step()
        assert opt.step_count == step
        v = {n: opt.state[p]["exp_avg_sq"].clone() for n, p in net.named_parameters()}
        if step <= 3:  # warmup steps 1..3 update the variance
            if previous is not None:
                assert all(not torch.equal(v[n], previous[n]) for n in ("w2", "b1", "b2", "extra"))
            else:
                assert all(float(v[n].abs().max()) > 0 for n in ("w2", "b1", "b2", "extra"))
            if step == 3:
                frozen = v
        else:  # step 4 is the first compressed step: the variance is frozen bitwise
            _assert_bitwise(v, frozen, f"exp_avg_sq at step {step}")
        previous = v
        # stage and needs_gradient_allreduce describe the NEXT step
        expect_warmup = step < 3
        assert opt.stage is (OnebitStage.WARMUP if expect_warmup else OnebitStage.COMPRESSION), step
        assert opt.needs_gradient_allreduce is expect_warmup, step
    assert opt.stage == "compression"


@pytest.mark.parametrize("cap_update", [True, False])
def test_compression_stage_single_process_is_adam_with_frozen_variance(cap_update: bool):
    net_a, net_b = Net(dtype=torch.float64), Net(dtype=torch.float64)
    freeze = 5
    opt = OnebitAdam(_groups(net_a), betas=(0.85, 0.995), eps=1e-6, freeze_step=freeze, cap_update=cap_update)
    groups_b = _groups(net_b)
    for g in groups_b:
        g["betas"], g["eps"] = (0.85, 0.995), 1e-6
    ref = _Reference(groups_b, freeze_step=freeze, cap_update=cap_update)
    for s in range(25):
        for net, o in ((net_a, opt), (net_b, ref)):
            for p in net.parameters():
                p.grad = None
            _backward(net, s, dtype=torch.float64)
            o.step()
        assert _max_diff(_params(net_a), _params(net_b)) < 1e-6, f"step {s + 1}"
        for p, q in zip(net_a.parameters(), net_b.parameters()):
            torch.testing.assert_close(opt.state[p]["exp_avg"], ref.state[id(q)]["m"], rtol=0, atol=1e-6)
    # nothing was communicated with one process
    assert opt.communication.calls == 0 and opt.communication.bytes_sent == 0
    if cap_update:  # the cap clipped coordinates in this run, so the comparison above covers it
        assert ref.clipped > 0


def test_compression_stage_uses_current_step_for_momentum_correction_and_freeze_step_for_variance():
    """One parameter, constant gradient: the compressed update is lr/(1-b1^t) m / (sqrt(v)/sqrt(1-b2^F) + eps)."""
    p = nn.Parameter(torch.tensor([1.0], dtype=torch.float64))
    b1, b2, lr, freeze = 0.9, 0.99, 0.1, 3
    # the paper's update: the growing gradient takes m_hat / sqrt(v_hat) past the cap (tested below)
    opt = OnebitAdam([p], lr=lr, betas=(b1, b2), eps=0.0, freeze_step=freeze, cap_update=False)
    m = v = 0.0
    value = 1.0
    for t in range(1, 8):
        g = 0.5 * t  # varying gradient, so a wrong step count changes the result
        p.grad = torch.tensor([g], dtype=torch.float64)
        opt.step()
        m = b1 * m + (1 - b1) * g
        if t <= freeze:
            v = b2 * v + (1 - b2) * g * g
        value -= lr / (1 - b1**t) * m / (math.sqrt(v) / math.sqrt(1 - b2 ** min(t, freeze)))
        assert float(p.detach()) == pytest.approx(value, rel=1e-12, abs=1e-12), t


def _adam_ratios(grads: torch.Tensor, betas: tuple[float, float], bias_correction: bool) -> torch.Tensor:
    """``|m_hat_t| / sqrt(v_hat_t)`` of Adam after the last of ``grads`` (one row per step, one column per sequence)."""
    b1, b2 = betas
    m = torch.zeros(grads.shape[1], dtype=torch.float64)
    v = torch.zeros_like(m)
    for g in grads:
        m = b1 * m + (1 - b1) * g
        v = b2 * v + (1 - b2) * g * g
    t = grads.shape[0]
    if bias_correction:
        m, v = m / (1 - b1**t), v / (1 - b2**t)
    return m.abs() / v.sqrt()


@pytest.mark.parametrize("bias_correction", [True, False])
@pytest.mark.parametrize("betas", [(0.9, 0.999), (0.85, 0.995), (0.9, 0.98), (0.0, 0.999)])
@pytest.mark.parametrize("t", [1, 2, 7, 60, 400])
def test_adam_step_bound_holds_for_every_gradient_sequence_and_is_attained(betas, t, bias_correction):
    """``adam_step_bound``: no gradient sequence takes Adam's ``|m_hat| / sqrt(v_hat)`` past it (random, heavy-tailed,
    growing and rare-spike sequences), the sequence ``|g_(t-k)| = (b1 / b2)^k`` reaches it, it is the sum of the
    docstring written out, and the bound over all steps (what ``cap_update`` clips at) is above it."""
    b1, b2 = betas
    bound = adam_step_bound(betas, t, bias_correction)
    written_out = (1 - b1) * math.sqrt(sum((b1 * b1 / b2) ** k for k in range(t)) / (1 - b2))
    if bias_correction:
        written_out *= math.sqrt(1 - b2**t) / (1 - b1**t)
    assert bound == pytest.approx(written_out, rel=1e-12)
    assert bound <= adam_step_bound(betas) * (1 + 1e-12) == _Reference.bound(b1, b2) * (1 + 1e-12)
    g = torch.Generator().manual_seed(t)
    steps = torch.arange(t, dtype=torch.float64).unsqueeze(1)
    grads = torch.cat([
        torch.randn(t, 2000, generator=g, dtype=torch.float64),
        torch.randn(t, 500, generator=g, dtype=torch.float64) ** 5,  # heavy tails
        torch.exp(steps * torch.rand(1, 500, generator=g, dtype=torch.float64)),  # growing
        torch.where(torch.rand(t, 500, generator=g) < 0.05, 1.0, 1e-3).double(),  # rare large gradients
    ], 1)
    assert float(_adam_ratios(grads, betas, bias_correction).max()) <= bound * (1 + 1e-12)
    worst = ((b1 / b2) ** (t - 1 - steps)).expand(t, 1)  # g_(t-k) = (b1 / b2)^k
    assert float(_adam_ratios(worst, betas, bias_correction)[0]) == pytest.approx(bound, rel=1e-9)


def test_adam_step_bound_over_all_steps():
    """The bound over all steps is the limit of the per-step bounds, above every one of them (bias-corrected or not,
    over a grid of betas and steps), and ``inf`` where the sum grows without bound."""
    assert adam_step_bound((0.9, 0.999)) == pytest.approx(7.2703, abs=1e-4)
    assert adam_step_bound((0.9, 0.98)) == pytest.approx(1.6977, abs=1e-4)
    for b1 in (0.0, 0.5, 0.8, 0.9, 0.95, 0.99):
        for b2 in (0.9, 0.98, 0.99, 0.999, 0.9999):
            limit = adam_step_bound((b1, b2))
            if b1 * b1 >= b2:
                assert limit == math.inf
                continue
            per_step = [adam_step_bound((b1, b2), t, bc) for t in (*range(1, 300, 7), 10**4, 10**6)
                        for bc in (True, False)]
            assert max(per_step) <= limit * (1 + 1e-12), (b1, b2)
            assert adam_step_bound((b1, b2), 10**6, False) == pytest.approx(limit, rel=1e-6)
    assert adam_step_bound((0.95, 0.9), 10**6) == math.inf  # b1^2 > b2: the sum grows without bound
    assert adam_step_bound((0.9, 0.0), 5) == math.inf  # b2 = 0: v is the last gradient's square alone
    assert adam_step_bound((0.0, 0.0), 5) == 1.0


# ---------------------------------------------------------------------------------------------------- validation
@pytest.mark.parametrize(
    "kwargs",
    [
        {"amsgrad": True},
        {"lr": -1e-3},
        {"betas": (1.0, 0.999)},
        {"betas": (0.9, 1.0)},
        {"betas": (-0.1, 0.999)},
        {"betas": (0.9, -0.5)},
        {"eps": -1e-8},
        {"weight_decay": -0.1},
        {"freeze_step": 0},
        {"freeze_step": -3},
        {"freeze_step": 2.0},
        {"freeze_step": 2.5},
        {"freeze_step": "3"},
        {"freeze_step": None},
        {"freeze_step": True},
        {"freeze_step": False},
        {"bucket_cap_mb": 0},
    ],
)
def test_invalid_arguments_raise_value_error(kwargs):
    kwargs = {"freeze_step": 2, **kwargs}
    with pytest.raises(ValueError):
        OnebitAdam(Net().parameters(), **kwargs)


def test_invalid_group_options_raise_value_error():
    net = Net()
    with pytest.raises(ValueError):
        OnebitAdam([{"params": [net.w1], "lr": -1.0}], freeze_step=2)
    with pytest.raises(ValueError):
        OnebitAdam([{"params": [net.w1], "betas": (0.9, 1.5)}], freeze_step=2)
    opt = OnebitAdam([net.w1], freeze_step=2)
    with pytest.raises(ValueError):
        opt.add_param_group({"params": [net.b1], "weight_decay": -1.0})


def test_freeze_step_defaults_to_auto_and_is_keyword_only():
    """``freeze_step`` defaults to ``"auto"`` (1-bit Adam; it was required), with the library's AutoFreeze settings;
    it stays keyword-only."""
    opt = OnebitAdam(Net().parameters())
    assert opt.freeze_step is None and opt.auto_freeze is not None and opt.freeze_detector is not None
    with pytest.raises(TypeError):
        OnebitAdam(Net().parameters(), 1e-3, (0.9, 0.999), 1e-8, 0.0, 5)  # freeze_step is keyword-only


@pytest.mark.parametrize(
    "mask",
    [
        torch.ones(3, 3),  # group-wide tensor of the wrong shape
        [torch.ones(HIDDEN, N_IN)],  # list too short
        [torch.ones(HIDDEN, N_IN), None, None],  # list too long
        [torch.ones(HIDDEN, N_IN), torch.ones(2)],  # second entry has the wrong shape
        [torch.ones(HIDDEN, N_IN), 1.0],  # not a tensor
        "ones",
    ],
)
def test_bad_masks_raise_value_error(mask):
    net = Net()
    with pytest.raises(ValueError):
        OnebitAdam([{"params": [net.w1, net.b1], "exp_avg_mask": mask}], freeze_step=2)


def test_sparse_gradients_raise_value_error_in_step():
    emb = nn.Embedding(10, 3, sparse=True)
    before = emb.weight.detach().clone()
    opt = OnebitAdam(emb.parameters(), freeze_step=2)
    emb(torch.tensor([1, 2, 3])).sum().backward()
    assert emb.weight.grad.is_sparse
    with pytest.raises(ValueError, match="sparse"):
        opt.step()
    assert opt.step_count == 0 and torch.equal(emb.weight, before)


# ---------------------------------------------------------------------------------------------------- masks
def _mask_run(groups_fn, steps: int = 14, freeze: int = 4):
    net = Net()
    opt = OnebitAdam(groups_fn(net), freeze_step=freeze)
    snapshot = None
    for s in range(steps):
        opt.zero_grad()
        _backward(net, s)
        opt.step()
        if opt.step_count == freeze:
            snapshot = _params(net)
    return net, opt, snapshot


def test_mask_per_parameter_list_zeroes_momentum_and_freezes_coordinates():
    """A random mask on w1 (weight_decay 0): masked momentum exactly 0, masked coordinates do not move."""
    mask = (torch.rand(HIDDEN, N_IN, generator=torch.Generator().manual_seed(5)) > 0.5).float()
    mask[:, -1] = 0.0

    def groups(net):
        return [
            {"params": [net.w1, net.w2], "lr": 0.03, "weight_decay": 0.0, "exp_avg_mask": [mask, None]},
            {"params": [net.b1, net.b2, net.extra], "lr": 0.05},
        ]

    net, opt, at_freeze = _mask_run(groups)
    m = opt.state[net.w1]["exp_avg"]
    masked = mask == 0
    assert torch.equal(m[masked], torch.zeros_like(m[masked]))
    assert bool((m[~masked] != 0).all())
    assert torch.equal(net.w1.detach()[masked], at_freeze["w1"][masked])
    assert bool((net.w1.detach()[~masked] != at_freeze["w1"][~masked]).all())
    assert not torch.equal(net.w2.detach(), at_freeze["w2"])  # the None entry means unmasked
    # the masked coordinates with a live gradient did move in warmup (masks act in the compression stage only)
    assert not torch.equal(Net().w1.detach()[masked & (torch.arange(N_IN) < N_IN - 1)],
                           at_freeze["w1"][masked & (torch.arange(N_IN) < N_IN - 1)])


def test_masked_coordinates_move_only_by_weight_decay():
    lr, wd, freeze = 0.03, 0.1, 4
    mask = torch.ones(HIDDEN, N_IN)
    mask[:3, :3] = 0.0

    def groups(net):
        return [{"params": [net.w1], "lr": lr, "weight_decay": wd, "exp_avg_mask": [mask]},
                {"params": [net.b1, net.w2, net.b2, net.extra]}]

    net, opt, at_freeze = _mask_run(groups, steps=12, freeze=freeze)
    expected = at_freeze["w1"][:3, :3].clone()
    for _ in range(12 - freeze):
        expected.mul_(1 - lr * wd)
    torch.testing.assert_close(net.w1.detach()[:3, :3], expected, rtol=1e-6, atol=0)
    assert torch.equal(opt.state[net.w1]["exp_avg"][:3, :3], torch.zeros(3, 3))


def test_group_wide_tensor_mask():
    """DeepSpeed's form: one tensor mask for a group whose parameters share its shape."""
    torch.manual_seed(0)
    a, b = nn.Parameter(torch.randn(4, 5)), nn.Parameter(torch.randn(4, 5))
    mask = torch.ones(4, 5)
    mask[1] = 0.0
    opt = OnebitAdam([{"params": [a, b], "exp_avg_mask": mask, "lr": 0.01}], freeze_step=2)
    target = torch.randn(4, 5)
    snapshot = None
    for step in range(1, 9):
        opt.zero_grad()
        (((a - target) ** 2).sum() + ((b + target) ** 2).sum()).backward()
        opt.step()
        if step == 2:
            snapshot = (a.detach().clone(), b.detach().clone())
    for p, before in zip((a, b), snapshot):
        assert torch.equal(opt.state[p]["exp_avg"][1], torch.zeros(5))
        assert torch.equal(p.detach()[1], before[1])
        assert bool((p.detach()[[0, 2, 3]] != before[[0, 2, 3]]).all())


# ---------------------------------------------------------------------------------------------------- odd params
def test_parameters_without_gradient_in_some_steps_both_stages():
    """``extra`` has no gradient on odd steps. Warmup: skipped like AdamW (untouched, no weight decay).
    Compression: a zero gradient, its momentum decays by b1 (as ``lerp(m, 0, 1 - b1)``, the op that folds DDP's
    zero-filled gradient entries in the overlap hook, so both paths give the same bits) and it still moves."""
    freeze, b1 = 6, 0.9
    net = Net()
    opt = OnebitAdam([{"params": [net.w1, net.b1, net.w2, net.b2]},
                      {"params": [net.extra], "weight_decay": 0.1, "lr": 0.02}], freeze_step=freeze)
    moved_without_grad = 0
    for s in range(16):
        opt.zero_grad(set_to_none=True)
        use_extra = s % 2 == 0
        _backward(net, s, use_extra=use_extra)
        assert (net.extra.grad is None) is not use_extra
        before = net.extra.detach().clone()
        m_before = opt.state[net.extra]["exp_avg"].clone() if net.extra in opt.state else None
        v_before = opt.state[net.extra]["exp_avg_sq"].clone() if net.extra in opt.state else None
        compressed = opt.stage is OnebitStage.COMPRESSION
        opt.step()
        if use_extra:
            assert not torch.equal(net.extra.detach(), before)
        elif not compressed:
            assert torch.equal(net.extra.detach(), before), s
            assert torch.equal(opt.state[net.extra]["exp_avg"], m_before)
            assert torch.equal(opt.state[net.extra]["exp_avg_sq"], v_before)
        else:
            assert torch.equal(opt.state[net.extra]["exp_avg"], m_before.lerp(torch.zeros_like(m_before), 1 - b1))
            torch.testing.assert_close(opt.state[net.extra]["exp_avg"], m_before * b1)
            assert torch.equal(opt.state[net.extra]["exp_avg_sq"], v_before)
            assert not torch.equal(net.extra.detach(), before)
            moved_without_grad += 1
        assert all(torch.isfinite(p).all() for p in net.parameters())
    assert moved_without_grad == 5


def test_parameter_without_gradient_in_any_step_matches_reference():
    """The compression-stage reference (zero gradient for a missing one) holds with gradient gaps after warmup."""
    freeze = 4
    net_a, net_b = Net(dtype=torch.float64), Net(dtype=torch.float64)
    opt = OnebitAdam(_groups(net_a), freeze_step=freeze)
    ref = _Reference(_groups(net_b), freeze_step=freeze)
    for s in range(14):
        use_extra = s < freeze or s % 3 == 0
        for net, o in ((net_a, opt), (net_b, ref)):
            for p in net.parameters():
                p.grad = None
            _backward(net, s, use_extra=use_extra, dtype=torch.float64)
            o.step()
        assert _max_diff(_params(net_a), _params(net_b)) < 1e-6, f"step {s + 1}"


def test_parameter_never_updated_in_warmup_stays_frozen_with_warning(caplog):
    """``extra`` gets gradients only in the compression stage: no variance estimate, so it is kept out of the
    update, also after a checkpoint round trip (the buckets are rebuilt then)."""
    freeze = 3
    net = Net()
    opt = OnebitAdam(net.parameters(), freeze_step=freeze)
    initial = net.extra.detach().clone()

    def steps(opt, rng):
        for s in rng:
            opt.zero_grad(set_to_none=True)
            _backward(net, s, use_extra=opt.stage is OnebitStage.COMPRESSION)
            opt.step()
            assert torch.equal(net.extra.detach(), initial), s
            assert all(torch.isfinite(p).all() for p in net.parameters())

    with caplog.at_level(logging.WARNING, logger="lightning_onebit.optim"):
        steps(opt, range(7))
        assert any("no gradient during warmup" in r.getMessage() for r in caplog.records)
        opt_b = OnebitAdam(net.parameters(), freeze_step=freeze)
        opt_b.load_state_dict(_roundtrip(opt.state_dict()))
        steps(opt_b, range(7, 11))
    assert not torch.equal(net.w2.detach(), Net().w2.detach())


def test_requires_grad_false_parameters_are_untouched_and_have_no_state():
    net = Net()
    net.b1.requires_grad_(False)
    before = net.b1.detach().clone()
    opt = OnebitAdam(net.parameters(), weight_decay=0.1, freeze_step=3)
    _train(net, opt, range(8))
    assert torch.equal(net.b1.detach(), before)
    assert net.b1 not in opt.state
    assert sum(layout.numel for layout in opt.bucket_layouts().values()) == sum(
        p.numel() for p in net.parameters() if p.requires_grad
    )
    assert len(opt.state_dict()["state"]) == 4
    assert not torch.equal(net.w2.detach(), Net().w2.detach())


def test_changing_trainable_parameters_in_compression_stage(caplog):
    """Freezing one parameter and unfreezing another mid-compression rebuilds the buckets: the newly frozen one is
    untouched, the newly trainable one (no variance estimate from warmup) is kept out of the update."""
    torch.manual_seed(0)
    a, b, c = (nn.Parameter(torch.randn(3)) for _ in range(3))
    c.requires_grad_(False)
    opt = OnebitAdam([a, b, c], lr=0.1, freeze_step=2)
    for _ in range(4):
        opt.zero_grad()
        ((a - 1) ** 2 + (b - 1) ** 2).sum().backward()
        opt.step()
    b.requires_grad_(False)
    c.requires_grad_(True)
    b_before, c_before, a_before = b.detach().clone(), c.detach().clone(), a.detach().clone()
    with caplog.at_level(logging.WARNING, logger="lightning_onebit.optim"):
        for _ in range(3):
            opt.zero_grad(set_to_none=True)
            ((a - 1) ** 2 + (c - 1) ** 2).sum().backward()
            opt.step()
    assert torch.equal(b.detach(), b_before) and torch.equal(c.detach(), c_before)
    assert not torch.equal(a.detach(), a_before)
    assert any("no gradient during warmup" in r.getMessage() for r in caplog.records)
    assert [layout.tensor_numels for layout in opt.bucket_layouts().values()] == [(3, 3)]


def test_tiny_tensors_and_several_groups():
    torch.manual_seed(1)
    params = [nn.Parameter(torch.randn(1)) for _ in range(5)] + [nn.Parameter(torch.randn(3, 2))]
    groups = [{"params": [p], "lr": 0.01 * (i + 1), "weight_decay": 0.01 * i} for i, p in enumerate(params)]
    opt = OnebitAdam(groups, freeze_step=2)
    ref_params = [nn.Parameter(p.detach().clone()) for p in params]
    ref = _Reference([{"params": [q], "lr": g["lr"], "weight_decay": g["weight_decay"]}
                      for q, g in zip(ref_params, groups)], freeze_step=2)
    for step in range(10):
        for ps, o in ((params, opt), (ref_params, ref)):
            for i, p in enumerate(ps):
                p.grad = None
                ((p - i) ** 2).sum().backward()
            o.step()
        for p, q in zip(params, ref_params):
            torch.testing.assert_close(p.detach(), q.detach(), rtol=0, atol=1e-6)
    assert opt.stage is OnebitStage.COMPRESSION
    assert len(opt.bucket_layouts()) == 1
    assert opt.bucket_layouts()[0].numel == 5 + 6


# ---------------------------------------------------------------------------------------------------- checkpoints
def _roundtrip(state_dict):
    buf = io.BytesIO()
    torch.save(state_dict, buf)
    buf.seek(0)
    return torch.load(buf, weights_only=True)


@pytest.mark.parametrize(
    "resume_at,total",
    [(3, 6), (3, 12), (6, 12), (9, 16)],
    ids=["warmup", "across-freeze", "at-freeze", "compression"],
)
def test_state_dict_round_trip_continues_identically(resume_at, total):
    freeze = 6
    net_a = Net()
    opt_a = OnebitAdam(_groups(net_a), freeze_step=freeze)
    _train(net_a, opt_a, range(resume_at))
    saved_net, saved_opt = _roundtrip(net_a.state_dict()), _roundtrip(opt_a.state_dict())
    _train(net_a, opt_a, range(resume_at, total))

    net_b = Net(seed=42)  # different init: everything must come from the checkpoint
    net_b.load_state_dict(saved_net)
    opt_b = OnebitAdam(_groups(net_b), freeze_step=freeze)
    opt_b.load_state_dict(saved_opt)
    assert opt_b.step_count == resume_at
    assert opt_b.stage is (OnebitStage.WARMUP if resume_at < freeze else OnebitStage.COMPRESSION)
    assert opt_b.needs_gradient_allreduce is (resume_at < freeze)
    _train(net_b, opt_b, range(resume_at, total))
    _assert_bitwise(_params(net_a), _params(net_b), "resumed run")
    assert opt_b.step_count == opt_a.step_count == total
    for pa, pb in zip(net_a.parameters(), net_b.parameters()):
        assert torch.equal(opt_a.state[pa]["exp_avg"], opt_b.state[pb]["exp_avg"])
        assert torch.equal(opt_a.state[pa]["exp_avg_sq"], opt_b.state[pb]["exp_avg_sq"])


def test_state_dict_contents_and_mask_comes_from_code():
    freeze = 3
    net = Net()
    opt = OnebitAdam(_groups(net), freeze_step=freeze)
    _train(net, opt, range(5))
    sd = opt.state_dict()
    assert all("exp_avg_mask" not in g for g in sd["param_groups"])
    assert sd["onebit"] == {"step": 5, "freeze_step": freeze, "optimizer": "OnebitAdam"}
    assert all("step" not in s for s in sd["state"].values())
    # the optimizer's own groups still hold their masks after state_dict()
    assert opt.param_groups[0]["exp_avg_mask"][0] is not None

    # A new optimizer with a different mask: the code's mask is used, not the (absent) checkpoint one.
    new_mask = torch.ones(HIDDEN, N_IN)
    new_mask[:, :2] = 0.0
    net_b = Net()
    net_b.load_state_dict(net.state_dict())
    groups_b = _groups(net_b)
    groups_b[0]["exp_avg_mask"] = [new_mask, None]
    opt_b = OnebitAdam(groups_b, freeze_step=freeze)
    opt_b.load_state_dict(_roundtrip(sd))
    assert opt_b.param_groups[0]["exp_avg_mask"][0] is new_mask
    assert opt_b.param_groups[1]["exp_avg_mask"] == [None, None, None]
    at_load = net_b.w1.detach().clone()
    _train(net_b, opt_b, range(5, 9))
    m = opt_b.state[net_b.w1]["exp_avg"]
    assert torch.equal(m[:, :2], torch.zeros(HIDDEN, 2))
    lr, wd = 0.03, 0.01
    expected = at_load[:, :2].clone()
    for _ in range(4):
        expected.mul_(1 - lr * wd)
    torch.testing.assert_close(net_b.w1.detach()[:, :2], expected, rtol=1e-6, atol=0)
    assert bool((net_b.w1.detach()[:, 2:-1] != at_load[:, 2:-1]).all())  # unmasked live columns move

    # A state dict from a run without masks loads into an optimizer with masks (and keeps them).
    net_c = Net()
    opt_c = OnebitAdam(_groups(net_c, mask=False), freeze_step=freeze)
    _train(net_c, opt_c, range(4))
    opt_d = OnebitAdam(_groups(Net()), freeze_step=freeze)
    opt_d.load_state_dict(opt_c.state_dict())
    assert opt_d.param_groups[0]["exp_avg_mask"][0] is not None


def test_stage_is_rederived_with_the_code_freeze_step():
    net = Net()
    opt = OnebitAdam(net.parameters(), freeze_step=3)
    _train(net, opt, range(4))
    assert opt.stage is OnebitStage.COMPRESSION
    opt_b = OnebitAdam(net.parameters(), freeze_step=10)
    opt_b.load_state_dict(copy.deepcopy(opt.state_dict()))
    assert opt_b.step_count == 4 and opt_b.freeze_step == 10
    assert opt_b.stage is OnebitStage.WARMUP and opt_b.needs_gradient_allreduce


def test_state_dict_loaded_twice_into_running_optimizer_rewinds_step():
    net = Net()
    opt = OnebitAdam(_groups(net), freeze_step=3)
    _train(net, opt, range(2))
    sd = copy.deepcopy(opt.state_dict())
    _train(net, opt, range(2, 6))
    assert opt.stage is OnebitStage.COMPRESSION
    opt.load_state_dict(sd)
    assert opt.step_count == 2 and opt.stage is OnebitStage.WARMUP


def test_load_adamw_state_dict_takes_step_from_adamw():
    k, freeze = 4, 7
    net_a, net_b = Net(), Net()
    adamw = torch.optim.AdamW(_groups(net_a, mask=False))
    adamw_ref = torch.optim.AdamW(_groups(net_b, mask=False))
    _train(net_a, adamw, range(k))
    _train(net_b, adamw_ref, range(k))

    opt = OnebitAdam(_groups(net_a), freeze_step=freeze)
    opt.load_state_dict(_roundtrip(adamw.state_dict()))
    assert opt.step_count == k
    assert opt.stage is OnebitStage.WARMUP
    assert all("step" not in s for s in opt.state.values())
    # warmup continues as AdamW would
    for s in range(k, freeze):
        for net, o in ((net_a, opt), (net_b, adamw_ref)):
            o.zero_grad()
            _backward(net, s)
            o.step()
        assert _max_diff(_params(net_a), _params(net_b)) < 1e-6, f"step {s + 1}"
    assert opt.stage is OnebitStage.COMPRESSION
    at_freeze = {n: opt.state[p]["exp_avg_sq"].clone() for n, p in net_a.named_parameters()}
    _train(net_a, opt, range(freeze, freeze + 4))
    assert opt.step_count == freeze + 4
    _assert_bitwise({n: opt.state[p]["exp_avg_sq"] for n, p in net_a.named_parameters()}, at_freeze)
    assert all(torch.isfinite(p).all() for p in net_a.parameters())


# ---------------------------------------------------------------------------------------------------- error feedback
def test_error_feedback_seam_single_process():
    """With one process nothing is compressed, so there is no error feedback: the buffers stay empty."""
    net = Net()
    opt = OnebitAdam(_groups(net), freeze_step=2)
    empty = {
        "world_size": 1,
        "topology": {"mode": "flat", "num_nodes": None, "ranks_per_node": None, "world_size": 1},
        "buckets": {},
    }
    assert opt.last_dropped_error_norm is None
    assert opt.error_feedback_state_dict() == empty
    _train(net, opt, range(6))
    assert opt.stage is OnebitStage.COMPRESSION
    assert opt.error_feedback_state_dict() == empty
    assert opt.reset_error_feedback() == 0.0
    # a checkpoint of another world size is refused, changing nothing
    with pytest.raises(ValueError, match="world size"):
        opt.load_error_feedback_state_dict({"world_size": 2, "buckets": {}})
    # loading the optimizer state resets error feedback and reports the (zero) norm dropped
    opt.load_state_dict(copy.deepcopy(opt.state_dict()))
    assert opt.last_dropped_error_norm == 0.0
    before = _params(net)
    _train(net, opt, range(6, 8))
    assert _max_diff(_params(net), before) > 0
    assert opt.error_feedback_state_dict() == empty


def test_error_feedback_round_trip_single_process():
    """Restoring this rank's own error feedback (same layout, same world size) must work, also with one rank."""
    net = Net()
    opt = OnebitAdam(_groups(net), freeze_step=2)
    _train(net, opt, range(5))
    ef = _roundtrip(opt.error_feedback_state_dict())
    net_b = Net()
    net_b.load_state_dict(net.state_dict())
    opt_b = OnebitAdam(_groups(net_b), freeze_step=2)
    opt_b.load_state_dict(_roundtrip(opt.state_dict()))
    opt_b.load_error_feedback_state_dict(ef)
    _train(net, opt, range(5, 8))
    _train(net_b, opt_b, range(5, 8))
    _assert_bitwise(_params(net), _params(net_b))


def test_error_feedback_of_a_changed_model_is_refused_with_the_reason():
    """A checkpoint of a model whose parameter has since changed shape: restoring the error feedback (which builds the
    buckets from the loaded state) gives the reason, naming the parameter and the shapes, instead of a size-mismatch
    RuntimeError from deep inside the bucket code, and changes nothing."""
    emb = nn.Embedding(6, 2)
    opt = OnebitAdam(emb.parameters(), freeze_step=1, dead_coordinates="ignore")
    for _ in range(3):
        opt.zero_grad()
        emb(torch.tensor([0, 1, 2])).sum().backward()
        opt.step()
    grown = nn.Embedding(9, 2)
    restored = OnebitAdam(grown.parameters(), freeze_step=1)
    restored.load_state_dict(_roundtrip(opt.state_dict()))
    reason = restored.error_feedback_mismatch(opt.error_feedback_state_dict())
    assert reason == ("the optimizer state 'exp_avg' of parameter 0 of param group 0 (shape (9, 2)) has shape (6, 2): "
                      "the model changed since the checkpoint"), reason
    with pytest.raises(ValueError, match=re.escape(reason)):
        restored.load_error_feedback_state_dict(opt.error_feedback_state_dict())


@pytest.mark.parametrize("when", [0, 2])
def test_bucket_layouts_or_error_feedback_load_in_warmup_do_not_change_training(when):
    """Asking for the layouts (public), or restoring an (empty) error-feedback checkpoint, during warmup must not
    change training (e.g. by freezing parameters that have no state yet)."""
    net_a, net_b, net_c = Net(), Net(), Net()
    opt_a = OnebitAdam(_groups(net_a), freeze_step=3)
    opt_b = OnebitAdam(_groups(net_b), freeze_step=3)
    opt_c = OnebitAdam(_groups(net_c), freeze_step=3)
    _train(net_a, opt_a, range(when))
    _train(net_b, opt_b, range(when))
    _train(net_c, opt_c, range(when))
    layouts = opt_b.bucket_layouts()
    assert sum(layout.numel for layout in layouts.values()) == sum(p.numel() for p in net_b.parameters())
    opt_c.load_error_feedback_state_dict(opt_c.error_feedback_state_dict())
    _train(net_a, opt_a, range(when, 8))
    _train(net_b, opt_b, range(when, 8))
    _train(net_c, opt_c, range(when, 8))
    _assert_bitwise(_params(net_a), _params(net_b), "after bucket_layouts()")
    _assert_bitwise(_params(net_a), _params(net_c), "after load_error_feedback_state_dict()")


def test_bucket_cap_splits_buckets_without_changing_single_process_result():
    net_a, net_b = Net(), Net()
    opt_a = OnebitAdam(_groups(net_a), freeze_step=3)
    opt_b = OnebitAdam(_groups(net_b), freeze_step=3, bucket_cap_mb=64 / 2**20)
    _train(net_a, opt_a, range(8))
    _train(net_b, opt_b, range(8))
    assert len(opt_a.bucket_layouts()) == 1 and len(opt_b.bucket_layouts()) == 3
    _assert_bitwise(_params(net_a), _params(net_b))


# ---------------------------------------------------------------------------------------------------- distributed
FREEZE = 5
TOTAL = 20  # 15 compressed steps
RESUME_AT = 8  # an error-feedback reset costs this toy model a transient loss bump of about 5 steps


def _snapshot(net: Net, opt: OnebitAdam) -> dict:
    return {
        "params": _params(net),
        "exp_avg": {n: opt.state[p]["exp_avg"].clone() for n, p in net.named_parameters()},
        "exp_avg_sq": {n: opt.state[p]["exp_avg_sq"].clone() for n, p in net.named_parameters()},
        "step": opt.step_count,
        "eval_loss": _eval_loss(net),
    }


def _dist_steps(rank, world_size, net, opt, steps, history, local_grads=None):
    for s in steps:
        opt.zero_grad(set_to_none=True)
        compressed = opt.stage is OnebitStage.COMPRESSION
        # rank 1 leaves `extra` without a gradient in some compressed steps
        use_extra = not (compressed and rank == 1 and s % 2 == 1)
        _backward(net, s, rank, use_extra=use_extra)
        if opt.needs_gradient_allreduce:  # what a standalone user does in warmup
            for p in net.parameters():
                dist.all_reduce(p.grad)
                p.grad.div_(world_size)
        elif local_grads is not None:
            local_grads.append(net.w2.grad.clone())
        opt.step()
        history.append(_snapshot(net, opt))


def _dist_scenario(rank: int, world_size: int, bucket_cap_mb: float) -> dict:
    torch.manual_seed(0)

    def make(mask=True, cap_update=True):
        net = Net()
        # without the mask the optimizer's own dead-coordinate masking is off too: the control below shows why both
        return net, OnebitAdam(_groups(net, mask=mask), freeze_step=FREEZE, bucket_cap_mb=bucket_cap_mb,
                               dead_coordinates="mask" if mask else "ignore", cap_update=cap_update)

    out: dict = {}
    # uninterrupted run, checkpoint at RESUME_AT
    net, opt = make()
    history, local_grads = [], []
    _dist_steps(rank, world_size, net, opt, range(FREEZE), history, local_grads)
    at_freeze = copy.deepcopy(
        {"net": net.state_dict(), "opt": opt.state_dict(), "ef": opt.error_feedback_state_dict()}
    )
    _dist_steps(rank, world_size, net, opt, range(FREEZE, RESUME_AT), history, local_grads)
    buf = io.BytesIO()
    torch.save({"net": net.state_dict(), "opt": opt.state_dict(), "ef": opt.error_feedback_state_dict()}, buf)
    _dist_steps(rank, world_size, net, opt, range(RESUME_AT, TOTAL), history, local_grads)
    out["history"] = history
    out["local_grads"] = local_grads
    out["calls"] = opt.communication.calls
    out["collectives"] = opt.communication.collectives
    out["bytes_sent"] = opt.communication.bytes_sent
    out["n_buckets"] = len(opt.bucket_layouts())
    out["ef_keys"] = sorted(opt.error_feedback_state_dict()["buckets"])
    ef_norm = opt.compression.error_feedback_norm()
    out["ef_norm"] = ef_norm
    opt.load_state_dict(copy.deepcopy(opt.state_dict()))  # drops this rank's error feedback
    out["dropped"] = opt.last_dropped_error_norm
    out["ef_after_load"] = opt.error_feedback_state_dict()["buckets"]

    # resumed from the checkpoint, error feedback reset (the default)
    for restore_ef in (False, True):
        buf.seek(0)
        ckpt = torch.load(buf, weights_only=False)
        net_r, opt_r = make()
        net_r.load_state_dict(ckpt["net"])
        opt_r.load_state_dict(ckpt["opt"])
        stage = opt_r.stage
        if restore_ef:
            bad = dict(ckpt["ef"], world_size=world_size + 1)
            try:
                opt_r.load_error_feedback_state_dict(bad)
                out["bad_ef_raised"] = False
            except ValueError:
                out["bad_ef_raised"] = True
            opt_r.load_error_feedback_state_dict(ckpt["ef"])
        resumed = []
        _dist_steps(rank, world_size, net_r, opt_r, range(RESUME_AT, TOTAL), resumed)
        out["resumed_ef" if restore_ef else "resumed"] = resumed
        out["resumed_stage"] = stage

    # resumed at the freeze boundary (error feedback saved before any compression: empty)
    net_f, opt_f = make()
    net_f.load_state_dict(at_freeze["net"])
    opt_f.load_state_dict(at_freeze["opt"])
    out["freeze_ef_buckets"] = at_freeze["ef"]["buckets"]
    out["freeze_stage"] = opt_f.stage
    opt_f.load_error_feedback_state_dict(at_freeze["ef"])
    out["resumed_at_freeze"] = []
    _dist_steps(rank, world_size, net_f, opt_f, range(FREEZE, TOTAL), out["resumed_at_freeze"])

    # without the mask, the always-zero-gradient column gets +-scale momentum and blows up (why masks exist), unless
    # the update's cap holds it to lr * B a step
    for name, cap_update in (("nomask", False), ("nomask_capped", True)):
        net_n, opt_n = make(mask=False, cap_update=cap_update)
        out[name] = []
        _dist_steps(rank, world_size, net_n, opt_n, range(FREEZE + 2), out[name])
    return out


@pytest.fixture(scope="module", params=[2, 3], ids=["2ranks", "3ranks"])
def dist_run(request):
    world_size = request.param
    # 2 ranks: one bucket; 3 ranks: a tiny bucket cap gives three buckets, one of two 1-element tensors
    cap = 25.0 if world_size == 2 else 64 / 2**20
    return world_size, run_distributed(_dist_scenario, world_size, cap)


def _state_of(snapshot):
    return {f"{k}.{n}": t for k in ("params", "exp_avg", "exp_avg_sq") for n, t in snapshot[k].items()}


def test_distributed_replicas_bitwise_identical_every_step(dist_run):
    world_size, results = dist_run
    history0 = results[0]["history"]
    assert len(history0) == TOTAL
    for r in range(1, world_size):
        for i, (a, b) in enumerate(zip(history0, results[r]["history"])):
            assert a["step"] == b["step"] == i + 1
            _assert_bitwise(_state_of(a), _state_of(b), f"rank {r} vs 0 after step {i + 1}")
    # the ranks really had different local gradients in the compression stage
    for r in range(1, world_size):
        assert all(not torch.equal(g0, g) for g0, g in zip(results[0]["local_grads"], results[r]["local_grads"]))
    assert len(results[0]["local_grads"]) == TOTAL - FREEZE


def test_distributed_compression_stage_invariants(dist_run):
    world_size, results = dist_run
    for res in results:
        history = res["history"]
        at_freeze = history[FREEZE - 1]
        assert history[FREEZE - 2]["exp_avg_sq"]["w1"].ne(at_freeze["exp_avg_sq"]["w1"]).any()
        for snap in history[FREEZE:]:
            _assert_bitwise(snap["exp_avg_sq"], at_freeze["exp_avg_sq"], f"exp_avg_sq at step {snap['step']}")
            m = snap["exp_avg"]["w1"]
            assert torch.equal(m[:, -1], torch.zeros(HIDDEN)), f"masked momentum at step {snap['step']}"
            assert all(torch.isfinite(t).all() for t in snap["params"].values())
        # the masked (dead) column moves only by weight decay: p (1 - lr wd) per step, lr 0.03, wd 0.01
        expected = at_freeze["params"]["w1"][:, -1].clone()
        for snap in history[FREEZE:]:
            expected.mul_(1 - 0.03 * 0.01)
            torch.testing.assert_close(snap["params"]["w1"][:, -1], expected, rtol=1e-6, atol=0)
        # momentum is not trivially zero elsewhere and parameters move in every compressed step
        for prev, snap in zip(history[FREEZE - 1 :], history[FREEZE:]):
            for name in ("w2", "b1", "b2", "extra"):
                assert not torch.equal(prev["params"][name], snap["params"][name]), (name, snap["step"])
        # the loss keeps falling in the compression stage
        loss_at_freeze = at_freeze["eval_loss"]
        losses = [s["eval_loss"] for s in history[FREEZE:]]
        assert losses[-1] < 0.8 * loss_at_freeze, (loss_at_freeze, losses)
        # one compressed allreduce (two collectives) per bucket per compressed step, nothing in warmup
        assert res["calls"] == res["n_buckets"] * (TOTAL - FREEZE)
        assert res["collectives"] == 2 * res["calls"]
        assert res["bytes_sent"] > 0
    assert results[0]["n_buckets"] == (1 if world_size == 2 else 3)


def test_distributed_unmasked_dead_coordinates_explode(dist_run):
    """Control for the mask test: without the mask (and with ``dead_coordinates="ignore"``) the dead column's
    momentum is nonzero after compression, and without the update's cap (``cap_update=False``, the paper's update) it
    jumps by ``lr * scale / eps``; with the cap each compressed step moves it by at most ``lr * B``."""
    _, results = dist_run
    lr, wd = 0.03, 0.01  # _groups' for w1
    for res in results:
        for name in ("nomask", "nomask_capped"):
            assert bool((res[name][-1]["exp_avg"]["w1"][:, -1] != 0).all()), name
        last = res["nomask"][-1]
        assert float((last["params"]["w1"][:, -1] - res["nomask"][FREEZE - 1]["params"]["w1"][:, -1]).abs().max()) > 1
        capped = res["nomask_capped"]
        for k in range(FREEZE, FREEZE + 2):  # records k - 1 -> k: compressed step k + 1
            before = capped[k - 1]["params"]["w1"][:, -1]
            moved = (capped[k]["params"]["w1"][:, -1] - before).abs()
            decay = lr * wd * before.abs()
            assert bool((moved > 0).all()), k
            assert bool((moved <= (lr * adam_step_bound((0.9, 0.999)) + decay) * (1 + 1e-3)).all()), k


def test_distributed_error_feedback_seam(dist_run):
    world_size, results = dist_run
    for res in results:
        assert res["ef_keys"] == list(range(res["n_buckets"]))
        assert res["ef_norm"] > 0
        assert res["dropped"] == res["ef_norm"]
        assert res["ef_after_load"] == {}
        assert res["bad_ef_raised"] is True


def test_distributed_resume_in_compression_stage(dist_run):
    world_size, results = dist_run
    for res in results:
        assert res["resumed_stage"] is OnebitStage.COMPRESSION
        assert [s["step"] for s in res["resumed"]] == list(range(RESUME_AT + 1, TOTAL + 1))
    # error feedback reset: replicas stay identical and training continues
    for r in range(1, world_size):
        for a, b in zip(results[0]["resumed"], results[r]["resumed"]):
            _assert_bitwise(_state_of(a), _state_of(b), f"resumed rank {r} vs 0 step {a['step']}")
    at_resume = results[0]["history"][RESUME_AT - 1]["eval_loss"]
    resumed_losses = [s["eval_loss"] for s in results[0]["resumed"]]
    at_freeze = results[0]["history"][FREEZE - 1]["eval_loss"]
    assert all(math.isfinite(x) for x in resumed_losses)
    info = (at_freeze, at_resume, [round(x, 3) for x in resumed_losses])
    assert resumed_losses[-1] < at_resume, info
    assert max(resumed_losses) < 0.7 * at_freeze, info
    for res in results:
        for snap in res["resumed"]:
            _assert_bitwise(snap["exp_avg_sq"], res["history"][FREEZE - 1]["exp_avg_sq"])
            assert torch.equal(snap["exp_avg"]["w1"][:, -1], torch.zeros(HIDDEN))
    # the reset changed the trajectory (so the next check is meaningful) ...
    assert any(
        not torch.equal(a["params"]["w1"], b["params"]["w1"])
        for a, b in zip(results[0]["resumed"], results[0]["history"][RESUME_AT:])
    )
    # ... and with each rank's own error feedback restored, the resumed run equals the uninterrupted one bitwise
    for res in results:
        assert len(res["resumed_ef"]) == TOTAL - RESUME_AT
        for a, b in zip(res["resumed_ef"], res["history"][RESUME_AT:]):
            _assert_bitwise(_state_of(a), _state_of(b), f"resumed with error feedback, step {a['step']}")


def test_distributed_resume_at_freeze_boundary(dist_run):
    """A checkpoint after the last warmup step: the next step is compressed, the saved error feedback is empty and
    loads as zero, and the run continues exactly as the uninterrupted one."""
    _, results = dist_run
    for res in results:
        assert res["freeze_stage"] is OnebitStage.COMPRESSION
        assert res["freeze_ef_buckets"] == {}
        assert len(res["resumed_at_freeze"]) == TOTAL - FREEZE
        for a, b in zip(res["resumed_at_freeze"], res["history"][FREEZE:]):
            assert a["step"] == b["step"]
            _assert_bitwise(_state_of(a), _state_of(b), f"resumed at the freeze boundary, step {a['step']}")


# ---------------------------------------------------------------------------------------------------- bucket plan
def test_bucket_plan_lays_out_momenta_survives_state_dict_and_rejects_bad_plans():
    """set_bucket_plan (what the overlap hook passes: DDP's buckets) decides the momentum buckets; parameters it does
    not name are packed after them; the plan is saved as parameter indices and restored by load_state_dict."""
    net = Net()
    opt = OnebitAdam(net.parameters(), freeze_step=2, dead_coordinates="ignore")
    assert opt.set_bucket_plan([[net.b2, net.w2], [net.w1]]) is True
    assert opt.set_bucket_plan([[net.b2, net.w2], [net.w1]]) is False  # the same plan: no change
    _train(net, opt, range(3))
    layouts = opt.bucket_layouts()
    assert {k: layout.tensor_numels for k, layout in layouts.items()} == {
        0: (1, HIDDEN), 1: (HIDDEN * N_IN,), 2: (HIDDEN, 1),  # b1 and extra, unnamed, packed after the plan
    }
    assert opt.state[net.w2]["exp_avg"].data_ptr() != opt.state[net.w1]["exp_avg"].data_ptr()

    saved = opt.state_dict()
    assert saved["onebit"]["bucket_plan"] == [[0, [3, 2]], [1, [0]]]  # parameter indices in parameters() order
    other = Net()
    restored = OnebitAdam(other.parameters(), freeze_step=2, dead_coordinates="ignore")
    restored.load_state_dict(saved)
    assert [[tuple(p.shape) for p in bucket] for bucket in restored.bucket_plan] == [[(1,), (1, HIDDEN)], [(HIDDEN, N_IN)]]
    assert {k: layout.tensor_numels for k, layout in restored.bucket_layouts().items()} == {
        k: layout.tensor_numels for k, layout in layouts.items()
    }
    for p, q in zip(net.parameters(), other.parameters()):
        assert torch.equal(opt.state[p]["exp_avg"], restored.state[q]["exp_avg"])

    # changing the plan mid-stage moves the momenta (values kept) and carries the error feedback over (one rank here:
    # none; tests/strategy/test_resume_in_another_setup.py checks the carry on 2 and 4 ranks)
    momenta = {id(p): opt.state[p]["exp_avg"].clone() for p in net.parameters()}
    assert opt.set_bucket_plan(None) is True
    assert len(opt.bucket_layouts()) == 1
    for p in net.parameters():
        assert torch.equal(opt.state[p]["exp_avg"], momenta[id(p)])

    with pytest.raises(ValueError, match="names a parameter that an earlier bucket holds"):
        opt.set_bucket_plan([[net.w1], [net.w1, net.b1]])
    mixed = Net()
    mixed.b1.data = mixed.b1.data.double()
    opt_mixed = OnebitAdam(mixed.parameters(), freeze_step=2)
    with pytest.raises(ValueError, match="mixes devices or dtypes"):
        opt_mixed.set_bucket_plan([[mixed.w1, mixed.b1]])
    # a plan that no longer fits the model (a checkpoint of another model) is ignored, not an error
    saved["onebit"]["bucket_plan"] = [[0, [99]]]
    fresh = OnebitAdam(Net().parameters(), freeze_step=2)
    fresh.load_state_dict(saved)
    assert fresh.bucket_plan is None


def test_start_bucket_exchange_refuses_during_warmup_and_before_the_buckets_exist():
    net = Net()
    opt = OnebitAdam(net.parameters(), freeze_step=1, dead_coordinates="ignore")
    params = list(net.parameters())
    opt.set_bucket_plan([params])
    _backward(net, 0)
    grads = [p.grad for p in params]
    assert opt.start_bucket_exchange_(0, params, grads) is False  # warmup
    opt.step()
    opt.zero_grad()
    _backward(net, 1)
    assert opt.start_bucket_exchange_(0, params, [p.grad for p in params]) is False  # buckets built at this step
    opt.step()
    opt.zero_grad()
    _backward(net, 2)
    assert opt.start_bucket_exchange_(0, params[::-1], [p.grad for p in params[::-1]]) is False  # not bucket 0
    assert opt.start_bucket_exchange_(0, params, [p.grad for p in params]) is True
    assert opt.exchanges_in_flight == 1
    with pytest.raises(RuntimeError, match="ready twice before optimizer.step"):
        opt.start_bucket_exchange_(0, params, [p.grad for p in params])
    opt.step()
    assert opt.exchanges_in_flight == 0


# ---------------------------------------------------------------------------------------------------- frozen variance
class _OpCounter:
    """Counts the aten ops whose name contains ``word`` (e.g. every ``sqrt``: plain, ``out=`` and ``_foreach``)."""

    def __init__(self, word: str) -> None:
        from torch.utils._python_dispatch import TorchDispatchMode

        counter = self

        class Mode(TorchDispatchMode):
            def __torch_dispatch__(self, func, types, args=(), kwargs=None):
                if word in func.__name__:
                    counter.count += 1
                return func(*args, **(kwargs or {}))

        self.count, self.mode = 0, Mode()

    def __enter__(self) -> "_OpCounter":
        self.mode.__enter__()
        return self

    def __exit__(self, *exc) -> None:
        self.mode.__exit__(*exc)


class _SqrtCounter(_OpCounter):
    """Counts square-root passes: torch's ``sqrt`` ops and the library's correctly rounded ones
    (``kernels.torch_kernels.sqrt_into``, which takes numpy's on CPU, unseen by the dispatcher)."""

    def __init__(self) -> None:
        super().__init__("sqrt")
        from lightning_onebit.kernels import torch_kernels

        self._module, self._original = torch_kernels, torch_kernels.sqrt_into

    def __enter__(self) -> "_SqrtCounter":
        original = self._original

        def counted(x: torch.Tensor, out: torch.Tensor) -> torch.Tensor:
            if x.device.type == "cpu":  # the numpy path (the torch path is counted by the dispatch mode)
                self.count += 1
            return original(x, out)

        self._module.sqrt_into = counted
        super().__enter__()
        return self

    def __exit__(self, *exc) -> None:
        super().__exit__(*exc)
        self._module.sqrt_into = self._original


def test_frozen_adam_denominator_is_cached_with_the_same_bits_and_recomputed_when_v_eps_or_bc2_change():
    from lightning_onebit import kernels

    g = torch.Generator().manual_seed(0)
    shapes = [(7, 5), (3,), (64,)]
    ms = [torch.randn(s, generator=g) for s in shapes]
    vs = [torch.rand(s, generator=g) for s in shapes]
    cached = [torch.randn(s, generator=g) for s in shapes]
    fresh = [p.clone() for p in cached]

    def both(bc2_sqrt: float, eps: float) -> int:
        with _SqrtCounter() as sqrts:
            kernels.frozen_adam_update_(cached, ms, vs, 0.999, bc2_sqrt, eps, -1e-2, backend="torch", frozen=True)
        kernels.frozen_adam_update_(fresh, ms, vs, 0.999, bc2_sqrt, eps, -1e-2, backend="torch")
        for a, b in zip(cached, fresh):
            assert torch.equal(a, b)
        return sqrts.count

    assert both(0.3, 1e-8) == len(shapes)  # computed once per tensor
    assert both(0.3, 1e-8) == 0 and both(0.3, 1e-8) == 0  # then reused: no sqrt, two passes per tensor
    vs[1].mul_(1.5)  # a variance step (in place: its version counter changes)
    assert both(0.3, 1e-8) == 1
    assert both(0.3, 1e-6) == len(shapes)  # another eps
    assert both(0.5, 1e-6) == len(shapes)  # another bias correction
    vs[0] = vs[0].clone()  # a new tensor (load_state_dict)
    assert both(0.5, 1e-6) == 1


def test_compressed_step_reuses_the_frozen_denominator_and_reads_nothing_on_the_host():
    """1-bit Adam's compression stage on the torch kernels: after the first compressed step no sqrt (the frozen
    variance's denominator is cached) and no host synchronisation; the bits are those of the update that recomputes
    the denominator every step."""
    from lightning_onebit import kernels
    from tests.detectors import count_host_syncs

    net_a, net_b = Net(), Net()
    opt_a = OnebitAdam(_groups(net_a), freeze_step=3, kernel_backend="torch", dead_coordinates="ignore")
    opt_b = OnebitAdam(_groups(net_b), freeze_step=3, kernel_backend="torch", dead_coordinates="ignore")
    original = kernels.frozen_adam_update_

    def uncached(*args, **kwargs):
        kwargs["frozen"] = False
        return original(*args, **kwargs)

    for s in range(10):
        for net in (net_a, net_b):
            net.zero_grad(set_to_none=True)
            _backward(net, s)
        with count_host_syncs() as syncs, _SqrtCounter() as sqrts:
            opt_a.step()
        kernels.frozen_adam_update_ = uncached
        try:
            opt_b.step()
        finally:
            kernels.frozen_adam_update_ = original
        _assert_bitwise(_params(net_a), _params(net_b), f"step {s + 1}")
        if s + 1 > 4:  # steady compressed steps (the first one computes the denominators)
            assert sqrts.count == 0, f"step {s + 1}: the frozen denominator was recomputed"
            assert syncs.count == 0, f"step {s + 1}: {syncs.summary()}"
    assert opt_a.stage == "compression"
